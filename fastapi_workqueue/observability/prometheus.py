"""Prometheus metrics of the queue (the ``prometheus`` extra).

Counted in this process: ``workqueue_published_total{topic,status}``,
``workqueue_processed_total{subscription,outcome}``,
``workqueue_process_duration_seconds{subscription}`` and ``workqueue_in_flight{subscription}``:
kept in plain Python by :mod:`.tally` and read by :class:`TallyCollector` at scrape, so a process
that is never scraped never imports prometheus-client. Read from the database when ``/metrics`` is
scraped (so every process's and pod's work is in them), cached for
``WORKQUEUE_METRICS_CACHE_SECONDS``: ``workqueue_deliveries{subscription,status}``,
``workqueue_backlog{subscription}``, ``workqueue_oldest_pending_age_seconds{subscription}``,
``workqueue_dead_letters{subscription}``, and for a subscription with flow limits
``workqueue_flow_limit{subscription,limit}``, ``workqueue_flow_tokens{subscription}`` and
``workqueue_flow_waiting{subscription}``. No label names a message or a key.

With prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before the app
starts, as for several uvicorn workers), the process counts through prometheus-client's own
counters (:class:`WorkQueueMetrics`, :class:`PrometheusObserver`), whose values live in that mode's
files, and the counters of every worker are summed at scrape time. Only prometheus-client's public
API is used: an attempt counts through the labelled children's ``inc`` and ``observe``, looked up
once per subscription.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.registry import Collector
    from prometheus_client.utils import floatToGoString
except ImportError as exc:
    from ..core.errors import missing_extra

    raise missing_extra("Prometheus metrics", "prometheus-client", "prometheus") from exc

from ..core.clock import store_now
from ..core.errors import TransportError
from ..core.flow import parse_rate
from ..core.observe import Observer, ProcessScope, PublishScope, topic_label
from ..core.redaction import redacting_logger
from . import semconv
from .tally import OUTCOMES, ProcessTally

log = redacting_logger("fastapi_workqueue.metrics")

if TYPE_CHECKING:
    from ..core.envelope import PublishResult
    from ..core.kernel import Kernel
    from ..core.live_work import FlowState
    from ..core.reports import SubscriptionStats
    from ..core.topology import SubscriptionState
    from ..core.transport import ClaimedDelivery

class Metric(NamedTuple):
    """One of the process's four metrics, as :class:`WorkQueueMetrics` and :class:`TallyCollector`
    both serve it."""

    name: str
    help: str
    labels: list[str]


PUBLISHED = Metric("workqueue_published", "Messages published, by topic and result status.", ["topic", "status"])
PROCESSED = Metric("workqueue_processed", "Attempts finished, by subscription and outcome.",
                   ["subscription", "outcome"])
DURATION = Metric("workqueue_process_duration_seconds", "Duration of an attempt (the handler).", ["subscription"])
IN_FLIGHT = Metric("workqueue_in_flight", "Attempts running in this process.", ["subscription"])


class WorkQueueMetrics:
    """The process's metric objects, registered in one registry: what the queue counts into in
    multiprocess mode (elsewhere it counts into a :class:`.tally.ProcessTally`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.published = Counter(PUBLISHED.name, PUBLISHED.help, PUBLISHED.labels, registry=registry)
        self.processed = Counter(PROCESSED.name, PROCESSED.help, PROCESSED.labels, registry=registry)
        self.duration = Histogram(DURATION.name, DURATION.help, DURATION.labels, buckets=semconv.DURATION_BUCKETS,
                                  registry=registry)
        self.in_flight = Gauge(IN_FLIGHT.name, IN_FLIGHT.help, IN_FLIGHT.labels, multiprocess_mode="livesum",
                               registry=registry)
        self._per_subscription: dict[str, _Children] = {}
        self._published: dict[tuple[str, str], Callable[[float], None]] = {}

    def published_counter(self, topic: str, status: str) -> Callable[[float], None]:
        """Adds to ``workqueue_published_total{topic,status}``; the child is looked up once per pair
        (``labels()`` takes a lock each time, and a publish of one message counts once)."""
        found = self._published.get((topic, status))
        if found is None:
            found = self._published[(topic, status)] = self.published.labels(topic, status).inc
        return found

    def of(self, subscription: str) -> _Children:
        """The metric children of ``subscription``, looked up once (``labels()`` takes a lock each time)."""
        found = self._per_subscription.get(subscription)
        if found is None:
            found = self._per_subscription[subscription] = _Children(self, subscription)
        return found


class _Children:
    """What one subscription's attempts count into: its labelled children, looked up once
    (``labels()`` takes a lock each time)."""

    __slots__ = ("_counters", "_metrics", "_subscription", "observe", "running")

    def __init__(self, metrics: WorkQueueMetrics, subscription: str) -> None:
        self._metrics = metrics
        self._subscription = subscription
        self.running: Callable[[float], None] = metrics.in_flight.labels(subscription).inc
        """Adds to the in-flight gauge (1 when an attempt starts, -1 when it ends)."""
        self.observe: Callable[[float], None] = metrics.duration.labels(subscription).observe
        """Observes an attempt's duration."""
        self._counters: dict[str | None, Callable[[float], None]] = {}

    def processed(self, outcome: str | None) -> Callable[[float], None]:
        """Adds to ``workqueue_processed_total`` of the subscription and the settlement kind ``outcome``."""
        found = self._counters.get(outcome)
        if found is None:
            found = self._counters[outcome] = self._metrics.processed.labels(
                self._subscription, OUTCOMES.get(outcome, "released")).inc
        return found


_BY_REGISTRY: dict[int, WorkQueueMetrics] = {}


def metrics_for(registry: CollectorRegistry | None = None) -> WorkQueueMetrics:
    """The metric objects of ``registry`` (prometheus-client's default one when None), made once."""
    target = registry if registry is not None else REGISTRY
    found = _BY_REGISTRY.get(id(target))
    if found is None or found.registry is not target:
        found = _BY_REGISTRY[id(target)] = WorkQueueMetrics(target)
    return found


class PrometheusObserver(Observer):
    """Counts publishes and attempts into :class:`WorkQueueMetrics` (multiprocess mode)."""

    def __init__(self, metrics: WorkQueueMetrics) -> None:
        self.metrics = metrics

    @classmethod
    def default(cls) -> PrometheusObserver:
        return cls(metrics_for(None))

    def publish_started(self, topic: str, count: int, *, message_id: str | None = None,
                        correlation_id: str | None = None) -> PublishScope | None:
        return _Published(self.metrics, topic, count)

    def process_started(self, subscription: str, delivery: ClaimedDelivery) -> ProcessScope | None:
        return _Processed(self.metrics.of(subscription))


class _Published(PublishScope):
    def __init__(self, metrics: WorkQueueMetrics, topic: str, count: int) -> None:
        self.metrics, self.topic, self.count = metrics, topic, count

    def end(self, results: Sequence[PublishResult] | None, error: BaseException | None) -> None:
        topic = topic_label(self.topic, results, error)
        if results is None:
            self.metrics.published_counter(topic, "Error")(self.count)
            return
        if len(results) == 1:
            self.metrics.published_counter(topic, str(results[0].status.value))(1)
            return
        counts: dict[str, int] = {}
        for result in results:
            status = str(result.status.value)
            counts[status] = counts.get(status, 0) + 1
        for status, n in counts.items():
            self.metrics.published_counter(topic, status)(n)


class _Processed(ProcessScope):
    __slots__ = ("children", "started")

    def __init__(self, children: _Children) -> None:
        self.children = children
        self.started = time.perf_counter()
        children.running(1)

    def end(self, outcome: str | None, error: BaseException | None) -> None:
        children = self.children
        children.running(-1)
        children.processed(outcome)(1)
        children.observe(time.perf_counter() - self.started)


_BUCKET_LABELS: list[str] = [*(floatToGoString(b) for b in semconv.DURATION_BUCKETS), "+Inf"]  # type: ignore[no-untyped-call]


class TallyCollector(Collector):
    """The counters, histogram and gauge of :class:`WorkQueueMetrics` (the same names, help and
    labels), read from a :class:`.tally.ProcessTally` when the registry is collected."""

    def __init__(self, tally: ProcessTally) -> None:
        self.tally = tally

    def collect(self) -> Iterable[Any]:
        tally = self.tally  # (copying a dict's items is one step for the interpreter: safe in a scrape thread)
        published = CounterMetricFamily(PUBLISHED.name, PUBLISHED.help, labels=PUBLISHED.labels)
        for labels, count in list(tally.published.items()):
            published.add_metric(list(labels), float(count))
        processed = CounterMetricFamily(PROCESSED.name, PROCESSED.help, labels=PROCESSED.labels)
        for labels, count in list(tally.processed.items()):
            processed.add_metric(list(labels), float(count))
        duration = HistogramMetricFamily(DURATION.name, DURATION.help, labels=DURATION.labels)
        for subscription, durations in list(tally.durations.items()):
            total, counts, cumulative, buckets = durations.total, list(durations.counts), 0, []
            for label, count in zip(_BUCKET_LABELS, counts, strict=True):
                cumulative += count
                buckets.append((label, float(cumulative)))
            duration.add_metric([subscription], buckets, total)
        in_flight = GaugeMetricFamily(IN_FLIGHT.name, IN_FLIGHT.help, labels=IN_FLIGHT.labels)
        for subscription, running in list(tally.in_flight.items()):
            in_flight.add_metric([subscription], float(running))
        return [published, processed, duration, in_flight]


_TALLIES: dict[int, CollectorRegistry] = {}


def register_tally(tally: ProcessTally, registry: CollectorRegistry | None = None) -> None:
    """Serves ``tally`` from ``registry`` (prometheus-client's default one when None), once per registry."""
    target = registry if registry is not None else REGISTRY
    if _TALLIES.get(id(target)) is not target:
        target.register(TallyCollector(tally))
        _TALLIES[id(target)] = target


class StoreSnapshot:
    """The database's counts as the last scrape read them, reused for ``cache_seconds``."""

    def __init__(self, kernel: Kernel, cache_seconds: float, clock: Any = time.monotonic) -> None:
        self.kernel = kernel
        self.cache_seconds = cache_seconds
        self.clock = clock
        self.stats: list[SubscriptionStats] = []
        self.flows: list[tuple[SubscriptionState, FlowState | None]] = []
        """Each subscription with flow limits, and how full they are."""
        self.read_at: float | None = None
        self.taken_at = datetime.now(UTC)
        self.store_up = True
        """Whether the last read reached the store: while it does not, the scrape answers with the
        process's own counters, ``workqueue_store_up 0`` and none of the database's gauges."""
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        """Reads the counts again when the cached ones are older than ``cache_seconds``; one read
        at a time, however many scrapers ask at once."""
        async with self._lock:
            now = self.clock()
            if self.read_at is not None and now - self.read_at < self.cache_seconds:
                return
            try:
                self.stats = await self.kernel.operator.stats()
                self.flows = await self._flows()
                taken_at = await store_now(self.kernel.ports.clock)  # (the clock that stamped the stats' times)
            except (TransportError, RuntimeError) as exc:  # (out of reach, or the queue is not open)
                if self.store_up:
                    log.warning("metrics: the store's gauges are left out while it cannot be read (%s)", exc)
                self.store_up, self.stats, self.flows = False, [], []
                self.read_at = now
                return
            self.store_up = True
            self.read_at = now
            self.taken_at = taken_at

    async def _flows(self) -> list[tuple[SubscriptionState, FlowState | None]]:
        reader = self.kernel.ports.flow
        limited = [s for s in await self.kernel.transport.list_subscriptions() if s.flow_limited]
        return [(s, None if reader is None else await reader.flow_state(s.name)) for s in limited]


class StoreCollector(Collector):
    """Gauges of every subscription from a :class:`StoreSnapshot`."""

    def __init__(self, snapshot: StoreSnapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Any]:
        deliveries = GaugeMetricFamily("workqueue_deliveries", "Deliveries by subscription and status (database).",
                                       labels=["subscription", "status"])
        backlog = GaugeMetricFamily("workqueue_backlog", "Claimable Pending plus InFlight deliveries (database).",
                                    labels=["subscription"])
        oldest = GaugeMetricFamily("workqueue_oldest_pending_age_seconds",
                                   "Age of the oldest Pending delivery, 0 when none (database).",
                                   labels=["subscription"])
        dead = GaugeMetricFamily("workqueue_dead_letters", "Dead-lettered deliveries (database).",
                                 labels=["subscription"])
        limit = GaugeMetricFamily("workqueue_flow_limit",
                                  "A subscription's flow limit: max_in_flight and key_concurrency as counts, "
                                  "rate_limit and key_rate_limit per second (database).",
                                  labels=["subscription", "limit"])
        tokens = GaugeMetricFamily("workqueue_flow_tokens", "Tokens in a subscription's rate_limit bucket (database).",
                                   labels=["subscription"])
        waiting = GaugeMetricFamily("workqueue_flow_waiting",
                                    "Claimable deliveries a flow limit holds back now, up to 1000 (database).",
                                    labels=["subscription"])
        for sub, state in self.snapshot.flows:
            for name, value in sub.flow_limits().items():
                limit.add_metric([sub.name, name], parse_rate(value).per_second if isinstance(value, str) else value)
            if state is not None:
                if state.tokens is not None:
                    tokens.add_metric([sub.name], state.tokens)
                waiting.add_metric([sub.name], state.waiting)
        taken = self.snapshot.taken_at
        for s in self.snapshot.stats:
            for status, value in (("Pending", s.pending), ("InFlight", s.in_flight),
                                  ("DeadLettered", s.dead_lettered), ("Completed", s.completed),
                                  ("Discarded", s.discarded)):
                deliveries.add_metric([s.subscription, status], value)
            backlog.add_metric([s.subscription], s.claimable + s.in_flight)
            age = 0.0 if s.oldest_pending_at is None else max(0.0, (taken - s.oldest_pending_at).total_seconds())
            oldest.add_metric([s.subscription], age)
            dead.add_metric([s.subscription], s.dead_lettered)
        up = GaugeMetricFamily("workqueue_store_up", "1 when the last scrape read the store, 0 when it could not "
                               "(the database's gauges are then left out).")
        up.add_metric([], 1.0 if self.snapshot.store_up else 0.0)
        return [up, deliveries, backlog, oldest, dead, limit, tokens, waiting]
