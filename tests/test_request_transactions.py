"""A publish joins the request's transaction only while that transaction is open, from the request's
own task; anywhere else it commits on its own. An Accepted answer is never a message nobody commits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import BackgroundTasks, Depends, FastAPI, HTTPException
from sqlalchemy import QueuePool, text
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue import PublishRequest, PublishResult, WorkQueue

from .conftest import unique
from .support import make_queue

pytestmark = pytest.mark.timeout(60)


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def pending(queue: WorkQueue, subscription: str) -> int:
    [stats] = await queue.stats(subscription)
    return stats.pending


async def make(database_url: str) -> tuple[WorkQueue, str, str]:
    queue, topic, subs = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True)
    return queue, topic, subs["a"]


async def test_a_task_spawned_by_the_request_publishes_after_the_response_in_its_own_transaction(
    database_url: str,
) -> None:
    queue, topic, sub = await make(database_url)
    app = FastAPI(lifespan=queue.lifespan)
    answered = asyncio.Event()
    spawned: list[asyncio.Task[list[PublishResult]]] = []

    async def publish_later() -> list[PublishResult]:
        await answered.wait()  # the request's transaction is committed and its session closed
        return await queue.publish(topic, [PublishRequest(payload="fire and forget")])

    @app.post("/spawn")
    async def spawn(session: AsyncSession = queue.session) -> dict[str, str]:
        await session.execute(text("SELECT 1"))
        spawned.append(asyncio.create_task(publish_later()))
        return {"ok": "yes"}

    async with queue.lifespan(app), client(app) as http:
        assert (await http.post("/spawn")).status_code == 200
        answered.set()
        [result] = await spawned[0]
        assert result.status == "Accepted"
        assert await pending(queue, sub) == 1


async def test_background_tasks_and_late_cleanups_publish_in_their_own_transaction(database_url: str) -> None:
    queue, topic, sub = await make(database_url)
    app = FastAPI(lifespan=queue.lifespan)
    results: list[PublishResult] = []

    async def publish(payload: str) -> None:
        results.extend(await queue.publish(topic, [PublishRequest(payload=payload)]))

    async def audit() -> AsyncIterator[None]:
        yield
        # A request-scoped dependency cleans up after the response, after the session committed.
        await publish("from a cleanup after the response")

    @app.post("/background")
    async def background(
        tasks: BackgroundTasks, session: AsyncSession = queue.session, _: None = Depends(audit, scope="request")
    ) -> dict[str, str]:
        await session.execute(text("SELECT 1"))
        tasks.add_task(publish, "from a background task")
        return {"ok": "yes"}

    async with queue.lifespan(app), client(app) as http:
        assert (await http.post("/background")).status_code == 200
        assert sorted(r.status.value for r in results) == ["Accepted", "Accepted"]
        assert await pending(queue, sub) == 2


async def test_the_requests_own_session_handed_to_a_background_task_is_refused_not_lost(database_url: str) -> None:
    """``BackgroundTasks`` runs after the response, when the request's transaction has committed and
    its session closed: a publish or dispatch with ``session=`` that session is refused with what to
    do instead (it would begin a transaction nobody commits, and on SQLite hold the write lock), and
    the same call without ``session=`` commits on its own."""
    from fastapi_workqueue import ConfigurationError

    queue, topic, sub = await make(database_url)

    @queue.job(unique("later-job"))
    async def later_job(n: int) -> None: ...

    app = FastAPI(lifespan=queue.lifespan)
    refusals: list[str] = []
    results: list[PublishResult] = []

    async def later(session: AsyncSession) -> None:
        for call in (lambda: queue.publish(topic, [PublishRequest(payload="late")], session=session),
                     lambda: queue.dispatch(later_job, 1, session=session)):
            try:
                await call()
            except ConfigurationError as exc:
                refusals.append(str(exc))
        results.extend(await queue.publish(topic, [PublishRequest(payload="own")]))

    @app.post("/signup")
    async def signup(tasks: BackgroundTasks, session: AsyncSession = queue.session) -> dict[str, str]:
        [joined] = await queue.publish(topic, [PublishRequest(payload="in the request")], session=session)
        assert joined.status == "Accepted"
        tasks.add_task(later, session)
        return {"ok": "yes"}

    async with queue.lifespan(app), client(app) as http:
        assert (await http.post("/signup")).status_code == 200
        assert len(refusals) == 2, refusals
        assert all("its request has ended" in r and "Publish without session=" in r for r in refusals)
        assert [r.status.value for r in results] == ["Accepted"]
        # the request's publish and the task's own: nothing else, and the store is not held
        assert await asyncio.wait_for(pending(queue, sub), 10) == 2


async def test_another_task_does_not_join_an_open_request_transaction(database_url: str) -> None:
    """A task running beside the request (asyncio.gather, create_task) has its own transaction, so
    the request failing afterwards does not take that task's message with it."""
    queue, topic, sub = await make(database_url)
    app = FastAPI(lifespan=queue.lifespan)

    @app.post("/fail")
    async def fail(session: AsyncSession = queue.session) -> None:
        if database_url.startswith("postgresql"):
            await session.execute(text("SELECT 1"))  # on SQLite the request's write would lock the other task out
        [beside] = await asyncio.create_task(queue.publish(topic, [PublishRequest(payload="beside")]))
        assert beside.status == "Accepted"
        [own] = await queue.publish(topic, [PublishRequest(payload="in the request")])
        assert own.status == "Accepted"
        raise HTTPException(409, "refused after publishing")

    async with queue.lifespan(app), client(app) as http:
        assert (await http.post("/fail")).status_code == 409
        assert await pending(queue, sub) == 1  # the request's own publish was rolled back


