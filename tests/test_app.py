"""The queue inside a FastAPI app: lifespan, health, reconcile, request sessions, wake-ups."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, HTTPException
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue import (
    ConfigurationError,
    Outcome,
    PublishRequest,
    Subscription,
    SubscriptionPlan,
    Topic,
    WorkMessage,
    WorkOutcome,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.settings import DEFAULT_DATABASE_URL

from .conftest import unique
from .support import FAST, ClaimWatch, delivery_status, make_queue, wait_for

pytestmark = pytest.mark.timeout(60)


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_health_reports_each_planned_subscription(pg_url: str) -> None:
    queue, _, subs = make_queue(pg_url, [{"role": "run"}, {"role": "paused"}, {"role": "orphan"}])
    missing = unique("missing")
    queue.settings.subscriptions.append(SubscriptionPlan(name=missing))

    @queue.handler("run")
    async def run(message: WorkMessage[Any]) -> WorkOutcome:
        return Outcome.complete()

    @queue.handler("paused")
    async def paused(message: WorkMessage[Any]) -> WorkOutcome:
        return Outcome.complete()

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.health_router)
    async with queue.lifespan(app), client(app) as http:
        await queue.pause(subs["paused"])
        response = await http.get("/health/extensions")
        assert response.status_code == 503  # the unknown subscription is an Error
        [ext] = response.json()["Extensions"]
        states = {s["Subscription"]: (s["State"], s["Reason"]) for s in ext["Subscriptions"]}
        assert states[subs["run"]] == ("Running", None)
        assert states[subs["paused"]][0] == "Paused"
        assert states[subs["orphan"]][0] == "HandlerNotRegistered"
        assert "orphan" in states[subs["orphan"]][1]
        assert states[missing][0] == "Error" and "does not exist" in states[missing][1]
        assert ext["Status"] == "Degraded" and ext["Reason"].startswith("2 subscriptions in Error or "
                                                                         "HandlerNotRegistered (")


async def test_health_is_503_while_the_lifespan_has_not_started_the_queue(pg_url: str) -> None:
    """A forgotten ``lifespan=queue.lifespan`` (or a mounted app, whose lifespan does not run): the
    process consumes nothing, so a load balancer takes it out; a web process whose host is off on
    purpose stays 200."""
    queue, _, _ = make_queue(pg_url, [{"role": "run"}])
    off, _, _ = make_queue(pg_url, [{"role": "run"}], disable_host=True)
    for q, expected in ((queue, 503), (off, 200)):
        app = FastAPI()  # (no lifespan)
        app.include_router(q.health_router)
        async with client(app) as http:
            response = await http.get("/health/extensions")
        [ext] = response.json()["Extensions"]
        assert (response.status_code, ext["Status"]) == (expected, "Stopped")
        if expected == 503:  # (SPEC: each subscription the host would run is in Error, and says why)
            [sub] = ext["Subscriptions"]
            assert sub["State"] == "Error" and "run the app with lifespan=queue.lifespan" in sub["Reason"]


async def test_a_subscription_that_is_not_served_is_logged_once(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue, _, subs = make_queue(pg_url, [{"role": "orphan"}])
    caplog.set_level(logging.WARNING, logger="fastapi_workqueue")
    async with queue.lifespan(None):
        assert queue.host is not None
        await queue.host.reconcile()  # (a second pass: logged once, not at every reconcile)
    lines = [r.getMessage() for r in caplog.records if subs["orphan"] in r.getMessage()]
    assert lines == [f"{subs['orphan']}: not served by this process (HandlerNotRegistered): no handler is "
                     "registered under 'orphan' in this process; register it with @queue.handler(...) and import "
                     "its module"]


async def test_health_is_503_for_a_handler_not_registered_and_200_for_running_paused_unsupported(
    pg_url: str,
) -> None:
    roles = [{"role": "run"}, {"role": "paused"}, {"role": "away", "host_type": "external"}]
    queue, _, subs = make_queue(pg_url, roles)
    orphaned, _, orphan_subs = make_queue(pg_url, [{"role": "run"}, {"role": "orphan"}])
    for q in (queue, orphaned):

        @q.handler("run")
        async def run(message: WorkMessage[Any]) -> WorkOutcome:
            return Outcome.complete()

    @queue.handler("paused")
    async def paused(message: WorkMessage[Any]) -> WorkOutcome:
        return Outcome.complete()

    healthy, sick = FastAPI(), FastAPI()
    healthy.include_router(queue.health_router)
    sick.include_router(orphaned.health_router)
    async with queue.lifespan(healthy), orphaned.lifespan(sick), client(healthy) as ok, client(sick) as bad:
        await queue.pause(subs["paused"])
        response = await ok.get("/health/extensions")
        [ext] = response.json()["Extensions"]
        states = {s["Subscription"]: s["State"] for s in ext["Subscriptions"]}
        assert states == {subs["run"]: "Running", subs["paused"]: "Paused", subs["away"]: "Unsupported"}
        assert response.status_code == 200

        response = await bad.get("/health/extensions")
        assert response.status_code == 503  # a load balancer takes this instance out
        [ext] = response.json()["Extensions"]
        assert ext["Status"] == "Degraded"  # (the host says which subscription is not served)
        states = {s["Subscription"]: s["State"] for s in ext["Subscriptions"]}
        assert states == {orphan_subs["run"]: "Running", orphan_subs["orphan"]: "HandlerNotRegistered"}


async def test_pause_resume_and_new_subscriptions_take_effect_without_restart(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "a"}])
    handled: list[str] = []

    @queue.handler("a")
    async def handle(message: WorkMessage[str]) -> WorkOutcome:
        handled.append(message.payload)
        return Outcome.complete()

    late_name = unique("late")
    queue.settings.subscriptions.append(SubscriptionPlan(name=late_name))
    async with queue.lifespan(None):
        assert queue.host is not None
        # Paused by an operator elsewhere (not through this queue object): the reconcile loop notices.
        await queue.transport.set_subscription_status(subs["a"], "Paused")
        await wait_for(lambda: _state(queue, subs["a"]) == "Paused")
        consumer = queue.host.consumers[subs["a"]]
        # Its claim loop has ended (it claims nothing until resumed): what is published now waits.
        await wait_for(lambda: consumer.claim_loop == "stopped", describe=lambda: consumer.claim_loop)
        await queue.publish(topic, [PublishRequest(payload="while paused")])
        assert handled == [] and (await queue.stats(subs["a"]))[0].pending == 1
        await queue.transport.set_subscription_status(subs["a"], "Active")
        await wait_for(lambda: handled == ["while paused"])

        # A subscription created after start, by another deployment, is planned on the next reconcile.
        assert _state(queue, late_name) == "Error"
        other = WorkQueue(
            WorkQueueSettings(database_url=pg_url, enabled=False),
            topics=[Topic(name=topic)],
            subscriptions=[Subscription(name=late_name, topic=topic, handler_key="a", lease_seconds=3)],
        )
        async with other.lifespan(None):
            pass
        await wait_for(lambda: _state(queue, late_name) == "Running")
        [result] = await queue.publish(topic, [PublishRequest(payload="to both")])
        await wait_for(lambda: handled.count("to both") == 2)

        # A changed lease reaches the running consumer.
        changed = WorkQueue(
            WorkQueueSettings(database_url=pg_url, enabled=False),
            topics=[Topic(name=topic)],
            subscriptions=[Subscription(name=late_name, topic=topic, handler_key="a", lease_seconds=7)],
        )
        async with changed.lifespan(None):
            pass
        await wait_for(
            lambda: queue.host is not None and queue.host.consumers[late_name].subscription.lease_seconds == 7
        )
        assert result.message_id is not None


async def test_disable_host_env_keeps_the_host_off(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKQUEUE_DISABLE_HOST", "1")
    queue, topic, subs = make_queue(pg_url, [{"role": "a"}])
    calls = 0

    @queue.handler("a")
    async def handle(message: WorkMessage[Any]) -> WorkOutcome:
        nonlocal calls
        calls += 1
        return Outcome.complete()

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.health_router)
    async with queue.lifespan(app), client(app) as http:
        assert queue.host is None  # no host: no consumer in this process could claim what is published
        [result] = await queue.publish(topic, [PublishRequest(payload=1)])
        body = (await http.get("/health/extensions")).json()
        assert body["Extensions"][0]["Status"] == "Disabled"
        info = await delivery_status(queue, subs["a"], result.message_id)
        assert info.status == "Pending"
    assert calls == 0


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"WORKQUEUE_ENABLED": "0"}, "WORKQUEUE_ENABLED"),
        ({"WORKQUEUE_DISABLE_HOST": "1"}, "WORKQUEUE_DISABLE_HOST"),
        ({"WORKQUEUE_ENABLED": "1", "WORKQUEUE_DISABLE_HOST": "true"}, "WORKQUEUE_DISABLE_HOST"),
        ({"WORKQUEUE_ENABLED": "false", "WORKQUEUE_DISABLE_HOST": "0"}, "WORKQUEUE_ENABLED"),
    ],
    ids=["enabled-0", "disable-host-1", "disable-host-wins-over-enabled", "enabled-off-wins-over-disable-host"],
)
async def test_either_switch_turns_the_host_off_and_the_log_says_which(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, env: dict[str, str], named: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    queue, _, _ = make_queue(pg_url, [{"role": "a"}])

    @queue.handler("a")
    async def handle(message: WorkMessage[Any]) -> WorkOutcome:
        return Outcome.complete()

    with caplog.at_level(logging.INFO, logger="fastapi_workqueue"):
        async with queue.lifespan(None):
            assert queue.host is None
    [line] = [r.getMessage() for r in caplog.records if "host is off" in r.getMessage()]
    assert named in line, line


async def test_disable_host_is_read_with_the_settings_not_at_start_up(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The switch is a setting: a variable set after the settings were made changes nothing, and
    ``disable_host=True`` in code turns the host off whatever the environment says."""
    monkeypatch.delenv("WORKQUEUE_DISABLE_HOST", raising=False)
    running, _, _ = make_queue(pg_url, [{"role": "a"}])
    off, _, _ = make_queue(pg_url, [{"role": "a"}], disable_host=True)
    monkeypatch.setenv("WORKQUEUE_DISABLE_HOST", "1")
    for queue in (running, off):

        @queue.handler("a")
        async def handle(message: WorkMessage[Any]) -> WorkOutcome:
            return Outcome.complete()

    async with running.lifespan(None):
        assert running.host is not None
    async with off.lifespan(None):
        assert off.host is None
        reason = off.health().reason
        assert reason == "the host is off in this process: WORKQUEUE_DISABLE_HOST is on (disable_host=True)"


