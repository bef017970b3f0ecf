"""Job events and their listeners.

Every step of a job is an event: :class:`JobProcessing` before an attempt, then one of
:class:`JobProcessed`, :class:`JobReleased` (it comes back; ``reason`` says why),
:class:`JobFailed` (for good) or :class:`JobDiscarded`. All of them subclass :class:`JobEvent`, so
``queue.listen(JobEvent, fn)`` hears every one. A listener runs where the event happens (in the
worker, or in the process that dispatched), sync or async; its error is logged and changes nothing
about the job.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from ..core.redaction import redacting_logger

log = redacting_logger("fastapi_workqueue.jobs")

ReleaseReason = Literal["error", "timeout", "overlap", "once-busy", "release", "shutdown", "unknown-job", "lease-lost"]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobEvent:
    """What every job event carries."""

    job: str
    """The job's name."""
    job_id: uuid.UUID
    """The job's id (its MessageID: the same over every attempt, retry and replay)."""
    queue: str
    attempt: int
    tries: int

    @property
    def id(self) -> uuid.UUID:
        """The job's id, as ``JobContext.id`` names it."""
        return self.job_id

    @property
    def name(self) -> str:
        """The job's name, as ``JobContext.name`` names it."""
        return self.job


@dataclass(frozen=True, slots=True, kw_only=True)
class JobProcessing(JobEvent):
    """An attempt starts."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobProcessed(JobEvent):
    """The job succeeded."""

    seconds: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class JobReleased(JobEvent):
    """The attempt ended and the job comes back (after ``delay_seconds`` when known)."""

    reason: ReleaseReason
    delay_seconds: float | None = None
    error: BaseException | None = field(default=None, compare=False)
    """The exception that ended the attempt (``reason="error"`` or ``"timeout"``)."""

    @property
    def exception(self) -> BaseException | None:
        """The same as :attr:`error`."""
        return self.error


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFailed(JobEvent):
    """The job failed for good: its tries are spent, or it can never succeed."""

    error: BaseException | None = field(default=None, compare=False)
    """The exception that failed the job (None when it was released on its last try)."""
    reason: str = ""
    chain_ended: bool = False
    """True when jobs were chained after this one: they will not run."""

    @property
    def exception(self) -> BaseException | None:
        """The same as :attr:`error`."""
        return self.error


@dataclass(frozen=True, slots=True, kw_only=True)
class JobDiscarded(JobEvent):
    """The job discarded itself (``return job.discard(reason)``)."""

    reason: str
    chain_ended: bool = False


E = TypeVar("E", bound=JobEvent)
Listener = Callable[[Any], Awaitable[None] | None]


class JobEvents:
    """The listeners of one queue, by event class (a listener of a base class hears its subclasses)."""

    def __init__(self) -> None:
        self._listeners: list[tuple[type[JobEvent], Listener]] = []

    def listen(self, event: type[E], listener: Callable[[E], Awaitable[None] | None]) -> None:
        if not (isinstance(event, type) and issubclass(event, JobEvent)):
            raise TypeError(f"listen() takes a JobEvent class such as JobFailed, not {event!r}")
        if not callable(listener):
            raise TypeError(f"listener {listener!r} is not callable")
        self._listeners.append((event, listener))

    def __bool__(self) -> bool:
        return bool(self._listeners)

    async def emit(self, event: JobEvent) -> None:
        """Calls every listener of ``event``'s class; a listener's error is logged, never raised."""
        for kind, listener in self._listeners:
            if not isinstance(event, kind):
                continue
            try:
                result = listener(event)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("a listener of %s for job %s (%s) failed", type(event).__name__, event.job, event.job_id)
