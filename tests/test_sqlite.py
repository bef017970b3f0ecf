"""What is specific to the embedded SQLite transport, on real files and real processes.

The conformance suite runs every queue operation on SQLite and PostgreSQL alike; these tests
cover what only SQLite has: the default settings, a relative file in the working directory,
configuration errors that say what to change, what ``validate-bindings`` reports, the caller's
transaction on a single-writer file, and several processes on one file.

Run as a module (``python -m tests.test_sqlite contender ...``) this file is also the contender
process of :func:`test_two_processes_publish_and_claim_on_one_file_without_loss_or_double_delivery`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import event, text

from fastapi_workqueue import (
    ConfigurationError,
    Outcome,
    PublishRequest,
    PublishStatus,
    Subscription,
    SubscriptionPlan,
    Topic,
    WorkMessage,
    WorkOutcome,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.core.database_url import sqlite_path
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.transport import Settlement
from fastapi_workqueue.database import create_database_transport
from fastapi_workqueue.database.sql_files import migrations
from fastapi_workqueue.database.sqlite import SqliteTransport
from fastapi_workqueue.settings import DEFAULT_DATABASE_URL

from . import support

ROOT = Path(__file__).resolve().parents[1]

FAST = {
    "idle_poll_min_ms": 10,
    "idle_poll_max_ms": 100,
    "sweeper_interval_ms": 200,
    "reconcile_interval_ms": 500,
    "shutdown_drain_ms": 500,
}


def unique(prefix: str) -> str:
    return f"{prefix}-{os.urandom(5).hex()}"


def url_of(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


@pytest.fixture
def no_workqueue_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings as on a machine where nothing is configured."""
    for name in list(os.environ):
        if name.startswith("WORKQUEUE_"):
            monkeypatch.delenv(name)


async def wait_for(check: Any, what: str, within: float = 10.0, interval: float = 0.02) -> Any:
    """Polls ``check()`` (sync or async) until it is truthy; the failure names ``what``."""
    try:
        return await support.wait_for(check, within=within, interval=interval)
    except AssertionError as exc:
        raise AssertionError(f"{what}: not within {within} s") from exc


@contextlib.asynccontextmanager
async def open_transport(url: str, *, migrate: bool = True) -> AsyncIterator[SqliteTransport]:
    transport = SqliteTransport(url)
    await transport.open()
    try:
        if migrate:
            await transport.migrate()
        yield transport
    finally:
        await transport.close()


# -- defaults ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_workqueue_env")
def test_default_settings_use_an_sqlite_file_and_migrate_at_start() -> None:
    settings = WorkQueueSettings()
    assert settings.database_url == DEFAULT_DATABASE_URL == "sqlite+aiosqlite:///workqueue.db"
    assert settings.migrate_at_start is True
    transport = create_database_transport(settings.database_url)
    assert isinstance(transport, SqliteTransport)
    assert transport.path == "workqueue.db"  # relative: in the working directory

    # Migrations at start are the SQLite default only; elsewhere they are the schema owner's job.
    assert WorkQueueSettings(auto_migrate=False).migrate_at_start is False
    assert WorkQueueSettings(database_url="postgresql+asyncpg://u@h/db").migrate_at_start is False
    assert WorkQueueSettings(database_url="postgresql+asyncpg://u@h/db", auto_migrate=True).migrate_at_start is True


@pytest.mark.usefixtures("no_workqueue_env")
def test_one_environment_variable_switches_to_postgresql(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKQUEUE_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/app")
    settings = WorkQueueSettings()
    assert settings.database_url == "postgresql+asyncpg://postgres@127.0.0.1:5432/app"
    assert settings.migrate_at_start is False


@pytest.mark.usefixtures("no_workqueue_env")
async def test_many_openers_of_one_new_file_all_get_it_in_wal_mode(tmp_path: Path) -> None:
    """Each opener switches a new file to WAL; SQLite can answer "database is locked" at once to
    all but one of them (it does not wait when waiting could deadlock), and open tries again."""
    for attempt in range(20):
        path = tmp_path / f"new-{attempt}.db"
        transports = [SqliteTransport(url_of(path)) for _ in range(6)]
        results = await asyncio.gather(*(t.open() for t in transports), return_exceptions=True)
        try:
            assert [r for r in results if isinstance(r, BaseException)] == []
        finally:
            for t, r in zip(transports, results, strict=True):
                if not isinstance(r, BaseException):
                    await t.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_a_queue_on_the_default_relative_file_works_through_its_lifespan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    topic, name = unique("topic"), unique("sub")
    queue = WorkQueue(
        WorkQueueSettings(subscriptions=[SubscriptionPlan(name=name)], **FAST),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=name, topic=topic, handler_key="greet")],
    )
    seen: list[Any] = []

    @queue.handler("greet")
    async def greet(message: WorkMessage[dict[str, str]]) -> WorkOutcome:
        seen.append(message.payload)
        return Outcome.complete()

    async with queue.lifespan(None):
        # Migrations were applied at start, in the file the default URL names, in the working directory.
        database = tmp_path / "workqueue.db"
        assert database.is_file()
        with contextlib.closing(sqlite3.connect(database)) as conn:
            applied = [row[0] for row in conn.execute("SELECT version FROM schema_migration ORDER BY version")]
            [(journal_mode,)] = conn.execute("PRAGMA journal_mode")
        assert applied == [m.version for m in migrations("sqlite")]
        assert journal_mode == "wal"

        [result] = await queue.publish(topic, [PublishRequest(payload={"hello": "world"})])
        assert result.status is PublishStatus.ACCEPTED
        await wait_for(lambda: seen, "the handler ran")

        async def completed() -> Any:
            done = await queue.deliveries(name, "Completed")
            return done if done and done[0].message_id == result.message_id else None

        [delivery] = await wait_for(completed, "the delivery completed")
        assert delivery.attempt == 1
    assert seen == [{"hello": "world"}]


