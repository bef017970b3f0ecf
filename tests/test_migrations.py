"""The migration runner: records what it applied, applies it once, refuses changed files, and
refuses with one line a database that the pre-release chain of migrations built."""

from __future__ import annotations

import asyncio
import hashlib
import re
import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from fastapi_workqueue.core.errors import ConfigurationError
from fastapi_workqueue.database import migration_plan, sql_files
from fastapi_workqueue.database.migration_plan import PRE_RELEASE_FIRST_CHECKSUMS
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn
from fastapi_workqueue.database.postgres_migrations import apply_postgres_migrations
from fastapi_workqueue.database.sqlite import SqliteTransport

from .conftest import recreate_database
from .support import wait_for

pytestmark = pytest.mark.timeout(60)

SQL_DIR = Path(__file__).resolve().parents[1] / "sql" / "postgresql"
MIGRATION_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
FUNCTION_CHANGE = re.compile(r"\b(CREATE\s+(?:OR\s+REPLACE\s+)?)FUNCTION\s+workqueue\.(\w+)\s*\(", re.IGNORECASE)


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
    """The functions a fresh install has: those schema.sql creates."""
    return {m.group(2) for m in FUNCTION_CHANGE.finditer(sql_files.read("postgresql", "schema.sql"))}


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
    # Each version once, in order, from 0001_schema (release 0.1.0's schema) on.
    versions = [version for version, _, _ in on_disk]
    assert versions == sorted(set(versions)) and on_disk[0][:2] == (1, "schema")
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
        async def both_waiting() -> bool:
            return bool(await gate.fetchval(
                "SELECT count(*) FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_database d ON d.oid = l.database "
                "WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database()"
            ) == 2)

        await wait_for(both_waiting, within=5)
        await gate_tx.commit()
        results = await asyncio.wait_for(asyncio.gather(*runners), timeout=30)

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
    assert found[0].label == "0001_schema"

    expected = defined_functions()
    assert {"publish", "claim", "heartbeat", "settle", "sweep", "sync_topic", "sync_subscription"} <= expected
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        present = await schema_functions(conn)
    finally:
        await conn.close()
    assert sorted(expected - present) == []
    assert sorted(present - expected) == []  # nothing in the database that schema.sql does not define


# -- a database the pre-release chain of migrations built -------------------------------------------

PRE_RELEASE_CHAIN: dict[str, list[tuple[int, str]]] = {
    "postgresql": [
        (1, "schema"), (2, "operations"), (3, "privileges"), (4, "hot_paths"), (5, "publish_fast_path"),
        (6, "api_keys"), (7, "release_keys"), (8, "release_keys_delete"), (9, "publish_one_statement"),
        (10, "publish_without_lookup"), (11, "publish_in_statements"), (12, "publish_one"),
        (13, "purge_within_bounds"), (14, "settle_by_index"), (15, "heartbeat_by_index"),
        (16, "publish_one_fallback"), (17, "lighter_writes"), (18, "publish_reads_key_modes"),
        (19, "keys_skip_producers"), (20, "settle_draws"), (21, "heartbeat_hot"), (22, "settled_counts"),
        (23, "listings_fill_every_field"), (24, "api_keys_touched_after_match"), (25, "jobs_store"),
        (26, "hot_path_plans"), (27, "aws_outbox"), (28, "stats_history"), (29, "claim_many_by_id"),
        (30, "publish_wakes_after_commit"), (31, "claim_many_one_due"), (32, "api_key_topics_and_sessions"),
        (33, "process_holder"), (35, "once_renew"), (36, "subscription_lifecycle"), (37, "sweep_names_taken_leases"),
    ],
    "sqlite": [
        (1, "schema"), (2, "heartbeat_in_place"), (3, "settled_counts"), (4, "api_key_names"), (5, "jobs_store"),
        (7, "aws_outbox"), (8, "stats_history"), (9, "api_key_topics_and_sessions"), (10, "process_holder"),
        (13, "subscription_lifecycle"),
    ],
    "mssql": [
        (1, "schema"), (2, "helpers"), (3, "topology"), (4, "publish"), (5, "consume"), (6, "sweeper"),
        (7, "operate"), (8, "keys_and_markers"), (9, "publish_accepted_shorthand"), (10, "purge_within_bounds"),
        (11, "publish_reads_key_modes"), (12, "keys_skip_producers"), (13, "settle_draws"),
        (14, "heartbeat_in_place"), (15, "settled_counts"), (16, "listings_fill_every_field"),
        (17, "api_keys_touched_after_match"), (18, "jobs_store"), (20, "aws_outbox"), (21, "stats_history"),
        (22, "aws_outbox_binary_keys"), (23, "api_key_topics_and_sessions"), (24, "process_holder"),
        (26, "once_renew"), (27, "subscription_lifecycle"), (28, "sweep_names_taken_leases"),
    ],
}
"""The schema_migration rows each dialect's chain before 0.1.0 left, (version, name) in order."""


def pre_release_rows(dialect: str, *, first_checksum: str | None = None) -> list[tuple[int, str, str]]:
    """(version, name, checksum) as the pre-release chain recorded them: its 0001's real checksum
    (or ``first_checksum``), a stand-in for the others (only 0001's is known to the runner)."""
    first = first_checksum or PRE_RELEASE_FIRST_CHECKSUMS[dialect]
    return [(v, n, first if v == 1 else hashlib.sha256(f"{v:04d}_{n}".encode()).hexdigest())
            for v, n in PRE_RELEASE_CHAIN[dialect]]


