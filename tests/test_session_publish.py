"""A publish that joins a SQLAlchemy session on PostgreSQL runs on the session's own connection and
transaction, whether it is the transaction's first statement or follows the caller's writes."""

from __future__ import annotations

import contextlib
import re
import uuid
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from fastapi_workqueue import PublishRequest

from .support import make_queue

pytestmark = pytest.mark.timeout(60)


async def stored(engine: AsyncEngine, message_id: uuid.UUID) -> bool:
    """Whether another connection sees the message (committed)."""
    async with engine.connect() as conn:
        count: int | None = await conn.scalar(
            text("SELECT count(*) FROM workqueue.message WHERE id = :i"), {"i": message_id})
    return count == 1


async def test_a_publish_first_in_a_session_begins_its_transaction_and_rolls_back_with_it(pg_url: str) -> None:
    queue, topic, _ = make_queue(pg_url, [{"role": "a"}], enabled=False)
    engine = create_async_engine(pg_url)
    async with queue.lifespan(None):
        try:
            rolled_back, committed = uuid.uuid4(), uuid.uuid4()
            async with AsyncSession(engine) as session:
                async with session.begin():
                    [result] = await queue.publish(topic, [PublishRequest(message_id=rolled_back, payload=1)],
                                                   session=session)
                    assert result.ok
                    pid = await session.scalar(text("SELECT pg_backend_pid()"))
                    in_tx = await session.scalar(text("SELECT count(*) FROM workqueue.message WHERE id = :i"),
                                                 {"i": rolled_back})
                    assert in_tx == 1  # visible inside the transaction that wrote it
                    await session.rollback()
                assert not await stored(engine, rolled_back)
                async with session.begin():
                    [result] = await queue.publish(topic, [PublishRequest(message_id=committed, payload=2)],
                                                   session=session)
                    assert result.ok
                    assert not await stored(engine, committed)  # not committed yet: other connections see nothing
                assert await stored(engine, committed)
            assert isinstance(pid, int)
        finally:
            await engine.dispose()


async def test_a_publish_after_the_callers_writes_shares_their_fate(pg_url: str) -> None:
    queue, topic, _ = make_queue(pg_url, [{"role": "a"}], enabled=False)
    engine = create_async_engine(pg_url)
    async with queue.lifespan(None):
        try:
            async with engine.begin() as conn:
                await conn.execute(text("CREATE TABLE IF NOT EXISTS session_publish_rows (id uuid PRIMARY KEY)"))
            kept, dropped = uuid.uuid4(), uuid.uuid4()
            for message_id, commit in ((kept, True), (dropped, False)):
                async with AsyncSession(engine) as session:
                    await session.execute(text("INSERT INTO session_publish_rows VALUES (:i)"), {"i": message_id})
                    [a, b] = await queue.publish(topic, [PublishRequest(payload="x"), PublishRequest(payload="y")],
                                                 session=session)  # a batch: the general path
                    [one] = await queue.publish(topic, [PublishRequest(message_id=message_id, payload="z")],
                                                session=session)  # one message: publish_one
                    assert a.ok and b.ok and one.ok
                    if commit:
                        await session.commit()
                    else:
                        await session.rollback()
                assert await stored(engine, message_id) is commit
                async with engine.connect() as conn:
                    count = await conn.scalar(text("SELECT count(*) FROM session_publish_rows WHERE id = :i"),
                                              {"i": message_id})
                assert count == (1 if commit else 0)
            # A duplicate MessageID in the same transaction answers as the general path does.
            async with AsyncSession(engine) as session, session.begin():
                [again] = await queue.publish(topic, [PublishRequest(message_id=kept, payload="z")], session=session)
                assert again.message_id == kept
        finally:
            await engine.dispose()


def message_query(database_url: str) -> str:
    """The count of one message by ID, in the queue's table of each dialect."""
    if database_url.startswith("sqlite"):
        return "SELECT count(*) FROM message WHERE id = :i"
    return "SELECT count(*) FROM workqueue.message WHERE id = :i"