# -- configuration errors ------------------------------------------------------------------------


async def test_a_missing_directory_says_what_to_change(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "queue.db"
    queue = WorkQueue(WorkQueueSettings(database_url=url_of(missing), enabled=False))
    with pytest.raises(ConfigurationError) as error:
        await queue.open()
    message = str(error.value)
    assert str(missing.parent) in message and "does not exist" in message
    assert "WORKQUEUE_DATABASE_URL" in message  # what to change: create the directory, or point elsewhere
    assert not missing.parent.exists()  # nothing was created behind the user's back


async def test_a_file_the_process_cannot_write_says_where_and_what_to_change() -> None:
    # (/proc takes no new file, even from root, whom a directory's mode does not stop)
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:////proc/workqueue-test.db", enabled=False))
    with pytest.raises(ConfigurationError) as error:
        await queue.open()
    assert str(error.value).startswith("cannot open the SQLite file '/proc/workqueue-test.db' for writing (")
    assert "make the file and its directory writable by this process" in str(error.value)


READ_ONLY_OPEN = """
import asyncio, sys
from fastapi_workqueue import ConfigurationError, WorkQueue, WorkQueueSettings

async def main() -> None:
    queue = WorkQueue(WorkQueueSettings(database_url=sys.argv[1], enabled=False))
    try:
        await queue.open()
    except ConfigurationError as exc:
        print("ConfigurationError:", exc)
    else:
        await queue.close()
        print("opened")

asyncio.run(main())
"""


def test_a_read_only_queue_file_is_refused_at_open_not_at_every_write(tmp_path: Path) -> None:
    """A file this process may read but not write (its directory writable): SQLite would open it
    read-only and fail each write as it came, a claim loop retrying forever; the queue refuses it at
    open, as it does a directory it cannot write. (Root is not stopped by a file's mode: the
    process runs without the capability that lets it pass.)"""
    path = tmp_path / "queue.db"
    url = f"sqlite+aiosqlite:///{path}"
    assert subprocess.run([sys.executable, "-c", READ_ONLY_OPEN, url], capture_output=True, text=True,
                          check=True).stdout.strip() == "opened"
    path.chmod(0o444)
    command = [sys.executable, "-c", READ_ONLY_OPEN, url]
    if os.geteuid() == 0:
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--", *command]
    shown = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert shown == (f"ConfigurationError: cannot open the SQLite file {str(path)!r} for writing (the file is "
                     "read-only for this process): the queue writes the file and, beside it, its -wal and -shm "
                     "files; make the file and its directory writable by this process, on a local disk")


async def test_a_percent_encoded_path_names_the_file_the_request_sessions_open(tmp_path: Path) -> None:
    """``%20`` in the URL is a space, for the queue as for SQLAlchemy: a publish in a request
    session finds the queue's tables (they went to another file, ``x%20y/q.db``)."""
    folder = tmp_path / "x y"
    folder.mkdir()
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path}/x%20y/q.db", enabled=False,
                                        auto_migrate=True),
                      topics=[Topic(name="t")], subscriptions=[Subscription(name="s", topic="t", handler_key="h")])
    async with queue.lifespan(None):
        async with queue.sessionmaker() as session, session.begin():
            [result] = await queue.publish("t", [PublishRequest(payload=1)], session=session)
        assert result.status is PublishStatus.ACCEPTED
        [stats] = await queue.stats("s")
        assert stats.pending == 1
    assert sorted(os.listdir(tmp_path)) == ["x y"] and "q.db" in os.listdir(folder)


