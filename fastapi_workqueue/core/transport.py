"""The transport contract: what the runtime, the host and operators need from where messages live.

A transport implements :class:`Transport`; its :class:`Capabilities` say what it cannot do, and
the host reports such subscriptions ``Unsupported`` instead of failing silently.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol, runtime_checkable

from .envelope import PreparedMessage, PublishResult
from .reports import (
    ActionResult,
    Backlog,
    BindingReport,
    DeliveryInfo,
    DeliveryStatus,
    PartitionCondition,
    PartitionInfo,
    SubscriptionStats,
    SweepReport,
)
from .topology import Subscription, SubscriptionState, SubscriptionStatus, Topic

SettleKind = Literal["Complete", "Retry", "Fail", "DeadLetter", "Release"]
SettleResult = Literal["Completed", "Pending", "DeadLettered", "Discarded", "LeaseLost"]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport can honour."""

    ordered: bool = True
    exclusive: bool = True
    transactional_publish: bool = True
    wakeups: bool = False
    runtime_roles: bool = False
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ClaimedDelivery:
    """A delivery claimed under a lease; ``lease_token`` fences every later call."""

    delivery_id: str
    lease_token: str
    attempt: int
    max_attempts: int
    lease_expires_at: datetime | None
    message_id: uuid.UUID
    topic: str
    partition_key: str | None
    attributes: dict[str, str]
    payload_json: str | None
    payload_ref: str | None = None
    correlation_id: str | None = None
    published_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class HeartbeatRequest:
    delivery_id: str
    lease_token: str
    percent: int | None = None
    message: str | None = None


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    delivery_id: str
    alive: bool
    cancel_requested: bool
    lease_expires_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Settlement:
    """How one claimed delivery ends this attempt."""

    delivery_id: str
    lease_token: str
    kind: SettleKind
    delay_seconds: float | None = None
    reason: str | None = None
    error: str | None = None


WakeupListener = Callable[[str], None]
"""Called with a subscription id when it may have new claimable work."""


@runtime_checkable
class Transport(Protocol):
    """Where messages live. Every method is safe to call from many processes at once."""

    name: str
    capabilities: Capabilities

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def migrate(self) -> list[str]: ...

    # topology
    async def sync_topology(self, topics: Sequence[Topic], subscriptions: Sequence[Subscription]) -> None: ...
    async def list_subscriptions(self) -> list[SubscriptionState]: ...
    async def list_topics(self) -> list[Topic]: ...
    async def set_subscription_status(self, subscription: str, status: SubscriptionStatus) -> bool | None: ...

    # publish
    async def publish(
        self, topic: str, messages: Sequence[PreparedMessage], *, session: Any = None
    ) -> list[PublishResult]: ...

    # consume
    async def claim(self, subscription: str, limit: int) -> list[ClaimedDelivery]: ...
    async def heartbeat(self, requests: Sequence[HeartbeatRequest]) -> list[HeartbeatResult]: ...
    async def settle(self, settlements: Sequence[Settlement]) -> list[SettleResult]: ...
    async def add_wakeup_listener(self, listener: WakeupListener) -> None:
        """Calls ``listener`` when a subscription may have new work. The first listener opens what
        delivers wake-ups (PostgreSQL: a LISTEN connection), so a process that only publishes
        never receives them."""
        ...

    # once markers (context.once)
    async def once_begin(self, key: str, running_seconds: float) -> tuple[str, str | None]: ...
    async def once_finish(self, key: str, token: str, ttl_seconds: float) -> bool: ...
    async def once_abort(self, key: str, token: str) -> bool: ...

    # housekeeping
    async def sweep(self, limit: int = 1000) -> SweepReport: ...

    # operate
    async def stats(self, subscription: str | None = None) -> list[SubscriptionStats]: ...
    async def backlog(self, subscription: str) -> Backlog | None: ...
    async def get_delivery(self, delivery_id: str, *, include_payload: bool = False) -> DeliveryInfo | None: ...
    async def list_deliveries(
        self,
        subscription: str,
        status: DeliveryStatus,
        *,
        limit: int = 100,
        after: str | None = None,
        include_payload: bool = False,
    ) -> list[DeliveryInfo]: ...
    async def partitions(
        self, subscription: str, condition: PartitionCondition | None = None, *, limit: int = 100
    ) -> list[PartitionInfo]: ...
    async def replay(self, subscription: str, delivery_id: str, note: str | None = None) -> ActionResult: ...
    async def validate_bindings(self) -> BindingReport: ...
    async def prune(self, older_than_seconds: float) -> int: ...
    async def discard(self, subscription: str, delivery_id: str, reason: str | None = None) -> ActionResult: ...