async def test_the_default_sqlite_file_is_announced_with_its_path(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("WORKQUEUE_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    handlers = list(logging.getLogger().handlers)
    fallback = WorkQueue(WorkQueueSettings(enabled=False))
    chosen = WorkQueue(WorkQueueSettings(enabled=False, database_url=DEFAULT_DATABASE_URL))
    with caplog.at_level(logging.INFO, logger="fastapi_workqueue"):
        async with fallback.lifespan(None):
            pass
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        caplog.clear()
        async with chosen.lifespan(None):
            pass
    [warning] = warned
    assert str(tmp_path / "workqueue.db") in warning.getMessage()
    assert "WORKQUEUE_DATABASE_URL" in warning.getMessage()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # chosen on purpose: no warning
    assert logging.getLogger().handlers == handlers  # embedded, the library configures no logging


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("not json", "WORKQUEUE_SUBSCRIPTIONS is not valid JSON"),
        ('{"name": "*"}', "WORKQUEUE_SUBSCRIPTIONS (WorkQueueSettings.subscriptions): Input should be a valid list"),
        ('[{"name": "a", "concurrency": 0}]', "[0].concurrency: Input should be greater than or equal to 1"),
    ],
    ids=["not-json", "not-a-list", "bad-concurrency"],
)
def test_malformed_subscriptions_are_one_configuration_error(
    monkeypatch: pytest.MonkeyPatch, value: str, says: str
) -> None:
    monkeypatch.setenv("WORKQUEUE_SUBSCRIPTIONS", value)
    with pytest.raises(ConfigurationError) as raised:
        WorkQueueSettings()
    text = str(raised.value)
    assert says in text and "\n" not in text
    assert """for example WORKQUEUE_SUBSCRIPTIONS='[{"name": "*", "concurrency": 4}]'""" in text


