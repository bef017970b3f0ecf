#!/usr/bin/env python3
"""What a NOTIFY inside the publishing transaction costs concurrent publishers (PostgreSQL 0030).

    .venv/bin/python bench/experiments/notify_commit.py                 # 8 connections, 8 s per round, 3 rounds
    .venv/bin/python bench/experiments/notify_commit.py --clients 16 --seconds 5

No HTTP and no queue runtime: ``--clients`` asyncpg connections each commit, as fast as they can,
what ``POST /orders`` commits (an order row, then one message to ``orders.created`` with an
Exclusive and an Ordered subscription, keyed by one of 1,000 customers), in two variants taken in
turns (the order alternates by round):

- ``inside``: ``publish_one``, which calls ``pg_notify`` in the transaction (what 0029 did);
- ``after``: ``publish_one`` quiet (``p_quiet``), whose answer is notified after the commit by the transport's
  own ``NotificationSender`` on one connection of its own (what the transport does since 0030).

It prints committed transactions per second per round and the medians. The database
(``--database``, default ``bench_notify_commit``, on ``$BENCH_PG_URL`` or the local server) is
dropped and recreated at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastapi_workqueue import Subscription, Topic
from fastapi_workqueue.database.listener import NotificationSender
from fastapi_workqueue.database.postgres import CHANNEL, PostgresTransport

ARGS = "$1, $2, $3, NULL, $4, NULL, NULL, $5, NULL, NULL, NULL, NULL, 100"
TOPIC = "orders.created"


async def prepare(server: str, database: str) -> str:
    admin = await asyncpg.connect(f"{server}/postgres")
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{database}"')
    finally:
        await admin.close()
    dsn = f"{server}/{database}"
    transport = PostgresTransport(dsn, listen=False)
    await transport.open()
    try:
        await transport.migrate()
        await transport.sync_topology([Topic(name=TOPIC)], [
            Subscription(name="orders.email", topic=TOPIC, handler_key="h", partition_mode="Exclusive"),
            Subscription(name="orders.audit", topic=TOPIC, handler_key="h", partition_mode="Ordered"),
        ])
    finally:
        await transport.close()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE TABLE orders (id bigserial PRIMARY KEY, customer text NOT NULL, amount int)")
    finally:
        await conn.close()
    return dsn


async def run(dsn: str, variant: str, clients: int, seconds: float) -> float:
    conns = [await asyncpg.connect(dsn) for _ in range(clients)]
    own = await asyncpg.connect(dsn)

    @contextlib.asynccontextmanager
    async def lend() -> AsyncIterator[asyncpg.Connection]:  # type: ignore[type-arg]
        yield own

    # The transport's own sender, on a connection of its own.
    sender = NotificationSender(CHANNEL, lend)
    committed = 0
    stop = time.monotonic() + seconds

    async def client(conn: asyncpg.Connection, n: int) -> None:  # type: ignore[type-arg]
        nonlocal committed
        k = 0
        while time.monotonic() < stop:
            k += 1
            customer = f"customer-{(n * 7919 + k) % 1000}"
            async with conn.transaction():
                await conn.execute("INSERT INTO orders (customer, amount) VALUES ($1, 5)", customer)
                rows = await conn.fetch(f"SELECT * FROM workqueue.publish_one({ARGS}, p_quiet => $6)",
                                        TOPIC, uuid.uuid4(), customer, '{"order_id": 1}', "h", variant == "after")
            if variant == "after" and rows and rows[0]["wake_subscriptions"]:
                sender.send(rows[0]["wake_subscriptions"])
            committed += 1

    started = time.monotonic()
    await asyncio.gather(*(client(c, n) for n, c in enumerate(conns)))
    elapsed = time.monotonic() - started
    await sender.close()
    for c in (*conns, own):
        await c.close()
    return committed / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--database", default="bench_notify_commit")
    args = parser.parse_args()
    server = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432").rstrip("/")
    dsn = await prepare(server, args.database)
    rates: dict[str, list[float]] = {"inside": [], "after": []}
    for round_ in range(args.rounds):
        for variant in ("inside", "after") if round_ % 2 == 0 else ("after", "inside"):
            rate = await run(dsn, variant, args.clients, args.seconds)
            rates[variant].append(rate)
            print(f"round {round_ + 1} {variant:>6}: {rate:,.0f} transactions/s", flush=True)
    inside, after = (statistics.median(rates[v]) for v in ("inside", "after"))
    print(f"medians: inside {inside:,.0f}/s, after {after:,.0f}/s ({after / inside:.2f}x), "
          f"{args.clients} connections, {args.rounds} rounds of {args.seconds:g} s")


if __name__ == "__main__":
    asyncio.run(main())
