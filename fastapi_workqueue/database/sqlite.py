"""The SQLite transport: the embedded default, one file, no server.

Every operation is a routine of :mod:`.sqlite_routines` run in one ``BEGIN IMMEDIATE``
transaction: SQLite has a single writer, so a claim is atomic across every process that opens
the file. WAL mode lets readers go on while a write runs; ``busy_timeout`` makes a process wait
for the writer instead of failing. Several worker processes on one file stay correct (fencing,
keys, leases are the same as on PostgreSQL); throughput is that of one writer.

What SQLite cannot do: LISTEN/NOTIFY (other processes find new work by polling; consumers in
the publishing process are woken directly) and roles (anyone who can open the file can write
it). ``validate-bindings`` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sqlite3
import time
from collections.abc import Sequence
from typing import Any

from ..core.errors import ConfigurationError, TransportError
from ..core.reports import BindingIssue
from ..core.transport import Capabilities
from .errors import with_retries
from .routines import RoutineTransport, Row
from .sql_files import migrations, read
from .sqlite_routines import READ_ONLY, ROUTINES, Call

BUSY_TIMEOUT_MS = 10_000

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


def load_queries() -> dict[str, str]:
    """The named statements of ``sql/sqlite/queries.sql``."""
    text = read("sqlite", "queries.sql")
    parts = _NAME.split(text)
    return {parts[i]: parts[i + 1].strip().rstrip(";") for i in range(1, len(parts), 2)}


def sqlite_path(url: str) -> str:
    """``sqlite+aiosqlite:///relative.db`` / ``sqlite:////absolute.db`` → a file path."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme.startswith("sqlite"):
        raise ValueError(f"database URL {url!r} is not SQLite; use sqlite+aiosqlite:///path/to/file.db")
    path = rest[1:] if rest.startswith("/") else rest
    path = path.split("?", 1)[0]
    if not path or path == ":memory:":
        raise ConfigurationError("SQLite needs a file (several connections and processes share it), not :memory:")
    return path


def _directory_exists(path: str) -> bool:
    return os.path.isdir(os.path.dirname(os.path.abspath(path)))


def split_statements(script: str) -> list[str]:
    """A SQL script as its complete statements (DDL of a migration file)."""
    statements: list[str] = []
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            if buffer.strip():
                statements.append(buffer.strip())
            buffer = ""
    if buffer.strip() and not all(s.strip().startswith("--") for s in buffer.strip().splitlines()):
        statements.append(buffer.strip())
    return statements


class _ConnectionExecutor:
    """Runs named statements on the transport's own aiosqlite connection."""

    def __init__(self, conn: Any, queries: dict[str, str]) -> None:
        self._conn = conn
        self._queries = queries

    async def fetch(self, query: str, /, **params: Any) -> list[dict[str, Any]]:
        cursor = await self._conn.execute(self._queries[query], params)
        try:
            rows = await cursor.fetchall()
            columns = [c[0] for c in cursor.description or ()]
        finally:
            await cursor.close()
        return [dict(zip(columns, row, strict=True)) for row in rows]

    async def execute(self, query: str, /, **params: Any) -> int:
        cursor = await self._conn.execute(self._queries[query], params)
        try:
            return int(cursor.rowcount)
        finally:
            await cursor.close()


class _SessionExecutor:
    """Runs named statements on a caller's SQLAlchemy session, inside its transaction."""

    def __init__(self, session: Any, queries: dict[str, str]) -> None:
        from .session import SessionExecutor

        self._session = SessionExecutor(session)
        self._queries = queries

    async def fetch(self, query: str, /, **params: Any) -> list[dict[str, Any]]:
        conn = await self._session.connection()
        result = await conn.exec_driver_sql(self._queries[query], params)
        return [dict(row) for row in result.mappings().all()] if result.returns_rows else []

    async def execute(self, query: str, /, **params: Any) -> int:
        conn = await self._session.connection()
        result = await conn.exec_driver_sql(self._queries[query], params)
        return int(result.rowcount)


