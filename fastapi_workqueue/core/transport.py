"""The transport contract: what the runtime, the host and operators need from where messages live.

A transport implements :class:`Transport`, the sum of the roles below (each a protocol a part of
the library can ask for alone); its :class:`Capabilities` say what it cannot do, and the host
reports such subscriptions ``Unsupported`` instead of failing silently. What only some transports
have (ending claims that wait for work, a process registry, API keys ...) is a port of its own in
:mod:`.ports`, resolved once when the queue is wired.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol, runtime_checkable

from .envelope import PreparedMessage, PublishResult
from .flow import HeldBackLimit
from .outcomes import FollowUp
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

SettleKind = Literal["Complete", "Retry", "Fail", "DeadLetter", "Release", "Discard"]
SettleResult = Literal["Completed", "Pending", "DeadLettered", "Discarded", "LeaseLost"]

FREES_KEYS: frozenset[SettleResult] = frozenset({"Completed", "Discarded"})
"""The settle results that free the deduplication keys a settlement names (``Settlement.frees``):
the delivery's work ended with it. A settle that finds its lease lost frees nothing (the job runs
again and still holds its key)."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport can honour."""

    ordered: bool = True
    exclusive: bool = True
    transactional_publish: bool = True
    wakeups: bool = False
    runtime_roles: bool = False
    cancel: bool = True
    """Discard of an in-flight delivery asks its handler to stop (False: answered ``Unsupported``)."""
    exact_backlog: bool = True
    """Per-key backlog and partition listings are exact (False: answered ``Unsupported``)."""
    retry_keeps_key_busy: bool = False
    """Exclusive: a delivery waiting out its retry delay keeps its key from the others (SQS FIFO)."""
    terminal_counts: bool = True
    """Stats count Completed and Discarded deliveries (False: SQS deletes them and counts none; 0)."""
    sweeps: bool = True
    """The sweep expires leases and purges (False: the broker does it itself, and ``sweep`` never runs)."""
    message_state: bool = True
    """Keeps what :mod:`.message_state` names: a completion's result (False: a broker keeps none;
    the jobs layer's status, results, groups and debounce live in the database)."""
    priority: bool = True
    """A published message's ``priority`` orders the claims of its deliveries (False: SQS, refused)."""
    concurrency_limits: bool = True
    """A subscription's ``max_in_flight`` and ``key_concurrency`` hold across processes (False: Unsupported)."""
    rate_limits: bool = True
    """A subscription's ``rate_limit`` and ``key_rate_limit`` hold across processes (False: Unsupported)."""
    savepoint_retry: bool = True
    """A publish in a caller's transaction that the store asks to try again (a unique job key another
    transaction took at once) is tried again in a savepoint (False: SQLite, whose single writer
    serializes the dispatchers already, and where a savepoint turns the caller's lock into an upgrade
    that fails at once)."""
    exclusive_needs_fifo: bool = False
    """Exclusive holds only on a FIFO topic (SQS: the key is the message group; a standard queue
    hands one key's messages to several consumers at once)."""
    claims_wait: bool = False
    """A claim may wait for work to arrive (SQS's long poll, a held head's retry delay): how long
    it takes says nothing of a stalled store, so the host does not report it (:mod:`.stalls`)."""
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
    headers: dict[str, str] | None = None
    """What the publisher's library carried with the message (the W3C trace context), or None."""
    lease_offset_seconds: float = 0.0
    """How long after the claim call started the transport started (or restarted) this lease: the
    runtime counts the lease from then. 0 where the lease starts inside the claim (a database's
    transaction); an SQS receive that long-polled renews the lease once the message is there."""


@dataclass(frozen=True, slots=True)
class HeldBack:
    """A flow limit of the subscription kept claimable work back in a claim (none of it was claimed
    or spent an attempt)."""

    limit: HeldBackLimit
    retry_after: float | None = None
    """Seconds until the limit lets another delivery through (a rate limit's next token); None
    when that waits for a delivery in flight to end (``max_in_flight``, ``key_concurrency``)."""


