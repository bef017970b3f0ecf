"""Keys of Exclusive and Ordered subscriptions under concurrency (PostgreSQL, READ COMMITTED: each
statement of a function sees what had committed when it started).

Every case is made deterministic with a second connection that holds a row lock the call under
test must meet, and the case waits until the server reports the call waiting on it before it
goes on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.transport import Settlement
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from .conftest import unique

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def engine(pg_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(pg_url)
    yield engine
    await engine.dispose()


@pytest.fixture
async def observer(pg_url: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    """A connection of its own, to watch the others from."""
    conn: asyncpg.Connection[Any] = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    yield conn
    await conn.close()


async def wait_until_blocked(observer: asyncpg.Connection[Any], query_part: str, within: float = 10.0) -> None:
    """Returns once a backend of this database running a query that contains ``query_part`` waits
    for a lock (a row lock shows as a wait on another transaction)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        waiting = await observer.fetchval(
            "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid() AND strpos(query, $1) > 0",
            query_part,
        )
        if waiting:
            return
        if loop.time() > deadline:
            raise AssertionError(f"no call of {query_part!r} waited for a lock within {within} s")
        await asyncio.sleep(0.01)


# -- 1. publish reads each subscription's partition mode where it inserts the deliveries ---------


async def test_a_subscription_made_exclusive_during_a_publish_keeps_single_flight(
    pg_transport: PostgresTransport, engine: AsyncEngine, observer: asyncpg.Connection[Any]
) -> None:
    """Publish's general path used to decide in its first statement whether the topic had keyed
    subscriptions, and inserted every delivery with key_mode 0 when it saw none. A subscription
    created as Exclusive after that statement (here: while the publish waits for a deduplication
    key another transaction holds) then got two deliveries of one key claimable at once."""
    topic = unique("race")
    await pg_transport.sync_topology([Topic(name=topic)], [])
    first, second = unique("d"), unique("d")
    holder: AsyncConnection = await engine.connect()
    try:
        await holder.begin()
        # Another producer holds deduplication key `first`, not yet committed.
        [held] = await pg_transport.publish(
            topic, [prepare(PublishRequest(payload="held", deduplication_key=first))], session=holder)
        assert held.status == "Accepted"
        publishing = asyncio.create_task(pg_transport.publish(topic, [
            prepare(PublishRequest(payload=1, partition_key="k", deduplication_key=first)),
            prepare(PublishRequest(payload=2, partition_key="k", deduplication_key=second)),
        ]))
        await wait_until_blocked(observer, "workqueue.publish")
        # Between the publish's statements: the topic gets an Exclusive subscription.
        exclusive = unique("exclusive")
        await pg_transport.sync_topology(
            [Topic(name=topic)],
            [Subscription(name=exclusive, topic=topic, handler_key="h", partition_mode="Exclusive")])
        await holder.rollback()
        results = await asyncio.wait_for(publishing, timeout=10)
    finally:
        await holder.close()
    assert [r.status for r in results] == ["Accepted", "Accepted"]

    modes = await observer.fetch(
        "SELECT d.key_mode FROM workqueue.delivery d JOIN workqueue.subscription s ON s.id = d.subscription_id "
        "WHERE s.name = $1 ORDER BY d.id", exclusive)
    assert [r["key_mode"] for r in modes] == [1, 1]
    # One key, one delivery at a time; the second only once the first is settled.
    claimed = await pg_transport.claim(exclusive, 10)
    assert len(claimed) == 1
    assert await pg_transport.claim(exclusive, 10) == []
    assert await pg_transport.settle([Settlement(claimed[0].delivery_id, claimed[0].lease_token, "Complete")]) == [
        "Completed"]
    [after] = await pg_transport.claim(exclusive, 10)
    assert after.delivery_id != claimed[0].delivery_id
