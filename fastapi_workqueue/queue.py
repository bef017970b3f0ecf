"""WorkQueue: the one object an app creates. Topology, handlers, publish, lifespan, routers.

It is the public surface and the assembly: it wires one :class:`~.core.kernel.Kernel` (with the
database transport, the FastAPI dependency injector and the request sessions, which only the
layers above ``core`` can build) and hands that kernel to the jobs layer, the routers, the
dashboard and the metrics. Its own methods delegate to the kernel, the operator service and the
jobs layer. Inside the package only ``__init__`` and the CLI's app loading import this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from .core.envelope import PublishRequest
from .core.errors import ConfigurationError, TransportError
from .core.handlers import HandlerFunc, unused_handlers
from .core.health import ExtensionHealth
from .core.host import GroupPlan, Host, SubscriptionPlan
from .core.kernel import Kernel, worker_runs_host
from .core.observe import Observer
from .core.ports import Ports
from .core.published import PublishResults
from .core.redaction import redacting_logger
from .core.reports import (
    ActionResult,
    Backlog,
    BindingReport,
    DeliveryInfo,
    DeliveryStatus,
    PartitionCondition,
    PartitionInfo,
    SubscriptionStats,
    SweepReport,
)
from .core.request_load import RequestLoad
from .core.retirement import DeleteResult, RetireResult, TopicStatus, TopicStatusChange
from .core.settings import WorkQueueSettings, default_database_file, misspelt_database_url_problem, unknown_variables
from .core.topology import Subscription, SubscriptionStatus, Topic, is_job_topic
from .core.transport import Transport
from .web.di import DependencyInvoker
from .web.limits import DEFAULT_MAX_BATCH, DEFAULT_MAX_BODY_BYTES
from .web.session import RequestSessions

log = redacting_logger("fastapi_workqueue")

_OPEN_ELSEWHERE = (
    "the queue is open already, but it was opened {where} and never closed: its connections belong to "
    "that event loop, where nothing serves them now (the host would stall and publishes would fail). Close it "
    "where it was opened (await queue.close() before that loop ends), or open it only in the app's lifespan; "
    "for work before the server starts (migrating, creating tables) use queue.migrate() or queue.engine, which "
    "leave the queue closed"
)

if TYPE_CHECKING:
    from datetime import datetime, timedelta

    from fastapi import APIRouter, FastAPI
    from prometheus_client import CollectorRegistry
    from pydantic import JsonValue
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker
    from starlette.types import ASGIApp

    from .jobs.definition import Job
    from .jobs.events import E
    from .jobs.failed import FailedJob
    from .jobs.fake import JobFake
    from .jobs.groups import JobGroup
    from .jobs.layer import Jobs
    from .jobs.middleware import Middleware
    from .jobs.schedules import Schedule
    from .jobs.status import JobStatus
    from .web.auth import Authorizer

    Session = AsyncSession | AsyncConnection
    """A caller's transaction that a publish or dispatch joins (a rollback queues nothing)."""

    JobRef = Job | str | Callable[..., Any]
    """A job as dispatch and schedule take it: its function, its :class:`Job`, or its name."""

F = TypeVar("F", bound=HandlerFunc)
J = TypeVar("J", bound=Callable[..., Awaitable[Any]])
"""A job function: it may return a value (kept with ``store_result=True``)."""

_warned_variables: set[str] = set()
"""Unknown ``WORKQUEUE_*`` variables already warned about in this process (once each)."""

__all__ = ["WorkQueue"]


def _wired_transport(kernel: Kernel) -> Transport:
    """The transport of a queue built from its settings and topics: the database, and a router
    over it and the other transports its topics name (found by entry point, given the kernel)."""
    from .database import create_database_transport

    settings = kernel.settings
    database: Transport | None = None
    only_other = bool(kernel.topics) and all(t.transport != "database" for t in kernel.topics.values())
    if settings.database_url or not only_other:
        database = create_database_transport(
            kernel.database_url(), pool_max_size=settings.pool_size, listen=settings.listen,
            sqlite_busy_timeout_ms=settings.sqlite_busy_timeout_ms,
        )
    routed = None
    if not all(t.transport == "database" for t in kernel.topics.values()):
        from .core.routing import build_routing

        routed = build_routing(kernel, database, list(kernel.topics.values()), list(kernel.subscriptions.values()))
    transport = routed if routed is not None else database
    assert transport is not None
    return transport


def _default_observers(settings: WorkQueueSettings) -> list[Observer]:
    """OpenTelemetry and Prometheus, as the settings ask and as far as they are installed."""
    if not (settings.otel or settings.prometheus):
        return []
    from .observability import default_observers

    return default_observers(settings)


_JOB_TOPIC_NAME = (
    "{what}: topics whose names start with 'jobs.' are the job queues' (@queue.job), whose one subscription "
    "the jobs layer declares and its job workers run: this one would never be served. Name the topic otherwise "
    "({name!r}, say), or declare a job with @queue.job(..., queue=...)"
)

