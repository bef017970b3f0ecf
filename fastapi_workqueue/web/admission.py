"""A first-come, first-served gate in front of the request sessions' connection pool.

SQLAlchemy's asyncio pool hands a returned connection to whoever asks next: a request that
arrives just then takes it before the request that has waited longest runs, and that one goes
back to the end of the line. Under load a few requests wait many turns (seconds, at 50 clients on
two cores) while the rest pass. The gate admits requests in the order they came, one freed slot
to the longest waiter, so a request's wait is bounded by the ones ahead of it.

The order is ``asyncio.Semaphore``'s: since Python 3.11 it admits its waiters first in, first out
and a newcomer never passes a waiter (``acquire`` waits while anyone does), and a place handed to
a waiter that is cancelled as it wakes goes on to the next one. It replaced a hand-written gate
that did the same; tests/test_admission.py checks those promises on the standard library's
semaphore. This class adds what the semaphore does not say: a wait with a deadline that answers
False instead of raising, and the counts of holders and waiters (kept here, not read from the
semaphore's private fields).
"""

from __future__ import annotations

import asyncio


class FairGate:
    """At most ``limit`` holders at once; a freed place goes to the longest waiter, never to a newcomer."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.held = 0
        self.waiting = 0
        """Callers waiting for a place now."""
        self._places = asyncio.Semaphore(limit)

    async def acquire(self, wait_seconds: float) -> bool:
        """Takes a place, waiting up to ``wait_seconds`` behind earlier callers; False when none
        came in time (nothing is held then)."""
        places = self._places
        if not places.locked():  # a free place and nobody waiting: no await, no timer
            await places.acquire()
            self.held += 1
            return True
        self.waiting += 1
        try:
            async with asyncio.timeout(wait_seconds):
                await places.acquire()
        except TimeoutError:
            return False  # (the semaphore passed on a place that came as the time ran out)
        finally:
            self.waiting -= 1
        self.held += 1
        return True

    def release(self) -> None:
        """Gives a place back: to the longest waiter when there is one, else to the free places."""
        self.held -= 1
        self._places.release()
