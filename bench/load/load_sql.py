#!/usr/bin/env python3
"""What an order of the example app costs the database server, through the SQL functions alone.

    .venv/bin/python bench/load/load_sql.py                      # both variants, single and batched, 3 repeats
    .venv/bin/python bench/load/load_sql.py --orders 500 --repeats 1

No HTTP, no Python runtime in between: one asyncpg connection drives, for each order, what the
example app's path asks of the store. The topology is the example's: topic ``orders.created``
with ``orders.email`` (Exclusive) and ``orders.audit`` (Ordered), customers drawn from
``--customers`` keys with a seeded random source.

- ``single``: per order, ``publish_one``, then for each subscription ``claim(…, 1)`` and
  ``settle`` of what it got: five transactions, as the app makes them under light load.
- ``batched``: per ``--batch`` orders, one ``publish`` of the batch, then for each
  subscription claims of up to the batch and one ``settle`` per claim: as under heavy load.

It reads the CPU time of the driving connection's backend from ``/proc/<pid>/stat`` (the server
runs on this machine) before and after, and the time inside each ``workqueue.*`` routine from
``pg_stat_user_functions`` (``track_functions = 'pl'``), and prints JSON: server CPU-ms per order,
wall ms per order, and per routine its calls and self time per order.

Variants (``--variants``), measured in turns in the same database:

- ``tuned``: the hot-path functions with ``plan_cache_mode = force_generic_plan`` and
  ``enable_seqscan = off``, as ``sql/postgresql/schema.sql`` creates them.
- ``plain``: the same functions with both reset to the server's defaults.

The database (``--database``, default ``bench_load_sql``) is dropped and recreated at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from fastapi_workqueue import Subscription, Topic, WorkQueue, WorkQueueSettings

TOPIC = "orders.created"
SUBSCRIPTIONS = (("orders.email", "Exclusive"), ("orders.audit", "Ordered"))
# The routines an order's path runs, by signature (sql/postgresql/schema.sql).
HOT_PATH = (
    "publish(text, uuid[], text[], jsonb[], text[], text[], text[], text[], text[], double precision[], "
    "double precision[], timestamp with time zone[], integer[], text[], integer[])",
    "publish_one(text, uuid, text, jsonb, text, text, text, text, double precision, timestamp with time zone, "
    "integer, text, integer)",
    "claim(text, integer, uuid, timestamp with time zone)",
    "claim_many(text[], integer, uuid, timestamp with time zone)",
    "heartbeat(bigint[], uuid[], smallint[], text[], timestamp with time zone)",
    "settle(bigint[], uuid[], text[], double precision[], text[], text[], double precision[], "
    "timestamp with time zone)",
    "refresh_partition(integer, text, smallint)",
    "release_keys(bigint[])",
    "rederive_stale(integer[], integer)",
)
TICKS = os.sysconf("SC_CLK_TCK")


def server_dsn(pg_url: str, database: str) -> str:
    scheme, sep, rest = pg_url.partition("://")
    if not sep or scheme.split("+", 1)[0] not in ("postgresql", "postgres"):
        raise SystemExit(f"--pg-url {pg_url!r} is not a PostgreSQL URL such as postgresql://postgres@127.0.0.1:5432")
    return f"postgresql://{rest.split('/', 1)[0]}/{database}"


def backend_cpu_seconds(pid: int) -> float:
    """utime + stime of a server process (fields 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def prepare(pg_url: str, database: str) -> str:
    admin = await asyncpg.connect(server_dsn(pg_url, "postgres"))
    try:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            database)
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}"')
        await admin.execute(f'CREATE DATABASE "{database}"')
        await admin.execute(f"ALTER DATABASE \"{database}\" SET track_functions = 'pl'")
    finally:
        await admin.close()
    dsn = server_dsn(pg_url, database)
    queue = WorkQueue(
        WorkQueueSettings(database_url=dsn, enabled=False),
        topics=[Topic(name=TOPIC)],
        subscriptions=[Subscription(name=n, topic=TOPIC, handler_key=n, partition_mode=m)  # type: ignore[arg-type]
                       for n, m in SUBSCRIPTIONS],
    )
    await queue.migrate()
    await queue.open()  # writes the topic and subscriptions
    await queue.close()
    return dsn


