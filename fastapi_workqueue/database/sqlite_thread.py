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
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

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


class Cancelled(threading.Event):
    """Set when the caller of a transaction stopped waiting for it: the thread rolls it back
    instead of committing it, unless the commit has begun."""


class ThreadConnection:
    """One ``sqlite3`` connection (autocommit mode: the transport begins its transactions), used
    only from one thread of its own; calls from the loop run there in order."""

    def __init__(self, pool: ThreadPoolExecutor, raw: sqlite3.Connection) -> None:
        self._pool = pool
        self.raw = raw
        """The connection itself: for functions that :meth:`run` runs on its thread only."""

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
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

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
            self._pool.shutdown(wait=False)
