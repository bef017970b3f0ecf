"""What each page shows, read from the queue: every read is bounded (a page of rows, or a count
that stops at a cap) and goes through an index, whatever the tables hold."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Literal

from ..core.attempts import AttemptInfo
from ..core.clock import store_now
from ..core.history import StatsPoint
from ..core.host import SubscriptionHealth
from ..core.live_work import LIVE_COUNT_CAP, BlockedKey, FlowState, LiveCounts
from ..core.processes import ProcessInfo
from ..core.reports import DeliveryInfo
from ..core.search import FoundDelivery
from ..core.topology import SubscriptionState
from ..core.words import count, duration
from ..web.operator_view import found_deliveries, kept_attempts, shown, shown_all
from .causes import SCAN, Causes, group_causes
from .jobs_view import JobRow, declared_jobs, job_name, job_queue, job_timeout

if TYPE_CHECKING:
    from ..core.kernel import Kernel
    from ..jobs.layer import Jobs

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
SEARCH_PAGE = 50
"""Deliveries a search shows (the newest that match)."""
BLOCKED_SHOWN = 10
"""Blocked keys of one Ordered subscription the overview looks at (it says "10+" past them)."""


@dataclass
class SubscriptionRow:
    state: SubscriptionState
    counts: LiveCounts
    health: SubscriptionHealth | None
    completed_last_hour: int = 0

    @property
    def paused(self) -> bool:
        return self.state.status == "Paused" or self.state.topic_status == "Paused"


@dataclass(frozen=True)
class Attention:
    """Something on the overview an operator should look at first: ``alert`` before ``warn``."""

    severity: Literal["alert", "warn"]
    subscription: str
    what: str
    detail: str
    anchor: str = ""
    """Where on the subscription's page it is (``#dead-letters``)."""


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
    served: dict[str, int] = field(default_factory=dict)
    """Live processes that run each subscription, anywhere (the process registry)."""
    knows_processes: bool = False
    """Whether the store keeps a process registry (else "anywhere" is unknown)."""
    attention: list[Attention] = field(default_factory=list)

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
    causes: Causes | None = None
    """The dead letters grouped by cause (None when there are none)."""
    stuck_before: datetime | None = None
    """An InFlight delivery claimed before this is stuck."""
    job_queue: str | None = None
    """The job queue the subscription serves (its dead letters are failed jobs), or None."""
    jobs: list[JobRow] = field(default_factory=list)
    """The jobs declared on that queue."""
    flow: FlowState | None = None
    """How full its flow limits are and what waits on them (None: it has none, or the store reads none)."""


def stuck_before(kernel: Kernel, now: datetime) -> datetime:
    """An InFlight delivery claimed before this is stuck (``dashboard_stuck_after_seconds``)."""
    return now - timedelta(seconds=kernel.settings.dashboard_stuck_after_seconds)


async def counts_of(kernel: Kernel, subscription: str | None = None,
                    now: datetime | None = None) -> dict[str, LiveCounts]:
    """The live counts by subscription: bounded where the transport offers it, else stats."""
    live = kernel.ports.live_work
    if live is not None:
        before = stuck_before(kernel, now or await store_now(kernel.ports.clock))
        return {c.subscription: c for c in await live.live_counts(subscription, stuck_before=before)}
    return {
        s.subscription: LiveCounts(subscription=s.subscription, pending=s.pending, in_flight=s.in_flight,
                                   dead_lettered=s.dead_lettered, cap=2**62, oldest_pending_at=s.oldest_pending_at)
        for s in await kernel.operator.stats(subscription)
    }


def waiting_since(counts: LiveCounts, now: datetime) -> datetime | None:
    """Since when the longest-waiting claimable delivery waits, or None when none waits."""
    oldest = counts.oldest_pending_at
    return oldest if counts.pending and oldest is not None and oldest <= now else None


async def history_of(kernel: Kernel, now: datetime, subscription: str | None = None) -> tuple[list[StatsPoint], bool]:
    history = kernel.ports.history
    if history is None:
        return [], False
    return await history.stats_history(now - timedelta(minutes=CHART_MINUTES), subscription), True


def _health_by_name(kernel: Kernel) -> dict[str, SubscriptionHealth]:
    return {h.subscription: h for h in kernel.health().subscriptions}


