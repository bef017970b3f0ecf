"""Shared fixtures: a fresh PostgreSQL database per test session, a moto server per test session (the
AWS tests and the conformance suite's aws harness share it), transports, unique names."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from . import tiers

pytest_plugins = ("pytester",)

# Each test session gets a database of its own (several sessions may run at once on one server).
PG_URL = os.environ.get(
    "WORKQUEUE_TEST_DATABASE_URL", f"postgresql+asyncpg://postgres@127.0.0.1:5432/workqueue_test_{os.getpid()}"
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test with its tier (tests/tiers.py) before ``-m`` selects."""
    tiers.apply(config, items)


def unique(prefix: str) -> str:
    """A name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def drop_database(url: str, *, create: bool = False) -> None:
    """Drops the database of ``url`` (closing its connections), and creates it afresh if asked."""
    dsn = to_asyncpg_dsn(url)
    base, _, name = dsn.rpartition("/")
    admin = await asyncpg.connect(f"{base}/postgres")
    try:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        if create:
            await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()


async def recreate_database(url: str) -> None:
    """A fresh, empty database at ``url``."""
    await drop_database(url, create=True)


@pytest.fixture(scope="session")
async def pg_url() -> AsyncIterator[str]:
    """A freshly created, migrated PostgreSQL database for this test session (dropped at the end)."""
    await recreate_database(PG_URL)
    transport = PostgresTransport(PG_URL, listen=False)
    await transport.open()
    try:
        await transport.migrate()
    finally:
        await transport.close()
    yield PG_URL
    if "WORKQUEUE_TEST_DATABASE_URL" not in os.environ:
        await drop_database(PG_URL)


@pytest.fixture(scope="session")
async def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A migrated SQLite file for this test session."""
    from fastapi_workqueue.database.sqlite import SqliteTransport

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('sqlite') / 'workqueue.db'}"
    transport = SqliteTransport(url)
    await transport.open()
    try:
        await transport.migrate()
    finally:
        await transport.close()
    return url


@pytest.fixture(params=["postgresql", "sqlite"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The session's PostgreSQL database, then an SQLite file of the test's own (a test runs on each)."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'queue.db'}"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture(params=["postgresql", "sqlite"])
async def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A database of the test's own on each store (PostgreSQL, then SQLite), empty and not migrated:
    what the test finds in it ("every queue", a command's listing) is its own."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}"
        return
    async with private_database("workqueue_fresh") as url:
        yield url


@contextlib.asynccontextmanager
async def private_database(prefix: str) -> AsyncIterator[str]:
    """A PostgreSQL database of its own beside the session's (``<prefix>_<random>``), empty, dropped after."""
    url = PG_URL.rpartition("/")[0] + f"/{prefix}_{uuid.uuid4().hex[:8]}"
    await recreate_database(url)
    try:
        yield url
    finally:
        await drop_database(url)


@pytest.fixture
async def pg_transport(pg_url: str) -> AsyncIterator[PostgresTransport]:
    transport = PostgresTransport(pg_url, listen=False, pool_max_size=4)
    await transport.open()
    yield transport
    await transport.close()


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    """The endpoint of a moto server started for this session (the AWS SDKs get test credentials):
    one for tests/aws and the conformance suite's aws harness."""
    from .aws.moto import CREDENTIALS, moto_server

    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    try:
        with moto_server() as url:
            yield url
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