@pytest.mark.parametrize("url", ["sqlite+aiosqlite:///:memory:", "sqlite:///:memory:", "sqlite+aiosqlite://"])
async def test_memory_or_no_file_says_what_to_change(url: str) -> None:
    queue = WorkQueue(WorkQueueSettings(database_url=url, enabled=False))
    with pytest.raises(ConfigurationError) as error:
        await queue.open()
    message = str(error.value)
    assert "file" in message
    assert "sqlite+aiosqlite:///" in message and "WORKQUEUE_DATABASE_URL" in message


async def test_a_file_that_is_not_a_database_says_so(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database, but long enough to have a header to read " * 20)
    queue = WorkQueue(WorkQueueSettings(database_url=url_of(notes), enabled=False))
    with pytest.raises(ConfigurationError, match="not an SQLite database"):
        await queue.open()


async def test_an_unmigrated_file_says_to_migrate(tmp_path: Path) -> None:
    url = url_of(tmp_path / "empty.db")
    queue = WorkQueue(
        WorkQueueSettings(database_url=url, enabled=False, auto_migrate=False, sync_topology=False),
        topics=[Topic(name="t")],
    )
    await queue.open()
    try:
        with pytest.raises(ConfigurationError, match="migrate"):
            await queue.stats()
        with pytest.raises(ConfigurationError, match="migrate"):
            await queue.publish("t", [PublishRequest(payload=1)])
        with pytest.raises(ConfigurationError, match="migrate"):  # in a caller's session too
            async with queue.sessionmaker() as session, session.begin():
                await queue.publish("t", [PublishRequest(payload=1)], session=session)
        report = await queue.validate_bindings()
        assert not report.ok
        assert any(i.severity == "Error" and "not applied" in i.message for i in report.issues), report
    finally:
        await queue.close()


# -- validate-bindings ---------------------------------------------------------------------------


async def run_cli(*args: str, cwd: Path = ROOT) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fastapi_workqueue", *args, cwd=cwd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_validate_bindings_is_ok_and_names_what_sqlite_cannot_do(tmp_path: Path) -> None:
    url = url_of(tmp_path / "queue.db")
    async with open_transport(url) as transport:
        report = await transport.validate_bindings()
    assert report.ok and report.transport == "sqlite"
    assert {i.severity for i in report.issues} == {"Info"}
    notes = " | ".join(i.message for i in report.issues)
    assert "LISTEN/NOTIFY" in notes and "poll" in notes
    assert "roles" in notes

    code, out, err = await run_cli("--database-url", url, "--json", "validate-bindings")
    assert code == 0, err
    body = json.loads(out)
    assert body["Ok"] is True and body["Transport"] == "sqlite"
    assert [i["Severity"] for i in body["Issues"]] == ["Info", "Info"]
    assert any("LISTEN/NOTIFY" in i["Message"] for i in body["Issues"])
    assert any("roles" in i["Message"] for i in body["Issues"])

    code, out, err = await run_cli("--database-url", url, "validate-bindings")
    assert code == 0, err
    assert out.startswith("sqlite: ok")
    assert "LISTEN/NOTIFY" in out


async def test_validate_bindings_on_an_unmigrated_file_fails_loudly(tmp_path: Path) -> None:
    url = url_of(tmp_path / "fresh.db")
    code, out, err = await run_cli("--database-url", url, "validate-bindings")
    assert code == 1, (out, err)
    assert "problems found" in out and "not applied" in out


# -- the caller's transaction --------------------------------------------------------------------


@contextlib.asynccontextmanager
async def session_queue(tmp_path: Path, **settings: Any) -> AsyncIterator[tuple[WorkQueue, str, str]]:
    topic, name = unique("topic"), unique("sub")
    options = {**FAST, **settings}
    queue = WorkQueue(
        WorkQueueSettings(database_url=url_of(tmp_path / "queue.db"), **options),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=name, topic=topic, handler_key="h")],
    )
    await queue.open()
    try:
        async with queue.engine.begin() as conn:
            await conn.execute(text("CREATE TABLE IF NOT EXISTS app_order (id INTEGER PRIMARY KEY, note TEXT)"))
        yield queue, topic, name
    finally:
        await queue.close()


async def app_orders(queue: WorkQueue) -> list[str]:
    async with queue.sessionmaker() as session:
        return list((await session.execute(text("SELECT note FROM app_order ORDER BY id"))).scalars())


