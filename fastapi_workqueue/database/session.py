"""Runs a statement on the caller's SQLAlchemy session, inside the caller's transaction.

Only SQLAlchemy's public API decides how a publish joins that transaction: ``AsyncSession.connection()``
(which begins the session's transaction when none has), ``exec_driver_sql``, and for the drivers'
fast paths ``AsyncConnection.get_raw_connection()`` with its ``driver_connection`` and the driver's
own public transaction state (asyncpg's ``is_in_transaction()``, aiosqlite's ``in_transaction``).
No private attribute of SQLAlchemy or of a driver is read; tests/test_session_publish.py fails if a
publish does not join the caller's transaction (its rollback, or its savepoint's, removes the message).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core.redaction import redacting_logger

log = redacting_logger("fastapi_workqueue.session")


class SessionExecutor:
    """Executes driver-level SQL on an ``AsyncSession`` or ``AsyncConnection``.

    The session must be bound to the queue's database. Its transaction is joined, never committed
    here: a rollback by the caller publishes nothing.
    """

    def __init__(self, session: Any) -> None:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

        if not isinstance(session, AsyncSession | AsyncConnection):
            raise TypeError(
                f"session must be a SQLAlchemy AsyncSession or AsyncConnection, got {type(session).__name__}"
            )
        self._session = session

    async def connection(self) -> Any:
        from sqlalchemy.ext.asyncio import AsyncSession

        if isinstance(self._session, AsyncSession):
            conn = await self._session.connection()
            joined(self._session, conn)
            return conn
        joined_connection(self._session)
        return self._session

    async def fetch(self, sql: str, args: Sequence[Any]) -> list[Mapping[str, Any]]:
        conn = await self.connection()
        result = await conn.exec_driver_sql(sql, tuple(args))
        return list(result.mappings().all())


_JOINED = "fastapi_workqueue.joined"
"""The key in ``Session.info`` of the connection a statement of the queue (a publish) ran on in the
session's transaction: its commit is checked by :func:`_refuse_an_aborted_commit`."""
_PUBLISHED_IN = "fastapi_workqueue.published_in"
"""The key in a connection's ``info`` of the transaction (a weak reference) a statement of the queue
ran in on a bare ``AsyncConnection``: its commit is checked by :func:`_refuse_an_aborted_connection_commit`."""
_FAILED_IN = "fastapi_workqueue.failed_in"
"""The key in a connection's ``info`` of the transaction (a weak reference) in which a statement failed."""


def joined(session: Any, conn: Any) -> None:
    """Notes that a statement of the queue runs in ``session``'s transaction on ``conn`` (an
    ``AsyncConnection``): the session's commit is refused if a statement of that transaction failed
    and left it aborted."""
    _listen_for_failures()
    session.sync_session.info[_JOINED] = conn.sync_connection


def joined_connection(conn: Any) -> None:
    """Notes that a statement of the queue runs in the transaction of ``conn``, a bare
    ``AsyncConnection`` (no session around it): its commit is refused, as a session's is, if a
    statement of that transaction failed and left it aborted."""
    _listen_for_failures()
    sync = conn.sync_connection
    transaction = None if sync is None else sync.get_transaction()
    if transaction is not None:
        sync.info[_PUBLISHED_IN] = weakref.ref(transaction)


def statement_failed(conn: Any) -> None:
    """Notes that a statement failed in ``conn``'s transaction (an ``AsyncConnection``; for a
    statement sent on its driver connection, which SQLAlchemy's error event does not see)."""
    _note_failure(conn.sync_connection)


