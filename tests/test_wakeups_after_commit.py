"""PostgreSQL wakes a publish's consumers after the publishing transaction commits, not inside it:
the transaction that writes the message sends no NOTIFY (a notifying commit holds a lock of
the whole database until it is flushed), and one NOTIFY of its own names every subscription to wake.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.database.listener import (
    MAX_PAYLOAD_BYTES,
    WAKE_ALL,
    NotificationListener,
    NotificationSender,
    parse_wakeup,
    wakeup_payloads,
)
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from .conftest import unique
from .support import wait_for

pytestmark = pytest.mark.timeout(60)


def test_a_payload_names_one_or_several_subscriptions_and_anything_else_wakes_all() -> None:
    assert parse_wakeup("7") == ["7"]
    assert parse_wakeup("3,5,12") == ["3", "5", "12"]
    for unreadable in ("*", "", "3,,5", "3,x", "subscription", " 3"):
        assert parse_wakeup(unreadable) == [WAKE_ALL], unreadable


def test_long_lists_of_ids_are_split_within_the_notify_limit() -> None:
    assert wakeup_payloads([]) == []
    assert wakeup_payloads([4, 9]) == ["4,9"]
    ids = list(range(1_000_000, 1_003_000))
    payloads = wakeup_payloads(ids)
    assert len(payloads) > 1
    assert all(len(p.encode()) <= MAX_PAYLOAD_BYTES for p in payloads)
    assert [int(i) for p in payloads for i in parse_wakeup(p)] == ids


class Heard:
    """What a plain LISTEN connection on the queue's channel receives."""

    def __init__(self) -> None:
        self.payloads: list[str] = []

    def __call__(self, *args: object) -> None:
        self.payloads.append(str(args[3]))

    def ids(self, among: set[str]) -> list[str]:
        return sorted((i for p in self.payloads for i in parse_wakeup(p) if i in among), key=int)

    async def until(self, count: int, among: set[str]) -> None:
        await wait_for(lambda: len(self.ids(among)) >= count, within=5)

    async def settled(self, pg_url: str, transport: PostgresTransport) -> None:
        """Returns once every NOTIFY the transport sent so far has arrived: its sender has nothing
        left to send, then a sentinel NOTIFY sent after that comes back (NOTIFYs arrive in the
        order of their commits)."""
        await wait_for(lambda: transport._sender is None or transport._sender._task is None, within=5)
        sentinel = f"sentinel-{len(self.payloads)}-{id(self)}"
        conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
        try:
            await conn.execute("SELECT pg_notify('workqueue', $1)", sentinel)
        finally:
            await conn.close()
        await wait_for(lambda: sentinel in self.payloads, within=5)


@pytest.fixture
async def listening(pg_url: str) -> AsyncIterator[Heard]:
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    heard = Heard()
    await conn.add_listener("workqueue", heard)
    try:
        yield heard
    finally:
        await conn.close()


async def two_subscriptions(transport: PostgresTransport) -> tuple[str, set[str]]:
    topic = unique("wake-topic")
    names = {unique("wake-a"), unique("wake-b")}
    await transport.sync_topology([Topic(name=topic)], [
        Subscription(name=name, topic=topic, handler_key="h") for name in sorted(names)
    ])
    ids = {str(s.id) for s in await transport.list_subscriptions() if s.name in names}
    assert len(ids) == 2
    return topic, ids


async def test_a_publish_in_a_session_notifies_once_it_commits_and_never_on_rollback(
    pg_url: str, pg_transport: PostgresTransport, listening: Heard
) -> None:
    rolled_back, rolled_back_ids = await two_subscriptions(pg_transport)
    committed, committed_ids = await two_subscriptions(pg_transport)
    engine = create_async_engine(pg_url)
    try:
        async with AsyncSession(engine) as session:
            async with session.begin():
                [result] = await pg_transport.publish(rolled_back, [prepare(PublishRequest(payload=1))],
                                                      session=session)
                assert result.status == "Accepted"
                await listening.settled(pg_url, pg_transport)
                assert listening.ids(rolled_back_ids) == []  # written, not committed: nobody is woken
                await session.rollback()
            # The same session commits twice more: neither commit wakes the rolled-back publish's
            # subscriptions; the one that published wakes its own, in one NOTIFY.
            async with session.begin():
                await session.execute(text("SELECT 1"))
            async with session.begin():
                [result] = await pg_transport.publish(committed, [prepare(PublishRequest(payload=2))],
                                                      session=session)
                assert result.status == "Accepted"
            await listening.settled(pg_url, pg_transport)
    finally:
        await engine.dispose()
    assert listening.ids(rolled_back_ids) == []
    assert listening.ids(committed_ids) == sorted(committed_ids, key=int)
    assert ",".join(sorted(committed_ids, key=int)) in listening.payloads  # both in one NOTIFY


