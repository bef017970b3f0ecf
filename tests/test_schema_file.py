"""``sql/<dialect>/schema.sql`` is the schema a fresh install ends with, written to be read: these
tests replay the migrations (``0001_schema`` of release 0.1.0, then one per later release) on an
empty database and check that the result equals what the schema file alone builds (procrastinate's
migration test is the model).

* PostgreSQL: catalog against catalog, two empty databases: tables and columns (types, defaults,
  nullability, identity, storage options), indexes (``pg_get_indexdef``), constraints
  (``pg_get_constraintdef``), functions (``pg_get_functiondef``) and every grant.
* SQLite: the normalized ``sqlite_master`` of two empty files.
* SQL Server (no server runs here): the objects the migrations leave, each with its definition
  (tables, indexes, views, functions, procedures), against those of the schema file.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from fastapi_workqueue.database import sql_files
from fastapi_workqueue.database.mssql import split_batches
from fastapi_workqueue.database.postgres import to_asyncpg_dsn
from fastapi_workqueue.database.postgres_migrations import apply_postgres_migrations
from fastapi_workqueue.database.sqlite import SqliteTransport, split_statements

from .test_migrations import scratch_url  # noqa: F401  (a fixture: an empty database of its own)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


# -- PostgreSQL -----------------------------------------------------------------------------------

CATALOG: dict[str, str] = {
    "schema": """
        SELECT n.nspname, pg_get_userbyid(n.nspowner) AS owner, n.nspacl::text AS acl
        FROM pg_catalog.pg_namespace n WHERE n.nspname = 'workqueue'""",
    "relations": """
        SELECT c.relname, c.relkind, c.relpersistence, c.reloptions::text AS options, c.relacl::text AS acl
        FROM pg_catalog.pg_class c WHERE c.relnamespace = 'workqueue'::regnamespace AND c.relkind <> 'i'
        ORDER BY c.relname""",
    "columns": """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid) AS "default", a.attidentity, a.attgenerated,
               a.attacl::text AS acl,
               row_number() OVER (PARTITION BY c.relname ORDER BY a.attnum) AS position
        FROM pg_catalog.pg_attribute a
        JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = 'workqueue'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
          AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY c.relname, a.attnum""",
    "indexes": """
        SELECT c.relname, pg_get_indexdef(i.indexrelid) AS definition, c.reloptions::text AS options
        FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid
        WHERE c.relnamespace = 'workqueue'::regnamespace
        ORDER BY c.relname""",
    "constraints": """
        SELECT r.conrelid::regclass::text AS relation, r.conname, r.contype, pg_get_constraintdef(r.oid) AS definition
        FROM pg_catalog.pg_constraint r WHERE r.connamespace = 'workqueue'::regnamespace
        ORDER BY 1, 2""",
    "sequences": """
        SELECT s.seqrelid::regclass::text AS sequence, format_type(s.seqtypid, NULL) AS type, s.seqstart,
               s.seqincrement, s.seqmax, s.seqmin, s.seqcache, s.seqcycle
        FROM pg_catalog.pg_sequence s JOIN pg_catalog.pg_class c ON c.oid = s.seqrelid
        WHERE c.relnamespace = 'workqueue'::regnamespace
        ORDER BY 1""",
    "functions": """
        SELECT p.oid::regprocedure::text AS signature, pg_get_functiondef(p.oid) AS definition,
               p.proacl::text AS acl
        FROM pg_catalog.pg_proc p WHERE p.pronamespace = 'workqueue'::regnamespace
        ORDER BY 1""",
}


# Roles belong to the cluster, and other test sessions on the same server create and drop the
# queue's roles while this one runs: grants to them are left out of the comparison (a migration
# grants one only where the role exists; so does schema.sql). PUBLIC's and the owner's stay in.
_ROLE_GRANT = re.compile(r"workqueue_(?:runtime|operator|admin|scaler|aws)=[^,}]*,?")


async def catalog(url: str) -> dict[str, list[dict[str, Any]]]:
    conn: asyncpg.Connection[Any] = await asyncpg.connect(to_asyncpg_dsn(url))
    try:
        found = {name: [dict(r) for r in await conn.fetch(sql)] for name, sql in CATALOG.items()}
    finally:
        await conn.close()
    for rows in found.values():
        for row in rows:
            if isinstance(row.get("acl"), str):
                row["acl"] = _ROLE_GRANT.sub("", row["acl"]).replace(",}", "}")
    return found


@pytest.fixture
async def second_scratch_url(pg_url: str) -> AsyncIterator[str]:
    """Another empty database of its own."""
    from .conftest import recreate_database

    base, _, _ = pg_url.rpartition("/")
    url = f"{base}/wq_schema_{__import__('uuid').uuid4().hex[:10]}"
    await recreate_database(url)
    try:
        yield url
    finally:
        admin = await asyncpg.connect(f"{to_asyncpg_dsn(base)}/postgres")
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{url.rpartition("/")[2]}" WITH (FORCE)')
        finally:
            await admin.close()


def by_key(rows: list[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {tuple(r[k] for k in keys): r for r in rows}


async def test_postgresql_schema_file_builds_what_the_migrations_build(
    scratch_url: str, second_scratch_url: str  # noqa: F811
) -> None:
    migrated_url, installed_url = scratch_url, second_scratch_url
    conn: asyncpg.Connection[Any] = await asyncpg.connect(to_asyncpg_dsn(migrated_url))
    try:
        applied = await apply_postgres_migrations(conn)
        assert len(applied) == len(sql_files.migrations("postgresql"))
    finally:
        await conn.close()
    conn = await asyncpg.connect(to_asyncpg_dsn(installed_url))
    try:
        await conn.execute(sql_files.read("postgresql", "schema.sql"))
    finally:
        await conn.close()

    migrated, installed = await catalog(migrated_url), await catalog(installed_url)
    keys = {"schema": ("nspname",), "relations": ("relname",), "columns": ("relname", "attname"),
            "indexes": ("relname",), "constraints": ("relation", "conname"), "sequences": ("sequence",),
            "functions": ("signature",)}
    for part, key in keys.items():
        want, got = by_key(migrated[part], *key), by_key(installed[part], *key)
        assert sorted(got) == sorted(want), f"{part}: schema.sql has {sorted(set(got) - set(want))}, " \
                                            f"lacks {sorted(set(want) - set(got))}"
        for name, row in want.items():
            assert got[name] == row, f"{part} {name}: schema.sql differs from the migrations"
    assert migrated["functions"] and migrated["columns"]


# -- SQLite -------------------------------------------------------------------------------------------


def normalized_master(path: Path) -> dict[tuple[str, str], str]:
    """(type, name) → the object's SQL without comments and with whitespace collapsed."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'").fetchall()
    finally:
        conn.close()
    return {(kind, name): normalize_sql(sql or "") for kind, name, sql in rows}


