"""WorkQueue: the one object an app creates. Topology, handlers, publish, lifespan, routers."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from fastapi import APIRouter, Depends
from pydantic import ValidationError

from .core.envelope import (
    MAX_ENVELOPE_BYTES,
    PreparedMessage,
    PublishError,
    PublishRequest,
    PublishResult,
    PublishStatus,
    RequestRejected,
    aborted_results,
    prepare,
)
from .core.errors import ConfigurationError, UnknownTopic
from .core.handlers import HandlerFunc, HandlerRegistry, HandlerSpec, unused_handlers
from .core.host import GroupPlan, Host, SubscriptionPlan
from .core.observe import NO_OBSERVER, Observer, Observers, carry_headers
from .core.ports import Ports
from .core.published import NOT_ACCEPTED_LOGGED, PublishResults, refusal
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
from .core.retirement import (
    DISCARD_BATCH,
    DeleteResult,
    RetireResult,
    TopicStatus,
    TopicStatusChange,
    TopologyLifecycle,
)
from .core.topology import Subscription, SubscriptionStatus, Topic
from .core.transport import Transport
from .settings import WorkQueueSettings, default_database_file, unknown_variables
from .web.auth import Authorizer, api_key_authorizer
from .web.di import DependencyInvoker
from .web.health import ExtensionHealth, build_health_router
from .web.routes import DEFAULT_MAX_BATCH, DEFAULT_MAX_BODY_BYTES, build_router
from .web.session import RequestSessions, current_session

log = redacting_logger("fastapi_workqueue")

if TYPE_CHECKING:
    from datetime import timedelta

    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
    from starlette.types import ASGIApp

    from .jobs.definition import Job
    from .jobs.events import E
    from .jobs.failed import FailedJob
    from .jobs.fake import JobFake
    from .jobs.layer import Jobs
    from .jobs.middleware import Middleware
    from .jobs.schedules import Schedule

    JobRef = Job | str | Callable[..., Any]
    """A job as dispatch and schedule take it: its function, its :class:`Job`, or its name."""

F = TypeVar("F", bound=HandlerFunc)

_warned_variables: set[str] = set()
"""Unknown ``WORKQUEUE_*`` variables already warned about in this process (once each)."""

_worker_runs_host: ContextVar[bool] = ContextVar("workqueue_worker_runs_host", default=False)


@contextlib.contextmanager
def host_run_by_worker() -> Iterator[None]:
    """Within it, app lifespans (``queue.lifespan``) open their queues but start no host.

    ``workqueue work --app module:app`` runs the app's lifespan inside it: the worker's own host
    (one subscription, its concurrency and budget) is the only one that runs in the process.
    """
    token = _worker_runs_host.set(True)
    try:
        yield
    finally:
        _worker_runs_host.reset(token)


def _lifecycle_of(transport: Transport, what: str) -> TopologyLifecycle:
    """The store that retires and deletes ``what`` (database transports do)."""
    lifecycle = Ports.of(transport).lifecycle
    if lifecycle is not None:
        return lifecycle
    raise ConfigurationError(
        f"{what} lives on the {transport.name} transport, which cannot retire or delete it here; remove it from "
        "the exported manifest and the infrastructure instead"
    )


def _checked(topic: str, results: list[PublishResult]) -> PublishResults:
    """A publish's results, with its refusals logged at WARNING; raises UnknownTopic when the
    store did not know the topic."""
    answer = results if isinstance(results, PublishResults) else PublishResults(results)
    for index, result in enumerate(answer):
        if result.status in NOT_ACCEPTED_LOGGED:
            error = result.error
            code = error.code if error is not None else result.status.value
            if code == "UnknownTopic":
                raise UnknownTopic(topic, f"cannot publish to topic {topic!r}: neither the code declares it "
                                          f"(Topic(name={topic!r})) nor the store holds it; check the name")
            if code != "BatchAborted":
                log.warning("publish to %s: item %d was %s (%s): %s", topic, index, result.status.value, code,
                            refusal(result))
    return answer


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
        self.settings = settings if settings is not None else WorkQueueSettings()
        """The settings the queue was made with (read from ``WORKQUEUE_*`` when none were given)."""
        self.topics: dict[str, Topic] = {}
        """The topics declared in code, by name."""
        self.subscriptions: dict[str, Subscription] = {}
        """The subscriptions declared in code, by name."""
        for topic in topics:
            self.add_topic(topic)
        for subscription in subscriptions:
            self.add_subscription(subscription)
        self.handlers = HandlerRegistry()
        self._invoker = DependencyInvoker()
        self._transport = transport
        self._ports: Ports | None = None
        self._owns_transport = transport is None
        self._host: Host | None = None
        self._opened = 0
        self.request_load = RequestLoad()
        """The requests this process serves (those holding ``queue.session``), which its host yields to."""
        self._sessions = RequestSessions(self._database_url, lambda: self.settings.session_pool(),
                                         load=self.request_load)
        self.health_router: APIRouter = build_health_router(self)
        """``GET /health/extensions``: the state of the host and of each subscription it plans, 503
        when one is ``HandlerNotRegistered`` or in ``Error``. ``app.include_router(queue.health_router)``."""
        self._router: APIRouter | None = None
        self._jobs: Jobs | None = None
        self._observers: list[Observer] = []
        self._observer: Observer | None = None
        self._metrics_router: APIRouter | None = None

    # -- routers -----------------------------------------------------------------------------

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
        check = authorize or api_key_authorizer(self)
        router = build_router(self, check, prefix=prefix, max_body_bytes=max_body_bytes, max_batch=max_batch)
        from .jobs.routes import build_job_router

        router.include_router(build_job_router(self, check, prefix=""))
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

        return build_metrics_router(
            self, authorize=authorize or api_key_authorizer(self),
            public=self.settings.metrics_public if public is None else public, path=path, registry=registry,
        )

    @property
    def observer(self) -> Observer:
        """What sees this queue's publishes, attempts and settles: OpenTelemetry and Prometheus
        when they are installed and enabled in the settings, and any :meth:`add_observer`."""
        if self._observer is None:
            from .observability import default_observers

            found = default_observers(self.settings) + self._observers
            self._observer = NO_OBSERVER if not found else found[0] if len(found) == 1 else Observers(found)
        return self._observer

    def add_observer(self, observer: Observer) -> None:
        """Adds an observer of your own (subclass :class:`~fastapi_workqueue.core.observe.Observer`)."""
        self._observers.append(observer)
        self._observer = None

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
        if topic.name in self.topics and self.topics[topic.name] != topic:
            raise ConfigurationError(f"topic {topic.name!r} is declared twice with different settings")
        self.topics[topic.name] = topic

    def add_subscription(self, subscription: Subscription) -> None:
        """Declares a subscription (synced to the store at start-up)."""
        if subscription.name in self.subscriptions and self.subscriptions[subscription.name] != subscription:
            raise ConfigurationError(
                f"subscription {subscription.name!r} is declared twice with different settings"
            )
        if subscription.topic not in self.topics:
            raise ConfigurationError(
                f"subscription {subscription.name!r} names topic {subscription.topic!r}, which is not declared; "
                f"add Topic(name={subscription.topic!r}) to the WorkQueue's topics"
            )
        self.subscriptions[subscription.name] = subscription

    def handler(self, key: str) -> Callable[[F], F]:
        """Registers an async handler under ``key``; subscriptions name the key.

        The handler takes ``message: WorkMessage[Payload]``, optionally ``context: WorkContext``,
        and any FastAPI dependencies (``Depends``), resolved per attempt.
        """

        def register(func: F) -> F:
            spec = self.handlers.add(key, func)
            try:
                self._invoker.prepare(spec)
            except ConfigurationError:
                self.handlers.remove(key)
                raise
            return func

        return register

    def resolve_handler(self, key: str) -> HandlerSpec | None:
        """The handler registered under ``key``, or None (for the host and the jobs layer)."""
        return self.handlers.get(key)

    def app_needed_by(self, key: str) -> str | None:
        """Where the handler of ``key`` takes a ``Request`` or ``HTTPConnection`` in its dependency
        graph (``"handler 'k' -> get_settings -> request"``), or None. Such a handler reads
        ``request.app`` and needs to run with the app (``workqueue work --app module:app``)."""
        spec = self.handlers.get(key)
        return self._invoker.app_needed_by_key(key) if spec is None else self._invoker.app_needed_by(spec)

    def prepare_dependencies(self, key: str, func: Callable[..., Any], params: Sequence[str]) -> None:
        """Builds and checks the dependency graph of ``func``'s ``params`` (a job's, say) under ``key``."""
        self._invoker.prepare_call(key, func, list(params))

    async def call_with_dependencies(
        self, key: str, func: Callable[..., Any], fixed: Mapping[str, Any], message: Any, context: Any
    ) -> Any:
        """Calls ``func`` with ``fixed`` arguments and its dependencies solved for this attempt."""
        return await self._invoker.call(key, func, dict(fixed), message, context)

    def bind_app(self, app: ASGIApp | None) -> None:
        """The app whose ``state`` and ``dependency_overrides`` handlers see (``lifespan`` binds it)."""
        self._invoker.app = app

    @property
    def bound_app(self) -> ASGIApp | None:
        """The app :meth:`bind_app` (or the lifespan) bound, or None."""
        app: ASGIApp | None = self._invoker.app
        return app

    # -- jobs --------------------------------------------------------------------------------

    @property
    def jobs(self) -> Jobs:
        """The jobs layer (:class:`fastapi_workqueue.jobs.layer.Jobs`), made on first use."""
        if self._jobs is None:
            from .jobs.layer import Jobs

            self._jobs = Jobs(self)
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
        priority: int = 0,
        rate_limit: str | None = None,
        concurrency: int | None = None,
    ) -> Callable[[F], F]:
        """Declares a job: ``@queue.job("billing.send-invoice-reminder", tries=5, backoff=[10, 60, 300],
        timeout=30, queue="mail")`` on ``async def send(payload: Model, job: JobContext, dep = Depends(...))``.

        ``tries`` attempts in all; ``backoff`` the delay after failed attempt n (item n, the last
        repeating; default the queue's exponential full-jitter backoff); ``timeout`` seconds after
        which ``job.signal`` aborts and the attempt fails; ``encrypted`` stores the payload encrypted
        with ``WORKQUEUE_APP_KEY``; ``middleware`` runs around each attempt. ``priority`` (0 to 9,
        higher first) is what its jobs are dispatched with unless a dispatch says otherwise.
        ``concurrency`` and ``rate_limit`` (``"50/s"``) are its queue's limits, held across every
        process: the most jobs of the queue running at once, and started per second, minute or hour.
        """
        decorate: Callable[[F], F] = self.jobs.declare(
            name, tries=tries, backoff=backoff, timeout=timeout, queue=queue, encrypted=encrypted,
            middleware=middleware, priority=priority, rate_limit=rate_limit, concurrency=concurrency,
        )
        return decorate

    @overload
    async def dispatch(
        self, job: JobRef, payload: Any = None, *, delay: timedelta | float | None = None, queue: str | None = None,
        unique: None = None, unique_until: Literal["done", "processing"] = "done", unique_for: float = 3600,
        session: Any = None, priority: int | None = None,
    ) -> uuid.UUID: ...

    @overload
    async def dispatch(
        self, job: JobRef, payload: Any = None, *, delay: timedelta | float | None = None, queue: str | None = None,
        unique: str | None, unique_until: Literal["done", "processing"] = "done", unique_for: float = 3600,
        session: Any = None, priority: int | None = None,
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
        session: Any = None,
        priority: int | None = None,
    ) -> uuid.UUID | None:
        """Validates ``payload`` and queues ``job``; returns the job id (None while ``unique`` is held).

        Joins ``session``'s transaction, or the request's (``queue.session``): a rollback queues
        nothing. ``delay`` is a ``timedelta`` or seconds; ``queue`` overrides the declared queue;
        ``priority`` (0 to 9, higher first) the declared priority.
        """
        result: uuid.UUID | None = await self.jobs.dispatch(
            job, payload, delay=delay, queue=queue, unique=unique, unique_until=unique_until, unique_for=unique_for,
            session=session, priority=priority,
        )
        return result

    async def bulk(self, items: Iterable[tuple[Any, ...]], *, session: Any = None) -> list[uuid.UUID]:
        """Queues ``[(job, payload), ...]`` in one transaction; one invalid payload queues none."""
        ids: list[uuid.UUID] = await self.jobs.bulk(items, session=session)
        return ids

    async def chain(self, items: Iterable[tuple[Any, ...]], *, session: Any = None) -> list[uuid.UUID]:
        """Queues jobs that run one after the other; returns all their ids."""
        ids: list[uuid.UUID] = await self.jobs.chain(items, session=session)
        return ids

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

    async def failed_jobs(self, queue: str | None = None, *, limit: int = 100,
                          include_payload: bool = False) -> list[FailedJob]:
        """Jobs that failed for good (the job queues' dead letters), with their redacted error."""
        failed: list[FailedJob] = await self.jobs.failed.list(queue, limit=limit, include_payload=include_payload)
        return failed

    async def retry_job(self, job_id: uuid.UUID | str, note: str | None = None) -> ActionResult:
        """Queues a failed job again, with the same id and its tries counted afresh."""
        result: ActionResult = await self.jobs.failed.retry(uuid.UUID(str(job_id)), note)
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

    def _database_url(self) -> str:
        url = self.settings.database_url
        if not url:
            raise ConfigurationError(
                "no database is configured: set WORKQUEUE_DATABASE_URL (for example "
                "postgresql+asyncpg://postgres@127.0.0.1:5432/app or sqlite+aiosqlite:///app.db) or "
                "WorkQueueSettings(database_url=...)"
            )
        return url

    @property
    def transport(self) -> Transport:
        """The transport messages live on (created from the settings on first use)."""
        if self._transport is None:
            from .core.routing import build_routing
            from .database import create_database_transport

            database: Transport | None = None
            only_other = bool(self.topics) and all(t.transport != "database" for t in self.topics.values())
            if self.settings.database_url or not only_other:
                database = create_database_transport(
                    self._database_url(), pool_max_size=self.settings.pool_size, listen=self.settings.listen,
                    sqlite_busy_timeout_ms=self.settings.sqlite_busy_timeout_ms,
                )
            routed = build_routing(self, database, list(self.topics.values()), list(self.subscriptions.values()))
            self._transport = routed if routed is not None else database
            assert self._transport is not None
        return self._transport

    @property
    def ports(self) -> Ports:
        """The transport's optional parts (process registry, live work, API keys ...), resolved
        once for the transport in use."""
        transport = self.transport
        if self._ports is None or self._ports.transport is not transport:
            self._ports = Ports.of(transport)
        return self._ports

    @property
    def is_open(self) -> bool:
        """True between :meth:`open` and :meth:`close` (inside the lifespan)."""
        return self._opened > 0

    @property
    def host(self) -> Host | None:
        """The running host, when this process runs one."""
        return self._host

    @property
    def engine(self) -> AsyncEngine:
        """A SQLAlchemy ``AsyncEngine`` on the queue's database, for the app's own tables."""
        return self._sessions.engine

    @property
    def sessionmaker(self) -> async_sessionmaker[AsyncSession]:
        """An ``async_sessionmaker`` on :attr:`engine`."""
        return self._sessions.sessionmaker

    @property
    def session(self) -> AsyncSession:
        """A dependency: a session in a transaction per request, committed before the response.

        ``async def endpoint(session: AsyncSession = queue.session)``. Publishes made during the
        request join its transaction; an exception rolls both back.
        """
        dependency: AsyncSession = Depends(self._sessions.dependency, scope="function")
        return dependency

    async def open(self) -> None:
        """Opens the transport (and migrates / syncs the topology as the settings say)."""
        self._opened += 1
        if self._opened > 1:
            return
        try:
            if self._jobs is not None:
                self._jobs.check()
            for problem in unknown_variables():
                if problem not in _warned_variables:
                    _warned_variables.add(problem)
                    log.warning("%s", problem)
            if self.settings.uses_default_database:
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
            self._opened = 0
            with contextlib.suppress(Exception):
                await self.transport.close()
            raise

    async def close(self) -> None:
        """Stops the host if it runs and closes the transport."""
        if self._opened == 0:
            return
        self._opened -= 1
        if self._opened > 0:
            return
        await self._stop_host()
        if self._jobs is not None:
            await self._jobs.drain_events()
        if self._transport is not None:
            await self._transport.close()  # first: a transport may use the sessions' engine (the aws outbox relay)
        await self._sessions.dispose()

    @contextlib.asynccontextmanager
    async def operator_transport(self) -> AsyncIterator[Transport]:
        """The queue's transport opened for an operator's calls (``workqueue stats --app ...``):
        every transport its topics name (aws too), without a host, the aws outbox relay, a
        migration or a topology sync. Closed again, with the queue's engine, on the way out."""
        if self._opened:
            yield self.transport
            return
        if self._transport is None and self.settings.aws_relay:
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
        if self._opened:
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
        options = self.settings.host_options()
        option_overrides.setdefault("observer", self.observer)
        self.request_load.busy_at = self.settings.busy_requests
        self.request_load.busy_concurrency = self.settings.busy_concurrency
        option_overrides.setdefault("request_load", self.request_load)
        if option_overrides:
            from dataclasses import replace

            options = replace(options, **option_overrides)
        return Host(
            self.transport,
            self.resolve_handler,
            self._invoker,
            plan=plan if plan is not None else self.settings.subscriptions,
            groups=groups if groups is not None else self.job_groups(),
            options=options,
            max_deliveries=max_deliveries,
            stop_when_idle=stop_when_idle,
            declared=self.subscriptions.keys(),
        )

    def job_groups(self, queues: str | None = None, concurrency: int | None = None) -> list[GroupPlan]:
        """The consumer of the job queues: ``queues`` (``mail,*``; default ``WORKQUEUE_JOB_QUEUES``,
        unset: every queue fairly) at ``concurrency`` (default ``WORKQUEUE_JOB_CONCURRENCY``)."""
        if self._jobs is None or not len(self._jobs.registry):
            return []
        from .jobs.worker import job_group

        return [job_group(queues if queues is not None else self.settings.job_queues,
                          concurrency or self.settings.job_concurrency)]

    async def _start_host(self) -> Host:
        """Starts this process's host (the lifespan does, unless the host is off here); returns it."""
        if self._host is None:
            if self.job_groups():
                # The app's own host takes the job queues under the same rule as `workqueue work`.
                from .jobs.worker import check_fits_lease, parse_queues

                check_fits_lease(self.jobs, parse_queues(self.settings.job_queues),
                                 self.settings.shutdown_drain_ms / 1000,
                                 stop_timeout_name="WORKQUEUE_SHUTDOWN_DRAIN_MS")
            self._host = self.build_host()
            await self._host.start()
            for problem in unused_handlers(self.handlers.keys(), self._host.stored_handler_keys):
                log.warning("%s", problem)
            if self._jobs is not None:
                self._jobs.schedules.start()
                if self.job_groups():
                    self._jobs.watch_queues(self._host, self.settings.job_queues)
        return self._host

    async def _stop_host(self) -> None:
        """Stops the host, its job watchers and schedules, if they run."""
        host, self._host = self._host, None
        if self._jobs is not None:
            await self._jobs.stop_watching()
            await self._jobs.schedules.stop()
        if host is not None:
            await host.stop()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any = None) -> AsyncIterator[dict[str, Any]]:
        """The app's lifespan: ``FastAPI(lifespan=queue.lifespan)``, or ``async with queue.lifespan(app):``."""
        self.bind_app(app)
        await self.open()
        try:
            off = self._host_off_reason()
            if off is None:
                await self._start_host()
            elif not _worker_runs_host.get():  # `workqueue work` runs a host of its own: nothing is off
                log.info("work queue host is off in this process: %s", off)
            yield {"workqueue": self}
        finally:
            await self.close()

    def _host_off_reason(self) -> str | None:
        """Why the lifespan starts no host in this process, or None when it starts one.

        The settings' ``enabled`` and ``disable_host`` (``WORKQUEUE_ENABLED=0``,
        ``WORKQUEUE_DISABLE_HOST=1``, read when the settings were made) are two switches for one
        thing: either one turns the host off, whatever the other says."""
        if _worker_runs_host.get():
            return "workqueue work runs its own host here"
        if not self.settings.enabled:
            return "WORKQUEUE_ENABLED is off (enabled=False)"
        if self.settings.disable_host:
            return "WORKQUEUE_DISABLE_HOST is on (disable_host=True)"
        return None

    def health(self) -> ExtensionHealth:
        """The state of the host and of every subscription it plans."""
        if self._opened == 0:
            return ExtensionHealth(status="Stopped", reason="the app's lifespan has not started the queue")
        if self._host is None:
            off = self._host_off_reason() or "the host is not started"
            return ExtensionHealth(status="Disabled", reason=f"the host is off in this process: {off}")
        subscriptions = self._host.health()
        degraded = any(s.state == "Error" for s in subscriptions)
        return ExtensionHealth(status="Degraded" if degraded else "Running", subscriptions=subscriptions)

    # -- publish -----------------------------------------------------------------------------

    async def publish(
        self,
        topic: str,
        requests: Sequence[PublishRequest | Mapping[str, Any]],
        *,
        session: Any = None,
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
        cap = self.envelope_cap(topic)
        attempts = self.settings.max_message_attempts
        prepared: list[PreparedMessage] = []
        failures: dict[int, PublishResult] = {}
        for index, raw in enumerate(requests):
            try:
                request = raw if isinstance(raw, PublishRequest) else PublishRequest.model_validate(raw)
                prepared.append(prepare(request, max_envelope_bytes=cap, max_attempts=attempts))
            except RequestRejected as exc:
                failures[index] = PublishResult(
                    status=PublishStatus.REJECTED,
                    message_id=getattr(raw, "message_id", None),
                    error=exc.error,
                )
            except ValidationError as exc:
                first = exc.errors()[0]
                failures[index] = PublishResult(
                    status=PublishStatus.REJECTED,
                    error=PublishError(
                        code="InvalidRequest",
                        message=f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}",
                        field=str(first["loc"][0]) if first["loc"] else None,
                    ),
                )
        return await self.publish_prepared(topic, len(requests), prepared, failures, session=session)

    def envelope_cap(self, topic: str) -> int:
        """The most bytes an envelope on ``topic`` may have (a topic may lower the library's limit)."""
        declared = self.topics.get(topic)
        if declared is not None and declared.max_payload_bytes is not None:
            return min(MAX_ENVELOPE_BYTES, declared.max_payload_bytes)
        return MAX_ENVELOPE_BYTES

    async def publish_prepared(
        self, topic: str, count: int, prepared: list[PreparedMessage], failures: dict[int, PublishResult], *,
        session: Any = None,
    ) -> PublishResults:
        """The second half of :meth:`publish`, for ``count`` requests already prepared: ``prepared``
        those that passed, ``failures`` the results of those refused, by index (then none is
        published). For layers that prepare their messages themselves (the jobs layer)."""
        if session is None:
            session = current_session()
        observer = self.observer
        single = prepared[0] if len(prepared) == 1 else None
        scope = None if observer is NO_OBSERVER else observer.publish_started(
            topic, count, message_id=str(single.message_id) if single is not None else None,
            correlation_id=single.correlation_id if single is not None else None,
        )
        if failures:
            results = aborted_results(count, failures)
            if scope is not None:
                scope.end(results, None)
            return _checked(topic, results)
        if scope is None:
            return _checked(topic, await self.transport.publish(topic, prepared, session=session))
        headers = scope.headers()
        if headers:
            for message in prepared:
                carry_headers(message, headers)
        try:
            results = await self.transport.publish(topic, prepared, session=session)
        except BaseException as exc:
            scope.end(None, exc)
            raise
        scope.end(results, None)
        return _checked(topic, results)

    # -- operate -----------------------------------------------------------------------------

    async def sweep(self, limit: int = 1000) -> SweepReport:
        """Runs one sweeper pass now (lease expiry and retention)."""
        return await self.transport.sweep(limit)

    async def stats(self, subscription: str | None = None) -> list[SubscriptionStats]:
        """Counts by state of every subscription, or of ``subscription`` (``workqueue stats``)."""
        return await self.transport.stats(subscription)

    async def backlog(self, subscription: str) -> Backlog | None:
        """Claimable Pending (one per key where keys run one at a time) plus InFlight, as a scaler
        sees it; None when ``subscription`` does not exist."""
        return await self.transport.backlog(subscription)

    async def dead_letters(
        self, subscription: str, *, limit: int = 100, after: str | None = None, include_payload: bool = False
    ) -> list[DeliveryInfo]:
        """The dead letters of ``subscription``, ``limit`` at a time: pass the last
        ``delivery_id`` as ``after`` for the next. ``include_payload`` adds the payloads."""
        return await self.transport.list_deliveries(
            subscription, "DeadLettered", limit=limit, after=after, include_payload=include_payload
        )

    async def deliveries(
        self, subscription: str, status: DeliveryStatus, *, limit: int = 100, after: str | None = None,
        include_payload: bool = False,
    ) -> list[DeliveryInfo]:
        """The deliveries of ``subscription`` in ``status`` (``Pending``, ``InFlight``,
        ``Completed``, ``DeadLettered``, ``Discarded``), paged as :meth:`dead_letters`."""
        return await self.transport.list_deliveries(
            subscription, status, limit=limit, after=after, include_payload=include_payload
        )

    async def get_delivery(self, delivery_id: str, *, include_payload: bool = False) -> DeliveryInfo | None:
        """One delivery whole (state, attempts, lease, progress, last error), or None."""
        return await self.transport.get_delivery(delivery_id, include_payload=include_payload)

    async def partitions(
        self, subscription: str, condition: PartitionCondition | None = None, *, limit: int = 100
    ) -> list[PartitionInfo]:
        """The partition keys of ``subscription`` with live work: their head and how many wait
        behind it; ``condition`` keeps the ``Blocked``, ``InFlight`` or ``Idle`` ones."""
        return await self.transport.partitions(subscription, condition, limit=limit)

    async def replay(self, subscription: str, delivery_id: str, note: str | None = None) -> ActionResult:
        """DeadLettered → Pending, same MessageID and Ordered position, attempts reset."""
        return await self.transport.replay(subscription, delivery_id, note)

    async def discard(self, subscription: str, delivery_id: str, reason: str | None = None) -> ActionResult:
        """Pending/DeadLettered → Discarded; InFlight → cancel requested (Discarded when it returns)."""
        return await self.transport.discard(subscription, delivery_id, reason)

    async def validate_bindings(self) -> BindingReport:
        """Checks the store: schema version, capabilities, what the transport leaves out."""
        return await self.transport.validate_bindings()

    async def set_status(self, subscription: str, status: SubscriptionStatus) -> bool | None:
        """Pauses or resumes a subscription (None when it does not exist)."""
        changed = await self.transport.set_subscription_status(subscription, status)
        if self._host is not None and changed:
            await self._host.reconcile()
        return changed

    async def pause(self, subscription: str) -> bool | None:
        """Stops claiming on ``subscription`` (its deliveries still arrive and wait); True when it
        changed, False when it was paused already, None when it does not exist."""
        return await self.set_status(subscription, "Paused")

    async def resume(self, subscription: str) -> bool | None:
        """Claims on ``subscription`` again after :meth:`pause`, or takes it back after
        :meth:`retire`; answers as :meth:`pause` does."""
        return await self.set_status(subscription, "Active")

    async def retire(self, subscription: str, *, discard_pending: bool = False,
                     reason: str | None = None) -> RetireResult:
        """Retires a subscription removed from the code: publish gives it no new delivery from now
        on, what it holds drains in processes that still have its handler (or, with
        ``discard_pending=True``, its Pending deliveries are discarded with ``reason``), and its
        counts stay readable. :meth:`resume` takes it back; ``workqueue subscriptions delete``
        removes it once it is empty. Raises :class:`ConfigurationError` when it does not exist."""
        store = _lifecycle_of(self.ports.for_subscription(subscription), f"subscription {subscription!r}")
        result = await store.retire_subscription(subscription)
        if result is None:
            raise ConfigurationError(f"subscription {subscription!r} does not exist; `workqueue subscriptions list` "
                                     "shows the stored ones")
        if discard_pending:
            why = reason or "discarded when the subscription was retired"
            discarded = 0
            while True:
                count = await store.discard_pending(subscription, why, DISCARD_BATCH)
                discarded += count
                if count < DISCARD_BATCH:
                    break
            result = result.model_copy(update={"discarded": discarded})
        if self._host is not None:
            await self._host.reconcile()
        return result

    async def delete_subscription(self, subscription: str) -> DeleteResult:
        """Deletes a retired subscription that holds nothing Pending, InFlight or DeadLettered, with
        its ended deliveries and counts; otherwise answers why not (``result``, ``remaining``)."""
        store = _lifecycle_of(self.ports.for_subscription(subscription), f"subscription {subscription!r}")
        return await store.delete_subscription(subscription)

    async def set_topic_status(self, topic: str, status: TopicStatus) -> TopicStatusChange:
        """Retires (``Retired``: it refuses new messages, its subscriptions drain), pauses or takes
        back (``Active``) a topic. Raises :class:`ConfigurationError` when it does not exist."""
        store = _lifecycle_of(self.ports.for_topic(topic), f"topic {topic!r}")
        change = await store.set_topic_status(topic, status)
        if change is None:
            raise ConfigurationError(f"topic {topic!r} does not exist; `workqueue topics list` shows the stored ones")
        if self._host is not None:
            await self._host.reconcile()
        return change

    async def delete_topic(self, topic: str) -> DeleteResult:
        """Deletes a retired topic that no subscription names any more; otherwise answers why not."""
        store = _lifecycle_of(self.ports.for_topic(topic), f"topic {topic!r}")
        return await store.delete_topic(topic)
