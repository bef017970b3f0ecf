"""The transports the conformance suite runs on. Each case runs once per transport."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiosqlite
import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn
from fastapi_workqueue.database.sqlite import SqliteTransport

from .harness import Harness


@dataclass
class PostgresHarness:
    name: str
    transport: PostgresTransport
    url: str
    engine: Any

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        async with AsyncSession(self.engine) as session, session.begin():
            yield session

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
class SqliteHarness:
    name: str
    transport: SqliteTransport
    url: str
    engine: Any

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        async with AsyncSession(self.engine) as session, session.begin():
            yield session

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


@pytest.fixture(params=["postgresql", "sqlite"])
async def harness(request: pytest.FixtureRequest, pg_url: str, sqlite_url: str) -> AsyncIterator[Harness]:
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