async def set_variant(conn: asyncpg.Connection[Any], variant: str) -> None:
    for signature in HOT_PATH:
        if variant == "plain":
            await conn.execute(f"ALTER FUNCTION workqueue.{signature} RESET plan_cache_mode RESET enable_seqscan")
        else:
            await conn.execute(f"ALTER FUNCTION workqueue.{signature} "
                               "SET plan_cache_mode = force_generic_plan SET enable_seqscan = off")


async def reset_tables(conn: asyncpg.Connection[Any]) -> None:
    keep = {"topic", "subscription", "schema_migration"}
    tables = [r["tablename"] for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'workqueue'")
              if r["tablename"] not in keep]
    await conn.execute("TRUNCATE " + ", ".join(f"workqueue.{t}" for t in sorted(tables)) + " RESTART IDENTITY")


class Orders:
    """The example's order messages: a payload, its hash and size, a customer key."""

    def __init__(self, customers: int, seed: int) -> None:
        self.customers = customers
        self.random = random.Random(seed)
        self.n = 0

    def next(self) -> tuple[uuid.UUID, str, str, str, int]:
        self.n += 1
        customer = f"customer-{self.random.randrange(self.customers)}"
        payload = json.dumps({"order_id": self.n, "customer": customer, "amount_cents": 1000 + self.n % 500})
        digest = hashlib.sha256(payload.encode()).hexdigest()
        return uuid.uuid4(), customer, payload, digest, len(payload) + 200


PUBLISH_ONE = ("SELECT * FROM workqueue.publish_one(p_topic => $1, p_message_id => $2, p_partition_key => $3, "
               "p_attributes => $4, p_payload => $5, p_payload_ref => $6, p_correlation_id => $7, "
               "p_content_hash => $8, p_delay => $9, p_not_before => $10, p_max_attempts => $11, "
               "p_backoff_schedule => $12, p_envelope_bytes => $13)")
PUBLISH = ("SELECT * FROM workqueue.publish(p_topic => $1, p_message_ids => $2, p_partition_keys => $3, "
           "p_attributes => $4, p_payloads => $5, p_payload_refs => NULL, p_correlation_ids => NULL, "
           "p_content_hashes => $6, p_deduplication_keys => NULL, p_deduplication_ttls => NULL, p_delays => NULL, "
           "p_not_befores => NULL, p_max_attempts => NULL, p_backoff_schedules => NULL, p_envelope_bytes => $7)")
CLAIM = "SELECT * FROM workqueue.claim(p_subscription => $1, p_limit => $2)"
SETTLE = ("SELECT * FROM workqueue.settle(p_ids => $1, p_tokens => $2, p_outcomes => $3, p_delays => NULL, "
          "p_reasons => NULL, p_errors => NULL, p_draws => $4)")


async def consume(conn: asyncpg.Connection[Any], limit: int) -> int:
    """Claims up to ``limit`` of each subscription and settles each claim as Complete."""
    done = 0
    for name, _ in SUBSCRIPTIONS:
        rows = await conn.fetch(CLAIM, name, limit)
        if rows:
            await conn.fetch(SETTLE, [r["delivery_id"] for r in rows], [r["lease_token"] for r in rows],
                             ["Complete"] * len(rows), [0.5] * len(rows))
            done += len(rows)
    return done


async def run_orders(conn: asyncpg.Connection[Any], orders: Orders, count: int, mode: str, batch: int) -> None:
    if mode == "single":
        for _ in range(count):
            mid, key, payload, digest, size = orders.next()
            await conn.fetch(PUBLISH_ONE, TOPIC, mid, key, "{}", payload, None, None, digest, None, None, None,
                             None, size)
            await consume(conn, 1)
    else:
        for _ in range(0, count, batch):
            items = [orders.next() for _ in range(batch)]
            await conn.fetch(PUBLISH, TOPIC, [i[0] for i in items], [i[1] for i in items], ["{}"] * batch,
                             [i[2] for i in items], [i[3] for i in items], [i[4] for i in items])
            while await consume(conn, batch):  # an Exclusive/Ordered key gives one delivery per claim
                pass
    # Whatever is left (a key's later orders in the same batch) is finished before the next mark.
    while await consume(conn, max(batch, 1)):
        pass


