"""The SQL Server half, checked without a SQL Server (none can run on our machines).

What this file verifies (docs/sql-server.md says the same):

* every file of ``sql/mssql`` parses with sqlfluff's ``tsql`` dialect, with no unparsable segment;
* every PostgreSQL function (as ``sql/postgresql/schema.sql`` defines it) but the PostgreSQL-only
  ones has a T-SQL routine (as ``sql/mssql/schema.sql`` defines it) of the same name with the same
  parameter names in the same order, and SQL Server has no routine PostgreSQL lacks;
* the result columns: each procedure's ``-- returns:`` line and the aliases of its final SELECT
  equal PostgreSQL's ``RETURNS TABLE (...)`` (or the routine's name for a scalar function);
* every routine the transport calls (``routines.py``) exists in both dialects, with the keyword
  names it passes and defaults for the parameters it leaves out;
* some design rules (writing procedures use XACT_ABORT and TRY/CATCH/THROW, claims use
  UPDLOCK/READPAST/ROWLOCK, the sweeper takes its application lock without waiting, no
  PostgreSQL-only syntax) and the transport's pieces that need no server.

What it cannot verify is how the procedures behave: that needs a SQL Server, and the
conformance suite (tests/conformance) runs on one when WORKQUEUE_MSSQL_URL is set.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import json
import re
import struct
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlfluff.core import FluffConfig, Linter

from fastapi_workqueue.core.errors import ConfigurationError, SchemaMissing, TransportError
from fastapi_workqueue.database import create_database_transport, mssql
from fastapi_workqueue.database.mssql import MssqlTransport
from fastapi_workqueue.database.sql_files import migrations
from fastapi_workqueue.database.sqlite_routines import READ_ONLY

ROOT = Path(__file__).resolve().parents[1]
PG_DIR = ROOT / "sql" / "postgresql"
MSSQL_DIR = ROOT / "sql" / "mssql"
MSSQL_FILES = sorted(MSSQL_DIR.rglob("*.sql"))
MSSQL_SCHEMA = MSSQL_DIR / "schema.sql"
ROUTINES_PY = ROOT / "fastapi_workqueue" / "database" / "routines.py"

PURE_HELPERS = frozenset({"backoff_seconds", "filter_matches", "rate_per_second"})
"""PostgreSQL functions that are T-SQL functions (pure helpers); every other one is a procedure."""
HELPER_OBJECTS = frozenset({"random_draw"})
"""SQL Server objects without a PostgreSQL twin: the view backoff_seconds draws its jitter from
(a T-SQL function may not call RAND()). It is a view, not a routine."""
POSTGRESQL_ONLY = frozenset({"publish_one", "watch_message", "delivery_ended"})
"""PostgreSQL functions without a T-SQL routine: publish_one is publish for one message with
scalars (and, quiet, without its NOTIFY), which only the PostgreSQL transport calls
(``postgres.py``); every other dialect calls publish for that too. watch_message
asks for a NOTIFY when a job ends (a waiter elsewhere polls), and delivery_ended is a trigger's
function (SQL Server's trigger of that name is no routine)."""
OWNER_ONLY = frozenset({"aws_binding_replace"})
"""Granted to no role: importing bindings is a deployment step the schema owner runs."""
AWS_READS = frozenset({"aws_outbox_take", "aws_binding_list"})
"""The AWS layer's routines that write nothing (SQLite runs its outbox and bindings as named
statements, so they are not in ``READ_ONLY``); the take locks the rows it answers."""
RETURN_STATUS = frozenset({"refresh_partition", "rederive_stale"})
"""Answer through the procedure's return status instead of a result set (only other procedures
call them; a result set would reach their client)."""

SEARCH_COLUMNS = {"message": ("job",)}
"""SQL Server's computed columns that only an index of the search reads (``message_job``: the job
name out of the attributes); PostgreSQL and SQLite index the expression itself."""

URL = "mssql+aioodbc://app:secret@db.example:1433/work?driver=ODBC+Driver+18+for+SQL+Server"


# -- parsing ---------------------------------------------------------------------------------------


def _strip_line_comments(text: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def _balanced(text: str, start: int) -> tuple[str, int]:
    """The text inside the parentheses opening at ``start``, and the index after them."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    raise ValueError("unbalanced parentheses")


def _split_top(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


@dataclass(frozen=True)
class PgFunction:
    name: str
    params: tuple[str, ...]
    defaults: frozenset[str]
    returns: str  # "table", "void" or the scalar type
    columns: tuple[str, ...]


@functools.cache
def pg_functions() -> dict[str, PgFunction]:
    """Every function of ``sql/postgresql/schema.sql``, the schema a fresh install ends with."""
    found: dict[str, PgFunction] = {}
    text = _strip_line_comments((PG_DIR / "schema.sql").read_text(encoding="utf-8"))
    for match in re.finditer(r"CREATE\s+OR\s+REPLACE\s+FUNCTION\s+workqueue\.(\w+)\s*\(", text, re.I):
        args, end = _balanced(text, match.end() - 1)
        items = _split_top(args)
        rest = re.match(r"\s*RETURNS\s+", text[end:], re.I)
        assert rest, f"schema.sql: {match.group(1)} has no RETURNS"
        after = end + rest.end()
        columns: tuple[str, ...] = ()
        if re.match(r"TABLE\s*\(", text[after:], re.I):
            inner, _ = _balanced(text, text.index("(", after))
            returns, columns = "table", tuple(c.split()[0] for c in _split_top(inner))
        else:
            returns = text[after:].split()[0].lower()
        found[match.group(1)] = PgFunction(
            name=match.group(1),
            params=tuple(item.split()[0] for item in items),
            defaults=frozenset(item.split()[0] for item in items if re.search(r"\bDEFAULT\b", item, re.I)),
            returns=returns,
            columns=columns,
        )
    return found


MAX_PARSE_NODES = 1_000_000
"""sqlfluff's guard against hostile input stops at 100,000 tokens by default; the schema is our own
and has outgrown it."""


@functools.cache
def parse_tree(path: Path) -> Any:
    """sqlfluff's parse of one T-SQL file (parsed once per test session)."""
    config = FluffConfig(overrides={"dialect": "tsql", "max_parse_nodes": MAX_PARSE_NODES})
    return Linter(config=config).parse_string(path.read_text(encoding="utf-8"), fname=str(path))


def _first(segment: Any, *types: str) -> Any:
    return next((s for s in segment.segments if s.is_type(*types)), None)


def _identifier(segment: Any) -> str:
    return str(segment.raw).strip("[]\"")


def _select_columns(select: Any) -> tuple[str, ...]:
    clause = _first(select, "select_clause")
    names: list[str] = []
    for element in clause.recursive_crawl("select_clause_element", recurse_into=False):
        alias = _first(element, "alias_expression")
        if alias is not None:
            idents = [s for s in alias.recursive_crawl("naked_identifier", "quoted_identifier")]
            names.append(_identifier(idents[-1]))
            continue
        column = _first(element, "column_reference")
        assert column is not None, f"result column without a name: {element.raw!r}"
        idents = [s for s in column.recursive_crawl("naked_identifier", "quoted_identifier")]
        names.append(_identifier(idents[-1]))
    return tuple(names)


def _final_select(procedure: Any) -> tuple[str, ...] | None:
    """The columns of the last SELECT at the top level of the procedure's BEGIN ... END."""
    body = _first(procedure, "procedure_statement")
    block = next(body.recursive_crawl("begin_end_block"))
    result = None
    for statement in (s for s in block.segments if s.is_type("statement")):
        inner = statement.segments[0]
        if inner.is_type("with_compound_statement"):
            inner = _first(inner, "select_statement") or inner
        if inner.is_type("select_statement") and not re.match(r"(?is)select\s+@\w+\s*=", inner.raw):
            result = _select_columns(inner)
    return result


@dataclass(frozen=True)
class TsqlRoutine:
    name: str
    kind: str  # "procedure" or "function"
    params: tuple[str, ...]
    defaults: frozenset[str]
    annotation: str | None
    result_columns: tuple[str, ...] | None
    raw: str
    file: str


def _parameters(segment: Any) -> tuple[tuple[str, ...], frozenset[str]]:
    params: list[str] = []
    defaults: set[str] = set()
    for child in segment.recursive_crawl("parameter", "comparison_operator", recurse_into=False):
        if child.is_type("parameter"):
            params.append(str(child.raw))
        elif params:
            defaults.add(params[-1])
    return tuple(params), frozenset(defaults)


_ANNOTATION = re.compile(
    r"^-- returns: (?P<cols>.+)\nCREATE OR ALTER (?:PROCEDURE|FUNCTION) workqueue\.(?P<name>\w+)", re.M
)


@functools.cache
def tsql_routines() -> dict[str, TsqlRoutine]:
    """Every procedure and function of ``sql/mssql/schema.sql``."""
    routines: dict[str, TsqlRoutine] = {}
    annotations = {m["name"]: m["cols"].strip() for m in _ANNOTATION.finditer(MSSQL_SCHEMA.read_text(encoding="utf-8"))}
    tree = parse_tree(MSSQL_SCHEMA).tree
    for segment in tree.recursive_crawl("create_procedure_statement", "create_function_statement"):
        name = _identifier(list(_first(segment, "object_reference").recursive_crawl("naked_identifier"))[-1])
        schema = _first(segment, "object_reference").raw.split(".")[0]
        assert schema == "workqueue", f"schema.sql: {name} is not in schema workqueue"
        assert name not in routines, f"schema.sql defines {name} twice"
        kind = "procedure" if segment.is_type("create_procedure_statement") else "function"
        param_list = _first(segment, "procedure_parameter_list", "function_parameter_list")
        params, defaults = _parameters(param_list) if param_list is not None else ((), frozenset())
        routines[name] = TsqlRoutine(
            name=name, kind=kind, params=params, defaults=defaults, annotation=annotations.get(name),
            result_columns=_final_select(segment) if kind == "procedure" else None,
            raw=str(segment.raw), file=MSSQL_SCHEMA.name,
        )
    return routines


def _expected_annotation(fn: PgFunction) -> str:
    if fn.name in RETURN_STATUS:
        return "return status"
    if fn.returns == "table":
        return ", ".join(fn.columns)
    if fn.returns == "void":
        return "nothing"
    return fn.name


# -- (a) every file parses -------------------------------------------------------------------------


@pytest.mark.parametrize("path", MSSQL_FILES, ids=lambda p: str(p.relative_to(MSSQL_DIR)))
def test_every_file_parses_as_tsql(path: Path) -> None:
    parsed = parse_tree(path)
    problems = [str(v) for variant in parsed.parsed_variants
                for v in (*variant.lexing_violations, *variant.parsing_violations)]
    assert parsed.tree is not None
    unparsable = [(s.pos_marker.working_line_no, s.raw[:80]) for s in parsed.tree.recursive_crawl("unparsable")]
    assert not problems and not unparsable, f"{path.name}: {problems or unparsable}"


def test_the_files_are_the_expected_migrations() -> None:
    found = migrations("mssql")
    versions = [m.version for m in found]
    # 0001_schema (release 0.1.0's schema), then each later release's one, each version once.
    assert versions == sorted(set(versions)) and found[0].label == "0001_schema", versions
    for role in ROLES:
        assert (MSSQL_DIR / "roles" / f"{role}_role.sql").is_file()


def test_every_create_starts_its_batch() -> None:
    """CREATE PROCEDURE/FUNCTION/VIEW must be the first statement of a batch (the runner splits on GO)."""
    for path in MSSQL_FILES:
        for batch in parse_tree(path).tree.recursive_crawl("batch"):
            statements = [s for s in batch.segments if s.is_type("statement")]
            for i, statement in enumerate(statements):
                kind = statement.segments[0]
                if kind.is_type("create_procedure_statement", "create_function_statement", "create_view_statement"):
                    assert i == 0, f"{path.name}: {kind.raw[:60]!r} is not the first statement of its batch"


def test_split_batches_matches_the_parser() -> None:
    for path in MSSQL_FILES:
        batches = mssql.split_batches(path.read_text(encoding="utf-8"))
        parsed = [b for b in parse_tree(path).tree.recursive_crawl("batch")
                  if any(s.is_type("statement") for s in b.segments)]
        assert len(batches) == len(parsed), path.name
        assert not any(re.search(r"(?im)^\s*GO\s*$", b) for b in batches)


# -- (b) one routine per PostgreSQL function, same parameters --------------------------------------


@pytest.mark.parametrize("name", sorted(set(pg_functions()) - POSTGRESQL_ONLY))
def test_every_postgresql_function_has_its_routine(name: str) -> None:
    fn = pg_functions()[name]
    routine = tsql_routines().get(name)
    assert routine is not None, f"sql/mssql has no routine workqueue.{name}"
    assert routine.kind == ("function" if name in PURE_HELPERS else "procedure"), routine.kind
    assert routine.params == tuple(f"@{p}" for p in fn.params), (
        f"{name}: PostgreSQL ({', '.join(fn.params)}) vs SQL Server ({', '.join(routine.params)})"
    )
    assert routine.defaults == frozenset(f"@{p}" for p in fn.defaults), f"{name}: parameter defaults differ"


def test_publish_one_is_publish_for_one_message_without_a_deduplication_key() -> None:
    """The PostgreSQL-only routine: publish's parameters in the singular, less the deduplication
    ones, and p_quiet; publish's result columns and the subscriptions to wake (when quiet); only
    the PostgreSQL transport calls it."""
    publish, one = pg_functions()["publish"], pg_functions()["publish_one"]
    singular = {"p_message_ids": "p_message_id", "p_partition_keys": "p_partition_key",
                "p_payloads": "p_payload", "p_payload_refs": "p_payload_ref", "p_correlation_ids": "p_correlation_id",
                "p_content_hashes": "p_content_hash", "p_delays": "p_delay", "p_not_befores": "p_not_before",
                "p_backoff_schedules": "p_backoff_schedule", "p_priorities": "p_priority"}
    expected = tuple(singular.get(p, p) for p in publish.params if not p.startswith("p_deduplication"))
    assert one.params == (*expected, "p_quiet") and one.columns == (*publish.columns, "wake_subscriptions")
    assert not set(tsql_routines()) & POSTGRESQL_ONLY
    assert not set(transport_calls()) & POSTGRESQL_ONLY, "routines.py serves every dialect"
    postgres_py = (ROOT / "fastapi_workqueue" / "database" / "postgres.py").read_text(encoding="utf-8")
    assert '"publish_one"' in postgres_py


def test_no_routine_without_a_postgresql_function() -> None:
    extra = set(tsql_routines()) - set(pg_functions())
    assert not extra, f"SQL Server routines PostgreSQL does not have: {sorted(extra)}"


def test_other_objects_are_the_documented_ones() -> None:
    pg_text = (PG_DIR / "schema.sql").read_text()
    pg_tables = set(re.findall(r"CREATE TABLE workqueue\.(\w+)", pg_text))
    ms_text = MSSQL_SCHEMA.read_text()
    assert set(re.findall(r"CREATE TABLE workqueue\.(\w+)", ms_text)) == pg_tables
    assert set(re.findall(r"CREATE OR ALTER VIEW workqueue\.(\w+)", ms_text)) == HELPER_OBJECTS
    pg_columns = table_columns(pg_text)
    ms_columns = {table: [c for c in columns if c not in SEARCH_COLUMNS.get(table, ())]
                  for table, columns in table_columns(ms_text).items()}
    assert ms_columns == pg_columns, "every table has the same columns, in the same order"
    assert all(pg_columns.values())


def table_columns(text: str) -> dict[str, list[str]]:
    """Table → its column names, in order, from the CREATE TABLE statements (a column line starts
    with its lower-case name; constraint and continuation lines start otherwise)."""
    tables: dict[str, list[str]] = {}
    for match in re.finditer(r"CREATE TABLE workqueue\.(\w+) \((.*?)\n\)", text, re.S):
        words = (line.split()[0].strip("[]\"") for line in match.group(2).splitlines() if line.strip())
        tables[match.group(1)] = [w for w in words if re.fullmatch(r"[a-z_]+", w)]
    return tables


def test_publish_answers_with_no_rows_when_every_item_is_accepted_in_both_dialects() -> None:
    """The shorthand the transport reads (``routines.py``: no rows means all Accepted)."""
    publish = tsql_routines()["publish"]
    final_select = publish.raw[publish.raw.rindex("SELECT r.idx"):]
    assert re.search(r"WHERE EXISTS \(SELECT 1 FROM @v_result AS \w+ WHERE \w+\.status <> N'Accepted'\)", final_select)
    schema = (PG_DIR / "schema.sql").read_text(encoding="utf-8")
    pg_publish = schema[schema.index("CREATE OR REPLACE FUNCTION workqueue.publish("):]
    assert "RETURN;  -- no rows: every item was Accepted" in pg_publish[: pg_publish.index("\n$$;")]
    assert "RETURN;  -- no rows: Accepted" in pg_publish


# -- (c) result columns ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(set(pg_functions()) - POSTGRESQL_ONLY))
def test_result_columns_match(name: str) -> None:
    fn = pg_functions()[name]
    routine = tsql_routines()[name]
    assert routine.annotation == _expected_annotation(fn), f"{name}: the '-- returns:' line"
    if routine.kind == "function":
        return
    if fn.name in RETURN_STATUS or fn.returns == "void":
        assert routine.result_columns is None, f"{name} sends a result set PostgreSQL does not have"
        return
    expected = fn.columns if fn.returns == "table" else (fn.name,)
    assert routine.result_columns == expected, f"{name}: final SELECT {routine.result_columns} vs {expected}"


# -- (d) what the transport calls exists in both dialects ------------------------------------------


def transport_calls() -> dict[str, set[str]]:
    """Routine name → the keyword names ``routines.py`` passes, from ``self.call("…")`` and
    ``self._scalar("…")`` (``self._action("…")`` adds what ``_action`` passes itself), and from
    ``self._call_each(connection, "…", [{"p_…": …} for …])`` (the keys of its dicts)."""
    tree = ast.parse(ROUTINES_PY.read_text(encoding="utf-8"))
    calls: dict[str, set[str]] = {}
    action_keywords: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
            continue
        keywords = {k.arg for k in node.keywords if k.arg and k.arg.startswith("p_")}
        first = node.args[0] if node.args else None
        if node.func.attr in ("call", "_scalar", "_action"):
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                calls.setdefault(first.value, set()).update(keywords)
                if node.func.attr == "_action":
                    calls[first.value].add("<action>")
            elif node.func.attr == "call":
                action_keywords |= keywords
        elif node.func.attr == "_call_each" and len(node.args) == 3 and isinstance(node.args[1], ast.Constant):
            each = node.args[2]
            row = each.elt if isinstance(each, ast.ListComp) else None
            assert isinstance(row, ast.Dict), f"_call_each of {node.args[1].value!r}: pass a comprehension of dicts"
            calls.setdefault(str(node.args[1].value), set()).update(
                str(k.value) for k in row.keys if isinstance(k, ast.Constant))
    for names in calls.values():
        if "<action>" in names:
            names.discard("<action>")
            names |= action_keywords
    return calls


def test_the_transport_calls_every_operation() -> None:
    calls = transport_calls()
    assert {"publish", "claim", "settle", "sweep", "replay", "discard", "schema_versions"} <= set(calls)
    assert calls["replay"] == {"p_subscription", "p_delivery_id", "p_note"}


@pytest.mark.parametrize("name", sorted(transport_calls()))
def test_every_called_routine_exists_in_both_dialects(name: str) -> None:
    passed = transport_calls()[name]
    fn = pg_functions().get(name)
    routine = tsql_routines().get(name)
    assert fn is not None and routine is not None, f"{name} is missing in PostgreSQL or SQL Server"
    assert passed <= set(fn.params), f"{name}: PostgreSQL lacks {passed - set(fn.params)}"
    assert {f"@{p}" for p in passed} <= set(routine.params), f"{name}: SQL Server lacks some of {passed}"
    left_out = set(fn.params) - passed
    assert left_out <= fn.defaults, f"{name}: {left_out} are left out but have no default on PostgreSQL"
    assert {f"@{p}" for p in left_out} <= routine.defaults, f"{name}: {left_out} have no default on SQL Server"


# -- design rules ----------------------------------------------------------------------------------


def _code(text: str) -> str:
    return _strip_line_comments(text)


@pytest.mark.parametrize("name", sorted(set(pg_functions()) - PURE_HELPERS - POSTGRESQL_ONLY))
def test_writing_procedures_abort_and_rethrow(name: str) -> None:
    routine = tsql_routines()[name]
    code = _code(routine.raw)
    writes = re.search(
        r"(?i)\b(INSERT\s+INTO|DELETE\s+FROM)\s+[a-z_]|\bDELETE\s+[a-z_]\w*\s+FROM|\bUPDATE\s+[a-z_][\w.]*\s"
        r"|\bEXEC\s+workqueue\.",
        code,
    )
    if name in READ_ONLY | AWS_READS:
        assert not writes, f"{name} is read-only on every other dialect but writes here"
        return
    assert writes, f"{name} writes on PostgreSQL"
    for needed in ("SET XACT_ABORT ON", "BEGIN TRY", "BEGIN CATCH", "THROW;"):
        assert needed in code, f"{name} lacks {needed}"


def test_claims_skip_locked_rows_and_the_sweep_never_waits() -> None:
    routines = tsql_routines()
    # keys and deliveries without a key, each those with a priority and the others
    assert _code(routines["claim"].raw).count("WITH (UPDLOCK, READPAST, ROWLOCK)") == 4
    assert "WITH (UPDLOCK, READPAST, ROWLOCK)" in _code(routines["expire_leases"].raw)
    sweep = re.sub(r"\s+", " ", _code(routines["sweep"].raw))
    assert ("sp_getapplock @Resource = N'workqueue.sweep', @LockMode = N'Exclusive', "
            "@LockOwner = N'Transaction', @LockTimeout = 0") in sweep
    assert "SELECT @v_ran AS ran" in sweep


def test_the_outbox_take_skips_locked_rows_and_its_head_check_reads_past_none() -> None:
    """As PostgreSQL's FOR UPDATE SKIP LOCKED: the take skips rows another relay holds; the check
    for an earlier unsent row of a key must see those rows, so it reads past none."""
    take = _code(tsql_routines()["aws_outbox_take"].raw)
    assert take.count("WITH (UPDLOCK, READPAST, ROWLOCK)") == 1
    check = take[take.index("NOT EXISTS"):]
    assert "READPAST" not in check and "e.id < l.id" in check and "e.sent_at IS NULL" in check
    assert "e.id NOT IN (SELECT x.id FROM @v_locked AS x)" in check


def test_no_postgresql_only_syntax() -> None:
    forbidden = [r"\bpg_\w+", r"\bLIMIT\b", r"\bRETURNING\b", r"\bON CONFLICT\b", r"\bILIKE\b", r"::",
                 r"\bGREATEST\s*\(", r"\bLEAST\s*\(", r"\bIS (NOT )?DISTINCT FROM\b", r"\bnow\(\)", r"\$\$"]
    sources = [(m.name, m.sql) for m in migrations("mssql")] + [("schema", (MSSQL_DIR / "schema.sql").read_text())]
    for name, sql in sources:
        code = _code(sql)
        found = [p for p in forbidden if re.search(p, code, re.I)]
        assert not found, f"{name}: {found}"


ROLES = ("runtime", "operator", "admin", "aws")


def postgresql_role_functions(role: str) -> set[str]:
    """The functions sql/postgresql/roles/<role>_role.sql grants EXECUTE on (its ARRAY[...] list)."""
    text = (PG_DIR / "roles" / f"{role}_role.sql").read_text(encoding="utf-8")
    listed = text[text.index("ARRAY[") : text.index("])")]
    return set(re.findall(r"'(\w+)'", listed))


@pytest.mark.parametrize("role", ROLES)
def test_role_scripts_grant_execute_on_the_postgresql_lists_only(role: str) -> None:
    """Each role gets EXECUTE on the procedures its PostgreSQL twin lists (but the PostgreSQL-only
    ones) and nothing else: no schema-wide grant, every table denied."""
    code = _code((MSSQL_DIR / "roles" / f"{role}_role.sql").read_text())
    name = f"workqueue_{role}"
    granted = re.findall(rf"^GRANT EXECUTE ON OBJECT::workqueue\.(\w+) TO {name};$", code, re.M)
    assert len(re.findall(r"\bGRANT\b", code)) == len(granted), "the role gets EXECUTE on procedures, nothing else"
    assert set(granted) == postgresql_role_functions(role) - POSTGRESQL_ONLY
    assert set(granted) <= set(tsql_routines()), "a role is granted a procedure that does not exist"
    deny = f"DENY SELECT, INSERT, UPDATE, DELETE ON SCHEMA::workqueue TO {name}"
    assert deny in code and "ON SCHEMA::workqueue TO" not in code.replace(deny, "")
    assert re.search(rf"REVOKE EXECUTE,[^;]*ON SCHEMA::workqueue FROM {name};", code)


@pytest.mark.parametrize("role", ROLES)
def test_role_scripts_create_their_role(role: str) -> None:
    """The role is created by dynamic SQL (CREATE ROLE must start its batch), which the parser
    sees only as a string: the statement inside is checked here."""
    code = _code((MSSQL_DIR / "roles" / f"{role}_role.sql").read_text())
    name = f"workqueue_{role}"
    assert re.search(
        rf"IF DATABASE_PRINCIPAL_ID\(N'{name}'\) IS NULL\s+EXEC \(N'CREATE ROLE {name}'\);", code
    ), f"{role}_role.sql does not create {name}"


def test_the_roles_split_the_routines() -> None:
    """Keys are minted and retired topology deleted by the admin only; operator actions are not the
    runtime's; the helpers the routines call for themselves are granted to no role."""
    runtime, operator, admin, aws = (postgresql_role_functions(r) for r in ROLES)
    assert {"api_key_create", "api_key_list", "api_key_revoke", "delete_subscription", "delete_topic"} == admin
    assert not admin & (runtime | operator)
    assert aws == {"aws_outbox_write", "aws_outbox_take", "aws_outbox_mark_sent", "aws_outbox_defer",
                   "aws_binding_list"}
    assert not aws & (runtime | operator | admin), "the AWS layer's routines are its role's alone"
    operating = {"replay", "discard", "set_subscription_status", "prune", "retire_subscription", "discard_pending",
                 "set_topic_status"}
    assert not operating & runtime
    assert operating <= operator
    assert {"publish", "claim", "heartbeat", "settle", "api_key_verify", "api_key_touch", "api_key_session",
            "api_key_end_sessions"} <= runtime
    assert "api_key_lookup" not in pg_functions()  # it would answer a stored hash
    helpers = {"refresh_partition", "release_keys", "rederive_stale", "fold_settled_counts", "backoff_seconds",
               "filter_matches", "expire_leases", "purge", "delivery_ended", "release_group_message", "rate_per_second"}
    assert not (helpers | OWNER_ONLY) & (runtime | operator | admin | aws)
    assert runtime | operator | admin | aws | helpers | OWNER_ONLY == set(pg_functions()), (
        "every function is someone's, a helper or the owner's")


# -- the transport, without a server ---------------------------------------------------------------


def test_the_factory_builds_the_sql_server_transport() -> None:
    transport = create_database_transport(URL, pool_max_size=2, listen=False)
    assert isinstance(transport, MssqlTransport)
    assert transport.dialect == "mssql" and transport.capabilities.wakeups is False
    assert transport.capabilities.runtime_roles is True
    assert transport._dsn == (
        "DRIVER={ODBC Driver 18 for SQL Server};SERVER=db.example,1433;DATABASE=work;UID=app;PWD=secret"
    )


def test_connection_strings() -> None:
    freetds = mssql.odbc_connection_string("mssql+aioodbc://sa:p%3Bw@db/work?driver=FreeTDS&TDS_Version=7.4")
    assert freetds == "DRIVER={FreeTDS};SERVER=db;DATABASE=work;UID=sa;PWD={p;w};TDS_Version=7.4"
    raw = "DRIVER={ODBC Driver 18 for SQL Server};SERVER=x;Trusted_Connection=yes"
    assert mssql.odbc_connection_string(f"mssql+aioodbc:///?odbc_connect={raw}") == raw
    with pytest.raises(ConfigurationError, match="mssql\\+aioodbc://"):
        mssql.odbc_connection_string("postgresql+asyncpg://db/work")


def test_calls_render_as_exec_with_named_parameters() -> None:
    transport = MssqlTransport(URL)
    assert transport.statement("claim", ("p_subscription", "p_limit")) == (
        "EXEC workqueue.claim @p_subscription = ?, @p_limit = ?"
    )
    assert transport.statement("list_topics", ()) == "EXEC workqueue.list_topics"
    with pytest.raises(ValueError, match="not a routine"):
        transport.statement("claim; DROP TABLE x", ())


def test_values_are_encoded_for_the_driver() -> None:
    mid = uuid.uuid4()
    when = datetime(2030, 1, 2, 3, 4, 5, 600000, tzinfo=UTC)
    assert json.loads(mssql.encode_param([mid, None, when])) == [str(mid), None, "2030-01-02T03:04:05.600000+00:00"]
    assert json.loads(mssql.encode_param([1.5, '{"a": "b"}'])) == [1.5, '{"a": "b"}']
    assert mssql.encode_param(mid) == str(mid)
    assert mssql.encode_param(True) is True and mssql.encode_param(None) is None


def test_rows_are_normalised() -> None:
    upper = "8F14E45F-CEEA-467F-A0B3-0C1D2E3F4A5B"
    row = mssql.normalise_row({"message_id": upper, "lease_token": upper, "id": 7, "topic": "T"})
    assert row == {"message_id": upper.lower(), "lease_token": upper.lower(), "id": 7, "topic": "T"}
    packed = struct.pack("<6hI2h", 2030, 1, 2, 3, 4, 5, 600_000_000, -5, -30)
    decoded = mssql.decode_datetimeoffset(packed)
    assert decoded == datetime(2030, 1, 2, 3, 4, 5, 600000, tzinfo=timezone(-timedelta(hours=5, minutes=30)))
    assert mssql.decode_datetimeoffset(None) is None


@pytest.mark.parametrize(
    ("message", "kind", "retryable"),
    [
        ("[Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Transaction (Process ID 52) was deadlocked "
         "(1205) (SQLExecDirectW)", TransportError, True),
        ("[Microsoft][ODBC Driver 18 for SQL Server][SQL Server]a message with the same MessageID was "
         "published concurrently; retry the publish (51001) (SQLExecDirectW)", TransportError, True),
        ("[Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Could not find stored procedure "
         "'workqueue.claim'. (2812) (SQLExecDirectW)", SchemaMissing, None),
        ("[Microsoft][ODBC Driver 18 for SQL Server][SQL Server]The EXECUTE permission was denied on the "
         "object 'claim' (229) (SQLExecDirectW)", ConfigurationError, None),
        ("[Microsoft][ODBC Driver 18 for SQL Server][SQL Server]subscription s has live deliveries (51002) "
         "(SQLExecDirectW)", ConfigurationError, None),
    ],
)
def test_driver_errors_are_mapped(message: str, kind: type[Exception], retryable: bool | None) -> None:
    class DriverError(Exception):
        pass

    mapped = mssql.map_mssql_error(DriverError("42000", message), "claim")
    assert type(mapped) is kind
    assert "[Microsoft]" not in str(mapped) and "(SQLExecDirectW)" not in str(mapped)
    if retryable is not None:
        assert isinstance(mapped, TransportError) and mapped.retryable is retryable


async def test_opening_without_the_driver_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise ImportError("libodbc.so.2: cannot open shared object file")

    monkeypatch.setattr("fastapi_workqueue.database.mssql.importlib.import_module", missing)
    with pytest.raises(ConfigurationError) as caught:
        await MssqlTransport(URL).open()
    text = str(caught.value)
    assert "fastapi-workqueue[mssql]" in text and "unixODBC" in text and "ODBC Driver 18" in text


def test_the_other_transports_never_import_the_odbc_driver() -> None:
    code = (
        "import sys\n"
        "from fastapi_workqueue.database import create_database_transport\n"
        "import fastapi_workqueue.database.postgres, fastapi_workqueue.database.sqlite\n"
        f"create_database_transport({URL!r})\n"
        "assert 'aioodbc' not in sys.modules and 'pyodbc' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


class _FakePool:
    @staticmethod
    def acquire() -> Any:
        class _Acquired:
            async def __aenter__(self) -> object:
                return object()

            async def __aexit__(self, *exc: object) -> None:
                return None

        return _Acquired()


def _fake_transport(monkeypatch: pytest.MonkeyPatch, rcsi: bool) -> MssqlTransport:
    transport = MssqlTransport(URL)
    transport._pool = _FakePool()

    async def fetch_rows(conn: Any, sql: str, values: Any) -> list[dict[str, Any]]:
        assert "is_read_committed_snapshot_on" in sql and "sys.databases" in sql
        return [{"database_name": "work]q", "is_read_committed_snapshot_on": rcsi}]

    async def call(routine: str, **params: Any) -> list[dict[str, Any]]:
        assert routine == "schema_versions"
        return [{"version": m.version, "name": m.name, "checksum": m.checksum} for m in migrations("mssql")]

    monkeypatch.setattr(mssql, "fetch_rows", fetch_rows)
    monkeypatch.setattr(transport, "call", call)
    return transport


async def test_validate_bindings_reports_read_committed_snapshot_off(monkeypatch: pytest.MonkeyPatch) -> None:
    report = await _fake_transport(monkeypatch, rcsi=False).validate_bindings()
    assert not report.ok
    [error] = [i for i in report.issues if i.severity == "Error"]
    assert error.subject == "READ_COMMITTED_SNAPSHOT"
    assert "ALTER DATABASE [work]]q] SET READ_COMMITTED_SNAPSHOT ON WITH ROLLBACK IMMEDIATE" in error.message
    assert any(i.severity == "Info" and "polling" in i.message for i in report.issues)


async def test_validate_bindings_is_ok_with_read_committed_snapshot_on(monkeypatch: pytest.MonkeyPatch) -> None:
    report = await _fake_transport(monkeypatch, rcsi=True).validate_bindings()
    assert report.ok, report.issues


def test_the_store_clock_reads_the_database_time_as_the_procedures_do() -> None:
    """``store_now`` (ages on the dashboard and in Prometheus) reads SQL Server's clock, the one its
    procedures read (SYSDATETIMEOFFSET), not the process's: the statement parses as T-SQL and asks
    for that function; a transport given a clock answers that clock's time without a call."""
    parsed = Linter(config=FluffConfig(overrides={"dialect": "tsql"})).parse_string(mssql.STORE_NOW_SQL + "\n")
    assert parsed.tree is not None and not list(parsed.tree.recursive_crawl("unparsable"))
    assert "SYSDATETIMEOFFSET()" in mssql.STORE_NOW_SQL
    procedures = " ".join(p.read_text(encoding="utf-8") for p in MSSQL_FILES)
    assert "SYSDATETIMEOFFSET()" in procedures

    class Fixed:
        def now(self) -> datetime:
            return datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)

    transport = MssqlTransport(URL, clock=Fixed())
    assert asyncio.run(transport.store_now()) == datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
