"""The FastAPI integration at its edges, end to end: two queues in one request, settings that cannot
work, and one app served on two event loops."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue import PublishRequest, Subscription, SubscriptionPlan, Topic, WorkQueue, WorkQueueSettings

from .conftest import drop_database, recreate_database, unique
from .support import FAST, make_queue
from .test_request_transactions import client, pending

pytestmark = pytest.mark.timeout(60)


async def test_a_publish_to_a_second_queue_does_not_join_the_first_queues_request_session(
    pg_url: str, tmp_path: Path
) -> None:
    # Two queues in one process: the app's own (PostgreSQL) whose request session the endpoint
    # holds, and a second one on its own SQLite file. A publish to the second queue has nothing
    # to do with the first queue's transaction: it must land in the second queue's store.
    first, _, _ = make_queue(pg_url, [{"role": "a"}], enabled=False)
    second, topic_b, subs_b = make_queue(f"sqlite+aiosqlite:///{tmp_path / 'b.db'}", [{"role": "b"}],
                                         enabled=False, auto_migrate=True)
    app = FastAPI(lifespan=first.lifespan)
    answers: list[str] = []

    @app.post("/publish")
    async def endpoint(session: AsyncSession = first.session) -> dict[str, str]:
        await session.execute(text("SELECT 1"))
        [result] = await second.publish(topic_b, [PublishRequest(payload={"n": 1})])
        answers.append(result.status)
        return {"status": result.status}

    async with second.lifespan(None), first.lifespan(app), client(app) as http:
        response = await http.post("/publish")
        assert response.status_code == 200, response.text
        assert answers == ["Accepted"]
        assert await pending(second, subs_b["b"]) == 1


async def test_a_queue_per_tenant_database_publishes_to_its_own_database_inside_another_queues_request(
    pg_url: str,
) -> None:
    # One queue per tenant database, the same topology in each (a common multi-tenant layout). An
    # endpoint that holds tenant A's request session and publishes to tenant B's queue must put the
    # message in B's database (joining A's transaction would put it in A's, where B's consumers
    # never see it).
    other_url = pg_url.rpartition("/")[0] + f"/workqueue_tenant_{unique('b').replace('-', '_')}"
    await recreate_database(other_url)
    topic, sub = unique("topic"), unique("sub")

    def tenant(url: str) -> WorkQueue:
        return WorkQueue(
            WorkQueueSettings(database_url=url, enabled=False, auto_migrate=True,
                              subscriptions=[SubscriptionPlan(name=sub)], **FAST),
            topics=[Topic(name=topic)], subscriptions=[Subscription(name=sub, topic=topic, handler_key="h")],
        )

    tenant_a, tenant_b = tenant(pg_url), tenant(other_url)
    app = FastAPI(lifespan=tenant_a.lifespan)

    @app.post("/b")
    async def endpoint(session: AsyncSession = tenant_a.session) -> dict[str, str]:
        await session.execute(text("SELECT 1"))
        [result] = await tenant_b.publish(topic, [PublishRequest(payload={"for": "b"})])
        return {"status": result.status}

    try:
        async with tenant_b.lifespan(None), tenant_a.lifespan(app), client(app) as http:
            response = await http.post("/b")
            assert response.status_code == 200, response.text
            assert response.json() == {"status": "Accepted"}
            landed = {"a": await pending(tenant_a, sub), "b": await pending(tenant_b, sub)}
            assert landed == {"a": 0, "b": 1}
    finally:
        await drop_database(other_url)


async def test_an_idle_poll_max_below_the_min_is_a_configuration_error_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/configuration.md: "A value that cannot work raises one `ConfigurationError` that names the
    # variable and what is wrong." A newcomer who only lowers WORKQUEUE_IDLE_POLL_MAX_MS below the
    # default minimum (250) hears it when the settings are made, not from inside the lifespan.
    from fastapi_workqueue import ConfigurationError, WorkQueueSettings

    monkeypatch.setenv("WORKQUEUE_IDLE_POLL_MAX_MS", "100")
    monkeypatch.setenv("WORKQUEUE_DATABASE_URL", f"sqlite+aiosqlite:///{tmp_path / 'q.db'}")
    with pytest.raises(ConfigurationError, match="WORKQUEUE_IDLE_POLL_MAX_MS"):
        queue = WorkQueue(WorkQueueSettings())
        app = FastAPI(lifespan=queue.lifespan)
        async with queue.lifespan(app):
            pass


def test_a_misspelt_key_inside_workqueue_subscriptions_is_named_not_reported_as_an_unknown_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # docs/configuration.md: "A value that cannot work raises one `ConfigurationError` that names the
    # variable and what is wrong." A typo inside the plan ("concurency") names the variable and the
    # key, and does not deny that WORKQUEUE_SUBSCRIPTIONS exists.
    from fastapi_workqueue import ConfigurationError, WorkQueueSettings

    monkeypatch.setenv("WORKQUEUE_SUBSCRIPTIONS", '[{"name": "*", "concurency": 8}]')
    with pytest.raises(ConfigurationError) as caught:
        WorkQueueSettings()
    message = str(caught.value)
    assert "has no setting 'subscriptions'" not in message, message
    assert "WORKQUEUE_SUBSCRIPTIONS" in message and "concurency" in message, message


def test_the_same_app_serves_a_second_testclient_on_sqlite(tmp_path: Path) -> None:
    # The usual FastAPI test layout: a module-level app (and queue), a `with TestClient(app)` per
    # test; each TestClient runs the lifespan on an event loop of its own. On SQLite the
    # transport's lock is made when it opens, on that loop: one made once would stay bound to the
    # first loop and fail every wait in the second ("bound to a different event loop").
    import asyncio
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # starlette's notice about httpx2, not what is tested
        from fastapi.testclient import TestClient

    queue, topic, _ = make_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", [{"role": "a"}], enabled=False,
                                 auto_migrate=True)
    app = FastAPI(lifespan=queue.lifespan)

    @app.post("/burst")
    async def burst() -> list[str]:
        answers = await asyncio.gather(*(queue.publish(topic, [PublishRequest(payload=n)]) for n in range(5)))
        return [str(results[0].status) for results in answers]

    for run in range(2):
        with TestClient(app, raise_server_exceptions=False) as http:
            response = http.post("/burst")
            assert response.status_code == 200, (run, response.text)
            assert len(response.json()) == 5
