"""Settings of a WorkQueue, read from ``WORKQUEUE_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from .database_url import database_scheme
from .envelope import DEFAULT_MAX_MESSAGE_ATTEMPTS, MAX_ATTEMPTS_LIMIT
from .errors import ConfigurationError
from .host import HostOptions, SubscriptionPlan
from .redaction import redact, register_secrets
from .session_pool import SessionPool
from .topology import MIN_LEASE_SECONDS
from .words import closest

ENV_PREFIX = "WORKQUEUE_"
SUBSCRIPTIONS_EXAMPLE = """WORKQUEUE_SUBSCRIPTIONS='[{"name": "*", "concurrency": 4}]'"""
_FIELD_IN_SETTINGS_ERROR = re.compile(r'field "(?P<field>\w+)"')

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///workqueue.db"
"""Where the queue lives when nothing else is configured: an SQLite file in the working directory."""


def default_database_file() -> str:
    """The absolute path of the default SQLite file, from the working directory."""
    return os.path.abspath(DEFAULT_DATABASE_URL.partition(":///")[2])


class WorkQueueSettings(BaseSettings):
    """How the queue connects and how this process's host runs.

    Every field can be set in the environment: ``WORKQUEUE_DATABASE_URL``,
    ``WORKQUEUE_SUBSCRIPTIONS='[{"name": "*", "concurrency": 8}]'``, ``WORKQUEUE_DISABLE_HOST=1`` …
    """

    # (hide_input_in_errors: a value refused, a database URL with its password say, stays out of the
    # ValidationError that a printed traceback shows as the ConfigurationError's cause)
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", hide_input_in_errors=True)

    def __init__(self, **values: Any) -> None:
        """Reads the environment; a value that cannot work raises ConfigurationError in one line."""
        try:
            super().__init__(**values)
        except SettingsError as exc:
            raise _settings_error(exc) from exc
        except ValidationError as exc:
            raise _validation_error(exc) from exc
        if self.idle_poll_max_ms < self.idle_poll_min_ms:
            raise _settings_invalid(
                f"{_variable('idle_poll_max_ms')} ({self.idle_poll_max_ms}) is below {_variable('idle_poll_min_ms')} "
                f"({self.idle_poll_min_ms}): the idle poll doubles from the minimum up to the maximum; raise the "
                "maximum or lower the minimum", ["idle_poll_max_ms", "idle_poll_min_ms"],
            )

    enabled: bool = True
    """Run the host (consumers, sweeper, reconcile loop) in this process."""
    database_url: str | None = DEFAULT_DATABASE_URL
    """``postgresql+asyncpg://user:password@host:5432/db`` (``postgresql://`` works too),
    ``sqlite+aiosqlite:///path/file.db`` or ``mssql+aioodbc://…``; by default an SQLite file,
    ``workqueue.db``, in the working directory."""
    system_principal: str | None = None
    """Who handlers act as; handed to them as ``context.principal``."""
    subscriptions: list[SubscriptionPlan] = Field(default_factory=lambda: [SubscriptionPlan()])
    """Which subscriptions this process runs (``*``: every one but the job queues', which ``job_queues``
    picks) and how many deliveries of each at once."""
    idle_poll_min_ms: int = Field(default=250, ge=1)
    """The first poll interval of an idle consumer."""
    idle_poll_max_ms: int = Field(default=5000, ge=1)
    """The idle poll interval doubles up to this (at least ``idle_poll_min_ms``)."""
    wake_backoff_ms: int = Field(default=100, ge=0)
    """After wake-up claims that found nothing (another process took the delivery), a consumer waits
    10 ms doubling up to this long before its next wake-up claim; 0 claims at every wake-up."""
    shutdown_drain_ms: int = Field(default=8000, ge=0)
    """How long shutdown waits for running handlers, before and again after aborting them; what
    is left then goes back to Pending without spending an attempt."""
    sweeper_enabled: bool = True
    """Run the sweeper (expired leases, retention) in this process; one pass at a time runs across
    all processes."""
    sweeper_interval_ms: int = Field(default=60000, ge=10)
    """Time between sweeper passes (the dashboard's chart gets a point a minute at most)."""
    reconcile_interval_ms: int = Field(default=30000, ge=0)
    """How often the host reads the subscriptions again (a pause, a resume, a new one); 0 turns it off."""
    stalled_store_call_ms: int = Field(default=30000, ge=0)
    """A claim or a settle that has waited this long for the store (a lock another session holds,
    a stalled store) is logged at WARNING and puts the subscriptions it holds up in Error, so
    health answers 503 until it returns; 0 turns the look off."""
    disable_host: bool = False
    """``WORKQUEUE_DISABLE_HOST=1`` keeps the host off in one process without touching the rest."""
    auto_migrate: bool | None = None
    """Apply pending schema migrations at start-up. Unset: yes on SQLite (embedded), no elsewhere
    (run ``workqueue migrate`` as the schema owner)."""
    sync_topology: bool = True
    """Write the topics and subscriptions declared in code to the database at start-up."""
    pool_size: int = Field(default=10, ge=1)
    """Connections the queue keeps to the database (besides one for LISTEN in a process that consumes)."""
    sqlite_busy_timeout_ms: int = Field(default=30000, ge=1)
    """SQLite: how long one operation waits in all for the file's write lock (behind this process's
    other callers, in SQLite's busy handler and between attempts) before it fails with a
    retryable error. Every call has this one bound, whatever the number of callers; a statement
    of a request session (``queue.session``) waits as long."""
    busy_requests: int = Field(default=2, ge=0)
    """Requests first: while this many requests of this process hold a request session
    (``queue.session``) at once, each consumer of its host claims only up to ``busy_concurrency``
    deliveries; below it they claim at full concurrency again at once. 0: never (a process that only
    consumes never counts a request)."""
    busy_concurrency: int = Field(default=1, ge=1)
    """Deliveries a consumer of a busy web process holds at once (see ``busy_requests``)."""
    session_pool_size: int = Field(default=10, ge=1)
    """Connections of the request sessions (``queue.session``, ``queue.sessionmaker``) per process."""
    session_pool_overflow: int = Field(default=0, ge=0)
    """Connections opened beyond ``session_pool_size`` at a peak (and closed after it)."""
    session_pool_timeout_ms: int = Field(default=5000, ge=1)
    """How long a request waits for a free connection before it is answered 503 with Retry-After."""
    session_pool_pre_ping: bool = False
    """Test each connection with a round trip when it is taken from the pool (costs one per request;
    without it, the first use of a connection the server dropped fails once and the pool renews)."""
    listen: bool = True
    """Wake idle consumers with LISTEN/NOTIFY on PostgreSQL (polling stays as the fallback). The
    LISTEN connection opens with the first consumer: a process that only publishes has none."""

    # -- jobs ------------------------------------------------------------------------------------
    jobs_mode: Literal["async", "sync"] = "async"
    """``sync`` runs a job at its dispatch, in the caller's task, instead of queuing it (development
    and simple tests): the job does not join the caller's transaction and a rollback does not undo it."""
    job_queues: str | None = None
    """Which job queues this process's host takes, in order: ``mail,default`` (strict order),
    ``mail,*`` (``*``: every other queue, fairly, at its place). Unset: every queue, fairly."""
    job_concurrency: int = Field(default=4, ge=1)
    """How many jobs this process's host runs at once, over all the queues it takes."""
    job_lease_seconds: float = Field(default=90.0, ge=MIN_LEASE_SECONDS)
    """The lease of a job queue's deliveries; a job's timeout plus the stop timeout must fit in it."""
    job_unknown_grace_seconds: float = Field(default=900.0, ge=0, le=86400)
    """How long after its dispatch a job that this worker does not declare, on one of its app's
    queues (a rolling deploy's new job, met by a worker of the release before), goes back every 5 s
    without spending a try, for a worker that knows it; after that it spends its tries. 0: at once."""
    app_key: SecretStr | None = None
    """The Fernet key that encrypts the payloads of ``encrypted=True`` jobs (``WORKQUEUE_APP_KEY``)."""
    previous_keys: SecretStr | None = None
    """Earlier app keys, comma-separated, that still decrypt (``WORKQUEUE_PREVIOUS_KEYS``)."""

    otel: bool = True
    """Trace and measure through the OpenTelemetry API when it is installed (the ``otel`` extra);
    ``WORKQUEUE_OTEL=0`` turns it off. The app brings the SDK and the exporters; the queue loads
    the API once the process has imported it (the SDK does), so a bare worker never does."""
    prometheus: bool = True
    """Count publishes and attempts for ``queue.metrics_router`` when prometheus-client is installed."""
    metrics_public: bool = False
    """Serve ``/metrics`` without an API key (``WORKQUEUE_METRICS_PUBLIC=1``), for a scraper on a
    private network; by default it asks for a key with ``workqueue:read``."""
    metrics_cache_seconds: float = Field(default=5.0, ge=0)
    """How long ``/metrics`` reuses the counts it read from the database."""
    max_message_attempts: int = Field(default=DEFAULT_MAX_MESSAGE_ATTEMPTS, ge=1, le=MAX_ATTEMPTS_LIMIT)
    """The most attempts a published message may ask for with ``max_attempts`` (``MaxAttempts`` over
    REST); a request above it is refused (422). Subscriptions' own ``max_attempts`` are not bound by it."""
    dashboard_secret: SecretStr | None = None
    """The server secret that signs the dashboard's session cookies (``WORKQUEUE_DASHBOARD_SECRET``,
    at least 16 characters, the same in every process); unset: derived from ``app_key``."""

    dashboard_stuck_after_seconds: float = Field(default=600.0, gt=0)
    """An InFlight delivery claimed longer ago than this is flagged as stuck on the dashboard
    (``WORKQUEUE_DASHBOARD_STUCK_AFTER_SECONDS``; its lease may still be renewed)."""

    trace_url: str | None = None
    """A link to a trace in your tracing UI, with ``{trace_id}`` where the trace id goes
    (``https://tempo.example/trace/{trace_id}``): the dashboard links each delivery to the trace its
    message was published in."""

    # -- aws -------------------------------------------------------------------------------------
    aws_region: str | None = None
    """The AWS region of the ``aws`` topics' SNS topics and SQS queues (``WORKQUEUE_AWS_REGION``);
    credentials come from the AWS SDK's default chain, the region always from here."""
    aws_endpoint_url: str | None = None
    """A local emulator (moto, LocalStack) in development and tests; None for AWS itself."""
    aws_resource_prefix: str = ""
    """Prepended to every SNS topic and SQS queue name the manifest gives (``mj-wq-``)."""
    aws_bindings_file: str | None = None
    """Where ``import-bindings`` stores the ARNs and queue URLs when the queue has no database."""
    aws_wait_time_seconds: int = Field(default=20, ge=0, le=20)
    """How long an idle consumer's ReceiveMessage long-polls (SQS's WaitTimeSeconds)."""
    aws_relay: bool = True
    """Run the outbox relay (committed publishes to aws topics → SNS) in processes that open the queue."""
    aws_relay_interval_ms: int = Field(default=1000, ge=10)
    """How often an idle relay looks for committed outbox rows."""
    aws_lambda_subscriptions: list[str] = Field(default_factory=list)
    """The subscriptions served by a Lambda function rather than a host
    (``WORKQUEUE_AWS_LAMBDA_SUBSCRIPTIONS='["documents.archive"]'``): the manifest gives them a
    ``lambda`` block and hosts do not consume them."""

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        if value:
            try:
                database_scheme(value, source="the URL")
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
            scheme, sep, rest = value.partition("://")
            value = scheme.lower() + sep + rest  # (schemes are case-insensitive; the drivers' names are not)
        return value

    @field_validator("app_key", "previous_keys", "dashboard_secret")
    @classmethod
    def _masked_everywhere(cls, value: SecretStr | None) -> SecretStr | None:
        """Registers the keys with the redaction as soon as they are read, whether or not a cipher
        or a dashboard of this process ever uses them (a handler's error may quote them)."""
        if value is not None:
            register_secrets(part.strip() for part in value.get_secret_value().split(","))
        return value

    @field_validator("trace_url")
    @classmethod
    def _trace_url(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith(("https://", "http://")) or "{trace_id}" not in value):
            raise ValueError("give an http(s) URL with {trace_id} where the trace id goes, e.g. "
                             "https://tempo.example/trace/{trace_id}")
        return value

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """The fields, with the database URL's password masked (a repr ends up in logs)."""
        for name, value in super().__repr_args__():
            yield name, redact(value) if name == "database_url" and isinstance(value, str) else value

    def session_pool(self) -> SessionPool:
        """The request sessions' pool, from the settings."""
        return SessionPool(
            size=self.session_pool_size, overflow=self.session_pool_overflow,
            timeout_seconds=self.session_pool_timeout_ms / 1000, pre_ping=self.session_pool_pre_ping,
            sqlite_busy_seconds=self.sqlite_busy_timeout_ms / 1000,
        )

    @property
    def migrate_at_start(self) -> bool:
        """Whether start-up applies pending migrations."""
        if self.auto_migrate is not None:
            return self.auto_migrate
        return (self.database_url or "").startswith("sqlite")

    @property
    def uses_default_database(self) -> bool:
        """True when nothing chose the database (no ``WORKQUEUE_DATABASE_URL``, no ``database_url``)."""
        return "database_url" not in self.model_fields_set and self.database_url == DEFAULT_DATABASE_URL

    @property
    def host_enabled(self) -> bool:
        """True when this process should run the host."""
        return self.enabled and not self.disable_host

    def host_options(self) -> HostOptions:
        """The host's timings."""
        if self.idle_poll_max_ms < self.idle_poll_min_ms:
            raise ValueError(
                f"idle_poll_max_ms ({self.idle_poll_max_ms}) is below idle_poll_min_ms ({self.idle_poll_min_ms})"
            )
        return HostOptions(
            idle_poll_min_ms=self.idle_poll_min_ms,
            idle_poll_max_ms=self.idle_poll_max_ms,
            wake_backoff_ms=self.wake_backoff_ms,
            shutdown_drain_ms=self.shutdown_drain_ms,
            sweeper_enabled=self.sweeper_enabled,
            sweeper_interval_ms=self.sweeper_interval_ms,
            reconcile_interval_ms=self.reconcile_interval_ms,
            stalled_store_call_ms=self.stalled_store_call_ms,
            principal=self.system_principal,
        )


def _variable(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def _example(field: str) -> str:
    if field == "subscriptions":
        return f"; it is a JSON list of subscription plans, for example {SUBSCRIPTIONS_EXAMPLE}"
    return ""


def _settings_invalid(message: str, fields: Sequence[str]) -> ConfigurationError:
    """A ConfigurationError about settings whose values cannot work; its ``fields`` names them."""
    error = ConfigurationError(message)
    error.fields = tuple(fields)
    return error


def settings_beside_invalid_variables(**values: Any) -> WorkQueueSettings:
    """``WorkQueueSettings(**values)``, leaving out the ``WORKQUEUE_*`` variables whose values cannot
    work: for an operator command, which warns of them and goes on (it may be what repairs the app).
    A value given here that cannot work still raises."""
    saved: dict[str, str] = {}
    try:
        while True:
            try:
                return WorkQueueSettings(**values)
            except ConfigurationError as exc:
                dropped = {_variable(f) for f in exc.fields if f not in values} & set(os.environ)
                if not dropped:
                    raise
                saved.update((name, os.environ.pop(name)) for name in dropped)
    finally:
        os.environ.update(saved)


def _settings_error(exc: SettingsError) -> ConfigurationError:
    """A value of the environment that does not parse (not JSON, where JSON is expected)."""
    match = _FIELD_IN_SETTINGS_ERROR.search(str(exc))
    field = match.group("field") if match else "?"
    cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
    return _settings_invalid(f"{_variable(field)} is not valid JSON{cause}{_example(field)}", [field])


PACKAGE_VARIABLES = frozenset({
    "WORKQUEUE_APP",  # the CLI's --app
    "WORKQUEUE_ALLOW_DESTRUCTIVE",  # the CLI's guard for destructive commands
    "WORKQUEUE_SUBSCRIPTION_POLICY",  # the Lambda adapter's policy
})
"""``WORKQUEUE_*`` variables the package reads outside the settings."""

OTHER_VARIABLES = PACKAGE_VARIABLES | frozenset({
    # The project's own test suite and benchmarks (README, docs/sql-server.md): a contributor who
    # exports them runs the example app too, and they are no typo. Never offered as a guess.
    "WORKQUEUE_TEST_DATABASE_URL", "WORKQUEUE_MSSQL_URL", "WORKQUEUE_MODEL_EXAMPLES", "WORKQUEUE_MODEL_STEPS",
    "WORKQUEUE_FUZZ_EXAMPLES", "WORKQUEUE_BENCH_DSN", "WORKQUEUE_BENCH_MAX_IN_FLIGHT",
})
"""``WORKQUEUE_*`` variables read outside the settings: by the package, or by the project's
tests and benchmarks."""


def setting_names() -> list[str]:
    """The names of every setting (``database_url``, ...)."""
    return list(WorkQueueSettings.model_fields)


def _unknown(environ: Mapping[str, str] | None) -> list[tuple[str, str | None]]:
    """Each ``WORKQUEUE_*`` variable that names no setting, with the variable it most resembles."""
    offered = {_variable(name) for name in setting_names()} | PACKAGE_VARIABLES
    known = offered | OTHER_VARIABLES
    found = []
    for name in sorted(os.environ if environ is None else environ):
        if name.upper().startswith(ENV_PREFIX) and name.upper() not in known:
            suffix = closest(name.upper().removeprefix(ENV_PREFIX),
                              sorted(k.removeprefix(ENV_PREFIX) for k in offered))
            found.append((name, None if suffix is None else ENV_PREFIX + suffix))
    return found


_JOB_EQUIVALENTS = {
    "max_in_flight": "@queue.job(..., concurrency=...)", "rate_limit": "@queue.job(..., rate_limit=...)",
    "max_attempts": "@queue.job(..., tries=...)", "lease_seconds": "WORKQUEUE_JOB_LEASE_SECONDS",
    "backoff_base_seconds": "@queue.job(..., backoff=...)",
}
"""What sets a subscription field for a job queue, where something does."""


def _subscription_field(name: str) -> str | None:
    """The field of ``Subscription`` that ``name`` names (``WORKQUEUE_MAX_IN_FLIGHT`` or
    ``max_in_flight``: ``max_in_flight``), if it names no setting; else None."""
    from .topology import Subscription  # (only for an unknown name)

    squashed = name.upper().removeprefix(ENV_PREFIX).replace("_", "").lower()
    return next((f for f in Subscription.model_fields
                 if f.replace("_", "") == squashed and f not in WorkQueueSettings.model_fields), None)


def _per_subscription(field: str) -> str:
    job = _JOB_EQUIVALENTS.get(field)
    return (f"{field} is set per subscription, in the code: Subscription(..., {field}=...)"
            + (f" (a job queue's: {job})" if job else "") + "; see docs/configuration.md")


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One sentence per ``WORKQUEUE_*`` variable of the environment that names no setting, with
    the variable it most resembles (a typo is otherwise silently ignored; one whose value is a
    database URL is taken for ``WORKQUEUE_DATABASE_URL``), or the subscription field it names
    (those are set in the code, per subscription)."""
    values = os.environ if environ is None else environ
    said = []
    for name, guess in _unknown(environ):
        field = _subscription_field(name)
        if field is not None:
            hint = "; " + _per_subscription(field)
        elif _DATABASE_URL_VALUE.match(values.get(name, "")):
            hint = f"; did you mean {_variable('database_url')}? (its value is a database URL)"
        elif guess:
            hint = f"; did you mean {guess}?"
        else:
            hint = "; see docs/configuration.md for the settings"
        said.append(f"{name} is not a setting of fastapi-workqueue and is ignored{hint}")
    return said


_DATABASE_URL_VALUE = re.compile(r"\s*(?:postgresql|postgres|sqlite|mssql)(?:\+[a-z0-9]+)?://", re.IGNORECASE)


def misspelt_database_url(environ: Mapping[str, str] | None = None) -> str | None:
    """The variable of the environment that names no setting but was meant as the database URL
    (a misspelt database URL): it most resembles ``WORKQUEUE_DATABASE_URL``, or its value is a
    database URL (``WORKQUEUE_POSTGRES_URL=postgresql://…``); None when there is none."""
    values = os.environ if environ is None else environ
    database = _variable("database_url")
    return next((name for name, guess in _unknown(environ)
                 if guess == database or _DATABASE_URL_VALUE.match(values.get(name, ""))), None)


def misspelt_database_url_problem(remedy: str) -> str | None:
    """The refusal of a process started with a misspelt database URL and none set (it must fail
    loudly, not run on a file nobody meant), ending with ``remedy``; None when there is none."""
    if (misspelt := misspelt_database_url()) is None:
        return None
    return (f"{misspelt} is not a setting of fastapi-workqueue; did you mean WORKQUEUE_DATABASE_URL? No "
            f"database URL is set{remedy}")


def _unknown_field(field: str) -> str:
    if (per_subscription := _subscription_field(field)) is not None:
        return f"WorkQueueSettings has no setting {field!r}; {_per_subscription(per_subscription)}"
    guess = closest(field, setting_names())
    hint = f"did you mean {guess!r}?" if guess else "see docs/configuration.md for the settings"
    return f"WorkQueueSettings has no setting {field!r}; {hint}"


def _validation_error(exc: ValidationError) -> ConfigurationError:
    """Values of the wrong shape, each named by its variable and where in it the problem is."""
    # (an unknown key inside a setting, WORKQUEUE_SUBSCRIPTIONS' "concurency", is that setting's problem)
    unknown = [str(e["loc"][0]) for e in exc.errors() if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
    if unknown:
        return ConfigurationError("; ".join(_unknown_field(field) for field in unknown))
    problems: dict[str, list[str]] = {}
    for error in exc.errors():
        loc = list(error["loc"])
        field = str(loc.pop(0)) if loc else "?"
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
        message = "no such key" if error["type"] == "extra_forbidden" else error["msg"]
        problems.setdefault(field, []).append(f"{where + ': ' if where else ''}{message}")
    text = "; ".join(
        f"{_variable(field)} (WorkQueueSettings.{field}): {', '.join(found)}{_example(field)}"
        for field, found in problems.items()
    )
    return _settings_invalid(text, list(problems))
