"""The transports the conformance suite (``fastapi_workqueue.testing.conformance``) runs on here:
memory, PostgreSQL, SQLite, SQL Server (where WORKQUEUE_MSSQL_URL names one) and AWS on moto. Each
case runs once per transport.

Each database harness builds its transport with a clock of its own (a ManualClock) and lets time
pass by moving it (:meth:`Harness.advance`): claims, heartbeats, settles and sweeps run at the
clock's time, so a lease runs out or a retry comes due without a rewritten row. Publish keeps the
database's time, so a deduplication key's expiry (:meth:`Harness.advance_deduplication`) is still
moved with a direct statement: PostgreSQL through asyncpg as the owner, SQLite through a connection
to the file, SQL Server through the harness's engine.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiosqlite
import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from fastapi_workqueue.core.clock import ManualClock
from fastapi_workqueue.database.mssql import MssqlTransport
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn
from fastapi_workqueue.database.sqlite import SqliteTransport
from fastapi_workqueue.testing.conformance import Harness, memory_harness


@dataclass
class _SessionHarness:
    """What every database harness shares: a caller's session with an open transaction."""

    name: str
    transport: Any
    url: str
    engine: Any
    clock: ManualClock = field(default_factory=ManualClock)
    moves_clock = True  # advance() ages every delivery, not only the one it names

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        async with AsyncSession(self.engine) as session, session.begin():
            yield session

    async def advance(self, delivery_id: str, seconds: float) -> None:
        """Moves the transport's clock ``seconds`` forward: every delivery ages with it, as in real
        time. The named delivery must exist (a case that names a wrong one is a broken case)."""
        assert await self.transport.get_delivery(delivery_id) is not None, f"no delivery {delivery_id}"
        self.clock.advance(seconds)

    async def advance_deduplication(self, topic: str, key: str, seconds: float) -> None:
        raise NotImplementedError

    async def expire_lease(self, delivery_id: str) -> None:
        info = await self.transport.get_delivery(delivery_id)
        assert info is not None and info.status == "InFlight" and info.lease_expires_at is not None, info
        remaining = (info.lease_expires_at - self.clock.now()).total_seconds()
        await self.advance(delivery_id, max(remaining, 0.0) + 1.0)


@dataclass
class PostgresHarness(_SessionHarness):
    transport: PostgresTransport

    @contextlib.asynccontextmanager
    async def hold_sweep_lock(self) -> AsyncIterator[None]:
        conn = await asyncpg.connect(to_asyncpg_dsn(self.url))
        try:
            async with conn.transaction():
                assert await conn.fetchval("SELECT pg_try_advisory_xact_lock(hashtext('workqueue.sweep')::bigint)")
                yield
        finally:
            await conn.close()

    async def advance_deduplication(self, topic: str, key: str, seconds: float) -> None:
        conn = await asyncpg.connect(to_asyncpg_dsn(self.url))
        try:
            status = await conn.execute(
                "UPDATE workqueue.deduplication SET expires_at = expires_at - make_interval(secs => $3) "
                "WHERE topic = $1 AND deduplication_key = $2",
                topic, key, float(seconds),
            )
        finally:
            await conn.close()
        assert status == "UPDATE 1", f"no deduplication key {key!r} on {topic}"


@dataclass
class SqliteHarness(_SessionHarness):
    transport: SqliteTransport

    @contextlib.asynccontextmanager
    async def hold_sweep_lock(self) -> AsyncIterator[None]:
        # Another process's pass holds the lock row until it ends.
        async with aiosqlite.connect(self.transport.path) as conn:
            await conn.execute(
                "INSERT INTO lock (name, holder, expires_at) VALUES ('workqueue.sweep', 'elsewhere', ?)",
                (time.time() + 60,),
            )
            await conn.commit()
            try:
                yield
            finally:
                await conn.execute("DELETE FROM lock WHERE holder = 'elsewhere'")
                await conn.commit()

    async def advance_deduplication(self, topic: str, key: str, seconds: float) -> None:
        async with aiosqlite.connect(self.transport.path, timeout=10) as conn:
            cursor = await conn.execute(
                "UPDATE deduplication SET expires_at = expires_at - :s "
                "WHERE topic = :topic AND deduplication_key = :key",
                {"topic": topic, "key": key, "s": float(seconds)},
            )
            moved = cursor.rowcount
            await conn.commit()
        assert moved == 1, f"no deduplication key {key!r} on {topic}"


