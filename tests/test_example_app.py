"""The example app, driven in-process over HTTP against the test database, its host running.

Every case runs twice: on the PostgreSQL test database and on an SQLite file of its own (the
app's default), with the same assertions. The example's subscription names are fixed, so each
test uses customers of its own and asserts on its own orders and MessageIDs, never on global
counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from sqlalchemy import func, select, text

from example_app.main import create_app
from example_app.models import AuditEntry, Order
from fastapi_workqueue import DeliveryInfo, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.keys import SCOPE_READ, create_key

from .support import wait_for

T = TypeVar("T")

WAIT_SECONDS = 20.0
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Example:
    client: httpx.AsyncClient
    queue: WorkQueue
    app: Any


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def example_database(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The URL the example runs on: the session's PostgreSQL database, or a fresh SQLite file."""
    if request.param == "postgresql":
        url: str = request.getfixturevalue("pg_url")
        return url
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('example') / 'workqueue-example.db'}"


@pytest.fixture(scope="module")
async def example(example_database: str) -> AsyncIterator[Example]:
    """The example app with its lifespan entered (host running), and an HTTP client on it."""
    settings = WorkQueueSettings(
        database_url=example_database,
        auto_migrate=True,
        subscriptions=[{"name": "orders.email"}, {"name": "orders.audit"}],
        job_queues="mail",
        idle_poll_min_ms=20,
        idle_poll_max_ms=200,
        sweeper_interval_ms=500,
        reconcile_interval_ms=1000,
        shutdown_drain_ms=2000,
    )
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://example") as client,
    ):
        yield Example(client=client, queue=app.state.queue, app=app)


def new_customer() -> str:
    return f"customer-{uuid.uuid4().hex[:10]}"


async def eventually(check: Callable[[], Awaitable[T | None]], what: str, within: float = WAIT_SECONDS) -> T:
    """Polls ``check()`` until it returns a truthy value; fails after ``within`` seconds saying ``what``."""
    value: T = await wait_for(check, within=within, interval=0.05, describe=lambda: f"{what}: not yet")
    return value


async def place_order(client: httpx.AsyncClient, customer: str, email: str, amount_cents: int = 1000) -> dict[str, Any]:
    response = await client.post("/orders", json={"customer": customer, "email": email, "amount_cents": amount_cents})
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    assert body["publish"]["Status"] == "Accepted", body
    return body


