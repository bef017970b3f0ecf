"""The SQL Server transport: every operation is one ``EXEC workqueue.<procedure>`` through aioodbc.

The procedures of ``sql/mssql`` mirror the PostgreSQL functions one to one (same names, same
parameters, same result columns), so :class:`MssqlTransport` only renders the call, encodes
arrays as JSON text and normalises what comes back:

* ``call("claim", p_subscription=…, p_limit=…)`` runs ``EXEC workqueue.claim @p_subscription = ?,
  @p_limit = ?``: named arguments, so a parameter the procedure lacks is an error, never a shift.
* Lists travel as JSON arrays in ``nvarchar(max)`` (UUIDs and datetimes as ISO strings).
* ``uniqueidentifier`` values come back from SQL Server in upper case; the uuid columns are
  lower-cased before they reach any comparison. ``datetimeoffset`` comes back as an aware datetime.

What SQL Server lacks: LISTEN/NOTIFY. Consumers in other processes find new work by polling.
What it needs: ``READ_COMMITTED_SNAPSHOT ON`` (otherwise publishers, claimers and readers block
each other); ``validate-bindings`` probes it and says which ``ALTER DATABASE`` to run.

aioodbc (and pyodbc below it) import only where the system has unixODBC and an ODBC driver
(``apt-get install unixodbc`` plus Microsoft's ODBC Driver 18 or FreeTDS's ``tdsodbc``). They are
imported when the transport opens, never at import time, so the other transports never need them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import re
import struct
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from ..core.clock import Clock
from ..core.errors import ConfigurationError, SchemaMissing, TransportError, TransportUnavailable
from ..core.redaction import redacting_logger
from ..core.reports import BindingIssue
from ..core.transport import Capabilities
from .errors import with_retries
from .migration_plan import pending
from .routines import RandomSource, RoutineTransport, Row

log = redacting_logger("fastapi_workqueue.mssql")

T = TypeVar("T")

DEFAULT_DRIVER = "ODBC Driver 18 for SQL Server"
INSTALL_HINT = (
    "SQL Server needs aioodbc and an ODBC driver: pip install 'fastapi-workqueue[mssql]', the system's "
    "unixODBC (apt-get install unixodbc) and a SQL Server ODBC driver (Microsoft ODBC Driver 18 for SQL "
    "Server, or FreeTDS: apt-get install tdsodbc)"
)

SQL_SS_TIMESTAMPOFFSET = -155
"""The ODBC type code of ``datetimeoffset``, which pyodbc cannot read without a converter."""

UUID_COLUMNS = frozenset({"id", "message_id", "lease_token", "token"})
"""Result columns that may hold a ``uniqueidentifier`` (normalised to lower case)."""

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
STORE_NOW_SQL = "SELECT SYSDATETIMEOFFSET() AS now"
"""The database's time, by the clock its procedures read (``store_now``)."""
_GO = re.compile(r"^\s*GO\s*(?:--.*)?$", re.IGNORECASE)
_NATIVE_ERROR = re.compile(r"\((\d+)\)\s*\(SQL\w+\)")
_DRIVER_PREFIX = re.compile(r"^(?:\s*\[[^\]]*\])+\s*")

_RETRYABLE = {1205, 1222, 3960, 3961, 51001}  # deadlock, lock timeout, snapshot conflicts, "retry" (51001)
_MISSING_SCHEMA = {208, 2760, 2812, 4121}  # object, schema, procedure, function missing
_PERMISSION = {229, 230, 262, 297, 300}
_AUTH = {4060, 18452, 18456}

_BOOTSTRAP = (
    "IF SCHEMA_ID(N'workqueue') IS NULL EXEC (N'CREATE SCHEMA workqueue');",
    """IF OBJECT_ID(N'workqueue.schema_migration', N'U') IS NULL
    CREATE TABLE workqueue.schema_migration (
        version     int NOT NULL CONSTRAINT schema_migration_pk PRIMARY KEY,
        name        nvarchar(200) NOT NULL,
        checksum    nvarchar(64) NOT NULL,
        applied_at  datetimeoffset(6) NOT NULL
                    CONSTRAINT schema_migration_applied_at_default DEFAULT SYSDATETIMEOFFSET()
    );""",
)