def _row(state: SubscriptionState, counts: dict[str, LiveCounts], health: dict[str, SubscriptionHealth],
         history: list[StatsPoint]) -> SubscriptionRow:
    return SubscriptionRow(
        state=state,
        counts=counts.get(state.name) or LiveCounts(subscription=state.name, pending=0, in_flight=0,
                                                    dead_lettered=0, cap=LIVE_COUNT_CAP),
        health=health.get(state.name),
        completed_last_hour=sum(p.completed for p in history if p.subscription == state.name),
    )


async def process_list(kernel: Kernel) -> list[ProcessInfo] | None:
    """The processes of the store's registry, live ones first (None when the store keeps none)."""
    registry = kernel.ports.processes
    return None if registry is None else await registry.list_processes()


def served_by(processes: list[ProcessInfo]) -> dict[str, int]:
    """How many live (Running) processes run each subscription."""
    served: dict[str, int] = {}
    for process in processes:
        if process.state == "Running":
            for name in process.subscriptions:
                served[name] = served.get(name, 0) + 1
    return served


async def attention(kernel: Kernel, rows: list[SubscriptionRow], served: dict[str, int] | None,
                    now: datetime | None = None) -> list[Attention]:
    """What needs looking at first: dead letters, blocked Ordered keys, work nobody runs anywhere,
    a subscription this process cannot run, deliveries in flight for longer than the stuck
    threshold, claimable work waiting longer than it; alerts before warnings, then by subscription."""
    found: list[Attention] = []
    live = kernel.ports.live_work
    now = now or await store_now(kernel.ports.clock)
    limit = kernel.settings.dashboard_stuck_after_seconds
    for row in rows:
        state, counts = row.state, row.counts
        name = state.name
        cap = counts.cap
        if counts.dead_lettered:
            found.append(Attention("alert", name, _many(counts.dead_lettered, cap, "dead letter"),
                                   "replay them once the cause is fixed, or discard them", "#dead-letters"))
        if state.partition_mode == "Ordered" and live is not None and (
                counts.dead_lettered or counts.pending):
            blocked = await live.blocked_keys(name, limit=BLOCKED_SHOWN, cap=WAITING_CAP)
            if blocked:
                keys = ", ".join(b.partition_key for b in blocked[:3]) + (" …" if len(blocked) > 3 else "")
                found.append(Attention("alert", name, f"{len(blocked)}{'+' if len(blocked) >= BLOCKED_SHOWN else ''} "
                                       f"blocked key{'s' if len(blocked) != 1 else ''}", f"keys {keys}", "#blocked"))
        nobody = served is not None and not served.get(name) and state.host_type == "worker"
        if counts.pending and nobody and state.status != "Paused" and state.topic_status != "Paused":
            found.append(Attention("alert", name, f"{_many(counts.pending, cap, 'delivery')} pending, no consumer "
                                   "anywhere",
                                   "no live process runs this subscription: start a worker "
                                   f"(workqueue work --subscription {name}) or check the processes"))
        elif counts.pending and row.paused:
            found.append(Attention("warn", name, f"paused with {_many(counts.pending, cap, 'delivery')} pending",
                                   "resume it when its work may run again"))
        if counts.stuck:
            found.append(Attention("warn", name, f"{_many(counts.stuck, cap, 'delivery')} in flight for over "
                                   f"{duration(limit)}",
                                   "claimed long ago and not settled: check its progress and its holder, or "
                                   "cancel it", "#in-flight"))
        waiting = waiting_since(counts, now)
        waited = 0.0 if waiting is None else (now - waiting).total_seconds()
        if waited > limit and not row.paused:
            found.append(Attention("warn", name, f"the oldest pending delivery waits {duration(waited)}",
                                   "its consumers fall behind: more concurrency or more workers"))
        if row.health is not None and row.health.state in ("Error", "HandlerNotRegistered"):
            found.append(Attention("alert", name, f"{row.health.state} in this process",
                                   row.health.reason or ""))
    return sorted(found, key=lambda a: (a.severity != "alert", a.subscription))


def _many(value: int, cap: int, noun: str) -> str:
    """``1 dead letter``, ``3 dead letters``, ``1,000+ dead letters`` (a count that reached its cap)."""
    if value >= cap:
        return f"{cap:,}+ {count(2, noun).partition(' ')[2]}"
    return f"{value:,} {count(value, noun).partition(' ')[2]}"


