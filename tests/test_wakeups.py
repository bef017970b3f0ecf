"""LISTEN/NOTIFY wake-ups on PostgreSQL: opened only by a process that consumes."""

from __future__ import annotations

import asyncpg

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from .conftest import unique
from .support import wait_for


async def listening_backends(pg_url: str) -> int:
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        return int(await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'"
        ))
    finally:
        await conn.close()


async def test_publisher_does_not_listen_and_first_consumer_does(pg_url: str) -> None:
    before = await listening_backends(pg_url)
    transport = PostgresTransport(pg_url, listen=True, pool_max_size=2)
    await transport.open()
    try:
        topic, sub = unique("topic"), unique("wakeups")
        await transport.sync_topology([Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="k")])
        await transport.publish(topic, [prepare(PublishRequest(payload=1))])
        assert await listening_backends(pg_url) == before

        woken: list[str] = []
        await transport.add_wakeup_listener(woken.append)
        await transport.add_wakeup_listener(woken.append)  # one LISTEN connection for any number
        assert await listening_backends(pg_url) == before + 1
        [state] = [s for s in await transport.list_subscriptions() if s.name == sub]
        subscription_id = state.id
        assert isinstance(subscription_id, str)  # a wake-up names its subscription by this id
        await transport.publish(topic, [prepare(PublishRequest(payload=2))])
        await wait_for(lambda: woken.count(subscription_id) == 2, within=5, describe=lambda: woken)
    finally:
        await transport.close()
    assert await listening_backends(pg_url) == before