class Claimed(list[ClaimedDelivery]):
    """What :meth:`Consuming.claim` answers: the deliveries claimed, and ``held_back`` when a flow
    limit of the subscription kept claimable work back (a plain list from a transport without limits)."""

    __slots__ = ("held_back",)

    def __init__(self, deliveries: Iterable[ClaimedDelivery] = (), held_back: HeldBack | None = None) -> None:
        super().__init__(deliveries)
        self.held_back = held_back


@dataclass(frozen=True, slots=True)
class HeartbeatRequest:
    delivery_id: str
    lease_token: str
    percent: int | None = None
    message: str | None = None
    lease_seconds: float | None = None
    """The lease the renewal grants (the one the process counts); None: the subscription's."""


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
    follow_ups: tuple[FollowUp, ...] = ()
    """Published in the transaction that writes a ``Complete`` (see :class:`.outcomes.FollowUp`)."""
    result_json: str | None = None
    """Kept with the message in the transaction that writes a ``Complete`` (a job's stored result);
    written only by :meth:`Consuming.settle_with_follow_ups`."""
    frees: tuple[tuple[str, str, uuid.UUID], ...] = ()
    """Deduplication keys (topic, key, the message that holds it) freed in the transaction that
    writes a ``Complete`` when it completes or discards the delivery (a unique job's key)."""

    @property
    def one_transaction(self) -> bool:
        """True when the settle writes more than the delivery (follow-ups, a result, keys to free):
        it goes through :meth:`Consuming.settle_with_follow_ups`, not a batch."""
        return bool(self.follow_ups) or self.result_json is not None or bool(self.frees)


CLAIM_MANY_REFUSAL = "claim_many takes None-mode subscriptions only"
"""How every transport's claim_many starts its refusal (a ValueError) of a keyed subscription or
one with flow limits."""

WakeupListener = Callable[[str], None]
"""Called with a subscription id when it may have new claimable work."""


