"""The SQLite transport's own connection, on a thread of its own, where whole transactions run.

A routine's statements (``BEGIN IMMEDIATE``, its reads and writes, ``COMMIT``) run one after
another on the connection's thread, without coming back to the event loop between them. So a
process whose loop is blocked (a handler's ``time.sleep``, a long computation) never holds the
file's write lock longer than one transaction takes: only the answer waits for the loop. (Run one
statement at a time from the loop, a blocked loop held the lock, and every other process on the
file waited: their heartbeats too, so their handlers lost their leases.)

A routine of :mod:`.sqlite_routines` is an ``async`` function whose only awaits are its
statements. On this connection they run at once, so the routine's coroutine completes in one
step, driven on the thread by :func:`run_to_end`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..core.errors import TransportError

T = TypeVar("T")


class RoutineSuspended(RuntimeError):
    """A routine awaited something other than its statements (a bug of the routine)."""


def run_to_end(awaitable: Awaitable[T]) -> T:
    """Runs ``awaitable`` (a routine's coroutine), which must not suspend, to its end; its
    result, or its exception."""
    steps = awaitable.__await__()
    try:
        next(steps)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    steps.close()
    raise RoutineSuspended("a SQLite routine awaited something other than its statements")


class CallerGone(Exception):
    """The caller of a transaction stopped waiting for it (cancelled): it is rolled back."""


class _Turn:
    """One transaction's state, shared by its caller (on the loop) and the connection's thread."""

    __slots__ = ("cancelled", "lock", "phase")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False
        self.phase = "queued"
        """queued, working (BEGIN and the work: a cancel interrupts it), ending (COMMIT or
        ROLLBACK: never interrupted) or done."""


def _roll_back(raw: sqlite3.Connection) -> None:
    """Ends the open transaction, if any, without a commit ("no transaction is active" when the
    failure was BEGIN's or COMMIT's own)."""
    for _ in range(3):
        with contextlib.suppress(sqlite3.Error):
            raw.execute("ROLLBACK")
        if not raw.in_transaction:
            return


class ThreadConnection:
    """One ``sqlite3`` connection (autocommit mode: the transport begins its transactions), used
    only from one thread of its own; calls from the loop run there in order."""

    def __init__(self, pool: ThreadPoolExecutor, raw: sqlite3.Connection) -> None:
        self._pool = pool
        self.raw = raw
        """The connection itself: for functions that :meth:`run` runs on its thread only."""
        self._closed = False

    @classmethod
    async def connect(cls, path: str, busy_seconds: float) -> ThreadConnection:
        """Opens ``path`` on a new thread; raises ``sqlite3.Error`` (and leaves no thread) when it cannot."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="workqueue-sqlite")
        try:
            raw = await asyncio.get_running_loop().run_in_executor(
                pool, lambda: sqlite3.connect(path, isolation_level=None, timeout=busy_seconds, check_same_thread=False)
            )
        except BaseException:
            pool.shutdown(wait=False)
            raise
        return cls(pool, raw)

    async def run(self, work: Callable[[], T]) -> T:
        """``work()`` on the connection's thread, after what was sent before."""
        if self._closed:
            raise TransportError("the SQLite transport is closed; use it inside the WorkQueue's lifespan")
        # (in the caller's context, as asyncio.to_thread runs a function: what a routine logs keeps it)
        return await asyncio.get_running_loop().run_in_executor(self._pool, contextvars.copy_context().run, work)

    async def transaction(self, begin: Callable[[sqlite3.Connection, Callable[[], bool]], None],
                          work: Callable[[sqlite3.Connection], T]) -> T:
        """``begin(connection, cancelled)``, ``work(connection)`` and ``COMMIT``, whole on the
        connection's thread; rolled back when ``work`` raises.

        A caller cancelled meanwhile has it rolled back instead of committed, unless its
        ``COMMIT`` has begun: one still queued never starts, a statement under way is
        interrupted, and ``begin`` (waiting for another process's writer) can give up at once
        when ``cancelled()`` turns true, so that a stop does not wait out the busy timeout. The
        connection is never left inside a transaction, holding the file's write lock.
        """
        turn = _Turn()
        raw = self.raw

        def whole() -> T:
            with turn.lock:
                if turn.cancelled:
                    raise CallerGone
                turn.phase = "working"
            try:
                try:
                    begin(raw, lambda: turn.cancelled)
                    result = work(raw)
                except BaseException:
                    with turn.lock:
                        turn.phase = "ending"
                    _roll_back(raw)
                    raise
                with turn.lock:
                    turn.phase = "ending"
                    gone = turn.cancelled
                if gone:
                    _roll_back(raw)
                    raise CallerGone
                try:
                    raw.execute("COMMIT")
                except BaseException:
                    _roll_back(raw)
                    raise
                return result
            finally:
                with turn.lock:
                    turn.phase = "done"

        try:
            return await self.run(whole)
        except asyncio.CancelledError:
            with turn.lock:
                turn.cancelled = True
                if turn.phase == "working":
                    raw.interrupt()
            raise

    async def execute(self, sql: str, params: Any = ()) -> list[Any]:
        """One statement; its rows (none for a statement that returns none)."""
        def one() -> list[Any]:
            cursor = self.raw.execute(sql, params)
            try:
                return cursor.fetchall()
            finally:
                cursor.close()

        return await self.run(one)

    async def set_trace_callback(self, callback: Callable[[str], object] | None) -> None:
        """Calls ``callback`` with each statement the connection starts, on its thread."""
        await self.run(lambda: self.raw.set_trace_callback(callback))

    async def close(self) -> None:
        """Closes the connection, after what was sent before, and ends its thread."""
        try:
            await self.run(self.raw.close)
        finally:
            self._closed = True
            self._pool.shutdown(wait=False)