def normalize_sql(sql: str) -> str:
    without_comments = "\n".join(line.split("--", 1)[0] for line in sql.splitlines())
    return re.sub(r"\s+", " ", without_comments).replace("( ", "(").replace(" )", ")").replace(" ,", ",").strip()


async def test_sqlite_schema_file_builds_what_the_migrations_build(tmp_path: Path) -> None:
    migrated_path, installed_path = tmp_path / "migrated.db", tmp_path / "installed.db"
    transport = SqliteTransport(f"sqlite+aiosqlite:///{migrated_path}")
    await transport.open()
    try:
        await transport.migrate()
    finally:
        await transport.close()
    conn = sqlite3.connect(installed_path)
    try:
        for statement in split_statements(sql_files.read("sqlite", "schema.sql")):
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()
    migrated, installed = normalized_master(migrated_path), normalized_master(installed_path)
    assert sorted(installed) == sorted(migrated)
    for name, sql in migrated.items():
        assert installed[name] == sql, name


# -- SQL Server ----------------------------------------------------------------------------------------

_OBJECT = re.compile(
    r"^\s*CREATE\s+(?:OR\s+ALTER\s+)?(?P<kind>TABLE|(?:UNIQUE\s+)?(?:CLUSTERED\s+|NONCLUSTERED\s+)?INDEX|VIEW"
    r"|PROCEDURE|FUNCTION)\s+(?P<name>[\w.\[\]]+)(?:\s+ON\s+(?P<table>[\w.]+))?",
    re.I,
)
_UNFOLLOWED = re.compile(r"^\s*(?:ALTER\s+TABLE|DROP\s+(?:INDEX|TABLE|PROCEDURE|FUNCTION|VIEW))\b", re.I)