async def overview(kernel: Kernel) -> Overview:
    now = await store_now(kernel.ports.clock)  # (the clock that stamped what the page shows the age of)
    topics = {t.name: TopicView(name=t.name, status=getattr(t, "status", "Active"))
              for t in await kernel.transport.list_topics()}
    subscriptions = await kernel.transport.list_subscriptions()
    counts = await counts_of(kernel, now=now)
    history, has_history = await history_of(kernel, now)
    health = _health_by_name(kernel)
    for state in sorted(subscriptions, key=lambda s: s.name):
        topic = topics.setdefault(state.topic, TopicView(name=state.topic, status=state.topic_status))
        topic.status = state.topic_status
        topic.subscriptions.append(_row(state, counts, health, history))
    report = kernel.health()
    processes = await process_list(kernel)
    served = None if processes is None else served_by(processes)
    ordered = sorted(topics.values(), key=lambda t: t.name)
    rows = [row for topic in ordered for row in topic.subscriptions]
    return Overview(now=now, topics=ordered, history=history, has_history=has_history, host=report.status,
                    host_reason=report.reason, served=served or {}, knows_processes=served is not None,
                    attention=await attention(kernel, rows, served, now))


async def find_subscription(kernel: Kernel, name: str) -> SubscriptionState | None:
    return next((s for s in await kernel.transport.list_subscriptions() if s.name == name), None)


async def subscription_page(kernel: Kernel, jobs: Callable[[], Jobs], state: SubscriptionState,
                            after: str | None) -> SubscriptionPage:
    now = await store_now(kernel.ports.clock)
    name = state.name
    history, has_history = await history_of(kernel, now, name)
    row = _row(state, await counts_of(kernel, name, now), _health_by_name(kernel), history)
    in_flight = shown_all(await kernel.operator.deliveries(name, "InFlight", limit=IN_FLIGHT_PAGE))
    # The first page's read also gives the causes panel its oldest SCAN dead letters (one read).
    wanted = PAGE if after is not None else max(PAGE, SCAN)
    dead = shown_all(await kernel.operator.dead_letters(name, limit=wanted + 1, after=after))
    next_after = dead[PAGE - 1].delivery_id if len(dead) > PAGE else None
    live = kernel.ports.live_work
    blocked: list[BlockedKey] = []
    if state.partition_mode == "Ordered" and live is not None:
        blocked = await live.blocked_keys(name, limit=PAGE, cap=WAITING_CAP)
    causes = group_causes(dead[:SCAN], complete=len(dead) <= SCAN) if dead and after is None else None
    dead = dead[:PAGE + 1]
    flow_reader = kernel.ports.flow
    flow = await flow_reader.flow_state(name, cap=WAITING_CAP) if state.flow_limited and flow_reader else None
    return SubscriptionPage(now=now, row=row, history=history, has_history=has_history, in_flight=in_flight,
                            dead_letters=dead[:PAGE], next_after=next_after, after=after, blocked=blocked,
                            causes=causes, stuck_before=stuck_before(kernel, now),
                            job_queue=(served := job_queue(name)),
                            jobs=[] if served is None else declared_jobs(jobs(), served), flow=flow)


@dataclass
class JobOfDelivery:
    """The job a delivery runs: its name, queue, the timeout its envelope carries and its declaration."""

    name: str
    queue: str | None
    timeout: float | None
    declared: JobRow | None


async def delivery(kernel: Kernel, jobs: Callable[[], Jobs], delivery_id: str, *,
                   include_payload: bool) -> tuple[DeliveryInfo, JobOfDelivery | None] | None:
    """A delivery (its payload only when ``include_payload``) and the job it runs, if it is one."""
    info = await kernel.operator.get_delivery(delivery_id, include_payload=True)  # the job's timeout is in its envelope
    if info is None:
        return None
    job = None
    name = job_name(info)
    if name is not None:
        served = job_queue(info.subscription)
        declared = next((j for j in declared_jobs(jobs()) if j.name == name), None)
        job = JobOfDelivery(name=name, queue=served, timeout=job_timeout(info), declared=declared)
    if not include_payload:
        info = info.model_copy(update={"payload": None})
    return shown(info), job


async def attempts_of(kernel: Kernel, delivery_id: str) -> list[AttemptInfo] | None:
    """The kept attempts of a delivery, oldest first, errors redacted (None when the store keeps none)."""
    return await kept_attempts(kernel.ports, delivery_id)


async def search(kernel: Kernel, query: str) -> list[FoundDelivery] | None:
    """The newest deliveries that match ``query`` exactly, errors redacted (None when the
    transport cannot search; empty for an empty query)."""
    if not query:
        return [] if kernel.ports.search is not None else None
    return await found_deliveries(kernel.ports, query, SEARCH_PAGE)