async def test_a_publish_in_a_session_commits_with_it_and_vanishes_with_a_rollback(tmp_path: Path) -> None:
    async with session_queue(tmp_path, enabled=False) as (queue, topic, name):
        async with queue.sessionmaker() as session, session.begin():
            await session.execute(text("INSERT INTO app_order (note) VALUES ('kept')"))
            [kept] = await queue.publish(topic, [PublishRequest(payload="kept")], session=session)
            assert kept.status is PublishStatus.ACCEPTED
            # Not visible outside the caller's transaction until it commits (a read: WAL readers
            # do not wait for the writer).
            [stats] = await queue.stats(name)
            assert stats.pending == 0

        async with queue.sessionmaker() as session, session.begin():
            await session.execute(text("INSERT INTO app_order (note) VALUES ('dropped')"))
            [dropped] = await queue.publish(topic, [PublishRequest(payload="dropped")], session=session)
            assert dropped.status is PublishStatus.ACCEPTED
            await session.rollback()

        # A publish that is the transaction's first statement joins it too.
        async with queue.sessionmaker() as session, session.begin():
            [first] = await queue.publish(topic, [PublishRequest(payload="first, dropped")], session=session)
            await session.execute(text("INSERT INTO app_order (note) VALUES ('first, dropped')"))
            await session.rollback()

        # A connection (not a session) joins the same way.
        async with queue.engine.connect() as conn:
            async with conn.begin():
                [by_connection] = await queue.publish(topic, [PublishRequest(payload="conn")], session=conn)
            async with conn.begin():
                await queue.publish(topic, [PublishRequest(payload="conn, dropped")], session=conn)
                await conn.rollback()

        assert await app_orders(queue) == ["kept"]
        claimed = await queue.transport.claim(name, 10)
        assert [c.message_id for c in claimed] == [kept.message_id, by_connection.message_id]
        assert dropped.message_id is not None and first.message_id is not None
        [stats] = await queue.stats(name)
        assert (stats.pending, stats.in_flight) == (0, 2)


async def test_concurrent_sessions_deduplicate_as_one_writer(tmp_path: Path) -> None:
    """A publish in a session holds the write lock from its first read to the session's commit,
    so a second session publishing the same deduplication key sees the first one's message."""
    async with session_queue(tmp_path, enabled=False) as (queue, topic, name):
        begun: list[str] = []  # each session's publish starts its transaction with BEGIN IMMEDIATE

        def heard(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
            if statement.startswith("BEGIN IMMEDIATE"):
                begun.append(statement)

        event.listen(queue.engine.sync_engine, "before_cursor_execute", heard)

        async def publish_in_own_session(payload: str) -> Any:
            async with queue.sessionmaker() as session, session.begin():
                [result] = await queue.publish(
                    topic, [PublishRequest(payload=payload, deduplication_key="order-7")], session=session
                )
                return result

        async with queue.sessionmaker() as session, session.begin():
            [first] = await queue.publish(
                topic, [PublishRequest(payload="first", deduplication_key="order-7")], session=session
            )
            assert len(begun) == 1
            second_task = asyncio.create_task(publish_in_own_session("second"))
            # The second session asks for the write lock while this one holds it: it waits for this commit.
            await support.wait_for(lambda: len(begun) == 2 or second_task.done(), describe=lambda: begun)
            assert not second_task.done()
        second = await second_task
        assert first.status is PublishStatus.ACCEPTED
        assert second.status is PublishStatus.DUPLICATE and second.message_id == first.message_id
        claimed = await queue.transport.claim(name, 10)
        assert [c.message_id for c in claimed] == [first.message_id]


async def test_a_publish_in_a_session_wakes_the_consumers_of_this_process_at_commit(tmp_path: Path) -> None:
    """No LISTEN/NOTIFY on SQLite: consumers in the publishing process are woken directly, also
    when the publish is committed by the caller's session, instead of waiting for their next poll."""
    handled = asyncio.Event()
    slow_polls = {"idle_poll_min_ms": 8000, "idle_poll_max_ms": 10000}
    async with session_queue(tmp_path, **slow_polls) as (queue, topic, name):
        watch = support.ClaimWatch(queue.transport)

        @queue.handler("h")
        async def handle(message: WorkMessage[str]) -> WorkOutcome:
            handled.set()
            return Outcome.complete()

        await queue._start_host()
        await watch.empty_claim(name)  # the consumer's first claim found nothing; it now sleeps 8 s or more
        started = time.monotonic()
        async with queue.sessionmaker() as session, session.begin():
            await queue.publish(topic, [PublishRequest(payload="now")], session=session)
        await asyncio.wait_for(handled.wait(), 5)
        assert time.monotonic() - started < 3


# -- cancellation --------------------------------------------------------------------------------


async def test_a_call_cancelled_while_waiting_for_the_writer_leaves_no_transaction_open(tmp_path: Path) -> None:
    url = url_of(tmp_path / "queue.db")
    async with open_transport(url) as transport:
        blocker = sqlite3.connect(transport.path, isolation_level=None, timeout=5)
        try:
            blocker.execute("BEGIN IMMEDIATE")  # another process is writing
            sent: list[str] = []  # the statements the transport's connection starts, on its thread
            assert transport._conn is not None
            await transport._conn.set_trace_callback(sent.append)
            waiting = asyncio.create_task(transport.sweep())
            # Its BEGIN IMMEDIATE is running: SQLite's busy handler waits for the blocker's lock.
            await support.wait_for(lambda: "BEGIN IMMEDIATE" in sent or waiting.done(), describe=lambda: sent)
            assert not waiting.done()
            waiting.cancel()  # e.g. the host stopping its sweeper
            blocker.execute("COMMIT")
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            # The transport's connection must not hold the write lock, nor be inside a transaction.
            blocker.execute("BEGIN IMMEDIATE")
            blocker.execute("COMMIT")
            report = await transport.sweep()
            assert report.ran
        finally:
            blocker.close()


# -- the example app -----------------------------------------------------------------------------


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_the_example_app_starts_on_sqlite_with_nothing_configured_and_handles_an_order(tmp_path: Path) -> None:
    """What ``./scripts/run-example`` starts (uvicorn on ``example_app.main:app``), with no
    ``WORKQUEUE_*`` variable: the app creates ``workqueue.db`` in its working directory,
    migrates it, and handles a published order. (``test_example_app.py`` runs every example case
    on SQLite and PostgreSQL in-process.)"""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env["PYTHONPATH"] = str(ROOT)
    log_path = tmp_path / "uvicorn.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "uvicorn", "example_app.main:app", "--host", "127.0.0.1", "--port", str(port),
            cwd=tmp_path, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
        )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:

            async def running() -> bool:
                assert proc.returncode is None, log_path.read_text()
                try:
                    response = await client.get("/health/extensions")
                except httpx.TransportError:
                    return False
                return response.status_code == 200 and response.json()["Extensions"][0]["Status"] == "Running"

            await wait_for(running, "the example app started", within=30, interval=0.1)
            order = {"customer": "alice", "email": "alice@example.com", "amount_cents": 1250}
            response = await client.post("/orders", json=order)
            assert response.status_code == 201, response.text
            order_id = response.json()["order_id"]

            async def handled() -> Any:
                body = (await client.get(f"/orders/{order_id}")).json()
                return body if body["emailed_at"] and body["audit"] else None

            body = await wait_for(handled, "the order was emailed and audited", within=20, interval=0.1)
            assert body["audit"] == [f"order {order_id} created: 1250 cents"]
        assert (tmp_path / "workqueue.db").is_file()
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    log = log_path.read_text()
    # uvicorn re-raises SIGTERM once it has shut the app down.
    assert proc.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in log, log
    assert "Traceback" not in log and "locked" not in log, log