def tsql_objects(texts: list[str]) -> dict[tuple[str, str], str]:
    """The objects a sequence of T-SQL scripts creates, each with its normalized definition (a later
    CREATE OR ALTER of a name wins). A procedure, function or view is its whole batch; elsewhere a
    statement starts at the beginning of a line (a table and its indexes share a batch). A migration
    that alters or drops an object needs this comparison to follow it: until then it says so."""
    objects: dict[tuple[str, str], str] = {}
    for text in texts:
        for batch in split_batches(text):
            code = "\n".join(line.split("--", 1)[0] for line in batch.splitlines()).strip()
            if re.match(r"CREATE\s+OR\s+ALTER\s+(?:PROCEDURE|FUNCTION|VIEW)\b", code, re.I):
                starts = [0]
            else:
                starts = [m.start() for m in re.finditer(r"^(?=(?:CREATE|DROP|INSERT|SET|IF|ALTER)\b)", code,
                                                         re.M | re.I)]
            for begin, end in zip(starts, [*starts[1:], len(code)], strict=True):
                statement = code[begin:end]
                assert not _UNFOLLOWED.match(statement), f"teach tsql_objects to follow: {statement[:80]!r}"
                if created := _OBJECT.match(statement):
                    kind = "INDEX" if "INDEX" in created["kind"].upper() else created["kind"].upper()
                    name = created["name"] if kind != "INDEX" else f"{created['table']}.{created['name']}"
                    objects[(kind, name)] = normalize_sql(statement).rstrip(";")
    return objects


def test_sql_server_schema_file_defines_what_the_migrations_leave() -> None:
    migrated = tsql_objects([m.sql for m in sql_files.migrations("mssql")])
    installed = tsql_objects([sql_files.read("mssql", "schema.sql")])
    assert sorted(installed) == sorted(migrated)
    for name, definition in migrated.items():
        assert installed[name] == definition, name
    kinds = {kind for kind, _ in migrated}
    assert kinds == {"TABLE", "INDEX", "VIEW", "FUNCTION", "PROCEDURE"}


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite", "mssql"])
def test_each_schema_file_names_the_migrations_it_equals(dialect: str) -> None:
    """The first line says which migrations the file is the sum of: a new migration updates it."""
    last = sql_files.migrations(dialect)[-1].version
    first_line = sql_files.read(dialect, "schema.sql").splitlines()[0]
    assert f"(through migration {last:04d})" in first_line, first_line


def test_the_sql_server_outbox_keeps_keys_as_the_library_allows_them() -> None:
    """The outbox's topic and partition key compare case-sensitively (binary collation), the key
    takes 512 characters, and the key index fits SQL Server's 1700-byte nonclustered key."""
    migrated = tsql_objects([m.sql for m in sql_files.migrations("mssql")])
    table = migrated[("TABLE", "workqueue.aws_outbox")]
    assert "topic nvarchar(200) collate latin1_general_100_bin2 not null" in table.lower()
    assert "partition_key nvarchar(512) collate latin1_general_100_bin2 null" in table.lower()
    index = migrated[("INDEX", "workqueue.aws_outbox.aws_outbox_unsent_key")]
    assert "(topic, partition_key, id)" in index  # 400 + 1024 + 8 bytes


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite", "mssql"])
def test_each_schema_file_speaks_of_the_code_not_of_migration_numbers(dialect: str) -> None:
    """Its comments explain the code by what it does (and docs/design/ by why), never by a migration
    a reader never saw ("0010's", "(0026)"): only the header names the migrations it equals."""
    text = sql_files.read(dialect, "schema.sql")
    header, _, body = text.partition("\n\n")
    assert "(through migration " in header and "0001_schema.sql" in header
    comments = [(n, line.split("--", 1)[1]) for n, line in enumerate(body.splitlines(), header.count("\n") + 3)
                if "--" in line]
    numbered = [(n, c.strip()) for n, c in comments if re.search(r"\b0\d{3}\b|\bversion \d+\b", c)]
    assert numbered == [], numbered
