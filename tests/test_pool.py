"""The PostgreSQL transport's connection pool, on the test server."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest

from fastapi_workqueue.database.pool import ConnectionPool, PoolClosed
from fastapi_workqueue.database.postgres import to_asyncpg_dsn

from .support import wait_for


class Connect:
    """Opens connections for the pool and keeps each one it opened."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.opened: list[asyncpg.Connection[Any]] = []

    async def __call__(self) -> asyncpg.Connection[Any]:
        conn: asyncpg.Connection[Any] = await asyncpg.connect(self.dsn)
        self.opened.append(conn)
        return conn


@pytest.fixture
def connect(pg_url: str) -> Connect:
    return Connect(to_asyncpg_dsn(pg_url))


async def backend(conn: asyncpg.Connection[Any]) -> int:
    return int(await conn.fetchval("SELECT pg_backend_pid()"))


async def test_reuses_idle_connections_and_opens_min_size_up_front(connect: Connect) -> None:
    pool = ConnectionPool(connect, min_size=2, max_size=4)
    await pool.open()
    assert len(connect.opened) == 2
    pids = set()
    for _ in range(10):
        async with pool.acquire() as conn:
            pids.add(await backend(conn))
    assert len(connect.opened) == 2
    assert len(pids) == 1  # the most recently used connection is taken first
    await pool.close()
    assert all(c.is_closed() for c in connect.opened)


async def test_never_more_than_max_size_and_waiters_are_served_in_turn(connect: Connect) -> None:
    pool = ConnectionPool(connect, min_size=0, max_size=2)
    await pool.open()
    running = 0
    peak = 0

    async def use(i: int) -> int:
        nonlocal running, peak
        async with pool.acquire() as conn:
            running += 1
            peak = max(peak, running)
            await conn.execute("SELECT pg_sleep(0.02)")
            running -= 1
            return i

    assert await asyncio.gather(*(use(i) for i in range(8))) == list(range(8))
    assert peak == 2
    assert len(connect.opened) == 2
    await pool.close()


async def test_connection_left_in_a_transaction_or_closed_is_not_reused(connect: Connect) -> None:
    pool = ConnectionPool(connect, min_size=0, max_size=1)
    async with pool.acquire() as conn:
        first = await backend(conn)
        tx = conn.transaction()
        await tx.start()  # left open by the user of the connection
    assert conn.is_closed()
    async with pool.acquire() as conn:
        second = await backend(conn)
        await conn.close()
    async with pool.acquire() as conn:
        third = await backend(conn)
    assert len({first, second, third}) == 3
    await pool.close()


async def test_a_failed_statement_keeps_the_connection(connect: Connect) -> None:
    pool = ConnectionPool(connect, min_size=0, max_size=1)
    with pytest.raises(asyncpg.exceptions.DivisionByZeroError):
        async with pool.acquire() as conn:
            first = await backend(conn)
            await conn.fetchval("SELECT 1 / 0")
    async with pool.acquire() as conn:
        assert await backend(conn) == first
    await pool.close()


async def test_cancelled_use_drops_the_connection_and_frees_its_place(connect: Connect, pg_url: str) -> None:
    pool = ConnectionPool(connect, min_size=0, max_size=1)
    marker = f"pool-cancel-{uuid.uuid4().hex}"

    async def slow() -> None:
        async with pool.acquire() as conn:
            await conn.execute(f"SELECT pg_sleep(10) -- {marker}")

    task = asyncio.create_task(slow())
    observer: asyncpg.Connection[Any] = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:  # cancelled while the server runs its statement
        await wait_for(lambda: observer.fetchval(
            "SELECT count(*) > 0 FROM pg_stat_activity WHERE state = 'active' AND strpos(query, $1) > 0", marker))
    finally:
        await observer.close()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert connect.opened[0].is_closed()
    async with pool.acquire() as conn:  # the place is free again, on a new connection
        assert await conn.fetchval("SELECT 1") == 1
    assert len(connect.opened) == 2
    await pool.close()


async def test_a_cancelled_waiter_leaves_the_queue(connect: Connect) -> None:
    pool = ConnectionPool(connect, min_size=0, max_size=1)
    async with pool.acquire():
        waiter = asyncio.create_task(pool.get())
        await wait_for(lambda: pool.waiting == 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    async with pool.acquire() as conn:  # the connection went back to the pool, not to the dead waiter
        assert await conn.fetchval("SELECT 1") == 1
    assert len(connect.opened) == 1
    await pool.close()


async def test_failed_connect_frees_its_place(pg_url: str) -> None:
    attempts = 0
    dsn = to_asyncpg_dsn(pg_url)

    async def flaky() -> asyncpg.Connection[Any]:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise OSError("connection refused")
        conn: asyncpg.Connection[Any] = await asyncpg.connect(dsn)
        return conn

    pool = ConnectionPool(flaky, min_size=0, max_size=1)
    with pytest.raises(OSError, match="refused"):
        await pool.get()
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT 1") == 1
    await pool.close()


async def test_closed_pool_refuses_and_fails_its_waiters(connect: Connect) -> None:
    pool = ConnectionPool(connect, min_size=0, max_size=1)
    held = await pool.get()
    waiter = asyncio.create_task(pool.get())
    await wait_for(lambda: pool.waiting == 1)
    await pool.close()
    with pytest.raises(PoolClosed):
        await waiter
    assert held.is_closed()  # in use at close: terminated
    with pytest.raises(PoolClosed):
        await pool.get()


def test_sizes_are_checked() -> None:
    async def never() -> asyncpg.Connection[Any]:
        raise AssertionError

    with pytest.raises(ValueError, match="min_size"):
        ConnectionPool(never, min_size=3, max_size=2)


async def test_idle_connections_past_their_lifetime_close_down_to_min_size(connect: Connect) -> None:
    now = [1000.0]  # the pool's clock, moved by the test
    pool = ConnectionPool(connect, min_size=1, max_size=4, max_idle_seconds=2.0, clock=lambda: now[0])
    held = [await pool.get() for _ in range(3)]
    for conn in held:
        pool.put(conn)
    assert pool.size == 3
    now[0] += 2.0
    async with pool.acquire() as conn:  # not yet past their lifetime: all kept
        assert await conn.fetchval("SELECT 1") == 1
    assert pool.size == 3
    now[0] += 0.5
    async with pool.acquire() as conn:  # giving it back retires the idle ones that aged out
        assert await conn.fetchval("SELECT 1") == 1
    assert pool.size == 1
    assert sum(not c.is_closed() for c in connect.opened) == 1
    await pool.close()
