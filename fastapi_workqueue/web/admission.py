"""A first-come, first-served gate in front of the request sessions' connection pool.

SQLAlchemy's asyncio pool hands a returned connection to whoever asks next: a request that
arrives just then takes it before the request that has waited longest runs, and that one goes
back to the end of the line. Under load a few requests wait many turns (seconds, at 50 clients on
two cores) while the rest pass. The gate admits requests in the order they came, one freed slot
to the longest waiter, so a request's wait is bounded by the ones ahead of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class FairGate:
    """At most ``limit`` holders at once; a freed place goes to the longest waiter, never to a newcomer."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.held = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """Callers waiting for a place now."""
        return sum(1 for waiter in self._waiters if not waiter.done())

    async def acquire(self, wait_seconds: float) -> bool:
        """Takes a place, waiting up to ``wait_seconds`` behind earlier callers; False when none
        came in time (nothing is held then)."""
        if self.held < self.limit and not self._waiters:
            self.held += 1
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(wait_seconds):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the place came as the time ran out: pass it on
            return False
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
        return True

    def release(self) -> None:
        """Gives a place back: to the longest waiter when there is one (the count of holders
        stays), else to the pool of free places."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.held -= 1
