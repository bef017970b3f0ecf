"""A small connection pool for the PostgreSQL transport.

The queue sends one statement per use of a connection (a routine call in autocommit), so a pool
needs little: a stack of idle connections, a cap, and a queue of waiters. Taking and returning a
connection here is a few list operations, without the task that a shielded release costs per use,
which is a large share of a one-message publish.

A connection is put back only when it is open and idle: one that is closed, left in a transaction,
or whose use ended in a cancellation (the driver may still be cancelling its statement) is
terminated, and the next use opens a fresh one.

Kept rather than asyncpg's own pool (it uses only asyncpg's public API), on these measurements,
taken in turns on the 2-core machine while other work ran on it, the transport built on
``asyncpg.create_pool`` (``reset=`` a no-op, ``init=`` the jsonb codec) against this one: a
one-message ``queue.publish`` cost this process 558 µs of CPU instead of 406 µs (medians of 5 turns
of 3,000 publishes), and an ``acquire`` with its release alone 38.9 µs instead of 1.4 µs (5 turns of
20,000; asyncpg releases through ``asyncio.shield``, a task per use). The wall-time benchmark
(``bench/compare/workqueue_bench.py --only publish``, 5 turns of 10,000, alternating) could not
resolve it there: the machine made each publish wait 4-6 ms (medians 207 and 264 messages/s one at
a time, 13,069 and 12,280 in batches, ratios 1.02). On a quiet machine a one-message publish takes
about 270 µs (3,678/s, bench/README.md), so a third of that extra CPU is already well over 5 %.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import asyncpg

from ..core.tasks import TaskScope

Connect = Callable[[], Awaitable["asyncpg.Connection[Any]"]]


class PoolClosed(RuntimeError):
    """The pool was closed; the transport is no longer open."""


class ConnectionPool:
    """Hands out asyncpg connections, at most ``max_size`` at once, keeping idle ones for reuse.

    Idle connections unused for ``max_idle_seconds`` are closed when the pool is next used, down
    to ``min_size``. ``clock`` (seconds, monotonic) is what their idle time is counted on: a test
    passes one it moves instead of waiting.
    """

    def __init__(self, connect: Connect, *, min_size: int = 1, max_size: int = 10,
                 max_idle_seconds: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        if max_size < 1 or not 0 <= min_size <= max_size:
            raise ValueError(f"pool sizes must satisfy 0 <= min_size <= max_size and max_size >= 1, "
                             f"got min_size={min_size}, max_size={max_size}")
        self._connect = connect
        self._min_size = min_size
        self._max_size = max_size
        self._max_idle = max_idle_seconds
        self._clock = clock
        self._idle: deque[tuple[asyncpg.Connection[Any], float]] = deque()
        self._in_use: set[asyncpg.Connection[Any]] = set()
        self._opening = 0
        self._waiters: deque[asyncio.Future[asyncpg.Connection[Any] | None]] = deque()
        self._closed = False

    @property
    def size(self) -> int:
        """Connections open or being opened."""
        return len(self._idle) + len(self._in_use) + self._opening

    @property
    def waiting(self) -> int:
        """Callers waiting for a connection (every place taken)."""
        return sum(1 for waiter in self._waiters if not waiter.done())

    async def open(self) -> None:
        """Opens ``min_size`` connections (the first failure is raised)."""
        opened = await asyncio.gather(*(self._new() for _ in range(self._min_size)), return_exceptions=True)
        now = self._clock()
        for conn in opened:
            if not isinstance(conn, BaseException):
                self._in_use.discard(conn)
                self._idle.append((conn, now))
        failures = [r for r in opened if isinstance(r, BaseException)]
        if failures:
            await self.close()
            raise failures[0]

    def acquire(self) -> Lease:
        """``async with pool.acquire() as conn:`` gives a connection and puts it back after."""
        return Lease(self)

    def take_idle(self) -> asyncpg.Connection[Any] | None:
        """An idle connection for the caller alone, or None (then :meth:`get` waits or opens one).
        Give it back with :meth:`put`. Not a coroutine: the common case costs no await."""
        if self._closed:
            return None
        while self._idle:
            conn, _ = self._idle.pop()  # the most recently used: warm, and lets the rest age out
            if not conn.is_closed():
                self._in_use.add(conn)
                return conn
        return None

    async def get(self) -> asyncpg.Connection[Any]:
        """A connection for the caller alone until it gives it back with :meth:`put`."""
        while True:
            if self._closed:
                raise PoolClosed("the connection pool is closed")
            idle = self.take_idle()
            if idle is not None:
                return idle
            if self.size < self._max_size:
                return await self._new()
            waiter: asyncio.Future[asyncpg.Connection[Any] | None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                handed_over = await waiter
            except asyncio.CancelledError:
                if not waiter.done():
                    self._waiters.remove(waiter)
                elif not waiter.cancelled():
                    # Handed a connection (or room for one) just as we were cancelled: pass it on.
                    handed = waiter.result()
                    if handed is None:
                        self._wake(None)
                    else:
                        self.put(handed)
                raise
            if handed_over is not None:
                return handed_over
            # None: a connection was dropped, so there is room to open one; look again.

    def put(self, conn: asyncpg.Connection[Any], *, reusable: bool = True) -> None:
        """Gives ``conn`` back. It is kept only when ``reusable`` and open and idle."""
        self._in_use.discard(conn)
        if self._closed or not reusable or conn.is_closed() or conn.is_in_transaction():
            conn.terminate()
            self._wake(None)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._in_use.add(conn)
                waiter.set_result(conn)
                return
        now = self._clock()
        self._idle.append((conn, now))
        self._retire_idle(now)

    async def close(self, within: float = 5.0) -> None:
        """Closes the idle connections (all at once, for at most ``within`` seconds; those the
        server has not seen off by then are terminated) and terminates those still in use."""
        self._closed = True
        idle = [conn for conn, _ in self._idle]
        self._idle.clear()
        for conn in self._in_use:
            conn.terminate()
        self._in_use.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(PoolClosed("the connection pool is closed"))
        if not idle:
            return
        scope = TaskScope("workqueue-pool-close")
        closing = {scope.spawn(conn.close(), name="workqueue-pool-close", watch=False): conn for conn in idle}
        try:
            await scope.close(grace=1.0, finish_within=within)
        finally:  # (also when the close itself is cancelled: no connection is left open)
            for task, conn in closing.items():
                if not task.done() or task.cancelled() or task.exception() is not None:
                    conn.terminate()

    async def _new(self) -> asyncpg.Connection[Any]:
        self._opening += 1
        try:
            conn = await self._connect()
        except BaseException:
            self._opening -= 1
            self._wake(None)
            raise
        self._opening -= 1
        if self._closed:
            conn.terminate()
            raise PoolClosed("the connection pool is closed")
        self._in_use.add(conn)
        return conn

    def _wake(self, conn: asyncpg.Connection[Any] | None) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return

    def _retire_idle(self, now: float) -> None:
        # The oldest idle connections sit at the left end.
        while len(self._idle) > self._min_size and now - self._idle[0][1] > self._max_idle:
            conn, _ = self._idle.popleft()
            conn.terminate()


class Lease:
    """The context manager of :meth:`ConnectionPool.acquire` (a plain class: it is on every call)."""

    __slots__ = ("_conn", "_pool")

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._conn: asyncpg.Connection[Any] | None = None

    async def __aenter__(self) -> asyncpg.Connection[Any]:
        self._conn = await self._pool.get()
        return self._conn

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            # A use that ended in a cancellation (or another BaseException) may have left a
            # statement being cancelled on the server: such a connection is not reused.
            self._pool.put(conn, reusable=exc_type is None or issubclass(exc_type, Exception))
