#!/usr/bin/env python3
"""What the Prometheus counting costs a publish call and an attempt: prometheus-client's own
counters (multiprocess mode) against the plain counts of ``observability/tally.py`` (every other
process), each hook pair called in a tight loop, in turns (bench/README.md, "Worker memory").

    .venv/bin/python bench/experiments/observer_cost.py                 # 5 turns of 100,000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prometheus_client import CollectorRegistry

from fastapi_workqueue.core.envelope import PublishResult, PublishStatus
from fastapi_workqueue.observability.prometheus import PrometheusObserver, WorkQueueMetrics
from fastapi_workqueue.observability.tally import ProcessTally, TallyObserver

RESULTS = [PublishResult(status=PublishStatus.ACCEPTED)]


def per_call_us(observer: Any, calls: int) -> tuple[float, float]:
    """Microseconds of one attempt's hooks (start, end Complete) and of one publish's (start, end)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        observer.process_started("bench-none", None).end("Complete", None)
    attempt = (time.perf_counter() - t0) / calls * 1e6
    t0 = time.perf_counter()
    for _ in range(calls):
        observer.publish_started("bench.none", 1).end(RESULTS, None)
    return attempt, (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"prometheus-client": [], "tally": []}
    for _ in range(args.turns):
        runs["prometheus-client"].append(per_call_us(PrometheusObserver(WorkQueueMetrics(CollectorRegistry())),
                                                     args.calls))
        runs["tally"].append(per_call_us(TallyObserver(ProcessTally()), args.calls))
    for name, got in runs.items():
        attempt = statistics.median(a for a, _ in got)
        publish = statistics.median(p for _, p in got)
        print(f"{name:18s} attempt {attempt:5.2f} µs   publish call {publish:5.2f} µs   (medians of {args.turns})")


if __name__ == "__main__":
    main()
