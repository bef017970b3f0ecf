"""PostgreSQL's migration runner: applies ``sql/postgresql/``'s versioned migrations and records
what it applied in ``workqueue.schema_migration``. SQLite's runner is ``SqliteTransport.migrate``
(``sqlite.py``), SQL Server's ``apply_mssql_migrations`` (``mssql.py``)."""

from __future__ import annotations

from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from ..core.errors import ConfigurationError
from ..core.redaction import redacting_logger
from .sql_files import migrations

log = redacting_logger("fastapi_workqueue.migrations")

_REVOKE_PUBLIC = """
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA workqueue FROM PUBLIC;
REVOKE ALL ON ALL PROCEDURES IN SCHEMA workqueue FROM PUBLIC;
"""

_BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS workqueue;
CREATE TABLE IF NOT EXISTS workqueue.schema_migration (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    checksum    text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
"""


async def apply_postgres_migrations(conn: asyncpg.Connection[Any] | PoolConnectionProxy[Any]) -> list[str]:
    """Applies every migration not yet recorded, in one transaction, one process at a time."""
    applied_now: list[str] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('workqueue.migrate')::bigint)")
        if await conn.fetchval("SELECT to_regclass('workqueue.schema_migration')") is None:
            await conn.execute(_BOOTSTRAP)
        rows = await conn.fetch("SELECT version, name, checksum FROM workqueue.schema_migration")
        done = {r["version"]: r for r in rows}
        for migration in migrations("postgresql"):
            label = f"{migration.version:04d}_{migration.name}"
            recorded = done.get(migration.version)
            if recorded is not None:
                if recorded["checksum"] != migration.checksum:
                    raise ConfigurationError(
                        f"migration {label} was changed after it was applied to this database; "
                        "ship schema changes as a new migration file"
                    )
                continue
            log.info("applying migration %s", label)
            await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO workqueue.schema_migration (version, name, checksum) VALUES ($1, $2, $3)",
                migration.version, migration.name, migration.checksum,
            )
            applied_now.append(label)
        if applied_now:
            # New functions get no PUBLIC EXECUTE: only the owner and the roles granted them (roles/) may.
            await conn.execute(_REVOKE_PUBLIC)
    return applied_now
