"""Middleware around each attempt of a job, and :func:`without_overlapping`.

A middleware is ``async def mw(attempt, call_next)``: it may call ``await call_next()`` (which runs
the next middleware, then the job, and returns what the job returned), or end the attempt on its
own by returning ``attempt.job.release(...)`` or ``attempt.job.discard(...)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .context import JobContext, JobRelease

if TYPE_CHECKING:
    from .definition import Job

CallNext = Callable[[], Awaitable[Any]]
Middleware = Callable[["JobAttempt", CallNext], Awaitable[Any]]


@dataclass(slots=True)
class JobAttempt:
    """What a middleware sees of one attempt."""

    job: JobContext
    payload: Any
    definition: Job
    timeout: float | None
    lease_seconds: float
    locks: Locks


class Locks:
    """Locks with an expiry, shared by every worker (the queue's once markers)."""

    def __init__(self, begin: Callable[[str, float], Awaitable[tuple[str, str | None]]],
                 end: Callable[[str, str], Awaitable[bool]]) -> None:
        self._begin = begin
        self._end = end

    async def acquire(self, key: str, seconds: float) -> str | None:
        """A token when ``key`` was free (held now for at most ``seconds``), None when it is taken."""
        state, token = await self._begin(key, seconds)
        return token if state == "Run" and token is not None else None

    async def release(self, key: str, token: str) -> None:
        """Frees ``key``, also while the attempt is being cancelled."""
        await asyncio.shield(self._end(key, token))


def without_overlapping(
    key_or_fn: str | Callable[[Any], str],
    release_after: float = 5,
    expires_after: float | None = None,
    shared: bool = False,
) -> Middleware:
    """Lets no two attempts with the key ``key_or_fn`` run at once, on any worker.

    An attempt that finds the key taken does not run: it goes back to the queue for
    ``release_after`` seconds, and that counts as an attempt (so the job needs tries). The key may
    be a function of the payload (``lambda p: f"stats:{p.user_id}"``). The key belongs to the job
    unless ``shared=True``. The lock expires after ``expires_after`` seconds, by default the
    queue's lease, so a worker that died does not hold it for ever.
    """
    key = key_or_fn
    if not (isinstance(key, str) and key) and not callable(key):
        raise TypeError(
            f"without_overlapping takes a key (a non-empty string) or a function of the payload, not {key!r}"
        )
    if release_after < 0:
        raise ValueError(f"release_after must be 0 or more seconds, got {release_after!r}")
    if expires_after is not None and expires_after <= 0:
        raise ValueError(f"expires_after must be above 0 seconds, got {expires_after!r}")

    async def middleware(attempt: JobAttempt, call_next: CallNext) -> Any:
        name = key(attempt.payload) if callable(key) else key
        lock = f"overlap:{name}" if shared else f"overlap:{attempt.definition.name}:{name}"
        token = await attempt.locks.acquire(lock, expires_after or attempt.lease_seconds)
        if token is None:
            return JobRelease(float(release_after), reason="overlap")
        try:
            return await call_next()
        finally:
            await attempt.locks.release(lock, token)

    middleware.__name__ = f"without_overlapping({key!r})"
    return middleware