# -- several processes on one file ---------------------------------------------------------------

CONTENDERS = 2
PER_CONTENDER = 150
ORDERED_KEYS = 5


def contender_topology(topic: str, plain: str, ordered: str) -> tuple[Topic, list[Subscription]]:
    return Topic(name=topic), [
        Subscription(name=plain, topic=topic, handler_key="plain", lease_seconds=120),
        Subscription(name=ordered, topic=topic, handler_key="ordered", partition_mode="Ordered", lease_seconds=120),
    ]


async def contender(url: str, topic: str, plain: str, ordered: str, label: str, count: int) -> None:
    """Publishes ``count`` messages in small batches, claiming and settling between batches, then
    claims and settles until nothing is left; prints what it claimed as JSON."""
    rng = random.Random(label)
    transport = SqliteTransport(url)
    await transport.open()
    try:
        await transport.migrate()  # both processes start on a fresh file
        topic_def, subscriptions = contender_topology(topic, plain, ordered)
        await transport.sync_topology([topic_def], subscriptions)
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go", to both at once
        claimed: list[dict[str, Any]] = []
        settle_results: Counter[str] = Counter()

        async def claim_and_settle(limit: int) -> int:
            got = 0
            for subscription in (plain, ordered):
                batch = await transport.claim(subscription, limit)
                got += len(batch)
                claimed.extend(
                    {"subscription": subscription, "delivery_id": d.delivery_id, "message_id": str(d.message_id),
                     "attempt": d.attempt} for d in batch
                )
                if batch:
                    results = await transport.settle(
                        [Settlement(d.delivery_id, d.lease_token, "Complete") for d in batch]
                    )
                    settle_results.update(results)
            return got

        sent = 0
        while sent < count:
            size = min(rng.randint(1, 5), count - sent)
            requests = [
                PublishRequest(partition_key=f"key-{(sent + i) % ORDERED_KEYS}", payload={"by": label, "n": sent + i})
                for i in range(size)
            ]
            results = await transport.publish(topic, [prepare(r) for r in requests])
            assert [r.status for r in results] == [PublishStatus.ACCEPTED] * size, results
            sent += size
            await claim_and_settle(rng.randint(1, 4))
        while await claim_and_settle(10):
            pass
        print(json.dumps({"claimed": claimed, "settled": dict(settle_results), "published": sent}), flush=True)
    finally:
        await transport.close()