@pytest.mark.parametrize(
    "way", ["session, first statement", "session, after its writes", "connection, first statement",
            "connection, after its writes", "savepoint"]
)
async def test_a_publish_joins_the_callers_transaction_whatever_began_it(database_url: str, way: str) -> None:
    """The message is seen inside the caller's transaction, by nobody outside it, and a rollback of
    that transaction (or of the savepoint around the publish) removes it: a publish that ran on
    another connection, or committed on its own, fails each of these."""
    queue, topic, _ = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True)
    count = text(message_query(database_url))
    sqlite = database_url.startswith("sqlite")

    def key(message_id: uuid.UUID) -> Any:
        return str(message_id) if sqlite else message_id

    async def seen_outside(message_id: uuid.UUID) -> int:
        async with queue.engine.connect() as other:
            return int(await other.scalar(count, {"i": key(message_id)}))

    async with queue.lifespan(None):
        async with queue.engine.begin() as conn:
            await conn.execute(text("CREATE TABLE IF NOT EXISTS joined_rows (id varchar(36) PRIMARY KEY)"))
        for end in ("rollback", "commit"):
            message_id = uuid.uuid4()
            async with queue.engine.connect() as conn, AsyncSession(bind=conn) as bound:
                handle: Any = bound if way.startswith("session") else conn
                outer = await (bound.begin() if handle is bound else conn.begin())
                if "after its writes" in way:
                    await handle.execute(text("INSERT INTO joined_rows VALUES (:i)"), {"i": str(message_id)})
                inner = await handle.begin_nested() if way == "savepoint" else None
                [result] = await queue.publish(topic, [PublishRequest(message_id=message_id, payload=end)],
                                               session=handle)
                assert result.ok
                assert await handle.scalar(count, {"i": key(message_id)}) == 1  # in the caller's transaction
                assert await seen_outside(message_id) == 0  # and in no other
                if end == "rollback":
                    await (inner or outer).rollback()
                    if inner is not None:  # the savepoint is gone, the transaction goes on
                        assert await handle.scalar(count, {"i": key(message_id)}) == 0
                if outer.is_active:
                    await outer.commit()
            assert await seen_outside(message_id) == (1 if end == "commit" else 0), (way, end)


@pytest.mark.parametrize("end", ["rollback", "commit"])
async def test_a_released_first_savepoint_still_ends_with_the_transaction(database_url: str, end: str) -> None:
    """docs/publishing.md: a statement that may fail goes in ``session.begin_nested()``, and if the
    endpoint then raises, its rows and messages roll back together. On SQLite a savepoint that was
    the transaction's first statement opened the file's transaction itself, and its release was the
    commit: the row and the message stayed when the transaction then rolled back."""
    queue, topic, _ = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True)
    count = text(message_query(database_url))
    message_id = uuid.uuid4()
    key: Any = str(message_id) if database_url.startswith("sqlite") else message_id
    async with queue.lifespan(None):
        async with queue.engine.begin() as conn:
            await conn.execute(text("CREATE TABLE IF NOT EXISTS saved_rows (id varchar(36) PRIMARY KEY)"))
        with pytest.raises(RuntimeError) if end == "rollback" else contextlib.nullcontext():
            async with queue.sessionmaker() as session, session.begin():
                async with session.begin_nested():
                    await session.execute(text("INSERT INTO saved_rows VALUES (:i)"), {"i": str(message_id)})
                    [result] = await queue.publish(topic, [PublishRequest(message_id=message_id, payload=1)],
                                                   session=session)
                    assert result.ok
                if end == "rollback":
                    raise RuntimeError("the endpoint fails after the savepoint")
        async with queue.engine.connect() as other:
            rows = await other.scalar(text("SELECT count(*) FROM saved_rows WHERE id = :i"), {"i": str(message_id)})
            messages = await other.scalar(count, {"i": key})
        assert (rows, messages) == ((0, 0) if end == "rollback" else (1, 1))


@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_request_session_made_under_a_loop_now_closed_is_made_again(pg_url: str) -> None:
    """A test without the app's lifespan (``httpx.ASGITransport``) makes the request sessions'
    engine under its own event loop, and nothing disposes of it. The next test, whose client runs
    the lifespan on a new loop (``TestClient``), gets a new engine: the old one's connections
    belong to the closed loop (every request answered 500)."""
    import asyncio
    import gc
    import warnings

    import httpx
    from fastapi import FastAPI

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # starlette's notice about httpx2, not what is tested
        from fastapi.testclient import TestClient

    queue, _, _ = make_queue(pg_url, [{"role": "a"}])
    app = FastAPI(lifespan=queue.lifespan)

    @app.get("/one")
    async def one(session: AsyncSession = queue.session) -> int:
        return int((await session.execute(text("SELECT 1"))).scalar_one())

    async def without_lifespan() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            return (await client.get("/one")).status_code

    assert queue.engine is not None  # (made here, outside any loop: the first loop to use it owns it)
    assert asyncio.run(without_lifespan()) == 200
    with TestClient(app, raise_server_exceptions=False) as client:
        assert [client.get("/one").status_code for _ in range(3)] == [200, 200, 200]
    # The first engine's connection was left with its loop (Python warns of it when it is
    # collected): collected here, not in whichever test runs next.
    gc.collect()


