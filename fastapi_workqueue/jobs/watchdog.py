"""The jobs' watchdog: a thread that notices an attempt still running long after its timeout.

A job's timeout is enforced on the event loop: its signal aborts and its task is cancelled. A
job that swallows the cancellation, or blocks the loop (``time.sleep``, a CPU-bound loop, a
blocking driver call), escapes that, and a check scheduled on the same loop would never run. The
watchdog lives outside the loop, in a daemon thread of its own: each attempt with a timeout is
watched until it ends, and when one is still running ``stop_timeout`` seconds after its timeout,
the watchdog calls the jobs layer's ``stuck`` policy from its thread. ``workqueue work`` logs and
ends the process with exit code 70 there; an app's own host logs a critical error.

Before it blames the job, the watchdog asks the loop: it schedules a callback from its thread and
waits for it a moment. When the loop does not answer and the task it is running is not the job's,
other code blocks the loop (another job, a handler), and the job's cancellation has not had its
turn yet: the watchdog warns once, naming where the loop is held, and gives the job the stop
timeout again, and again while the loop stays held (or answers late), for as long as the job's
timeout and stop timeout once more and at least 30 s. It blames the job when the job's own task
holds the blocked loop, when the loop answers promptly and the job still runs (it swallowed the
cancellation), or when the loop stayed held past that second window (it may be a task the job
started; and the process's heartbeats have lapsed by then too).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import sysconfig
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
    loop: asyncio.AbstractEventLoop | None = None
    task: asyncio.Task[Any] | None = None
    """The loop and the task the attempt runs on (None outside a loop)."""
    thread_id: int = 0
    held_up: bool = False
    """Its last deadline found the loop blocked by other code (or found it answering late)."""
    held_since: float | None = None
    """When a deadline first found the loop held by other code."""
    ended: bool = False


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
        self.held_floor = HELD_FLOOR_SECONDS
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, job: Any, context: Any, timeout: float, stop_timeout: float) -> Watch:
        """Watches an attempt that starts now with ``timeout`` seconds and ``stop_timeout`` after them."""
        overrun = Overrun(job, context, timeout, stop_timeout, self._clock() + timeout + stop_timeout)
        with contextlib.suppress(RuntimeError):  # (not on a loop: nothing to ask, the deadline alone decides)
            overrun.loop, overrun.task = asyncio.get_running_loop(), asyncio.current_task()
        overrun.thread_id = threading.get_ident()
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
            overrun.ended = True
            self._watched.discard(overrun)

    def _again(self, overrun: Overrun) -> None:
        """Watches ``overrun`` for another stop timeout."""
        with self._changed:
            if not overrun.ended:
                overrun.deadline = self._clock() + max(overrun.stop_timeout, PROBE_SECONDS)
                self._watched.add(overrun)

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
                    if self._to_blame(overrun):
                        self._on_overrun(overrun)
                except Exception:  # (the thread must go on watching the others)
                    log.exception("the policy for job %s that ran past its timeout failed", overrun.job.name)

    def _to_blame(self, overrun: Overrun) -> bool:
        """Whether the overdue attempt itself keeps running (see the module's docstring); when other
        code holds the loop, it is watched for another stop timeout instead."""
        loop = overrun.loop
        if loop is None:
            return True
        answered = threading.Event()
        try:
            loop.call_soon_threadsafe(answered.set)
        except RuntimeError:  # (the loop is closed: the attempt is no longer running)
            return False
        asked = self._clock()
        if answered.wait(max(min(PROBE_SECONDS, overrun.stop_timeout), PROMPT_SECONDS * 2)):
            late = self._clock() - asked > PROMPT_SECONDS
            if overrun.ended:
                return False
            if (overrun.held_up or late) and not self._held_too_long(overrun):
                # The loop runs again only now: the job's cancellation has had its turn only now
                # (the answer, queued while the loop was held, may even have run before it).
                overrun.held_up = False
                self._again(overrun)
                return False
            return True
        running = _running_task(loop)
        if overrun.ended:
            return False
        if running is not None and running is overrun.task:
            return True
        if overrun.held_since is None:
            overrun.held_since = self._clock()
            log.warning(
                "job %s (%s) is past its timeout of %g s, but the event loop is blocked by other code (%s) and has "
                "not run its cancellation; it gets %g s more once the loop runs. Code that blocks the loop holds "
                "up every job and request of this process: await the blocking call in a thread "
                "(asyncio.to_thread)", overrun.job.name, overrun.context.id, overrun.timeout,
                _where(overrun.thread_id, running), overrun.stop_timeout,
            )
        elif self._held_too_long(overrun):
            # Held that long, it may be the job's own code after all (a task the job started is
            # another task), and the process's leases lapse: the job is blamed as when its own
            # task holds the loop.
            return True
        overrun.held_up = True
        self._again(overrun)
        return False

    def _held_too_long(self, overrun: Overrun) -> bool:
        """Whether the loop was first found held (or late) more than the job's timeout and stop
        timeout, and at least :attr:`held_floor` seconds, ago (so that no job is waited for forever)."""
        now = self._clock()
        if overrun.held_since is None:
            overrun.held_since = now
            return False
        return now - overrun.held_since > max(overrun.timeout + overrun.stop_timeout, self.held_floor)

PROBE_SECONDS = 0.2
"""How long the watchdog waits for the loop to run a callback before it takes the loop as blocked."""
PROMPT_SECONDS = 0.05
"""An answer later than this came from a loop that was held until just now."""
HELD_FLOOR_SECONDS = 30.0
"""The least time a job past its timeout is waited for while other code holds the loop (a third of
the default job lease: past it the process's heartbeats have lapsed too)."""

_PATHS = sysconfig.get_paths()
_LIBRARY = (*{_PATHS["stdlib"], _PATHS["platstdlib"]}, os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "<")
"""The standard library, this package and frozen modules: never where the application blocks."""
_INSTALLED = (*_LIBRARY, *{_PATHS["purelib"], _PATHS["platlib"]})


def _running_task(loop: asyncio.AbstractEventLoop) -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task(loop)
    except RuntimeError:  # pragma: no cover - a closed loop
        return None


def _where(thread_id: int, task: asyncio.Task[Any] | None) -> str:
    """Where the loop's thread is now: the task's name and the innermost frame of the application's
    code (outside the standard library, installed packages and this package; failing that, the
    innermost outside the first two)."""
    stack = []
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    for skipped in (_INSTALLED, _LIBRARY):
        for frame in stack:
            code = frame.f_code
            if not code.co_filename.startswith(skipped):
                return f"{_named(task)}, at {code.co_filename}:{frame.f_lineno} in {code.co_name}"
    return _named(task)


def _named(task: asyncio.Task[Any] | None) -> str:
    return "a callback of the loop" if task is None else f"task {task.get_name()!r}"
