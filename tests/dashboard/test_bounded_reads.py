"""The dashboard with a million deliveries: every page reads a bounded number of rows, each
through an index.

A database of its own holds 1,000,000 deliveries: a week of Completed history, a backlog of
Pending, dead letters and running ones on one subscription, an Ordered subscription with tens of
thousands of keys, some blocked; and a day of stats history for a hundred subscriptions. The app's
transport loads ``auto_explain`` on each of its connections (a subclass that only adds that), so
every statement the pages run, the ones inside the queue's functions included, reports its plan
with the rows each node read; the test sums them by table and looks for sequential scans.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from fastapi_workqueue import Subscription, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.keys import SCOPE_ADMIN, SCOPE_OPERATE, SCOPE_READ, create_key
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from ..conftest import recreate_database, unique
from .shop import SECRET
from .test_pages import sign_in

pytestmark = pytest.mark.timeout(300)

UI = "/work-queue/ui"
HISTORY, BACKLOG, DEAD, RUNNING = 700_000, 200_000, 40_000, 100
KEYS, BLOCKED, RETRYING, BEHIND = 55_000, 1_000, 500, 3
TOTAL = HISTORY + BACKLOG + DEAD + RUNNING + KEYS + BLOCKED * BEHIND
BUDGET = 20_000
"""Rows of delivery a page may read: what the caps and the page sizes allow, a fiftieth of the table."""
MESSAGE_BUDGET = 400
"""Rows of message a page may read: its lists (running, dead letters) and the causes panel's 200."""

EXPLAIN = ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0", "SET auto_explain.log_analyze = on",
           "SET auto_explain.log_timing = off", "SET auto_explain.log_nested_statements = on",
           "SET auto_explain.log_format = json", "SET auto_explain.log_level = notice")


class ExplainedTransport(PostgresTransport):
    """The PostgreSQL transport, each of whose connections reports the plans of what it runs."""

    plans: list[dict[str, Any]]

    async def _connect(self) -> asyncpg.Connection[Any]:
        conn = await super()._connect()
        for statement in EXPLAIN:
            await conn.execute(statement)

        def collect(_conn: Any, message: Any) -> None:
            text = str(message.message)
            start = text.find("{")
            if text.startswith("duration") and start >= 0:
                self.plans.append(json.loads(text[start:]))

        conn.add_log_listener(collect)
        return conn


def rows_read(plans: list[dict[str, Any]]) -> tuple[Counter[str], set[tuple[str, str]]]:
    """Rows each table's scans read (returned plus removed by filters, per loop), and the sequential
    scans seen, by table."""
    read: Counter[str] = Counter()
    scans: set[tuple[str, str]] = set()

    def walk(node: dict[str, Any]) -> None:
        relation = node.get("Relation Name")
        if relation:
            loops = node.get("Actual Loops", 1)
            fetched = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0) + node.get(
                "Rows Removed by Index Recheck", 0)
            read[relation] += fetched * loops
            if node["Node Type"] == "Seq Scan":
                scans.add((relation, node["Node Type"]))
        for child in node.get("Plans", []):
            walk(child)

    for entry in plans:
        walk(entry["Plan"])
    return read, scans


