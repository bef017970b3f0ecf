"""What each page shows, read from the queue: every read is bounded (a page of rows, or a count
that stops at a cap) and goes through an index, whatever the tables hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..core.history import StatsHistoryReader, StatsPoint
from ..core.host import SubscriptionHealth
from ..core.live_work import LIVE_COUNT_CAP, BlockedKey, LiveCounts, LiveWorkReader
from ..core.reports import DeliveryInfo
from ..core.topology import SubscriptionState
from ..web.operator_view import shown, shown_all

if TYPE_CHECKING:
    from ..queue import WorkQueue

PAGE = 25
"""Dead letters a page; also the most in-flight deliveries and blocked keys a page lists."""
IN_FLIGHT_PAGE = 50
WAITING_CAP = 100
"""Where the count of deliveries waiting behind a blocked key's head stops."""
CHART_MINUTES = 60
BULK_BATCH = 100
"""Dead letters replayed per batch of a bulk replay."""
BULK_BATCHES = 10
"""Batches per bulk replay request: one confirmation replays at most BULK_BATCH x BULK_BATCHES."""


@dataclass
class SubscriptionRow:
    state: SubscriptionState
    counts: LiveCounts
    health: SubscriptionHealth | None
    completed_last_hour: int = 0

    @property
    def paused(self) -> bool:
        return self.state.status == "Paused" or self.state.topic_status == "Paused"


@dataclass
class TopicView:
    name: str
    status: str
    subscriptions: list[SubscriptionRow] = field(default_factory=list)


@dataclass
class Overview:
    now: datetime
    topics: list[TopicView]
    history: list[StatsPoint]
    has_history: bool
    host: str
    host_reason: str | None

    @property
    def rows(self) -> list[SubscriptionRow]:
        return [row for topic in self.topics for row in topic.subscriptions]


@dataclass
class SubscriptionPage:
    now: datetime
    row: SubscriptionRow
    history: list[StatsPoint]
    has_history: bool
    in_flight: list[DeliveryInfo]
    dead_letters: list[DeliveryInfo]
    next_after: str | None
    after: str | None
    blocked: list[BlockedKey]
    waiting_cap: int = WAITING_CAP


async def counts_of(queue: WorkQueue, subscription: str | None = None) -> dict[str, LiveCounts]:
    """The live counts by subscription: bounded where the transport offers it, else stats."""
    transport: Any = queue.transport
    if isinstance(transport, LiveWorkReader):
        return {c.subscription: c for c in await transport.live_counts(subscription)}
    return {
        s.subscription: LiveCounts(subscription=s.subscription, pending=s.pending, in_flight=s.in_flight,
                                   dead_lettered=s.dead_lettered, cap=2**62)
        for s in await queue.stats(subscription)
    }


async def history_of(queue: WorkQueue, now: datetime, subscription: str | None = None) -> tuple[list[StatsPoint], bool]:
    transport: Any = queue.transport
    if not isinstance(transport, StatsHistoryReader):
        return [], False
    return await transport.stats_history(now - timedelta(minutes=CHART_MINUTES), subscription), True


def _health_by_name(queue: WorkQueue) -> dict[str, SubscriptionHealth]:
    return {h.subscription: h for h in queue.health().subscriptions}


def _row(state: SubscriptionState, counts: dict[str, LiveCounts], health: dict[str, SubscriptionHealth],
         history: list[StatsPoint]) -> SubscriptionRow:
    return SubscriptionRow(
        state=state,
        counts=counts.get(state.name) or LiveCounts(subscription=state.name, pending=0, in_flight=0,
                                                    dead_lettered=0, cap=LIVE_COUNT_CAP),
        health=health.get(state.name),
        completed_last_hour=sum(p.completed for p in history if p.subscription == state.name),
    )


async def overview(queue: WorkQueue) -> Overview:
    now = datetime.now(UTC)
    topics = {t.name: TopicView(name=t.name, status="Active") for t in await queue.transport.list_topics()}
    subscriptions = await queue.transport.list_subscriptions()
    counts = await counts_of(queue)
    history, has_history = await history_of(queue, now)
    health = _health_by_name(queue)
    for state in sorted(subscriptions, key=lambda s: s.name):
        topic = topics.setdefault(state.topic, TopicView(name=state.topic, status=state.topic_status))
        topic.status = state.topic_status
        topic.subscriptions.append(_row(state, counts, health, history))
    report = queue.health()
    return Overview(now=now, topics=sorted(topics.values(), key=lambda t: t.name), history=history,
                    has_history=has_history, host=report.status, host_reason=report.reason)


async def find_subscription(queue: WorkQueue, name: str) -> SubscriptionState | None:
    return next((s for s in await queue.transport.list_subscriptions() if s.name == name), None)


async def subscription_page(queue: WorkQueue, state: SubscriptionState, after: str | None) -> SubscriptionPage:
    now = datetime.now(UTC)
    name = state.name
    history, has_history = await history_of(queue, now, name)
    row = _row(state, await counts_of(queue, name), _health_by_name(queue), history)
    in_flight = shown_all(await queue.deliveries(name, "InFlight", limit=IN_FLIGHT_PAGE))
    dead = shown_all(await queue.dead_letters(name, limit=PAGE + 1, after=after))
    next_after = dead[PAGE - 1].delivery_id if len(dead) > PAGE else None
    transport: Any = queue.transport
    blocked: list[BlockedKey] = []
    if state.partition_mode == "Ordered" and isinstance(transport, LiveWorkReader):
        blocked = await transport.blocked_keys(name, limit=PAGE, cap=WAITING_CAP)
    return SubscriptionPage(now=now, row=row, history=history, has_history=has_history, in_flight=in_flight,
                            dead_letters=dead[:PAGE], next_after=next_after, after=after, blocked=blocked)


async def delivery(queue: WorkQueue, delivery_id: str, *, include_payload: bool) -> DeliveryInfo | None:
    info = await queue.get_delivery(delivery_id, include_payload=include_payload)
    return None if info is None else shown(info)