async def get_order(client: httpx.AsyncClient, order_id: int) -> dict[str, Any]:
    response = await client.get(f"/orders/{order_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def find_delivery(queue: WorkQueue, subscription: str, message_id: str) -> DeliveryInfo | None:
    """The delivery of ``message_id`` on ``subscription``, whatever its state."""
    for status in ("Pending", "InFlight", "Completed", "DeadLettered", "Discarded"):
        for info in await queue.deliveries(subscription, status, limit=1000):
            if str(info.message_id) == message_id:
                return info
    return None


async def test_an_order_is_emailed_and_audited(example: Example) -> None:
    customer = new_customer()
    placed = await place_order(example.client, customer, f"{customer}@example.com", 1250)
    order_id, message_id = placed["order_id"], placed["publish"]["MessageID"]

    async def emailed_and_audited() -> dict[str, Any] | None:
        order = await get_order(example.client, order_id)
        return order if order["emailed_at"] and order["audit"] else None

    order = await eventually(emailed_and_audited, f"order {order_id} emailed and audited")
    assert order["message_id"] == message_id
    assert order["email_attempts"] == 1
    assert order["email_error"] is None
    assert order["audit"] == [f"order {order_id} created: 1250 cents"]
    for subscription in ("orders.email", "orders.audit"):
        # A handler's effect is visible before its settle is written (the settler batches them).
        async def completed(subscription: str = subscription) -> DeliveryInfo | None:
            delivery = await find_delivery(example.queue, subscription, message_id)
            return delivery if delivery is not None and delivery.status == "Completed" else None

        delivery = await eventually(completed, f"the {subscription} delivery completed")
        assert delivery.attempt == 1, delivery


async def test_signing_up_dispatches_the_welcome_mail_job_in_the_same_transaction(example: Example) -> None:
    name = new_customer()
    created = await example.client.post("/customers", json={"name": name, "email": f"{name}.flaky@example.com"})
    assert created.status_code == 201, created.text
    job_id = created.json()["welcome_job_id"]
    assert job_id is not None and created.json()["welcomed_at"] is None

    async def welcomed() -> dict[str, Any] | None:
        view = (await example.client.get(f"/customers/{name}")).json()
        return view if view["welcomed_at"] else None

    view = await eventually(welcomed, f"{name} welcomed")
    assert view["welcome_job_id"] == job_id  # the mail failed once ("flaky") and was sent on attempt 2
    assert (await example.client.post("/customers", json={"name": name, "email": "x@y.z"})).status_code == 409
    [delivery] = await example.queue.transport.message_deliveries(uuid.UUID(job_id))
    assert (delivery.subscription, delivery.attempt) == ("jobs.mail", 2)


async def test_a_flaky_address_succeeds_on_the_second_attempt(example: Example) -> None:
    customer = new_customer()
    placed = await place_order(example.client, customer, f"{customer}.flaky@example.com")
    order_id, message_id = placed["order_id"], placed["publish"]["MessageID"]

    async def emailed() -> dict[str, Any] | None:
        order = await get_order(example.client, order_id)
        return order if order["emailed_at"] else None

    order = await eventually(emailed, f"order {order_id} emailed")
    assert order["email_attempts"] == 2
    assert order["email_error"] is None

    async def completed() -> DeliveryInfo | None:
        delivery = await find_delivery(example.queue, "orders.email", message_id)
        return delivery if delivery is not None and delivery.status == "Completed" else None

    delivery = await eventually(completed, "the email delivery completed")
    assert delivery.attempt == 2
    assert delivery.last_error is not None and "mail server busy" in delivery.last_error


async def test_an_invalid_address_is_dead_lettered_at_once(example: Example) -> None:
    customer = new_customer()
    placed = await place_order(example.client, customer, f"invalid-{customer}@example.com")
    order_id, message_id = placed["order_id"], placed["publish"]["MessageID"]

    async def dead_letter() -> DeliveryInfo | None:
        letters = await example.queue.dead_letters("orders.email", limit=1000)
        return next((d for d in letters if str(d.message_id) == message_id), None)

    letter = await eventually(dead_letter, f"order {order_id}'s email dead-lettered")
    assert letter.attempt == 1  # FatalWorkError: no retries, although max_attempts is 3
    assert letter.max_attempts == 3
    assert letter.reason is not None and "does not exist" in letter.reason

    async def audited() -> dict[str, Any] | None:
        order = await get_order(example.client, order_id)
        return order if order["audit"] else None

    order = await eventually(audited, f"order {order_id} audited")  # the other subscription is unaffected
    assert order["emailed_at"] is None
    assert order["email_attempts"] == 1
    assert "does not exist" in order["email_error"]


async def test_a_failure_after_publishing_rolls_back_the_order_and_its_message(example: Example) -> None:
    customer = new_customer()
    body = {"customer": customer, "email": f"{customer}@example.com", "amount_cents": 500, "fail_after_publish": True}
    response = await example.client.post("/orders", json=body)
    assert response.status_code == 400, response.text
    detail = response.json()["detail"]
    order_id, message_id = detail["order_id"], detail["message_id"]

    assert (await example.client.get(f"/orders/{order_id}")).status_code == 404
    async with example.queue.sessionmaker() as session:
        orders = await session.scalar(select(func.count()).select_from(Order).where(Order.customer == customer))
        if str(example.queue.settings.database_url).startswith("sqlite"):
            query = "SELECT count(*) FROM message WHERE id = :id"
        else:
            query = "SELECT count(*) FROM workqueue.message WHERE id = CAST(:id AS uuid)"
        messages = await session.scalar(text(query), {"id": message_id})
    assert orders == 0
    assert messages == 0
    for subscription in ("orders.email", "orders.audit"):
        assert await find_delivery(example.queue, subscription, message_id) is None


async def test_sign_ups_of_one_name_at_once_answer_one_201_and_409s(example: Example) -> None:
    """Ten requests sign up one name at the same moment: one is created, the others are told the
    customer exists (409), none fails with the database's unique-constraint error (500)."""
    import asyncio

    name = new_customer()
    answers = await asyncio.gather(*(
        example.client.post("/customers", json={"name": name, "email": f"{name}@example.com"}) for _ in range(10)))
    assert sorted(a.status_code for a in answers) == [201] + [409] * 9, [(a.status_code, a.text[:120]) for a in answers]


async def test_audit_lines_follow_publish_order_per_customer(example: Example) -> None:
    customer = new_customer()
    order_ids = [
        (await place_order(example.client, customer, f"{customer}@example.com", amount))["order_id"]
        for amount in (100, 200, 300, 400, 500)
    ]

    async def audit_trail() -> list[int] | None:
        async with example.queue.sessionmaker() as session:
            rows = await session.scalars(
                select(AuditEntry.order_id).where(AuditEntry.customer == customer).order_by(AuditEntry.id)
            )
            trail = list(rows)
        return trail if len(trail) == len(order_ids) else None

    assert await eventually(audit_trail, f"{customer}'s audit trail") == order_ids


async def test_health_reports_both_subscriptions_and_the_job_queue_running(example: Example) -> None:
    response = await example.client.get("/health/extensions")
    assert response.status_code == 200, response.text
    [extension] = response.json()["Extensions"]
    assert extension["Status"] == "Running"
    states = {s["Subscription"]: s["State"] for s in extension["Subscriptions"]}
    assert states == {"orders.email": "Running", "orders.audit": "Running", "jobs.mail": "Running"}


async def test_the_dashboard_is_mounted_and_signs_in_with_a_read_key(example: Example) -> None:
    """What the README's first run shows: /work-queue/ui sends a visitor to its sign-in page, and an
    API key with workqueue:read (as ``workqueue api-keys create`` makes) opens the overview."""
    ui = "/work-queue/ui"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=example.app), base_url="http://example",
                                 follow_redirects=True) as browser:
        page = await browser.get(f"{ui}/")
        assert page.status_code == 200, page.text
        assert page.url.path == f"{ui}/sign-in" and 'name="api_key"' in page.text
        token = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert token is not None
        key = (await create_key(example.queue.transport, f"reader-{uuid.uuid4().hex[:8]}", [SCOPE_READ])).key
        overview = await browser.post(f"{ui}/sign-in", data={"csrf": token.group(1), "api_key": key, "next": f"{ui}/"})
        assert overview.status_code == 200 and overview.url.path == f"{ui}/", overview.text
        assert "orders.email" in overview.text and "orders.audit" in overview.text


