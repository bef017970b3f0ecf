#!/usr/bin/env python3
"""What the search indexes of the message table cost a publish, measured in turns.

    .venv/bin/python bench/experiments/search_indexes.py            # 6 turns, PostgreSQL
    .venv/bin/python bench/experiments/search_indexes.py --turns 10 --single 2000 --batched 20000

The dashboard's search finds a message by its partition key, correlation ID or job name through
three partial indexes (``message_partition_key``, ``message_correlation_id``, ``message_job``).
One database, migrated from the work tree, is measured with and without them, turn by turn (the
indexes dropped or created again between turns, the tables emptied, who goes first alternating),
so that whatever else the machine does weighs on both alike. Each turn publishes, as the publish
bench does, one message per call (``--single``) and batches of 500 (``--batched`` messages), once
with plain messages (no key, correlation ID or job: the partial indexes are not written) and once
with messages that carry all three (every index written). The medians of the messages per second
are printed as JSON with the change.

``--dsn`` names the server (default ``$BENCH_PG_URL`` or ``postgresql://postgres@127.0.0.1:5432``);
the database ``bench_search_indexes`` is dropped and created again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import asyncpg

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkQueue, WorkQueueSettings

TOPIC = "bench.search"
DATABASE = "bench_search_indexes"
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


async def main(args: argparse.Namespace) -> None:
    admin = await asyncpg.connect(f"{args.dsn}/postgres")
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{DATABASE}"')
    finally:
        await admin.close()
    url = f"{args.dsn.replace('postgresql://', 'postgresql+asyncpg://', 1)}/{DATABASE}"
    queue = WorkQueue(WorkQueueSettings(database_url=url, enabled=False, auto_migrate=True),
                      topics=[Topic(name=TOPIC)],
                      subscriptions=[Subscription(name=f"{TOPIC}.a", topic=TOPIC, handler_key="a")])
    conn = await asyncpg.connect(f"{args.dsn}/{DATABASE}")
    cases = [("single", 1, args.single), ("batch of 500", 500, args.batched)]
    rates: dict[str, dict[str, list[float]]] = {}
    await queue.open()
    try:
        await publish_rate(queue, 200, 1, True)  # warm-up
        for turn in range(args.turns):
            order = ["with", "without"] if turn % 2 == 0 else ["without", "with"]
            for variant in order:
                await conn.execute("TRUNCATE workqueue.message, workqueue.delivery CASCADE")
                for name, ddl in INDEXES.items():
                    await conn.execute(f"DROP INDEX IF EXISTS workqueue.{name}")
                    if variant == "with":
                        await conn.execute(ddl)
                await conn.execute("VACUUM ANALYZE workqueue.message")
                for label, batch, total in cases:
                    for tagged in (False, True):
                        key = f"{label}, {'key + correlation ID + job' if tagged else 'plain'}"
                        rate = await publish_rate(queue, total, batch, tagged)
                        rates.setdefault(key, {}).setdefault(variant, []).append(rate)
    finally:
        await queue.close()
        await conn.close()
    report: dict[str, Any] = {"turns": args.turns, "single": args.single, "batched": args.batched, "cases": {}}
    for key, by in rates.items():
        with_, without = statistics.median(by["with"]), statistics.median(by["without"])
        report["cases"][key] = {"with msgs/s": round(with_), "without msgs/s": round(without),
                                "change %": round((with_ / without - 1) * 100, 1)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432"))
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--single", type=int, default=1000, help="messages published one per call, per turn and case")
    ap.add_argument("--batched", type=int, default=10000, help="messages in batches of 500, per turn and case")
    asyncio.run(main(ap.parse_args()))
