"""An in-memory transport: the whole queue in this process's memory, for an application's tests.

``MemoryTransport`` keeps topics, subscriptions, messages and deliveries in dicts and applies the
rules of :mod:`fastapi_workqueue.core.lifecycle` (the same settle and expiry transitions, backoff
and claim rules the SQLite routines run), so it passes the conformance suite
(:mod:`fastapi_workqueue.testing.conformance`) beside the database transports. Every operation runs
without awaiting in between, so each is atomic on its event loop.

Time is its clock's (``clock=``, by default the system's): pass a
:class:`~fastapi_workqueue.core.clock.ManualClock` and a test moves leases, retry delays and
retention on with ``clock.advance(seconds)`` instead of sleeping. Transports built with the same
``url`` (``memory://name``) share one store while any of them lives; ``memory://`` is a store of
its own. What it cannot do: publish in a caller's database transaction (there is none:
``capabilities.transactional_publish`` is False), and outlive its process.

It lives in ``core`` because the jobs layer runs on it too (the sync mode and ``queue.fake()``
run the real consumer over it); :mod:`fastapi_workqueue.testing` exports it for an app's tests.
"""

from __future__ import annotations

import json
import math
import random
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .clock import SYSTEM_CLOCK, Clock
from .envelope import MAX_ENVELOPE_BYTES, PreparedMessage, PublishError, PublishResult, PublishStatus
from .errors import ConfigurationError, TransportError
from .flow import HeldBackLimit, Rate, key_rooms, parse_rate, refill, take_limited, tokens_due_in
from .leases import counted_lease
from .lifecycle import (
    BackoffPolicy,
    BatchItem,
    PartitionMode,
    Transition,
    batch_refusals,
    classify_batch,
    expire_transition,
    follow_up_refused,
    granted_lease,
    matches,
    next_claimable,
    repeats_stored_call,
    settle_delay,
    settle_transition,
    split_claim,
    topic_refusal,
    unkeyed_share,
)
from .live_work import LIVE_COUNT_CAP, FlowState
from .message_state import GroupMember
from .observe import trace_id_of
from .processes import Holder, ProcessBeat, ProcessInfo, current_process, package_version
from .reports import (
    ActionResult,
    Backlog,
    BindingIssue,
    BindingReport,
    DeliveryInfo,
    DeliveryStatus,
    PartitionCondition,
    PartitionInfo,
    SubscriptionStats,
    SweepReport,
    TakenBack,
)
from .topology import (
    DEFAULT_RETENTION_SECONDS,
    Subscription,
    SubscriptionState,
    SubscriptionStatus,
    Topic,
    TopicState,
    topic_move_refused,
)
from .transport import (
    FREES_KEYS,
    Capabilities,
    Claimed,
    ClaimedDelivery,
    HeartbeatRequest,
    HeartbeatResult,
    HeldBack,
    Settlement,
    SettleResult,
    WakeupListener,
)

__all__ = ["MemoryTransport"]

_WEEK = float(DEFAULT_RETENTION_SECONDS)
_DEDUPLICATION_TTL = 300.0
_LIVE = ("Pending", "InFlight", "DeadLettered")


@dataclass
class _Topic:
    topic: Topic
    status: str = "Active"


@dataclass
class _Sub:
    id: int
    spec: Subscription
    status: str = "Active"


@dataclass
class _Message:
    id: uuid.UUID
    topic: str
    partition_key: str | None
    attributes: dict[str, str]
    headers: dict[str, str] | None
    payload_json: str | None
    payload_ref: str | None
    correlation_id: str | None
    content_hash: str
    published_at: datetime


@dataclass
class _Delivery:
    id: int
    subscription: str
    message_id: uuid.UUID
    partition_key: str | None
    mode: PartitionMode
    max_attempts: int
    backoff: BackoffPolicy
    visible_at: datetime
    created_at: datetime
    status: DeliveryStatus = "Pending"
    attempt: int = 0
    lease_token: str | None = None
    lease_expires_at: datetime | None = None
    claimed_at: datetime | None = None
    settled_at: datetime | None = None
    cancel_requested: bool = False
    reason: str | None = None
    last_error: str | None = None
    note: str | None = None
    progress_percent: int | None = None
    progress_message: str | None = None
    held_by: uuid.UUID | None = None
    group_id: uuid.UUID | None = None
    priority: int = 0


@dataclass
class _Group:
    """A group: the held message its members' ends release, and which of them ended when."""

    then: uuid.UUID
    members: list[uuid.UUID]
    ended: dict[uuid.UUID, datetime] = field(default_factory=dict)
    released_at: datetime | None = None


@dataclass
class _Process:
    beat: ProcessBeat
    last_seen_at: datetime
    stopped_at: datetime | None = None


@dataclass
class _Store:
    """Everything a memory store holds (shared by the transports of one ``memory://name``)."""

    topics: dict[str, _Topic] = field(default_factory=dict)
    subs: dict[str, _Sub] = field(default_factory=dict)
    messages: dict[uuid.UUID, _Message] = field(default_factory=dict)
    deliveries: dict[int, _Delivery] = field(default_factory=dict)
    deduplication: dict[tuple[str, str], tuple[uuid.UUID, datetime]] = field(default_factory=dict)
    once: dict[str, tuple[str, str, datetime]] = field(default_factory=dict)
    steps: dict[tuple[uuid.UUID, str], str] = field(default_factory=dict)
    results: dict[uuid.UUID, str] = field(default_factory=dict)
    groups: dict[uuid.UUID, _Group] = field(default_factory=dict)
    processes: dict[uuid.UUID, _Process] = field(default_factory=dict)
    sweep_lock_holders: int = 0
    buckets: dict[tuple[str, bool, str], tuple[float, datetime]] = field(default_factory=dict)
    """Rate limits' token buckets: (subscription, per key, key) -> (tokens, as of)."""
    last_id: int = 0
    wakeups: list[WakeupListener] = field(default_factory=list)


_STORES: weakref.WeakValueDictionary[str, _Store] = weakref.WeakValueDictionary()


def _claim_order(d: _Delivery) -> tuple[int, datetime, int]:
    return (-d.priority, d.visible_at, d.id)


def _shared(candidates: list[_Delivery], room: int) -> list[_Delivery]:
    """What a claim of ``room`` takes of ``candidates`` (in claim order) on a subscription without
    flow limits."""
    keyed = [d for d in candidates if d.mode != "None"][:room]
    unkeyed = [d for d in candidates if d.mode == "None"][: unkeyed_share(room, len(keyed))]
    taken, others = split_claim(room, keyed, unkeyed, _claim_order, _claim_order)
    return taken + others