@pytest.fixture(scope="module")
async def million(pg_url: str) -> AsyncIterator[dict[str, Any]]:
    """A migrated database of its own with the deliveries above (built with set-based inserts)."""
    base, _, _ = pg_url.rpartition("/")
    url = f"{base}/wq_million_{unique('db').split('-')[1]}"
    await recreate_database(url)
    topic, bulk, ordered = unique("big"), unique("bulk"), unique("ordered")
    setup = PostgresTransport(url, listen=False, pool_max_size=1)
    await setup.open()
    try:
        await setup.migrate()
        await setup.sync_topology([Topic(name=topic)], [
            Subscription(name=bulk, topic=topic, handler_key="bulk"),
            Subscription(name=ordered, topic=topic, handler_key="ordered", partition_mode="Ordered"),
        ])
    finally:
        await setup.close()
    conn = await asyncpg.connect(to_asyncpg_dsn(url))
    try:
        ids = {r["name"]: r["id"] for r in await conn.fetch("SELECT id, name FROM workqueue.subscription")}
        await conn.execute(
            "INSERT INTO workqueue.message (id, topic, payload, content_hash, published_at) "
            "SELECT gen_random_uuid(), $1, '{\"n\": 1}', md5(g::text), now() - interval '3 days' "
            "FROM generate_series(1, 100000) g", topic)
        messages = "(SELECT array_agg(id) FROM workqueue.message)"
        columns = ("subscription_id, message_id, partition_key, key_mode, status, attempt, max_attempts, "
                   "backoff_base_seconds, backoff_max_seconds, visible_at, lease_token, lease_expires_at, claimed_at, "
                   "reason, last_error, created_at, settled_at")
        await conn.execute(f"""
            WITH m AS (SELECT {messages} AS ids)
            INSERT INTO workqueue.delivery ({columns})
            SELECT $1, m.ids[1 + g % 100000], NULL, 0, s.status, s.attempt, 5, 1, 300,
                   now() - interval '1 hour', s.token, s.lease, s.claimed, s.reason, s.error,
                   now() - make_interval(secs => (g % 600000)::double precision), s.settled
            FROM m, generate_series(1, $2::integer) g
            CROSS JOIN LATERAL (SELECT
                CASE WHEN g <= $3 THEN 'Completed' WHEN g <= $3 + $4 THEN 'Pending'
                     WHEN g <= $3 + $4 + $5 THEN 'DeadLettered' ELSE 'InFlight' END AS status) k
            CROSS JOIN LATERAL (SELECT k.status,
                CASE WHEN k.status = 'Pending' THEN 0 ELSE 1 END AS attempt,
                CASE WHEN k.status = 'InFlight' THEN gen_random_uuid() END AS token,
                CASE WHEN k.status = 'InFlight' THEN now() + interval '1 minute' END AS lease,
                CASE WHEN k.status IN ('InFlight', 'Completed', 'DeadLettered') THEN now() - interval '2 hours' END
                    AS claimed,
                CASE WHEN k.status = 'DeadLettered' THEN 'max attempts reached: ConnectionError' END AS reason,
                CASE WHEN k.status = 'DeadLettered' THEN 'Traceback (most recent call last):\nConnectionError: no'
                END AS error,
                CASE WHEN k.status IN ('Completed', 'DeadLettered')
                     THEN now() - make_interval(secs => (g % 600000)::double precision) END AS settled) s
            """, ids[bulk], HISTORY + BACKLOG + DEAD + RUNNING, HISTORY, BACKLOG, DEAD)
        # The Ordered subscription: one head per key, ready; the first keys blocked by a dead-lettered
        # head with deliveries waiting behind it; the next ones retrying later.
        await conn.execute(f"""
            WITH m AS (SELECT {messages} AS ids)
            INSERT INTO workqueue.delivery ({columns})
            SELECT $1, m.ids[1 + g % 100000], 'key-' || g, 2,
                   CASE WHEN g <= $3 THEN 'DeadLettered' ELSE 'Pending' END,
                   CASE WHEN g <= $3 + $4 THEN 1 ELSE 0 END, 5, 1, 300,
                   CASE WHEN g > $3 AND g <= $3 + $4 THEN now() + interval '1 hour' ELSE now() - interval '1 hour' END,
                   NULL, NULL, NULL, CASE WHEN g <= $3 THEN 'the ledger refused the entry' END, NULL, now(),
                   CASE WHEN g <= $3 THEN now() END
            FROM m, generate_series(1, $2::integer) g
            """, ids[ordered], KEYS, BLOCKED, RETRYING)
        await conn.execute(f"""
            WITH m AS (SELECT {messages} AS ids)
            INSERT INTO workqueue.delivery ({columns})
            SELECT $1, m.ids[1 + g % 100000], 'key-' || (1 + g % $2::integer), 2, 'Pending', 0, 5, 1, 300,
                   now() - interval '1 hour', NULL, NULL, NULL, NULL, NULL, now(), NULL
            FROM m, generate_series(0, $2::integer * $3::integer - 1) g
            """, ids[ordered], BLOCKED, BEHIND)
        await conn.execute("""
            INSERT INTO workqueue.partition (subscription_id, partition_key, holder_id, next_id, next_visible_at,
                                             blocked_id)
            SELECT d.subscription_id, d.partition_key, NULL,
                   CASE WHEN d.status = 'Pending' THEN d.id END, CASE WHEN d.status = 'Pending' THEN d.visible_at END,
                   CASE WHEN d.status = 'DeadLettered' THEN d.id END
            FROM workqueue.delivery d
            WHERE d.subscription_id = $1 AND d.id IN (
                SELECT min(x.id) FROM workqueue.delivery x WHERE x.subscription_id = $1 GROUP BY x.partition_key)
            """, ids[ordered])
        assert await conn.fetchval("SELECT count(*) FROM workqueue.delivery") == TOTAL
        # A day of history, a point a minute, for these two and a hundred other subscriptions.
        await conn.execute("""
            INSERT INTO workqueue.stats_history (subscription_id, recorded_at, pending, in_flight, dead_lettered,
                                                 completed, window_seconds)
            SELECT s, date_trunc('minute', now()) - make_interval(mins => m), 10, 2, 1, 60, 60
            FROM unnest(array_cat($1::integer[], (SELECT array_agg(g) FROM generate_series(1000, 1099) g))) s,
                 generate_series(1, 1440) m
            """, list(ids.values()))
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    yield {"url": url, "bulk": bulk, "ordered": ordered}
    admin = await asyncpg.connect(f"{to_asyncpg_dsn(base)}/postgres")
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{url.rpartition("/")[2]}" WITH (FORCE)')
    finally:
        await admin.close()


