"""The jobs' watchdog: a thread that notices an attempt still running long after its timeout.

A job's timeout is enforced on the event loop: its signal aborts and its task is cancelled. A
job that swallows the cancellation, or blocks the loop (``time.sleep``, a CPU-bound loop, a
blocking driver call), escapes that, and a check scheduled on the same loop would never run. The
watchdog lives outside the loop, in a daemon thread of its own: each attempt with a timeout is
watched until it ends, and when one is still running ``stop_timeout`` seconds after its timeout,
the watchdog calls the jobs layer's ``stuck`` policy from its thread. ``workqueue work`` logs and
ends the process with exit code 70 there; an app's own host logs a critical error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.redaction import redacting_logger

log = redacting_logger("fastapi_workqueue.jobs")

THREAD_NAME = "workqueue-job-watchdog"


@dataclass(slots=True, eq=False)
class Overrun:
    """One watched attempt: the job, its context, its timeout and the stop timeout after it."""

    job: Any
    context: Any
    timeout: float
    stop_timeout: float
    deadline: float = field(default=0.0)
    """When the attempt is overdue, on the watchdog's clock."""


class Watch:
    """The handle of one watched attempt: :meth:`end` when the attempt ended."""

    __slots__ = ("_dog", "overrun")

    def __init__(self, dog: Watchdog, overrun: Overrun) -> None:
        self._dog = dog
        self.overrun = overrun

    def end(self) -> None:
        self._dog._forget(self.overrun)


class Watchdog:
    """Calls ``on_overrun(overrun)`` from its own thread for each watched attempt still running at
    its deadline (timeout plus stop timeout after its start). The thread starts with the first
    watch and sleeps while nothing is watched."""

    def __init__(self, on_overrun: Callable[[Overrun], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._on_overrun = on_overrun
        self._clock = clock
        self._watched: set[Overrun] = set()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, job: Any, context: Any, timeout: float, stop_timeout: float) -> Watch:
        """Watches an attempt that starts now with ``timeout`` seconds and ``stop_timeout`` after them."""
        overrun = Overrun(job, context, timeout, stop_timeout, self._clock() + timeout + stop_timeout)
        with self._changed:
            self._watched.add(overrun)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()
            self._changed.notify()
        return Watch(self, overrun)

    @property
    def watching(self) -> int:
        """How many attempts are watched now."""
        with self._changed:
            return len(self._watched)

    def _forget(self, overrun: Overrun) -> None:
        with self._changed:
            self._watched.discard(overrun)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._watched:
                    self._changed.wait()
                now = self._clock()
                overdue = [o for o in self._watched if o.deadline <= now]
                if not overdue:
                    self._changed.wait(min(o.deadline for o in self._watched) - now)
                    continue
                self._watched.difference_update(overdue)
            for overrun in overdue:
                try:
                    self._on_overrun(overrun)
                except Exception:  # (the thread must go on watching the others)
                    log.exception("the policy for job %s that ran past its timeout failed", overrun.job.name)
