"""The kernel of one queue: what the library's layers receive instead of the app-facing WorkQueue.

A :class:`~fastapi_workqueue.WorkQueue` (``queue.py``) is what an app creates and holds; it wires
one :class:`Kernel` and hands it to the jobs layer, the REST API and health routers, the
dashboard, the AWS transport and the metrics. The kernel holds what they share: the settings, the
transport and its resolved ports, the topology the code declares, the handler registry, the
dependency injector, the observers, the request sessions, the host when this process runs one,
and the operator service (:class:`~.operator.Operator`).

It imports nothing above ``core``. What only a layer above can build is handed in when the queue
is wired: the database transport (``build_transport``), the default observers, the dependency
injector (``web/di.py``, behind :class:`Injector`) and the request sessions (``web/session.py``,
behind :class:`SessionSource`). SQLAlchemy's session types are named for the type checker only;
nothing here imports SQLAlchemy when it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from .envelope import (
    MAX_ENVELOPE_BYTES,
    PreparedMessage,
    PublishRequest,
    PublishResult,
    PublishStatus,
    RequestRejected,
    WorkMessage,
    aborted_results,
    named_as_given,
    prepare,
)
from .errors import ConfigurationError, SchemaMissing, UnknownTopic
from .handlers import HandlerFunc, HandlerRegistry, HandlerSpec
from .health import ExtensionHealth
from .host import GroupPlan, Host, SubscriptionHealth, SubscriptionPlan
from .observe import NO_OBSERVER, Observer, Observers, carry_headers
from .operator import Operator
from .ports import Ports, database_url_of
from .published import NOT_ACCEPTED_LOGGED, PublishResults, refusal
from .redaction import redacting_logger
from .request_load import RequestLoad
from .settings import WorkQueueSettings, default_database_file, misspelt_database_url_problem
from .topology import Subscription, Topic, is_job_topic, is_name
from .transport import Transport
from .words import count

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

    from .context import WorkContext
    from .outcomes import WorkOutcome
    from .reports import TakenBack

log = redacting_logger("fastapi_workqueue")

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


def worker_runs_host() -> bool:
    """True inside :func:`host_run_by_worker`."""
    return _worker_runs_host.get()


class Injector(Protocol):
    """Solves the FastAPI dependencies of handlers and jobs, once per attempt
    (:class:`fastapi_workqueue.web.di.DependencyInvoker`)."""

    app: Any
    """The app whose ``state`` and ``dependency_overrides`` dependencies see, or None."""

    def prepare(self, spec: HandlerSpec) -> None: ...
    def prepare_call(self, key: str, func: Callable[..., Any], params: list[str]) -> None: ...
    def app_needed_by(self, spec: HandlerSpec) -> str | None: ...
    def app_needed_by_key(self, key: str) -> str | None: ...

    async def __call__(
        self, spec: HandlerSpec, message: WorkMessage[Any], context: WorkContext
    ) -> WorkOutcome | None: ...

    async def call(
        self, key: str, func: Callable[..., Any], fixed: dict[str, Any], message: WorkMessage[Any],
        context: WorkContext,
    ) -> Any: ...


class SessionSource(Protocol):
    """The request sessions on the queue's database (:class:`fastapi_workqueue.web.session.RequestSessions`)."""

    @property
    def engine(self) -> AsyncEngine: ...

    @property
    def sessionmaker(self) -> async_sessionmaker[AsyncSession]: ...

    def current(self) -> AsyncSession | None:
        """The request's session a publish made here joins, or None (see ``web/session.py``)."""
        ...

    def resolve(self, session: Any) -> Any:
        """The transaction a publish joins: ``session`` when given (refused when it is a request's
        session whose request has ended), else :meth:`current`."""
        ...

    async def dispose(self) -> None: ...


def _no_observers(settings: WorkQueueSettings) -> list[Observer]:
    return []