@dataclass
class MssqlHarness(_SessionHarness):
    transport: MssqlTransport

    @contextlib.asynccontextmanager
    async def hold_sweep_lock(self) -> AsyncIterator[None]:
        # Another process's pass holds the application lock until its transaction ends.
        async with self.transport.pool.acquire() as conn, conn.cursor() as cur:
            await cur.execute(
                "SET NOCOUNT ON; BEGIN TRANSACTION; DECLARE @granted int; "
                "EXEC @granted = sp_getapplock @Resource = N'workqueue.sweep', @LockMode = N'Exclusive', "
                "@LockOwner = N'Transaction', @LockTimeout = 0; SELECT @granted"
            )
            [granted] = await cur.fetchone()
            assert granted >= 0
            try:
                yield
            finally:
                await cur.execute("IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION")

    async def advance_deduplication(self, topic: str, key: str, seconds: float) -> None:
        params = {"topic": topic, "key": key, "ms": round(seconds * 1000)}
        async with self.engine.begin() as conn:
            moved = (await conn.execute(text(
                "UPDATE workqueue.deduplication SET expires_at = DATEADD(millisecond, -:ms, expires_at) "
                "WHERE topic = :topic AND deduplication_key = :key"
            ), params)).rowcount
        assert moved == 1, f"no deduplication key {key!r} on {topic}"


@pytest.fixture(params=["memory", "postgresql", "sqlite", "mssql", "aws"])
async def harness(request: pytest.FixtureRequest, pg_url: str, sqlite_url: str) -> AsyncIterator[Harness]:
    if request.param == "memory":
        async with memory_harness() as memory:
            yield memory
        return
    if request.param == "aws":
        from ..aws.harness import AWS_SKIPS, aws_harness

        case = request.node.originalname
        one = request.node.name.replace("[aws-", "[")  # the case with its other parameters: name[param]
        for skipped in (case, one):
            if skipped in AWS_SKIPS:
                pytest.skip(f"aws: {AWS_SKIPS[skipped]}")
        async with aws_harness(request.getfixturevalue("moto_url")) as aws:
            yield aws
        return
    if request.param == "mssql":
        # No SQL Server runs in CI here: the suite runs on one only where this variable names it,
        # e.g. mssql+aioodbc://sa:…@127.0.0.1:1433/workqueue?driver=ODBC+Driver+18+for+SQL+Server
        mssql_url = os.environ.get("WORKQUEUE_MSSQL_URL")
        if not mssql_url:
            pytest.skip("set WORKQUEUE_MSSQL_URL to run the conformance suite on SQL Server")
        clock = ManualClock()
        mssql_transport = MssqlTransport(mssql_url, pool_max_size=4, clock=clock)
        await mssql_transport.open()
        mssql_engine = create_async_engine(mssql_url)
        try:
            await mssql_transport.migrate()
            yield MssqlHarness("mssql", mssql_transport, mssql_url, mssql_engine, clock)
        finally:
            await mssql_engine.dispose()
            await mssql_transport.close()
    if request.param == "sqlite":
        clock = ManualClock()
        sqlite_transport = SqliteTransport(sqlite_url, clock=clock)
        await sqlite_transport.open()
        sqlite_engine = create_async_engine(sqlite_url, connect_args={"timeout": 10})
        try:
            yield SqliteHarness("sqlite", sqlite_transport, sqlite_url, sqlite_engine, clock)
        finally:
            await sqlite_engine.dispose()
            await sqlite_transport.close()
    if request.param == "postgresql":
        clock = ManualClock()
        transport = PostgresTransport(pg_url, listen=False, pool_max_size=4, clock=clock)
        await transport.open()
        engine = create_async_engine(pg_url)
        try:
            yield PostgresHarness("postgresql", transport, pg_url, engine, clock)
        finally:
            await engine.dispose()
            await transport.close()
