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
from fastapi_workqueue.core.transport import SettleKind, Settlement
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from .conftest import unique
from .support import wait_for

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
    async def waiting() -> bool:
        return bool(await observer.fetchval(
            "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid() AND strpos(query, $1) > 0",
            query_part,
        ))

    await wait_for(waiting, within=within, interval=0.01,
                   describe=lambda: f"no call of {query_part!r} waited for a lock")


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


# -- 2. settles and sweeps of other keys never wait for a producer --------------------------------


class Keys:
    """An Exclusive subscription with deliveries of a hot key and of other keys, all claimed."""

    def __init__(self, transport: PostgresTransport, topic: str, subscription: str) -> None:
        self.transport = transport
        self.topic = topic
        self.subscription = subscription
        self.claimed: dict[str, Any] = {}

    @classmethod
    async def make(cls, transport: PostgresTransport, keys: list[str], mode: str = "Exclusive") -> Keys:
        topic, subscription = unique("hot"), unique(mode.lower())
        await transport.sync_topology([Topic(name=topic)], [Subscription(
            name=subscription, topic=topic, handler_key="h", partition_mode=mode,
            backoff_base_seconds=0, backoff_max_seconds=0)])
        world = cls(transport, topic, subscription)
        await world.publish(*keys)
        for delivery in await transport.claim(subscription, 100):
            assert delivery.partition_key is not None
            world.claimed[delivery.partition_key] = delivery
        assert sorted(world.claimed) == sorted(set(keys))
        return world

    async def publish(self, *keys: str, session: Any = None) -> None:
        results = await self.transport.publish(
            self.topic, [prepare(PublishRequest(payload=key, partition_key=key)) for key in keys], session=session)
        assert all(r.status == "Accepted" for r in results)

    def settlement(self, key: str, kind: SettleKind = "Complete") -> Settlement:
        delivery = self.claimed[key]
        return Settlement(delivery.delivery_id, delivery.lease_token, kind)

    async def in_flight(self, observer: asyncpg.Connection[Any]) -> dict[str, int]:
        rows = await observer.fetch(
            "SELECT d.partition_key, count(*) AS n FROM workqueue.delivery d "
            "JOIN workqueue.subscription s ON s.id = d.subscription_id "
            "WHERE s.name = $1 AND d.status = 'InFlight' GROUP BY d.partition_key", self.subscription)
        return {r["partition_key"]: r["n"] for r in rows}


