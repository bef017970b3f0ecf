"""What a running job sees: its id, name, attempt, tries, queue, signal and log, and what it can do:
``once``, ``step``, ``release`` and ``discard``."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..core.context import AbortSignal, call_sync_or_async
from ..core.envelope import MAX_DELAY_SECONDS
from ..core.lifecycle import is_final_attempt

if TYPE_CHECKING:
    from .status import JobStatus


@dataclass(frozen=True, slots=True)
class JobRelease:
    """Returned by a job (``return job.release(60)``): the attempt ends and the job comes back after
    ``delay_seconds``. The attempt counts, so a job that releases itself needs tries."""

    delay_seconds: float = 0.0
    reason: str = "release"


@dataclass(frozen=True, slots=True)
class JobDiscard:
    """Returned by a job (``return job.discard("the account no longer exists")``): the job ends now,
    neither retried nor failed."""

    reason: str


class StepStore(Protocol):
    """Where :meth:`JobContext.step` keeps the results of durable steps."""

    async def get(self, job_id: uuid.UUID, name: str) -> tuple[bool, Any]: ...
    async def put(self, job_id: uuid.UUID, name: str, value: Any) -> Any:
        """Stores ``value`` and returns it as a later attempt will read it."""
        ...


class OnceRunner(Protocol):
    """``WorkContext.once`` of the attempt's delivery (it takes plain and coroutine functions)."""

    async def __call__(self, key: str, fn: Callable[[], Any], *, ttl_seconds: float = 86400) -> bool: ...


class JobContext:
    """A job's attempt: ``id`` (the same over every attempt, retry and replay: an idempotency key),
    ``name``, ``attempt`` (from 1), ``tries``, ``queue``, ``signal`` and ``log``; for the ``then`` job
    of a group, ``group_id`` and ``group_results``."""

    __slots__ = ("_log", "_make_log", "_once", "_steps", "attempt", "group_id", "group_results", "id", "name", "queue",
                 "signal", "tries")

    def __init__(  # (the runner passes them by position: once per attempt, at a third of the cost)
        self,
        id: uuid.UUID,
        name: str,
        attempt: int,
        tries: int,
        queue: str,
        signal: AbortSignal,
        log: logging.LoggerAdapter[logging.Logger] | Callable[[], logging.LoggerAdapter[logging.Logger]],
        once: OnceRunner,
        steps: StepStore,
    ) -> None:
        self.id = id
        self.name = name
        self.attempt = attempt
        self.tries = tries
        self.queue = queue
        self.signal = signal
        if isinstance(log, logging.LoggerAdapter):
            self._log: logging.LoggerAdapter[logging.Logger] | None = log
            self._make_log: Callable[[], logging.LoggerAdapter[logging.Logger]] | None = None
        else:
            self._log, self._make_log = None, log
        self._once = once
        self._steps = steps
        self.group_id: uuid.UUID | None = None
        """The ``then`` job of a group: the group's id (None for any other job)."""
        self.group_results: list[JobStatus] | None = None
        """The ``then`` job of a group: each member's :class:`~fastapi_workqueue.jobs.JobStatus`
        (state, error, result ...), in the order the members were given; None for any other job."""

    def __repr__(self) -> str:
        return (f"JobContext(name={self.name!r}, id={self.id}, attempt={self.attempt}/{self.tries}, "
                f"queue={self.queue!r})")

    @property
    def log(self) -> logging.LoggerAdapter[logging.Logger]:
        """The jobs logger with the job's name, id, queue and attempt on every record."""
        if self._log is None:
            assert self._make_log is not None
            self._log = self._make_log()
        return self._log

    @property
    def is_final_attempt(self) -> bool:
        """True when a failure of this attempt fails the job for good."""
        return is_final_attempt(self.attempt, self.tries)

    async def once(self, key: str, fn: Callable[[], Any], ttl_seconds: float = 86400) -> bool:
        """Runs ``fn`` (a plain or a coroutine function) unless it already succeeded for ``key`` (a
        marker kept ``ttl_seconds``, a day by default). Returns True when ``fn`` ran now, False when
        it had run before.

        While another attempt runs ``fn`` for ``key``, this attempt goes back to the queue for five
        seconds without using a try. A worker that dies between ``fn`` and the marker runs ``fn``
        again: put an id into the key and keep ``fn`` safe to repeat where you can.
        """
        return await self._once(key, fn, ttl_seconds=ttl_seconds)

    async def step(self, name: str, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` (a plain or a coroutine function) once for this job and step name and stores
        its result as JSON; a later attempt (after a crash, a retry or a replay) returns the stored
        result without running ``fn``. Every attempt gets the value as JSON gives it back (a tuple
        comes back as a list, a pydantic model as a dict), the first one included.

        A crash after ``fn`` and before the result is stored runs ``fn`` again, as with ``once``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError("a step needs a name, e.g. job.step('charge-card', charge)")
        found, value = await self._steps.get(self.id, name)
        if found:
            return value
        return await self._steps.put(self.id, name, await call_sync_or_async(fn))

    def release(self, delay_seconds: float = 0.0) -> JobRelease:
        """Ends this attempt; the job comes back after ``delay_seconds``. ``return job.release(30)``."""
        if not 0 <= delay_seconds <= MAX_DELAY_SECONDS:
            raise ValueError(f"delay_seconds must be between 0 and 100 years, got {delay_seconds!r}")
        return JobRelease(float(delay_seconds))

    def discard(self, reason: str) -> JobDiscard:
        """Ends the job for good, neither retried nor failed. ``return job.discard("why")``."""
        return JobDiscard(reason)