async def test_request_session_commits_before_response_and_publish_joins_it(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "a"}], enabled=False)
    table = unique("orders").replace("-", "_")
    app = FastAPI(lifespan=queue.lifespan)

    @app.post("/orders/{n}")
    async def create(n: int, fail: bool = False, session: AsyncSession = queue.session) -> dict[str, Any]:
        await session.execute(text(f"INSERT INTO {table} (n) VALUES (:n)"), {"n": n})
        [result] = await queue.publish(topic, [PublishRequest(payload={"n": n})])
        if fail:
            raise HTTPException(status_code=409, detail="refused after publishing")
        return {"message_id": str(result.message_id), "status": result.status}

    async with queue.lifespan(app), client(app) as http:
        async with queue.engine.begin() as conn:
            await conn.execute(
                text(f"CREATE TABLE {table} (n int, CONSTRAINT {table}_n UNIQUE (n) DEFERRABLE INITIALLY DEFERRED)")
            )
        ok = await http.post("/orders/1")
        assert ok.status_code == 200 and ok.json()["status"] == "Accepted"
        refused = await http.post("/orders/2", params={"fail": True})
        assert refused.status_code == 409
        # The commit fails (deferred unique violation) before the response: a 500, nothing published.
        with pytest.raises(Exception, match=r"unique|duplicate"):
            await http.post("/orders/1")
        async with queue.engine.connect() as conn:
            rows = (await conn.execute(text(f"SELECT n FROM {table} ORDER BY n"))).scalars().all()
        assert rows == [1]
        [stats] = await queue.stats(subs["a"])
        assert stats.pending == 1