async def measure(dsn: str, variant: str, mode: str, count: int, batch: int, customers: int, seed: int,
                  warmup: int) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn)
    try:
        await set_variant(conn, variant)
        await reset_tables(conn)
        await conn.close()
        conn = await asyncpg.connect(dsn)  # a fresh backend: no plan cached from another variant
        orders = Orders(customers, seed)
        await run_orders(conn, orders, warmup, mode, batch)
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        before_fn = {r["funcname"]: (r["calls"], r["self_time"]) for r in await conn.fetch(
            "SELECT funcname, calls, self_time FROM pg_stat_user_functions WHERE schemaname = 'workqueue'")}
        cpu0, wall0 = backend_cpu_seconds(pid), time.perf_counter()
        await run_orders(conn, orders, count, mode, batch)
        wall = time.perf_counter() - wall0
        cpu = backend_cpu_seconds(pid) - cpu0
        await conn.execute("SELECT pg_sleep(0.6)")  # function counters are flushed at most once a second
        await conn.close()
        conn = await asyncpg.connect(dsn)
        await conn.execute("SELECT pg_sleep(0.6)")
        after_fn = {r["funcname"]: (r["calls"], r["self_time"]) for r in await conn.fetch(
            "SELECT funcname, calls, self_time FROM pg_stat_user_functions WHERE schemaname = 'workqueue'")}
        left = await conn.fetchval("SELECT count(*) FROM workqueue.delivery WHERE status <> 'Completed'")
        done = await conn.fetchval("SELECT count(*) FROM workqueue.delivery WHERE status = 'Completed'")
    finally:
        await conn.close()
    routines = {}
    for name, (calls, self_time) in sorted(after_fn.items()):
        c0, t0 = before_fn.get(name, (0, 0.0))
        if calls - c0:
            routines[name] = {"calls_per_order": round((calls - c0) / count, 3),
                              "self_ms_per_order": round((self_time - t0) / count, 4)}
    expected = (warmup + count) * len(SUBSCRIPTIONS)
    return {
        "variant": variant, "mode": mode, "orders": count, "batch": batch if mode == "batched" else 1,
        "server_cpu_ms_per_order": round(cpu * 1000 / count, 3),
        "wall_ms_per_order": round(wall * 1000 / count, 3),
        "routines": routines,
        "check": "ok" if left == 0 and done == expected else f"{done} Completed of {expected}, {left} left",
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432"))
    parser.add_argument("--database", default="bench_load_sql")
    parser.add_argument("--variants", default="plain,tuned")
    parser.add_argument("--modes", default="single,batched")
    parser.add_argument("--orders", type=int, default=2000, help="orders per measurement (default 2000)")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--customers", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.orders % args.batch or args.warmup % args.batch:
        raise SystemExit("--orders and --warmup must be multiples of --batch")
    variants = args.variants.split(",")
    for v in variants:
        if v not in ("plain", "tuned"):
            raise SystemExit(f"--variants takes plain and tuned, not {v!r}")
    dsn = await prepare(args.pg_url, args.database)
    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for mode in args.modes.split(","):
            for variant in variants if r % 2 == 0 else variants[::-1]:  # the order alternates
                run = await measure(dsn, variant, mode, args.orders, args.batch, args.customers, args.seed + r,
                                    args.warmup)
                print(json.dumps({k: run[k] for k in ("variant", "mode", "server_cpu_ms_per_order",
                                                        "wall_ms_per_order", "check")}), file=sys.stderr, flush=True)
                runs.append(run)
    # The functions stay as the migrations left them.
    conn = await asyncpg.connect(dsn)
    try:
        await set_variant(conn, "tuned")
    finally:
        await conn.close()
    summary = {}
    for mode in args.modes.split(","):
        for variant in variants:
            mine = [x for x in runs if x["mode"] == mode and x["variant"] == variant]
            summary[f"{mode}/{variant}"] = {
                "server_cpu_ms_per_order": {"median": statistics.median(x["server_cpu_ms_per_order"] for x in mine),
                                            "min": min(x["server_cpu_ms_per_order"] for x in mine),
                                            "max": max(x["server_cpu_ms_per_order"] for x in mine)},
                "wall_ms_per_order": statistics.median(x["wall_ms_per_order"] for x in mine),
            }
    load = [round(x, 2) for x in os.getloadavg()]
    result = {"summary": summary, "runs": runs, "load_average_after": load,
              "settings": {k: getattr(args, k) for k in ("orders", "warmup", "batch", "customers", "repeats", "seed")}}
    text = json.dumps(result, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    asyncio.run(main())
