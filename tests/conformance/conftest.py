"""The transports the conformance suite runs on. Each case runs once per transport."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiosqlite
import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from fastapi_workqueue.database.mssql import MssqlTransport
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn
from fastapi_workqueue.database.sqlite import SqliteTransport

from .harness import Harness


@dataclass
class _SessionHarness:
    """What every database harness shares: a caller's session with an open transaction."""

    name: str
    transport: Any
    url: str
    engine: Any

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        async with AsyncSession(self.engine) as session, session.begin():
            yield session


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


@pytest.fixture(params=["postgresql", "sqlite", "mssql"])
async def harness(request: pytest.FixtureRequest, pg_url: str, sqlite_url: str) -> AsyncIterator[Harness]:
    if request.param == "mssql":
        # No SQL Server runs in CI here: the suite runs on one only where this variable names it,
        # e.g. mssql+aioodbc://sa:…@127.0.0.1:1433/workqueue?driver=ODBC+Driver+18+for+SQL+Server
        mssql_url = os.environ.get("WORKQUEUE_MSSQL_URL")
        if not mssql_url:
            pytest.skip("set WORKQUEUE_MSSQL_URL to run the conformance suite on SQL Server")
        mssql_transport = MssqlTransport(mssql_url, pool_max_size=4)
        await mssql_transport.open()
        mssql_engine = create_async_engine(mssql_url)
        try:
            await mssql_transport.migrate()
            yield MssqlHarness("mssql", mssql_transport, mssql_url, mssql_engine)
        finally:
            await mssql_engine.dispose()
            await mssql_transport.close()
    if request.param == "sqlite":
        sqlite_transport = SqliteTransport(sqlite_url)
        await sqlite_transport.open()
        sqlite_engine = create_async_engine(sqlite_url, connect_args={"timeout": 10})
        try:
            yield SqliteHarness("sqlite", sqlite_transport, sqlite_url, sqlite_engine)
        finally:
            await sqlite_engine.dispose()
            await sqlite_transport.close()
    if request.param == "postgresql":
        transport = PostgresTransport(pg_url, listen=False, pool_max_size=4)
        await transport.open()
        engine = create_async_engine(pg_url)
        try:
            yield PostgresHarness("postgresql", transport, pg_url, engine)
        finally:
            await engine.dispose()
            await transport.close()