async def test_notification_wakes_an_idle_consumer_before_its_poll(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "a"}], idle_poll_min_ms=20_000, idle_poll_max_ms=20_000)
    handled = asyncio.Event()
    watch = ClaimWatch(queue.transport)

    @queue.handler("a")
    async def handle(message: WorkMessage[Any]) -> WorkOutcome:
        handled.set()
        return Outcome.complete()

    async with queue.lifespan(None):
        await watch.empty_claim(subs["a"])  # the consumer found nothing and sleeps for 20 s
        await queue.publish(topic, [PublishRequest(payload=1)])
        await asyncio.wait_for(handled.wait(), timeout=5)


async def test_unknown_database_gives_a_clear_error() -> None:
    queue = WorkQueue(
        WorkQueueSettings(database_url="postgresql+asyncpg://postgres@127.0.0.1:5432/no_such_db_here", **FAST)
    )
    with pytest.raises(Exception, match=r"no_such_db_here|does not exist"):
        async with queue.lifespan(None):
            pass


async def test_missing_database_url_says_what_to_set() -> None:
    from fastapi_workqueue import ConfigurationError

    queue = WorkQueue(WorkQueueSettings(database_url=None))
    with pytest.raises(ConfigurationError, match="WORKQUEUE_DATABASE_URL"):
        async with queue.lifespan(None):
            pass


def _state(queue: WorkQueue, name: str) -> str | None:
    host = queue.host
    if host is None:
        return None
    return next((h.state for h in host.health() if h.subscription == name), None)


async def test_the_rest_api_of_a_queue_not_open_says_so(pg_url: str) -> None:
    """A forgotten lifespan: the routes say the queue is not open (and where to fix it), not that
    the store is away and to retry."""
    queue, _, _ = make_queue(pg_url, [{"role": "run"}])
    app = FastAPI()  # (no lifespan)
    app.include_router(queue.router)
    async with client(app) as http:
        answer = await http.get("/work-queue/stats", headers={"X-API-Key": "wq_anything"})
    assert answer.status_code == 503
    assert answer.json()["detail"].startswith("the work queue is not open: include its routers in the app whose "
                                              "lifespan runs queue.lifespan")


async def test_a_request_session_while_the_database_is_away_answers_503(unused_tcp_port: int) -> None:
    """The request's connection cannot be had (the server is down): 503 with Retry-After, as for a
    pool with every connection busy, not a bare 500."""
    queue = WorkQueue(WorkQueueSettings(database_url=f"postgresql+asyncpg://postgres@127.0.0.1:{unused_tcp_port}/x"))
    app = FastAPI()

    @app.get("/orders")
    async def orders(session: AsyncSession = queue.session) -> dict[str, str]:
        return {"never": "here"}

    async with client(app) as http:
        answer = await http.get("/orders")
    await queue.engine.dispose()
    assert (answer.status_code, answer.headers.get("Retry-After")) == (503, "1")
    assert answer.json() == {"detail": "the database cannot be reached right now; retry shortly"}