async def test_two_processes_publish_and_claim_on_one_file_without_loss_or_double_delivery(tmp_path: Path) -> None:
    database = tmp_path / "shared.db"
    url = url_of(database)
    topic, plain, ordered = unique("topic"), unique("plain"), unique("ordered")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.test_sqlite", "contender", "--url", url, "--topic", topic, "--plain", plain,
            "--ordered", ordered, "--label", f"p{i}", "--count", str(PER_CONTENDER),
            cwd=ROOT, env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for i in range(CONTENDERS)
    ]
    try:
        for proc in procs:  # both migrated the fresh file and synced the topology
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            if line.strip() != b"READY":
                assert proc.stderr is not None
                problem = (await asyncio.wait_for(proc.stderr.read(), 30)).decode(errors="replace")
                raise AssertionError(f"a contender did not get ready: {line!r}\n{problem[-3000:]}")
        for proc in procs:  # start together
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        began = time.monotonic()
        outputs = [await asyncio.wait_for(proc.communicate(), 60) for proc in procs]
        elapsed = time.monotonic() - began
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    reports = []
    for proc, (out, err) in zip(procs, outputs, strict=True):
        errors = err.decode()
        assert proc.returncode == 0, errors
        assert "locked" not in errors and "busy" not in errors, errors
        reports.append(json.loads(out.decode().strip().splitlines()[-1]))

    # Every claim was settled Completed: no claim lost its lease to the other process.
    assert [r["settled"] for r in reports] == [{"Completed": len(r["claimed"])} for r in reports]
    assert all(c["attempt"] == 1 for r in reports for c in r["claimed"])
    claimed_ids = [c["delivery_id"] for r in reports for c in r["claimed"]]
    assert len(claimed_ids) == len(set(claimed_ids)), "a delivery was claimed twice"
    assert all(r["claimed"] for r in reports), "one process claimed nothing: no contention was exercised"

    total = CONTENDERS * PER_CONTENDER
    with contextlib.closing(sqlite3.connect(database)) as conn:
        conn.row_factory = sqlite3.Row
        rows = conn.execute(
            "SELECT d.id, s.name AS subscription, d.message_id, d.partition_key, d.status, d.attempt, "
            "d.claim_count, d.settled_at FROM delivery d JOIN subscription s ON s.id = d.subscription_id "
            "WHERE s.name IN (?, ?) ORDER BY d.id",
            (plain, ordered),
        ).fetchall()
        messages = conn.execute("SELECT count(*) FROM message WHERE topic = ?", (topic,)).fetchone()[0]
    assert messages == total
    per_message = Counter((r["subscription"], r["message_id"]) for r in rows)
    assert len(per_message) == 2 * total and set(per_message.values()) == {1}
    assert Counter((r["status"], r["attempt"], r["claim_count"]) for r in rows) == {("Completed", 1, 1): 2 * total}
    assert sorted(claimed_ids, key=int) == [str(r["id"]) for r in rows]

    # Ordered: each key's deliveries completed in publish (delivery id) order.
    by_key: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["subscription"] == ordered:
            by_key[r["partition_key"]].append(r["settled_at"])
    assert len(by_key) == ORDERED_KEYS
    for key, settled in by_key.items():
        assert all(a < b for a, b in itertools.pairwise(settled)), f"Ordered key {key} completed out of order"
    print(f"two processes: {2 * total} deliveries in {elapsed:.1f} s, claims {[len(r['claimed']) for r in reports]}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.test_sqlite")
    parser.add_argument("role", choices=["contender"])
    for option in ("--url", "--topic", "--plain", "--ordered", "--label"):
        parser.add_argument(option, required=True)
    parser.add_argument("--count", type=int, required=True)
    args = parser.parse_args(argv)
    asyncio.run(contender(args.url, args.topic, args.plain, args.ordered, args.label, args.count))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def test_sqlite_routines_take_the_postgresql_parameters() -> None:
    """Every routine the transport calls exists on SQLite, and a routine that names its parameters
    names PostgreSQL's, in the same order and with the same defaults (``**p`` takes them all)."""
    import inspect

    from fastapi_workqueue.database.sqlite_routines import ROUTINES

    from .test_mssql_sql import pg_functions, transport_calls

    functions = pg_functions()
    for name in transport_calls():
        assert name in ROUTINES, f"SQLite has no routine {name!r}"
    for name, fn in ROUTINES.items():
        assert name in functions, f"SQLite routine {name!r} has no PostgreSQL function"
        params = list(inspect.signature(fn).parameters.values())[1:]  # after the call context
        if [p.kind for p in params] == [inspect.Parameter.VAR_KEYWORD]:
            continue
        assert tuple(p.name for p in params) == functions[name].params, name
        defaults = frozenset(p.name for p in params if p.default is not inspect.Parameter.empty)
        assert defaults == functions[name].defaults, name


