"""What the probes of this folder share: a database of their own, its backends and their CPU."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Mapping, Sequence

import asyncpg

from fastapi_workqueue import Subscription, Topic, WorkQueue, WorkQueueSettings


def add_database_options(ap: argparse.ArgumentParser, database: str) -> None:
    """``--url`` (the server, ``$BENCH_PG_URL`` or the local one) and ``--database`` (``database``)."""
    ap.add_argument("--url", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432"),
                    help="the server, without a database name")
    ap.add_argument("--database", default=database)


async def fresh_database(url: str, database: str) -> tuple[asyncpg.Connection, str]:
    """Drops and creates ``database`` on the server at ``url``; returns a connection to the
    server's ``postgres`` database (the caller closes it) and the new database's URL."""
    base = url.rstrip("/")
    admin = await asyncpg.connect(f"{base}/postgres")
    await admin.execute(f'DROP DATABASE IF EXISTS "{database}"')
    await admin.execute(f'CREATE DATABASE "{database}"')
    return admin, f"{base}/{database}"


async def one_topic_queue(dsn: str, topic: str, subscription: str) -> WorkQueue:
    """A queue on ``dsn`` with ``topic`` and one subscription of it (no host), migrated and open;
    the caller closes it."""
    queue = WorkQueue(WorkQueueSettings(database_url=dsn, enabled=False), topics=[Topic(name=topic)],
                      subscriptions=[Subscription(name=subscription, topic=topic, handler_key=subscription)])
    await queue.migrate()
    await queue.open()
    return queue


async def backends(admin: asyncpg.Connection, database: str) -> list[int]:
    """The process ids of the database's backends now."""
    rows = await admin.fetch("SELECT pid FROM pg_stat_activity WHERE datname = $1", database)
    return [r["pid"] for r in rows]


def server_cpu(pids: list[int]) -> float:
    """Seconds on CPU of these backends so far (0 for one that has gone); the server must run on
    this machine (``/proc/<pid>/schedstat``)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat") as fh:
                total += int(fh.read().split()[0])
        except FileNotFoundError:
            pass
    return total / 1e9


def figures(values: Mapping[str, float], digits: int = 1) -> str:
    """A turn's (or the medians') figures on one line: ``name value``, two spaces apart."""
    return "  ".join(f"{name} {value:{digits + 7}.{digits}f}" for name, value in values.items())


def medians(results: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """Each path's median of each of its figures over its turns."""
    return {path: {name: statistics.median(turn[name] for turn in turns) for name in turns[0]}
            for path, turns in results.items()}
