"""SQLite: every operation waits for the file's write lock within one bound, however many callers
of one process wait at once, and then fails with a retryable error; nothing is lost meanwhile."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, TransportError
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.database import create_database_transport
from fastapi_workqueue.database.sqlite import SqliteTransport

pytestmark = pytest.mark.timeout(60)

BOUND_MS = 1500
PUBLISHERS = 5

TRY_LOCK = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=float(sys.argv[2]))
started = time.monotonic()
try:
    conn.execute("BEGIN IMMEDIATE")
except sqlite3.OperationalError as exc:
    print("refused", exc, flush=True)
else:
    conn.execute("ROLLBACK")
    print("took", time.monotonic() - started, flush=True)
"""

HOLD_LOCK = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


@asynccontextmanager
async def write_lock_held_elsewhere(path: str, seconds: float) -> AsyncIterator[asyncio.subprocess.Process]:
    """Another process holds the file's write lock for ``seconds``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLD_LOCK, path, str(seconds), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    assert (await proc.stdout.readline()).strip() == b"held"
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def queue_file(tmp_path: Path) -> tuple[SqliteTransport, str]:
    transport = create_database_transport(
        f"sqlite+aiosqlite:///{tmp_path / 'queue.db'}", sqlite_busy_timeout_ms=BOUND_MS
    )
    assert isinstance(transport, SqliteTransport)
    await transport.open()
    await transport.migrate()
    await transport.sync_topology([Topic(name="t")], [Subscription(name="s", topic="t", handler_key="h")])
    return transport, "t"


async def timed_publish(transport: SqliteTransport, topic: str, n: int) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        await transport.publish(topic, [prepare(PublishRequest(payload=n))])
    except TransportError as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


async def test_concurrent_callers_each_fail_within_the_bound_while_another_process_holds_the_lock(
    tmp_path: Path,
) -> None:
    transport, topic = await queue_file(tmp_path)
    try:
        async with write_lock_held_elsewhere(transport.path, 20):
            outcomes = await asyncio.gather(*(timed_publish(transport, topic, n) for n in range(PUBLISHERS)))
        for waited, error in outcomes:
            assert isinstance(error, TransportError) and error.retryable, error
            # Whether the wait ran out in SQLite's busy handler or between attempts: one error, saying
            # what the bound is and to retry (not the driver's "database is locked").
            assert str(error).startswith(f"the SQLite file {transport.path!r} is busy: its write lock was not free "
                                         f"within {BOUND_MS / 1000:g} s"), error
            # One bound per call, not one per caller queued ahead of it (slack for a loaded machine).
            assert waited <= BOUND_MS / 1000 + 1.0, outcomes
        [stats] = await transport.stats("s")
        assert stats.pending == 0  # a refused call wrote nothing
        # The file is free again: the same calls go through.
        outcomes = await asyncio.gather(*(timed_publish(transport, topic, n) for n in range(PUBLISHERS)))
        assert [error for _, error in outcomes] == [None] * PUBLISHERS
        [stats] = await transport.stats("s")
        assert stats.pending == PUBLISHERS
    finally:
        await transport.close()


async def test_a_lock_held_for_less_than_the_bound_only_delays_the_callers(tmp_path: Path) -> None:
    transport, topic = await queue_file(tmp_path)
    try:
        async with write_lock_held_elsewhere(transport.path, 0.5) as holder:
            outcomes = await asyncio.gather(*(timed_publish(transport, topic, n) for n in range(PUBLISHERS)))
            await holder.wait()
        assert [error for _, error in outcomes] == [None] * PUBLISHERS
        [stats] = await transport.stats("s")
        assert stats.pending == PUBLISHERS
    finally:
        await transport.close()


async def test_a_publish_in_a_request_session_waits_within_the_same_bound(tmp_path: Path) -> None:
    """A publish that joins a request session (``queue.sessionmaker``, as ``queue.session`` opens
    them) waits for the lock as long as the queue's own calls, not a fixed 10 s, and fails with the
    same busy error."""
    from fastapi_workqueue import WorkQueue, WorkQueueSettings

    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'queue.db'}", enabled=False,
                                        auto_migrate=True, sqlite_busy_timeout_ms=BOUND_MS),
                      topics=[Topic(name="t")], subscriptions=[Subscription(name="s", topic="t", handler_key="h")])
    async with queue.lifespan(None):
        transport = queue.transport
        assert isinstance(transport, SqliteTransport)
        async with write_lock_held_elsewhere(transport.path, 20):
            started = time.monotonic()
            with pytest.raises(TransportError) as raised:
                async with queue.sessionmaker() as session, session.begin():
                    await queue.publish("t", [PublishRequest(payload=1)], session=session)
            waited = time.monotonic() - started
        assert raised.value.retryable and "is busy: its write lock was not free" in str(raised.value)
        assert BOUND_MS / 1000 - 0.2 <= waited <= BOUND_MS / 1000 + 2.0, waited
        [stats] = await queue.stats("s")
        assert stats.pending == 0


def test_the_bound_is_a_setting() -> None:
    from fastapi_workqueue import WorkQueue, WorkQueueSettings

    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///x.db", sqlite_busy_timeout_ms=2500))
    transport = queue.transport
    assert isinstance(transport, SqliteTransport) and transport.busy_timeout == 2.5


async def test_a_caller_cancelled_as_the_lock_is_granted_is_cancelled(tmp_path: Path) -> None:
    """A cancellation that arrives while a call waits for this process's lock, in the step the lock is
    granted, ends the call (Python 3.11's wait_for swallowed it there, and a sweeper loop cancelled at
    shutdown went on forever) and leaves the lock free."""
    transport, _ = await queue_file(tmp_path)
    try:
        for _ in range(20):
            await transport._lock.acquire()
            call = asyncio.create_task(transport.stats())
            for _ in range(3):
                await asyncio.sleep(0)  # the call now waits for the lock
            transport._lock.release()
            await asyncio.sleep(0)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert not transport._lock.locked()
    finally:
        await transport.close()


async def test_a_blocked_event_loop_does_not_hold_the_files_write_lock(tmp_path: Path) -> None:
    """A process whose event loop blocks (a handler's ``time.sleep``) just after one of its writes
    began: the write runs to its end on the connection's thread, so another process gets the write
    lock at once, not after the block (it waited, and its heartbeats with it: its leases ran out)."""
    transport, topic = await queue_file(tmp_path)
    try:
        assert transport._conn is not None
        sent: list[str] = []  # the statements the transport's connection starts, on its thread
        await transport._conn.set_trace_callback(sent.append)
        for turn in range(3):
            sent.clear()
            publish = asyncio.create_task(transport.publish(topic, [prepare(PublishRequest(payload=turn))]))
            deadline = time.monotonic() + 5
            while "BEGIN IMMEDIATE" not in sent:  # (the publish has begun its transaction)
                assert time.monotonic() < deadline, sent
                await asyncio.sleep(0)
            other = subprocess.Popen(  # noqa: ASYNC220 (started while the event loop blocks, on purpose)
                [sys.executable, "-c", TRY_LOCK, transport.path, "1.0"], stdout=subprocess.PIPE, text=True)
            time.sleep(3.0)  # noqa: ASYNC251 (the event loop blocks, as a handler's sleep would block it)
            answer, _ = other.communicate(timeout=10)
            [result] = await transport.publish(topic, [prepare(PublishRequest(payload="after"))])
            assert (await publish)[0].ok and result.ok
            assert answer.startswith("took"), answer  # (before: "refused database is locked")
            assert float(answer.split()[1]) < 0.5, answer
    finally:
        await transport.close()


async def test_a_call_cancelled_while_another_process_writes_frees_the_connection_at_once(tmp_path: Path) -> None:
    """A sweep waiting in SQLite's busy handler for another process's writer, cancelled (a host
    stopping): its wait is interrupted, so this process's next calls and its close do not wait
    out the busy timeout (20 s here) behind it; nothing of it was applied."""
    transport = create_database_transport(f"sqlite+aiosqlite:///{tmp_path / 'queue.db'}",
                                          sqlite_busy_timeout_ms=20_000)
    assert isinstance(transport, SqliteTransport)
    await transport.open()
    await transport.migrate()
    await transport.sync_topology([Topic(name="t")], [Subscription(name="s", topic="t", handler_key="h")])
    try:
        assert transport._conn is not None
        sent: list[str] = []
        await transport._conn.set_trace_callback(sent.append)
        async with write_lock_held_elsewhere(transport.path, 15):
            sweep = asyncio.create_task(transport.sweep())
            await asyncio.wait_for(_until(lambda: "BEGIN IMMEDIATE" in sent), 5)
            await asyncio.sleep(0.2)  # (in the busy handler now)
            sweep.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sweep
            started = time.monotonic()
            [stats] = await transport.stats("s")  # a read: it needs the connection, not the write lock
            assert time.monotonic() - started < 2.0
            assert stats.pending == 0
        report = await transport.sweep()  # (the other writer gone: the connection writes again)
        assert report.ran
    finally:
        started = time.monotonic()
        await transport.close()
        assert time.monotonic() - started < 2.0


async def _until(check: Callable[[], bool]) -> None:
    while not check():  # noqa: ASYNC110 (what it waits for happens on another thread)
        await asyncio.sleep(0.01)


async def test_work_on_the_connections_thread_sees_the_callers_context(tmp_path: Path) -> None:
    """What runs on the connection's thread (a routine, what it logs) runs in the caller's context
    variables, as ``asyncio.to_thread`` runs a function."""
    import contextvars

    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")
    transport, _ = await queue_file(tmp_path)
    try:
        assert transport._conn is not None
        request_id.set("r-42")
        assert await transport._conn.run(request_id.get) == "r-42"
    finally:
        await transport.close()


async def test_a_migrated_file_starts_while_another_process_writes(tmp_path: Path) -> None:
    """A start on a file migrated already reads what is applied beside the writer and takes no
    write lock: it does not wait for another process's write (a request transaction that published)."""
    transport, _ = await queue_file(tmp_path)
    await transport.close()
    other = create_database_transport(transport.url, sqlite_busy_timeout_ms=BOUND_MS)
    async with write_lock_held_elsewhere(transport.path, 20):
        await other.open()
        try:
            started = time.monotonic()
            assert await other.migrate() == []
            assert time.monotonic() - started < BOUND_MS / 1000
        finally:
            await other.close()


async def test_a_migration_that_meets_a_held_lock_fails_with_the_busy_error(tmp_path: Path) -> None:
    """A migration past the bound failed with the driver's bare "database is locked" (and
    ``workqueue work`` with exit code 1 and a traceback); it is the retryable busy error every
    other call gives, and nothing of the migration was applied."""
    import sqlite3

    path = tmp_path / "new.db"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode = WAL").fetchall()
    transport = create_database_transport(f"sqlite+aiosqlite:///{path}", sqlite_busy_timeout_ms=300)
    await transport.open()
    try:
        async with write_lock_held_elsewhere(str(path), 20):
            with pytest.raises(TransportError) as caught:
                await transport.migrate()
        assert caught.value.retryable
        assert "is busy: its write lock was not free within 0.3 s" in str(caught.value), caught.value
        assert await transport.migrate() != []  # (the file free again: the whole schema, from the start)
    finally:
        await transport.close()


async def test_an_operator_command_keeps_the_busy_bound_setting(tmp_path: Path) -> None:
    """``WORKQUEUE_SQLITE_BUSY_TIMEOUT_MS`` bounds a command's wait too: the CLI built its transport
    from the URL alone, so a command waited the default 30 s whatever the setting said."""
    import os

    transport, _ = await queue_file(tmp_path)
    await transport.close()

    async def command(*args: str, bound: str) -> tuple[int | None, str]:
        env = {**os.environ, "WORKQUEUE_DATABASE_URL": transport.url, "WORKQUEUE_SQLITE_BUSY_TIMEOUT_MS": bound}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fastapi_workqueue", *args, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        return proc.returncode, err.decode()

    async with write_lock_held_elsewhere(transport.path, 40):
        code, err = await command("pause", "--subscription", "s", bound="300")
    assert code != 0 and "is busy: its write lock was not free within 0.3 s" in err, (code, err)
    code, err = await command("pause", "--subscription", "s", bound="soon")
    assert code != 0 and "WORKQUEUE_SQLITE_BUSY_TIMEOUT_MS='soon': give a whole number of milliseconds" in err, err


SLOW_QUERY = ("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 5000000) "
              "SELECT count(*) FROM n")


async def test_a_session_cancelled_in_a_statement_does_not_leave_the_file_locked(tmp_path: Path) -> None:
    """A task cancelled while its session's statement runs (a request's timeout, a handler past its
    time) had its connection closed by SQLAlchemy, but the statement's cursor outlived the close and
    SQLite keeps a connection with live statements open, in its transaction: the file stayed locked
    for every process until the garbage collector ran. The queue's engine rolls back first."""
    from sqlalchemy import text

    from fastapi_workqueue import WorkQueue, WorkQueueSettings

    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'queue.db'}", enabled=False,
                                        auto_migrate=True, sqlite_busy_timeout_ms=BOUND_MS),
                      topics=[Topic(name="t")], subscriptions=[Subscription(name="s", topic="t", handler_key="h")])

    async def request() -> None:
        async with queue.sessionmaker() as session, session.begin():
            await queue.publish("t", [PublishRequest(payload="cancelled")], session=session)
            await session.execute(text(SLOW_QUERY))

    async with queue.lifespan(None):
        transport = queue.transport
        assert isinstance(transport, SqliteTransport)
        for _ in range(3):
            task = asyncio.create_task(request())
            await asyncio.sleep(0.15)  # (inside the slow statement)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Another process writes at once, and so does the queue's own connection.
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", TRY_LOCK, transport.path, "1",
                                                        stdout=asyncio.subprocess.PIPE)
            out, _ = await proc.communicate()
            assert out.startswith(b"took"), out
            [result] = await queue.publish("t", [PublishRequest(payload="after")])
            assert result.ok
        payloads = [d.payload for d in await queue.deliveries("s", "Pending", include_payload=True)]
    assert payloads == ["after"] * 3, payloads