class MemoryTransport:
    """The Transport contract in memory (see the module's docstring)."""

    name = "memory"
    capabilities = Capabilities(
        transactional_publish=False,
        wakeups=True,
        notes=("in memory: one process, no caller's transaction",),
    )

    def __init__(self, url: str = "memory://", *, clock: Clock | None = None, rng: Any = None) -> None:
        """``clock``: the time every rule runs at (a test's ``ManualClock``); ``rng``: where the
        retries' jitter is drawn from (anything with ``random()``, like ``random.Random``)."""
        if not url.startswith("memory://"):
            raise ConfigurationError(f"a memory transport's url is memory:// or memory://<name>, got {url!r}")
        if rng is not None and not callable(getattr(rng, "random", None)):
            raise TypeError(f"rng must have a random() method, like random.Random; got {type(rng).__name__}")
        self.url = url
        self.clock: Clock = SYSTEM_CLOCK if clock is None else clock
        self.rng: Any = random.Random() if rng is None else rng
        name = url.removeprefix("memory://")
        store = _STORES.get(name) if name else None
        if store is None:
            store = _Store()
            if name:
                _STORES[name] = store
        self._store = store

    # -- lifecycle of the transport ------------------------------------------------------------

    async def open(self) -> None:
        """Nothing to open."""

    async def close(self) -> None:
        """Nothing to close: the store lives while a transport refers to it."""

    async def migrate(self) -> list[str]:
        """Nothing to migrate."""
        return []

    def _now(self) -> datetime:
        return self.clock.now()

    async def store_now(self) -> datetime:
        """The time by this store's clock."""
        return self.clock.now()

    def _draw(self) -> float:
        draw = float(self.rng.random())
        if not 0.0 <= draw < 1.0:
            raise ValueError(f"rng.random() must return a fraction in [0, 1); it returned {draw!r}")
        return draw

    def _wake(self, subscriptions: Iterable[str]) -> None:
        for name in dict.fromkeys(subscriptions):
            sub = self._store.subs.get(name)
            if sub is not None:
                for listener in list(self._store.wakeups):
                    listener(str(sub.id))

    async def add_wakeup_listener(self, listener: WakeupListener) -> None:
        """Calls ``listener`` (with a subscription's id) when a subscription may have new work."""
        self._store.wakeups.append(listener)

    # -- topology ------------------------------------------------------------------------------

    async def sync_topology(self, topics: Sequence[Topic], subscriptions: Sequence[Subscription]) -> None:
        store = self._store
        # Every refusal before any write: a refused sync leaves the topology as it was (as the
        # databases' one transaction does).
        for spec in subscriptions:
            current = store.subs.get(spec.name)
            if current is None:
                continue
            if current.spec.topic != spec.topic:
                raise ValueError(topic_move_refused(spec.name, current.spec.topic, spec.topic))
            live = [d for d in self._of(spec.name) if d.status in _LIVE]
            if live and current.spec.partition_mode != spec.partition_mode:
                raise ValueError(
                    f"subscription {spec.name} has live deliveries routed for partition mode "
                    f"{current.spec.partition_mode}; change it to {spec.partition_mode} once they are settled or "
                    "discarded, or create a new subscription"
                )
        for topic in topics:
            known = store.topics.get(topic.name)
            if known is None:
                store.topics[topic.name] = _Topic(Topic(**topic.model_dump(by_alias=False)))
            else:
                known.topic = Topic(**topic.model_dump(by_alias=False))
        for spec in subscriptions:
            current = store.subs.get(spec.name)
            if current is None:
                store.last_id += 1
                store.subs[spec.name] = _Sub(store.last_id, spec, spec.status)
            else:
                current.spec = spec

    async def list_subscriptions(self) -> list[SubscriptionState]:
        out = []
        for sub in sorted(self._store.subs.values(), key=lambda s: s.spec.name):
            topic = self._store.topics.get(sub.spec.topic)
            out.append(SubscriptionState(
                **{**sub.spec.model_dump(by_alias=False), "status": sub.status}, id=str(sub.id),
                topic_status=topic.status if topic else "Active",
                transport_name=topic.topic.transport if topic else "database",
                is_fifo=topic.topic.is_fifo if topic else False,
            ))
        return out

    async def list_topics(self) -> list[Topic]:
        return [TopicState(**t.topic.model_dump(by_alias=False), status=t.status)
                for _, t in sorted(self._store.topics.items())]

    async def set_subscription_status(self, subscription: str, status: SubscriptionStatus) -> bool | None:
        sub = self._store.subs.get(subscription)
        if sub is None:
            return None
        changed = sub.status != status
        sub.status = status
        if status == "Active" and changed:
            self._wake([subscription])
        return changed

    # -- publish -------------------------------------------------------------------------------

    async def publish(
        self, topic: str, messages: Sequence[PreparedMessage], *, session: Any = None
    ) -> list[PublishResult]:
        """Publishes ``messages`` at once, all or nothing. There is no caller's transaction to
        join: a ``session`` is refused."""
        if session is not None:
            raise ConfigurationError(
                "the memory transport cannot publish in a caller's database transaction (session=...); publish "
                "without a session, or test transactional publish on SQLite or PostgreSQL"
            )
        return self._publish(topic, messages)

    def _publish(self, topic: str, messages: Sequence[PreparedMessage]) -> list[PublishResult]:
        store, now = self._store, self._now()
        known = store.topics.get(topic)

        def stored(message_id: str) -> tuple[str, str] | None:
            found = store.messages.get(uuid.UUID(message_id))
            return None if found is None else (found.topic, found.content_hash)

        if known is None or known.status == "Retired":
            items = [BatchItem(str(m.message_id), m.content_hash, None, m.envelope_bytes) for m in messages]
            if known is not None and repeats_stored_call(items, topic=topic, stored=stored):
                return [PublishResult(message_id=m.message_id, status=PublishStatus.DUPLICATE) for m in messages]
            code, text = topic_refusal(topic, exists=known is not None)
            return [_refused(m.message_id, code, text) for m in messages]
        cap = known.topic.max_payload_bytes

        def live_holder(key: str) -> str | None:
            live = store.deduplication.get((topic, key))
            return str(live[0]) if live is not None and live[1] > now else None

        items = [BatchItem(str(m.message_id), m.content_hash, m.deduplication_key, m.envelope_bytes) for m in messages]
        verdicts = classify_batch(items, cap, topic=topic, stored=stored, live_holder=live_holder)
        refusals = batch_refusals(verdicts, items, topic=topic, cap=cap)
        if refusals is not None:
            return [_refused(uuid.UUID(mid), r.code, r.text,
                             PublishStatus.MESSAGE_ID_CONFLICT if r.status == "MessageIDConflict"
                             else PublishStatus.REJECTED)
                    for (_, mid), r in zip(verdicts, refusals, strict=True)]
        status = [v for v, _ in verdicts]
        result_ids = [uuid.UUID(mid) for _, mid in verdicts]

        subs = [s for s in store.subs.values() if s.spec.topic == topic]
        woken: list[str] = []
        for m, s in zip(messages, status, strict=True):
            if s != "Accepted":
                continue
            store.messages[m.message_id] = _Message(
                m.message_id, topic, m.partition_key, dict(m.attributes), m.headers, m.payload_json, m.payload_ref,
                m.correlation_id, m.content_hash, now)
            if m.deduplication_key is not None:
                store.deduplication[(topic, m.deduplication_key)] = (
                    m.message_id, now + timedelta(seconds=m.deduplication_ttl_seconds or _DEDUPLICATION_TTL))
            if m.not_before is not None:
                visible = max(now, m.not_before)
            else:
                visible = now + timedelta(seconds=m.delay_seconds or 0.0)
            for sub in subs:
                if not matches(sub.spec.filter, m.attributes):
                    continue
                store.last_id += 1
                mode: PartitionMode = sub.spec.partition_mode if m.partition_key is not None else "None"
                store.deliveries[store.last_id] = _Delivery(
                    store.last_id, sub.spec.name, m.message_id, m.partition_key, mode,
                    m.max_attempts or sub.spec.max_attempts,
                    BackoffPolicy(sub.spec.backoff_base_seconds, sub.spec.backoff_max_seconds,
                                  m.backoff_seconds or None),
                    visible, now, priority=m.priority,
                )
                if visible <= now:
                    woken.append(sub.spec.name)
        self._wake(woken)
        return [PublishResult(status=PublishStatus(s), message_id=i) for s, i in zip(status, result_ids, strict=True)]

    # -- consume -------------------------------------------------------------------------------

    def _of(self, subscription: str) -> list[_Delivery]:
        return [d for d in self._store.deliveries.values() if d.subscription == subscription]

    def _claimable(self, subscription: str, now: datetime) -> list[_Delivery]:
        """What a claim may take now, the highest priority first, then the oldest due: each visible
        unkeyed delivery, and per key the one :func:`next_claimable` names (keys are ranked by the
        priority of that delivery; within a key the order is the key's own)."""
        out: list[_Delivery] = []
        keys: dict[str, list[_Delivery]] = {}
        for d in self._of(subscription):
            if d.mode == "None":
                if d.status == "Pending" and d.visible_at <= now:
                    out.append(d)
            else:
                keys.setdefault(d.partition_key or "", []).append(d)
        for ds in keys.values():
            nxt = next_claimable(ds[0].mode, ds, now)
            if nxt is not None:
                out.append(nxt)
        out.sort(key=_claim_order)
        return out

    def _active(self, subscription: str) -> _Sub | None:
        sub = self._store.subs.get(subscription)
        topic = self._store.topics.get(sub.spec.topic) if sub is not None else None
        if sub is None or sub.status != "Active" or (topic is not None and topic.status == "Paused"):
            return None
        return sub

    def _lease(self, d: _Delivery, sub: _Sub, now: datetime) -> ClaimedDelivery:
        d.status, d.attempt = "InFlight", d.attempt + 1
        d.lease_token = str(uuid.uuid4())
        lease = granted_lease(counted_lease(sub.spec.name), sub.spec.lease_seconds)
        d.lease_expires_at = now + timedelta(seconds=lease)
        d.claimed_at = now
        d.held_by = current_process().id
        m = self._store.messages[d.message_id]
        return ClaimedDelivery(
            delivery_id=str(d.id), lease_token=d.lease_token, attempt=d.attempt, max_attempts=d.max_attempts,
            lease_expires_at=d.lease_expires_at, message_id=m.id, topic=m.topic, partition_key=m.partition_key,
            attributes=dict(m.attributes), payload_json=m.payload_json, payload_ref=m.payload_ref,
            correlation_id=m.correlation_id, published_at=m.published_at,
            headers=dict(m.headers) if m.headers else None,
        )

    async def claim(self, subscription: str, limit: int) -> list[ClaimedDelivery]:
        sub = self._active(subscription)
        if sub is None or limit < 1:
            return []
        now = self._now()
        if sub.spec.flow_limited:
            return self._claim_limited(sub, limit, now)
        taken = _shared(self._claimable(subscription, now), limit)
        taken.sort(key=_claim_order)  # the highest priority first, then the earliest due
        return [self._lease(d, sub, now) for d in taken]

    def _claim_limited(self, sub: _Sub, limit: int, now: datetime) -> Claimed:
        """claim under the subscription's flow limits (:mod:`fastapi_workqueue.core.flow`), as the
        database transports run it."""
        spec, name = sub.spec, sub.spec.name
        room = limit
        held: HeldBackLimit | None = None
        busy = [d for d in self._of(name)
                if d.status == "InFlight" and d.lease_expires_at is not None and d.lease_expires_at > now]
        if spec.max_in_flight is not None and spec.max_in_flight - len(busy) < room:
            room, held = max(spec.max_in_flight - len(busy), 0), "MaxInFlight"
        rate = parse_rate(spec.rate_limit) if spec.rate_limit else None
        key_rate = parse_rate(spec.key_rate_limit) if spec.key_rate_limit else None
        stamp = now.timestamp()

        def tokens(per_key: bool, key: str, r: Rate) -> float:
            bucket = self._store.buckets.get((name, per_key, key))
            return refill(None if bucket is None else bucket[0], None if bucket is None else bucket[1].timestamp(),
                          stamp, r)

        sub_tokens = tokens(False, "", rate) if rate is not None else 0.0
        if rate is not None and math.floor(sub_tokens) < room:
            room, held = math.floor(sub_tokens), "RateLimit"
        in_flight: dict[str, int] = {}
        for d in busy:
            if d.partition_key is not None:
                in_flight[d.partition_key] = in_flight.get(d.partition_key, 0) + 1
        by_concurrency = key_rooms(spec.key_concurrency if spec.partition_mode == "None" else None, in_flight)

        def key_room(key: str) -> float:
            spare = by_concurrency(key)
            return spare if key_rate is None else min(spare, tokens(True, key, key_rate))

        candidates = self._claimable(name, now)
        # The keys that can run and the deliveries without a key lock share the room, as on the
        # databases; a partition key limits the latter too on None mode (key_concurrency, key_rate).
        keyed = [d for d in candidates if d.mode != "None" and key_room(d.partition_key or "") >= 1][:room]
        unkeyed = take_limited([d for d in candidates if d.mode == "None"], unkeyed_share(room, len(keyed)),
                               lambda d: d.partition_key,
                               key_room if spec.partition_mode == "None" else lambda key: math.inf)
        keyed, unkeyed = split_claim(room, keyed, unkeyed, _claim_order, _claim_order)
        taken = keyed + unkeyed
        if held is None and len(taken) < limit and len(taken) < len(candidates):
            spent = key_rate is not None and any(
                tokens(True, d.partition_key, key_rate) < 1 for d in candidates if d.partition_key is not None)
            held = "KeyRateLimit" if key_rate is not None and (spent or spec.key_concurrency is None) \
                else "KeyConcurrency"
        taken.sort(key=_claim_order)  # the highest priority first, then the earliest due
        out = [self._lease(d, sub, now) for d in taken]
        if out and rate is not None:
            self._store.buckets[(name, False, "")] = (sub_tokens - len(out), now)
        spent_keys: dict[str, int] = {}
        for d in taken:
            if d.partition_key is not None:
                spent_keys[d.partition_key] = spent_keys.get(d.partition_key, 0) + 1
        if out and key_rate is not None:
            for key, n in spent_keys.items():
                self._store.buckets[(name, True, key)] = (tokens(True, key, key_rate) - n, now)
        if held is None or len(out) >= limit or len(taken) == len(candidates):
            return Claimed(out)
        retry: float | None = None
        if held == "RateLimit" and rate is not None:
            retry = tokens_due_in(sub_tokens - len(out), rate)
        elif held == "KeyRateLimit" and key_rate is not None:
            short = [t for t in (tokens(True, k, key_rate) for (s, per_key, k) in self._store.buckets
                                 if s == name and per_key) if t < 1]
            retry = tokens_due_in(max(short), key_rate) if short else None
        return Claimed(out, HeldBack(held, retry))

    async def claim_many(self, subscriptions: Sequence[str], limit: int) -> list[tuple[str, ClaimedDelivery]]:
        """One claim across several None-mode subscriptions, the oldest due first whatever their
        subscription; an Exclusive or Ordered one is refused (ValueError)."""
        if isinstance(subscriptions, str):
            raise TypeError(
                f"claim_many takes a sequence of subscription names, got the string {subscriptions!r}; "
                "claim one subscription with claim"
            )
        names = list(dict.fromkeys(subscriptions))
        if not names or limit < 1:
            return []
        for name in names:
            sub = self._store.subs.get(name)
            if sub is not None and (sub.spec.partition_mode != "None" or sub.spec.flow_limited):
                what = (f"is {sub.spec.partition_mode}" if sub.spec.partition_mode != "None" else "has flow limits")
                raise ValueError(
                    f"claim_many takes None-mode subscriptions only ({name} {what}); "
                    "claim an Exclusive or Ordered subscription, or one with flow limits, with claim"
                )
        now = self._now()
        candidates: list[tuple[_Delivery, _Sub]] = []
        for name in names:
            sub = self._active(name)
            if sub is not None:
                candidates.extend((d, sub) for d in self._claimable(name, now))
        candidates.sort(key=lambda c: (-c[0].priority, c[0].visible_at, c[0].id))
        return [(sub.spec.name, self._lease(d, sub, now)) for d, sub in candidates[:limit]]

    async def flow_state(self, subscription: str, *, cap: int = LIVE_COUNT_CAP) -> FlowState | None:
        """How full the subscription's flow limits are now (as the database transports count it)."""
        sub = self._store.subs.get(subscription)
        if sub is None:
            return None
        spec, now = sub.spec, self._now()
        busy = [d for d in self._of(subscription)
                if d.status == "InFlight" and d.lease_expires_at is not None and d.lease_expires_at > now]
        tokens = None
        if spec.rate_limit:
            bucket = self._store.buckets.get((subscription, False, ""))
            tokens = refill(None if bucket is None else bucket[0],
                            None if bucket is None else bucket[1].timestamp(), now.timestamp(),
                            parse_rate(spec.rate_limit))
        keys: set[str] = set()
        if spec.key_concurrency is not None and spec.partition_mode == "None":
            running: dict[str, int] = {}
            for d in busy:
                if d.partition_key is not None:
                    running[d.partition_key] = running.get(d.partition_key, 0) + 1
            keys |= {k for k, n in running.items() if n >= spec.key_concurrency}
        if spec.key_rate_limit:
            key_rate = parse_rate(spec.key_rate_limit)
            keys |= {k for (name, per_key, k), (t, at) in self._store.buckets.items()
                     if name == subscription and per_key and refill(t, at.timestamp(), now.timestamp(), key_rate) < 1}
        full = ((spec.max_in_flight is not None and len(busy) >= spec.max_in_flight)
                or (tokens is not None and tokens < 1))
        topic = self._store.topics.get(spec.topic)
        paused = sub.status == "Paused" or (topic is not None and topic.status == "Paused")
        waiting = [] if paused else [d for d in self._claimable(subscription, now) if full or d.partition_key in keys]
        return FlowState(subscription=subscription, in_flight=min(len(busy), cap), tokens=tokens,
                         keys_at_limit=min(len(keys), cap), waiting=min(len(waiting), cap), cap=cap)

    def _held(self, delivery_id: str, token: str) -> _Delivery | None:
        d = self._store.deliveries.get(_number(delivery_id))
        if d is None or d.status != "InFlight" or d.lease_token != str(token):
            return None
        return d

    async def heartbeat(self, requests: Sequence[HeartbeatRequest]) -> list[HeartbeatResult]:
        now = self._now()
        out = []
        for r in requests:
            d = self._held(r.delivery_id, r.lease_token)
            if d is None:
                out.append(HeartbeatResult(r.delivery_id, alive=False, cancel_requested=False))
                continue
            sub = self._store.subs[d.subscription]
            # (a cancel-requested one too: its handler is winding down, and its key stays busy)
            d.lease_expires_at = now + timedelta(seconds=granted_lease(r.lease_seconds, sub.spec.lease_seconds))
            if r.percent is not None:
                d.progress_percent = r.percent
            if r.message is not None:
                d.progress_message = r.message
            out.append(HeartbeatResult(r.delivery_id, alive=not d.cancel_requested,
                                       cancel_requested=d.cancel_requested, lease_expires_at=d.lease_expires_at))
        return out

    async def settle(self, settlements: Sequence[Settlement]) -> list[SettleResult]:
        now = self._now()
        results: list[SettleResult] = []
        woken: list[str] = []
        for s in settlements:
            d = self._held(s.delivery_id, s.lease_token)
            if d is None:
                results.append("LeaseLost")
                continue
            delay = settle_delay(s.delay_seconds)
            t = settle_transition(
                s.kind, attempt=d.attempt, max_attempts=d.max_attempts, now=now, backoff=d.backoff, draw=self._draw,
                delay=delay, reason=s.reason, error=s.error, cancel_requested=d.cancel_requested,
                current_reason=d.reason, current_error=d.last_error,
            )
            self._apply(d, t, now)
            results.append(t.status)
            woken.append(d.subscription)
        self._wake(woken)
        return results

    def _apply(self, d: _Delivery, t: Transition, now: datetime) -> None:
        d.status, d.attempt, d.reason, d.last_error = t.status, t.attempt, t.reason, t.last_error
        d.lease_token = d.lease_expires_at = None
        if t.visible_at is not None:
            d.visible_at = t.visible_at
        d.settled_at = now if t.terminal else None
        if t.terminal:
            self._ended(d, now)

    def _ended(self, d: _Delivery, at: datetime) -> None:
        """A delivery ended: a group member's first end counts, and the last releases the group's
        held message (as the databases' delivery_ended trigger does)."""
        group = self._store.groups.get(d.group_id) if d.group_id is not None else None
        if group is None or d.message_id in group.ended:
            return
        group.ended[d.message_id] = at
        if len(group.ended) == len(group.members) and group.released_at is None:
            self._release(group, at)

    def _release(self, group: _Group, at: datetime) -> None:
        group.released_at = at
        woken = []
        for d in self._store.deliveries.values():
            if d.message_id == group.then and d.status == "Pending" and d.mode == "None":
                d.visible_at = at
                woken.append(d.subscription)
        self._wake(woken)

    async def settle_together(self, settlements: Sequence[Settlement]) -> list[SettleResult] | None:
        """None: each goes through :meth:`settle_with_follow_ups` (all in memory, one call costs nothing)."""
        return None

    async def settle_with_follow_ups(self, settlement: Settlement) -> SettleResult:
        """Settles one delivery and, only when that completes it, keeps its result and publishes
        its follow-ups, all or nothing: a follow-up the publish refuses leaves the delivery InFlight and raises a
        :class:`TransportError` that names it."""
        s = settlement
        if s.kind == "Complete" and s.follow_ups:
            d = self._held(s.delivery_id, s.lease_token)
            if d is None:
                return "LeaseLost"
            if not d.cancel_requested:
                self._check_follow_ups(s)
        [result] = await self.settle([s])
        if result in FREES_KEYS:
            for topic, key, message_id in s.frees:
                await self.release_deduplication_key(topic, key, message_id)
        if result == "Completed":
            if s.result_json is not None:
                d = self._store.deliveries.get(_number(s.delivery_id))
                if d is not None:
                    self._store.results[d.message_id] = s.result_json
            for follow_up in s.follow_ups:
                self._publish(follow_up.topic, follow_up.messages)
        return result

    def _check_follow_ups(self, s: Settlement) -> None:
        """Raises when a follow-up would be refused, before anything is written (the rollback)."""
        for follow_up in s.follow_ups:
            answers = self._dry_run(follow_up.topic, follow_up.messages)
            refused = [(m, a) for m, a in zip(follow_up.messages, answers, strict=True)
                       if a.status not in (PublishStatus.ACCEPTED, PublishStatus.DUPLICATE)]
            if refused:
                message, answer = next(((m, a) for m, a in refused
                                        if a.error is None or a.error.code != "BatchAborted"), refused[0])
                raise TransportError(follow_up_refused(s.delivery_id, follow_up.topic, message, answer))

    def _dry_run(self, topic: str, messages: Sequence[PreparedMessage]) -> list[PublishResult]:
        """What a publish would answer, writing nothing."""
        store = self._store
        saved = (dict(store.messages), dict(store.deliveries), dict(store.deduplication), store.last_id,
                 store.wakeups)
        store.wakeups = []
        try:
            return self._publish(topic, messages)
        finally:
            store.messages, store.deliveries, store.deduplication, store.last_id, store.wakeups = saved

    # -- once markers --------------------------------------------------------------------------

    async def once_begin(self, key: str, running_seconds: float) -> tuple[str, str | None]:
        now = self._now()
        held = self._store.once.get(key)
        if held is not None and held[2] > now:
            return ("Done" if held[0] == "Done" else "Busy"), None
        token = str(uuid.uuid4())
        self._store.once[key] = ("Running", token, now + timedelta(seconds=running_seconds))
        return "Run", token

    async def once_finish(self, key: str, token: str, ttl_seconds: float) -> bool:
        held = self._store.once.get(key)
        if held is None or held[0] != "Running" or held[1] != str(token):
            return False
        self._store.once[key] = ("Done", held[1], self._now() + timedelta(seconds=ttl_seconds))
        return True

    async def once_abort(self, key: str, token: str) -> bool:
        held = self._store.once.get(key)
        if held is None or held[0] != "Running" or held[1] != str(token):
            return False
        del self._store.once[key]
        return True

    async def once_renew(self, key: str, token: str, running_seconds: float) -> bool:
        held = self._store.once.get(key)
        if held is None or held[0] != "Running" or held[1] != str(token):
            return False
        self._store.once[key] = ("Running", held[1], self._now() + timedelta(seconds=running_seconds))
        return True

    # -- deduplication keys and step results -----------------------------------------------------

    async def release_deduplication_key(self, topic: str, key: str, message_id: uuid.UUID, *,
                                        session: Any = None) -> bool:
        """Frees ``key`` of ``topic`` if ``message_id`` holds it; True when it held it (live). (No
        caller's transaction exists here: a ``session`` is not read.)"""
        held = self._store.deduplication.get((topic, key))
        if held is None or held[0] != message_id:
            return False
        del self._store.deduplication[(topic, key)]
        return held[1] > self._now()

    async def step_get(self, message_id: uuid.UUID, name: str) -> tuple[bool, str | None]:
        """(True, the stored JSON) of step ``name`` of the message's work, or (False, None)."""
        value = self._store.steps.get((message_id, name))
        return (False, None) if value is None else (True, value)

    async def step_put(self, message_id: uuid.UUID, name: str, value_json: str) -> None:
        """Stores a step's JSON result unless one is stored already (the first write wins)."""
        if not isinstance(value_json, str):
            raise TypeError(f"step_put stores JSON text; serialize the value first, got {type(value_json).__name__}")
        if message_id not in self._store.messages:
            raise TransportError(
                f"step put: message {message_id} is not stored (never published, or purged): a step result belongs "
                "to a stored message"
            )
        self._store.steps.setdefault((message_id, name), value_json)

    # -- results -------------------------------------------------------------------------------

    async def result_get(self, message_id: uuid.UUID) -> str | None:
        """The JSON text kept when the message's delivery completed with a result, or None."""
        return self._store.results.get(message_id)

    async def debounce(self, topic: str, key: str, message: PreparedMessage, seconds: float, *,
                       session: Any = None) -> uuid.UUID | None:
        """The pending message holding ``topic``'s ``key`` takes ``message``'s payload and comes due
        ``seconds`` from now while it still waits out its window (its MessageID); else the key is
        freed and None answered."""
        if session is not None:
            raise ConfigurationError(
                "the memory transport cannot debounce in a caller's database transaction (session=...); dispatch "
                "without a session"
            )
        store, now = self._store, self._now()
        held = store.deduplication.get((topic, key))
        if held is None:
            return None
        message_id = held[0]
        deliveries = [d for d in store.deliveries.values() if d.message_id == message_id]
        if not deliveries or not all(d.status == "Pending" and d.mode == "None" and d.claimed_at is None
                                     and d.visible_at > now for d in deliveries):
            del store.deduplication[(topic, key)]
            return None
        known = store.topics.get(topic)
        cap = known.topic.max_payload_bytes if known is not None else None
        if cap is not None and message.envelope_bytes > cap:
            raise TransportError(
                f"debounce: the debounced envelope is {message.envelope_bytes} bytes; topic '{topic}' accepts at "
                f"most {cap} bytes (max_payload_bytes)"
            )
        stored = store.messages[message_id]
        stored.payload_json, stored.content_hash = message.payload_json, message.content_hash
        due = now + timedelta(seconds=seconds)
        for d in deliveries:
            d.visible_at = due
        store.deduplication[(topic, key)] = (message_id, due)
        return message_id

    async def group_create(self, group_id: uuid.UUID, members: Sequence[uuid.UUID], then: uuid.UUID, *,
                           session: Any = None) -> int:
        """Makes ``members`` a group whose end releases the held message ``then``; answers how many
        members have not ended."""
        if session is not None:
            raise ConfigurationError(
                "the memory transport cannot make a group in a caller's database transaction (session=...); make "
                "it without a session"
            )
        store, now = self._store, self._now()
        group = store.groups[group_id] = _Group(then, list(members))
        live: set[uuid.UUID] = set()
        for d in store.deliveries.values():
            if d.message_id in group.members:
                d.group_id = group_id
                if d.status in ("Pending", "InFlight"):
                    live.add(d.message_id)
        group.ended.update((m, now) for m in group.members if m not in live)
        if len(group.ended) == len(group.members):
            self._release(group, now)
        return len(group.members) - len(group.ended)

    async def group_members(self, group_id: uuid.UUID) -> list[GroupMember]:
        """The members of a group, in order, each with its first delivery and stored result."""
        group = self._store.groups.get(group_id)
        if group is None:
            return []
        out = []
        for message_id in group.members:
            first = min((d for d in self._store.deliveries.values() if d.message_id == message_id),
                        key=lambda d: d.id, default=None)
            out.append(GroupMember(message_id=message_id, ended_at=group.ended.get(message_id),
                                   delivery=None if first is None else self._info(first, False),
                                   result=self._store.results.get(message_id)))
        return out

    # -- housekeeping --------------------------------------------------------------------------

    def hold_sweep_lock(self) -> _SweepLock:
        """Holds the sweep lock as another process's pass would (``async with``): a sweep in the
        meantime does not run (the conformance suite's C32)."""
        return _SweepLock(self._store)

    async def sweep(self, limit: int = 1000) -> SweepReport:
        """One pass: expires leases that ran out (the lifecycle's expiry transition), then purges
        what retention lets go. ``ran`` is False while the sweep lock is held."""
        store = self._store
        if store.sweep_lock_holders:
            return SweepReport(ran=False)
        now = self._now()
        expired = sorted((d for d in store.deliveries.values()
                          if d.status == "InFlight" and d.lease_expires_at is not None and d.lease_expires_at < now),
                         key=lambda d: (d.lease_expires_at or now, d.id))[:limit]
        taken: list[TakenBack] = []
        for d in expired:
            t = expire_transition(attempt=d.attempt, max_attempts=d.max_attempts, now=now, backoff=d.backoff,
                                  draw=self._draw, cancel_requested=d.cancel_requested, current_reason=d.reason,
                                  current_error=d.last_error)
            self._apply(d, t, now)
            taken.append(TakenBack(delivery_id=str(d.id), subscription=d.subscription, result=t.status,
                                   attempt=d.attempt, holder=self._holder(d)))
        purged_deliveries = self._purge_deliveries(now, limit)
        purged_messages = self._purge_messages(now, limit)
        gone = [k for k, (_, expires) in store.deduplication.items() if expires <= now][:limit]
        for k in gone:
            del store.deduplication[k]
        for key in [k for k, (_, _, expires) in store.once.items() if expires <= now][:limit]:
            del store.once[key]
        self._purge_buckets(now, limit)
        self._wake(d.subscription for d in expired if d.status == "Pending")
        return SweepReport(
            ran=True, retried=sum(t.result == "Pending" for t in taken),
            dead_lettered=sum(t.result == "DeadLettered" for t in taken),
            discarded=sum(t.result == "Discarded" for t in taken), purged_deliveries=purged_deliveries,
            purged_messages=purged_messages, purged_deduplication=len(gone), taken_back=taken,
        )

    def _purge_buckets(self, now: datetime, limit: int) -> None:
        """Token buckets full again (idle), or of a subscription without such a limit any more."""
        store = self._store
        idle = []
        for (name, per_key, key), (_, updated_at) in store.buckets.items():
            sub = store.subs.get(name)
            text = None if sub is None else sub.spec.key_rate_limit if per_key else sub.spec.rate_limit
            rate = parse_rate(text) if text else None
            if rate is None or updated_at + timedelta(seconds=rate.burst / rate.per_second) <= now:
                idle.append((name, per_key, key))
        for bucket in idle[:limit]:
            del store.buckets[bucket]

    def _purge_deliveries(self, now: datetime, limit: int) -> int:
        store = self._store
        gone = [d for d in store.deliveries.values()
                if d.status in ("Completed", "Discarded") and d.settled_at is not None
                and d.settled_at < now - timedelta(seconds=store.subs[d.subscription].spec.retention_seconds)]
        gone.sort(key=lambda d: (d.settled_at or now, d.id))
        for d in gone[:limit]:
            del store.deliveries[d.id]
        return len(gone[:limit])

    def _purge_messages(self, now: datetime, limit: int) -> int:
        store = self._store
        referred = {d.message_id for d in store.deliveries.values()}
        retention: dict[str, float] = {}
        for sub in store.subs.values():
            retention[sub.spec.topic] = max(retention.get(sub.spec.topic, 0.0), sub.spec.retention_seconds)
        gone = [m for m in store.messages.values() if m.id not in referred
                and m.published_at < now - timedelta(seconds=retention.get(m.topic, _WEEK))]
        gone.sort(key=lambda m: m.published_at)
        for m in gone[:limit]:
            del store.messages[m.id]
            for step in [k for k in store.steps if k[0] == m.id]:
                del store.steps[step]
            store.results.pop(m.id, None)
            for group_id in [g for g, group in store.groups.items() if group.then == m.id]:
                del store.groups[group_id]
        return len(gone[:limit])

    async def prune(self, older_than_seconds: float) -> int:
        """Removes Completed and Discarded deliveries settled more than ``older_than_seconds`` ago."""
        store = self._store
        cutoff = self._now() - timedelta(seconds=older_than_seconds)
        gone = [i for i, d in store.deliveries.items()
                if d.status in ("Completed", "Discarded") and d.settled_at is not None and d.settled_at < cutoff]
        for i in gone:
            del store.deliveries[i]
        return len(gone)

    # -- operate -------------------------------------------------------------------------------

    def _claimable_count(self, sub: _Sub, now: datetime) -> int:
        return len(self._claimable(sub.spec.name, now))

    async def stats(self, subscription: str | None = None) -> list[SubscriptionStats]:
        now = self._now()
        out = []
        for sub in sorted(self._store.subs.values(), key=lambda s: s.spec.name):
            if subscription is not None and sub.spec.name != subscription:
                continue
            ds = self._of(sub.spec.name)
            count = {status: sum(d.status == status for d in ds) for status in
                     ("Pending", "InFlight", "DeadLettered", "Completed", "Discarded")}
            pending = [d.visible_at for d in ds if d.status == "Pending" and d.visible_at <= now]
            out.append(SubscriptionStats(
                subscription=sub.spec.name, topic=sub.spec.topic, status=sub.status,
                partition_mode=sub.spec.partition_mode, pending=count["Pending"],
                claimable=self._claimable_count(sub, now) if self._active(sub.spec.name) else 0,
                in_flight=count["InFlight"],
                dead_lettered=count["DeadLettered"], completed=count["Completed"], discarded=count["Discarded"],
                oldest_pending_at=min(pending) if pending else None,
            ))
        return out

    async def backlog(self, subscription: str) -> Backlog | None:
        sub = self._store.subs.get(subscription)
        if sub is None:
            return None
        claimable = self._claimable_count(sub, self._now()) if self._active(subscription) else 0
        in_flight = sum(d.status == "InFlight" for d in self._of(subscription))
        return Backlog(subscription=subscription, claimable=claimable, in_flight=in_flight,
                       backlog=claimable + in_flight)

    def _info(self, d: _Delivery, include_payload: bool) -> DeliveryInfo:
        m = self._store.messages[d.message_id]
        return DeliveryInfo(
            delivery_id=str(d.id), subscription=d.subscription, message_id=d.message_id, topic=m.topic,
            partition_key=d.partition_key, status=d.status, attempt=d.attempt, max_attempts=d.max_attempts,
            reason=d.reason, last_error=d.last_error, note=d.note, cancel_requested=d.cancel_requested,
            progress_percent=d.progress_percent, progress_message=d.progress_message, visible_at=d.visible_at,
            lease_expires_at=d.lease_expires_at, created_at=d.created_at, claimed_at=d.claimed_at,
            settled_at=d.settled_at, attributes=dict(m.attributes), correlation_id=m.correlation_id,
            payload=json.loads(m.payload_json) if include_payload and m.payload_json is not None else None,
            trace_id=trace_id_of(m.headers) if m.headers else None, holder=self._holder(d),
        )

    def _holder(self, d: _Delivery) -> Holder | None:
        if d.held_by is None:
            return None
        known = self._store.processes.get(d.held_by)
        if known is None:
            return Holder(process_id=d.held_by)
        me = known.beat.identity
        return Holder(process_id=me.id, hostname=me.hostname, pid=me.pid, started_at=me.started_at)

    # -- the process registry ------------------------------------------------------------------

    async def process_beat(self, beat: ProcessBeat) -> None:
        """Writes or renews the process's row."""
        self._store.processes[beat.identity.id] = _Process(beat, self._now())

    async def process_stop(self, process_id: uuid.UUID) -> None:
        """Marks the process stopped (its row stays: the deliveries it held name it)."""
        known = self._store.processes.get(process_id)
        if known is not None:
            known.stopped_at = self._now()

    async def list_processes(self) -> list[ProcessInfo]:
        """The known processes, live ones first."""
        now = self._now()
        out = []
        for p in self._store.processes.values():
            me = p.beat.identity
            gone = p.last_seen_at < now - timedelta(seconds=3 * p.beat.interval_seconds)
            out.append(ProcessInfo(
                process_id=me.id, hostname=me.hostname, pid=me.pid, started_at=me.started_at,
                version=package_version(), subscriptions=list(p.beat.subscriptions), slots=p.beat.slots,
                busy=p.beat.busy, last_seen_at=p.last_seen_at, stopped_at=p.stopped_at,
                state="Stopped" if p.stopped_at is not None else "Gone" if gone else "Running",
                in_flight=sum(d.status == "InFlight" and d.held_by == me.id for d in self._store.deliveries.values()),
            ))
        out.sort(key=lambda i: (i.stopped_at is not None, -i.last_seen_at.timestamp(), str(i.process_id)))
        return out

    async def get_delivery(self, delivery_id: str, *, include_payload: bool = False) -> DeliveryInfo | None:
        d = self._store.deliveries.get(_number(delivery_id))
        return None if d is None else self._info(d, include_payload)

    async def known_messages(self, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """Which of these MessageIDs the store has."""
        return {i for i in ids if i in self._store.messages}

    async def message_deliveries(self, message_id: uuid.UUID, *, include_payload: bool = False) -> list[DeliveryInfo]:
        """Every delivery of one message, each with its subscription, as get_delivery answers."""
        return [self._info(d, include_payload) for d in self._store.deliveries.values() if d.message_id == message_id]

    async def list_deliveries(
        self,
        subscription: str,
        status: DeliveryStatus,
        *,
        limit: int = 100,
        after: str | None = None,
        include_payload: bool = False,
    ) -> list[DeliveryInfo]:
        if after and not (after.isascii() and after.isdigit()):
            return []  # (another transport's id, aws:...: this subscription gave none such)
        after_id = max(int(after), 0) if after else 0
        found = [d for d in self._of(subscription) if d.status == status and d.id > after_id]
        return [self._info(d, include_payload) for d in sorted(found, key=lambda d: d.id)[:limit]]

    async def partitions(
        self, subscription: str, condition: PartitionCondition | None = None, *, limit: int = 100
    ) -> list[PartitionInfo]:
        now = self._now()
        keys: dict[str, list[_Delivery]] = {}
        for d in self._of(subscription):
            if d.mode != "None":
                keys.setdefault(d.partition_key or "", []).append(d)
        out = []
        for key, ds in sorted(keys.items()):
            live = [d for d in ds if d.status in _LIVE]
            if not live:
                continue
            mode = ds[0].mode
            in_flight = next((d for d in ds if d.status == "InFlight"), None)
            head: _Delivery | None
            if in_flight is not None and mode == "Exclusive":
                cond, head = "InFlight", in_flight
            elif mode == "Ordered":
                head = live[0]
                blocked = head.status == "DeadLettered" or (
                    head.status == "Pending" and head.attempt > 0 and head.visible_at > now)
                cond = "InFlight" if head.status == "InFlight" else "Blocked" if blocked else "Idle"
            else:
                pending = sorted((d for d in ds if d.status == "Pending"), key=lambda d: (d.visible_at, d.id))
                if not pending:
                    continue
                cond, head = "Idle", pending[0]
            if condition is not None and cond != condition:
                continue
            waiting = sum(d.status == "Pending" and d is not head for d in ds)
            out.append(PartitionInfo(partition_key=key, condition=cond,
                                     head_delivery_id=str(head.id), head_status=head.status,
                                     head_attempt=head.attempt, head_visible_at=head.visible_at,
                                     waiting_items=waiting))
        return out[:limit]

    def _find(self, subscription: str, delivery_id: str) -> _Delivery | None:
        d = self._store.deliveries.get(_number(delivery_id))
        return d if d is not None and d.subscription == subscription else None

    async def replay(self, subscription: str, delivery_id: str, note: str | None = None) -> ActionResult:
        d = self._find(subscription, delivery_id)
        if d is None:
            return ActionResult(result="NotFound", delivery_id=delivery_id, subscription=subscription)
        if d.status != "DeadLettered":
            return ActionResult(result="NotDeadLettered", delivery_id=delivery_id, subscription=subscription,
                                status=d.status, cancel_requested=d.cancel_requested)
        d.status, d.attempt, d.visible_at, d.note, d.reason = "Pending", 0, self._now(), note, None
        d.settled_at, d.cancel_requested = None, False
        self._wake([subscription])
        return ActionResult(result="Replayed", delivery_id=delivery_id, subscription=subscription, status="Pending")

    async def discard(self, subscription: str, delivery_id: str, reason: str | None = None) -> ActionResult:
        d = self._find(subscription, delivery_id)
        base = {"delivery_id": delivery_id, "subscription": subscription}
        if d is None:
            return ActionResult(result="NotFound", **base)
        if d.status == "InFlight":
            if not d.cancel_requested:  # (a second cancel keeps the first one's reason)
                d.cancel_requested, d.reason = True, reason
            return ActionResult(result="CancelRequested", cancel_requested=True, status="InFlight", **base)
        if d.status in ("Pending", "DeadLettered"):
            self._discard(d, reason)
            return ActionResult(result="Discarded", status="Discarded", **base)
        return ActionResult(result="AlreadyTerminal", status=d.status, **base)

    def _discard(self, d: _Delivery, reason: str | None) -> None:
        d.status, d.reason, d.settled_at = "Discarded", reason, self._now()
        d.lease_token = d.lease_expires_at = None
        self._ended(d, d.settled_at)
        self._wake([d.subscription])

    async def discard_dead_letters(self, subscription: str, settled_before: datetime, limit: int = 1000) -> int:
        """Discards the subscription's DeadLettered deliveries settled before ``settled_before``
        (reason ``pruned``); returns how many it discarded."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if settled_before.tzinfo is None:
            raise ValueError(
                "settled_before must be an aware datetime, e.g. datetime.now(UTC) - timedelta(days=7); "
                f"got {settled_before!r} without a time zone"
            )
        dead = [d for d in self._of(subscription)
                if d.status == "DeadLettered" and d.settled_at is not None and d.settled_at < settled_before]
        for d in dead:
            self._discard(d, "pruned")
        return len(dead)

    async def rewrite_payload(
        self, message_id: uuid.UUID, payload_json: str, content_hash: str, envelope_bytes: int
    ) -> bool:
        """Replaces a stored message's payload while none of its deliveries is InFlight, Completed
        or Discarded; False when it did not rewrite."""
        if envelope_bytes > MAX_ENVELOPE_BYTES:
            raise ValueError(
                f"the rewritten envelope is {envelope_bytes} bytes; a message holds at most {MAX_ENVELOPE_BYTES} "
                "(MAX_ENVELOPE_BYTES)"
            )
        m = self._store.messages.get(message_id)
        if m is None:
            return False
        cap = self._store.topics[m.topic].topic.max_payload_bytes if m.topic in self._store.topics else None
        if cap is not None and envelope_bytes > cap:
            raise TransportError(
                f"rewrite payload: the rewritten envelope is {envelope_bytes} bytes; topic '{m.topic}' accepts at "
                f"most {cap} bytes (max_payload_bytes)"
            )
        if any(d.message_id == message_id and d.status in ("InFlight", "Completed", "Discarded")
               for d in self._store.deliveries.values()):
            return False
        m.payload_json, m.content_hash = payload_json, content_hash
        return True

    async def validate_bindings(self) -> BindingReport:
        """Nothing to bind: always ok, with a note that the store is this process's memory."""
        return BindingReport(transport=self.name, ok=True, issues=[BindingIssue(
            severity="Info", subject="memory", message="the queue lives in this process's memory (tests only)")])


class _SweepLock:
    def __init__(self, store: _Store) -> None:
        self._store = store

    async def __aenter__(self) -> None:
        self._store.sweep_lock_holders += 1

    async def __aexit__(self, *exc: object) -> None:
        self._store.sweep_lock_holders -= 1


def _number(delivery_id: str) -> int:
    """The id as the store keeps it; 0 (no delivery) unless written as the listings write ids."""
    text = str(delivery_id)
    return int(text) if text.isascii() and text.isdigit() and not text.startswith("0") else 0


def _refused(message_id: uuid.UUID, code: str, text: str,
             status: PublishStatus = PublishStatus.REJECTED) -> PublishResult:
    return PublishResult(status=status, message_id=message_id, error=PublishError(code=code, message=text))
