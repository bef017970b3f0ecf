"""The PostgreSQL transport: every operation is one call of a ``workqueue.*`` SQL function."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar, cast

import asyncpg

from ..core.clock import Clock
from ..core.database_url import (
    database_scheme,
    encoded_user_info,
    libpq_tls,
    pop_connect_timeout,
    pop_statement_cache_size,
    without_client_only,
)
from ..core.envelope import PreparedMessage, PublishResult
from ..core.errors import ConfigurationError
from ..core.redaction import redacting_logger
from ..core.transport import Capabilities
from .end_notices import EndNotices
from .errors import map_error, with_retries
from .listener import NotificationListener, NotificationSender
from .pool import ConnectionPool
from .postgres_migrations import apply_postgres_migrations
from .routines import RandomSource, RoutineTransport, Row, accepted, backoff_schedule_json, publish_result
from .session import SessionExecutor, after_commit, statement_failed, wakes_after_commit

log = redacting_logger("fastapi_workqueue.postgres")

T = TypeVar("T")

CHANNEL = "workqueue"
POOL_CLOSE_SECONDS = 1.0
"""How long a close waits for the server to see the pool's connections off before dropping them."""


def to_asyncpg_dsn(url: str) -> str:
    """``postgresql+asyncpg://…`` (SQLAlchemy style) → ``postgresql://…`` (libpq style), its TLS
    mode as libpq writes it (``ssl=require`` → ``sslmode=require``)."""
    if database_scheme(url) not in ("postgresql", "postgres"):
        raise ConfigurationError(f"database URL scheme {url.partition('://')[0]!r} is not PostgreSQL")
    return libpq_tls(without_client_only(f"postgresql://{encoded_user_info(url.partition('://')[2])}"))


async def _init_connection(conn: asyncpg.Connection[Any]) -> None:
    # jsonb travels as text both ways: the library parses it itself, in both the pool and the
    # caller's-session paths.
    await conn.set_type_codec(
        "jsonb", encoder=lambda v: v, decoder=lambda v: v, schema="pg_catalog", format="text"
    )


