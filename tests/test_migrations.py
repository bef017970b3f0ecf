"""The migration runner: records what it applied, applies it once, refuses changed files."""

from __future__ import annotations

import asyncio
import hashlib
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from fastapi_workqueue.core.errors import ConfigurationError
from fastapi_workqueue.database import sql_files
from fastapi_workqueue.database.migrations import apply_postgres_migrations
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from .conftest import recreate_database

pytestmark = pytest.mark.timeout(60)

SQL_DIR = Path(__file__).resolve().parents[1] / "sql" / "postgresql"
MIGRATION_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
FUNCTION_CHANGE = re.compile(
    r"\b(CREATE\s+(?:OR\s+REPLACE\s+)?|DROP\s+)FUNCTION\s+(?:IF\s+EXISTS\s+)?workqueue\.(\w+)\s*\(", re.IGNORECASE
)


def files_on_disk() -> list[tuple[int, str, str]]:
    """(version, name, checksum) of every migration file in the source checkout, in order."""
    found = []
    for path in SQL_DIR.iterdir():
        match = MIGRATION_FILE.match(path.name)
        if match:
            checksum = hashlib.sha256(path.read_text(encoding="utf-8").encode()).hexdigest()
            found.append((int(match.group(1)), match.group(2), checksum))
    return sorted(found)


def labels() -> list[str]:
    return [f"{version:04d}_{name}" for version, name, _ in files_on_disk()]


def defined_functions() -> set[str]:
    """The functions the migrations leave: created, and not dropped by a later statement."""
    names: set[str] = set()
    for migration in sql_files.migrations("postgresql"):
        for match in FUNCTION_CHANGE.finditer(migration.sql):
            if match.group(1).upper().startswith("DROP"):
                names.discard(match.group(2))
            else:
                names.add(match.group(2))
    return names


async def schema_functions(conn: asyncpg.Connection[Any]) -> set[str]:
    rows = await conn.fetch(
        "SELECT p.proname FROM pg_catalog.pg_proc p WHERE p.pronamespace = 'workqueue'::regnamespace"
    )
    return {r["proname"] for r in rows}


@pytest.fixture
async def scratch_url(pg_url: str) -> AsyncIterator[str]:
    """An empty database of its own, dropped afterwards."""
    base, _, _ = pg_url.rpartition("/")
    name = f"wq_scratch_{uuid.uuid4().hex[:10]}"
    url = f"{base}/{name}"
    await recreate_database(url)
    try:
        yield url
    finally:
        admin = await asyncpg.connect(f"{to_asyncpg_dsn(base)}/postgres")
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def test_applied_migrations_are_recorded_one_per_file(pg_url: str) -> None:
    on_disk = files_on_disk()
    # Each version once, in order; numbers reserved for work in progress elsewhere may be missing
    # (the runner applies every version a database lacks, whatever its place).
    versions = [version for version, _, _ in on_disk]
    assert versions == sorted(set(versions)) and versions[0] == 1
    assert len(on_disk) >= 3
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        rows = await conn.fetch("SELECT version, name, checksum FROM workqueue.schema_migration ORDER BY version")
    finally:
        await conn.close()
    assert [(r["version"], r["name"], r["checksum"]) for r in rows] == on_disk


async def test_running_again_applies_nothing(pg_url: str) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        before = await conn.fetch("SELECT version, checksum, applied_at FROM workqueue.schema_migration ORDER BY 1")
        assert await apply_postgres_migrations(conn) == []
        assert await apply_postgres_migrations(conn) == []
        after = await conn.fetch("SELECT version, checksum, applied_at FROM workqueue.schema_migration ORDER BY 1")
    finally:
        await conn.close()
    assert [tuple(r) for r in after] == [tuple(r) for r in before]

    transport = PostgresTransport(pg_url, listen=False, pool_max_size=1)
    await transport.open()
    try:
        assert await transport.migrate() == []
    finally:
        await transport.close()


