"""An order service on fastapi_workqueue.

``POST /orders`` stores an order and publishes ``orders.created`` in the same transaction. Two
subscriptions consume the topic:

- ``orders.email`` (Exclusive per customer) sends a confirmation and stamps ``emailed_at``. An
  address containing "flaky" fails on the first attempt and succeeds on the second; one
  containing "invalid" is dead-lettered at once.
- ``orders.audit`` (Ordered per customer) appends a line to the customer's audit trail, in
  publish order.

``POST /customers`` signs a customer up and dispatches the job ``customers.send-welcome-mail`` in
the same transaction (the jobs layer: a job is declared with ``@queue.job`` and dispatched with
``queue.dispatch``); the job sends the mail once and stamps ``welcomed_at``.

Start it with ``./scripts/run-example``, then::

    curl -s -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"customer": "alice", "email": "alice@example.com", "amount_cents": 1250}'
    curl -s localhost:8000/orders/1
    curl -s localhost:8000/health/extensions

The operator dashboard is at http://127.0.0.1:8000/work-queue/ui and Prometheus's ``/metrics`` at
http://127.0.0.1:8000/metrics; both ask for an API key with ``workqueue:read``, which
``./scripts/run-example`` prints at start (``workqueue api-keys create --name me --scopes
workqueue:read,workqueue:operate`` makes another).

``"fail_after_publish": true`` in the body makes the endpoint fail after publishing: the order
and its message roll back together.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue import (
    FatalWorkError,
    JobContext,
    Outcome,
    PublishRequest,
    PublishResult,
    Subscription,
    Topic,
    TransientWorkError,
    WorkContext,
    WorkMessage,
    WorkOutcome,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.settings import DEFAULT_DATABASE_URL as LIBRARY_DEFAULT_DATABASE_URL

from .models import AuditEntry, Base, Customer, Order

DEFAULT_DATABASE_URL = LIBRARY_DEFAULT_DATABASE_URL
"""The library's default, an SQLite file (workqueue.db) in the working directory, which the
``workqueue`` command finds there too; WORKQUEUE_DATABASE_URL switches to PostgreSQL."""
TOPIC = "orders.created"


# -- payloads and API models ---------------------------------------------------------------------


class OrderCreated(BaseModel):
    """The payload of ``orders.created``: a reference to the order row, not a copy of it."""

    order_id: int
    customer: str
    amount_cents: int


class NewOrder(BaseModel):
    customer: str = Field(min_length=1, max_length=200)
    email: str = Field(min_length=3, max_length=320)
    amount_cents: int = Field(gt=0)
    fail_after_publish: bool = False
    """Fail after publishing, to show that the order and its message roll back together."""


class OrderAccepted(BaseModel):
    order_id: int
    publish: PublishResult


class NewCustomer(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    email: str = Field(min_length=3, max_length=320)


class WelcomeMail(BaseModel):
    """The payload of the welcome-mail job: who to welcome (the job reads the rest from the row)."""

    customer: str


class CustomerView(BaseModel):
    name: str
    email: str
    signed_up_at: datetime
    welcome_job_id: uuid.UUID | None
    welcomed_at: datetime | None


class OrderView(BaseModel):
    id: int
    customer: str
    email: str
    amount_cents: int
    message_id: uuid.UUID
    created_at: datetime
    emailed_at: datetime | None
    email_attempts: int
    email_error: str | None
    audit: list[str]


# -- a stand-in for a mail provider --------------------------------------------------------------


class MailError(Exception):
    """A failed send; ``permanent`` failures will never succeed."""

    def __init__(self, text: str, *, permanent: bool) -> None:
        super().__init__(text)
        self.permanent = permanent


async def send_email(to: str, attempt: int) -> None:
    """Pretends to send a mail: "flaky" addresses fail on the first attempt, "invalid" ones always."""
    await asyncio.sleep(0.01)  # the network call; while a handler awaits, the runtime renews its lease
    if "invalid" in to:
        raise MailError(f"mailbox {to!r} does not exist", permanent=True)
    if "flaky" in to and attempt < 2:
        raise MailError("mail server busy, try again later", permanent=False)


# -- the queue: topology and handlers ------------------------------------------------------------


def build_queue(settings: WorkQueueSettings) -> WorkQueue:
    """The topic, its two subscriptions and their handlers."""
    quick_retries: dict[str, Any] = {"max_attempts": 3, "backoff_base_seconds": 1, "backoff_max_seconds": 5}
    queue = WorkQueue(
        settings,
        topics=[Topic(name=TOPIC)],
        subscriptions=[
            Subscription(name="orders.email", topic=TOPIC, handler_key="orders.email",
                         partition_mode="Exclusive", **quick_retries),
            Subscription(name="orders.audit", topic=TOPIC, handler_key="orders.audit",
                         partition_mode="Ordered", **quick_retries),
        ],
    )

    async def db_session() -> AsyncIterator[AsyncSession]:
        """A handler dependency: one session per attempt, closed when the attempt ends."""
        async with queue.sessionmaker() as session:
            yield session

    @queue.handler("orders.email")
    async def email_confirmation(
        message: WorkMessage[OrderCreated],
        context: WorkContext,
        session: AsyncSession = Depends(db_session),
    ) -> WorkOutcome:
        """Sends the order confirmation once and records the result on the order row.

        Exclusive per customer: one confirmation per customer runs at a time. A delivery waiting
        in backoff does not hold its key, so the customer's later orders go ahead meanwhile.
        """
        order = await session.get(Order, message.payload.order_id)
        if order is None:
            return Outcome.dead_letter(f"order {message.payload.order_id} does not exist")
        if order.emailed_at is not None:
            return Outcome.complete()  # a redelivery of work already done: nothing to send
        order.email_attempts = context.attempt
        try:
            await send_email(order.email, context.attempt)
        except MailError as exc:
            order.email_error = str(exc)
            await session.commit()
            if exc.permanent:
                raise FatalWorkError(str(exc)) from exc  # dead-lettered now, whatever attempts remain
            raise TransientWorkError(str(exc)) from exc  # retried after backoff, up to max_attempts
        order.emailed_at = datetime.now(UTC)
        order.email_error = None
        await session.commit()
        context.log.info("confirmation sent for order %s", order.id)
        return Outcome.complete()

    @queue.handler("orders.audit")
    async def audit_order(
        message: WorkMessage[OrderCreated],
        session: AsyncSession = Depends(db_session),
    ) -> WorkOutcome:
        """Appends a line to the customer's audit trail; Ordered keeps each customer's lines in publish order.

        The MessageID is the idempotency key: a redelivered message adds no second line.
        """
        created = message.payload
        seen = await session.scalar(select(AuditEntry.id).where(AuditEntry.message_id == message.message_id))
        if seen is None:
            session.add(AuditEntry(
                message_id=message.message_id,
                order_id=created.order_id,
                customer=created.customer,
                line=f"order {created.order_id} created: {created.amount_cents} cents",
            ))
            await session.commit()
        return Outcome.complete()

    @queue.job("customers.send-welcome-mail", tries=5, backoff=[1, 5, 30], timeout=30, queue="mail")
    async def send_welcome_mail(
        payload: WelcomeMail, job: JobContext, session: AsyncSession = Depends(db_session)
    ) -> Any:
        """Sends the welcome mail once per customer and stamps ``welcomed_at``.

        ``job.once`` keeps the mail from being sent twice when an attempt is repeated (a retry after
        the stamp failed, a worker that died after sending); ``job.id`` is the same over attempts.
        """
        customer = await session.get(Customer, payload.customer)
        if customer is None:
            return job.discard(f"customer {payload.customer!r} no longer exists")
        if customer.welcomed_at is not None:
            return None  # a repeat of work already done
        await job.once(f"welcome-mail:{customer.name}", lambda: send_email(customer.email, job.attempt))
        customer.welcomed_at = datetime.now(UTC)
        await session.commit()
        job.log.info("welcome mail sent to %s", customer.name)
        return None

    return queue


# -- the HTTP API --------------------------------------------------------------------------------


def build_router(queue: WorkQueue) -> APIRouter:
    router = APIRouter()

    @router.post("/orders", status_code=201)
    async def create_order(body: NewOrder, session: AsyncSession = queue.session) -> OrderAccepted:
        """Stores the order and publishes ``orders.created`` in one transaction.

        ``queue.session`` opens a transaction for the request and commits it before the response
        is sent; ``queue.publish`` joins it. If the endpoint raises, neither the order nor the
        message exists, and no handler ever sees the message.
        """
        order = Order(customer=body.customer, email=body.email, amount_cents=body.amount_cents,
                      message_id=uuid.uuid4())
        session.add(order)
        await session.flush()  # assigns order.id
        payload = OrderCreated(order_id=order.id, customer=order.customer, amount_cents=order.amount_cents)
        [result] = await queue.publish(TOPIC, [
            PublishRequest(message_id=order.message_id, partition_key=order.customer,
                           payload=payload.model_dump(mode="json")),
        ])
        if not result.ok:
            raise HTTPException(500, f"orders.created was not published: {result.error}")
        if body.fail_after_publish:
            raise HTTPException(400, {
                "message": "failed after publishing: the order and its message were rolled back",
                "order_id": order.id,
                "message_id": str(order.message_id),
            })
        return OrderAccepted(order_id=order.id, publish=result)

    @router.post("/customers", status_code=201)
    async def sign_up(body: NewCustomer, session: AsyncSession = queue.session) -> CustomerView:
        """Stores the customer and dispatches the welcome mail in the same transaction: if the
        request fails, there is neither a customer nor a mail to send."""
        if await session.get(Customer, body.name) is not None:
            raise HTTPException(409, f"customer {body.name!r} exists")
        customer = Customer(name=body.name, email=body.email)
        session.add(customer)
        try:
            await session.flush()
        except IntegrityError:  # (signed up by a request running beside this one)
            raise HTTPException(409, f"customer {body.name!r} exists") from None
        customer.welcome_job_id = await queue.dispatch("customers.send-welcome-mail", {"customer": body.name})
        await session.flush()
        await session.refresh(customer)
        return _customer_view(customer)

    @router.get("/customers/{name}")
    async def get_customer(name: str, session: AsyncSession = queue.session) -> CustomerView:
        """The customer and when the welcome mail went out."""
        customer = await session.get(Customer, name)
        if customer is None:
            raise HTTPException(404, f"customer {name!r} does not exist")
        return _customer_view(customer)

    @router.get("/orders/{order_id}")
    async def get_order(order_id: int, session: AsyncSession = queue.session) -> OrderView:
        """The order, what the email handler did with it, and its audit lines."""
        order = await session.get(Order, order_id)
        if order is None:
            raise HTTPException(404, f"order {order_id} does not exist")
        audit = await session.scalars(
            select(AuditEntry.line).where(AuditEntry.order_id == order_id).order_by(AuditEntry.id)
        )
        return OrderView(
            id=order.id, customer=order.customer, email=order.email, amount_cents=order.amount_cents,
            message_id=order.message_id, created_at=order.created_at, emailed_at=order.emailed_at,
            email_attempts=order.email_attempts, email_error=order.email_error, audit=list(audit),
        )

    return router


def _customer_view(customer: Customer) -> CustomerView:
    return CustomerView(name=customer.name, email=customer.email, signed_up_at=customer.signed_up_at,
                        welcome_job_id=customer.welcome_job_id, welcomed_at=customer.welcomed_at)


# -- the app -------------------------------------------------------------------------------------


async def create_tables(queue: WorkQueue) -> None:
    """Creates the example's tables unless they exist. Several processes may start at once (uvicorn
    --workers 2 on an empty database): on PostgreSQL they take turns under a transaction-scoped
    advisory lock; on SQLite one that loses the race to the file's single writer sees "already
    exists" and looks again."""
    for attempt in range(1, 4):
        try:
            async with queue.engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('example_app.create_tables'))"))
                await conn.run_sync(Base.metadata.create_all)
            return
        except OperationalError as exc:
            if attempt == 3 or "already exists" not in str(exc):
                raise


