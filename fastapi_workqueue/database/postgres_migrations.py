"""Applies the PostgreSQL migrations and records what it applied (SQLite's and SQL Server's
runners are their transports' ``migrate``; :mod:`.migration_plan` decides for all three)."""

from __future__ import annotations

from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from ..core.redaction import redacting_logger
from .migration_plan import pending

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
        rows = await conn.fetch("SELECT version, checksum FROM workqueue.schema_migration")
        for migration in pending("postgresql", {r["version"]: r["checksum"] for r in rows}):
            log.info("applying migration %s", migration.label)
            await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO workqueue.schema_migration (version, name, checksum) VALUES ($1, $2, $3)",
                migration.version, migration.name, migration.checksum,
            )
            applied_now.append(migration.label)
        if applied_now:
            # New functions get no PUBLIC EXECUTE: only the owner and the roles granted them (roles/) may.
            await conn.execute(_REVOKE_PUBLIC)
    return applied_now