async def test_changed_migration_is_refused(scratch_url: str) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        assert await apply_postgres_migrations(conn) == labels()
        for label in labels():
            version = int(label[:4])
            original = await conn.fetchval(
                "SELECT checksum FROM workqueue.schema_migration WHERE version = $1", version
            )
            await conn.execute(
                "UPDATE workqueue.schema_migration SET checksum = 'edited' WHERE version = $1", version
            )
            with pytest.raises(ConfigurationError, match=f"migration {label} was changed"):
                await apply_postgres_migrations(conn)
            # The failed run rolled back and left the connection usable.
            assert conn.is_in_transaction() is False
            await conn.execute(
                "UPDATE workqueue.schema_migration SET checksum = $2 WHERE version = $1", version, original
            )

        # Through the transport the error is the same ConfigurationError, not retried away.
        await conn.execute("UPDATE workqueue.schema_migration SET checksum = 'edited' WHERE version = 1")
        transport = PostgresTransport(scratch_url, listen=False, pool_max_size=1)
        await transport.open()
        try:
            with pytest.raises(ConfigurationError, match=labels()[0]):
                await transport.migrate()
        finally:
            await transport.close()
    finally:
        await conn.close()


async def test_concurrent_runners_apply_each_migration_once(scratch_url: str) -> None:
    dsn = to_asyncpg_dsn(scratch_url)
    conns: list[asyncpg.Connection[Any]] = []
    runners: list[asyncio.Task[list[str]]] = []
    try:
        for _ in range(3):
            conns.append(await asyncpg.connect(dsn))
        gate, first, second = conns
        # Hold the runners' lock so both are certainly running, and waiting, at the same time.
        gate_tx = gate.transaction()
        await gate_tx.start()
        await gate.execute("SELECT pg_advisory_xact_lock(hashtext('workqueue.migrate')::bigint)")
        runners += [asyncio.create_task(apply_postgres_migrations(c)) for c in (first, second)]
        waiting = 0
        for _ in range(250):
            waiting = await gate.fetchval(
                "SELECT count(*) FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_database d ON d.oid = l.database "
                "WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database()"
            )
            if waiting == 2:
                break
            await asyncio.sleep(0.02)
        await gate_tx.commit()
        results = await asyncio.wait_for(asyncio.gather(*runners), timeout=30)
        assert waiting == 2

        assert sorted(results, key=len) == [[], labels()]
        rows = await gate.fetch("SELECT version, name, checksum, applied_at FROM workqueue.schema_migration ORDER BY 1")
        assert [(r["version"], r["name"], r["checksum"]) for r in rows] == files_on_disk()
        assert len({r["applied_at"] for r in rows}) == 1  # one transaction applied them all
        assert await schema_functions(gate) == defined_functions()
    finally:
        for task in runners:
            task.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        for conn in conns:
            await conn.close()


async def test_sql_files_are_found_and_every_function_exists(pg_url: str) -> None:
    found = sql_files.migrations("postgresql")
    on_disk = files_on_disk()
    assert [(m.version, m.name, m.checksum) for m in found] == on_disk
    assert [m.name for m in found][:3] == ["schema", "operations", "privileges"]

    expected = defined_functions()
    assert {"publish", "claim", "heartbeat", "settle", "sweep", "sync_topic", "sync_subscription"} <= expected
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        present = await schema_functions(conn)
    finally:
        await conn.close()
    assert sorted(expected - present) == []
    assert sorted(present - expected) == []  # nothing in the schema that no migration defines


