"""A claim or a settle stuck behind another session's lock is said: in the log while it waits,
in health (503) until it returns, and again in the log when it does; nothing is lost."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from fastapi_workqueue import (
    PublishRequest,
    Subscription,
    SubscriptionPlan,
    Topic,
    WorkMessage,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.database.postgres import to_asyncpg_dsn

from .conftest import private_database, unique
from .support import delivery_status, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with private_database("workqueue_stalls") as url:
        yield url


def stalled_queue(url: str, topic: str, sub: str, stalled_ms: int) -> WorkQueue:
    return WorkQueue(
        WorkQueueSettings(database_url=url, auto_migrate=True, stalled_store_call_ms=stalled_ms,
                          idle_poll_min_ms=50, idle_poll_max_ms=100, shutdown_drain_ms=500,
                          subscriptions=[SubscriptionPlan(name=sub, concurrency=1)]),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=sub, topic=topic, handler_key=sub, lease_seconds=60)],
    )


async def completed(queue: WorkQueue, sub: str, message_id: Any) -> Any:
    """The delivery of ``message_id`` once it is Completed, else None."""
    info = await delivery_status(queue, sub, message_id)
    return info if info is not None and info.status == "Completed" else None


async def test_a_claim_and_a_settle_behind_a_lock_are_logged_and_make_health_503_until_they_return(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fastapi_workqueue")
    topic, sub = unique("stall"), unique("stall-sub")
    queue = stalled_queue(url, topic, sub, stalled_ms=800)
    runs: Counter[str] = Counter()
    entered, release = asyncio.Event(), asyncio.Event()

    @queue.handler(sub)
    async def work(message: WorkMessage[Any]) -> None:
        runs[str(message.message_id)] += 1
        entered.set()
        await release.wait()

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.health_router)
    async with queue.lifespan(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://app"
    ) as http:
        [result] = await queue.publish(topic, [PublishRequest(payload={"n": 1})])
        await asyncio.wait_for(entered.wait(), 10)
        assert (await http.get("/health/extensions")).status_code == 200

        locker = await asyncpg.connect(to_asyncpg_dsn(url))
        try:
            tx = locker.transaction()
            await tx.start()
            await locker.execute("LOCK TABLE workqueue.delivery IN ACCESS EXCLUSIVE MODE")
            release.set()  # (its settle now waits for the lock, as the consumer's next claim does)

            def stalled() -> Any:
                [entry] = queue.health().subscriptions
                return entry if entry.state == "Error" else None

            entry = await wait_for(stalled, within=10, interval=0.05)
            assert "has waited" in (entry.reason or "") and "lock" in (entry.reason or ""), entry
            response = await http.get("/health/extensions")
            assert response.status_code == 503, response.text
            [public] = response.json()["Extensions"][0]["Subscriptions"]
            assert "has waited" in public["Reason"], public  # (no driver text in it: shown to anyone)
            warnings = await wait_for(
                lambda: [r.getMessage() for r in caplog.records
                         if r.levelno == logging.WARNING and "has waited" in r.getMessage()],
                within=10, interval=0.05,
            )
            assert any(f"{sub}: a claim has waited" in w for w in warnings), warnings
            await asyncio.sleep(1.0)  # (said once per call, not at every look)
            assert sum(f"{sub}: a claim has waited" in r.getMessage() for r in caplog.records) == 1
        finally:
            await locker.close()  # (the lock goes with its session)

        info = await wait_for(functools.partial(completed, queue, sub, result.message_id), within=20)
        await wait_for(lambda: queue.health().subscriptions[0].state == "Running", within=10, interval=0.05)
        assert (await http.get("/health/extensions")).status_code == 200
        answered = [r.getMessage() for r in caplog.records if "answered after" in r.getMessage()]
        assert any(m.startswith(f"{sub}: a claim answered after") for m in answered), answered
        [again] = await queue.publish(topic, [PublishRequest(payload={"n": 2})])
        await wait_for(lambda: runs[str(again.message_id)] == 1, within=10)
    assert info.attempt == 1 and runs[str(result.message_id)] == 1, (info, runs)


async def test_nothing_is_said_of_calls_that_answer_in_time_or_with_the_look_off(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Idle claims every 50-100 ms for a while and a lock shorter than the limit say nothing; with
    ``stalled_store_call_ms=0`` a lock longer than any limit is not looked at either."""
    caplog.set_level(logging.INFO, logger="fastapi_workqueue")
    for stalled_ms, lock_seconds in ((3000, 0.5), (0, 1.5)):
        topic, sub = unique("calm"), unique("calm-sub")
        queue = stalled_queue(url, topic, sub, stalled_ms=stalled_ms)

        @queue.handler(sub)
        async def work(message: WorkMessage[Any]) -> None:
            return None

        async with queue.lifespan(None):
            await asyncio.sleep(0.5)
            locker = await asyncpg.connect(to_asyncpg_dsn(url))
            try:
                async with locker.transaction():
                    await locker.execute("LOCK TABLE workqueue.delivery IN ACCESS EXCLUSIVE MODE")
                    await asyncio.sleep(lock_seconds)
                    assert all(s.state == "Running" for s in queue.health().subscriptions), queue.health()
            finally:
                await locker.close()
            [result] = await queue.publish(topic, [PublishRequest(payload={})])
            await wait_for(functools.partial(completed, queue, sub, result.message_id), within=10)
    said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage() or "answered after" in
            r.getMessage()]
    assert not said, said


async def test_on_sqlite_a_claim_behind_another_writer_is_said_with_what_holds_an_sqlite_file(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The same on an SQLite file whose write lock another process holds (within the busy
    timeout): the reason names what holds an SQLite file's lock, not PostgreSQL's views."""
    import sqlite3

    caplog.set_level(logging.INFO, logger="fastapi_workqueue")
    path = tmp_path / "queue.db"
    topic, sub = unique("stall"), unique("stall-sub")
    queue = WorkQueue(
        WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{path}", stalled_store_call_ms=500,
                          sqlite_busy_timeout_ms=20_000, idle_poll_min_ms=50, idle_poll_max_ms=100,
                          shutdown_drain_ms=500, subscriptions=[SubscriptionPlan(name=sub, concurrency=1)]),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=sub, topic=topic, handler_key=sub)],
    )
    handled: list[Any] = []

    @queue.handler(sub)
    async def work(message: WorkMessage[Any]) -> None:
        handled.append(message.payload)

    async with queue.lifespan(None):
        writer = sqlite3.connect(path, isolation_level=None)
        try:
            writer.execute("BEGIN IMMEDIATE")  # (another process's writer, holding the lock)
            entry = await wait_for(lambda: next((s for s in queue.health().subscriptions if s.state == "Error"), None),
                                   within=10, interval=0.05)
        finally:
            writer.execute("ROLLBACK")
            writer.close()
        assert "SQLite file's write lock" in (entry.reason or "") and "pg_locks" not in (entry.reason or ""), entry
        await wait_for(lambda: queue.health().subscriptions[0].state == "Running", within=10, interval=0.05)
        await queue.publish(topic, [PublishRequest(payload={"n": 1})])
        await wait_for(lambda: handled == [{"n": 1}], within=10)
    said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert said and all("SQLite file's write lock" in line for line in said), said
