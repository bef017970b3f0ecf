#!/usr/bin/env python3
"""How long each dashboard page takes on a seeded PostgreSQL database.

    .venv/bin/python bench/dashboard/pages.py                       # 100,000 messages
    .venv/bin/python bench/dashboard/pages.py --messages 1000000    # the issue's million
    .venv/bin/python bench/dashboard/pages.py --repeats 50 --out results.json

The database ``bench_dashboard_pages`` (dropped and created again; ``--dsn`` names the server,
default ``$BENCH_PG_URL`` or ``postgresql://postgres@127.0.0.1:5432``) is migrated from the work
tree and seeded with set-based inserts: ``--messages`` messages (every fifth with a partition key,
each with a correlation ID, every tenth a job's), one delivery each on a plain subscription (70 %
Completed history, 20 % Pending backlog, 10 % dead letters in five causes with two kept attempts
each, and 100 InFlight held by two registered processes), an Ordered subscription with a key per
twentieth message (some blocked by a dead-lettered head, some retrying later), and a day of stats
history for the two and a hundred other subscriptions.

The dashboard is mounted in an app whose queue runs no host and is called in-process (httpx's
ASGI transport, signed in with an API key), so a page's time is the app's: its reads of the
database and its rendering, without a network. Each page is requested ``--warmup`` times, then
``--repeats`` times in turns with the others; the median, the 95th percentile and the slowest
are printed (milliseconds) as a table and, with ``--out``, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import asyncpg
import httpx
from fastapi import FastAPI

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fastapi_workqueue import Subscription, Topic, WorkQueue, WorkQueueSettings  # noqa: E402
from fastapi_workqueue.core.keys import SCOPE_ADMIN, SCOPE_OPERATE, SCOPE_READ, create_key  # noqa: E402

DATABASE = "bench_dashboard_pages"
UI = "/work-queue/ui"
SECRET = "bench-dashboard-pages-secret-0123456789"
TOPIC, BULK, ORDERED, JOBS = "bench.pages", "bench.pages.bulk", "bench.pages.ordered", "jobs.default"
CAUSES = [
    "Traceback (most recent call last):\nConnectionError: the relay answered 554 for order 1234",
    "Traceback (most recent call last):\nValueError: no customer with id 98765",
    "Traceback (most recent call last):\nTimeoutError: the warehouse did not answer in 30 s",
    "Traceback (most recent call last):\nKeyError: 'sku'",
    "Traceback (most recent call last):\nRuntimeError: the ledger refused the entry",
]


async def seed(dsn: str, messages: int) -> None:
    """The rows the pages read, written with set-based inserts."""
    conn = await asyncpg.connect(dsn)
    try:
        ids = {r["name"]: r["id"] for r in await conn.fetch("SELECT id, name FROM workqueue.subscription")}
        await conn.execute("""
            INSERT INTO workqueue.message (id, topic, partition_key, attributes, payload, correlation_id,
                                           content_hash, published_at)
            SELECT gen_random_uuid(), $1, CASE WHEN g % 5 = 0 THEN 'customer-' || (g % 5000) END,
                   CASE WHEN g % 10 = 0 THEN '{"job": "send_mail"}'::jsonb ELSE '{}'::jsonb END,
                   '{"n": 1}', 'req-' || g, md5(g::text), now() - make_interval(secs => ($2 - g)::double precision)
            FROM generate_series(1, $2::integer) g
            """, TOPIC, messages)
        await conn.execute("CREATE TEMP TABLE m AS SELECT row_number() OVER (ORDER BY published_at) AS n, id "
                           "FROM workqueue.message")
        await conn.execute("CREATE UNIQUE INDEX ON m (n)")
        processes = [("b6d3f0f2-0000-4000-8000-000000000001", "worker-1", 4101),
                     ("b6d3f0f2-0000-4000-8000-000000000002", "worker-2", 4102)]
        for process_id, host, pid in processes:
            await conn.execute("""
                INSERT INTO workqueue.process (id, hostname, pid, started_at, version, subscriptions, slots, busy,
                                               beat_interval_seconds, last_seen_at)
                VALUES ($1, $2, $3, now() - interval '1 day', 'bench', $4::jsonb, 64, 50, 30, now())
                """, process_id, host, pid, json.dumps([BULK, ORDERED]))
        completed, pending, dead = int(messages * 0.7), int(messages * 0.2), messages - int(messages * 0.9) - 100
        columns = ("subscription_id, message_id, partition_key, key_mode, status, attempt, max_attempts, "
                   "backoff_base_seconds, backoff_max_seconds, visible_at, lease_token, lease_expires_at, claimed_at, "
                   "reason, last_error, created_at, settled_at, held_by")
        await conn.execute(f"""
            INSERT INTO workqueue.delivery ({columns})
            SELECT $1, m.id, NULL, 0, k.status,
                   CASE WHEN k.status = 'Pending' THEN 0 WHEN k.status = 'DeadLettered' THEN 3 ELSE 1 END, 3, 1, 300,
                   now() - interval '1 hour',
                   CASE WHEN k.status = 'InFlight' THEN gen_random_uuid() END,
                   CASE WHEN k.status = 'InFlight' THEN now() + interval '1 minute' END,
                   CASE WHEN k.status <> 'Pending' THEN now() - interval '2 hours' END,
                   CASE WHEN k.status = 'DeadLettered'
                        THEN 'max attempts reached: ' || split_part(($6::text[])[1 + m.n % 5], chr(10), 2) END,
                   CASE WHEN k.status = 'DeadLettered' THEN ($6::text[])[1 + m.n % 5] END,
                   now() - make_interval(secs => ($5 - m.n)::double precision),
                   CASE WHEN k.status IN ('Completed', 'DeadLettered')
                        THEN now() - make_interval(secs => ($5 - m.n)::double precision) END,
                   CASE WHEN k.status <> 'Pending' THEN ($7::uuid[])[1 + m.n % 2] END
            FROM m
            CROSS JOIN LATERAL (
                SELECT CASE WHEN m.n <= $2 THEN 'Completed' WHEN m.n <= $2 + $3 THEN 'Pending'
                            WHEN m.n <= $2 + $3 + $4 THEN 'DeadLettered' ELSE 'InFlight' END AS status) k
            """, ids[BULK], completed, pending, dead, messages, CAUSES,
            [p for p, _, _ in processes])
        # Two kept attempts of each dead letter (the third is its DeadLettered settle's row).
        await conn.execute("""
            INSERT INTO workqueue.delivery_attempt (delivery_id, attempt, started_at, ended_at, held_by, outcome,
                                                    reason, error)
            SELECT d.id, a, d.claimed_at - make_interval(mins => 3 - a), d.claimed_at - make_interval(mins => 3 - a),
                   d.held_by, CASE WHEN a = 3 THEN 'DeadLettered' ELSE 'Failed' END, d.reason, d.last_error
            FROM workqueue.delivery d, generate_series(1, 3) a
            WHERE d.subscription_id = $1 AND d.status = 'DeadLettered'
            """, ids[BULK])
        keys = max(messages // 20, 100)
        blocked, retrying = keys // 50, keys // 100
        await conn.execute(f"""
            INSERT INTO workqueue.delivery ({columns})
            SELECT $1, m.id, 'key-' || m.n, 2,
                   CASE WHEN m.n <= $3 THEN 'DeadLettered' ELSE 'Pending' END,
                   CASE WHEN m.n <= $3 + $4 THEN 1 ELSE 0 END, 5, 1, 300,
                   CASE WHEN m.n > $3 AND m.n <= $3 + $4 THEN now() + interval '1 hour'
                        ELSE now() - interval '1 hour' END,
                   NULL, NULL, NULL, CASE WHEN m.n <= $3 THEN 'the ledger refused the entry' END, NULL, now(),
                   CASE WHEN m.n <= $3 THEN now() END, NULL
            FROM m WHERE m.n <= $2
            """, ids[ORDERED], keys, blocked, retrying)
        await conn.execute(f"""
            INSERT INTO workqueue.delivery ({columns})
            SELECT $1, m.id, 'key-' || (1 + m.n % $2::integer), 2, 'Pending', 0, 5, 1, 300,
                   now() - interval '1 hour', NULL, NULL, NULL, NULL, NULL, now(), NULL, NULL
            FROM m WHERE m.n <= $2 * 3
            """, ids[ORDERED], blocked)
        await conn.execute("""
            INSERT INTO workqueue.partition (subscription_id, partition_key, holder_id, next_id, next_visible_at,
                                             blocked_id)
            SELECT d.subscription_id, d.partition_key, NULL,
                   CASE WHEN d.status = 'Pending' THEN d.id END, CASE WHEN d.status = 'Pending' THEN d.visible_at END,
                   CASE WHEN d.status = 'DeadLettered' THEN d.id END
            FROM workqueue.delivery d
            WHERE d.subscription_id = $1 AND d.id IN (
                SELECT min(x.id) FROM workqueue.delivery x WHERE x.subscription_id = $1 GROUP BY x.partition_key)
            """, ids[ORDERED])
        await conn.execute("""
            INSERT INTO workqueue.stats_history (subscription_id, recorded_at, pending, in_flight, dead_lettered,
                                                 completed, window_seconds)
            SELECT s, date_trunc('minute', now()) - make_interval(mins => m), 10, 2, 1, 60, 60
            FROM unnest(array_cat($1::integer[], (SELECT array_agg(g) FROM generate_series(100000, 100099) g))) s,
                 generate_series(1, 1440) m
            """, list(ids.values()))
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


async def main(args: argparse.Namespace) -> None:
    admin = await asyncpg.connect(f"{args.dsn}/postgres")
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{DATABASE}"')
    finally:
        await admin.close()
    url = f"{args.dsn.replace('postgresql://', 'postgresql+asyncpg://', 1)}/{DATABASE}"
    queue = WorkQueue(
        WorkQueueSettings(database_url=url, enabled=False, auto_migrate=True, dashboard_secret=SECRET),
        topics=[Topic(name=TOPIC)],
        subscriptions=[Subscription(name=BULK, topic=TOPIC, handler_key="bulk"),
                       Subscription(name=ORDERED, topic=TOPIC, handler_key="ordered", partition_mode="Ordered")],
    )
    app = FastAPI(lifespan=queue.lifespan)
    app.mount(UI, queue.dashboard())
    started = time.perf_counter()
    async with queue.lifespan(app):
        await seed(f"{args.dsn}/{DATABASE}", args.messages)
        seeded = time.perf_counter() - started
        key = await create_key(queue.transport, "bench", [SCOPE_READ, SCOPE_OPERATE, SCOPE_ADMIN])  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://dashboard.test") as client:
            form = await client.get(f"{UI}/sign-in")
            token = form.text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
            signed = await client.post(f"{UI}/sign-in", data={"csrf": token, "api_key": key.key, "next": f"{UI}/"})
            assert signed.status_code == 303, signed.text[:300]
            dead = await queue.dead_letters(BULK, limit=1)
            middle = await queue.dead_letters(BULK, limit=1, after=str(int(args.messages * 0.9) - 500))
            dead_id = dead[0].delivery_id
            message_id = dead[0].message_id
            pages = {
                "overview": "/",
                "processes": "/processes",
                "jobs": "/jobs",
                "subscription (dead letters, causes)": f"/subscriptions/{BULK}",
                "subscription, a later dead-letter page": f"/subscriptions/{BULK}?after={middle[0].delivery_id}",
                "ordered subscription (blocked keys)": f"/subscriptions/{ORDERED}",
                "delivery (with attempts)": f"/deliveries/{dead_id}",
                "bulk replay confirmation": f"/subscriptions/{BULK}/replay-all",
                "search: delivery id": f"/search?q={dead_id}",
                "search: MessageID": f"/search?q={message_id}",
                "search: partition key": "/search?q=customer-40",
                "search: correlation ID": f"/search?q=req-{args.messages // 2}",
                "search: job name": "/search?q=send_mail",
                "search: nothing": "/search?q=nobody",
            }
            for path in pages.values():
                for _ in range(args.warmup):
                    answer = await client.get(UI + path)
                    assert answer.status_code == 200, (path, answer.status_code, answer.text[:300])
            times: dict[str, list[float]] = {name: [] for name in pages}
            for _ in range(args.repeats):
                for name, path in pages.items():
                    begin = time.perf_counter()
                    answer = await client.get(UI + path)
                    times[name].append((time.perf_counter() - begin) * 1000)
                    assert answer.status_code == 200
    rows = {name: {"median ms": round(statistics.median(t), 1), "p95 ms": round(percentile(t, 0.95), 1),
                   "max ms": round(max(t), 1)} for name, t in times.items()}
    deliveries = args.messages + max(args.messages // 20, 100) + 3 * (max(args.messages // 20, 100) // 50)
    report = {"messages": args.messages, "deliveries": deliveries, "repeats": args.repeats,
              "seed seconds": round(seeded, 1), "load average": os.getloadavg(), "pages": rows}
    print(f"{args.messages:,} messages, {deliveries:,} deliveries; {args.repeats} requests a page "
          f"(load average {os.getloadavg()[0]:.1f})\n")
    print("| page | median ms | p95 ms | max ms |\n| --- | ---: | ---: | ---: |")
    for name, row in rows.items():
        print(f"| {name} | {row['median ms']} | {row['p95 ms']} | {row['max ms']} |")
    if args.out:
        await asyncio.to_thread(Path(args.out).write_text, json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if not args.keep:
        admin = await asyncpg.connect(f"{args.dsn}/postgres")
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        finally:
            await admin.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432"))
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the database afterwards")
    asyncio.run(main(ap.parse_args()))