async def test_a_released_savepoint_wakes_nobody_until_the_transaction_commits(
    pg_url: str, pg_transport: PostgresTransport, listening: Heard
) -> None:
    dropped, dropped_ids = await two_subscriptions(pg_transport)
    kept, kept_ids = await two_subscriptions(pg_transport)
    engine = create_async_engine(pg_url)
    try:
        async with AsyncSession(engine) as session:
            await session.begin()
            async with session.begin_nested():
                await pg_transport.publish(dropped, [prepare(PublishRequest(payload=3))], session=session)
            await listening.settled(pg_url, pg_transport)
            assert listening.ids(dropped_ids) == []  # the savepoint is released; the transaction goes on
            await session.rollback()

            await session.begin()
            async with session.begin_nested():
                await pg_transport.publish(kept, [prepare(PublishRequest(payload=4))], session=session)
            await session.commit()
            await listening.settled(pg_url, pg_transport)
    finally:
        await engine.dispose()
    assert listening.ids(dropped_ids) == []
    assert listening.ids(kept_ids) == sorted(kept_ids, key=int)


async def test_a_session_joined_to_an_outer_transaction_wakes_consumers_when_the_outer_one_commits(
    pg_url: str, pg_transport: PostgresTransport, listening: Heard
) -> None:
    """The test-suite pattern: a session bound to a connection whose transaction began outside it.
    Its own commit commits nothing and wakes nobody; the outer transaction's rollback wakes nobody
    either, and its commit wakes the subscriptions (the NOTIFY stays in the transaction)."""
    rolled_back, rolled_back_ids = await two_subscriptions(pg_transport)
    committed, committed_ids = await two_subscriptions(pg_transport)
    engine = create_async_engine(pg_url)
    try:
        for topic, end in ((rolled_back, "rollback"), (committed, "commit")):
            async with engine.connect() as conn:
                outer = await conn.begin()
                async with AsyncSession(bind=conn, join_transaction_mode="create_savepoint") as session:
                    [result] = await pg_transport.publish(topic, [prepare(PublishRequest(payload=5))],
                                                          session=session)
                    assert result.status == "Accepted"
                    await session.commit()
                await listening.settled(pg_url, pg_transport)
                assert listening.ids(rolled_back_ids | committed_ids) == []  # the outer one is open
                await (outer.rollback() if end == "rollback" else outer.commit())
        await listening.until(2, committed_ids)
        await listening.settled(pg_url, pg_transport)
    finally:
        await engine.dispose()
    assert listening.ids(rolled_back_ids) == []
    assert listening.ids(committed_ids) == sorted(committed_ids, key=int)


async def test_a_publish_on_an_async_connection_notifies_inside_its_transaction(
    pg_url: str, pg_transport: PostgresTransport, listening: Heard
) -> None:
    """A Connection's commit event comes before the commit: there the publish keeps its NOTIFY in
    the transaction (PostgreSQL delivers it at the commit, and never after a rollback)."""
    rolled_back, rolled_back_ids = await two_subscriptions(pg_transport)
    committed, committed_ids = await two_subscriptions(pg_transport)
    engine = create_async_engine(pg_url)
    try:
        async with engine.connect() as conn:
            await conn.begin()
            await pg_transport.publish(rolled_back, [prepare(PublishRequest(payload=6))], session=conn)
            await conn.rollback()
            await conn.begin()
            await pg_transport.publish(committed, [prepare(PublishRequest(payload=7))], session=conn)
            await conn.commit()
        await listening.until(2, committed_ids)
        await listening.settled(pg_url, pg_transport)
    finally:
        await engine.dispose()
    assert listening.ids(rolled_back_ids) == []
    assert listening.ids(committed_ids) == sorted(committed_ids, key=int)
    assert pg_transport._sender is not None and pg_transport._sender.sent == 0  # PostgreSQL sent them


async def publish_one(transport: PostgresTransport, conn: asyncpg.Connection[Any], topic: str, n: int, *,
                      delay: float | None = None, key: str | None = None, quiet: bool = True) -> Any:
    """``publish_one`` of payload ``n`` in ``conn``'s transaction, as the transport calls it (quiet
    unless told otherwise)."""
    return await transport.call(
        "publish_one", connection=conn, p_topic=topic,
        p_message_id=prepare(PublishRequest(payload=n)).message_id, p_partition_key=key,
        p_attributes=None, p_payload=str(n), p_payload_ref=None, p_correlation_id=None, p_content_hash=str(n),
        p_delay=delay, p_not_before=None, p_max_attempts=None, p_backoff_schedule=None, p_envelope_bytes=10,
        p_quiet=quiet)


