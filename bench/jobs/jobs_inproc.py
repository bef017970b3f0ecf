#!/usr/bin/env python3
"""Python CPU per attempt of the library's in-process path alone: jobs against core deliveries.

    .venv/bin/python bench/jobs/jobs_inproc.py                  # 20,000 attempts per case, 3 rounds
    .venv/bin/python bench/jobs/jobs_inproc.py -n 5000 --rounds 5

``bench/jobs/jobs_attempt.py`` measures an attempt with PostgreSQL answering; there the store's share
(decoding claims, encoding settles, how settles batch) moves with the machine's load. Here the
same host, runtime, handler, observers and settler run in this process on the queues of
``bench/jobs/jobs_bench.py`` (the no-op job) and ``bench/compare/workqueue_bench.py`` (the no-op subscription),
and the transport's ``claim``, ``claim_many`` and ``settle`` answer from memory after a fixed pause
(2 ms a claim, 1 ms a settle), from rows shaped as the database returns them. The database
(``--dsn``) is used only to migrate and sync the topology. It prints µs of
``time.process_time()`` per attempt, medians of the rounds, and the claim and settle calls.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "compare")]  # jobs_bench, then the core benchmark

import jobs_bench  # noqa: E402
import workqueue_bench as core  # noqa: E402  (strips WORKQUEUE_* from the environment)

from fastapi_workqueue import WorkMessage  # noqa: E402
from fastapi_workqueue.database.routines import claimed  # noqa: E402
from fastapi_workqueue.jobs.envelope import envelope_json  # noqa: E402

_ids = itertools.count(1)


def row(topic: str, payload: Any, attributes: str) -> dict[str, Any]:
    """A claimed delivery as the claim routines return it."""
    n = next(_ids)
    return {"delivery_id": n, "lease_token": str(uuid.uuid4()), "attempt": 1, "max_attempts": 3,
            "lease_expires_at": None, "message_id": uuid.uuid4(), "topic": topic, "partition_key": None,
            "attributes": attributes, "payload": json.dumps(payload), "payload_ref": None, "correlation_id": None,
            "published_at": None}


async def one(case: str, dsn: str, n: int) -> tuple[float, dict[str, int]]:
    if case == "jobs":
        queue, _ = jobs_bench.make_jobs_queue(dsn, jobs_bench.ONE, host=True)
        name, topic = f"bench.noop.{jobs_bench.ONE[0]}", f"jobs.{jobs_bench.ONE[0]}"
        rows = [row(topic, envelope_json(name, {"i": i}), json.dumps({"job": name})) for i in range(n)]
    else:
        queue = core.make_queue(dsn, host=True)
        topic = core.CASES["none"][0]

        @queue.handler("bench.none")
        async def noop(message: WorkMessage[core.Item]) -> None:
            return None

        rows = [row(topic, {"i": i}, "{}") for i in range(n)]
    await queue.migrate()
    await queue.open()
    transport: Any = queue.transport
    pending = list(reversed(rows))
    settled = [0]
    calls = {"claim": 0, "settle": 0}

    async def claim(_subscription: str, limit: int) -> list[Any]:
        await asyncio.sleep(0.002)
        calls["claim"] += 1
        return [claimed(pending.pop()) for _ in range(min(limit, len(pending)))]

    async def claim_many(subscriptions: list[str], limit: int) -> list[Any]:
        await asyncio.sleep(0.002)
        calls["claim"] += 1
        return [(subscriptions[0], claimed(pending.pop())) for _ in range(min(limit, len(pending)))]

    async def settle(settlements: list[Any]) -> list[str]:
        await asyncio.sleep(0.001)
        calls["settle"] += 1
        settled[0] += len(settlements)
        return ["Completed"] * len(settlements)

    transport.claim, transport.claim_many, transport.settle = claim, claim_many, settle
    cpu0 = time.process_time()
    async with queue.lifespan(None):
        while settled[0] < n:  # noqa: ASYNC110 - the settles are counted in memory
            await asyncio.sleep(0.001)
        cpu = time.process_time() - cpu0
    await queue.close()
    return 1e6 * cpu / n, calls


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=20_000, help="attempts per case and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dsn", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432")
                        .rstrip("/") + "/bench_jobs_inproc", help="database for the topology only (created)")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default=core.default_loop(),
                        help="event loop (default: uvloop where installed, as the benchmarks' workers run)")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    await core.ensure_database(args.dsn)
    out: dict[str, list[float]] = {"jobs": [], "core": []}
    for r in range(args.rounds):
        for case in ("jobs", "core") if r % 2 == 0 else ("core", "jobs"):
            us, calls = await one(case, args.dsn, args.n)
            out[case].append(us)
            print(f"round {r + 1} {case:>4}: {us:.1f} µs per attempt; claims {calls['claim']}, "
                  f"settles {calls['settle']}", flush=True)
    jobs, base = statistics.median(out["jobs"]), statistics.median(out["core"])
    print(f"medians: jobs {jobs:.1f} µs, core {base:.1f} µs per attempt ({jobs / base:.2f}x), "
          f"{args.n} attempts, {args.rounds} rounds, {args.loop}")


if __name__ == "__main__":
    options = parse()
    if options.loop == "uvloop":
        import uvloop

        uvloop.run(main(options))
    else:
        asyncio.run(main(options))