class Kernel:
    """The internals of one queue that the layers share (see the module's docstring)."""

    def __init__(
        self,
        settings: WorkQueueSettings,
        *,
        injector: Injector,
        sessions: SessionSource,
        request_load: RequestLoad,
        build_transport: Callable[[Kernel], Transport],
        default_observers: Callable[[WorkQueueSettings], list[Observer]] = _no_observers,
        transport: Transport | None = None,
        facade: object = None,
    ) -> None:
        self.settings = settings
        """The settings the queue was made with (the CLI may replace them before the queue opens)."""
        self.topics: dict[str, Topic] = {}
        """The topics declared in code, by name."""
        self.subscriptions: dict[str, Subscription] = {}
        """The subscriptions declared in code, by name."""
        self.handlers = HandlerRegistry()
        """The handlers registered in code, by key."""
        self.injector = injector
        self.request_load = request_load
        """The requests this process serves (those holding ``queue.session``), which its host yields to."""
        self.sessions = sessions
        self.host: Host | None = None
        """The host this process runs, while it runs (the queue's lifespan or ``workqueue work`` sets it)."""
        self.opened = 0
        """How many ``open()`` calls no ``close()`` has ended yet."""
        self.opened_in: tuple[int, Callable[[], asyncio.AbstractEventLoop | None]] | None = None
        """The process and (a weak reference to) the event loop of the first ``open()`` still open."""
        self.ended = False
        """The queue was open in this process and has been closed since (its lifespan ended)."""
        self._said_not_open = False
        self.operator = Operator(self)
        """The operator calls (stats, dead letters, replay, pause, retire ...), written once."""
        self.facade = facade
        """The app-facing object this kernel was wired for (the WorkQueue): what an app's lifespan
        and routers refer to, for the code that looks for the app serving the queue (the jobs fake)."""
        self._build_transport = build_transport
        self._transport = transport
        self._given_url: str | None = None if transport is None else database_url_of(transport)
        """The database URL of a database transport given at construction (the request sessions open it)."""
        self._ports: Ports | None = None
        self._default_observers = default_observers
        self._observers: list[Observer] = []
        self._observer: Observer | None = None
        self.taken_back_listeners: list[Callable[[Sequence[TakenBack]], None]] = []
        """Hear the leases a sweeper pass of this process took back (the jobs layer's events for a
        job whose worker stopped): called with each pass's :attr:`SweepReport.taken_back`."""

    def leases_taken_back(self, taken_back: Sequence[TakenBack]) -> None:
        """Tells :attr:`taken_back_listeners` of the leases a sweeper pass took back; a listener's
        error is logged, never raised (the pass stands)."""
        if not taken_back:
            return
        for listener in self.taken_back_listeners:
            try:
                listener(taken_back)
            except Exception:
                log.exception("a listener of the leases the sweeper took back failed")

    # -- topology and handlers ----------------------------------------------------------------

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

    def add_handler(self, key: str, func: HandlerFunc) -> None:
        """Registers ``func`` under ``key``, its dependency graph built and checked now."""
        spec = self.handlers.add(key, func)
        try:
            self.injector.prepare(spec)
        except ConfigurationError:
            self.handlers.remove(key)
            raise

    def resolve_handler(self, key: str) -> HandlerSpec | None:
        """The handler registered under ``key``, or None (for the host and the jobs layer)."""
        return self.handlers.get(key)

    def app_needed_by(self, key: str) -> str | None:
        """Where the handler of ``key`` takes a ``Request`` or ``HTTPConnection`` in its dependency
        graph (``"handler 'k' -> get_settings -> request"``), or None."""
        spec = self.handlers.get(key)
        return self.injector.app_needed_by_key(key) if spec is None else self.injector.app_needed_by(spec)

    def prepare_dependencies(self, key: str, func: Callable[..., Any], params: Sequence[str]) -> None:
        """Builds and checks the dependency graph of ``func``'s ``params`` (a job's, say) under ``key``."""
        self.injector.prepare_call(key, func, list(params))

    async def call_with_dependencies(
        self, key: str, func: Callable[..., Any], fixed: Mapping[str, Any], message: WorkMessage[Any],
        context: WorkContext,
    ) -> Any:
        """Calls ``func`` with ``fixed`` arguments and its dependencies solved for this attempt."""
        return await self.injector.call(key, func, dict(fixed), message, context)

    def bind_app(self, app: Any) -> None:
        """The app whose ``state`` and ``dependency_overrides`` handlers see (the lifespan binds it)."""
        self.injector.app = app

    @property
    def bound_app(self) -> Any:
        """The app :meth:`bind_app` bound, or None."""
        return self.injector.app

    # -- transport ------------------------------------------------------------------------------

    def database_url(self) -> str:
        """The database URL of the settings, or of the database transport given to the queue;
        ConfigurationError saying what to set when there is none, or when the two name different
        databases (the request sessions would write where the queue does not read)."""
        url = self.settings.database_url
        given = self._given_url
        if given is not None and not self.transport.capabilities.transactional_publish:
            raise ConfigurationError(
                f"queue.session (and queue.engine, queue.sessionmaker) opens the queue's SQL database, and "
                f"the transport given to the queue ({type(self.transport).__name__}) keeps no such database: "
                "give the queue a database transport, or, in a test, an SQLite file of the test's own "
                "(WorkQueueSettings(database_url=f\"sqlite+aiosqlite:///{tmp_path / 'test.db'}\") and no "
                "transport; docs/testing.md)"
            )
        if given is not None:
            if self.settings.uses_default_database or url == given:
                return given
            raise ConfigurationError(
                "the transport given to the queue stores in one database and the settings' database_url "
                "(WORKQUEUE_DATABASE_URL) names another: the request sessions (queue.session) would write "
                "where the queue does not read. Leave database_url unset, or give the transport's URL"
            )
        if self.settings.uses_default_database and (misspelt := misspelt_database_url_problem(
            f", so the app's sessions (queue.session, queue.engine) would write to the default SQLite file "
            f"{default_database_file()}: name the variable WORKQUEUE_DATABASE_URL"
        )) is not None:  # (before the app writes its tables to a file nobody meant, as the queue's start)
            raise ConfigurationError(misspelt)
        if not url:
            empty = "WORKQUEUE_DATABASE_URL is set, but empty" if "WORKQUEUE_DATABASE_URL" in os.environ else None
            raise ConfigurationError(
                f"{empty or 'no database is configured'}: set WORKQUEUE_DATABASE_URL (for example "
                "postgresql+asyncpg://postgres@127.0.0.1:5432/app or sqlite+aiosqlite:///app.db) or "
                "WorkQueueSettings(database_url=...)"
            )
        return url

    @property
    def given_database_url(self) -> str | None:
        """The URL of the database transport given to the queue at construction, or None."""
        return self._given_url

    @property
    def transport(self) -> Transport:
        """The transport messages live on (built from the settings on first use)."""
        if self._transport is None:
            self._transport = self._build_transport(self)
        return self._transport

    @property
    def built_transport(self) -> Transport | None:
        """The transport if it was built (or given) already, else None; builds nothing."""
        return self._transport

    @property
    def ports(self) -> Ports:
        """The transport's optional parts, resolved once for the transport in use."""
        transport = self.transport
        if self._ports is None or self._ports.transport is not transport:
            self._ports = Ports.of(transport)
        return self._ports

    @property
    def is_open(self) -> bool:
        """True between the queue's ``open()`` and ``close()`` (inside the lifespan)."""
        return self.opened > 0

    # -- observers ------------------------------------------------------------------------------

    @property
    def observer(self) -> Observer:
        """What sees the queue's publishes, attempts and settles: the default observers the
        settings ask for and every :meth:`add_observer`."""
        if self._observer is None:
            found = self._default_observers(self.settings) + self._observers
            self._observer = NO_OBSERVER if not found else found[0] if len(found) == 1 else Observers(found)
        return self._observer

    def add_observer(self, observer: Observer) -> None:
        """Adds an observer of the app's own."""
        self._observers.append(observer)
        self._observer = None

    # -- publish --------------------------------------------------------------------------------

    def envelope_cap(self, topic: str) -> int:
        """The most bytes an envelope on ``topic`` may have (a topic may lower the library's limit)."""
        declared = self.topics.get(topic)
        if declared is not None and declared.max_payload_bytes is not None:
            return min(MAX_ENVELOPE_BYTES, declared.max_payload_bytes)
        return MAX_ENVELOPE_BYTES

    async def publish(
        self, topic: str, requests: Sequence[PublishRequest | Mapping[str, Any]], *, session: Any = None,
        conflict_expected: bool = False,
    ) -> PublishResults:
        """Publishes ``requests`` to ``topic``, one result per request (``WorkQueue.publish``).
        ``conflict_expected``: a MessageIDConflict is an answer the caller expects (a schedule's tick
        another process queued with other bytes), not logged as a refusal."""
        if isinstance(requests, (PublishRequest, Mapping, str, bytes)) or not isinstance(requests, Sequence):
            raise TypeError(
                f"publish takes a list of requests, got {type(requests).__name__}: "
                f"queue.publish({topic!r}, [PublishRequest(payload=...)]) (a dict per request works too)"
            )
        cap = self.envelope_cap(topic)
        attempts = self.settings.max_message_attempts

        def make(index: int) -> PreparedMessage:
            raw = requests[index]
            try:
                request = raw if isinstance(raw, PublishRequest) else PublishRequest.model_validate(raw)
            except ValidationError as exc:
                raise _invalid_request(exc) from exc
            try:
                return prepare(request, max_envelope_bytes=cap, max_attempts=attempts)
            except RequestRejected as exc:
                exc.message_id = getattr(raw, "message_id", None)
                raise

        return await self.publish_each(topic, len(requests), make, session=session,
                                       conflict_expected=conflict_expected)

    async def publish_each(
        self, topic: str, count: int, make: Callable[[int], PreparedMessage], *, session: Any = None,
        conflict_expected: bool = False,
    ) -> PublishResults:
        """Publishes ``count`` messages to ``topic``: ``make(index)`` prepares the one at ``index``,
        or raises :class:`RequestRejected` to refuse it (then none is published). For layers that
        prepare their messages themselves (the jobs layer)."""
        prepared: list[PreparedMessage] = []
        failures: dict[int, PublishResult] = {}
        for index in range(count):
            try:
                prepared.append(make(index))
            except RequestRejected as exc:
                failures[index] = exc.result()
        return await self.publish_prepared(topic, count, prepared, failures, session=session,
                                           conflict_expected=conflict_expected)

    async def publish_prepared(
        self, topic: str, count: int, prepared: list[PreparedMessage], failures: dict[int, PublishResult], *,
        session: Any = None, conflict_expected: bool = False,
    ) -> PublishResults:
        """The second half of :meth:`publish`, for ``count`` requests already prepared: ``prepared``
        those that passed, ``failures`` the results of those refused, by index (then none is
        published). For layers that prepare their messages themselves (the jobs layer)."""
        if not is_name(topic):  # (no topic can have it: the store would refuse it as text, not as a name)
            raise self._unknown_topic(topic)
        if count == 0 and topic not in {t.name for t in await self.transport.list_topics()}:
            raise self._unknown_topic(topic)  # (a call with nothing to publish never reaches the store's check)
        if self.opened == 0 and not self.ended and not self._said_not_open and self.host_off_reason() is None:
            # (never opened here: not a publish of a handler draining while the lifespan ends)
            self._said_not_open = True
            log.warning(
                "publishing to %r while the queue is not open in this process (the app's lifespan has not started "
                "it): the message is stored, but nothing here consumes it; run the app with lifespan=queue.lifespan "
                "(a mounted app's lifespan does not run), or set WORKQUEUE_DISABLE_HOST=1 in a process that only "
                "publishes", topic,
            )
        session = self.sessions.resolve(session)
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
            return _checked(topic, results, self._unknown_topic, conflict_expected)
        if scope is None:
            return _checked(topic, await self._to_store(topic, prepared, session), self._unknown_topic,
                            conflict_expected)
        headers = scope.headers()
        if headers:
            for message in prepared:
                carry_headers(message, headers)
        try:
            results = await self._to_store(topic, prepared, session)
        except BaseException as exc:
            scope.end(None, exc)
            raise
        scope.end(results, None)
        return _checked(topic, results, self._unknown_topic, conflict_expected)

    async def _to_store(self, topic: str, prepared: list[PreparedMessage], session: Any) -> list[PublishResult]:
        """The transport's publish; a store without the schema, reached by a queue that was never
        opened, says that first (opening migrates when the settings ask for it)."""
        try:
            results = await self.transport.publish(topic, prepared, session=session)
        except SchemaMissing as exc:
            if self.opened:
                raise
            raise SchemaMissing(
                f"{exc}. The queue was never opened: run the app with lifespan=queue.lifespan (a test's "
                "ASGITransport runs none: enter queue.lifespan(app) around it) or `await queue.open()` first; "
                "opening migrates when the settings ask for it"
            ) from exc
        return named_as_given(results, prepared)

    # -- host -----------------------------------------------------------------------------------

    def build_host(
        self,
        plan: Sequence[SubscriptionPlan] | None = None,
        *,
        groups: Sequence[GroupPlan] = (),
        max_deliveries: int | None = None,
        stop_when_idle: bool = False,
        **option_overrides: Any,
    ) -> Host:
        """A host for the registered handlers; ``plan`` defaults to the settings' subscriptions."""
        options = self.settings.host_options()
        option_overrides.setdefault("observer", self.observer)
        option_overrides.setdefault("on_taken_back", self.leases_taken_back)
        self.request_load.busy_at = self.settings.busy_requests
        self.request_load.busy_concurrency = self.settings.busy_concurrency
        option_overrides.setdefault("request_load", self.request_load)
        if option_overrides:
            options = replace(options, **option_overrides)
        return Host(
            self.transport,
            self.resolve_handler,
            self.injector,
            plan=plan if plan is not None else self.settings.subscriptions,
            groups=groups,
            options=options,
            max_deliveries=max_deliveries,
            stop_when_idle=stop_when_idle,
            declared={name: sub.handler_key for name, sub in self.subscriptions.items()},
            ports=self.ports,
        )

    def host_off_reason(self) -> str | None:
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

    def _unknown_topic(self, topic: str) -> UnknownTopic:
        """The store does not hold ``topic``: why, as far as this queue can tell."""
        if topic in self.topics and self.opened == 0:
            why = ("the code declares it, but the queue was never opened, so its topics were not written to the "
                   "store: run the app with lifespan=queue.lifespan (a mounted app's lifespan does not run: give "
                   "the outer app the queue's lifespan) or `await queue.open()` first")
        elif topic in self.topics and not self.settings.sync_topology:
            why = ("the code declares it, but WORKQUEUE_SYNC_TOPOLOGY is off, so the queue does not write its "
                   "topics to the store: turn it on in one process, or create the topic there")
        elif topic in self.topics:
            why = ("the code declares it, but the store this publish went to does not hold it: a session on "
                   "another database, a topic declared after the queue opened, or one deleted since (the "
                   "queue writes its topics to the store when it opens)")
        else:
            why = f"neither the code declares it (Topic(name={topic!r})) nor the store holds it; check the name"
        return UnknownTopic(topic, f"cannot publish to topic {topic!r}: {why}")

    def _planned_here(self) -> list[tuple[str, int]]:
        """The subscriptions the host would run, by the plan (``*``: every declared one the host
        serves, with a handler registered here), with their concurrency."""
        plans = self.settings.subscriptions
        wildcard = next((p for p in plans if p.name == "*"), None)
        named = [(p.name, p.concurrency) for p in plans if p.name != "*"]
        if wildcard is not None:
            seen = {name for name, _ in named}
            named += [(name, wildcard.concurrency) for name, sub in sorted(self.subscriptions.items())
                      if name not in seen and sub.host_type == "worker" and not is_job_topic(sub.topic)
                      and self.handlers.get(sub.handler_key) is not None]
        return named

    def health(self) -> ExtensionHealth:
        """The state of the host and of every subscription it plans."""
        if self.opened == 0:
            ended = "the queue's lifespan has ended in this process (the app is stopping or has stopped)"
            if self.host_off_reason() is None:
                # Each subscription the host would run is in Error: not served (SPEC: health is 503).
                why = (f"not served: {ended}" if self.ended else
                       "not served: the app's lifespan has not started the queue; run the app with "
                       "lifespan=queue.lifespan (a mounted app's lifespan does not run: give the outer app the "
                       "queue's lifespan)")
                planned = [SubscriptionHealth(subscription=name, state="Error", reason=why, concurrency=concurrency)
                           for name, concurrency in self._planned_here()]
                return ExtensionHealth(status="Stopped", subscriptions=planned, reason=(
                    f"{ended}, so nothing is consumed here" if self.ended else
                    "the app's lifespan has not started the queue, so nothing is consumed in this process"))
            return ExtensionHealth(status="Stopped", reason=ended if self.ended else
                                   "the app's lifespan has not started the queue")
        if self.host is None:
            off = self.host_off_reason() or "the host is not started"
            return ExtensionHealth(status="Disabled", reason=f"the host is off in this process: {off}")
        subscriptions = self.host.health()
        if not self.host.reconciled:  # (whatever the list holds: nothing is planned from the store yet)
            return ExtensionHealth(status="Degraded", subscriptions=subscriptions, reason=(
                "the host has not read the store's subscriptions yet, so it consumes nothing; this process's "
                "log says why"))
        failing = [s for s in subscriptions if s.state in ("Error", "HandlerNotRegistered")]
        if not failing:
            return ExtensionHealth(status="Running", subscriptions=subscriptions)
        shown = ", ".join(s.subscription for s in failing[:5]) + (
            f" and {len(failing) - 5} more" if len(failing) > 5 else "")
        states = " or ".join(sorted({s.state for s in failing}))
        return ExtensionHealth(status="Degraded", subscriptions=subscriptions,
                               reason=f"{count(len(failing), 'subscription')} in {states} ({shown}); each says why")


def _invalid_request(exc: ValidationError) -> RequestRejected:
    """A request that is not a :class:`PublishRequest`, refused with its first error."""
    first = exc.errors()[0]
    return RequestRejected("InvalidRequest", f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}",
                           str(first["loc"][0]) if first["loc"] else None)


def _checked(topic: str, results: list[PublishResult], unknown: Callable[[str], UnknownTopic],
             conflict_expected: bool = False) -> PublishResults:
    """A publish's results, with its refusals logged at WARNING (a MessageIDConflict the caller
    expects aside); raises UnknownTopic when the store did not know the topic."""
    answer = results if isinstance(results, PublishResults) else PublishResults(results)
    for index, result in enumerate(answer):
        if conflict_expected and result.status == PublishStatus.MESSAGE_ID_CONFLICT:
            continue
        if result.status in NOT_ACCEPTED_LOGGED:
            error = result.error
            code = error.code if error is not None else result.status.value
            if code == "UnknownTopic":
                raise unknown(topic)
            if code != "BatchAborted":
                log.warning("publish to %s: item %d was %s (%s): %s", topic, index, result.status.value, code,
                            refusal(result))
    return answer
