"""The queue's counts in this process, kept in plain Python and read by Prometheus at scrape.

A process that nobody scrapes pays a dictionary update per publish call and per attempt and never
imports prometheus-client: about 3.5 MB less in a worker and no lock per count (bench/README.md,
"Worker memory"). The counts reach a registry through :class:`.prometheus.TallyCollector` once
something serves metrics: ``queue.metrics_router``, ``workqueue work --metrics-port``, or code of
the app's own that imports prometheus-client (its exporter of the default registry), which the
next hook notices. They count from the start of the process, whenever the export began.

With prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) the counts must reach
its files, so the queue counts through prometheus-client itself instead
(:class:`.prometheus.PrometheusObserver`).
"""

from __future__ import annotations

import os
import sys
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core.observe import Observer, ProcessScope, PublishScope, topic_label
from .semconv import DURATION_BUCKETS

if TYPE_CHECKING:
    from ..core.envelope import PublishResult
    from ..core.transport import ClaimedDelivery

OUTCOMES = {"Complete": "completed", "Retry": "retried", "Fail": "failed", "DeadLetter": "dead_lettered",
            "Discard": "discarded", "Release": "released", None: "abandoned"}
"""The ``outcome`` label of ``workqueue_processed_total``, by how the attempt was settled
(``abandoned``: its lease was lost or the process stopped with nothing to settle)."""


def multiprocess_mode() -> bool:
    """Whether prometheus-client's multiprocess mode is on (``PROMETHEUS_MULTIPROC_DIR`` set)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class Durations:
    """A histogram of one subscription's attempt durations: a count per bucket of
    :data:`.semconv.DURATION_BUCKETS` (upper bounds, inclusive) and one past the last, and the sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(DURATION_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.total += seconds


class ProcessTally:
    """What this process counted: publishes by (topic, status), attempts by (subscription,
    outcome label), attempts running by subscription, and each subscription's durations."""

    __slots__ = ("durations", "in_flight", "processed", "published")

    def __init__(self) -> None:
        self.published: dict[tuple[str, str], int] = {}
        self.processed: dict[tuple[str, str], int] = {}
        self.in_flight: dict[str, int] = {}
        self.durations: dict[str, Durations] = {}


PROCESS_TALLY = ProcessTally()
"""The counts of every queue in this process (as a registry's metrics would be)."""


def export_process_tally(registry: Any = None) -> None:
    """Serves :data:`PROCESS_TALLY` from ``registry`` (prometheus-client's default one when None);
    once per registry. Nothing in multiprocess mode, where the counters are prometheus-client's own."""
    if registry is None and multiprocess_mode():
        return
    from .prometheus import register_tally

    register_tally(PROCESS_TALLY, registry)


class TallyObserver(Observer):
    """Counts publishes and attempts into a :class:`ProcessTally`; exports it to prometheus-client's
    default registry from the first hook after the process has imported prometheus-client."""

    def __init__(self, tally: ProcessTally) -> None:
        self.tally = tally
        self._exported = False
        self._notice_import()

    @classmethod
    def process(cls) -> TallyObserver:
        return cls(PROCESS_TALLY)

    def _notice_import(self) -> None:
        if "prometheus_client" in sys.modules and hasattr(sys.modules["prometheus_client"], "REGISTRY"):
            self._exported = True
            if self.tally is PROCESS_TALLY:
                export_process_tally()

    def publish_started(self, topic: str, count: int, *, message_id: str | None = None,
                        correlation_id: str | None = None) -> PublishScope | None:
        if not self._exported:
            self._notice_import()
        return _Published(self.tally.published, topic, count)

    def process_started(self, subscription: str, delivery: ClaimedDelivery) -> ProcessScope | None:
        if not self._exported:
            self._notice_import()
        return _Processed(self.tally, subscription)


class _Published(PublishScope):
    __slots__ = ("count", "published", "topic")

    def __init__(self, published: dict[tuple[str, str], int], topic: str, count: int) -> None:
        self.published, self.topic, self.count = published, topic, count

    def end(self, results: Sequence[PublishResult] | None, error: BaseException | None) -> None:
        published, topic = self.published, topic_label(self.topic, results, error)
        if results is None:
            key = (topic, "Error")
            published[key] = published.get(key, 0) + self.count
            return
        for result in results:
            key = (topic, str(result.status.value))
            published[key] = published.get(key, 0) + 1


class _Processed(ProcessScope):
    __slots__ = ("started", "subscription", "tally")

    def __init__(self, tally: ProcessTally, subscription: str) -> None:
        self.tally, self.subscription = tally, subscription
        in_flight = tally.in_flight
        in_flight[subscription] = in_flight.get(subscription, 0) + 1
        self.started = time.perf_counter()

    def end(self, outcome: str | None, error: BaseException | None) -> None:
        seconds = time.perf_counter() - self.started
        tally, subscription = self.tally, self.subscription
        tally.in_flight[subscription] -= 1
        key = (subscription, OUTCOMES.get(outcome, "released"))
        tally.processed[key] = tally.processed.get(key, 0) + 1
        durations = tally.durations.get(subscription)
        if durations is None:
            durations = tally.durations[subscription] = Durations()
        durations.observe(seconds)