class StoreLifecycle(Protocol):
    """Opening, closing and migrating the store."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def migrate(self) -> list[str]: ...


class TopologyStore(Protocol):
    """Where topics and subscriptions are declared and their status kept."""

    async def sync_topology(self, topics: Sequence[Topic], subscriptions: Sequence[Subscription]) -> None: ...
    async def list_subscriptions(self) -> list[SubscriptionState]: ...
    async def list_topics(self) -> list[Topic]: ...
    async def set_subscription_status(self, subscription: str, status: SubscriptionStatus) -> bool | None: ...


class Publishing(Protocol):
    """Accepting messages for a topic (inside the caller's ``session`` where the store has one)."""

    async def publish(
        self, topic: str, messages: Sequence[PreparedMessage], *, session: Any = None
    ) -> list[PublishResult]: ...


class Consuming(Protocol):
    """Claiming under a lease, renewing it, and settling what was claimed."""

    async def claim(self, subscription: str, limit: int) -> list[ClaimedDelivery]:
        """Up to ``limit`` deliveries under lease, the highest priority first, within the
        subscription's flow limits (a :class:`Claimed` says when one held work back). Each is
        leased for the lease the claiming process counts when it says one
        (:func:`.leases.counted_lease`), else for the subscription's."""
        ...
    async def claim_many(self, subscriptions: Sequence[str], limit: int) -> list[tuple[str, ClaimedDelivery]]:
        """One claim across several None-mode subscriptions: up to ``limit`` deliveries, the highest
        priority and then the oldest due first whatever their subscription, each with its
        subscription's name and lease (as :meth:`claim` leases). An Exclusive or Ordered
        subscription among them, or one with flow limits, is refused with a ValueError (claim
        takes those)."""
        ...
    async def heartbeat(self, requests: Sequence[HeartbeatRequest]) -> list[HeartbeatResult]: ...
    async def settle(self, settlements: Sequence[Settlement]) -> list[SettleResult]: ...
    async def settle_with_follow_ups(self, settlement: Settlement) -> SettleResult:
        """Writes one settlement, publishes its follow-ups and keeps its ``result_json`` in one
        transaction; when the settle does not complete the delivery (a lost lease), nothing is
        published or kept."""
        ...
    async def settle_together(self, settlements: Sequence[Settlement]) -> list[SettleResult] | None:
        """What :meth:`settle_with_follow_ups` does for each of ``settlements``, in one transaction
        (one commit for all), answering a result for each; or None, having written none of them,
        when the store cannot (a broker has no such transaction) or one of them was refused (a
        follow-up the publish refuses). The caller then writes each with
        :meth:`settle_with_follow_ups`. A store out of reach raises, as a settle does."""
        ...
    async def add_wakeup_listener(self, listener: WakeupListener) -> None:
        """Calls ``listener`` when a subscription may have new work. The first listener opens what
        delivers wake-ups (PostgreSQL: a LISTEN connection), so a process that only publishes
        never receives them."""
        ...


class MessageMarkers(Protocol):
    """Small records kept beside a message: ``context.once`` keys, deduplication keys, job steps."""

    async def once_begin(self, key: str, running_seconds: float) -> tuple[str, str | None]: ...
    async def once_finish(self, key: str, token: str, ttl_seconds: float) -> bool: ...
    async def once_abort(self, key: str, token: str) -> bool: ...
    async def once_renew(self, key: str, token: str, running_seconds: float) -> bool:
        """Holds a Running key ``running_seconds`` more while ``token`` holds it (a holder renews it as a
        heartbeat renews a lease); False once the token no longer holds the key."""
        ...
    async def release_deduplication_key(self, topic: str, key: str, message_id: uuid.UUID, *,
                                        session: Any = None) -> bool:
        """Frees ``key`` of ``topic`` if ``message_id`` holds it (True when it did), in ``session``'s
        transaction when one is given."""
        ...
    async def step_get(self, message_id: uuid.UUID, name: str) -> tuple[bool, str | None]:
        """The stored JSON result of step ``name`` of the message's work, if any."""
        ...
    async def step_put(self, message_id: uuid.UUID, name: str, value_json: str) -> None:
        """Stores a step's JSON result; kept until the message is purged."""
        ...


class Housekeeping(Protocol):
    """Expiring leases, purging what is settled, pruning old dead letters."""

    async def sweep(self, limit: int = 1000) -> SweepReport: ...
    async def prune(self, older_than_seconds: float) -> int: ...
    async def discard_dead_letters(self, subscription: str, settled_before: datetime, limit: int = 1000) -> int:
        """Discards the subscription's DeadLettered deliveries settled before ``settled_before``
        (reason ``pruned``), ``limit`` at a time, each batch a transaction of its own; returns how
        many it discarded."""
        ...


class OperatorReads(Protocol):
    """What operators read: counts, backlogs, deliveries, partitions, bindings."""

    async def stats(self, subscription: str | None = None) -> list[SubscriptionStats]: ...
    async def backlog(self, subscription: str) -> Backlog | None: ...
    async def get_delivery(self, delivery_id: str, *, include_payload: bool = False) -> DeliveryInfo | None: ...
    async def known_messages(self, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """Which of these MessageIDs the store has."""
        ...
    async def message_deliveries(self, message_id: uuid.UUID, *, include_payload: bool = False) -> list[DeliveryInfo]:
        """Every delivery of one message, each with its subscription, as :meth:`get_delivery` answers."""
        ...
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
    async def validate_bindings(self) -> BindingReport: ...


class OperatorActions(Protocol):
    """What operators change: replay and discard of deliveries, a payload's rewrite."""

    async def replay(self, subscription: str, delivery_id: str, note: str | None = None) -> ActionResult: ...
    async def discard(self, subscription: str, delivery_id: str, reason: str | None = None) -> ActionResult: ...
    async def rewrite_payload(
        self, message_id: uuid.UUID, payload_json: str, content_hash: str, envelope_bytes: int
    ) -> bool:
        """Replaces a stored message's payload (re-encryption with a new key) while none of its
        deliveries is InFlight, Completed or Discarded; False when it did not rewrite."""
        ...


@runtime_checkable
class Transport(
    StoreLifecycle, TopologyStore, Publishing, Consuming, MessageMarkers, Housekeeping, OperatorReads,
    OperatorActions, Protocol,
):
    """Where messages live: every role above, with a ``name`` and the :class:`Capabilities` that say
    what it cannot honour. Every method is safe to call from many processes at once. A part of the
    library that needs one role takes that role's protocol; the optional parts a transport may add
    (a process registry, live work, stats history, API keys ...) are resolved once, into
    :class:`.ports.Ports`."""

    name: str
    capabilities: Capabilities
