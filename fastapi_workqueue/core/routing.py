"""A transport per topic: the routing transport sends each topic and its subscriptions to the
transport its ``Topic.transport`` names, and merges the operator views of all of them.

Transports other than ``database`` are found by name in the entry point group
``fastapi_workqueue.transports`` (``aws = "fastapi_workqueue.aws.transport:create_transport"``):
each entry is a callable ``create_transport(kernel) -> Transport`` that is given the queue's
:class:`~.kernel.Kernel` (its settings, topology and sessions), so the core imports none of them.
Deliveries of such a transport carry its name as a prefix of their ids (``aws:…``), which is how
heartbeats, settles and ``get_delivery`` find their transport.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from .attempts import AttemptInfo
from .envelope import PreparedMessage, PublishResult
from .errors import ConfigurationError, TransportError
from .ports import Ports, interrupter_of
from .processes import ProcessBeat, ProcessInfo
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
from .search import FoundDelivery
from .topology import Subscription, SubscriptionState, SubscriptionStatus, Topic
from .transport import (
    Capabilities,
    ClaimedDelivery,
    HeartbeatRequest,
    HeartbeatResult,
    Settlement,
    SettleResult,
    Transport,
    WakeupListener,
)

if TYPE_CHECKING:
    from .kernel import Kernel

ENTRY_POINT_GROUP = "fastapi_workqueue.transports"
DATABASE = "database"


def transport_factory(name: str) -> Callable[[Kernel], Transport]:
    """The ``create_transport(kernel)`` of the transport registered under ``name``."""
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        known = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | {DATABASE})
        hint = " (install fastapi-workqueue[aws])" if name == "aws" else ""
        raise ConfigurationError(
            f"no transport named {name!r} is installed{hint}; Topic.transport must be one of {known}"
        )
    try:
        factory: Callable[[Kernel], Transport] = found[0].load()
    except ImportError as exc:
        raise ConfigurationError(
            f"the {name!r} transport cannot be loaded ({exc}); install fastapi-workqueue[{name}]"
        ) from exc
    return factory


class RoutingTransport:
    """Routes by topic and subscription; the database transport keeps what only it stores (once
    markers, steps, deduplication keys, jobs)."""

    name = "routing"

    def __init__(
        self,
        default: Transport | None,
        others: dict[str, Transport],
        topics: dict[str, str],
        subscriptions: dict[str, str],
    ) -> None:
        self.default = default
        self.others = others
        self._ports = {id(t): Ports.of(t) for t in self._all()}
        """Each part's optional parts, resolved once."""
        database = self._ports[id(default)] if default is not None else None
        self._registry = database.processes if database is not None else None
        """The database's process registry: processes are the app's, not a topic's."""
        self._search = database.search if database is not None else None
        """The database's search (deliveries on a broker are found by their id only)."""
        self._topics = dict(topics)
        self._subscriptions = dict(subscriptions)
        base = default.capabilities if default is not None else Capabilities()
        self.capabilities = Capabilities(
            ordered=base.ordered, exclusive=base.exclusive, transactional_publish=base.transactional_publish,
            wakeups=base.wakeups, runtime_roles=base.runtime_roles, notes=base.notes,
            savepoint_retry=base.savepoint_retry,  # (the jobs layer's writes go to the database)
            message_state=default is not None and base.message_state,
            sweeps=any(t.capabilities.sweeps for t in self._all()),
            # What holds for some subscriptions only is not claimed for the queue as a whole (the
            # host and the operator calls ask the transport of each subscription).
            cancel=all(t.capabilities.cancel for t in self._all()),
            exact_backlog=all(t.capabilities.exact_backlog for t in self._all()),
            terminal_counts=all(t.capabilities.terminal_counts for t in self._all()),
            retry_keeps_key_busy=any(t.capabilities.retry_keeps_key_busy for t in self._all()),
            priority=all(t.capabilities.priority for t in self._all()),
            concurrency_limits=all(t.capabilities.concurrency_limits for t in self._all()),
            rate_limits=all(t.capabilities.rate_limits for t in self._all()),
        )

    # -- routing ---------------------------------------------------------------------------------

    def _named(self, name: str) -> Transport:
        if name == DATABASE:
            if self.default is None:
                raise ConfigurationError(
                    "a database topic needs a database: set WORKQUEUE_DATABASE_URL, or give the topic another transport"
                )
            return self.default
        return self.others[name]

    @property
    def database(self) -> Transport:
        """The database transport (ConfigurationError when the queue has none)."""
        return self._named(DATABASE)

    def transport_for_topic(self, topic: str) -> Transport:
        return self._named(self._topics.get(topic, DATABASE))

    def transport_for_subscription(self, subscription: str) -> Transport:
        return self._named(self._subscriptions.get(subscription, DATABASE))

    def ports_for_topic(self, topic: str) -> Ports:
        return self._ports[id(self.transport_for_topic(topic))]

    def ports_for_subscription(self, subscription: str) -> Ports:
        return self._ports[id(self.transport_for_subscription(subscription))]

    def ports_for_delivery(self, delivery_id: str) -> Ports:
        return self._ports[id(self.transport_for_delivery(delivery_id))]

    def transport_for_delivery(self, delivery_id: str) -> Transport:
        prefix, sep, _ = delivery_id.partition(":")
        if sep and prefix in self.others:
            return self.others[prefix]
        return self.database

    def _all(self) -> list[Transport]:
        return ([self.default] if self.default is not None else []) + list(self.others.values())

    # -- lifecycle -------------------------------------------------------------------------------

    async def open(self) -> None:
        opened: list[Transport] = []
        try:
            for transport in self._all():
                await transport.open()
                opened.append(transport)
        except BaseException:
            for transport in opened:
                await transport.close()
            raise

    async def close(self) -> None:
        for transport in reversed(self._all()):
            await transport.close()

    async def migrate(self) -> list[str]:
        return [] if self.default is None else await self.default.migrate()

    # -- topology --------------------------------------------------------------------------------

    async def sync_topology(self, topics: Sequence[Topic], subscriptions: Sequence[Subscription]) -> None:
        for name in {DATABASE, *self.others}:
            mine = [t for t in topics if (t.transport if t.transport in self.others else DATABASE) == name]
            names = {t.name for t in mine}
            subs = [s for s in subscriptions if s.topic in names]
            if mine or subs:
                await self._named(name).sync_topology(mine, subs)
        await self._record_moves([t for t in topics if t.transport in self.others])

    async def _record_moves(self, topics: Sequence[Topic]) -> None:
        """Records in the database that these topics, which it holds as database topics from
        before, are now on another transport: their old rows are no longer run or listed as the
        database's, and the CLI on the database alone refuses them."""
        if self.default is None or not topics:
            return
        held = {t.name: t for t in await self.default.list_topics()}
        moved = [t for t in topics if t.name in held and held[t.name].transport != t.transport]
        if moved:
            await self.default.sync_topology(moved, [])

    def _pairs(self) -> list[tuple[str, Transport]]:
        """Each transport with the name topics give it."""
        return ([(DATABASE, self.default)] if self.default is not None else []) + list(self.others.items())

    def _route(self, subscription: str, listed_by: str, transport_name: str = DATABASE) -> str:
        """The transport a subscription is on: the one its declared topic names, else (a row the
        database holds that this queue does not declare) the one its topic row names."""
        return self._subscriptions.get(subscription, transport_name if listed_by == DATABASE else listed_by)

    async def list_subscriptions(self) -> list[SubscriptionState]:
        """Each subscription once, as the transport it is on lists it: the database's rows of a
        subscription whose topic moved to another transport are not run from there."""
        found: list[SubscriptionState] = []
        seen: set[str] = set()
        for name, transport in self._pairs():
            for state in await transport.list_subscriptions():
                if self._route(state.name, name, state.transport_name) == name and state.name not in seen:
                    seen.add(state.name)
                    found.append(state)
        return found

    async def list_topics(self) -> list[Topic]:
        found: list[Topic] = []
        seen: set[str] = set()
        for name, transport in self._pairs():
            for topic in await transport.list_topics():
                route = self._topics.get(topic.name, topic.transport if name == DATABASE else name)
                if route == name and topic.name not in seen:
                    seen.add(topic.name)
                    found.append(topic)
        return found

    async def set_subscription_status(self, subscription: str, status: SubscriptionStatus) -> bool | None:
        return await self.transport_for_subscription(subscription).set_subscription_status(subscription, status)

    # -- publish and consume ---------------------------------------------------------------------

    async def publish(
        self, topic: str, messages: Sequence[PreparedMessage], *, session: Any = None
    ) -> list[PublishResult]:
        return await self.transport_for_topic(topic).publish(topic, messages, session=session)

    async def claim(self, subscription: str, limit: int) -> list[ClaimedDelivery]:
        return await self.transport_for_subscription(subscription).claim(subscription, limit)

    async def claim_many(self, subscriptions: Sequence[str], limit: int) -> list[tuple[str, ClaimedDelivery]]:
        serving = {id(self.transport_for_subscription(s)): self.transport_for_subscription(s) for s in subscriptions}
        if len(serving) > 1:
            raise ValueError("one claim cannot span subscriptions of different transports; group them per transport")
        [transport] = serving.values() if serving else [self.database]
        return await transport.claim_many(subscriptions, limit)

    def _split(self, ids: Sequence[str]) -> dict[int, tuple[Transport, list[int]]]:
        groups: dict[int, tuple[Transport, list[int]]] = {}
        for index, delivery_id in enumerate(ids):
            transport = self.transport_for_delivery(delivery_id)
            groups.setdefault(id(transport), (transport, []))[1].append(index)
        return groups

    async def heartbeat(self, requests: Sequence[HeartbeatRequest]) -> list[HeartbeatResult]:
        results: list[HeartbeatResult | None] = [None] * len(requests)
        for transport, indexes in self._split([r.delivery_id for r in requests]).values():
            answers = await transport.heartbeat([requests[i] for i in indexes])
            for i, answer in zip(indexes, answers, strict=True):
                results[i] = answer
        return [r for r in results if r is not None]

    async def settle(self, settlements: Sequence[Settlement]) -> list[SettleResult]:
        results: list[SettleResult | None] = [None] * len(settlements)
        for transport, indexes in self._split([s.delivery_id for s in settlements]).values():
            answers = await transport.settle([settlements[i] for i in indexes])
            for i, answer in zip(indexes, answers, strict=True):
                results[i] = answer
        return [r for r in results if r is not None]

    async def settle_with_follow_ups(self, settlement: Settlement) -> SettleResult:
        return await self.transport_for_delivery(settlement.delivery_id).settle_with_follow_ups(settlement)

    async def settle_together(self, settlements: Sequence[Settlement]) -> list[SettleResult] | None:
        """The transport of these deliveries settles them together when they all have one; else None."""
        groups = self._split([s.delivery_id for s in settlements])
        if len(groups) != 1:
            return None
        [(transport, _)] = groups.values()
        return await transport.settle_together(settlements)

    def interrupt_claims(self, subscriptions: Sequence[str]) -> None:
        """Passes the interrupt on to the transports of these subscriptions whose claims wait."""
        by_transport: dict[int, tuple[Transport, list[str]]] = {}
        for name in subscriptions:
            try:
                transport = self.transport_for_subscription(name)
            except ConfigurationError:
                continue
            by_transport.setdefault(id(transport), (transport, []))[1].append(name)
        for transport, names in by_transport.values():
            interrupter = interrupter_of(transport)
            if interrupter is not None:
                interrupter.interrupt_claims(names)

    async def add_wakeup_listener(self, listener: WakeupListener) -> None:
        for transport in self._all():
            if transport.capabilities.wakeups:
                await transport.add_wakeup_listener(listener)

    # -- what only the database keeps ------------------------------------------------------------

    async def once_begin(self, key: str, running_seconds: float) -> tuple[str, str | None]:
        return await self.database.once_begin(key, running_seconds)

    async def once_finish(self, key: str, token: str, ttl_seconds: float) -> bool:
        return await self.database.once_finish(key, token, ttl_seconds)

    async def once_abort(self, key: str, token: str) -> bool:
        return await self.database.once_abort(key, token)

    async def once_renew(self, key: str, token: str, running_seconds: float) -> bool:
        return await self.database.once_renew(key, token, running_seconds)

    async def release_deduplication_key(self, topic: str, key: str, message_id: uuid.UUID, *,
                                        session: Any = None) -> bool:
        return await self.transport_for_topic(topic).release_deduplication_key(topic, key, message_id,
                                                                               session=session)

    async def step_get(self, message_id: uuid.UUID, name: str) -> tuple[bool, str | None]:
        return await self.database.step_get(message_id, name)

    async def step_put(self, message_id: uuid.UUID, name: str, value_json: str) -> None:
        await self.database.step_put(message_id, name, value_json)

    async def process_beat(self, beat: ProcessBeat) -> None:
        if self._registry is not None:
            await self._registry.process_beat(beat)

    async def process_stop(self, process_id: uuid.UUID) -> None:
        if self._registry is not None:
            await self._registry.process_stop(process_id)

    async def list_processes(self) -> list[ProcessInfo]:
        return await self._registry.list_processes() if self._registry is not None else []

    async def sweep(self, limit: int = 1000) -> SweepReport:
        """Sweeps each transport that sweeps (``capabilities.sweeps``); SQS expires its leases itself."""
        reports = [await t.sweep(limit) for t in self._all() if t.capabilities.sweeps]
        fields = ("retried", "dead_lettered", "discarded", "purged_deliveries", "purged_messages",
                  "purged_deduplication")
        return SweepReport(ran=any(r.ran for r in reports), taken_back=[t for r in reports for t in r.taken_back],
                           **{f: sum(getattr(r, f) for r in reports) for f in fields})

    # -- operate ---------------------------------------------------------------------------------

    async def stats(self, subscription: str | None = None) -> list[SubscriptionStats]:
        """Each subscription once, from the transport it is on; one whose topic moved there from
        the database, which still holds some of its deliveries, says so in its ``reason``."""
        rows: dict[str, SubscriptionStats] = {}
        left: dict[str, SubscriptionStats] = {}
        for name, transport in self._pairs():
            if subscription is not None and name not in (DATABASE, self._route(subscription, DATABASE)):
                continue
            for row in await transport.stats(subscription):
                route = self._route(row.subscription, name)
                if route != name:
                    left[row.subscription] = row  # the database's row of a moved subscription
                elif row.subscription not in rows:
                    rows[row.subscription] = row
        for sub, old in left.items():
            reason = moved_reason(old, self._route(sub, DATABASE))
            if reason is None:
                continue
            rows[sub] = rows.get(sub, old).model_copy(update={"reason": reason})
        return list(rows.values())

    async def backlog(self, subscription: str) -> Backlog | None:
        return await self.transport_for_subscription(subscription).backlog(subscription)

    async def get_delivery(self, delivery_id: str, *, include_payload: bool = False) -> DeliveryInfo | None:
        return await self.transport_for_delivery(delivery_id).get_delivery(delivery_id, include_payload=include_payload)

    async def delivery_attempts(self, delivery_id: str) -> list[AttemptInfo]:
        reader = self._ports[id(self.transport_for_delivery(delivery_id))].attempts
        return await reader.delivery_attempts(delivery_id) if reader is not None else []

    async def search_deliveries(self, query: str, *, limit: int = 25) -> list[FoundDelivery]:
        """The database's search; a delivery on a broker is found by its id only (a broker cannot
        be searched), as ``get_delivery`` finds it."""
        serving = self.transport_for_delivery(query)
        if serving is not self.database:
            info = await serving.get_delivery(query)
            return [] if info is None else [FoundDelivery(matched="delivery id", delivery=info)]
        if self._search is None:
            return []
        return await self._search.search_deliveries(query, limit=limit)

    async def known_messages(self, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        return await self.database.known_messages(ids)

    async def message_deliveries(self, message_id: uuid.UUID, *, include_payload: bool = False) -> list[DeliveryInfo]:
        return await self.database.message_deliveries(message_id, include_payload=include_payload)

    async def list_deliveries(
        self, subscription: str, status: DeliveryStatus, *, limit: int = 100, after: str | None = None,
        include_payload: bool = False,
    ) -> list[DeliveryInfo]:
        """The subscription's transport's listing; for a subscription whose topic moved from the
        database, what the database still holds of it first (its ids, then the new transport's)."""
        serving = self.transport_for_subscription(subscription)
        if self.default is None or serving is self.default:
            return await serving.list_deliveries(
                subscription, status, limit=limit, after=after, include_payload=include_payload)
        rows: list[DeliveryInfo] = []
        prefixed = after is not None and self.transport_for_delivery(after) is not self.default
        if not prefixed:
            rows = await self.default.list_deliveries(
                subscription, status, limit=limit, after=after, include_payload=include_payload)
        if len(rows) < limit:
            try:
                rows += await serving.list_deliveries(subscription, status, limit=limit - len(rows),
                                                      after=after if prefixed else None,
                                                      include_payload=include_payload)
            except TransportError:
                if not rows:
                    raise
        return rows

    async def partitions(
        self, subscription: str, condition: PartitionCondition | None = None, *, limit: int = 100
    ) -> list[PartitionInfo]:
        return await self.transport_for_subscription(subscription).partitions(subscription, condition, limit=limit)

    def _holder(self, subscription: str, delivery_id: str) -> Transport:
        """The transport that holds a delivery: the one its id's prefix names; an id without one is
        the database's (of a subscription whose topic moved, from before the move)."""
        if self.default is None:
            return self.transport_for_subscription(subscription)
        return self.transport_for_delivery(delivery_id)

    async def replay(self, subscription: str, delivery_id: str, note: str | None = None) -> ActionResult:
        return await self._holder(subscription, delivery_id).replay(subscription, delivery_id, note)

    async def validate_bindings(self) -> BindingReport:
        reports = [await t.validate_bindings() for t in self._all()]
        return BindingReport(
            transport="+".join(r.transport for r in reports), ok=all(r.ok for r in reports),
            issues=[issue for r in reports for issue in r.issues],
        )

    async def prune(self, older_than_seconds: float) -> int:
        return sum([await t.prune(older_than_seconds) for t in self._all()])

    async def discard(self, subscription: str, delivery_id: str, reason: str | None = None) -> ActionResult:
        return await self._holder(subscription, delivery_id).discard(subscription, delivery_id, reason)

    async def discard_dead_letters(self, subscription: str, settled_before: datetime, limit: int = 1000) -> int:
        return await self.transport_for_subscription(subscription).discard_dead_letters(
            subscription, settled_before, limit
        )

    async def rewrite_payload(
        self, message_id: uuid.UUID, payload_json: str, content_hash: str, envelope_bytes: int
    ) -> bool:
        return await self.database.rewrite_payload(message_id, payload_json, content_hash, envelope_bytes)


def moved_reason(left: SubscriptionStats, transport: str) -> str | None:
    """What the database still holds of a subscription whose topic moved to ``transport``, and what
    to do about it; None when it holds nothing unsettled."""
    waiting, dead = left.pending + left.in_flight, left.dead_lettered
    if not waiting and not dead:
        return None
    parts = []
    if waiting:
        parts.append(
            f"{waiting} not yet forwarded to its {transport} queue (a process with the outbox relay on, "
            "WORKQUEUE_AWS_RELAY, forwards them)"
        )
    if dead:
        parts.append(
            f"{dead} dead letter{'s' if dead != 1 else ''} (list, replay or discard "
            f"{'them' if dead != 1 else 'it'} with `workqueue dead-letters|replay|discard --subscription "
            f"{left.subscription} --app MODULE:ATTR`)"
        )
    return (f"topic {left.topic!r} moved to the {transport} transport and the database still holds deliveries "
            f"of {left.subscription!r} from before: " + "; ".join(parts))


def build_routing(
    kernel: Kernel, default: Transport | None, topics: Sequence[Topic], subscriptions: Sequence[Subscription]
) -> Transport | None:
    """A routing transport when some topic names another transport than ``database``; else None."""
    names = sorted({t.transport for t in topics} - {DATABASE})
    if not names:
        return None
    others = {name: transport_factory(name)(kernel) for name in names}
    topic_of = {t.name: t.transport for t in topics}
    return RoutingTransport(
        default, others, topic_of, {s.name: topic_of.get(s.topic, DATABASE) for s in subscriptions}
    )
