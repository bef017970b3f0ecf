#!/usr/bin/env python3
"""What the envelope costs inside a publish loop against the same work back to back: ``prepare``
(the checks, canonical JSON, content hash and uuid7 of one message) timed on its own while
``queue.publish`` of one message runs one call after another, then timed again with nothing but
``prepare`` calls in between (bench/README.md, "Single publish: where the time goes").

    .venv/bin/python bench/experiments/cold_calls.py                 # 3 turns of 5,000 calls

Between two publishes the process sends, waits and wakes on a socket; on a virtual machine that
leaves the CPU's caches cold for the Python that runs next, so a call of the library costs more
than a loop of the same call alone says. Each line gives ``prepare``'s wall time per call in
both places (``time.perf_counter_ns`` around it; the wrapper's own cost is in both). The database
(``--database``, default ``bench_cold_calls``, on ``$BENCH_PG_URL`` or the local server) is
dropped and recreated at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from probe_support import add_database_options, fresh_database, one_topic_queue

import fastapi_workqueue.core.kernel as kernel
from fastapi_workqueue import PublishRequest

TOPIC = "cold.calls"


async def main(args: argparse.Namespace) -> None:
    admin, dsn = await fresh_database(args.url, args.database)
    queue = await one_topic_queue(dsn, TOPIC, "cold-calls")
    prepare = kernel.prepare
    spent = [0]

    def timed(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return prepare(*a, **kw)
        finally:
            spent[0] += time.perf_counter_ns() - start

    kernel.prepare = timed  # type: ignore[assignment]  (what Kernel.publish calls, by its module's name)
    places: dict[str, list[float]] = {"in the publish loop": [], "back to back": []}
    try:
        for i in range(200):
            await queue.publish(TOPIC, [PublishRequest(payload={"i": i})])
        for turn in range(args.turns):
            spent[0] = 0
            for i in range(args.calls):
                await queue.publish(TOPIC, [PublishRequest(payload={"i": i})])
            places["in the publish loop"].append(spent[0] / args.calls / 1000)
            spent[0] = 0
            for i in range(args.calls):
                timed(PublishRequest(payload={"i": i}))
            places["back to back"].append(spent[0] / args.calls / 1000)
            print(f"turn {turn + 1}: " + ", ".join(f"{name} {got[-1]:.2f} µs" for name, got in places.items()),
                  flush=True)
    finally:
        kernel.prepare = prepare  # type: ignore[assignment]
        await queue.close()
        await admin.close()
    print("medians: " + ", ".join(f"{name} {statistics.median(got):.2f} µs" for name, got in places.items()))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_database_options(ap, "bench_cold_calls")
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--turns", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