async def test_metrics_answer_a_read_key_and_refuse_a_request_without_one(example: Example) -> None:
    refused = await example.client.get("/metrics")
    assert refused.status_code == 401, refused.text
    key = (await create_key(example.queue.transport, f"scraper-{uuid.uuid4().hex[:8]}", [SCOPE_READ])).key
    scraped = await example.client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
    assert scraped.status_code == 200, scraped.text
    assert scraped.headers["content-type"].startswith("text/plain")
    assert 'subscription="orders.email"' in scraped.text, scraped.text


async def test_a_worker_process_runs_the_example_subscriptions(example: Example, example_database: str) -> None:
    """``workqueue work --app example_app.main:app`` finds the app's queue, runs its lifespan, and runs
    a subscription beside the app's own host, on the same database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env.update(PYTHONPATH=str(ROOT), WORKQUEUE_DATABASE_URL=example_database)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fastapi_workqueue", "work", "--app", "example_app.main:app",
        "--subscription", "orders.audit", "--once", cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().startswith("workqueue work: orders.audit: ran "), out.decode()


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
async def test_processes_starting_at_once_on_an_empty_database_all_start(
    dialect: str, tmp_path: Path
) -> None:
    """uvicorn --workers 2 on a new database: each process creates the example's tables at start;
    the ones that lose the race see them created and start too."""
    from tests.conftest import PG_URL, drop_database, recreate_database

    if dialect == "postgresql":
        url = PG_URL.rpartition("/")[0] + f"/workqueue_example_race_{os.getpid()}"
        await recreate_database(url)
    else:
        url = f"sqlite+aiosqlite:///{tmp_path / 'race.db'}"
    apps = [create_app(WorkQueueSettings(database_url=url, auto_migrate=True, enabled=False)) for _ in range(4)]
    try:
        async with contextlib.AsyncExitStack() as stack:
            await asyncio.gather(*(stack.enter_async_context(app.router.lifespan_context(app)) for app in apps))
            async with apps[0].state.queue.engine.connect() as conn:
                assert (await conn.execute(select(func.count()).select_from(Order))).scalar_one() == 0
    finally:
        if dialect == "postgresql":
            await drop_database(url)
