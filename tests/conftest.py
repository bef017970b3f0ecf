"""Shared fixtures: a fresh PostgreSQL database per test session, transports, unique names."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

PG_URL = os.environ.get(
    "WORKQUEUE_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/workqueue_test"
)


def unique(prefix: str) -> str:
    """A name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def recreate_database(url: str) -> None:
    dsn = to_asyncpg_dsn(url)
    base, _, name = dsn.rpartition("/")
    admin = await asyncpg.connect(f"{base}/postgres")
    try:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()


@pytest.fixture(scope="session")
async def pg_url() -> str:
    """A freshly created, migrated PostgreSQL database for this test session."""
    await recreate_database(PG_URL)
    transport = PostgresTransport(PG_URL, listen=False)
    await transport.open()
    try:
        await transport.migrate()
    finally:
        await transport.close()
    return PG_URL


@pytest.fixture
async def pg_transport(pg_url: str) -> AsyncIterator[PostgresTransport]:
    transport = PostgresTransport(pg_url, listen=False, pool_max_size=4)
    await transport.open()
    yield transport
    await transport.close()
