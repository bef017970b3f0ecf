#!/usr/bin/env python3
"""Where the time of one publish goes: the round trip alone, a plain INSERT, the publish routine
called raw, and ``queue.publish`` (bench/README.md, "Single publish: where the time goes").

    .venv/bin/python bench/experiments/publish_split.py                 # 3 turns of 3,000 calls each
    .venv/bin/python bench/experiments/publish_split.py --calls 5000 --turns 5

One process, one connection per measured path, calls awaited one after another (200 warm-ups
first). Each line gives the wall time per call, the client's CPU (``time.process_time``) and the
server's CPU: the sum over every backend of the database of ``/proc/<pid>/schedstat``, read before
and after (so the wake-up NOTIFY, sent after the commit on another pooled connection, is counted).
The server must run on this machine (its backends' /proc entries are read). The database
(``--database``, default ``bench_publish_split``, on ``$BENCH_PG_URL`` or the local server) is
dropped and recreated at the start; it holds one topic with one subscription.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from probe_support import add_database_options, backends, figures, fresh_database, medians, one_topic_queue, server_cpu

from fastapi_workqueue import PublishRequest

TOPIC = "split.none"
RAW_PUBLISH = (
    "SELECT * FROM workqueue.publish_one(p_topic => $1, p_message_id => $2, p_partition_key => NULL, "
    "p_attributes => '{}'::jsonb, p_payload => $3, p_payload_ref => NULL, p_correlation_id => NULL, "
    "p_content_hash => $4, p_delay => NULL, p_not_before => NULL, p_max_attempts => NULL, "
    "p_backoff_schedule => NULL, p_envelope_bytes => 40, p_quiet => true)"
)


async def measure(admin: asyncpg.Connection, database: str, calls: int,
                  call: Callable[[int], Awaitable[Any]]) -> dict[str, float]:
    for i in range(200):
        await call(i)
    pids = await backends(admin, database)
    s0, c0, t0 = server_cpu(pids), time.process_time(), time.perf_counter()
    for i in range(calls):
        await call(i)
    wall, client, server = time.perf_counter() - t0, time.process_time() - c0, server_cpu(pids) - s0
    return {"wall_us": wall / calls * 1e6, "client_cpu_us": client / calls * 1e6, "server_cpu_us": server / calls * 1e6}


async def main(args: argparse.Namespace) -> None:
    admin, dsn = await fresh_database(args.url, args.database)
    queue = await one_topic_queue(dsn, TOPIC, "split-none")
    conn = await asyncpg.connect(dsn)
    await conn.execute("CREATE TABLE plain (id bigserial PRIMARY KEY, payload jsonb, "
                       "created_at timestamptz DEFAULT now())")
    paths: dict[str, Callable[[int], Awaitable[Any]]] = {
        "SELECT 1": lambda i: conn.fetchval("SELECT 1"),
        "plain INSERT, autocommit": lambda i: conn.execute("INSERT INTO plain (payload) VALUES ($1)", '{"i": 1}'),
        "publish_one quiet, raw": lambda i: conn.fetch(RAW_PUBLISH, TOPIC, uuid.uuid4(), '{"i": 1}', "x"),
        "queue.publish": lambda i: queue.publish(TOPIC, [PublishRequest(payload={"i": i})]),
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    try:
        for turn in range(args.turns):
            names = list(paths)
            names = names[turn % len(names):] + names[:turn % len(names)]  # each path takes each place
            for name in names:
                await conn.execute("TRUNCATE workqueue.delivery, workqueue.message, plain RESTART IDENTITY CASCADE")
                got = await measure(admin, args.database, args.calls, paths[name])
                results[name].append(got)
                print(f"turn {turn + 1} {name:28s} {figures(got)}", flush=True)
    finally:
        await conn.close()
        await queue.close()
        await admin.close()
    summary = medians(results)
    print(json.dumps({"calls": args.calls, "turns": args.turns, "medians": summary}, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_database_options(ap, "bench_publish_split")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--turns", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
