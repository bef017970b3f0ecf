"""A worker process for the multi-process test: runs one Exclusive and one Ordered subscription.

``python -m tests.workers.mp_worker --database-url URL --topic T --exclusive S1 --ordered S2``

Each handler records its start in ``mp_started`` and, just before it completes, its end in
``mp_log`` (both tables belong to the test, see :data:`LOG_TABLES_DDL`), sleeping 20-120 ms in
between. The process prints ``READY <pid>`` once the queue's lifespan is entered and runs until
SIGTERM or SIGINT, then shuts the host down gracefully and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import sys
import uuid
from collections.abc import Sequence

import asyncpg
from pydantic import BaseModel

from fastapi_workqueue import (
    Outcome,
    Subscription,
    SubscriptionPlan,
    Topic,
    WorkContext,
    WorkMessage,
    WorkOutcome,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.database.postgres import to_asyncpg_dsn

EXCLUSIVE_HANDLER = "mp.exclusive"
ORDERED_HANDLER = "mp.ordered"
LEASE_SECONDS = 2.0
SWEEPER_INTERVAL_MS = 500
IDLE_POLL_MAX_MS = 200
RECONCILE_INTERVAL_MS = 1000
SHUTDOWN_DRAIN_MS = 2000

LOG_TABLES_DDL = """
CREATE TABLE IF NOT EXISTS public.mp_started (
    run_id         uuid PRIMARY KEY,
    subscription   text NOT NULL,
    partition_key  text NOT NULL,
    seq            integer NOT NULL,
    message_id     uuid NOT NULL,
    delivery_id    bigint NOT NULL,
    attempt        integer NOT NULL,
    pid            integer NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS public.mp_log (
    id             bigserial PRIMARY KEY,
    run_id         uuid NOT NULL,
    subscription   text NOT NULL,
    partition_key  text NOT NULL,
    seq            integer NOT NULL,
    message_id     uuid NOT NULL,
    delivery_id    bigint NOT NULL,
    attempt        integer NOT NULL,
    pid            integer NOT NULL,
    finished_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


class Step(BaseModel):
    """The payload of every message of the test: its place in its key's sequence."""

    seq: int


def build_topology(topic: str, exclusive: str, ordered: str) -> tuple[Topic, list[Subscription]]:
    """The topic and the two subscriptions, declared identically by the test and every worker."""
    return Topic(name=topic), [
        Subscription(
            name=exclusive,
            topic=topic,
            handler_key=EXCLUSIVE_HANDLER,
            partition_mode="Exclusive",
            lease_seconds=LEASE_SECONDS,
        ),
        Subscription(
            name=ordered,
            topic=topic,
            handler_key=ORDERED_HANDLER,
            partition_mode="Ordered",
            lease_seconds=LEASE_SECONDS,
        ),
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mp_worker", description=__doc__)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--exclusive", required=True, help="name of the Exclusive subscription")
    parser.add_argument("--ordered", required=True, help="name of the Ordered subscription")
    parser.add_argument("--concurrency", type=int, default=4, help="per subscription")
    parser.add_argument("--pool-size", type=int, default=6, help="connections of the handlers' own pool")
    parser.add_argument("--min-sleep-ms", type=int, default=20)
    parser.add_argument("--max-sleep-ms", type=int, default=120)
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    pid = os.getpid()
    topic, subscriptions = build_topology(args.topic, args.exclusive, args.ordered)
    settings = WorkQueueSettings(
        database_url=args.database_url,
        subscriptions=[
            SubscriptionPlan(name=args.exclusive, concurrency=args.concurrency),
            SubscriptionPlan(name=args.ordered, concurrency=args.concurrency),
        ],
        idle_poll_min_ms=20,
        idle_poll_max_ms=IDLE_POLL_MAX_MS,
        sweeper_interval_ms=SWEEPER_INTERVAL_MS,
        reconcile_interval_ms=RECONCILE_INTERVAL_MS,
        shutdown_drain_ms=SHUTDOWN_DRAIN_MS,
        pool_size=5,
    )
    queue = WorkQueue(settings, topics=[topic], subscriptions=subscriptions)
    pool = await asyncpg.create_pool(to_asyncpg_dsn(args.database_url), min_size=1, max_size=args.pool_size)
    assert pool is not None

    async def record(message: WorkMessage[Step]) -> None:
        run_id = uuid.uuid4()
        values = (
            message.subscription,
            message.partition_key,
            message.payload.seq,
            message.message_id,
            int(message.delivery_id),
            message.attempt,
            pid,
        )
        await pool.execute(
            "INSERT INTO public.mp_started (run_id, subscription, partition_key, seq, message_id, delivery_id, "
            "attempt, pid) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            run_id,
            *values,
        )
        await asyncio.sleep(random.uniform(args.min_sleep_ms, args.max_sleep_ms) / 1000)
        await pool.execute(
            "INSERT INTO public.mp_log (run_id, subscription, partition_key, seq, message_id, delivery_id, "
            "attempt, pid) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            run_id,
            *values,
        )

    @queue.handler(EXCLUSIVE_HANDLER)
    async def exclusive_handler(message: WorkMessage[Step], context: WorkContext) -> WorkOutcome:
        await record(message)
        return Outcome.complete()

    @queue.handler(ORDERED_HANDLER)
    async def ordered_handler(message: WorkMessage[Step], context: WorkContext) -> WorkOutcome:
        await record(message)
        return Outcome.complete()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with queue.lifespan(None):
            print(f"READY {pid}", flush=True)
            await stop.wait()
            print(f"STOPPING {pid}", flush=True)
    finally:
        await pool.close()
    print(f"STOPPED {pid}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s [{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(run(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
