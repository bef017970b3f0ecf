#!/usr/bin/env python3
"""What a ``stats()`` call costs with a little history and with a lot.

    .venv/bin/python bench/experiments/stats_history.py                     # PostgreSQL, 1,000 vs 1,000,000
    .venv/bin/python bench/experiments/stats_history.py --dialect sqlite    # the same on SQLite files

Two stores are built side by side, the same but for their history: one subscription with a live
backlog (``--pending`` Pending, ``--in-flight`` InFlight, ``--dead`` DeadLettered, published and
claimed through the transport) and ``--small`` or ``--large`` Completed deliveries within
retention. The history is written with SQL, as settles leave it (a Completed delivery, and its
count in ``settled_count``), because settling a million deliveries one batch at a time would take
the benchmark many minutes. Then ``transport.stats(subscription)`` is timed ``--calls`` times on
each, in turns (after ``--warmup`` calls), and the medians are printed as JSON with their ratio; the target is
a ratio of at most 1.5.

PostgreSQL: ``--dsn`` names the server (default ``$BENCH_PG_URL`` or
``postgresql://postgres@127.0.0.1:5432``); the databases ``bench_stats_small`` and
``bench_stats_large`` are dropped and created again. SQLite: two files in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import tempfile
import time
from typing import Any

import asyncpg

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.transport import Settlement
from fastapi_workqueue.database.postgres import PostgresTransport
from fastapi_workqueue.database.sqlite import SqliteTransport

TOPIC, SUBSCRIPTION = "bench.history", "bench.history.stats"

PG_HISTORY = """
INSERT INTO workqueue.delivery (subscription_id, message_id, status, attempt, max_attempts,
                                backoff_base_seconds, backoff_max_seconds, visible_at, claimed_at, settled_at)
SELECT $1, gen_random_uuid(), 'Completed', 1, 5, 1, 300, now(), now(), now() - random() * interval '1 day'
FROM generate_series(1, $2)
"""
PG_COUNT = "INSERT INTO workqueue.settled_count (subscription_id, completed, discarded) VALUES ($1, $2, 0)"

SQLITE_HISTORY = """
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < :count)
INSERT INTO delivery (subscription_id, message_id, status, attempt, max_attempts, backoff_base_seconds,
                      backoff_max_seconds, visible_at, claimed_at, settled_at, created_at)
SELECT :subscription, lower(hex(randomblob(16))), 'Completed', 1, 5, 1, 300, :now, :now,
       :now - abs(random() % 86400), :now
FROM n
"""


async def live_backlog(transport: Any, args: argparse.Namespace) -> None:
    """The same live work on both stores, through the library."""
    await transport.sync_topology([Topic(name=TOPIC)], [Subscription(name=SUBSCRIPTION, topic=TOPIC, handler_key="h")])
    total = args.pending + args.in_flight + args.dead
    await transport.publish(TOPIC, [prepare(PublishRequest(payload=i)) for i in range(total)])
    claimed = await transport.claim(SUBSCRIPTION, args.in_flight + args.dead)
    dead = claimed[: args.dead]
    await transport.settle([Settlement(c.delivery_id, c.lease_token, "DeadLetter", reason="bench") for c in dead])


async def time_stats(transports: list[Any], args: argparse.Namespace) -> list[float]:
    """Median milliseconds of one stats() call on each transport, the calls taken in turns so that
    whatever else the machine does weighs on both alike."""
    for _ in range(args.warmup):
        for transport in transports:
            await transport.stats(SUBSCRIPTION)
    times: list[list[float]] = [[] for _ in transports]
    for _ in range(args.calls):
        for transport, taken in zip(transports, times, strict=True):
            start = time.perf_counter()
            await transport.stats(SUBSCRIPTION)
            taken.append(time.perf_counter() - start)
    return [round(statistics.median(taken) * 1000, 3) for taken in times]


async def describe(transport: Any) -> dict[str, Any]:
    [stats] = await transport.stats(SUBSCRIPTION)
    return {"completed": stats.completed, "pending": stats.pending, "in_flight": stats.in_flight,
            "dead_lettered": stats.dead_lettered}


async def postgres_store(args: argparse.Namespace, name: str, history: int) -> Any:
    admin = await asyncpg.connect(f"{args.dsn}/postgres")
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = f"{args.dsn.replace('postgresql://', 'postgresql+asyncpg://', 1)}/{name}"
    transport = PostgresTransport(url, listen=False, pool_max_size=2)
    await transport.open()
    await transport.migrate()
    await live_backlog(transport, args)
    conn = await asyncpg.connect(f"{args.dsn}/{name}")
    try:
        subscription_id = await conn.fetchval("SELECT id FROM workqueue.subscription WHERE name = $1", SUBSCRIPTION)
        await conn.execute(PG_HISTORY, subscription_id, history)
        if await conn.fetchval("SELECT to_regclass('workqueue.settled_count')") is not None:
            await conn.execute(PG_COUNT, subscription_id, history)  # (a schema before 0022 counts nothing)
            await conn.execute("ANALYZE workqueue.settled_count")
        await conn.execute("VACUUM ANALYZE workqueue.delivery")
    finally:
        await conn.close()
    return transport


async def sqlite_store(args: argparse.Namespace, folder: str, history: int) -> Any:
    path = os.path.join(folder, f"history-{history}.db")
    transport = SqliteTransport(f"sqlite+aiosqlite:///{path}")
    await transport.open()
    await transport.migrate()
    await live_backlog(transport, args)
    conn = sqlite3.connect(path)
    try:
        [(subscription_id,)] = conn.execute("SELECT id FROM subscription WHERE name = ?", (SUBSCRIPTION,))
        conn.execute(SQLITE_HISTORY, {"count": history, "subscription": subscription_id, "now": time.time()})
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'settled_count'").fetchone():
            conn.execute(
                "INSERT INTO settled_count (subscription_id, completed, discarded) VALUES (?, ?, 0) "
                "ON CONFLICT (subscription_id) DO UPDATE SET completed = completed + excluded.completed",
                (subscription_id, history))
        conn.commit()
        conn.execute("ANALYZE")
    finally:
        conn.close()
    return transport


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        transports = []
        try:
            for name, history in (("bench_stats_small", args.small), ("bench_stats_large", args.large)):
                if args.dialect == "postgresql":
                    transports.append(await postgres_store(args, name, history))
                else:
                    transports.append(await sqlite_store(args, folder, history))
            small, large = [await describe(t) for t in transports]
            small["stats_ms"], large["stats_ms"] = await time_stats(transports, args)
        finally:
            for transport in transports:
                await transport.close()
    ratio = large["stats_ms"] / small["stats_ms"]
    return {"dialect": args.dialect, "calls": args.calls, "small": small, "large": large,
            "ratio": round(ratio, 3), "target": "ratio <= 1.5", "met": ratio <= 1.5}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dialect", choices=["postgresql", "sqlite"], default="postgresql")
    ap.add_argument("--dsn", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432"),
                    help="PostgreSQL server, without a database name")
    ap.add_argument("--small", type=int, default=1_000, help="Completed deliveries in the small store")
    ap.add_argument("--large", type=int, default=1_000_000, help="Completed deliveries in the large store")
    ap.add_argument("--pending", type=int, default=200)
    ap.add_argument("--in-flight", type=int, default=20)
    ap.add_argument("--dead", type=int, default=10)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    args.dsn = args.dsn.rstrip("/")
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
