"""A database session per request, committed before the response is sent.

Publishes made by the request join its transaction: a request that fails publishes nothing. The
rule for joining (SPEC §2): a publish joins the request's transaction only while that transaction
is open and only from the request's own task. A task the request spawned, a background task, a
cleanup that runs after the response, or a call after the endpoint returned publishes in a
transaction of its own, which commits before ``publish`` answers. So ``Accepted`` always means
committed, or part of a transaction that its owner, the request, still holds and will end.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import uuid
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.database_url import (
    database_kind,
    missing_sqlite_directory,
    pop_connect_timeout,
    pop_statement_cache_size,
    split_for_sqlalchemy,
    sqlite_path,
)
from ..core.errors import ConfigurationError, SessionPoolExhausted, TransportError
from ..core.redaction import redacting_logger
from ..core.request_load import IN_ATTEMPT, RequestLoad
from ..core.session_pool import SessionPool
from .admission import FairGate

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker


@dataclass(slots=True, eq=False)
class RequestTransaction:
    """The request's session while its dependency holds it open, and the task that owns it."""

    session: AsyncSession
    task: asyncio.Task[Any] | None
    open: bool = True
    owner: object = None
    """The :class:`RequestSessions` (one per queue) whose dependency opened it."""
    failed: bool = False
    """The handler it serves raised (:func:`fail_request_transaction`): it rolls back, even when
    a dependency caught the exception and its own dependency saw none."""

    def joinable(self) -> bool:
        """True while the transaction is open and the caller runs in the request's own task."""
        if not self.open:
            return False
        try:
            current = asyncio.current_task()
        except RuntimeError:
            return False
        return current is not None and current is self.task


_current: ContextVar[RequestTransaction | None] = ContextVar("workqueue_request_transaction", default=None)


def current_request_transaction() -> RequestTransaction | None:
    """The request session the code running here would join (or None): what an attempt finds
    before it solves its dependencies, to tell its own session from one it runs inside."""
    return _current.get()


def fail_request_transaction(before: RequestTransaction | None) -> None:
    """The handler (or job) of this attempt raised: the request session it opened rolls back when
    its dependency closes, whatever the dependencies between them did with the exception. Only
    one it opened (not ``before``, the one found before its dependencies were solved: a request
    a sync-mode job runs inside keeps its own outcome)."""
    holder = _current.get()
    if holder is not None and holder is not before and holder.open and holder.task is asyncio.current_task():
        holder.failed = True


def current_session() -> AsyncSession | None:
    """The request's session when a publish made here may join it (see the module's rule), else None."""
    holder = _current.get()
    return holder.session if holder is not None and holder.joinable() else None


async def _checkout(session: AsyncSession) -> None:
    """Takes the request's connection before the endpoint runs: a pool with every connection busy
    for the pool's timeout answers 503 with ``Retry-After`` instead of failing the endpoint midway."""
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    try:
        await session.connection()
    except PoolTimeout:
        raise _busy() from None
    except Exception as exc:
        from ..core.errors import TransportUnavailable
        from ..database.errors import map_error

        mapped = map_error(getattr(exc, "orig", None) or exc, "a request's database connection")
        if not isinstance(mapped, TransportUnavailable):
            raise
        log.warning("%s", mapped)  # (the driver's text, redacted; the answer says only that it is away)
        raise _away() from None


