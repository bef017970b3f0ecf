"""The runtime's own count of a lease: never later than the store's, and never started too late.

The store starts a lease inside the claim's transaction, after the request left this process,
and renews it inside the heartbeat's. Counting the local lease from the moment the request was
*sent* therefore ends it no later than the store does, whatever happened in between: a slow
round trip, a garbage-collection pause, a frozen VM, a process stopped and continued. A delivery
whose local lease has less than :func:`start_margin` left is not started (its claim may already
have run out in the store, and another worker may hold it): the runtime gives it back instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

START_MARGIN_FRACTION = 0.2
START_MARGIN_MAX_SECONDS = 30.0


def start_margin(lease_seconds: float) -> float:
    """How much of its lease a delivery must have left for its handler to start: a fifth of the
    lease, at most 30 s (a heartbeat is due within a third of it)."""
    return min(START_MARGIN_MAX_SECONDS, lease_seconds * START_MARGIN_FRACTION)


@dataclass(slots=True)
class LocalLease:
    """One delivery's lease as this process counts it, on a monotonic clock."""

    lease_seconds: float
    renewed_at: float
    """When the claim or the last heartbeat that renewed the lease was sent."""

    @classmethod
    def claimed(cls, sent_at: float, lease_seconds: float) -> LocalLease:
        """The lease of a claim sent at ``sent_at``."""
        return cls(lease_seconds, sent_at)

    @property
    def deadline(self) -> float:
        return self.renewed_at + self.lease_seconds

    def renew(self, sent_at: float, lease_seconds: float | None = None) -> None:
        """A heartbeat sent at ``sent_at`` renewed the lease."""
        if lease_seconds is not None:
            self.lease_seconds = lease_seconds
        self.renewed_at = max(self.renewed_at, sent_at)

    def remaining(self, now: float) -> float:
        return self.deadline - now

    def can_start(self, now: float) -> bool:
        """True when enough of the lease is left to start the handler."""
        return self.remaining(now) >= start_margin(self.lease_seconds)


_COUNTED: ContextVar[Mapping[str, float] | None] = ContextVar("workqueue_counted_leases", default=None)


@contextlib.contextmanager
def counting(leases: Mapping[str, float]) -> Iterator[None]:
    """Around a claim: the lease this process counts per subscription (the subscription's as it
    last read it). A store leases what it claims here for that, not for the subscription's lease
    as it stands now: a newer deploy may have shortened it, and a lease that ran out in the store
    before the one the process counts would let another worker take the delivery while it runs."""
    token = _COUNTED.set(leases)
    try:
        yield
    finally:
        _COUNTED.reset(token)


def counted_lease(subscription: str) -> float | None:
    """The lease the claiming process counts for ``subscription`` (:func:`counting`), or None."""
    leases = _COUNTED.get()
    return None if leases is None else leases.get(subscription)