async def test_an_upgrade_lets_an_existing_runtime_role_call_the_new_functions(
    scratch_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database whose runtime role was set up at version 11 can publish one message at once after
    migrating to 12 (publish_one), and settle and list deliveries after 20 and 23 (which create
    those functions again), without running the role script again."""
    from fastapi_workqueue.database import migrations as runner

    every = sql_files.migrations("postgresql")
    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        monkeypatch.setattr(runner, "migrations", lambda dialect: [m for m in every if m.version <= 11])
        await apply_postgres_migrations(conn)
        await conn.execute(sql_files.read("postgresql", "roles", "runtime_role.sql"))
        monkeypatch.setattr(runner, "migrations", lambda dialect: every)
        assert await apply_postgres_migrations(conn) == [f"{m.version:04d}_{m.name}" for m in every if m.version > 11]
        signature = ("workqueue.publish_one(text, uuid, text, jsonb, text, text, text, text, double precision, "
                     "timestamptz, integer, text, integer)")
        assert await conn.fetchval("SELECT has_function_privilege('workqueue_runtime', $1, 'EXECUTE')", signature)
        assert not await conn.fetchval("SELECT has_function_privilege('public', $1, 'EXECUTE')", signature)
        # 0020 and 0023 created settle and list_deliveries again, 0024 api_key_touch: the runtime role's.
        for recreated in ("workqueue.settle(bigint[], uuid[], text[], double precision[], text[], text[], "
                          "double precision[])", "workqueue.list_deliveries(text, text, integer, bigint)",
                          "workqueue.api_key_touch(uuid)"):
            assert await conn.fetchval("SELECT has_function_privilege('workqueue_runtime', $1, 'EXECUTE')", recreated)
            assert not await conn.fetchval("SELECT has_function_privilege('public', $1, 'EXECUTE')", recreated)
    finally:
        await conn.close()


async def test_an_upgrade_keeps_the_keys_made_before_and_gives_the_runtime_role_the_key_check(
    scratch_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key made at version 31 (no topic list) checks as before after 0032 and reaches every topic
    but the job queues'; the runtime role set up at 31 may call the new key check and session
    functions and no longer reads hashes (api_key_lookup is gone); the admin role may mint keys."""
    from fastapi_workqueue.core.keys import check_key, generate_key, hash_key
    from fastapi_workqueue.database import migrations as runner

    every = sql_files.migrations("postgresql")
    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    transport = PostgresTransport(scratch_url, listen=False, pool_max_size=1)
    try:
        monkeypatch.setattr(runner, "migrations", lambda dialect: [m for m in every if m.version <= 31])
        await apply_postgres_migrations(conn)
        for script in ("runtime_role.sql", "admin_role.sql"):
            await conn.execute(sql_files.read("postgresql", "roles", script))
        key, prefix = generate_key()
        await conn.execute("SELECT workqueue.api_key_create($1, $2, $3, $4, $5, NULL)", uuid.uuid4(), "old-publisher",
                           prefix, hash_key(key), ["workqueue:publish"])
        monkeypatch.setattr(runner, "migrations", lambda dialect: every)
        assert await apply_postgres_migrations(conn) == [f"{m.version:04d}_{m.name}" for m in every if m.version > 31]

        await transport.open()
        record = await check_key(transport, key)
        assert record is not None and record.name == "old-publisher" and record.topics is None
        principal = record.principal()
        assert principal.may_reach("orders") and not principal.has("workqueue:jobs")
        for granted in ("workqueue.api_key_verify(text, text)", "workqueue.api_key_session(text)",
                        "workqueue.api_key_end_sessions(uuid, integer)"):
            assert await conn.fetchval("SELECT has_function_privilege('workqueue_runtime', $1, 'EXECUTE')", granted)
            assert not await conn.fetchval("SELECT has_function_privilege('public', $1, 'EXECUTE')", granted)
        create = "workqueue.api_key_create(uuid, text, text, text, text[], timestamptz, text[])"
        assert await conn.fetchval("SELECT has_function_privilege('workqueue_admin', $1, 'EXECUTE')", create)
        assert await conn.fetchval("SELECT to_regproc('workqueue.api_key_lookup')") is None
    finally:
        await transport.close()
        await conn.close()
