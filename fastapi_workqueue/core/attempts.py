"""The attempts of a delivery that did not simply complete, kept by the store.

A claim that completes writes nothing more than the settle; an attempt off that path (a settle
that retries, dead-letters or discards, a lease expiry, a replay) leaves a row, at most
:data:`ATTEMPTS_KEPT` a delivery, removed with the delivery. A transport that keeps them
implements :class:`AttemptHistoryReader`; the database transports do.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, Protocol, runtime_checkable

from .processes import Holder
from .wire import WireModel

ATTEMPTS_KEPT = 50
"""The newest attempts kept per delivery; older ones go."""

AttemptOutcome = Literal["Failed", "DeadLettered", "Discarded", "LeaseExpired", "Replayed"]


class AttemptInfo(WireModel):
    """One kept attempt: ``Failed`` (retried later), ``DeadLettered``, ``Discarded``,
    ``LeaseExpired`` (the holder stopped renewing its lease) or ``Replayed`` (an operator replayed
    the dead letter: ``reason`` is the replay's note, and the attempts before it are past)."""

    attempt: int
    started_at: datetime | None = None
    ended_at: datetime
    outcome: AttemptOutcome
    reason: str | None = None
    error: str | None = None
    holder: Holder | None = None


@runtime_checkable
class AttemptHistoryReader(Protocol):
    """A transport that keeps the attempts off the happy path."""

    async def delivery_attempts(self, delivery_id: str) -> list[AttemptInfo]:
        """The kept attempts of one delivery, oldest first (empty for an unknown delivery)."""
        ...