class WorkQueue:
    """A durable work queue for a FastAPI or Starlette app.

    ``app = FastAPI(lifespan=queue.lifespan)`` opens the transport with the app and runs the
    host (consumers, sweeper, reconcile loop) until the app stops. Handlers register with
    ``@queue.handler(key)``; ``await queue.publish(topic, [PublishRequest(...)])`` publishes,
    joining the request's transaction when one is open.
    """

    def __init__(
        self,
        settings: WorkQueueSettings | None = None,
        *,
        topics: Iterable[Topic] = (),
        subscriptions: Iterable[Subscription] = (),
        transport: Transport | None = None,
    ) -> None:
        self._kernel: Kernel  # (the sessions read the kernel's settings when they first connect)
        load = RequestLoad()
        self._sessions = RequestSessions(lambda: self._kernel.database_url(),
                                         lambda: self._kernel.settings.session_pool(), load=load)
        self._kernel = Kernel(
            settings if settings is not None else WorkQueueSettings(), transport=transport,
            injector=DependencyInvoker(), sessions=self._sessions, request_load=load,
            build_transport=_wired_transport, default_observers=_default_observers, facade=self,
        )
        self.topics: dict[str, Topic] = self._kernel.topics
        """The topics declared in code, by name."""
        self.subscriptions: dict[str, Subscription] = self._kernel.subscriptions
        """The subscriptions declared in code, by name."""
        for topic in topics:
            self.add_topic(topic)
        for subscription in subscriptions:
            self.add_subscription(subscription)
        self.handlers = self._kernel.handlers
        """The handlers registered with :meth:`handler`, by key."""
        self.request_load = self._kernel.request_load
        """The requests this process serves (those holding ``queue.session``), which its host yields to."""
        self._health_router: APIRouter | None = None
        self._router: APIRouter | None = None
        self._jobs: Jobs | None = None
        self._metrics_router: APIRouter | None = None

    @property
    def settings(self) -> WorkQueueSettings:
        """The settings the queue was made with (read from ``WORKQUEUE_*`` when none were given)."""
        return self._kernel.settings

    @settings.setter
    def settings(self, settings: WorkQueueSettings) -> None:
        self._kernel.settings = settings

    @property
    def kernel(self) -> Kernel:
        """What the library's own layers (jobs, REST API, dashboard, AWS, metrics) share: the
        settings, transport and ports, handlers, observers and sessions. Internal: an app has no
        need of it, and it may change between releases."""
        return self._kernel

    # -- routers -----------------------------------------------------------------------------
    # Built on first use, with FastAPI: a worker that serves no HTTP never imports it.

    @property
    def health_router(self) -> APIRouter:
        """``GET /health/extensions``: the state of the host and of each subscription it plans, 503
        when one is ``HandlerNotRegistered`` or in ``Error``. ``app.include_router(queue.health_router)``."""
        if self._health_router is None:
            from .web.health import build_health_router

            self._health_router = build_health_router(self._kernel)
        return self._health_router

    @property
    def router(self) -> APIRouter:
        """The REST publish and operator API under ``/work-queue``, checked with API keys."""
        if self._router is None:
            self._router = self.create_router()
        return self._router

    def create_router(
        self,
        *,
        authorize: Authorizer | None = None,
        prefix: str = "/work-queue",
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> APIRouter:
        """The REST API with your own ``authorize`` dependency (OAuth, sessions …) or other limits.

        ``authorize`` takes ``SecurityScopes`` and returns a ``Principal``; it raises 401/403.
        """
        from .jobs.routes import build_job_router
        from .web.auth import api_key_authorizer
        from .web.cross_site import same_site_or_preflighted
        from .web.routes import build_router

        check = same_site_or_preflighted(authorize or api_key_authorizer(self._kernel))
        router = build_router(self._kernel, check, prefix=prefix, max_body_bytes=max_body_bytes, max_batch=max_batch)
        # (the operator routes' route class: the same body bound and parse errors for the job routes)
        router.include_router(build_job_router(lambda: self.jobs, check, prefix="", route_class=router.route_class))
        return router

    @property
    def metrics_router(self) -> APIRouter:
        """``GET /metrics`` in Prometheus's text format (needs the ``prometheus`` extra):
        ``app.include_router(queue.metrics_router)``. It asks for an API key with
        ``workqueue:read`` unless ``WORKQUEUE_METRICS_PUBLIC=1``."""
        if self._metrics_router is None:
            self._metrics_router = self.create_metrics_router()
        return self._metrics_router

    def create_metrics_router(self, *, authorize: Authorizer | None = None, public: bool | None = None,
                              path: str = "/metrics", registry: CollectorRegistry | None = None) -> APIRouter:
        """A ``/metrics`` router: ``authorize`` replaces the API keys, ``public=True`` serves it
        to anyone, ``registry`` is a ``prometheus_client.CollectorRegistry`` of the app's own."""
        from .observability.metrics_router import build_metrics_router
        from .web.auth import api_key_authorizer

        return build_metrics_router(
            self._kernel, authorize=authorize or api_key_authorizer(self._kernel),
            public=self.settings.metrics_public if public is None else public, path=path, registry=registry,
        )

    @property
    def observer(self) -> Observer:
        """What sees this queue's publishes, attempts and settles: OpenTelemetry and Prometheus
        when they are installed and enabled in the settings, and any :meth:`add_observer`."""
        return self._kernel.observer

    def add_observer(self, observer: Observer) -> None:
        """Adds an observer of your own (subclass :class:`~fastapi_workqueue.core.observe.Observer`)."""
        self._kernel.add_observer(observer)

    def dashboard(self, *, authorize: Authorizer | None = None, **options: Any) -> FastAPI:
        """The operator dashboard, an ASGI app: ``app.mount("/work-queue/ui", queue.dashboard())``.

        Signs people in with an API key by default, or uses the app's ``authorize`` dependency
        (the shape :meth:`create_router` takes). Needs the ``dashboard`` extra; ``options`` are
        those of :func:`fastapi_workqueue.dashboard.create_dashboard`.
        """
        from .dashboard import create_dashboard

        return create_dashboard(self, authorize=authorize, **options)

    # -- declaration -------------------------------------------------------------------------

    def add_topic(self, topic: Topic) -> None:
        """Declares a topic (synced to the store at start-up)."""
        self._kernel.add_topic(topic)

    def add_subscription(self, subscription: Subscription) -> None:
        """Declares a subscription (synced to the store at start-up)."""
        if is_job_topic(subscription.topic) and subscription.host_type == "worker":  # (an external one is served
            # outside the host, by a Lambda say)
            raise ConfigurationError(_JOB_TOPIC_NAME.format(
                what=f"subscription {subscription.name!r} names topic {subscription.topic!r}",
                name=subscription.topic.removeprefix("jobs.")))
        self._kernel.add_subscription(subscription)

    def handler(self, key: str) -> Callable[[F], F]:
        """Registers an async handler under ``key``; subscriptions name the key.

        The handler takes ``message: WorkMessage[Payload]``, optionally ``context: WorkContext``,
        and any FastAPI dependencies (``Depends``), resolved per attempt.
        """

        def register(func: F) -> F:
            self._kernel.add_handler(key, func)
            return func

        return register

    def bind_app(self, app: ASGIApp | None) -> None:
        """The app whose ``state`` and ``dependency_overrides`` handlers see (``lifespan`` binds it)."""
        self._kernel.bind_app(app)

    @property
    def bound_app(self) -> ASGIApp | None:
        """The app :meth:`bind_app` (or the lifespan) bound, or None."""
        app: ASGIApp | None = self._kernel.bound_app
        return app

    # -- jobs --------------------------------------------------------------------------------

    @property
    def jobs(self) -> Jobs:
        """The jobs layer (:class:`fastapi_workqueue.jobs.layer.Jobs`), made on first use."""
        if self._jobs is None:
            from .jobs.layer import Jobs

            self._jobs = Jobs(self._kernel)
        return self._jobs

    def job(
        self,
        name: str,
        *,
        tries: int = 3,
        backoff: Sequence[float] | float | None = None,
        timeout: float | None = None,
        queue: str = "default",
        encrypted: bool = False,
        middleware: Sequence[Middleware] = (),
        store_result: bool = False,
        priority: int = 0,
        rate_limit: str | None = None,
        concurrency: int | None = None,
    ) -> Callable[[J], J]:
        """Declares a job: ``@queue.job("billing.send-invoice-reminder", tries=5, backoff=[10, 60, 300],
        timeout=30, queue="mail")`` on ``async def send(payload: Model, job: JobContext, dep = Depends(...))``.

        ``tries`` attempts in all; ``backoff`` the delay after failed attempt n (item n, the last
        repeating; default the queue's exponential full-jitter backoff); ``timeout`` seconds after
        which ``job.signal`` aborts and the attempt fails; ``encrypted`` stores the payload encrypted
        with ``WORKQUEUE_APP_KEY``; ``middleware`` runs around each attempt; ``store_result`` keeps what
        the job returns (JSON, at most 64 KiB) for :meth:`job_status` and :meth:`wait`. ``priority`` (0 to 9,
        higher first) is what its jobs are dispatched with unless a dispatch says otherwise.
        ``concurrency`` and ``rate_limit`` (``"50/s"``) are its queue's limits, held across every
        process: the most jobs of the queue running at once, and started per second, minute or hour.
        """
        decorate: Callable[[J], J] = self.jobs.declare(
            name, tries=tries, backoff=backoff, timeout=timeout, queue=queue, encrypted=encrypted,
            middleware=middleware, store_result=store_result, priority=priority, rate_limit=rate_limit,
            concurrency=concurrency,
        )
        return decorate

    @overload
    async def dispatch(
        self, job: JobRef, payload: Any = None, *, delay: timedelta | float | None = None, queue: str | None = None,
        unique: None = None, unique_until: Literal["done", "processing"] = "done", unique_for: float = 3600,
        debounce: timedelta | float | None = None, debounce_key: str | None = None, session: Session | None = None,
        priority: int | None = None,
    ) -> uuid.UUID: ...

    @overload
    async def dispatch(
        self, job: JobRef, payload: Any = None, *, delay: timedelta | float | None = None, queue: str | None = None,
        unique: str | None, unique_until: Literal["done", "processing"] = "done", unique_for: float = 3600,
        debounce: timedelta | float | None = None, debounce_key: str | None = None, session: Session | None = None,
        priority: int | None = None,
    ) -> uuid.UUID | None: ...

    async def dispatch(
        self,
        job: JobRef,
        payload: Any = None,
        *,
        delay: timedelta | float | None = None,
        queue: str | None = None,
        unique: str | None = None,
        unique_until: Literal["done", "processing"] = "done",
        unique_for: float = 3600,
        debounce: timedelta | float | None = None,
        debounce_key: str | None = None,
        session: Session | None = None,
        priority: int | None = None,
    ) -> uuid.UUID | None:
        """Validates ``payload`` and queues ``job``; returns the job id (None while ``unique`` is held).

        Joins ``session``'s transaction, or the request's (``queue.session``): a rollback queues
        nothing. ``delay`` is a ``timedelta`` or seconds; ``queue`` overrides the declared queue;
        ``priority`` (0 to 9, higher first) the declared priority.
        ``debounce`` (a window) with ``debounce_key``: dispatches with one key within the window make
        one job, run once the window has passed since the last of them, with the last payload; each
        returns that job's id.
        """
        result: uuid.UUID | None = await self.jobs.dispatch(
            job, payload, delay=delay, queue=queue, unique=unique, unique_until=unique_until, unique_for=unique_for,
            debounce=debounce, debounce_key=debounce_key, session=session, priority=priority,
        )
        return result

    async def bulk(self, items: Iterable[tuple[Any, ...]], *, session: Session | None = None) -> list[uuid.UUID]:
        """Queues ``[(job, payload), ...]`` in one transaction; one invalid payload queues none."""
        ids: list[uuid.UUID] = await self.jobs.bulk(items, session=session)
        return ids

    async def chain(self, items: Iterable[tuple[Any, ...]], *, session: Session | None = None) -> list[uuid.UUID]:
        """Queues jobs that run one after the other; returns all their ids."""
        ids: list[uuid.UUID] = await self.jobs.chain(items, session=session)
        return ids

    async def group(
        self, items: Iterable[tuple[Any, ...]], *, then: tuple[Any, ...], session: Session | None = None
    ) -> JobGroup:
        """Queues the jobs ``items`` (``(job, payload)``, or ``(job, payload, {"queue": ...})``) and
        ``then``, which runs once when every one of them has ended, completed, failed or
        discarded, and finds each one's status (and result) in ``job.group_results``. All in one
        transaction (``session``'s, the request's, or one of its own); every payload is checked
        first. Returns the ``JobGroup`` (its id, the members' job ids, the ``then`` job's id)."""
        group: JobGroup = await self.jobs.group(items, then=then, session=session)
        return group

    async def size(self, queue: str | None = None) -> int:
        """Jobs that wait or run on ``queue`` (every job queue when None)."""
        count: int = await self.jobs.size(queue)
        return count

    def listen(self, event: type[E], listener: Callable[[E], Any]) -> None:
        """Calls ``listener`` (sync or async) for every job event of class ``event`` (``JobEvent``: all)."""
        self.jobs.events.listen(event, listener)

    def schedule(
        self,
        job: JobRef,
        *,
        cron: str | None = None,
        every: timedelta | float | None = None,
        payload: Any = None,
        timezone: str = "UTC",
        catch_up: bool = False,
        name: str | None = None,
        queue: str | None = None,
    ) -> Schedule:
        """Dispatches ``job`` on a schedule: ``cron="*/5 * * * *"`` (in ``timezone``) or
        ``every=timedelta(minutes=5)`` (or a number of seconds). Exactly one dispatch per tick across
        every process whose host runs; ticks missed while all were down are not queued unless
        ``catch_up=True``."""
        return self.jobs.schedules.add(job, cron=cron, every=every, payload=payload, timezone=timezone,
                                       catch_up=catch_up, name=name, queue=queue)

    async def run_schedules(self, now: datetime | None = None) -> int:
        """Queues every schedule's tick that is due at ``now`` (an aware datetime; default: the
        current time), as the host's schedule loop does, and returns how many this call queued (a
        tick already queued, by this process or another, is not queued again). The first call looks
        back a minute (or, with ``catch_up=True``, to the last tick the store knows); each later
        call queues the ticks after the previous call's ``now``. For tests, under ``queue.fake()``
        (the ticks are recorded) or on a queue open without its host (``await queue.open()``, or
        ``disable_host=True``): a host's loop moves with the real time."""
        return await self.jobs.schedules.run_due(now)

    async def job_status(self, job_id: uuid.UUID | str) -> JobStatus | None:
        """Where job ``job_id`` is: its state (Pending, Running, Completed, Failed, Discarded),
        attempts, tries, times, last error and (``store_result=True``) result; None when no job
        has that id (never dispatched, or purged with the retention)."""
        status: JobStatus | None = await self.jobs.status(job_id)
        return status

    async def wait(self, job_id: uuid.UUID | str, timeout: float | timedelta | None = None) -> JsonValue:  # noqa: ASYNC109
        """Waits until job ``job_id`` ends and returns what it returned (JSON as stored; None unless
        it is declared ``store_result=True``). Raises ``JobFailedError`` or ``JobDiscardedError``
        (``fastapi_workqueue.jobs``) carrying the job's status when it did not complete,
        ``JobNotFound`` when no job has the id, and ``TimeoutError`` after ``timeout`` seconds (a
        ``timedelta`` too; None waits as long as it takes). PostgreSQL tells the waiter when the
        job ends (LISTEN/NOTIFY); other stores are polled."""
        from .jobs.waiting import wait

        return await wait(self.jobs, job_id, timeout)

    async def failed_jobs(self, queue: str | None = None, *, limit: int = 100,
                          include_payload: bool = False) -> list[FailedJob]:
        """Jobs that failed for good (the job queues' dead letters), with their redacted error."""
        failed: list[FailedJob] = await self.jobs.failed.list(queue, limit=limit, include_payload=include_payload)
        return failed

    async def retry_job(self, job_id: uuid.UUID | str, note: str | None = None) -> ActionResult:
        """Queues a failed job again, with the same id and its tries counted afresh."""
        result: ActionResult = await self.jobs.failed.retry(uuid.UUID(str(job_id)), note)
        return result

    async def cancel_job(self, job_id: uuid.UUID | str, reason: str | None = None) -> ActionResult:
        """Cancels a job by its id: a waiting one ends Discarded at once (``Discarded``); a running
        one has its cancel requested (``CancelRequested``: its ``job.signal`` aborts, and it ends
        Discarded whatever it returns, never retried). Raises ``LookupError`` when no job with the
        id waits or runs (a failed one: ``forget_job``)."""
        from .jobs.cancel import cancel_job

        result: ActionResult = await cancel_job(self.jobs, uuid.UUID(str(job_id)), reason)
        return result

    async def forget_job(self, job_id: uuid.UUID | str) -> ActionResult:
        """Drops a failed job."""
        result: ActionResult = await self.jobs.failed.forget(uuid.UUID(str(job_id)))
        return result

    async def prune_failed_jobs(self, older_than_days: float, queue: str | None = None) -> int:
        """Drops the jobs that failed more than ``older_than_days`` ago; returns how many."""
        from datetime import timedelta

        from .jobs.failed import MAX_DAYS

        if not 0 <= older_than_days <= MAX_DAYS:
            raise ValueError(f"older_than_days must be between 0 and {MAX_DAYS:g}, got {older_than_days!r}")
        count: int = await self.jobs.failed.prune(timedelta(days=older_than_days), queue)
        return count

    async def reencrypt_jobs(self) -> int:
        """Encrypts waiting and failed encrypted jobs again with the current ``WORKQUEUE_APP_KEY``."""
        count: int = await self.jobs.reencrypt()
        return count

    def fake(self, *, app: ASGIApp | None = None) -> JobFake:
        """A test fake (``with queue.fake() as fake:``): dispatches are checked and recorded, not queued.

        ``await fake.work()`` runs them with the dependencies of ``app`` (its ``dependency_overrides``
        and state); without it, with the app that serves this queue (its lifespan is
        ``queue.lifespan`` or it includes the queue's routers), whether its lifespan ran or not."""
        from .jobs.fake import JobFake

        return JobFake(self.jobs, app=app)

    # -- transport ---------------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        """The transport messages live on (created from the settings on first use)."""
        return self._kernel.transport

    @property
    def ports(self) -> Ports:
        """The transport's optional parts (process registry, live work, API keys ...), resolved
        once for the transport in use."""
        return self._kernel.ports

    @property
    def is_open(self) -> bool:
        """True between :meth:`open` and :meth:`close` (inside the lifespan)."""
        return self._kernel.is_open

    @property
    def host(self) -> Host | None:
        """The running host, when this process runs one."""
        return self._kernel.host

    @property
    def engine(self) -> AsyncEngine:
        """A SQLAlchemy ``AsyncEngine`` on the queue's database, for the app's own tables."""
        return self._sessions.engine

    @property
    def sessionmaker(self) -> async_sessionmaker[AsyncSession]:
        """An ``async_sessionmaker`` on :attr:`engine`."""
        return self._sessions.sessionmaker

    @property
    def session(self) -> Any:
        """A dependency: a session in a transaction per request, committed before the response.

        ``async def endpoint(session: AsyncSession = queue.session)``; ``Depends(queue.session)``
        and ``Annotated[AsyncSession, queue.session]`` mean the same. Publishes made during the
        request join its transaction; an exception rolls both back.
        """
        from .web.session_dependency import SessionDependency

        return SessionDependency(self._sessions.dependency)

    async def open(self) -> None:
        """Opens the transport (and migrates / syncs the topology as the settings say)."""
        kernel = self._kernel
        here = (os.getpid(), asyncio.get_running_loop())
        if kernel.opened > 0 and kernel.opened_in is not None:
            # (another loop that still runs, a test client's thread say, shares the queue as before)
            pid, loop = kernel.opened_in[0], kernel.opened_in[1]()
            ended = loop is not here[1] and (loop is None or loop.is_closed() or not loop.is_running())
            if pid != here[0] or ended:
                raise ConfigurationError(_OPEN_ELSEWHERE.format(
                    where="in the parent process, before this one was forked (a --preload master, say)"
                    if pid != here[0] else "in an event loop that no longer runs (at import time with "
                    "asyncio.run(...), say)"))
        kernel.opened += 1
        if kernel.opened > 1:
            return
        kernel.ended = False
        kernel.opened_in = (here[0], weakref.ref(here[1]))
        try:
            if self._jobs is not None:
                self._jobs.check()
            for problem in unknown_variables():
                if problem not in _warned_variables:
                    _warned_variables.add(problem)
                    log.warning("%s", problem)
            default_file = self.settings.uses_default_database and kernel.given_database_url is None
            if default_file and (misspelt := misspelt_database_url_problem(
                f", so the queue would live in the default SQLite file {default_database_file()}: name the "
                "variable WORKQUEUE_DATABASE_URL"
            )) is not None:
                raise ConfigurationError(misspelt)
            if default_file:
                log.warning(
                    "no database is configured (neither WORKQUEUE_DATABASE_URL nor database_url): the queue "
                    "lives in the default SQLite file %s", default_database_file(),
                )
            await self.transport.open()
            if self.settings.migrate_at_start:
                applied = await self.transport.migrate()
                if applied:
                    log.info("applied migrations: %s", ", ".join(applied))
            if self.settings.sync_topology and (self.topics or self.subscriptions):
                await self.transport.sync_topology(list(self.topics.values()), list(self.subscriptions.values()))
                if self._jobs is not None:
                    self._jobs.mark_synced()
        except BaseException:
            kernel.opened = 0
            with contextlib.suppress(Exception):
                await self.transport.close()
            raise

    async def close(self) -> None:
        """Stops the host if it runs and closes the transport."""
        kernel = self._kernel
        if kernel.opened == 0:
            return
        kernel.opened -= 1
        if kernel.opened > 0:
            return
        kernel.ended = True
        await self._stop_host()
        if self._jobs is not None:
            await self._jobs.drain_events()
        transport = kernel.built_transport
        if transport is not None:
            await transport.close()  # first: a transport may use the sessions' engine (the aws outbox relay)
        await self._sessions.dispose()

    @contextlib.asynccontextmanager
    async def operator_transport(self) -> AsyncIterator[Transport]:
        """The queue's transport opened for an operator's calls (``workqueue stats --app ...``):
        every transport its topics name (aws too), without a host, the aws outbox relay, a
        migration or a topology sync. Closed again, with the queue's engine, on the way out."""
        if self._kernel.is_open:
            yield self.transport
            return
        if self._kernel.built_transport is None and self.settings.aws_relay:
            self.settings = self.settings.model_copy(update={"aws_relay": False})
        transport = self.transport
        await transport.open()
        try:
            yield transport
        finally:
            try:
                await transport.close()
            finally:
                await self._sessions.dispose()

    async def migrate(self) -> list[str]:
        """Applies pending schema migrations; returns those applied now."""
        if self._kernel.is_open:
            return await self.transport.migrate()
        await self.transport.open()
        try:
            return await self.transport.migrate()
        finally:
            await self.transport.close()

    # -- host --------------------------------------------------------------------------------

    def build_host(
        self,
        plan: Sequence[SubscriptionPlan] | None = None,
        *,
        groups: Sequence[GroupPlan] | None = None,
        max_deliveries: int | None = None,
        stop_when_idle: bool = False,
        **option_overrides: Any,
    ) -> Host:
        """A host for this queue's handlers (the lifespan builds one from the settings).

        ``groups`` default to one consumer for the job queues (``WORKQUEUE_JOB_QUEUES``) when the
        queue has jobs."""
        return self._kernel.build_host(
            plan, groups=groups if groups is not None else self._job_groups(), max_deliveries=max_deliveries,
            stop_when_idle=stop_when_idle, **option_overrides,
        )

    def _job_groups(self) -> list[GroupPlan]:
        """The consumer of the job queues the settings plan, when the queue declares jobs."""
        return [] if self._jobs is None else self._jobs.groups()

    async def _start_host(self) -> Host:
        """Starts this process's host (the lifespan does, unless the host is off here); returns it."""
        kernel = self._kernel
        if kernel.host is None:
            if self._job_groups():
                # The app's own host takes the job queues under the same rule as `workqueue work`.
                from .jobs.worker import check_fits_lease, parse_queues

                check_fits_lease(self.jobs, parse_queues(self.settings.job_queues),
                                 self.settings.shutdown_drain_ms / 1000,
                                 stop_timeout_name="WORKQUEUE_SHUTDOWN_DRAIN_MS")
            host = kernel.host = self.build_host()
            await host.start()
            if host.reconciled:  # (else the store's subscriptions are not known: health says why)
                for problem in unused_handlers(self.handlers.keys(), host.stored_handler_keys):
                    log.warning("%s", problem)
            if self._jobs is not None:
                self._jobs.schedules.start()
                if self._job_groups():
                    self._jobs.watch_queues(host, self.settings.job_queues)
                    await self._warn_of_unknown_queues()
        return kernel.host

    async def _warn_of_unknown_queues(self) -> None:
        """Warns of a job queue that ``WORKQUEUE_JOB_QUEUES`` names and nothing uses (a misspelling:
        the host would wait on it for nothing)."""
        from .jobs.worker import parse_queues, unknown_queues

        try:
            unknown = await unknown_queues(self.jobs, parse_queues(self.settings.job_queues), self.transport)
        except TransportError:
            return  # (the host reports the store's trouble itself)
        if unknown:
            declared = sorted(self.jobs.registry.queues())
            log.warning("WORKQUEUE_JOB_QUEUES names job queue(s) %s that no job declares and the store does not hold; "
                        "the app's job queues are %s", ", ".join(map(repr, unknown)), ", ".join(declared))

    def _takes_dependencies(self) -> bool:
        """Whether a handler or a job of this queue takes dependencies (an app's overrides apply)."""
        if any(spec.other_params for spec in self._kernel.handlers.specs()):
            return True
        return self._jobs is not None and any(job.dependency_params for job in self._jobs.registry)

    async def _stop_host(self) -> None:
        """Stops the host, its job watchers and schedules, if they run."""
        host, self._kernel.host = self._kernel.host, None
        if self._jobs is not None:
            await self._jobs.stop_watching()
            await self._jobs.schedules.stop()
        if host is not None:
            await host.stop()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any = None) -> AsyncIterator[dict[str, Any]]:
        """The app's lifespan: ``FastAPI(lifespan=queue.lifespan)``, or ``async with queue.lifespan(app):``.

        Entered without an app (``async with queue.lifespan():``, as a test may), the handlers and
        jobs that take dependencies see the one app alive in the process that serves this queue
        (its lifespan is the queue's, or it includes the queue's routers), with its
        ``dependency_overrides`` and ``state``; when there is none, or several, none."""
        if app is None and self._takes_dependencies():
            from .web.serving_apps import apps_of

            found = apps_of(self)
            if len(found) == 1:
                app = found[0]
                log.debug("queue.lifespan() without an app: dependencies see the app that serves the queue")
        self.bind_app(app)
        await self.open()
        try:
            off = self._kernel.host_off_reason()
            if off is None:
                await self._start_host()
            elif not worker_runs_host():  # `workqueue work` runs a host of its own: nothing is off
                log.info("work queue host is off in this process: %s", off)
            yield {"workqueue": self}
        finally:
            await self.close()

    def health(self) -> ExtensionHealth:
        """The state of the host and of every subscription it plans."""
        return self._kernel.health()

    # -- publish -----------------------------------------------------------------------------

    async def publish(
        self,
        topic: str,
        requests: Sequence[PublishRequest | Mapping[str, Any]],
        *,
        session: Session | None = None,
    ) -> PublishResults:
        """Publishes ``requests`` to ``topic``; one result per request, in order.

        With ``session`` (an ``AsyncSession`` or ``AsyncConnection``), the publish joins that
        transaction: a rollback publishes nothing. Inside a request that uses :attr:`session`, it
        joins the request's transaction while that is open, from the request's own task; a task
        the request spawned, a background task or a cleanup after the response publishes in a
        transaction of its own. Otherwise it commits on its own before answering. A call is
        all-or-nothing: when any request is refused, none is published and the others report
        ``BatchAborted``; each refusal is also logged at WARNING, and
        ``results.raise_for_errors()`` turns them into :class:`PublishFailed`.

        Raises :class:`UnknownTopic` when neither the code nor the store knows ``topic``.
        """
        return await self._kernel.publish(topic, requests, session=session)

    # -- operate -----------------------------------------------------------------------------

    async def sweep(self, limit: int = 1000) -> SweepReport:
        """Runs one sweeper pass now (lease expiry and retention)."""
        return await self._kernel.operator.sweep(limit)

    async def stats(self, subscription: str | None = None) -> list[SubscriptionStats]:
        """Counts by state of every subscription, or of ``subscription`` (``workqueue stats``)."""
        return await self._kernel.operator.stats(subscription)

    async def backlog(self, subscription: str) -> Backlog | None:
        """Claimable Pending (one per key where keys run one at a time) plus InFlight, as a scaler
        sees it; None when ``subscription`` does not exist."""
        return await self._kernel.operator.backlog(subscription)

    async def dead_letters(
        self, subscription: str, *, limit: int = 100, after: str | None = None, include_payload: bool = False
    ) -> list[DeliveryInfo]:
        """The dead letters of ``subscription``, ``limit`` at a time: pass the last
        ``delivery_id`` as ``after`` for the next. ``include_payload`` adds the payloads."""
        return await self._kernel.operator.dead_letters(subscription, limit=limit, after=after,
                                                        include_payload=include_payload)

    async def deliveries(
        self, subscription: str, status: DeliveryStatus, *, limit: int = 100, after: str | None = None,
        include_payload: bool = False,
    ) -> list[DeliveryInfo]:
        """The deliveries of ``subscription`` in ``status`` (``Pending``, ``InFlight``,
        ``Completed``, ``DeadLettered``, ``Discarded``), paged as :meth:`dead_letters`."""
        return await self._kernel.operator.deliveries(subscription, status, limit=limit, after=after,
                                                      include_payload=include_payload)

    async def get_delivery(self, delivery_id: str, *, include_payload: bool = False) -> DeliveryInfo | None:
        """One delivery whole (state, attempts, lease, progress, last error), or None."""
        return await self._kernel.operator.get_delivery(delivery_id, include_payload=include_payload)

    async def partitions(
        self, subscription: str, condition: PartitionCondition | None = None, *, limit: int = 100
    ) -> list[PartitionInfo]:
        """The partition keys of ``subscription`` with live work: their head and how many wait
        behind it; ``condition`` keeps the ``Blocked``, ``InFlight`` or ``Idle`` ones."""
        return await self._kernel.operator.partitions(subscription, condition, limit=limit)

    async def replay(self, subscription: str, delivery_id: str, note: str | None = None) -> ActionResult:
        """DeadLettered → Pending, same MessageID and Ordered position, attempts reset."""
        return await self._kernel.operator.replay(subscription, delivery_id, note)

    async def discard(self, subscription: str, delivery_id: str, reason: str | None = None) -> ActionResult:
        """Pending/DeadLettered → Discarded; InFlight → cancel requested (Discarded when it returns)."""
        return await self._kernel.operator.discard(subscription, delivery_id, reason)

    async def validate_bindings(self) -> BindingReport:
        """Checks the store: schema version, capabilities, what the transport leaves out."""
        return await self._kernel.operator.validate_bindings()

    async def set_status(self, subscription: str, status: SubscriptionStatus) -> bool | None:
        """Pauses or resumes a subscription (None when it does not exist)."""
        return await self._kernel.operator.set_status(subscription, status)

    async def pause(self, subscription: str) -> bool | None:
        """Stops claiming on ``subscription`` (its deliveries still arrive and wait); True when it
        changed, False when it was paused already, None when it does not exist."""
        return await self._kernel.operator.pause(subscription)

    async def resume(self, subscription: str) -> bool | None:
        """Claims on ``subscription`` again after :meth:`pause`, or takes it back after
        :meth:`retire`; answers as :meth:`pause` does."""
        return await self._kernel.operator.resume(subscription)

    async def retire(self, subscription: str, *, discard_pending: bool = False,
                     reason: str | None = None) -> RetireResult:
        """Retires a subscription removed from the code: publish gives it no new delivery from now
        on, what it holds drains in processes that still have its handler (or, with
        ``discard_pending=True``, its Pending deliveries are discarded with ``reason``), and its
        counts stay readable. :meth:`resume` takes it back; ``workqueue subscriptions delete``
        removes it once it is empty. Raises :class:`ConfigurationError` when it does not exist."""
        return await self._kernel.operator.retire(subscription, discard_pending=discard_pending, reason=reason)

    async def delete_subscription(self, subscription: str) -> DeleteResult:
        """Deletes a retired subscription that holds nothing Pending, InFlight or DeadLettered, with
        its ended deliveries and counts; otherwise answers why not (``result``, ``remaining``)."""
        return await self._kernel.operator.delete_subscription(subscription)

    async def set_topic_status(self, topic: str, status: TopicStatus) -> TopicStatusChange:
        """Retires (``Retired``: it refuses new messages, its subscriptions drain), pauses or takes
        back (``Active``) a topic. Raises :class:`ConfigurationError` when it does not exist."""
        return await self._kernel.operator.set_topic_status(topic, status)

    async def delete_topic(self, topic: str) -> DeleteResult:
        """Deletes a retired topic that no subscription names any more; otherwise answers why not."""
        return await self._kernel.operator.delete_topic(topic)