@functools.cache
def _listen_for_failures() -> None:
    """Listens, the first time a publish joins a session, for a failed statement on any engine
    (only errors call it) and for a commit of any session (a dict look-up unless a publish joined)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine
    from sqlalchemy.orm import Session

    event.listen(Engine, "handle_error", lambda context: _note_failure(context.connection))
    event.listen(Session, "before_commit", _refuse_an_aborted_commit)
    event.listen(Engine, "commit", _refuse_an_aborted_connection_commit)


def _note_failure(connection: Any) -> None:
    try:
        transaction = None if connection is None else connection.get_transaction()
        if transaction is not None:
            connection.info[_FAILED_IN] = weakref.ref(transaction)
    except Exception:  # (an invalidated connection: its transaction is gone anyway)
        return


def _refuse_an_aborted_commit(sync: Any) -> None:
    """Before the commit of a session a publish joined: when a statement failed in its transaction
    (caught by the caller), asks the database whether the transaction is still whole. PostgreSQL
    answers a COMMIT of an aborted transaction with a rollback and no error, which would leave the
    caller holding Accepted MessageIDs of messages that never existed; the commit raises instead."""
    if sync.in_nested_transaction():
        return  # (a savepoint released: the transaction goes on)
    connection = sync.info.get(_JOINED)
    if connection is None:
        return
    if connection.closed or connection.invalidated:
        del sync.info[_JOINED]  # (joined by an earlier transaction of the session, which rolled back)
        return
    failed_in = connection.info.get(_FAILED_IN)
    if failed_in is None or failed_in() is not connection.get_transaction():
        del sync.info[_JOINED]
        return
    _check_whole(connection, "session")
    del sync.info[_JOINED]


def _refuse_an_aborted_connection_commit(connection: Any) -> None:
    """Before the commit of a bare connection's transaction a publish joined: as
    :func:`_refuse_an_aborted_commit` for a session."""
    published_in = connection.info.get(_PUBLISHED_IN)
    if published_in is None:
        return
    transaction = connection.get_transaction()
    failed_in = connection.info.get(_FAILED_IN)
    if published_in() is not transaction or failed_in is None or failed_in() is not transaction:
        del connection.info[_PUBLISHED_IN]  # (an earlier transaction's, or nothing failed in this one)
        return
    _check_whole(connection, "connection")
    del connection.info[_PUBLISHED_IN]


def _check_whole(connection: Any, holder: str) -> None:
    """Raises :class:`TransactionAborted` when ``connection``'s transaction (where a statement
    failed) is aborted; the mark stays then, so a second commit of it is refused too."""
    from sqlalchemy.exc import DBAPIError

    from ..core.errors import TransactionAborted

    try:
        connection.exec_driver_sql("SELECT 1")
    except DBAPIError as exc:
        raise TransactionAborted(
            f"the transaction this {holder}'s publish joined had failed: a statement in it raised and was caught, "
            "so its commit would roll everything back, the publish included. Nothing was committed; run the work "
            f"again in a new transaction, with a statement that may fail inside a savepoint "
            f"(async with {holder}.begin_nested(): ...)"
        ) from exc


_AFTER_COMMIT = "fastapi_workqueue.after_commit"
"""The key in ``Session.info`` of the callbacks waiting for that session's commit."""


def wakes_after_commit(session: Any) -> bool:
    """Whether :func:`after_commit` can tell when ``session`` has committed: a ``Session``'s
    ``after_commit`` event comes after the commit, a ``Connection``'s ``commit`` event before it.
    A session bound to a connection (not an engine) may be joined to a transaction begun outside
    it, whose commit the session never sees: its publishes keep their NOTIFY in the transaction,
    which PostgreSQL delivers when that outer transaction commits."""
    from sqlalchemy.engine import Connection
    from sqlalchemy.ext.asyncio import AsyncSession

    return isinstance(session, AsyncSession) and not isinstance(session.sync_session.bind, Connection)


def after_commit(session: Any, callback: Callable[[], None]) -> None:
    """Calls ``callback()`` once the database transaction that ``session`` is in has committed,
    never when it rolls back. With an ``AsyncSession``: when its outermost transaction commits
    its connection (not when a savepoint is released, nor when a session joined to a transaction
    begun outside it ends: :func:`wakes_after_commit` keeps such a session's wake-ups in the
    transaction instead). With an
    ``AsyncConnection``: at its commit event, which comes just before the commit itself. The
    callback runs on the event loop's thread inside the commit and must not block; an error it
    raises is logged, never the commit's (the transaction has committed)."""
    from sqlalchemy import event
    from sqlalchemy.ext.asyncio import AsyncSession

    if not isinstance(session, AsyncSession):  # an AsyncConnection
        event.listen(session.sync_connection, "commit", lambda *_: _call(callback), once=True)
        return
    sync = session.sync_session
    root = sync.get_transaction()
    if root is None:  # nothing began: nothing is waiting to commit
        _call(callback)
        return
    waiting: list[tuple[Any, Any, Callable[[], None]]] | None = sync.info.get(_AFTER_COMMIT)
    if waiting is None:
        _listen_on_sessions()
        waiting = sync.info[_AFTER_COMMIT] = []
    waiting.append((root, sync.connection(), callback))


@functools.cache
def _listen_on_sessions() -> None:
    """Puts the two listeners below on the ``Session`` class, the first time only: listening on
    each session costs more than the rest of a publish's bookkeeping, and every session gets its
    own dispatch structures for it. Sessions nobody publishes through find no waiting list."""
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    event.listen(Session, "after_commit", _committed)
    event.listen(Session, "after_transaction_end", _ended)


def _committed(sync: Any) -> None:
    waiting = sync.info.get(_AFTER_COMMIT)  # (any session's commit: nothing waits on most)
    if not waiting or sync.in_nested_transaction():
        return  # a savepoint released: the transaction goes on
    root = sync.get_transaction()
    ready = [w for w in waiting if w[0] is root and not w[1].in_transaction()]
    if ready:
        waiting[:] = [w for w in waiting if w not in ready]
        for _root, _conn, callback in ready:
            _call(callback)


def _ended(sync: Any, transaction: Any) -> None:
    waiting = sync.info.get(_AFTER_COMMIT)
    if waiting and transaction.parent is None:
        # The outermost transaction is over: rolled back, committed (called above), or a session
        # joined to a transaction begun outside it (whose commit it cannot see).
        waiting[:] = [w for w in waiting if w[0] is not transaction]


def _call(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        log.exception("a callback after a commit failed; the transaction had committed")