async def test_api_keys_are_marked_used_after_the_match_and_live_names_are_unique(tmp_path: Path) -> None:
    """As on PostgreSQL: a made-up key with a real prefix does not mark the key used, and a
    second live key of one name is refused with what to do."""
    from fastapi_workqueue.core.keys import create_key, verify_key

    path = tmp_path / "keys.db"
    async with open_transport(url_of(path)) as transport:
        created = await create_key(transport, "deploy-bot", ["workqueue:read"])
        assert await verify_key(transport, f"wq_{created.prefix}_{'x' * 40}") is None
        with contextlib.closing(sqlite3.connect(path)) as conn:
            assert conn.execute("SELECT last_used_at FROM api_key").fetchone() == (None,)
        assert await verify_key(transport, created.key) is not None
        with contextlib.closing(sqlite3.connect(path)) as conn:
            assert conn.execute("SELECT last_used_at FROM api_key").fetchone() != (None,)

        with pytest.raises(ConfigurationError, match="an API key named 'deploy-bot' exists already; revoke it"):
            await create_key(transport, "deploy-bot", ["workqueue:read"])
        assert await transport.api_key_revoke("deploy-bot") == 1
        assert (await create_key(transport, "deploy-bot", ["workqueue:read"])).name == "deploy-bot"


async def test_an_upper_case_scheme_is_the_same_sqlite_url(tmp_path: Path) -> None:
    """URL schemes are case-insensitive: ``SQLITE+AIOSQLITE://`` is the SQLite default, migrated at
    start-up, and the request sessions open it too."""
    settings = WorkQueueSettings(database_url=f"SQLite+AIOSQLITE:///{tmp_path / 'queue.db'}", enabled=False)
    assert settings.database_url == f"sqlite+aiosqlite:///{tmp_path / 'queue.db'}"
    assert settings.migrate_at_start
    queue = WorkQueue(settings, topics=[Topic(name="upper.t")])
    async with queue.lifespan(None), queue.sessionmaker() as session, session.begin():
        [result] = await queue.publish("upper.t", [PublishRequest(payload=1)], session=session)
    assert result.status == "Accepted"


def test_a_directory_where_the_file_should_be_is_refused_and_leaves_no_thread_behind(tmp_path: Path) -> None:
    """The URL names a directory: a ConfigurationError that says so, before the driver starts its
    connection thread (a thread left behind died with 'Event loop is closed' once the loop ended)."""
    import threading

    folder = tmp_path / "queue.db"
    folder.mkdir()
    died: list[str] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: died.append(f"{args.exc_type.__name__}: {args.exc_value}")
    try:
        messages = []
        for _ in range(5):
            async def once() -> None:
                queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{folder}", enabled=False))
                with pytest.raises(ConfigurationError) as raised:
                    await queue.open()
                messages.append(str(raised.value))
                await queue.close()
            asyncio.run(once())
        time.sleep(0.5)
    finally:
        threading.excepthook = previous
    assert set(messages) == {f"{str(folder)!r} is a directory, not an SQLite file; set WORKQUEUE_DATABASE_URL to "
                             "sqlite+aiosqlite:///relative/file.db (in the working directory) or "
                             "sqlite+aiosqlite:////absolute/path/file.db (a file in that directory)"}
    assert died == []


def test_a_misspelt_option_of_the_sqlite_transport_is_refused(tmp_path: Path) -> None:
    """``clok=ManualClock()`` would leave the transport on the system clock, in silence."""
    from fastapi_workqueue.core.clock import ManualClock
    from fastapi_workqueue.database import create_database_transport

    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    with pytest.raises(TypeError, match="unexpected keyword argument 'clok'; it takes busy_timeout_ms, rng and clock"):
        create_database_transport(url, clok=ManualClock())
    clock = ManualClock()
    assert create_database_transport(url, clock=clock, pool_max_size=4, listen=False).clock is clock


async def test_an_api_key_call_does_not_wait_for_the_files_writer(tmp_path: Path) -> None:
    """A REST read with a key used a moment ago needs no write (its last-used mark is written at most
    once a minute): it answers while another connection holds the file's write lock (a request
    transaction that published, say), instead of waiting for it and answering 503."""
    from fastapi import FastAPI

    from fastapi_workqueue.core.keys import SCOPE_READ, create_key

    path = tmp_path / "q.db"
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{path}", auto_migrate=True,
                                        enabled=False, sqlite_busy_timeout_ms=1000))
    app = FastAPI()
    app.include_router(queue.router)
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://t") as http:
        headers = {"X-API-Key": (await create_key(queue.transport, "reader", [SCOPE_READ])).key}
        assert (await http.get("/work-queue/stats", headers=headers)).status_code == 200  # (marked used now)
        writer = sqlite3.connect(path, isolation_level=None)
        try:
            writer.execute("BEGIN IMMEDIATE")  # the file's write lock, held
            answer = await http.get("/work-queue/stats", headers=headers)
        finally:
            writer.execute("ROLLBACK")
            writer.close()
    assert answer.status_code == 200, answer.text


