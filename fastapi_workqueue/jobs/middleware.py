"""Middleware around each attempt of a job, and :func:`without_overlapping`.

A middleware is ``async def mw(attempt, call_next)``: it may call ``await call_next()`` (which runs
the next middleware, then the job, and returns what the job returned), or end the attempt on its
own by returning ``attempt.job.release(...)`` or ``attempt.job.discard(...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.redaction import redacting_logger
from ..core.tasks import TaskScope
from .context import JobContext, JobRelease

if TYPE_CHECKING:
    from .definition import Job

log = redacting_logger("fastapi_workqueue.jobs")

CallNext = Callable[[], Awaitable[Any]]
Middleware = Callable[["JobAttempt", CallNext], Awaitable[Any]]
MAX_RENEW_INTERVAL = 30.0
"""A held lock is renewed every third of its expiry, at most this many seconds apart (as a lease)."""


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
    """Locks with an expiry, shared by every worker (the queue's once markers), renewed by their
    holder while it runs, as a lease is renewed by heartbeats."""

    def __init__(self, begin: Callable[[str, float], Awaitable[tuple[str, str | None]]],
                 end: Callable[[str, str], Awaitable[bool]],
                 renew: Callable[[str, str, float], Awaitable[bool]]) -> None:
        self._begin = begin
        self._end = end
        self._renew = renew

    async def acquire(self, key: str, seconds: float) -> str | None:
        """A token when ``key`` was free (held now for at most ``seconds``), None when it is taken."""
        state, token = await self._begin(key, seconds)
        return token if state == "Run" and token is not None else None

    async def state(self, key: str) -> str:
        """Where ``key`` stands, without keeping it: ``Done`` (a once marker), ``Busy`` (held) or
        ``Free`` (it was, for the moment it took to look)."""
        state, token = await self._begin(key, 60.0)
        if state == "Run" and token is not None:
            await self._end(key, token)
            return "Free"
        return "Done" if state == "Done" else "Busy"

    async def renew(self, key: str, token: str, seconds: float) -> bool:
        """Holds ``key`` for ``seconds`` from now; False when ``token`` no longer holds it."""
        return await self._renew(key, token, seconds)

    async def keep(self, key: str, token: str, seconds: float) -> None:
        """Renews ``key`` every third of ``seconds`` until cancelled (the holder's attempt ended). A
        renewal the store could not answer is tried again at the next one; a lock found lost (its
        holder could not renew it within ``seconds``: a blocked event loop, a long outage) is logged
        and no longer renewed."""
        interval = min(seconds / 3, MAX_RENEW_INTERVAL)
        while True:
            await asyncio.sleep(interval)
            try:
                held = await self.renew(key, token, seconds)
            except Exception as exc:
                log.warning("renewing the overlap lock %r failed (%s); trying again in %.1f s", key, exc, interval)
                continue
            if not held:
                log.error("the overlap lock %r ran out before its attempt ended (not renewed within %g s): another "
                          "attempt with the key may run now", key, seconds)
                return

    async def release(self, key: str, token: str) -> None:
        """Frees ``key``, also while the attempt is being cancelled."""
        await asyncio.shield(self._end(key, token))


@contextlib.asynccontextmanager
async def _kept(locks: Locks, key: str, token: str, seconds: float) -> Any:
    """Keeps ``key`` renewed while the block runs, and frees it when the block ends."""
    renewal = TaskScope(f"workqueue-overlap-lock:{key}")
    renewal.spawn(locks.keep(key, token, seconds), name=f"workqueue-overlap-lock:{key}")
    try:
        yield
    finally:
        renewal.cancel()
        try:
            await locks.release(key, token)
        finally:
            await renewal.close()


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
    unless ``shared=True``. The holder renews the lock while its attempt runs (every third of
    ``expires_after``) and frees it when the attempt ends; a lock that is not renewed expires
    after ``expires_after`` seconds, by default the job lease, so a worker that died does not hold
    it for ever.
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
        seconds = expires_after or attempt.lease_seconds
        token = await attempt.locks.acquire(lock, seconds)
        if token is None:
            return JobRelease(float(release_after), reason="overlap")
        async with _kept(attempt.locks, lock, token, seconds):
            return await call_next()

    middleware.__name__ = f"without_overlapping({key!r})"
    return middleware