def _sqlite_busy(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's "database is locked" (or busy) from a statement of the request's
    session, through SQLAlchemy (its ``orig``)."""
    orig = getattr(exc, "orig", None)
    if not isinstance(orig, sqlite3.OperationalError):
        return False
    from ..database.sqlite import is_busy

    return is_busy(orig)


def _busy() -> Exception:
    """503 with ``Retry-After``: no connection of the pool freed in time."""
    return _away("every database connection of this process is in use; retry shortly")


def _away(detail: str = "the database cannot be reached right now; retry shortly") -> Exception:
    """503 with ``Retry-After``: the store cannot serve the request now (unreachable, or busy)."""
    from fastapi import HTTPException

    return HTTPException(status_code=503, detail=detail, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def to_sqlalchemy_url(url: str) -> str:
    """The URL the request sessions' engine opens, checked as the queue checks its own: the async
    driver the queue uses (asyncpg, aiosqlite, aioodbc) whatever driver the URL names, since a
    publish joins the session's connection; :class:`ConfigurationError` saying what to change
    for a scheme the queue does not take, a missing extra, or an SQLite file that cannot be one."""
    kind = database_kind(url)
    rest = url.partition("://")[2]
    if kind == "sqlite":
        missing = missing_sqlite_directory(sqlite_path(url))
        if missing is not None:
            raise missing
        return f"sqlite+aiosqlite://{rest}"
    return f"{kind}+{'asyncpg' if kind == 'postgresql' else 'aioodbc'}://{rest}"


RETRY_AFTER_SECONDS = 1

log = redacting_logger("fastapi_workqueue.session")


def _unique_statement_name() -> str:
    """A prepared statement's name no other connection's statement has (behind a pooler)."""
    return f"__workqueue_{uuid.uuid4().hex}__"

REQUEST_ENDED = "fastapi_workqueue.request_ended"
"""The key in a request session's ``info`` set once its request has ended (:meth:`RequestSessions.resolve`)."""


class RequestSessions:
    """Owns the SQLAlchemy engine for request sessions, created on first use.

    Its pool is sized by the settings, not by SQLAlchemy's default (5 plus 10 overflow
    connections, opened and closed as load comes and goes): ``size`` connections per process,
    ``overflow`` more at peaks. A request that finds every connection in use waits up to
    ``timeout_seconds`` for one, then gets 503 with ``Retry-After``.
    """

    def __init__(self, url_getter: Any, pool: Callable[[], SessionPool] = SessionPool,
                 load: RequestLoad | None = None) -> None:
        self._url_getter = url_getter
        self._pool = pool
        self._load = load if load is not None else RequestLoad()
        self._engine: AsyncEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._maker: async_sessionmaker[AsyncSession] | None = None
        self._gate: FairGate | None = None
        self._wait_seconds = 5.0

    @property
    def engine(self) -> AsyncEngine:
        """The engine of the request sessions, made on first use. One made under an event loop that
        has since closed (a test's, without the app's lifespan to dispose of it) is left behind and a
        new one made: its connections belong to that loop and cannot serve another."""
        self._drop_if_stale()
        if self._engine is None:
            from sqlalchemy.ext.asyncio import create_async_engine

            url = to_sqlalchemy_url(self._url_getter())
            pool = self._pool()
            # SQLite: wait for the single writer instead of failing at once, as the queue's own calls do.
            options: dict[str, Any] = (
                {"connect_args": {"timeout": pool.sqlite_busy_seconds}} if url.startswith("sqlite") else {})
            if url.startswith("postgresql+asyncpg://"):
                # The URL's parameters (application_name, libpq's sslmode, sslrootcert, …, and
                # connect_timeout) as the queue's own pool reads them.
                url, seconds = pop_connect_timeout(url)
                _, cache_size = pop_statement_cache_size(url)
                url, driver = split_for_sqlalchemy(url)
                connect_args: dict[str, Any] = {}
                if driver is not None:
                    connect_args["dsn"] = driver
                if seconds is not None:
                    connect_args["timeout"] = seconds
                if cache_size == 0:
                    # A pooler that keeps no prepared statements (PgBouncer in transaction mode):
                    # asyncpg's own cache off too (a publish in the session runs on its connection),
                    # and SQLAlchemy's statements named uniquely, so that one never meets another's
                    # name on a server connection the pooler hands around.
                    connect_args["statement_cache_size"] = 0
                    connect_args["prepared_statement_name_func"] = _unique_statement_name
                if connect_args:
                    options = {"connect_args": connect_args}
            self._engine = create_async_engine(
                url, pool_size=pool.size, max_overflow=pool.overflow, pool_timeout=pool.timeout_seconds,
                pool_pre_ping=pool.pre_ping, **options,
            )
            if url.startswith("sqlite"):  # (a cancelled statement's connection must not keep the file locked)
                from sqlalchemy import event

                from ..database.sqlite_engine import begin_before_a_first_savepoint, roll_back_before_close

                event.listen(self._engine.sync_engine, "connect", roll_back_before_close)
                event.listen(self._engine.sync_engine, "savepoint", begin_before_a_first_savepoint)
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:  # (made outside a loop: the first loop that uses it, see _drop_if_stale)
                self._loop = None
        return self._engine

    def _drop_if_stale(self) -> None:
        if self._engine is not None and self._loop is None:  # (made outside a loop: the first one to use it)
            with contextlib.suppress(RuntimeError):
                self._loop = asyncio.get_running_loop()
        if self._engine is not None and self._loop is not None and self._loop.is_closed():
            self._engine.sync_engine.dispose(close=False)  # (dropped, not closed: their loop is gone)
            self._engine = self._maker = self._gate = None
            self._loop = None

    @property
    def sessionmaker(self) -> async_sessionmaker[AsyncSession]:
        self._drop_if_stale()
        if self._maker is None:
            from sqlalchemy.ext.asyncio import async_sessionmaker

            self._maker = async_sessionmaker(self.engine, expire_on_commit=False)
        return self._maker

    def current(self) -> AsyncSession | None:
        """The request's session a publish made here joins (:func:`current_session`), or None: only
        a session of this queue's own requests (another queue's may be another database)."""
        holder = _current.get()
        return holder.session if holder is not None and holder.owner is self and holder.joinable() else None

    def resolve(self, session: Any) -> Any:
        """The transaction a publish joins: ``session`` when given, else :meth:`current`. A
        request's own session whose request has ended (handed to a background task, say) is
        refused: its transaction was committed or rolled back with the request, and a publish on
        it would begin one that nobody commits."""
        if session is None:
            return self.current()
        info = getattr(session, "info", None)
        if isinstance(info, dict) and info.get(REQUEST_ENDED):
            raise ConfigurationError(
                "this session is the request's (queue.session), and its request has ended: its transaction "
                "was committed or rolled back with the request. Publish without session= (the publish "
                "commits on its own), or within the request"
            )
        return session

    async def dispose(self) -> None:
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None
            self._maker = None
        self._gate = None

    @property
    def gate(self) -> FairGate:
        """Admits requests to the pool first come, first served (see :mod:`.admission`)."""
        self._drop_if_stale()
        if self._gate is None:
            pool = self._pool()
            self._gate = FairGate(pool.size + pool.overflow)
            self._wait_seconds = pool.timeout_seconds
        return self._gate

    async def dependency(self) -> AsyncIterator[AsyncSession]:
        """Opens a session; commits when the endpoint returns, rolls back when it raises.

        The commit covers whatever the session holds then: an endpoint that committed early and
        went on writing has that later work committed too. The request counts in the process's
        :class:`RequestLoad` from before it waits for a connection until its session is closed
        (a handler's attempt that takes it does not count: it is the host's own work).
        """
        counted = not IN_ATTEMPT.get()
        if counted:
            self._load.enter()
        try:
            gate = self.gate
            if not await gate.acquire(self._wait_seconds):
                if not counted:  # (a handler's attempt: the runtime gives its delivery back, no try spent)
                    raise SessionPoolExhausted(
                        f"every connection of this process's session pool was in use for {self._wait_seconds:g} s")
                raise _busy()
            try:
                async with self.sessionmaker() as session:
                    await _checkout(session)
                    holder = RequestTransaction(session, asyncio.current_task(), owner=self)
                    token = _current.set(holder)
                    try:
                        yield session
                    except BaseException as exc:
                        holder.open = False
                        await session.rollback()
                        if counted and isinstance(exc, TransportError) and exc.retryable:
                            # (a publish that met a busy or unreachable store: retry later, not a bare 500)
                            log.warning("a request's publish could not be written (%s); answered 503", exc)
                            raise _away("the queue's store could not take the request's publish now (busy or "
                                        "unreachable); retry shortly") from exc
                        if counted and _sqlite_busy(exc):
                            # (the endpoint's own write met the file's lock, held by another writer past the
                            # busy timeout: the same answer as a publish that met it)
                            log.warning("a request's write found the SQLite file busy (%s); answered 503",
                                        getattr(exc, "orig", exc))
                            raise _away("the database file is busy (another writer held its lock past "
                                        "WORKQUEUE_SQLITE_BUSY_TIMEOUT_MS); retry shortly") from exc
                        raise
                    else:
                        holder.open = False
                        if holder.failed:  # (a dependency caught what the handler raised)
                            await session.rollback()
                        else:
                            await session.commit()
                    finally:
                        holder.open = False
                        session.info[REQUEST_ENDED] = True
                        _current.reset(token)
            finally:
                gate.release()
        finally:
            if counted:
                self._load.leave()