async def test_a_file_that_holds_tables_named_as_the_queues_is_refused_with_their_names(tmp_path: Path) -> None:
    """An app's own ``message`` table in the queue's file: the start (and ``workqueue migrate``) says
    which tables clash and what to do, instead of SQLite's bare error or a traceback; the app's rows
    stay as they were."""
    path = tmp_path / "shared.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE message (id INTEGER PRIMARY KEY, body TEXT)")
        conn.execute("INSERT INTO message (body) VALUES ('the app''s own')")
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{path}", auto_migrate=True,
                                        enabled=False))
    with pytest.raises(ConfigurationError, match=r"already holds tables named as the queue's \(message\): give "
                                                 r"the queue a file of its own"):
        async with queue.lifespan(None):
            pass
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT body FROM message").fetchall() == [("the app's own",)]


def test_workqueue_migrate_on_a_file_with_tables_named_as_the_queues_says_which(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE delivery (id INTEGER PRIMARY KEY)")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}, "PYTHONPATH": str(ROOT)}
    migrate = subprocess.run([sys.executable, "-m", "fastapi_workqueue", "--database-url",
                              f"sqlite+aiosqlite:///{path}", "migrate"], env=env, capture_output=True, text=True,
                             timeout=60)
    assert migrate.returncode == 1 and "Traceback" not in migrate.stderr
    assert "already holds tables named as the queue's (delivery)" in migrate.stderr


@pytest.mark.parametrize("url", ["sqlite+aiosqlite:///data?v2/queue.db", "sqlite+aiosqlite:///queue.db?mode=ro",
                                 "sqlite+aiosqlite:///queue#1.db"])
def test_a_question_mark_or_hash_after_the_sqlite_path_is_refused(url: str) -> None:
    """The queue would open the part before it, another file, in silence; percent-encoded it is the path."""
    with pytest.raises(ConfigurationError, match=r"must be percent-encoded \(%3F, %23\)"):
        create_database_transport(url)
    with pytest.raises(ConfigurationError, match=r"must be percent-encoded \(%3F, %23\)"):
        WorkQueue(WorkQueueSettings(database_url=url)).engine  # noqa: B018 (the request sessions' engine)
    assert sqlite_path("sqlite+aiosqlite:///data%3Fv2/queue.db") == "data?v2/queue.db"


@pytest.mark.parametrize("own_row_first", [False, True], ids=["publish-first", "own-row-first"])
async def test_a_request_that_meets_a_busy_file_answers_503(tmp_path: Path, own_row_first: bool) -> None:
    """The file's write lock held past ``sqlite_busy_timeout_ms``: the request's publish fails as
    retryable, or its own row before it (as the README's example writes one) fails with SQLite's
    "database is locked", and the request answers 503 with Retry-After (it answered a bare 500);
    nothing of it is kept."""
    from fastapi import FastAPI
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession

    path = tmp_path / "q.db"
    topic = Topic(name="busy.orders")
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{path}", auto_migrate=True,
                                        enabled=False, sqlite_busy_timeout_ms=300), topics=[topic])
    app = FastAPI()

    @app.post("/orders")
    async def order(session: AsyncSession = queue.session) -> dict[str, str]:
        if own_row_first:
            await session.execute(text("INSERT INTO orders (n) VALUES (1)"))
        await queue.publish(topic.name, [PublishRequest(payload={"n": 1})])
        return {"ok": "yes"}

    setup = sqlite3.connect(path, isolation_level=None)
    setup.execute("CREATE TABLE orders (n INTEGER)")
    setup.close()
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://t") as http:
        writer = sqlite3.connect(path, isolation_level=None)
        try:
            writer.execute("BEGIN IMMEDIATE")
            answer = await http.post("/orders")
        finally:
            writer.execute("ROLLBACK")
            writer.close()
        assert (answer.status_code, answer.headers.get("Retry-After")) == (503, "1"), answer.text
        said = "the database file is busy" if own_row_first else "busy or unreachable"
        assert said in answer.json()["detail"], answer.text
        assert (await http.post("/orders")).status_code == 200  # (the lock free again)
    reader = sqlite3.connect(path)
    try:  # (the 503's row and message rolled back: those of the second request only)
        assert reader.execute("SELECT count(*) FROM orders").fetchone() == ((1,) if own_row_first else (0,))
        assert reader.execute("SELECT count(*) FROM message").fetchone() == (1,)
    finally:
        reader.close()