@pytest.fixture
async def producer(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A caller's connection with an open transaction: the request that published and then does
    slow work. Its transaction lasts until the test ends it, far beyond the 2 s the settles and
    sweeps are given."""
    conn = await engine.connect()
    await conn.begin()
    yield conn
    await conn.close()


async def test_the_settler_writes_other_keys_while_a_producer_holds_a_key(
    pg_transport: PostgresTransport, producer: AsyncConnection, observer: asyncpg.Connection[Any]
) -> None:
    """The host's settler writes one batch at a time: the settle of the held key must not hold up
    the settle of another key queued behind it."""
    from fastapi_workqueue.core.settler import Settler

    world = await Keys.make(pg_transport, ["hot", "other"])
    await world.publish("hot", session=producer)  # the producer now holds key "hot"
    settler = Settler(pg_transport)
    written: dict[str, asyncio.Event] = {key: asyncio.Event() for key in ("hot", "other")}
    results: dict[str, Any] = {}

    def done(key: str) -> Any:
        def record(_settlement: Settlement, result: Any) -> None:
            results[key] = result
            written[key].set()
        return record

    try:
        settler.submit(world.settlement("hot"), done("hot"))
        settler.submit(world.settlement("other"), done("other"))
        await asyncio.wait_for(written["other"].wait(), timeout=2)
        await asyncio.wait_for(written["hot"].wait(), timeout=2)
        assert results == {"hot": "Completed", "other": "Completed"}
        # The key's hand-over waits for the producer: nothing of "hot" is claimable meanwhile.
        assert await pg_transport.claim(world.subscription, 10) == []
        await producer.commit()
        [next_hot] = await pg_transport.claim(world.subscription, 10)
        assert next_hot.partition_key == "hot"
        assert await world.in_flight(observer) == {"hot": 1}
    finally:
        if producer.in_transaction():  # a failed case: let the settler finish before it closes
            await producer.rollback()
        await settler.close()


async def test_a_settle_batch_with_the_held_key_and_others_completes(
    pg_transport: PostgresTransport, producer: AsyncConnection, observer: asyncpg.Connection[Any]
) -> None:
    world = await Keys.make(pg_transport, ["hot", "hot", "a", "b"])  # a second "hot" waits behind the first
    await world.publish("hot", session=producer)
    results = await asyncio.wait_for(pg_transport.settle(
        [world.settlement("a"), world.settlement("hot"), world.settlement("b", "Fail")]), timeout=2)
    assert results == ["Completed", "Completed", "Pending"]
    # "a" is done and "b" is claimable again at once; "hot" stays held by its settled delivery.
    again = await pg_transport.claim(world.subscription, 10)
    assert [d.partition_key for d in again] == ["b"]
    assert await world.in_flight(observer) == {"b": 1}

    await producer.commit()
    claimed = await pg_transport.claim(world.subscription, 10)
    assert [d.partition_key for d in claimed] == ["hot"]  # the second "hot", not the producer's too
    assert await world.in_flight(observer) == {"b": 1, "hot": 1}
    assert await pg_transport.settle([Settlement(claimed[0].delivery_id, claimed[0].lease_token, "Complete")]) == [
        "Completed"]
    [last] = await pg_transport.claim(world.subscription, 10)
    assert last.partition_key == "hot" and last.delivery_id != claimed[0].delivery_id


async def test_a_sweeper_pass_expires_a_lease_of_the_held_key_without_waiting(
    pg_transport: PostgresTransport, producer: AsyncConnection, observer: asyncpg.Connection[Any]
) -> None:
    world = await Keys.make(pg_transport, ["hot", "other"])
    await observer.execute(
        "UPDATE workqueue.delivery SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
        int(world.claimed["hot"].delivery_id))
    await world.publish("hot", session=producer)
    report = await asyncio.wait_for(pg_transport.sweep(), timeout=2)
    assert report.ran and report.retried >= 1  # (other tests' expired leases may be swept too)
    expired = await pg_transport.get_delivery(world.claimed["hot"].delivery_id)
    assert expired is not None and expired.status == "Pending"
    assert await pg_transport.claim(world.subscription, 10) == []  # the key waits for its producer
    assert await world.in_flight(observer) == {"other": 1}

    await producer.commit()
    # Two deliveries of "hot" are Pending now (the expired one and the producer's): one at a time.
    [first] = await pg_transport.claim(world.subscription, 10)
    assert first.partition_key == "hot"
    assert await world.in_flight(observer) == {"hot": 1, "other": 1}
    assert await pg_transport.claim(world.subscription, 10) == []
    assert await pg_transport.settle([Settlement(first.delivery_id, first.lease_token, "Complete")]) == ["Completed"]
    [second] = await pg_transport.claim(world.subscription, 10)
    expired = world.claimed["hot"]
    assert {first.delivery_id, second.delivery_id} > {expired.delivery_id}
    assert (first if first.delivery_id == expired.delivery_id else second).attempt == 2


async def test_a_key_left_stale_is_handed_over_by_the_sweeper_too(
    pg_transport: PostgresTransport, producer: AsyncConnection, observer: asyncpg.Connection[Any]
) -> None:
    """No claim comes; the sweeper re-derives the key once its producer has committed."""
    world = await Keys.make(pg_transport, ["hot"])
    await world.publish("hot", session=producer)
    assert await asyncio.wait_for(pg_transport.settle([world.settlement("hot")]), timeout=2) == ["Completed"]
    stale = ("SELECT count(*) FROM workqueue.partition_stale ps "
             "JOIN workqueue.subscription s ON s.id = ps.subscription_id WHERE s.name = $1")
    assert await observer.fetchval(stale, world.subscription) == 1
    await asyncio.wait_for(pg_transport.sweep(), timeout=2)  # still held: stays stale
    assert await observer.fetchval(stale, world.subscription) == 1
    await producer.commit()
    await pg_transport.sweep()
    assert await observer.fetchval(stale, world.subscription) == 0
    backlog = await pg_transport.backlog(world.subscription)
    assert backlog is not None and backlog.claimable == 1


async def test_an_ordered_key_left_stale_keeps_its_order(
    pg_transport: PostgresTransport, producer: AsyncConnection, observer: asyncpg.Connection[Any]
) -> None:
    world = await Keys.make(pg_transport, ["hot", "hot"], mode="Ordered")
    first = world.claimed["hot"]
    await world.publish("hot", session=producer)  # the third of the key, still uncommitted
    assert await asyncio.wait_for(pg_transport.settle([world.settlement("hot")]), timeout=2) == ["Completed"]
    assert await pg_transport.claim(world.subscription, 10) == []
    await producer.commit()
    payloads = []
    while claimed := await pg_transport.claim(world.subscription, 10):
        assert len(claimed) == 1 and await world.in_flight(observer) == {"hot": 1}
        payloads.append(int(claimed[0].delivery_id))
        await pg_transport.settle([Settlement(claimed[0].delivery_id, claimed[0].lease_token, "Complete")])
    assert len(payloads) == 2 and payloads == sorted(payloads) and payloads[0] > int(first.delivery_id)
