"""What operators read and get back: stats, backlog, deliveries, partitions, action results."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from .processes import Holder
from .wire import WireModel

DeliveryStatus = Literal["Pending", "InFlight", "Completed", "DeadLettered", "Discarded"]
PartitionCondition = Literal["Blocked", "InFlight", "Idle"]


class SubscriptionStats(WireModel):
    """Counts of one subscription's deliveries by state."""

    subscription: str
    topic: str
    status: str
    partition_mode: str
    pending: int
    claimable: int
    in_flight: int
    dead_lettered: int
    completed: int
    discarded: int
    oldest_pending_at: datetime | None = None
    """Since when the longest-waiting due Pending delivery waits: the time it became claimable (its
    publish, its ``not_before``, the end of its retry's backoff). None when none is due."""
    reason: str | None = Field(default=None, exclude_if=lambda value: value is None)
    """What an operator should know of the counts and what to do (a subscription whose topic moved
    to another transport, with deliveries left in the database)."""


class Backlog(WireModel):
    """Work an autoscaler should see: claimable Pending (single flight per key) plus InFlight."""

    subscription: str
    claimable: int
    in_flight: int
    backlog: int


class DeliveryInfo(WireModel):
    """One delivery as operators see it. ``payload`` is only filled for admins."""

    delivery_id: str
    subscription: str
    message_id: uuid.UUID
    topic: str | None = None
    partition_key: str | None = None
    status: DeliveryStatus
    attempt: int
    max_attempts: int
    reason: str | None = None
    last_error: str | None = None
    note: str | None = None
    cancel_requested: bool = False
    progress_percent: int | None = None
    progress_message: str | None = None
    visible_at: datetime | None = None
    lease_expires_at: datetime | None = None
    created_at: datetime | None = None
    claimed_at: datetime | None = None
    settled_at: datetime | None = None
    attributes: dict[str, str] | None = None
    correlation_id: str | None = None
    payload: Any = None
    holder: Holder | None = None
    """The process that holds it (InFlight) or held its last attempt."""
    trace_id: str | None = None
    """The trace its message was published in (W3C trace id), when the publisher traced."""


class PartitionInfo(WireModel):
    """A key of an Exclusive or Ordered subscription with live work."""

    partition_key: str
    condition: PartitionCondition
    head_delivery_id: str | None = None
    head_status: str | None = None
    head_attempt: int | None = None
    head_visible_at: datetime | None = None
    waiting_items: int


class ActionResult(WireModel):
    """The answer to replay or discard."""

    result: Literal[
        "Replayed", "Discarded", "CancelRequested", "NotFound", "NotDeadLettered", "AlreadyTerminal", "Unsupported"
    ]
    delivery_id: str
    subscription: str
    cancel_requested: bool = False
    status: str | None = None
    reason: str | None = Field(default=None, exclude_if=lambda value: value is None)
    """Why the transport cannot do it (``Unsupported``: cancel of an in-flight SQS message)."""

    @property
    def ok(self) -> bool:
        """True when the action took effect."""
        return self.result in ("Replayed", "Discarded", "CancelRequested")


class TakenBack(WireModel):
    """A lease a sweeper pass took back: the delivery, what became of it, and who held it."""

    delivery_id: str
    subscription: str
    result: Literal["Pending", "DeadLettered", "Discarded"]
    attempt: int
    holder: Holder | None = None


class SweepReport(WireModel):
    """What one sweeper pass did; ``ran`` is False when another process held the sweep lock."""

    ran: bool
    retried: int = 0
    dead_lettered: int = 0
    discarded: int = 0
    purged_deliveries: int = 0
    purged_messages: int = 0
    purged_deduplication: int = 0
    taken_back: list[TakenBack] = Field(default_factory=list)
    """Each lease taken back in this pass (Pending: retried; DeadLettered: its final attempt;
    Discarded: its cancel was requested), with the process that held it."""

    @property
    def expired(self) -> int:
        """Leases expired in this pass."""
        return self.retried + self.dead_lettered + self.discarded


class BindingIssue(WireModel):
    """Something wrong (or worth knowing) about how the queue is bound to its store."""

    severity: Literal["Error", "Warning", "Info"]
    subject: str
    message: str


class BindingReport(WireModel):
    """The answer of validate-bindings: ``ok`` is False when any issue is an Error."""

    transport: str
    ok: bool
    issues: list[BindingIssue]
