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
import functools
import os
import re
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiosqlite

from ..core.clock import Clock
from ..core.database_url import FILE_URL_HINT, missing_sqlite_directory, sqlite_path
from ..core.errors import ConfigurationError, SchemaMissing, TransportError, TransportUnavailable
from ..core.reports import BindingIssue
from ..core.transport import Capabilities
from . import sqlite_history  # noqa: F401  (registers the stats history routines)
from .migration_plan import pending
from .routines import RandomSource, RoutineTransport, Row
from .session import after_commit
from .sql_files import read
from .sqlite_routines import READ_ONLY, ROUTINES, Call
from .sqlite_thread import ThreadConnection, run_to_end

_CREATED_TABLE = re.compile(r"^CREATE TABLE (?:IF NOT EXISTS )?(\w+)", re.MULTILINE | re.IGNORECASE)
"""The tables a migration creates."""

BUSY_TIMEOUT_MS = 30_000
"""How long one operation waits for the file's write lock in all (``WORKQUEUE_SQLITE_BUSY_TIMEOUT_MS``):
behind this process's other callers, inside SQLite's busy handler, and between attempts."""
RETRY_PAUSE_SECONDS = 0.05
BUSY_SLICE_MS = 100
"""The longest one wait of SQLite's busy handler for another process's writer, after which the
transport looks whether its caller is still there and its bound not passed, then waits again."""

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)

T = TypeVar("T")


def load_queries() -> dict[str, str]:
    """The named statements of ``sql/sqlite/queries.sql``."""
    text = read("sqlite", "queries.sql")
    parts = _NAME.split(text)
    return {parts[i]: parts[i + 1].strip().rstrip(";") for i in range(1, len(parts), 2)}


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
    """Runs named statements on the transport's own connection, on its thread (:mod:`.sqlite_thread`):
    the awaits of a routine complete at once, so the routine runs there from start to end."""

    def __init__(self, conn: sqlite3.Connection, queries: dict[str, str]) -> None:
        self._conn = conn
        self._queries = queries

    async def fetch(self, query: str, /, **params: Any) -> list[dict[str, Any]]:
        cursor = self._conn.execute(self._queries[query], params)
        try:
            rows = cursor.fetchall()
            columns = [c[0] for c in cursor.description or ()]
        finally:
            cursor.close()
        return [dict(zip(columns, row, strict=True)) for row in rows]

    async def execute(self, query: str, /, **params: Any) -> int:
        cursor = self._conn.execute(self._queries[query], params)
        try:
            return int(cursor.rowcount)
        finally:
            cursor.close()


class _SessionExecutor:
    """Runs named statements on a caller's SQLAlchemy session, inside its transaction.

    The routine must run in a write transaction from its first statement, as on the transport's
    own connection: Python's sqlite3 driver (under SQLAlchemy) opens a transaction only at the
    first INSERT/UPDATE/DELETE, so a routine whose reads came first (publish classifies before it
    inserts) would read outside the caller's transaction and decide on state another writer
    changes before its writes run (two sessions would both accept one deduplication key). When
    the caller's connection is not in a transaction yet, the first statement is ``BEGIN
    IMMEDIATE``: the caller's transaction then holds the write lock until it commits or rolls back.

    Whether it has begun is read from public interfaces only: SQLAlchemy's ``driver_connection``
    (the aiosqlite connection) and aiosqlite's ``in_transaction`` (sqlite3's, true once the file's
    transaction is open, which SQLAlchemy's own ``in_transaction()`` is not: it begins lazily).
    """

    def __init__(self, session: Any, queries: dict[str, str]) -> None:
        from .session import SessionExecutor

        self._session = SessionExecutor(session)
        self._queries = queries
        self._conn: Any = None

    async def begin(self) -> None:
        """Joins the caller's transaction, starting it with ``BEGIN IMMEDIATE`` if it has not begun."""
        conn = await self._session.connection()
        raw = await conn.get_raw_connection()
        driver = raw.driver_connection
        if not isinstance(driver, aiosqlite.Connection):
            raise TypeError(
                f"a session on SQLite must use the sqlite+aiosqlite driver, not {type(driver).__name__}"
            )
        if not driver.in_transaction:
            await conn.exec_driver_sql("BEGIN IMMEDIATE")
        self._conn = conn

    async def fetch(self, query: str, /, **params: Any) -> list[dict[str, Any]]:
        result = await self._conn.exec_driver_sql(self._queries[query], params)
        return [dict(row) for row in result.mappings().all()] if result.returns_rows else []

    async def execute(self, query: str, /, **params: Any) -> int:
        result = await self._conn.exec_driver_sql(self._queries[query], params)
        return int(result.rowcount)