async def test_every_page_reads_a_bounded_number_of_rows_through_indexes(million: dict[str, Any]) -> None:
    transport = ExplainedTransport(million["url"], listen=False, pool_max_size=2)
    transport.plans = []
    queue = WorkQueue(WorkQueueSettings(database_url=million["url"], enabled=False), transport=transport)
    app = FastAPI(lifespan=queue.lifespan)
    app.mount(UI, queue.dashboard(secret=SECRET))
    bulk, ordered = million["bulk"], million["ordered"]
    async with queue.lifespan(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://dashboard.test"
    ) as client:
        key = await create_key(queue.transport, "ops", [SCOPE_READ, SCOPE_OPERATE, SCOPE_ADMIN])
        assert (await sign_in(client, key.key)).status_code == 303
        dead = (await queue.dead_letters(bulk, limit=1, after="500000"))[0].delivery_id
        pages = {
            "overview": f"{UI}/",
            "subscription": f"{UI}/subscriptions/{bulk}",
            "dead letters, a later page": f"{UI}/subscriptions/{bulk}?after=920000",
            "ordered subscription": f"{UI}/subscriptions/{ordered}",
            "delivery": f"{UI}/deliveries/{dead}",
            "bulk replay confirmation": f"{UI}/subscriptions/{bulk}/replay-all",
            "search by delivery id": f"{UI}/search?q={dead}",
            "search by MessageID": f"{UI}/search?q={(await queue.get_delivery(dead)).message_id}",  # type: ignore[union-attr]
            "search by partition key": f"{UI}/search?q=key-17",
            "search by job name": f"{UI}/search?q=send_mail",
        }
        for name, path in pages.items():
            transport.plans = []
            page = await client.get(path)
            assert page.status_code == 200, (name, page.text[:500])
            read, scans = rows_read(transport.plans)
            assert transport.plans, f"{name}: no plan was reported"
            print(f"{name}: rows read {dict(read)}")
            assert read["delivery"] <= BUDGET, (name, read)
            assert read["partition"] <= BUDGET, (name, read)
            assert read["message"] <= MESSAGE_BUDGET, (name, read)
            big = {"delivery", "message", "partition", "stats_history"}
            assert not {table for table, _ in scans} & big, (name, scans)
            if name == "overview":
                assert re.search(r'class="num">1,000\+<', page.text), "capped counts are shown as such"
            if name == "ordered subscription":
                assert page.text.count('<tr data-key="key-') == 25 and "DeadLettered" in page.text
