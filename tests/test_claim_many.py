"""claim_many on PostgreSQL: what it reads with a large backlog (each subscription's claim index up
to the limit, never the whole backlog), that concurrent claimers take different deliveries (and a
claim past held ones still takes its limit), and that it commits as a claim without keys does
(synchronous_commit off)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import asyncpg
import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from .conftest import unique
from .support import explain_each_statement
from .test_migrations import scratch_url  # noqa: F401  (a fixture: an empty database of its own)
from .test_plans import rows_read

pytestmark = pytest.mark.timeout(180)

BACKLOG = 20_000
"""Messages published to one topic with three subscriptions: 60,000 Pending deliveries."""


async def queues(transport: PostgresTransport, count: int) -> tuple[str, list[str]]:
    """A topic with ``count`` None-mode subscriptions: each message gives each one a delivery."""
    topic = unique("jobs")
    names = [unique(f"q{i}") for i in range(count)]
    await transport.sync_topology(
        [Topic(name=topic)], [Subscription(name=n, topic=topic, handler_key="h") for n in names])
    return topic, names


async def test_claim_many_reads_each_claim_index_up_to_the_limit_whatever_the_backlog(
    scratch_url: str,  # noqa: F811
) -> None:
    transport = PostgresTransport(scratch_url, listen=False, pool_max_size=2)
    await transport.open()
    try:
        await transport.migrate()
        topic, names = await queues(transport, 3)
        for start in range(0, BACKLOG, 2000):
            await transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(start, start + 2000)])
    finally:
        await transport.close()

    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        await conn.execute("ANALYZE workqueue.delivery, workqueue.message, workqueue.subscription")
        plans = await explain_each_statement(conn)
        before = await rows_read(conn, "delivery")
        claimed = []
        for _ in range(7):  # past the point where PL/pgSQL may switch to a generic plan
            claimed += await conn.fetch("SELECT subscription, delivery_id FROM workqueue.claim_many($1, 10)", names)
        after = await rows_read(conn, "delivery")
        await conn.execute("SET auto_explain.log_min_duration = -1")
    finally:
        await conn.close()
    assert len(claimed) == 70 and len({r["delivery_id"] for r in claimed}) == 70
    # Seven claims of ten across three subscriptions of 20,000 Pending each: each claim reads at
    # most ten candidates per subscription and locks and updates ten. A sort of the backlog would
    # read 60,000 rows per claim.
    assert after - before < 7 * 80, (before, after)
    text = "\n".join(plans)
    assert "claim_many" in text or "delivery_claim" in text, "auto_explain sent no plan"
    assert "Seq Scan on delivery" not in text
    sorted_rows = [int(n) for n in re.findall(r"Sort .*?\(actual time=\S+ rows=(\d+)", text)]
    assert all(n <= 30 for n in sorted_rows), sorted_rows


async def test_two_claimers_never_take_the_same_delivery(pg_url: str, pg_transport: PostgresTransport) -> None:
    topic, names = await queues(pg_transport, 2)
    await pg_transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(10)])

    # One claimer's transaction is still open, its rows locked: the other claims past them.
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        async with conn.transaction():
            held = {r["delivery_id"] for r in await conn.fetch(
                "SELECT delivery_id FROM workqueue.claim_many($1, 6)", names)}
            assert len(held) == 6
            other = {int(d.delivery_id) for _, d in await pg_transport.claim_many(names, 20)}
        assert len(other) == 14 and not held & other
    finally:
        await conn.close()

    # Many claimers at once, on four connections, until nothing is left: each delivery once.
    await pg_transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(150)])
    taken: list[str] = []

    async def claimer() -> None:
        while True:
            got = await pg_transport.claim_many(names, 7)
            if not got:
                return
            taken.extend(d.delivery_id for _, d in got)

    await asyncio.gather(*(claimer() for _ in range(6)))
    assert len(taken) == 300 and len(set(taken)) == 300


async def test_a_claim_past_held_deliveries_still_takes_its_limit(pg_url: str, pg_transport: PostgresTransport) -> None:
    # The oldest due deliveries are held by another claimer's open transaction: a claim of fewer
    # than what waits makes them up from the subscriptions' indexes past the held ones.
    topic, names = await queues(pg_transport, 2)
    await pg_transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(10)])
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        async with conn.transaction():
            held = {r["delivery_id"] for r in await conn.fetch(
                "SELECT delivery_id FROM workqueue.claim_many($1, 6)", names)}
            assert len(held) == 6
            other = [(name, int(d.delivery_id)) for name, d in await pg_transport.claim_many(names, 8)]
        assert len(other) == 8 and not held & {i for _, i in other}
        assert {name for name, _ in other} <= set(names)
        rest = {int(d.delivery_id) for _, d in await pg_transport.claim_many(names, 20)}
        assert len(rest) == 6 and not rest & (held | {i for _, i in other})
    finally:
        await conn.close()


async def test_one_busy_queue_among_empty_ones_is_claimed_from_its_index(
    pg_url: str, pg_transport: PostgresTransport
) -> None:
    """A worker's usual case: of the queues it names, one has work. Its deliveries are
    locked as its claim index gives them, oldest first, past the rows another claimer holds; what
    waits on a later visible_at, or on a paused queue, stays."""
    busy_topic, [busy] = await queues(pg_transport, 1)
    _, empty = await queues(pg_transport, 2)
    later_topic, [later] = await queues(pg_transport, 1)
    names = [*empty, busy, later]
    await pg_transport.publish(busy_topic, [prepare(PublishRequest(payload=i)) for i in range(20)])
    await pg_transport.publish(later_topic, [prepare(PublishRequest(payload="later", delay_seconds=60))])

    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        async with conn.transaction():
            held = [r["delivery_id"] for r in await conn.fetch(
                "SELECT delivery_id FROM workqueue.claim_many($1, 6)", names)]
            assert len(held) == 6 and held == sorted(held)  # the oldest, in order
            other = [(name, d) for name, d in await pg_transport.claim_many(names, 10)]
            assert {name for name, _ in other} == {busy}
            ids = [int(d.delivery_id) for _, d in other]
            assert len(ids) == 10 and not set(held) & set(ids) and ids == sorted(ids)
            assert min(ids) > max(held)  # the next oldest, past the held ones
        rest = {int(d.delivery_id) for _, d in await pg_transport.claim_many(names, 50)}
        assert len(rest) == 4 and not rest & (set(held) | set(ids))
        assert await pg_transport.claim_many(names, 50) == []  # the delayed one waits
    finally:
        await conn.close()

    # Many claimers at once on the one busy queue, until nothing is left: each delivery once.
    await pg_transport.publish(busy_topic, [prepare(PublishRequest(payload=i)) for i in range(200)])
    taken: list[str] = []

    async def claimer() -> None:
        while True:
            got = await pg_transport.claim_many(names, 9)
            if not got:
                return
            assert {name for name, _ in got} == {busy}
            taken.extend(d.delivery_id for _, d in got)

    await asyncio.gather(*(claimer() for _ in range(6)))
    assert len(taken) == 200 and len(set(taken)) == 200


async def commit_mode_after(conn: asyncpg.Connection[Any], sql: str, *args: Any) -> tuple[str, int]:
    async with conn.transaction():
        rows = await conn.fetch(sql, *args)
        return str(await conn.fetchval("SHOW synchronous_commit")), len(rows)


async def test_claim_many_commits_as_a_claim_without_keys(pg_url: str, pg_transport: PostgresTransport) -> None:
    topic, names = await queues(pg_transport, 2)
    await pg_transport.publish(topic, [prepare(PublishRequest(payload=1))])
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        claim_many = "SELECT * FROM workqueue.claim_many($1, 10)"
        assert await commit_mode_after(conn, claim_many, names) == ("off", 2)
        assert await conn.fetchval("SHOW synchronous_commit") == "on"
        assert await commit_mode_after(conn, claim_many, names) == ("on", 0)  # nothing claimed
    finally:
        await conn.close()
