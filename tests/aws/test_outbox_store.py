"""The outbox store of each dialect (aws/outbox_store.py): every statement calls the dialect's
routine of its name with that routine's parameters, in order.

SQL Server is checked without a SQL Server (none can run here): the statements parse as T-SQL and
pass the procedures' parameters, the writer and the relay pick them by dialect, and a pass sends
what the take answered in order (SNS on a moto server), marks the sent rows and defers the rest,
through an engine stand-in that records what it is sent. How the procedures behave on a server is
for WORKQUEUE_MSSQL_URL runs. PostgreSQL runs its functions here, the clock driven through p_now."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlfluff.core import Linter

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.aws import body as bodies
from fastapi_workqueue.aws.outbox import OutboxRelay, write_outbox
from fastapi_workqueue.aws.outbox_store import (
    MssqlOutboxStore,
    PostgresOutboxStore,
    SqliteOutboxStore,
    store_for,
)
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.errors import ConfigurationError

from ..conftest import unique
from ..test_mssql_sql import pg_functions
from .world import aws_of, aws_queue

ROOT = Path(__file__).resolve().parents[2]
ROUTINES = ("aws_outbox_write", "aws_outbox_take", "aws_outbox_mark_sent", "aws_outbox_defer",
            "aws_binding_list", "aws_binding_replace")
MSSQL = MssqlOutboxStore.statements
PG = PostgresOutboxStore.statements


def as_tsql(statement: str) -> str:
    """The statement as SQL Server receives it, its ``:name`` parameters as ``@name`` variables."""
    return re.sub(r"(?<!:):(\w+)", r"@\1", statement).strip() + ";"


@pytest.mark.parametrize("name", sorted(MSSQL))
def test_each_sql_server_statement_parses_as_tsql(name: str) -> None:
    parsed = Linter(dialect="tsql").parse_string(as_tsql(MSSQL[name]))
    problems = [str(v) for variant in parsed.parsed_variants
                for v in (*variant.lexing_violations, *variant.parsing_violations)]
    assert parsed.tree is not None
    unparsable = [s.raw[:80] for s in parsed.tree.recursive_crawl("unparsable")]
    assert not problems and not unparsable, f"{name}: {problems or unparsable}"


def test_the_routines_exist_and_the_stores_call_nothing_else() -> None:
    assert set(ROUTINES) <= set(pg_functions())
    assert set(PG) == set(MSSQL) == {*ROUTINES, "aws_binding_exists"}
    sqlite = SqliteOutboxStore().statements
    assert {"aws_outbox_write", "aws_outbox_mark_sent", "aws_outbox_defer", "aws_binding_list"} <= set(sqlite)
    for statement in [*PG.values(), *MSSQL.values()]:
        assert not re.search(r"\b(INSERT|UPDATE|DELETE)\b|\bFROM workqueue\.aws_(outbox|binding)\b", statement)


@pytest.mark.parametrize("name", ROUTINES)
def test_sql_server_statements_pass_the_procedures_parameters_in_order(name: str) -> None:
    """EXEC names every parameter (test_mssql_sql.py proves the procedure's are PostgreSQL's)."""
    statement = MSSQL[name]
    assert statement.startswith(f"EXEC workqueue.{name}")
    assert tuple(re.findall(r"@(\w+) = :\w+", statement)) == pg_functions()[name].params
    postgresql_only = (r"(?<![:@_])\bLIMIT\b", r"SKIP LOCKED", r"::", r"\bnow\(\)", r"\bANY\(", r"\bRETURNING\b",
                       r"jsonb")
    for pattern in postgresql_only:
        assert not re.search(pattern, statement, re.I), pattern


@pytest.mark.parametrize("name", ROUTINES)
def test_postgresql_statements_pass_every_parameter(name: str) -> None:
    statement = PG[name]
    call = re.search(rf"workqueue\.{name}\((.*)\)", statement)
    assert call is not None, statement
    arguments = [a for a in call.group(1).split(", CAST") if a]
    assert len(arguments) == len(pg_functions()[name].params), statement


def test_the_store_is_chosen_by_dialect() -> None:
    def bind(name: str) -> Any:
        return SimpleNamespace(dialect=SimpleNamespace(name=name))

    assert isinstance(store_for(bind("postgresql")), PostgresOutboxStore)
    assert isinstance(store_for(bind("mssql")), MssqlOutboxStore)
    assert isinstance(store_for(bind("sqlite")), SqliteOutboxStore)
    assert store_for(bind("sqlite")) is store_for(SimpleNamespace(bind=bind("sqlite")))  # one per dialect
    with pytest.raises(ConfigurationError, match="no table on 'oracle'"):
        store_for(bind("oracle"))


class Recorder:
    """A SQL Server engine stand-in: records the statements a pass runs and answers the take
    from a script (there is no SQL Server to run them on)."""

    dialect = SimpleNamespace(name="mssql")

    def __init__(self, taken: Sequence[tuple[Any, ...]]) -> None:
        self.taken = list(taken)
        self.statements: list[tuple[str, Any]] = []
        self.committed = 0

    async def execute(self, statement: Any, params: Any = None) -> Any:
        sql = str(statement)
        self.statements.append((sql, params))
        rows = self.taken[: params["limit"]] if sql == MSSQL["aws_outbox_take"] else []
        return SimpleNamespace(all=lambda: rows)

    @property
    def bind(self) -> Any:
        return self

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[Recorder]:
        yield self
        self.committed += 1

    def ran(self, name: str) -> list[Any]:
        return [params for sql, params in self.statements if sql == MSSQL[name]]


async def test_write_outbox_on_sql_server_calls_the_procedure_in_the_callers_transaction() -> None:
    session = Recorder([])
    first = prepare(PublishRequest(payload={"n": 1}, partition_key="k", attributes={"a": "b"}))
    second = prepare(PublishRequest(payload={"n": 2}))
    await write_outbox(session, "orders", [(first, "one"), (second, "two")])
    [(sql, params)] = session.statements
    assert sql == MSSQL["aws_outbox_write"] and session.committed == 0  # the caller commits
    assert params["topic"] == "orders" and params["now"] is None
    assert json.loads(params["message_ids"]) == [str(first.message_id), str(second.message_id)]
    assert json.loads(params["partition_keys"]) == ["k", None]
    assert json.loads(params["bodies"]) == ["one", "two"]
    assert [json.loads(a) for a in json.loads(params["attributes"])] == [{"a": "b"}, {}]


async def test_write_outbox_refuses_a_database_without_the_routines() -> None:
    session = Recorder([])
    session.dialect = SimpleNamespace(name="oracle")
    with pytest.raises(ConfigurationError, match="no table on 'oracle'"):
        await write_outbox(session, "orders", [(prepare(PublishRequest(payload=1)), "body")])


async def test_a_sql_server_pass_sends_in_order_marks_and_defers_what_sns_refused(
    tmp_path: Path, moto_url: str,
) -> None:
    name = unique("t")
    sub = f"{name}.s"
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url,
                         [Topic(name=name, transport="aws", is_fifo=True)],
                         [Subscription(name=sub, topic=name, handler_key="h", partition_mode="Exclusive")]) as queue:
        messages = [prepare(PublishRequest(payload={"i": i}, partition_key=key))
                    for i, key in enumerate(["k", "k", None])]
        # SQL Server answers a uniqueidentifier in upper case; the deduplication id is the MessageID as published.
        rows = [(i + 1, name, str(m.message_id).upper(), m.partition_key, bodies.encode(name, m), "{}", 0)
                for i, m in enumerate(messages)]
        # Row 4's topic is not bound: SNS is never asked, the row is put off.
        unbound = prepare(PublishRequest(payload={"i": 3}))
        rows.append((4, "nowhere", str(unbound.message_id), None, "{}", "{}", 2))
        engine = Recorder(rows)
        report = await OutboxRelay(aws_of(queue), engine=engine).run_once()
        assert (report.sent, report.deferred) == (3, 1)
        assert [sql for sql, _ in engine.statements] == [
            MSSQL["aws_outbox_take"], MSSQL["aws_outbox_mark_sent"], MSSQL["aws_outbox_defer"]]
        assert engine.ran("aws_outbox_take") == [{"limit": 100, "now": None}]
        assert json.loads(engine.ran("aws_outbox_mark_sent")[0]["ids"]) == [1, 2, 3]
        [deferred] = engine.ran("aws_outbox_defer")
        assert deferred["id"] == 4 and "'nowhere' is not bound" in deferred["error"]
        assert 0 <= deferred["delay"] <= 4.0 and engine.committed == 1  # attempts 2: up to 2**2 s
        aws = aws_of(queue)
        queue_url, _ = aws._urls(sub)
        got: list[dict[str, Any]] = []
        for _ in range(10):
            answer = await aws.sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=0,
                                                   MessageSystemAttributeNames=["All"])
            batch = answer.get("Messages", [])
            got.extend(batch)
            for m in batch:
                await aws.sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=m["ReceiptHandle"])
            if not batch and got:
                break
        ids = [m["Attributes"]["MessageDeduplicationId"] for m in got]
        assert [json.loads(m["Body"])["message_id"] for m in got] == ids  # the MessageID as published
        keyed = [i for m, i in zip(got, ids, strict=True) if m["Attributes"]["MessageGroupId"] == "k"]
        assert keyed == [str(messages[0].message_id), str(messages[1].message_id)]
        assert sorted(ids) == sorted(str(m.message_id) for m in messages)


async def test_a_sql_server_pass_with_nothing_due_sends_nothing(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url,
                         [Topic(name=name, transport="aws")], []) as queue:
        engine = Recorder([])
        assert (await OutboxRelay(aws_of(queue), engine=engine).run_once()).sent == 0
        assert [sql for sql, _ in engine.statements] == [MSSQL["aws_outbox_take"]]


async def test_the_postgresql_functions_stamp_the_time_they_are_given(pg_url: str) -> None:
    """p_now drives the outbox's clock: a row written at t0 is due from t0, a deferred row from
    t0 + its delay, and a sent row carries the time of its mark. One transaction, rolled back."""
    store = PostgresOutboxStore()
    t0 = datetime(2001, 2, 3, 4, 5, 6, tzinfo=UTC)  # long before any other test's rows are due
    topic = unique("t")
    messages = [prepare(PublishRequest(payload={"i": i}, partition_key="k" if i < 2 else None)) for i in range(3)]
    engine = create_async_engine(pg_url)
    try:
        async with engine.connect() as conn:
            transaction = await conn.begin()
            await store.write(conn, topic, [(m, f"body {i}") for i, m in enumerate(messages)], now=t0)

            async def take(at: datetime) -> list[tuple[Any, ...]]:
                found = await conn.execute(text(PG["aws_outbox_take"]), {"limit": 100, "now": at})
                return [tuple(r) for r in found.all() if r[1] == topic]

            assert await take(t0 - timedelta(seconds=1)) == []
            taken = await take(t0)
            assert [r[2] for r in taken] == [m.message_id for m in messages]
            assert [r[4] for r in taken] == ["body 0", "body 1", "body 2"]
            first, second, third = (r[0] for r in taken)
            await conn.execute(text(PG["aws_outbox_defer"]),
                               {"id": first, "error": "Throttling", "delay": 30.0, "now": t0})
            # the key's head waits out its deferral: nothing of the key is due, the unkeyed row is
            assert [r[0] for r in await take(t0 + timedelta(seconds=29))] == [third]
            assert [r[0] for r in await take(t0 + timedelta(seconds=30))] == [first, second, third]
            await conn.execute(text(PG["aws_outbox_mark_sent"]),
                               {"ids": [first, second], "now": t0 + timedelta(seconds=31)})
            stamped = (await conn.execute(text(
                "SELECT id, sent_at, attempts, last_error, created_at FROM workqueue.aws_outbox "
                "WHERE topic = :topic ORDER BY id"), {"topic": topic})).all()
            assert [(r[1], r[2], r[3]) for r in stamped] == [
                (t0 + timedelta(seconds=31), 2, None), (t0 + timedelta(seconds=31), 1, None), (None, 0, None)]
            assert {r[4] for r in stamped} == {t0}
            assert [r[0] for r in await take(t0 + timedelta(seconds=31))] == [third]
            await transaction.rollback()
    finally:
        await engine.dispose()


async def test_the_bindings_say_to_migrate_on_a_database_without_them(tmp_path: Path) -> None:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}")
    try:
        store = store_for(engine)
        with pytest.raises(ConfigurationError, match=r"no bindings table \(aws_binding\).*workqueue migrate"):
            await store.list_bindings(engine)
        with pytest.raises(ConfigurationError, match="workqueue migrate"):
            await store.replace_bindings(engine, "us-east-1", [("topic", "t", '{"arn": "a"}')])
    finally:
        await engine.dispose()

