#!/usr/bin/env python3
"""What the search indexes of the message table cost a publish, measured in turns.

    .venv/bin/python bench/experiments/search_indexes.py            # PostgreSQL, 40 turns
    .venv/bin/python bench/experiments/search_indexes.py --turns 80 --single 50 --batches 4

The dashboard's search finds a message by its partition key, correlation ID or job name through
three partial indexes (``message_partition_key``, ``message_correlation_id``, ``message_job``).
Two databases are migrated from the work tree side by side, one of them with the three indexes
dropped, and the same publishes go to both in short turns (who goes first alternating), so that
whatever else the machine does weighs on both alike and both tables grow alike. Each turn
publishes, as the publish bench does, ``--single`` messages one per call and ``--batches`` batches
of 500, once with plain messages (no key, correlation ID or job: the partial indexes are not
written) and once with messages that carry all three (every index written). The messages per
second over all turns are printed as JSON with the change.

``--dsn`` names the server (default ``$BENCH_PG_URL`` or ``postgresql://postgres@127.0.0.1:5432``);
the databases ``bench_search_with`` and ``bench_search_without`` are dropped and created again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import asyncpg

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkQueue, WorkQueueSettings

TOPIC = "bench.search"
DATABASE = "bench_search"
INDEXES = {
    "message_partition_key": "CREATE INDEX message_partition_key ON workqueue.message (partition_key, published_at) "
                             "WHERE partition_key IS NOT NULL",
    "message_correlation_id": "CREATE INDEX message_correlation_id ON workqueue.message (correlation_id, published_at) "
                              "WHERE correlation_id IS NOT NULL",
    "message_job": "CREATE INDEX message_job ON workqueue.message ((attributes ->> 'job'), published_at) "
                   "WHERE attributes ? 'job'",
}


def requests(start: int, count: int, tagged: bool) -> list[PublishRequest]:
    if not tagged:
        return [PublishRequest(payload={"i": i}) for i in range(start, start + count)]
    return [PublishRequest(payload={"i": i}, partition_key=f"customer-{i % 500}", correlation_id=f"req-{i}",
                           attributes={"job": f"job_{i % 20}"}) for i in range(start, start + count)]


async def publish_rate(queue: WorkQueue, total: int, batch: int, tagged: bool) -> float:
    start = time.perf_counter()
    for first in range(0, total, batch):
        results = await queue.publish(TOPIC, requests(first, min(batch, total - first), tagged))
        assert all(r.ok for r in results)
    return total / (time.perf_counter() - start)


async def store(dsn: str, name: str, indexes: bool) -> WorkQueue:
    admin = await asyncpg.connect(f"{dsn}/postgres")
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = f"{dsn.replace('postgresql://', 'postgresql+asyncpg://', 1)}/{name}"
    queue = WorkQueue(WorkQueueSettings(database_url=url, enabled=False, auto_migrate=True),
                      topics=[Topic(name=TOPIC)],
                      subscriptions=[Subscription(name=f"{TOPIC}.a", topic=TOPIC, handler_key="a")])
    await queue.open()
    conn = await asyncpg.connect(f"{dsn}/{name}")
    try:
        for index in INDEXES:
            if not indexes:
                await conn.execute(f"DROP INDEX workqueue.{index}")
        present = await conn.fetchval("SELECT count(*) FROM pg_indexes WHERE schemaname = 'workqueue' "
                                      "AND indexname = ANY($1::text[])", list(INDEXES))
        assert present == (len(INDEXES) if indexes else 0)
    finally:
        await conn.close()
    await publish_rate(queue, 100, 1, True)  # warm-up
    return queue


async def main(args: argparse.Namespace) -> None:
    stores = {"with": await store(args.dsn, f"{DATABASE}_with", True),
              "without": await store(args.dsn, f"{DATABASE}_without", False)}
    cases = [("single", 1, args.single), ("batch of 500", 500, 500 * args.batches)]
    seconds: dict[str, dict[str, float]] = {}
    messages: dict[str, int] = {}
    try:
        for turn in range(args.turns):
            order = ["with", "without"] if turn % 2 == 0 else ["without", "with"]
            for label, batch, total in cases:
                for tagged in (False, True):
                    key = f"{label}, {'key + correlation ID + job' if tagged else 'plain'}"
                    messages[key] = messages.get(key, 0) + total
                    for variant in order:
                        rate = await publish_rate(stores[variant], total, batch, tagged)
                        seconds.setdefault(key, {}).setdefault(variant, 0.0)
                        seconds[key][variant] += total / rate
    finally:
        for queue in stores.values():
            await queue.close()
    report: dict[str, Any] = {"turns": args.turns, "single per turn": args.single,
                              "batches of 500 per turn": args.batches, "cases": {}}
    for key, by in seconds.items():
        with_, without = messages[key] / by["with"], messages[key] / by["without"]
        report["cases"][key] = {"with msgs/s": round(with_), "without msgs/s": round(without),
                                "change %": round((with_ / without - 1) * 100, 1)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432"))
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--single", type=int, default=50, help="messages published one per call, per turn and case")
    ap.add_argument("--batches", type=int, default=2, help="batches of 500, per turn and case")
    asyncio.run(main(ap.parse_args()))