SERVER_OPTIONS = frozenset({"pool_min_size", "pool_max_size", "listen", "connect_timeout"})
"""Options of the server databases' transports that one SQLite file has no use for (the queue
passes them whatever the database)."""


class SqliteTransport(RoutineTransport):
    """The database transport on one SQLite file: its own connection on a thread of its own
    (:mod:`.sqlite_thread`), a caller's session through aiosqlite."""

    name = "sqlite"
    dialect = "sqlite"
    capabilities = Capabilities(
        ordered=True,
        exclusive=True,
        transactional_publish=True,
        wakeups=False,
        runtime_roles=False,
        savepoint_retry=False,
        notes=(
            "no LISTEN/NOTIFY: other processes poll for new work",  # short: the CLI table cuts at 60
            "no roles: whoever can open the file can change it",
        ),
    )

    def __init__(
        self, url: str, *, busy_timeout_ms: int = BUSY_TIMEOUT_MS, rng: RandomSource | None = None,
        clock: Clock | None = None, **_options: Any
    ) -> None:
        unknown = sorted(set(_options) - SERVER_OPTIONS)
        if unknown:  # (a misspelt clock= would leave the transport on the system clock in silence)
            raise TypeError(f"SqliteTransport() got an unexpected keyword argument {unknown[0]!r}; it takes "
                            "busy_timeout_ms, rng and clock (and ignores a server's pool and LISTEN options)")
        super().__init__(rng=rng, clock=clock)
        if busy_timeout_ms < 1:
            raise ConfigurationError(f"the SQLite busy timeout must be at least 1 ms, got {busy_timeout_ms}")
        self.url = url
        self.path = sqlite_path(url)
        self.busy_timeout = busy_timeout_ms / 1000
        self._conn: ThreadConnection | None = None
        self._file: tuple[int, int] | None = None  # (device, inode) of the file as it was opened
        self._file_path = self.path
        self._lock = asyncio.Lock()
        self._queries = load_queries()
        self._busy_ms = busy_timeout_ms  # what the connection's PRAGMA busy_timeout is set to

    async def open(self) -> None:
        if self._conn is not None:
            return
        self._lock = asyncio.Lock()  # (of this open's event loop: a lock is bound to the first loop it waits on)
        missing = missing_sqlite_directory(self.path)
        if missing is not None:
            raise missing
        if _is_directory(self.path):  # (refused before the driver starts a thread for it)
            raise ConfigurationError(
                f"{self.path!r} is a directory, not an SQLite file; " + FILE_URL_HINT + " (a file in that directory)"
            )
        if _read_only(self.path):
            # (SQLite would open it read-only, and every write would fail later, one at a time)
            raise _cannot_write(self.path, PermissionError("the file is read-only for this process"))
        try:
            conn = await ThreadConnection.connect(self.path, self.busy_timeout)
        except sqlite3.Error as exc:
            raise _cannot_write(self.path, exc) from exc
        try:
            await conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
            rows = await _switch_to_wal(conn, self.busy_timeout)
            mode = str(rows[0][0]).lower() if rows else "unknown"
            if mode != "wal":
                # Without WAL, readers block the writer and "database is locked" errors follow.
                raise ConfigurationError(
                    f"the SQLite file {self.path!r} could not be switched to WAL mode (journal_mode is {mode}); "
                    "put it on a local disk, in a directory the process can write"
                )
            await conn.execute("PRAGMA synchronous = FULL")  # an Accepted message survives a power cut
            await conn.execute("PRAGMA foreign_keys = ON")
        except sqlite3.DatabaseError as exc:
            await conn.close()
            if "not a database" in str(exc):
                raise ConfigurationError(
                    f"{self.path!r} is not an SQLite database ({exc}); point WORKQUEUE_DATABASE_URL at a new or "
                    "existing queue file"
                ) from exc
            if "unable to open" in str(exc) or "readonly" in str(exc):
                raise _cannot_write(self.path, exc) from exc
            raise _mapped(exc, "open the SQLite file", self._busy) from exc
        except BaseException:
            await conn.close()
            raise
        self._conn = conn
        self._file_path = _absolute(self.path)  # (as SQLite opened it: a later chdir changes no file)
        self._file = _file_identity(self._file_path)

    def _check_file(self, operation: str) -> None:
        """Refuses a write once the file this process opened was deleted or replaced at its path: it
        would go on into the unlinked file, answer Accepted, and be lost when the process ends
        (while other processes use a new file at the path)."""
        opened = self._file
        if opened is None:
            return
        now = _file_identity(self._file_path)
        if now != opened:
            raise TransportError(  # (not retried: it does not pass by itself)
                f"{operation}: the SQLite file {self.path!r} was deleted or replaced while this process had it open; "
                "what it wrote since is in the old file, which no other process sees: nothing more is written "
                "to it. Restore the file, or restart the process to open the file at the path")

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def migrate(self) -> list[str]:
        """Applies every migration not yet recorded, in one transaction, one process at a time."""

        def apply(conn: sqlite3.Connection) -> list[str]:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migration (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
                "checksum TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
            recorded = {row[0]: row[1] for row in conn.execute("SELECT version, checksum FROM schema_migration")}
            applied: list[str] = []
            todo = pending("sqlite", recorded)
            if not recorded:  # (a file the queue has not migrated yet)
                self._refuse_foreign_tables(conn, "\n".join(m.sql for m in todo))
            for migration in todo:
                for statement in split_statements(migration.sql):
                    try:
                        conn.execute(statement)
                    except sqlite3.OperationalError as exc:
                        raise ConfigurationError(
                            f"the SQLite file {self.path!r} cannot take the queue's schema ({migration.label}: "
                            f"{exc}); give the queue a file of its own"
                        ) from exc
                conn.execute(
                    "INSERT INTO schema_migration (version, name, checksum, applied_at) VALUES (?, ?, ?, ?)",
                    (migration.version, migration.name, migration.checksum, time.time()),
                )
                applied.append(migration.label)
            return applied

        def recorded_now(conn: sqlite3.Connection) -> dict[int, str] | None:
            try:
                return {row[0]: row[1] for row in conn.execute("SELECT version, checksum FROM schema_migration")}
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return None
                raise

        try:
            # (read first, beside a writer: a file migrated already takes no write lock, so a
            # process that starts while another writes does not wait for it)
            recorded = await self._transaction(recorded_now, write=False)
            if recorded is not None and not pending("sqlite", recorded):
                return []
            return await self._transaction(apply)
        except sqlite3.Error as exc:
            raise _mapped(exc, "migrate", self._busy) from exc

    def _refuse_foreign_tables(self, conn: sqlite3.Connection, schema: str) -> None:
        """Before the first migration of a file: the tables it would create must not exist already
        (another application's, sharing the file), or the start fails on SQLite's bare error."""
        wanted = set(_CREATED_TABLE.findall(schema)) - {"schema_migration"}
        taken = sorted(wanted & {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")})
        if taken:
            raise ConfigurationError(
                f"the SQLite file {self.path!r} already holds tables named as the queue's ({', '.join(taken)}): "
                "give the queue a file of its own (WORKQUEUE_DATABASE_URL=sqlite+aiosqlite:///queue.db), or "
                "rename those tables; the queue's tables are listed in docs/sqlite.md"
            )

    async def _transaction(self, work: Callable[[sqlite3.Connection], T], *, write: bool = True,
                           deadline: float | None = None) -> T:
        """``work(connection)`` in one transaction of the transport's connection, run whole on its
        thread (:mod:`.sqlite_thread`), one at a time in this process.

        ``deadline`` (monotonic) bounds the whole wait for the write lock: for this process's
        other callers first, then in SQLite's busy handler, whose timeout is lowered to what is
        left. Past it the call fails with a retryable :class:`TransportError` and nothing of it
        was applied.

        A caller cancelled while the transaction waits or runs (a host stopping its sweeper) has
        it rolled back, as :meth:`.ThreadConnection.transaction` says.
        """
        conn = self._conn
        if conn is None:
            raise RuntimeError("the transport is not open; use it inside the WorkQueue's lifespan")
        if deadline is None:
            deadline = time.monotonic() + self.busy_timeout
        try:
            # asyncio.timeout, not wait_for: on Python 3.11, wait_for can swallow a cancellation of
            # the caller that arrives as the lock is granted (a sweeper loop would never end).
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                await self._lock.acquire()
        except TimeoutError:
            raise self._busy() from None
        try:
            if write:
                self._check_file("a write")
            return await conn.transaction(functools.partial(self._begin, write, deadline), work)
        finally:
            self._lock.release()

    def _begin(self, write: bool, deadline: float, conn: sqlite3.Connection, cancelled: Callable[[], bool]) -> None:
        """``BEGIN IMMEDIATE`` (or ``BEGIN`` for a read), on the connection's thread. While another
        process holds the write lock, SQLite's busy handler waits for it in slices of at most
        BUSY_SLICE_MS, and between them this gives up once ``deadline`` (monotonic) has passed or
        the caller is gone: SQLite's own wait cannot be interrupted, a slice ends soon enough."""
        if not write:
            conn.execute("BEGIN")
            return
        while True:
            left = max(int((deadline - time.monotonic()) * 1000), 1)
            wanted = min(left, BUSY_SLICE_MS)
            if wanted != self._busy_ms:
                conn.execute(f"PRAGMA busy_timeout = {wanted}")
                self._busy_ms = wanted
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if not is_busy(exc) or cancelled() or time.monotonic() >= deadline:
                    raise

    def _busy(self) -> TransportError:
        return TransportError(
            f"the SQLite file {self.path!r} is busy: its write lock was not free within "
            f"{self.busy_timeout:g} s (WORKQUEUE_SQLITE_BUSY_TIMEOUT_MS); nothing of this call was applied, "
            "retry it", retryable=True,
        )

    async def call(
        self, routine: str, *, retry: bool = True, session: Any = None, connection: Any = None, **params: Any
    ) -> Sequence[Row]:
        fn = ROUTINES[routine]
        if connection is not None:  # a Call of _in_transaction: the same transaction and clock
            return await fn(connection, **params)
        operation = routine.replace("_", " ")
        if session is not None:
            self._check_file(operation)
            executor = _SessionExecutor(session, self._queries)
            try:
                await executor.begin()
                call = Call(executor, time.time())  # the time once the write lock is held, as below
                rows = await fn(call, **params)
            except (sqlite3.Error, ValueError) as exc:
                raise _mapped(exc, operation, self._busy) from exc
            except Exception as exc:  # SQLAlchemy wraps the driver's error: map the original
                orig = getattr(exc, "orig", None)
                if isinstance(orig, sqlite3.Error):
                    raise _mapped(orig, operation, self._busy) from exc
                raise
            if call.wake:
                self._wake_after_commit(session, call.wake)
            return rows
        return await self._run(operation, lambda c: fn(c, **params), write=routine not in READ_ONLY, retry=retry)

    async def api_key_touch(self, key_id: str) -> None:
        """Marks a key used, at most once a minute. Whether it is due is read first, beside the
        writer: a REST call takes the file's write lock only when the mark is due, instead of
        waiting behind a long write (a request transaction that published) on every call."""
        async def due(c: Call) -> bool:
            return bool(await c.ex.fetch("api_key_touch_due", id=str(uuid.UUID(key_id)), now=c.now))

        if await self._run("api key touch", due, write=False, retry=True):
            await super().api_key_touch(key_id)

    async def _in_transaction(self, operation: str, work: Callable[[Any], Awaitable[T]]) -> T:
        """``work(call)`` in one ``BEGIN IMMEDIATE`` on the transport's connection: each routine
        called with ``connection=call`` runs its statements there, at the one time the call took."""
        return await self._run(operation, work, write=True, retry=True)

    async def _run(self, operation: str, work: Callable[[Call], Awaitable[T]], *, write: bool, retry: bool) -> T:
        """``work`` in one transaction of the transport's connection; then wakes the subscriptions
        it named. One bound for the whole call, however many callers wait in this process: a busy
        file is tried again while time is left, then the call fails with a retryable error."""
        deadline = time.monotonic() + self.busy_timeout
        queries = self._queries
        while True:
            def routine(conn: sqlite3.Connection) -> tuple[T, Call]:
                call = Call(_ConnectionExecutor(conn, queries), time.time())  # (the time once the lock is held)
                return run_to_end(work(call)), call

            try:
                try:
                    result, call = await self._transaction(routine, write=write, deadline=deadline)
                except (sqlite3.Error, ValueError) as exc:
                    raise _mapped(exc, operation, self._busy) from exc
            except TransportError as exc:
                if not (retry and exc.retryable) or time.monotonic() + RETRY_PAUSE_SECONDS >= deadline:
                    raise
                await asyncio.sleep(RETRY_PAUSE_SECONDS)
                continue
            for subscription_id in call.wake:
                self._dispatch_wakeup(str(subscription_id))
            return result

    def _wake_after_commit(self, session: Any, subscription_ids: set[int]) -> None:
        """Wakes this process's consumers when the caller's transaction commits (what NOTIFY does
        on PostgreSQL), as :func:`.session.after_commit` tells it. A rollback wakes nobody; on an
        ``AsyncConnection`` the listener then waits for that connection's next commit: at worst a
        spurious wake-up, which is only a hint to claim."""
        ids = sorted(subscription_ids)

        def wake() -> None:
            for subscription_id in ids:
                self._dispatch_wakeup(str(subscription_id))

        after_commit(session, wake)

    async def dialect_issues(self) -> list[BindingIssue]:
        return [BindingIssue(severity="Info", subject="sqlite", message=note) for note in self.capabilities.notes]


def _is_directory(path: str) -> bool:
    return os.path.isdir(path)


def _read_only(path: str) -> bool:
    """Whether the file exists and this process may not write it."""
    return os.path.exists(path) and not os.access(path, os.W_OK)


def _cannot_write(path: str, exc: BaseException) -> ConfigurationError:
    return ConfigurationError(
        f"cannot open the SQLite file {path!r} for writing ({exc}): the queue writes the file and, beside it, "
        "its -wal and -shm files; make the file and its directory writable by this process, on a local disk"
    )


def _absolute(path: str) -> str:
    return path if os.path.basename(path) == ":memory:" or "file::memory:" in path else os.path.abspath(path)


def _file_identity(path: str) -> tuple[int, int] | None:
    """The (device, inode) of the file at ``path``; None for an in-memory database, and (0, 0) when
    nothing is there."""
    if os.path.basename(path) == ":memory:" or "file::memory:" in path:
        return None
    try:
        found = os.stat(path)
    except OSError:
        return (0, 0)
    return (found.st_dev, found.st_ino)


def is_busy(exc: BaseException) -> bool:
    """Whether SQLite refused for want of the file's lock (its busy handler gave up)."""
    text = str(exc)
    return "locked" in text or "busy" in text


def _mapped(exc: BaseException, operation: str, busy: Callable[[], TransportError]) -> Exception:
    """The driver's error as the library's; ``busy()`` for a locked file (SQLite's own busy handler
    gave up), the one error that says what the bound is and to retry."""
    if isinstance(exc, ValueError):
        return ConfigurationError(str(exc))
    text = str(exc)
    if "no such table" in text:
        return SchemaMissing(
            f"{operation}: the work queue schema is missing ({text}); run `queue.migrate()` (or `workqueue migrate`), "
            "or set WORKQUEUE_AUTO_MIGRATE=1"
        )
    if is_busy(exc):
        return busy()
    if "disk is full" in text or "disk I/O error" in text:  # (SQLITE_FULL, SQLITE_IOERR: for a while, retried)
        return TransportUnavailable(f"{operation}: the SQLite file cannot be written now ({text}); retry later")
    return TransportError(f"{operation}: {text}")


async def _switch_to_wal(conn: ThreadConnection, wait_seconds: float) -> list[Any]:
    """``PRAGMA journal_mode = WAL`` (its rows), tried again while another process holds the file's lock.

    Two processes opening a new file at once both switch it; SQLite may answer "database is
    locked" at once instead of waiting out the busy timeout, since waiting could deadlock.
    """
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            return await conn.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.02)