class PostgresTransport(RoutineTransport):
    """The database transport on PostgreSQL through a pool of asyncpg connections (:mod:`.pool`)."""

    name = "postgresql"
    dialect = "postgresql"
    empty_attributes = None  # the publish routine stores a missing value as '{}'
    shares_repeated_values = True
    capabilities = Capabilities(
        ordered=True,
        exclusive=True,
        transactional_publish=True,
        wakeups=True,
        runtime_roles=True,
    )

    def __init__(
        self,
        url: str,
        *,
        pool_min_size: int = 1,
        pool_max_size: int = 10,
        listen: bool = True,
        connect_timeout: float = 10.0,
        rng: RandomSource | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(rng=rng, clock=clock)
        self.url = url
        dsn, url_timeout = pop_connect_timeout(to_asyncpg_dsn(url))
        dsn, self._statement_cache_size = pop_statement_cache_size(dsn)
        self._dsn = dsn
        self._pool_min_size = pool_min_size
        self._pool_max_size = pool_max_size
        self._connect_timeout = url_timeout if url_timeout is not None else connect_timeout
        self._pool: ConnectionPool | None = None
        self._listen = listen
        self._listener: NotificationListener | None = None
        self._sender: NotificationSender | None = None
        self._statements: dict[tuple[str, tuple[str, ...]], str] = {}
        self._ends = EndNotices(self._dsn)
        self._own_publishes = 0
        """Publishes of one message in a transaction of their own under way (see :meth:`_publish_via`)."""

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Creates the pool (and the LISTEN connection). Fails fast with a clear error."""
        if self._pool is not None:
            return
        try:
            pool = ConnectionPool(self._connect, min_size=self._pool_min_size, max_size=self._pool_max_size)
            await pool.open()
            self._pool = pool
            self._sender = NotificationSender(CHANNEL, pool.acquire)
        except Exception as exc:
            raise map_error(exc, f"connecting to {self._safe_url()}") from exc
        if self._wakeup_listeners:
            await self._start_wakeups()

    async def _start_wakeups(self) -> None:
        # Only a process that consumes listens: a publisher would receive every notification.
        if self._listen and self._listener is None and self._pool is not None:
            listener = NotificationListener(self._dsn, CHANNEL, self._dispatch_wakeup)
            await listener.start()
            self._listener = listener

    @contextlib.asynccontextmanager
    async def watching_end(self, message_id: uuid.UUID) -> AsyncIterator[asyncio.Event | None]:
        """While entered, an event set when the message's delivery ends (``watch_message`` marks it,
        the ``delivery_ended`` trigger notifies) or the LISTEN connection came back; the caller
        reads the status again each time. None for a transport made with ``listen=False``
        (``WORKQUEUE_LISTEN=0``): the caller polls."""
        if not self._listen:
            yield None
            return
        event = asyncio.Event()
        await self._ends.add(message_id, event)
        try:
            await self.call("watch_message", p_message_id=message_id)
            yield event
        finally:
            self._ends.remove(message_id, event)

    async def close(self) -> None:
        await self._ends.close()
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None
        if self._sender is not None:
            sender, self._sender = self._sender, None
            await sender.close()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close(within=POOL_CLOSE_SECONDS)  # (a server that does not answer: dropped after it)

    async def _connect(self) -> asyncpg.Connection[Any]:
        options: dict[str, Any] = ({} if self._statement_cache_size is None
                                   else {"statement_cache_size": self._statement_cache_size})
        conn: asyncpg.Connection[Any] = await asyncpg.connect(self._dsn, timeout=self._connect_timeout, **options)
        try:
            await _init_connection(conn)
        except BaseException:
            conn.terminate()
            raise
        return conn

    def _safe_url(self) -> str:
        """The URL without its credentials: neither ``user:password@`` nor the query (which may
        carry ``?password=``)."""
        scheme, _, rest = self.url.partition("://")
        host = rest.rsplit("@", 1)[-1].split("?", 1)[0]
        return f"{scheme}://{host}"

    @property
    def pool(self) -> ConnectionPool:
        if self._pool is None:
            raise RuntimeError("the transport is not open; use it inside the WorkQueue's lifespan")
        return self._pool

    async def _publish_via(self, topic: str, messages: Sequence[PreparedMessage], **via: Any) -> list[PublishResult]:
        """One message without a deduplication key goes to ``publish_one``: the same answers as
        ``publish``, with a value per parameter instead of arrays of one. Quiet (``p_quiet``), it
        sends no NOTIFY in the publishing transaction: the subscriptions it names are woken once
        that transaction has committed (:meth:`_wake_after_commit`). Inside a transaction of the
        transport's own (``connection=``, a settle's follow-ups), or of an ``AsyncConnection``
        (whose commit event comes before the commit), it notifies in the transaction. So does a
        publish in a transaction of its own while no other such publish of this process is under
        way: its commit has no commit of ours to hold up, and the consumers hear of it at the commit
        itself, without a second round trip on a second connection (docs/design/publish-paths.md)."""
        if len(messages) != 1 or messages[0].deduplication_key is not None:
            return await super()._publish_via(topic, messages, **via)
        m = messages[0]
        session = via.get("session")
        own = session is None and via.get("connection") is None  # a transaction of its own
        quiet = (own and self._own_publishes > 0) or (session is not None and wakes_after_commit(session))
        self._own_publishes += own
        try:
            rows = await self._publish_one(topic, m, quiet, via)
        finally:
            self._own_publishes -= own
        if not rows:  # no rows: Accepted (and, when quiet, nobody to wake)
            return [accepted(m)]
        row = rows[0]
        if quiet and row["wake_subscriptions"] is not None:
            self._wake_after_commit(session, row["wake_subscriptions"])
            return [accepted(m)]
        return [publish_result(row, m)]

    async def _publish_one(self, topic: str, m: PreparedMessage, quiet: bool, via: dict[str, Any]) -> Sequence[Row]:
        return await self.call(
            "publish_one",
            **via,
            p_topic=topic,
            p_message_id=m.message_id,
            p_partition_key=m.partition_key,
            p_attributes=m.attributes_json if m.attributes or m.headers else self.empty_attributes,
            p_payload=m.payload_json,
            p_payload_ref=m.payload_ref,
            p_correlation_id=m.correlation_id,
            p_content_hash=m.content_hash,
            p_delay=m.delay_seconds,
            p_not_before=m.not_before,
            p_max_attempts=m.max_attempts,
            p_backoff_schedule=backoff_schedule_json(m),
            p_envelope_bytes=m.envelope_bytes,
            p_priority=m.priority or None,
            p_quiet=quiet,
        )

    async def _call_each(self, connection: Any, routine: str, calls: list[dict[str, Any]]) -> None:
        """All the calls in one round trip: the driver sends the statements of ``executemany`` together."""
        if len(calls) < 2:
            await super()._call_each(connection, routine, calls)
            return
        try:
            await connection.executemany(self._statement(routine, tuple(calls[0])), [tuple(c.values()) for c in calls])
        except Exception as exc:
            raise map_error(exc, routine.replace("_", " ")) from exc

    def _wake_after_commit(self, session: Any, subscription_ids: Sequence[int]) -> None:
        """NOTIFY ``subscription_ids`` once ``session``'s transaction commits, or now when the
        publish ran in a transaction of its own (committed by the time it answered)."""
        sender = self._sender
        if sender is None:
            return
        if session is None:
            sender.send(subscription_ids)
        else:
            after_commit(session, lambda: sender.send(subscription_ids))

    async def call(
        self, routine: str, *, retry: bool = True, session: Any = None, connection: Any = None, **params: Any
    ) -> Sequence[Row]:
        """``SELECT * FROM workqueue.<routine>(p_a => $1, …)``: named arguments, so a parameter
        that the function does not have is an error, never a silent shift. With ``connection`` (an
        asyncpg connection in a transaction, :meth:`_in_transaction`) it runs there, not retried."""
        sql = self._statement(routine, tuple(params))
        # An array of nothing but NULLs travels as one NULL: every routine reads its arrays with a
        # multi-argument unnest() (which pads) or = ANY(), so the meaning is the same.
        values = []
        for value in params.values():
            if type(value) is list and (not value or value[0] is None) and value.count(None) == len(value):
                value = None
            values.append(value)
        if session is not None:
            try:
                return cast(Sequence[Row], await fetch_asyncpg(session, sql, values))
            except Exception as exc:
                raise map_error(exc, routine.replace("_", " ")) from exc
        if connection is not None:
            try:
                return cast(Sequence[Row], await connection.fetch(sql, *values))
            except Exception as exc:
                raise map_error(exc, routine.replace("_", " ")) from exc
        try:  # the first try without the retry wrapper: this is the path of every queue operation
            return await self._fetch(sql, values)
        except Exception as exc:
            if not retry:
                raise map_error(exc, routine.replace("_", " ")) from exc
            failure = exc
        return await with_retries(
            routine.replace("_", " "), functools.partial(self._fetch, sql, values), first_failure=failure
        )

    def _statement(self, routine: str, names: tuple[str, ...]) -> str:
        """``SELECT * FROM workqueue.<routine>(p_a => $1, …)`` for these argument names (kept once built)."""
        sql = self._statements.get((routine, names))
        if sql is None:
            args = ", ".join(f"{name} => ${i}" for i, name in enumerate(names, 1))
            sql = f"SELECT * FROM workqueue.{routine}({args})"
            self._statements[(routine, names)] = sql
        return sql

    async def store_now(self) -> datetime:
        """The database's time now (``clock_timestamp()``), or the transport's clock when it was given one."""
        injected = self._now()
        if injected is not None:
            return injected
        try:
            rows = await self._fetch("SELECT clock_timestamp() AS now", [])
        except Exception as exc:  # (as every call: the library's own error, which its callers handle)
            raise map_error(exc, "read the database's time") from exc
        moment: datetime = rows[0]["now"]
        return moment

    async def _fetch(self, sql: str, values: list[Any]) -> Sequence[Row]:
        pool = self.pool
        conn = pool.take_idle() or await pool.get()
        reusable = False
        try:
            rows = cast(Sequence[Row], await conn.fetch(sql, *values))
            reusable = True
            return rows
        except asyncpg.exceptions.InternalClientError:
            # asyncpg left the connection in an undefined protocol state ("cannot switch to
            # state 12; another operation (2) is in progress", seen as the server restarts):
            # given back as it is, it would fail the next call that gets it from the pool.
            conn.terminate()
            raise
        except Exception:
            reusable = True  # a statement that failed (and rolled back) leaves the connection usable
            raise
        finally:
            # A use that ended in a cancellation (or another BaseException) may have left a
            # statement being cancelled on the server: such a connection is not reused.
            pool.put(conn, reusable=reusable)

    async def _in_transaction(self, operation: str, work: Callable[[Any], Awaitable[T]]) -> T:
        """``work(conn)`` on one pooled connection in one transaction, tried again as a whole after
        a deadlock, a serialization failure or a dropped connection."""

        async def attempt() -> T:
            async with self.pool.acquire() as conn, conn.transaction():
                return await work(conn)

        return await with_retries(operation, attempt)

    async def migrate(self) -> list[str]:
        """Applies the pending migrations; returns the names applied now."""

        async def call() -> list[str]:
            async with self.pool.acquire() as conn:
                return await apply_postgres_migrations(conn)

        return await with_retries("migrate", call)

    # -- helpers for tests and tools ---------------------------------------------------------

    async def run_in_connection(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        """Runs ``fn`` with a pooled connection (for tooling; not part of the transport contract)."""
        async with self.pool.acquire() as conn:
            return await fn(conn)


async def fetch_asyncpg(session: Any, sql: str, args: Sequence[Any]) -> Sequence[Any]:
    """:meth:`.session.SessionExecutor.fetch` for a session on SQLAlchemy's asyncpg dialect, straight on its
    driver connection once the database transaction is open: the same statement in the same
    transaction, without SQLAlchemy's execution layer (about 100 µs of CPU a call).

    Only public interfaces decide it: the pool's ``driver_connection`` (the asyncpg connection)
    and asyncpg's own ``is_in_transaction()``, which is true only once the server has begun the
    transaction. SQLAlchemy begins it lazily, at the session's first statement; until then (or on
    any other driver) the statement goes through SQLAlchemy, which begins the transaction first.
    Rows are asyncpg records."""
    executor = SessionExecutor(session)
    conn = await executor.connection()
    raw = await conn.get_raw_connection()
    driver = raw.driver_connection
    if not isinstance(driver, asyncpg.Connection) or not driver.is_in_transaction():
        return await executor.fetch(sql, args)
    try:
        rows: Sequence[Any] = await driver.fetch(sql, *args)
    except asyncpg.PostgresError:
        statement_failed(conn)  # (the transaction is aborted: its commit is refused, not a silent rollback)
        raise
    return rows
