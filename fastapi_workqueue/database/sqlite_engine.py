"""The request sessions' SQLite engine: a connection rolls back before it closes.

A task cancelled while one of its session's statements runs (a request's timeout, a handler past
its ``max_processing_seconds``) has its connection invalidated and closed by SQLAlchemy. But the
statement's cursor outlives the close, held by the cancellation's traceback, and SQLite's close
(``sqlite3_close_v2``) then waits for every statement to be finalized: until the garbage collector
frees that cursor, the connection stays open, in its transaction, holding the file's write lock,
and every write of every process on the file waits and then fails as busy. A ``ROLLBACK`` sent on
the driver's thread just before the close ends the transaction and frees the lock at once,
whatever still holds the cursor.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from typing import Any

import aiosqlite


def _roll_back(connection: sqlite3.Connection) -> None:
    """On the driver's thread: ends the transaction (its statements still alive or not)."""
    with contextlib.suppress(sqlite3.Error):
        if connection.in_transaction:
            connection.execute("ROLLBACK")


class RollingBackConnection(aiosqlite.Connection):
    """aiosqlite's connection, rolled back on its thread before it closes or stops."""

    async def close(self) -> None:
        raw = self._connection
        if raw is not None:
            # (queued before the close: it runs first even if this caller is cancelled meanwhile)
            with contextlib.suppress(Exception):
                await self._execute(_roll_back, raw)  # type: ignore[no-untyped-call]
        await super().close()

    def stop(self) -> Any:  # (aiosqlite 0.22 and later: SQLAlchemy's forced close, and __del__)
        raw = self._connection
        if raw is not None and self._running:
            self._tx.put_nowait((None, functools.partial(_roll_back, raw)))
        return super().stop()


def roll_back_before_close(dbapi_connection: Any, record: Any) -> None:
    """A ``connect`` listener of the engine: its new aiosqlite connection rolls back before it
    closes (:class:`RollingBackConnection`)."""
    driver = getattr(dbapi_connection, "driver_connection", None)
    if type(driver) is aiosqlite.Connection:
        driver.__class__ = RollingBackConnection


def begin_before_a_first_savepoint(conn: Any, name: Any) -> None:
    """A ``savepoint`` listener of the engine: a savepoint that would open the file's transaction
    (the session's first statement, ``async with session.begin_nested():``) is preceded by
    ``BEGIN IMMEDIATE``. Python's sqlite3 begins a transaction only before a data statement, so a
    first ``SAVEPOINT`` opened it itself, and its ``RELEASE`` was the ``COMMIT``: what the savepoint
    wrote stayed when the request then failed. ``IMMEDIATE``, as the queue begins a session it
    publishes in: a savepoint is there to write, and a write lock taken later could fail at once."""
    driver = getattr(conn.connection, "driver_connection", None)
    if isinstance(driver, aiosqlite.Connection) and not driver.in_transaction:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
