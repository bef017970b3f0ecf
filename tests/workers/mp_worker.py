"""A worker process for the multi-process test: runs one Exclusive and one Ordered subscription.

``python -m tests.workers.mp_worker --database-url URL --topic T --exclusive S1 --ordered S2``

Each handler records its start in ``mp_started`` and, just before it completes, its end in
``mp_log`` (both tables belong to the test, see :data:`LOG_TABLES_DDL` and
:data:`SQLITE_LOG_TABLES_DDL`), sleeping 20-120 ms in between. On PostgreSQL the records go
through an asyncpg pool; on SQLite through a plain connection to the queue's own file, each
record one short autocommitted statement (never inside a queue transaction, so no record holds
the file's single write lock for longer than its insert). The process prints ``READY <pid>``
once the queue's lifespan is entered and runs until SIGTERM or SIGINT, then shuts the host down
gracefully and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import aiosqlite
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
from fastapi_workqueue.core.database_url import sqlite_path
from fastapi_workqueue.database.postgres import to_asyncpg_dsn

EXCLUSIVE_HANDLER = "mp.exclusive"
ORDERED_HANDLER = "mp.ordered"
LEASE_SECONDS = 2.0
SWEEPER_INTERVAL_MS = 500
IDLE_POLL_MAX_MS = 200
SQLITE_IDLE_POLL_MAX_MS = 100
"""SQLite has no LISTEN/NOTIFY: a worker finds work published by another process by polling."""
SQLITE_BUSY_TIMEOUT_MS = 10_000
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


# SQLite: the same tables in the queue's file; times are epoch seconds written by the process.
SQLITE_LOG_TABLES_DDL = """
CREATE TABLE IF NOT EXISTS mp_started (
    run_id         TEXT PRIMARY KEY,
    subscription   TEXT NOT NULL,
    partition_key  TEXT NOT NULL,
    seq            INTEGER NOT NULL,
    message_id     TEXT NOT NULL,
    delivery_id    INTEGER NOT NULL,
    attempt        INTEGER NOT NULL,
    pid            INTEGER NOT NULL,
    started_at     REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS mp_log (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id         TEXT NOT NULL,
    subscription   TEXT NOT NULL,
    partition_key  TEXT NOT NULL,
    seq            INTEGER NOT NULL,
    message_id     TEXT NOT NULL,
    delivery_id    INTEGER NOT NULL,
    attempt        INTEGER NOT NULL,
    pid            INTEGER NOT NULL,
    finished_at    REAL NOT NULL
);
"""


def is_sqlite(database_url: str) -> bool:
    return database_url.startswith("sqlite")


async def open_sqlite(database_url: str) -> aiosqlite.Connection:
    """A plain autocommit connection to the queue's SQLite file that waits for the writer."""
    conn = await aiosqlite.connect(
        sqlite_path(database_url), isolation_level=None, timeout=SQLITE_BUSY_TIMEOUT_MS / 1000
    )
    try:
        await conn.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    except BaseException:
        await conn.close()
        raise
    return conn


class RunLog(Protocol):
    """Where the handlers record their runs."""

    async def started(self, run_id: uuid.UUID, values: tuple[Any, ...]) -> None: ...
    async def finished(self, run_id: uuid.UUID, values: tuple[Any, ...]) -> None: ...
    async def close(self) -> None: ...


class PostgresRunLog:
    """``public.mp_started`` / ``public.mp_log`` through an asyncpg pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @classmethod
    async def open(cls, database_url: str, pool_size: int) -> PostgresRunLog:
        pool = await asyncpg.create_pool(to_asyncpg_dsn(database_url), min_size=1, max_size=pool_size)
        assert pool is not None
        return cls(pool)

    async def started(self, run_id: uuid.UUID, values: tuple[Any, ...]) -> None:
        await self._pool.execute(
            "INSERT INTO public.mp_started (run_id, subscription, partition_key, seq, message_id, delivery_id, "
            "attempt, pid) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            run_id,
            *values,
        )

    async def finished(self, run_id: uuid.UUID, values: tuple[Any, ...]) -> None:
        await self._pool.execute(
            "INSERT INTO public.mp_log (run_id, subscription, partition_key, seq, message_id, delivery_id, "
            "attempt, pid) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            run_id,
            *values,
        )

    async def close(self) -> None:
        await self._pool.close()


class SqliteRunLog:
    """``mp_started`` / ``mp_log`` in the queue's SQLite file: one autocommitted insert per record.

    The connection is in autocommit mode, so each insert is its own transaction: it takes the
    write lock only for that statement (waiting up to the busy timeout for the writer of the
    moment) and never while the handler sleeps.
    """

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    @classmethod
    async def open(cls, database_url: str) -> SqliteRunLog:
        conn = await open_sqlite(database_url)
        # These rows are the test's evidence, not queue state: a process crash (SIGKILL) keeps what
        # was committed in WAL mode with synchronous=NORMAL; only a power cut could lose the tail.
        await conn.execute("PRAGMA synchronous = NORMAL")
        return cls(conn)

    async def started(self, run_id: uuid.UUID, values: tuple[Any, ...]) -> None:
        await self._insert("mp_started", "started_at", run_id, values)

    async def finished(self, run_id: uuid.UUID, values: tuple[Any, ...]) -> None:
        await self._insert("mp_log", "finished_at", run_id, values)

    async def _insert(self, table: str, stamp: str, run_id: uuid.UUID, values: tuple[Any, ...]) -> None:
        subscription, partition_key, seq, message_id, delivery_id, attempt, pid = values
        cursor = await self._conn.execute(
            f"INSERT INTO {table} (run_id, subscription, partition_key, seq, message_id, delivery_id, attempt, pid, "
            f"{stamp}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (str(run_id), subscription, partition_key, seq, str(message_id), delivery_id, attempt, pid, time.time()),
        )
        await cursor.close()

    async def close(self) -> None:
        await self._conn.close()


async def open_run_log(database_url: str, pool_size: int) -> RunLog:
    if is_sqlite(database_url):
        return await SqliteRunLog.open(database_url)
    return await PostgresRunLog.open(database_url, pool_size)


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
    parser.add_argument("--pool-size", type=int, default=6, help="connections of the handlers' own pool (PostgreSQL)")
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
        idle_poll_max_ms=SQLITE_IDLE_POLL_MAX_MS if is_sqlite(args.database_url) else IDLE_POLL_MAX_MS,
        sweeper_interval_ms=SWEEPER_INTERVAL_MS,
        reconcile_interval_ms=RECONCILE_INTERVAL_MS,
        shutdown_drain_ms=SHUTDOWN_DRAIN_MS,
        pool_size=5,
    )
    queue = WorkQueue(settings, topics=[topic], subscriptions=subscriptions)
    run_log = await open_run_log(args.database_url, args.pool_size)

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
        await run_log.started(run_id, values)
        await asyncio.sleep(random.uniform(args.min_sleep_ms, args.max_sleep_ms) / 1000)
        await run_log.finished(run_id, values)

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
        await run_log.close()
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
