#!/usr/bin/env python3
"""How long one call takes when calls come 20 ms apart, as in the latency case, against the same
calls back to back: the floor under the end-to-end latency (bench/README.md, "What bounds the
remaining targets").

    .venv/bin/python bench/experiments/latency_floor.py                  # 200 calls per path and spacing

Paths: ``SELECT 1`` (a round trip), a plain one-row INSERT committed on its own (what pgbench's
ceiling measures), and ``queue.publish`` of one message (without consumers). Spacings: none (back
to back) and ``--spacing`` seconds (default 0.020, the latency case's). Each line gives the p50
and p99 of the call in ms. The database (``--database``, default ``bench_latency_floor``, on
``$BENCH_PG_URL`` or the local server) is dropped and recreated at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from probe_support import add_database_options, fresh_database, one_topic_queue

from fastapi_workqueue import PublishRequest


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


async def timed(call: Callable[[], Awaitable[Any]], count: int, spacing: float) -> list[float]:
    for _ in range(20):  # warm-up
        await call()
    took = []
    for _ in range(count):
        if spacing:
            await asyncio.sleep(spacing)
        t0 = time.perf_counter()
        await call()
        took.append((time.perf_counter() - t0) * 1000)
    return took


async def main(args: argparse.Namespace) -> None:
    admin, dsn = await fresh_database(args.url, args.database)
    await admin.close()
    queue = await one_topic_queue(dsn, "floor.none", "floor-none")
    conn = await asyncpg.connect(dsn)
    await conn.execute("CREATE TABLE plain (id bigserial PRIMARY KEY, payload jsonb, "
                       "created_at timestamptz DEFAULT now())")
    paths: dict[str, Callable[[], Awaitable[Any]]] = {
        "SELECT 1": lambda: conn.fetchval("SELECT 1"),
        "plain INSERT, autocommit": lambda: conn.execute("INSERT INTO plain (payload) VALUES ($1)", '{"i": 1}'),
        "queue.publish, one message": lambda: queue.publish("floor.none", [PublishRequest(payload={"i": 1})]),
    }
    try:
        for name, call in paths.items():
            for spacing in (0.0, args.spacing):
                took = await timed(call, args.calls, spacing)
                label = "back to back" if not spacing else f"{spacing * 1000:.0f} ms apart"
                print(f"{name:28s} {label:13s} p50 {pct(took, 50):6.3f} ms   p99 {pct(took, 99):6.3f} ms", flush=True)
    finally:
        await conn.close()
        await queue.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_database_options(ap, "bench_latency_floor")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--spacing", type=float, default=0.020)
    asyncio.run(main(ap.parse_args()))