async def test_the_publishing_transaction_itself_sends_no_notify(
    pg_url: str, pg_transport: PostgresTransport, listening: Heard
) -> None:
    """Quiet, publish_one answers whom to wake; the transaction that called it notifies nobody."""
    topic, ids = await two_subscriptions(pg_transport)
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        async with conn.transaction():
            rows = await publish_one(pg_transport, conn, topic, 3)
        [row] = rows
        assert (row["status"], sorted(map(str, row["wake_subscriptions"]), key=int)) == (
            "Accepted", sorted(ids, key=int))
        # Delayed: nothing to claim now, nobody to wake, no rows (Accepted).
        async with conn.transaction():
            later = await publish_one(pg_transport, conn, topic, 4, delay=30.0)
        assert list(later) == []
    finally:
        await conn.close()
    await listening.settled(pg_url, pg_transport)
    assert listening.ids(ids) == []


async def test_publish_one_still_notifies_in_its_transaction_for_an_earlier_version(
    pg_url: str, pg_transport: PostgresTransport, listening: Heard
) -> None:
    """What the transport calls inside a transaction of its own (publish_one) keeps its answers and its wake-ups."""
    topic, ids = await two_subscriptions(pg_transport)
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        async with conn.transaction():
            rows = await conn.fetch(
                "SELECT * FROM workqueue.publish_one($1, $2, NULL, NULL, '5', NULL, NULL, '5', "
                "NULL, NULL, NULL, NULL, 10)",
                topic, prepare(PublishRequest(payload=5)).message_id)
            assert list(rows) == []  # no rows: Accepted
    finally:
        await conn.close()
    await listening.until(2, ids)
    assert listening.ids(ids) == sorted(ids, key=int)
    assert sorted(ids, key=int) == sorted((p for p in listening.payloads if p in ids), key=int)  # one id each


async def test_publish_one_with_a_key_notifies_in_its_transaction_the_subscriptions_it_can_wake(
    pg_url: str, pg_transport: PostgresTransport, listening: Heard
) -> None:
    """Not quiet, a keyed message: the Exclusive subscription whose key it becomes the next of is
    woken, and the one without keys; a second message of the same key wakes only the latter (the
    key has a delivery ahead of it)."""
    topic = unique("wake-keyed")
    keyed, plain = unique("wake-exclusive"), unique("wake-none")
    await pg_transport.sync_topology([Topic(name=topic)], [
        Subscription(name=keyed, topic=topic, handler_key="h", partition_mode="Exclusive"),
        Subscription(name=plain, topic=topic, handler_key="h"),
    ])
    by_name = {s.name: str(s.id) for s in await pg_transport.list_subscriptions() if s.name in (keyed, plain)}
    ids = set(by_name.values())
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        for n in (1, 2):
            async with conn.transaction():
                rows = await publish_one(pg_transport, conn, topic, n, key="k", quiet=False)
            assert list(rows) == []  # no rows: Accepted
    finally:
        await conn.close()
    await listening.settled(pg_url, pg_transport)
    assert listening.ids(ids) == sorted([by_name[keyed], by_name[plain], by_name[plain]], key=int)


async def test_the_listener_wakes_each_subscription_a_payload_names(pg_url: str) -> None:
    woken: list[str] = []
    channel = unique("wake_channel").replace("-", "_")
    listener = NotificationListener(to_asyncpg_dsn(pg_url), channel, woken.append)
    await listener.start()
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        await conn.execute("SELECT pg_notify($1, '3,5')", channel)
        await conn.execute("SELECT pg_notify($1, 'not ids')", channel)
        await conn.execute("SELECT pg_notify($1, '8')", channel)
        await wait_for(lambda: len(woken) >= 4, within=5)
    finally:
        await conn.close()
        await listener.stop()
    assert woken == ["3", "5", WAKE_ALL, "8"]