async def test_the_urls_driver_and_server_parameters_reach_the_queue_and_its_sessions(pg_url: str) -> None:
    """``application_name`` (a server setting), libpq's ``connect_timeout`` and SQLAlchemy's own
    ``prepared_statement_cache_size`` in one URL: the queue and the request sessions both open,
    and both connect as the URL says."""
    name = f"wq-{uuid.uuid4().hex[:8]}"
    # (libpq's client-only keepalives and gssencmode shape libpq's socket; the server knows them not)
    url = (f"{pg_url}?application_name={name}&connect_timeout=5&prepared_statement_cache_size=0"
           "&keepalives=1&keepalives_idle=30&gssencmode=disable")
    queue, topic, _ = make_queue(url, [{"role": "a"}], auto_migrate=True, enabled=False)
    async with queue.lifespan(None):
        async with queue.sessionmaker() as session:
            assert await session.scalar(text("SELECT current_setting('application_name')")) == name
            [result] = await queue.publish(topic, [PublishRequest(payload=1)], session=session)
            await session.commit()
        assert result.ok
        async with queue.sessionmaker() as session:
            mine = await session.scalar(
                text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :n"), {"n": name})
        assert mine is not None and mine >= 2  # the queue's own pool and the session's connection
        # No prepared statement kept on the queue's own connections (what a pooler without them needs).
        kept = await queue.transport.run_in_connection(  # type: ignore[attr-defined]
            lambda conn: conn.fetchval("SELECT count(*) FROM pg_prepared_statements"))
        assert kept == 0


async def test_the_request_sessions_open_the_database_of_a_transport_given_to_the_queue(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``WorkQueue(transport=create_database_transport(url))`` with no database in the settings:
    a publish in a request session lands where the queue reads (it went to ./workqueue.db)."""
    from fastapi_workqueue import ConfigurationError, Subscription, Topic, WorkQueue, WorkQueueSettings
    from fastapi_workqueue.database import create_database_transport

    monkeypatch.delenv("WORKQUEUE_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    url = f"sqlite+aiosqlite:///{tmp_path / 'test.db'}"
    queue = WorkQueue(WorkQueueSettings(auto_migrate=True, enabled=False),
                      topics=[Topic(name="signups")],
                      subscriptions=[Subscription(name="signups.mail", topic="signups", handler_key="mail")],
                      transport=create_database_transport(url))
    async with queue.lifespan(None):
        async with queue.sessionmaker() as session, session.begin():
            [result] = await queue.publish("signups", [PublishRequest(payload=1)], session=session)
        assert result.ok
        [stats] = await queue.stats("signups.mail")
        assert stats.pending == 1
    assert not (tmp_path / "workqueue.db").exists()

    other = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'other.db'}"),
                      transport=create_database_transport(url))
    with pytest.raises(ConfigurationError, match=re.escape(
            "the request sessions (queue.session) would write where the queue does not read")):
        _ = other.engine


async def test_a_session_behind_a_pooler_without_prepared_statements_publishes(pg_url: str) -> None:
    """``?prepared_statement_cache_size=0``: a transaction pooler hands each transaction some server
    connection, which knows none of the statements prepared before (``DEALLOCATE ALL`` stands for
    it here). A publish in the session, and SQLAlchemy's own statements, never count on one."""
    url = f"{pg_url}?prepared_statement_cache_size=0"
    queue, topic, subs = make_queue(url, [{"role": "a"}], auto_migrate=True, enabled=False)
    async with queue.lifespan(None):
        for n in range(3):
            async with queue.sessionmaker() as session, session.begin():
                await session.execute(text("DEALLOCATE ALL"))
                assert await session.scalar(text("SELECT :n").bindparams(n=n)) == n
                [result] = await queue.publish(topic, [PublishRequest(payload=n)], session=session)
                assert result.ok
        [stats] = await queue.stats(subs["a"])
        assert stats.pending == 3



async def test_libpqs_fallback_application_name_names_the_connections(pg_url: str) -> None:
    name = f"wq-fallback-{uuid.uuid4().hex[:8]}"
    queue, _, _ = make_queue(f"{pg_url}?fallback_application_name={name}&keepalives_count=3", [{"role": "a"}],
                             auto_migrate=True, enabled=False)
    async with queue.lifespan(None), queue.sessionmaker() as session:
        assert await session.scalar(text("SELECT current_setting('application_name')")) == name
        seen = await session.scalar(
            text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :n"), {"n": name})
        assert seen is not None and seen >= 2  # the queue's own pool and this session
