#!/usr/bin/env python3
"""Where the time of a batch publish goes: ``queue.publish`` of 500 messages; the same with Python's
cyclic garbage collector off (``gc.disable()`` around the calls: what the collector's passes over
the objects a batch keeps alive cost), with its first threshold at 10,000 instead of 700, and with
what existed before the calls frozen (``gc.freeze()``); the preparation alone (``PublishRequest`` and
``prepare()``, no database), and a one-table INSERT of 500 rows over arrays (``INSERT ... SELECT
unnest(...)``, the shape of pgqueuer's batch enqueue) for comparison (bench/README.md, "What bounds
the remaining targets").

    .venv/bin/python bench/experiments/batch_split.py                 # 3 turns of 20,000 messages
    .venv/bin/python bench/experiments/batch_split.py --attributes    # each message with one attribute, as a job

One process, one connection per path, calls of ``--batch`` awaited one after another. Each line
gives the messages per second, and per message the wall time, the client's CPU
(``time.process_time``) and the server's CPU (``/proc/<pid>/schedstat`` of the database's
backends; the server must run on this machine). The database (``--database``, default
``bench_batch_split``, on ``$BENCH_PG_URL`` or the local server) is dropped and recreated at the
start; it holds one topic with one subscription, and the one table.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from probe_support import add_database_options, backends, figures, fresh_database, medians, one_topic_queue, server_cpu

from fastapi_workqueue import PublishRequest
from fastapi_workqueue.core.envelope import prepare

TOPIC = "split.batch"
DEFAULT_THRESHOLD = gc.get_threshold()


async def main(args: argparse.Namespace) -> None:
    admin, dsn = await fresh_database(args.url, args.database)
    queue = await one_topic_queue(dsn, TOPIC, "split-batch")
    conn = await asyncpg.connect(dsn)
    await conn.execute("CREATE TABLE one_table (id bigserial PRIMARY KEY, payload jsonb, entrypoint text, "
                       "priority int, status text DEFAULT 'queued', created timestamptz DEFAULT now())")
    await conn.execute("CREATE INDEX ON one_table (priority, id) WHERE status = 'queued'")
    n, batch = args.messages, args.batch

    attributes = {"job": "bench.noop"} if args.attributes else {}

    async def library() -> None:
        for start in range(0, n, batch):
            await queue.publish(TOPIC, [PublishRequest(payload={"i": i}, attributes=attributes)
                                        for i in range(start, start + batch)])

    async def preparation() -> None:
        for start in range(0, n, batch):
            [prepare(PublishRequest(payload={"i": i}, attributes=attributes)) for i in range(start, start + batch)]

    async def one_table() -> None:
        for start in range(0, n, batch):
            await conn.fetch(
                "INSERT INTO one_table (payload, entrypoint, priority) "
                "SELECT unnest($1::jsonb[]), unnest($2::text[]), unnest($3::int[]) RETURNING id",
                [json.dumps({"i": i}) for i in range(start, start + batch)], ["noop"] * batch, [0] * batch)

    def collector(setting: str) -> Callable[[], Awaitable[None]]:
        """``library`` with the cyclic collector off, its first threshold at 10,000 (700 by
        default), or what exists before the calls frozen (``gc.freeze()``, after a collection)."""
        async def path() -> None:
            gc.collect()
            if setting == "off":
                gc.disable()
            elif setting == "threshold":
                gc.set_threshold(10_000, *gc.get_threshold()[1:])
            else:
                gc.freeze()
            try:
                await library()
            finally:
                gc.enable()
                gc.set_threshold(*DEFAULT_THRESHOLD)
                gc.unfreeze()
        return path

    paths: dict[str, Callable[[], Awaitable[None]]] = {
        "queue.publish": library, "queue.publish, gc off": collector("off"),
        "queue.publish, gc 10,000": collector("threshold"), "queue.publish, gc frozen": collector("freeze"),
        "preparation only": preparation, "one-table INSERT": one_table,
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    try:
        for turn in range(args.turns):
            for name, path in paths.items():
                await conn.execute("TRUNCATE workqueue.delivery, workqueue.message, one_table CASCADE")
                await path()  # warm-up and a table of the same size for every turn
                await conn.execute("TRUNCATE workqueue.delivery, workqueue.message, one_table CASCADE")
                pids = await backends(admin, args.database)
                s0, c0, t0 = server_cpu(pids), time.process_time(), time.perf_counter()
                await path()
                wall, client, server = time.perf_counter() - t0, time.process_time() - c0, server_cpu(pids) - s0
                got = {"msgs_per_s": n / wall, "wall_us": wall / n * 1e6, "client_cpu_us": client / n * 1e6,
                       "server_cpu_us": server / n * 1e6}
                results[name].append(got)
                print(f"turn {turn + 1} {name:25s} {figures(got)}", flush=True)
    finally:
        await conn.close()
        await queue.close()
        await admin.close()
    print(json.dumps({"messages": n, "batch": batch, "turns": args.turns, "medians": medians(results)}, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_database_options(ap, "bench_batch_split")
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--attributes", action="store_true",
                    help="every message carries the same attribute (job=bench.noop), as a job does")
    asyncio.run(main(ap.parse_args()))