async def test_a_consumer_in_another_process_is_woken_by_a_session_publish(pg_url: str) -> None:
    """End to end: the transport that listens hears the wake-up that another one sends after its
    session's commit, for its own subscription id."""
    publisher = PostgresTransport(pg_url, listen=False, pool_max_size=2)
    consumer = PostgresTransport(pg_url, pool_max_size=2)
    await publisher.open()
    await consumer.open()
    woken: list[str] = []
    engine = create_async_engine(pg_url)
    try:
        topic, ids = await two_subscriptions(publisher)
        await consumer.add_wakeup_listener(woken.append)
        async with AsyncSession(engine) as session, session.begin():
            await publisher.publish(topic, [prepare(PublishRequest(payload=6))], session=session)
        await wait_for(lambda: ids <= set(woken), within=5)
        assert publisher._sender is not None and publisher._sender.sent >= 1
    finally:
        await engine.dispose()
        await consumer.close()
        await publisher.close()


async def test_wake_ups_sent_together_share_one_notify(pg_url: str, pg_transport: PostgresTransport) -> None:
    """Publishes that commit before the sender gets to run are woken by one NOTIFY naming them all;
    a failed NOTIFY is dropped (logged) and the sender keeps working."""
    channel = unique("wake_together").replace("-", "_")
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    heard = Heard()
    await conn.add_listener(channel, heard)
    sender = NotificationSender(channel, pg_transport.pool.acquire)
    try:
        for sid in range(100, 120):
            sender.send([sid, sid + 1000])
        await wait_for(lambda: heard.payloads, within=5)
        await sender.close()
        assert sender.sent == 1
        assert [int(i) for p in heard.payloads for i in parse_wakeup(p)] == sorted(
            [*range(100, 120), *range(1100, 1120)])

        refusals = [ConnectionError("the pool is closed")]

        def acquire() -> contextlib.AbstractAsyncContextManager[Any]:
            return _refusing(refusals.pop()) if refusals else pg_transport.pool.acquire()

        flaky = NotificationSender(channel, acquire)
        flaky.send([5])  # its NOTIFY fails: logged and dropped
        await wait_for(lambda: flaky._task is None, within=5)
        assert flaky.sent == 0
        flaky.send([6])  # the next one goes out
        await flaky.close()
        flaky.send([7])  # closed: refused
        assert flaky.sent == 1 and flaky._task is None
        await wait_for(lambda: "6" in heard.payloads, within=5)
        assert "5" not in heard.payloads and "7" not in heard.payloads
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def _refusing(error: Exception) -> AsyncIterator[Any]:
    raise error
    yield  # pragma: no cover


async def test_a_publish_alone_notifies_in_its_commit_and_concurrent_ones_after_theirs(
    pg_url: str, pg_transport: PostgresTransport, listening: Heard
) -> None:
    """A publish in a transaction of its own, while no other such publish of the process is under
    way, notifies in its commit: the transport's sender sends nothing, and the consumers hear of it
    all the same. Publishes under way together go quiet: the sender wakes their consumers after
    their commits, several in one NOTIFY."""
    topic, ids = await two_subscriptions(pg_transport)
    sender = pg_transport._sender
    assert sender is not None
    before = sender.sent
    [result] = await pg_transport.publish(topic, [prepare(PublishRequest(payload=1))])
    assert result.status == "Accepted"
    await listening.until(2, ids)
    await listening.settled(pg_url, pg_transport)
    assert sender.sent == before

    heard_before = len(listening.ids(ids))
    answers = await asyncio.gather(*(pg_transport.publish(topic, [prepare(PublishRequest(payload=i))])
                                     for i in range(20)))
    assert [a.status for [a] in answers] == ["Accepted"] * 20
    await listening.settled(pg_url, pg_transport)
    assert sender.sent > before  # the 19 that were not alone: woken through the sender
    assert len(listening.ids(ids)) > heard_before


async def test_a_listener_that_cannot_connect_yet_lets_the_process_start_and_listens_later(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A LISTEN connection refused at start (here: its database is not there yet; in production,
    the server's last connection slot taken) does not stop the process: consumers poll, the watch
    connects in the background, wakes everyone once and then hears each wake-up."""
    from .conftest import drop_database

    woken: list[str] = []
    channel = unique("late_channel").replace("-", "_")
    url = pg_url.rsplit("/", 1)[0] + "/" + unique("wq_late").replace("-", "_")
    listener = NotificationListener(to_asyncpg_dsn(url), channel, woken.append)
    try:
        await listener.start()
        assert "LISTEN connection failed" in caplog.text and "consumers poll" in caplog.text
        assert woken == []
        await drop_database(url, create=True)
        await wait_for(lambda: woken == [WAKE_ALL], within=15)
        conn = await asyncpg.connect(to_asyncpg_dsn(url))
        try:
            await conn.execute("SELECT pg_notify($1, '7')", channel)
            await wait_for(lambda: woken == [WAKE_ALL, "7"], within=5)
        finally:
            await conn.close()
    finally:
        await listener.stop()
        await drop_database(url)