class SqliteTransport(RoutineTransport):
    """The database transport on one SQLite file, through aiosqlite."""

    name = "sqlite"
    dialect = "sqlite"
    capabilities = Capabilities(
        ordered=True,
        exclusive=True,
        transactional_publish=True,
        wakeups=False,
        runtime_roles=False,
        notes=(
            "no LISTEN/NOTIFY: consumers in other processes find new work by polling",
            "no roles: whoever can open the file can change it",
        ),
    )

    def __init__(self, url: str, **_options: Any) -> None:
        super().__init__()
        self.url = url
        self.path = sqlite_path(url)
        self._conn: Any = None
        self._lock = asyncio.Lock()
        self._queries = load_queries()

    async def open(self) -> None:
        if self._conn is not None:
            return
        try:
            import aiosqlite
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise ConfigurationError("SQLite needs aiosqlite: pip install 'fastapi-workqueue[sqlite]'") from exc
        if not _directory_exists(self.path):
            raise ConfigurationError(f"the directory of the SQLite file {self.path!r} does not exist; create it")
        try:
            conn = await aiosqlite.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        except sqlite3.Error as exc:
            raise ConfigurationError(f"cannot open the SQLite file {self.path!r}: {exc}") from exc
        try:
            await conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            await conn.execute("PRAGMA journal_mode = WAL")
            await conn.execute("PRAGMA synchronous = FULL")  # an Accepted message survives a power cut
            await conn.execute("PRAGMA foreign_keys = ON")
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def migrate(self) -> list[str]:
        """Applies every migration not yet recorded, in one transaction, one process at a time."""
        async with self._transaction() as conn:
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migration (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
                "checksum TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
            cursor = await conn.execute("SELECT version, checksum FROM schema_migration")
            done = {row[0]: row[1] for row in await cursor.fetchall()}
            await cursor.close()
            applied: list[str] = []
            for migration in migrations("sqlite"):
                label = f"{migration.version:04d}_{migration.name}"
                if migration.version in done:
                    if done[migration.version] != migration.checksum:
                        raise ConfigurationError(
                            f"migration {label} was changed after it was applied to this database; "
                            "ship schema changes as a new migration file"
                        )
                    continue
                for statement in split_statements(migration.sql):
                    await conn.execute(statement)
                await conn.execute(
                    "INSERT INTO schema_migration (version, name, checksum, applied_at) VALUES (?, ?, ?, ?)",
                    (migration.version, migration.name, migration.checksum, time.time()),
                )
                applied.append(label)
            return applied

    @contextlib.asynccontextmanager
    async def _transaction(self, *, write: bool = True) -> Any:
        if self._conn is None:
            raise RuntimeError("the transport is not open; use it inside the WorkQueue's lifespan")
        async with self._lock:
            await self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield self._conn
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._conn.execute("ROLLBACK")
                raise
            await self._conn.execute("COMMIT")

    async def call(
        self, routine: str, *, retry: bool = True, session: Any = None, **params: Any
    ) -> Sequence[Row]:
        fn = ROUTINES[routine]
        operation = routine.replace("_", " ")
        if session is not None:
            call = Call(_SessionExecutor(session, self._queries), time.time())
            try:
                return await fn(call, **params)
            except (sqlite3.Error, ValueError) as exc:
                raise _mapped(exc, operation) from exc

        async def run() -> Sequence[Row]:
            try:
                async with self._transaction(write=routine not in READ_ONLY) as conn:
                    call = Call(_ConnectionExecutor(conn, self._queries), time.time())
                    rows = await fn(call, **params)
            except (sqlite3.Error, ValueError) as exc:
                raise _mapped(exc, operation) from exc
            for subscription_id in call.wake:
                self._dispatch_wakeup(str(subscription_id))
            return rows

        if retry:
            return await with_retries(operation, run)
        return await run()

    async def dialect_issues(self) -> list[BindingIssue]:
        return [BindingIssue(severity="Info", subject="sqlite", message=note) for note in self.capabilities.notes]


def _mapped(exc: BaseException, operation: str) -> Exception:
    if isinstance(exc, ValueError):
        return ConfigurationError(str(exc))
    text = str(exc)
    if "no such table" in text:
        return ConfigurationError(
            f"{operation}: the work queue schema is missing ({text}); run `queue.migrate()` (or `workqueue migrate`), "
            "or set WORKQUEUE_AUTO_MIGRATE=1"
        )
    return TransportError(f"{operation}: {text}", retryable="locked" in text or "busy" in text)