def assert_says_what_to_do(message: str, dialect: str) -> None:
    last = PRE_RELEASE_CHAIN[dialect][-1][0]
    assert "\n" not in message, message
    assert f"migrations 0001-{last:04d}" in message and "before 0.1.0" in message, message
    assert "0001_schema" in message and "`workqueue migrate`" in message, message


async def write_schema_migration(url: str, rows: list[tuple[int, str, str]]) -> None:
    conn = await asyncpg.connect(to_asyncpg_dsn(url))
    try:
        await conn.execute(
            "CREATE SCHEMA workqueue; CREATE TABLE workqueue.schema_migration (version integer PRIMARY KEY, "
            "name text NOT NULL, checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        await conn.executemany("INSERT INTO workqueue.schema_migration (version, name, checksum) VALUES ($1, $2, $3)",
                               rows)
    finally:
        await conn.close()


@pytest.mark.parametrize("first", ["the pre-release 0001", "an unknown 0001"])
async def test_a_database_the_pre_release_chain_built_is_refused_with_what_to_do(scratch_url: str, first: str) -> None:
    """Its schema_migration rows give it away (the old 0001's checksum, or versions this release
    does not ship beside a 0001 it does not know): migrate refuses with one line, applies nothing."""
    other = hashlib.sha256(b"some other 0001").hexdigest() if first == "an unknown 0001" else None
    await write_schema_migration(scratch_url, pre_release_rows("postgresql", first_checksum=other))
    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        with pytest.raises(ConfigurationError) as caught:
            await apply_postgres_migrations(conn)
        assert_says_what_to_do(str(caught.value), "postgresql")
        assert "DROP SCHEMA workqueue CASCADE" in str(caught.value)
        assert await conn.fetchval("SELECT to_regclass('workqueue.delivery')") is None  # nothing applied
        assert await conn.fetchval("SELECT count(*) FROM workqueue.schema_migration") == len(
            PRE_RELEASE_CHAIN["postgresql"])
    finally:
        await conn.close()

    transport = PostgresTransport(scratch_url, listen=False, pool_max_size=1)
    await transport.open()
    try:
        with pytest.raises(ConfigurationError, match=r"before 0\.1\.0"):
            await transport.migrate()
    finally:
        await transport.close()


async def test_an_edited_0001_alone_is_a_changed_migration_not_the_old_chain(scratch_url: str) -> None:
    await write_schema_migration(scratch_url, [(1, "schema", "edited")])
    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        with pytest.raises(ConfigurationError, match="0001_schema was changed after it was applied") as refused:
            await apply_postgres_migrations(conn)
        # (and what its user does about it: it said only how to ship a schema change)
        assert "DROP SCHEMA workqueue CASCADE) or use a new database and run `workqueue migrate`" in str(refused.value)
    finally:
        await conn.close()


async def test_sqlite_refuses_a_file_the_pre_release_chain_built(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    try:
        conn.execute("CREATE TABLE schema_migration (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
                     "checksum TEXT NOT NULL, applied_at REAL NOT NULL)")
        conn.executemany("INSERT INTO schema_migration VALUES (?, ?, ?, 0)", pre_release_rows("sqlite"))
        conn.commit()
    finally:
        conn.close()
    transport = SqliteTransport(f"sqlite+aiosqlite:///{path}")
    await transport.open()
    try:
        with pytest.raises(ConfigurationError) as caught:
            await transport.migrate()
        assert_says_what_to_do(str(caught.value), "sqlite")
        assert "use a new file" in str(caught.value)
        # validate-bindings says the same, once, instead of a line per migration.
        report = await transport.validate_bindings()
        [error] = [i for i in report.issues if i.severity == "Error"]
        assert error.subject == "schema" and error.message == str(caught.value)
    finally:
        await transport.close()
    conn = sqlite3.connect(path)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        conn.close()
    assert tables == {"schema_migration"}  # nothing applied


def test_sql_server_recognises_the_pre_release_chain_by_its_rows() -> None:
    """No SQL Server runs here: the decision its runner makes from the rows, checked as such."""
    old = {v: c for v, _, c in pre_release_rows("mssql")}
    message = migration_plan.pre_release_chain("mssql", old)
    assert message is not None
    assert_says_what_to_do(message, "mssql")
    with pytest.raises(ConfigurationError, match=r"before 0\.1\.0"):
        migration_plan.pending("mssql", old)
    current = {m.version: m.checksum for m in sql_files.migrations("mssql")}
    assert migration_plan.pre_release_chain("mssql", current) is None
    assert migration_plan.pending("mssql", current) == []
    assert [m.label for m in migration_plan.pending("mssql", {})] == ["0001_schema"]


def test_the_pre_release_checksums_are_those_of_the_old_first_migrations() -> None:
    """None of them is the checksum of a migration this release ships (it would then be refused)."""
    for dialect, checksum in PRE_RELEASE_FIRST_CHECKSUMS.items():
        assert checksum not in {m.checksum for m in sql_files.migrations(dialect)}
