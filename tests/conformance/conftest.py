"""The transports the conformance suite runs on. Each case runs once per transport."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

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


@pytest.fixture(params=["postgresql"])
async def harness(request: pytest.FixtureRequest, pg_url: str) -> AsyncIterator[Harness]:
    if request.param == "postgresql":
        transport = PostgresTransport(pg_url, listen=False, pool_max_size=4)
        await transport.open()
        engine = create_async_engine(pg_url)
        try:
            yield PostgresHarness("postgresql", transport, pg_url, engine)
        finally:
            await engine.dispose()
            await transport.close()