_MIGRATION_LOCK = """DECLARE @v_lock int;
EXEC @v_lock = sp_getapplock @Resource = N'workqueue.migrate', @LockMode = N'Exclusive',
    @LockOwner = N'Transaction', @LockTimeout = 60000;
IF @v_lock < 0
    THROW 51000, N'another process is applying the work queue migrations; retry when it has finished', 1;"""

_RCSI_PROBE = (
    "SELECT DB_NAME() AS database_name, is_read_committed_snapshot_on "
    "FROM sys.databases WHERE name = DB_NAME()"
)


# -- connection string -----------------------------------------------------------------------------


def _odbc_value(value: str) -> str:
    """An ODBC connection-string value, braced when it holds a separator."""
    if any(c in value for c in ";{}=") or value != value.strip():
        return "{" + value.replace("}", "}}") + "}"
    return value


def odbc_connection_string(url: str) -> str:
    """``mssql+aioodbc://user:password@host:1433/database?driver=…&TrustServerCertificate=yes``
    → an ODBC connection string. Query parameters other than ``driver`` become ODBC keywords;
    ``odbc_connect=<connection string>`` (SQLAlchemy's form) is used as it is."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception as exc:
        raise ConfigurationError(f"cannot parse the SQL Server URL: {exc}") from exc
    if parsed.get_backend_name() != "mssql" or parsed.get_driver_name() not in ("aioodbc", "mssql"):
        raise ConfigurationError(
            f"database URL scheme {parsed.drivername!r} is not SQL Server through aioodbc; use "
            "mssql+aioodbc://user:password@host:1433/database?driver=ODBC+Driver+18+for+SQL+Server"
        )
    query = {key: value if isinstance(value, str) else value[-1] for key, value in parsed.query.items()}
    raw = query.pop("odbc_connect", None)
    if raw:
        return raw
    driver = query.pop("driver", DEFAULT_DRIVER)
    parts = [f"DRIVER={{{driver}}}"]
    host = parsed.host or "localhost"
    if "freetds" in driver.lower():
        parts.append(f"SERVER={_odbc_value(host)}")
        if parsed.port:
            parts.append(f"PORT={parsed.port}")
    else:
        parts.append(f"SERVER={_odbc_value(f'{host},{parsed.port}' if parsed.port else host)}")
    if parsed.database:
        parts.append(f"DATABASE={_odbc_value(parsed.database)}")
    if parsed.username:
        parts.append(f"UID={_odbc_value(parsed.username)}")
        parts.append(f"PWD={_odbc_value(parsed.password or '')}")
    parts.extend(f"{key}={_odbc_value(value)}" for key, value in query.items())
    return ";".join(parts)


# -- values in and out -----------------------------------------------------------------------------


def _json_item(value: Any) -> Any:
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def encode_param(value: Any) -> Any:
    """A routine argument as the driver binds it: lists as JSON text, UUIDs and datetimes as ISO
    strings (SQL Server converts them to the procedure's parameter type)."""
    if isinstance(value, list | tuple):
        return json.dumps([_json_item(v) for v in value])
    return _json_item(value)


def normalise_row(row: dict[str, Any]) -> dict[str, Any]:
    """uniqueidentifier columns in lower case (SQL Server answers in upper case)."""
    for name in UUID_COLUMNS.intersection(row):
        value = row[name]
        if isinstance(value, str):
            row[name] = value.lower()
    return row


def decode_datetimeoffset(value: bytes | None) -> datetime | None:
    """pyodbc output converter for ``datetimeoffset`` (SQL_SS_TIMESTAMPOFFSET_STRUCT)."""
    if value is None:
        return None
    year, month, day, hour, minute, second, nanoseconds, tz_hour, tz_minute = struct.unpack("<6hI2h", value)
    offset = timezone(timedelta(hours=tz_hour, minutes=tz_minute))
    return datetime(year, month, day, hour, minute, second, nanoseconds // 1000, tzinfo=offset)


def split_batches(script: str) -> list[str]:
    """A T-SQL script as the batches between its ``GO`` lines (comment-only batches dropped)."""
    batches: list[str] = []
    current: list[str] = []
    for line in [*script.splitlines(), "GO"]:
        if not _GO.match(line):
            current.append(line)
            continue
        text = "\n".join(current).strip()
        current = []
        code = [ln for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("--")]
        if code:
            batches.append(text)
    return batches


# -- errors ----------------------------------------------------------------------------------------


def native_error(exc: BaseException) -> tuple[str | None, int | None, str]:
    """(SQLSTATE, SQL Server error number, message) of a pyodbc error, also wrapped by SQLAlchemy."""
    inner = getattr(exc, "orig", None)
    if isinstance(inner, BaseException):
        exc = inner
    args: tuple[Any, ...] = getattr(exc, "args", ())
    state = args[0] if len(args) >= 2 and isinstance(args[0], str) else None
    text = str(args[1]) if len(args) >= 2 else str(exc)
    match = _NATIVE_ERROR.search(text)
    number = int(match.group(1)) if match else None
    message = _DRIVER_PREFIX.sub("", text[: match.start()] if match else text).strip()
    return state, number, message or type(exc).__name__


_OBJECT_IN_USE = 51002
"""THROW 51002: PostgreSQL's object_in_use (a subscription moved to another topic, a partition mode
changed under live work), a ConfigurationError as there."""


def map_mssql_error(exc: BaseException, operation: str) -> Exception:
    """A driver exception as a :class:`TransportError` (or a configuration error)."""
    if isinstance(exc, TransportError | ConfigurationError):
        return exc
    state, number, text = native_error(exc)
    if number in _AUTH or state == "28000":
        return ConfigurationError(
            f"{operation}: SQL Server refused the login or the database ({text}); check WORKQUEUE_DATABASE_URL"
        )
    if number in _PERMISSION:
        return ConfigurationError(
            f"{operation}: the database user lacks a permission ({text}); the application's user needs the "
            "workqueue_runtime role of sql/mssql/roles/runtime_role.sql, operator actions workqueue_operator "
            "(operator_role.sql) and API key management workqueue_admin (admin_role.sql), and migrations need "
            "the schema owner: run them as the owner, not with WORKQUEUE_AUTO_MIGRATE under the runtime user"
        )
    if number == _OBJECT_IN_USE:  # sync_subscription: a change the stored subscription forbids
        return ConfigurationError(f"{operation}: {text}")
    if number in _MISSING_SCHEMA:
        return SchemaMissing(
            f"{operation}: the work queue schema is missing or out of date ({text}); run "
            "`queue.migrate()` (or `workqueue migrate`), or set WORKQUEUE_AUTO_MIGRATE=1"
        )
    if number in _RETRYABLE or state == "40001":
        return TransportError(f"{operation}: {text}", retryable=True)
    if (state is not None and (state.startswith("08") or state in ("HYT00", "HYT01"))) or isinstance(
        exc, OSError | ConnectionError | asyncio.TimeoutError
    ):
        return TransportUnavailable(f"{operation}: SQL Server is unavailable ({text}); retry later")
    return TransportError(f"{operation}: {text}")


# -- driver access ---------------------------------------------------------------------------------


def _import_aioodbc() -> Any:
    """aioodbc, imported on first use: it needs pyodbc, which needs the system's unixODBC."""
    try:
        return importlib.import_module("aioodbc")
    except ImportError as exc:
        raise ConfigurationError(f"{INSTALL_HINT} ({exc})") from exc


async def _init_connection(raw: Any) -> None:
    raw.add_output_converter(SQL_SS_TIMESTAMPOFFSET, decode_datetimeoffset)


async def fetch_rows(conn: Any, sql: str, values: Sequence[Any]) -> list[Row]:
    """Runs one statement on an aioodbc connection; returns the rows of its first result set.

    Every result set is drained, so an error raised after the first one still surfaces."""
    rows: list[Row] = []
    seen = False
    async with conn.cursor() as cur:
        await cur.execute(sql, *values)
        while True:
            if cur.description is not None and not seen:
                seen = True
                columns = [c[0] for c in cur.description]
                rows = [normalise_row(dict(zip(columns, r, strict=True))) for r in await cur.fetchall()]
            if not await cur.nextset():
                return rows


async def apply_mssql_migrations(conn: Any) -> list[str]:
    """Applies every migration not yet recorded, in one transaction, one process at a time (the
    application lock 'workqueue.migrate'). Each file runs batch by batch (split on GO lines)."""
    applied_now: list[str] = []
    async with conn.cursor() as cur:
        await cur.execute("SET XACT_ABORT ON")
        await cur.execute("BEGIN TRANSACTION")
        try:
            await cur.execute(_MIGRATION_LOCK)
            for batch in _BOOTSTRAP:
                await cur.execute(batch)
            await cur.execute("SELECT version, checksum FROM workqueue.schema_migration")
            recorded = {int(r[0]): str(r[1]) for r in await cur.fetchall()}
            for migration in pending("mssql", recorded):
                log.info("applying migration %s", migration.label)
                for batch in split_batches(migration.sql):
                    await cur.execute(batch)
                    while await cur.nextset():
                        pass
                await cur.execute(
                    "INSERT INTO workqueue.schema_migration (version, name, checksum) VALUES (?, ?, ?)",
                    migration.version, migration.name, migration.checksum,
                )
                applied_now.append(migration.label)
            await cur.execute("COMMIT TRANSACTION")
        except BaseException:
            with contextlib.suppress(Exception):
                await cur.execute("IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION")
            raise
        finally:
            with contextlib.suppress(Exception):
                await cur.execute("SET XACT_ABORT OFF")
    return applied_now


class MssqlTransport(RoutineTransport):
    """The database transport on SQL Server 2019 or later, through an aioodbc pool."""

    name = "mssql"
    dialect = "mssql"
    capabilities = Capabilities(
        ordered=True,
        exclusive=True,
        transactional_publish=True,
        wakeups=False,
        runtime_roles=True,
        notes=("no LISTEN/NOTIFY: consumers in other processes find new work by polling",),
    )

    def __init__(
        self,
        url: str,
        *,
        pool_min_size: int = 1,
        pool_max_size: int = 10,
        connect_timeout: float = 10.0,
        rng: RandomSource | None = None,
        clock: Clock | None = None,
        **_options: Any,
    ) -> None:
        super().__init__(rng=rng, clock=clock)
        self.url = url
        self._dsn = odbc_connection_string(url)
        self._pool_min_size = pool_min_size
        self._pool_max_size = pool_max_size
        self._connect_timeout = connect_timeout
        self._pool: Any = None
        self._statements: dict[tuple[str, tuple[str, ...]], str] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Creates the pool (autocommit: each procedure runs in a transaction of its own)."""
        if self._pool is not None:
            return
        aioodbc = _import_aioodbc()
        try:
            self._pool = await aioodbc.create_pool(
                dsn=self._dsn,
                minsize=self._pool_min_size,
                maxsize=self._pool_max_size,
                autocommit=True,
                timeout=max(1, round(self._connect_timeout)),
                after_created=_init_connection,
            )
        except Exception as exc:
            raise map_mssql_error(exc, f"connecting to {self._safe_url()}") from exc

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()
            await pool.wait_closed()

    def _safe_url(self) -> str:
        scheme, _, rest = self.url.partition("://")
        host = rest.rsplit("@", 1)[-1].split("?", 1)[0]
        return f"{scheme}://{host}"

    @property
    def pool(self) -> Any:
        if self._pool is None:
            raise RuntimeError("the transport is not open; use it inside the WorkQueue's lifespan")
        return self._pool

    # -- routines ----------------------------------------------------------------------------

    def statement(self, routine: str, names: tuple[str, ...]) -> str:
        """``EXEC workqueue.<routine> @p_a = ?, @p_b = ?`` (cached per routine and argument names)."""
        sql = self._statements.get((routine, names))
        if sql is None:
            for name in (routine, *names):
                if not _NAME.match(name):
                    raise ValueError(f"not a routine or parameter name: {name!r}")
            args = ", ".join(f"@{name} = ?" for name in names)
            sql = f"EXEC workqueue.{routine} {args}".rstrip()
            self._statements[(routine, names)] = sql
        return sql

    async def call(
        self, routine: str, *, retry: bool = True, session: Any = None, connection: Any = None, **params: Any
    ) -> Sequence[Row]:
        sql = self.statement(routine, tuple(params))
        values = tuple(encode_param(v) for v in params.values())
        operation = routine.replace("_", " ")
        if session is not None:
            try:
                return await self._fetch_in_session(session, sql, values)
            except Exception as exc:
                raise map_mssql_error(exc, operation) from exc
        if connection is not None:  # in the transaction of _in_transaction: the procedure joins it
            try:
                return await fetch_rows(connection, sql, values)
            except Exception as exc:
                raise map_mssql_error(exc, operation) from exc

        async def run() -> Sequence[Row]:
            try:
                async with self.pool.acquire() as conn:
                    return await fetch_rows(conn, sql, values)
            except Exception as exc:
                raise map_mssql_error(exc, operation) from exc

        if retry:
            return await with_retries(operation, run)
        return await run()

    async def store_now(self) -> datetime:
        """The database's time now (``SYSDATETIMEOFFSET()``, the clock its procedures read), or the
        transport's clock when it was given one."""
        injected = self._now()
        if injected is not None:
            return injected

        async def run() -> Sequence[Row]:
            try:
                async with self.pool.acquire() as conn:
                    return await fetch_rows(conn, STORE_NOW_SQL, ())
            except Exception as exc:
                raise map_mssql_error(exc, "read the database's time") from exc

        rows = await with_retries("read the database's time", run)
        moment: datetime = rows[0]["now"]  # (aware: datetimeoffset goes through decode_datetimeoffset)
        return moment

    async def _in_transaction(self, operation: str, work: Callable[[Any], Awaitable[T]]) -> T:
        """``work(conn)`` in one explicit transaction on a pooled connection (each procedure sees
        ``@@TRANCOUNT > 0`` and joins it), tried again as a whole after a deadlock."""

        async def run() -> T:
            try:
                async with self.pool.acquire() as conn:
                    await fetch_rows(conn, "BEGIN TRANSACTION", ())
                    try:
                        result = await work(conn)
                        await fetch_rows(conn, "COMMIT TRANSACTION", ())
                    except BaseException:
                        with contextlib.suppress(Exception):
                            await fetch_rows(conn, "IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION", ())
                        raise
                    return result
            except Exception as exc:
                raise map_mssql_error(exc, operation) from exc

        return await with_retries(operation, run)

    async def _fetch_in_session(self, session: Any, sql: str, values: Sequence[Any]) -> list[Row]:
        """Runs the call on the caller's SQLAlchemy session (``mssql+aioodbc://``), inside its
        transaction: the procedure joins it, and a rollback by the caller undoes the call."""
        from .session import SessionExecutor

        conn = await SessionExecutor(session).connection()
        result = await conn.exec_driver_sql(sql, tuple(values))
        if not result.returns_rows:
            return []
        return [normalise_row(dict(r)) for r in result.mappings().all()]

    async def migrate(self) -> list[str]:
        """Applies the pending migrations; returns the names applied now."""

        async def run() -> list[str]:
            try:
                async with self.pool.acquire() as conn:
                    return await apply_mssql_migrations(conn)
            except Exception as exc:
                raise map_mssql_error(exc, "migrate") from exc

        return await with_retries("migrate", run)

    async def dialect_issues(self) -> list[BindingIssue]:
        """READ_COMMITTED_SNAPSHOT must be ON; LISTEN/NOTIFY does not exist (consumers poll)."""
        issues: list[BindingIssue] = []
        try:
            async with self.pool.acquire() as conn:
                rows = await fetch_rows(conn, _RCSI_PROBE, ())
        except Exception as exc:
            mapped = map_mssql_error(exc, "validate bindings")
            issues.append(BindingIssue(
                severity="Warning", subject="READ_COMMITTED_SNAPSHOT",
                message=f"could not read the database's READ_COMMITTED_SNAPSHOT setting: {mapped}",
            ))
            rows = []
        if rows and not rows[0]["is_read_committed_snapshot_on"]:
            database = str(rows[0]["database_name"]).replace("]", "]]")
            issues.append(BindingIssue(
                severity="Error", subject="READ_COMMITTED_SNAPSHOT",
                message=(
                    "READ_COMMITTED_SNAPSHOT is OFF: without row versioning, publishers, claimers and "
                    "operator reads block each other. As an administrator, run "
                    f"ALTER DATABASE [{database}] SET READ_COMMITTED_SNAPSHOT ON WITH ROLLBACK IMMEDIATE "
                    "(it rolls back open transactions of that database, so pick a quiet moment)"
                ),
            ))
        issues.extend(BindingIssue(severity="Info", subject="mssql", message=note) for note in self.capabilities.notes)
        return issues

    # -- helpers for tests and tools ---------------------------------------------------------

    async def run_in_connection(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        """Runs ``fn`` with a pooled aioodbc connection (for tooling; not part of the contract)."""
        async with self.pool.acquire() as conn:
            return await fn(conn)