async def test_a_publish_after_the_endpoint_commits_joins_what_the_dependency_commits(database_url: str) -> None:
    queue, topic, sub = await make(database_url)
    app = FastAPI(lifespan=queue.lifespan)
    table = unique("notes").replace("-", "_")

    @app.post("/commit-midway")
    async def commit_midway(session: AsyncSession = queue.session) -> dict[str, Any]:
        await session.execute(text(f"INSERT INTO {table} (n) VALUES (1)"))
        await session.commit()  # the endpoint commits early; it goes on in a new transaction
        await session.execute(text(f"INSERT INTO {table} (n) VALUES (2)"))
        [result] = await queue.publish(topic, [PublishRequest(payload="after a commit")])
        return {"status": result.status}

    async with queue.lifespan(app):
        async with queue.engine.begin() as conn:
            await conn.execute(text(f"CREATE TABLE {table} (n int)"))
        async with client(app) as http:
            response = await http.post("/commit-midway")
        assert response.json() == {"status": "Accepted"}
        async with queue.engine.connect() as conn:
            rows = (await conn.execute(text(f"SELECT n FROM {table} ORDER BY n"))).scalars().all()
        assert rows == [1, 2]
        assert await pending(queue, sub) == 1


async def test_a_request_that_finds_every_connection_busy_gets_503_with_retry_after(database_url: str) -> None:
    queue, _, _ = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True,
                             session_pool_size=1, session_pool_timeout_ms=200)
    app = FastAPI(lifespan=queue.lifespan)
    holding, release = asyncio.Event(), asyncio.Event()

    @app.get("/hold")
    async def hold(session: AsyncSession = queue.session) -> dict[str, str]:
        holding.set()
        await release.wait()
        return {"ok": "held"}

    @app.get("/quick")
    async def quick(session: AsyncSession = queue.session) -> dict[str, int]:
        return {"n": (await session.execute(text("SELECT 1"))).scalar_one()}

    async with queue.lifespan(app), client(app) as http:
        pool = queue.engine.pool
        assert isinstance(pool, QueuePool) and pool.size() == 1
        first = asyncio.create_task(http.get("/hold"))
        await asyncio.wait_for(holding.wait(), 10)
        refused = await http.get("/quick")
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert "retry" in refused.json()["detail"]
        release.set()
        assert (await first).status_code == 200
        assert (await http.get("/quick")).json() == {"n": 1}