def create_app(settings: WorkQueueSettings | None = None) -> FastAPI:
    """Builds the app. Without ``settings`` it reads ``WORKQUEUE_*`` from the environment."""
    if settings is None:
        settings = WorkQueueSettings(
            database_url=os.environ.get("WORKQUEUE_DATABASE_URL", DEFAULT_DATABASE_URL),
            auto_migrate=True,
        )
    queue = build_queue(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        """Opens the queue (migrating its schema), creates the example's tables, runs the host."""
        async with queue.lifespan(app) as state:
            await create_tables(queue)
            yield state

    app = FastAPI(title="Orders: a fastapi-workqueue example", lifespan=lifespan)
    app.state.queue = queue
    app.include_router(build_router(queue))
    # The operator dashboard: sign in with an API key. It signs its sessions with a server secret
    # (WORKQUEUE_DASHBOARD_SECRET, the same in every process); this example makes one for the process
    # when none is set, so that a first run needs no set-up (a restart then signs everyone out).
    ephemeral = None if settings.dashboard_secret or settings.app_key else secrets.token_urlsafe(32)
    app.mount("/work-queue/ui", queue.dashboard(secret=ephemeral) if ephemeral else queue.dashboard())
    app.include_router(queue.router)  # REST publish and operator API under /work-queue (API keys)
    app.include_router(queue.health_router)  # GET /health/extensions
    app.include_router(queue.metrics_router)  # GET /metrics for Prometheus, with a workqueue:read key
    return app


app = create_app()
queue: WorkQueue = app.state.queue
"""The app's queue (also ``app.state.queue``). ``workqueue work --app example_app.main:app
--subscription orders.email`` runs the app's lifespan and that subscription's handlers in a
process of its own."""
