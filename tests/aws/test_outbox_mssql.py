"""The outbox on SQL Server, checked without a SQL Server (none can run here): the statements parse
as T-SQL and read the migration's columns, the writer and the relay pick them by dialect, and a
pass sends what it took in order, leaves the rows behind another relay's, and marks the rest, with
SNS on a moto server. How the statements behave on a server is for WORKQUEUE_MSSQL_URL runs."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlfluff.core import Linter

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.aws import body as bodies
from fastapi_workqueue.aws.outbox import OutboxRelay, write_outbox
from fastapi_workqueue.aws.outbox_mssql import BEHIND, DEFER, MARK_SENT, STATEMENTS, TAKE, WRITE
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.errors import ConfigurationError

from ..conftest import unique
from .world import aws_of, aws_queue

SCHEMA = Path(__file__).resolve().parents[2] / "sql" / "mssql" / "schema.sql"


def as_tsql(statement: str) -> str:
    """The statement as SQL Server receives it, its ``:name`` parameters as ``@name`` variables."""
    return re.sub(r":(\w+)", r"@\1", statement).strip() + ";"


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_each_statement_parses_as_tsql(name: str) -> None:
    parsed = Linter(dialect="tsql").parse_string(as_tsql(STATEMENTS[name]))
    problems = [str(v) for variant in parsed.parsed_variants
                for v in (*variant.lexing_violations, *variant.parsing_violations)]
    assert parsed.tree is not None
    unparsable = [s.raw[:80] for s in parsed.tree.recursive_crawl("unparsable")]
    assert not problems and not unparsable, f"{name}: {problems or unparsable}"


def outbox_columns() -> set[str]:
    text = SCHEMA.read_text()
    table = text[text.index("CREATE TABLE workqueue.aws_outbox"):]
    table = table[: table.index("\nGO")]
    return {m.group(1) for m in re.finditer(r"^\s{4}(\w+)\s", table, re.M)} - {"CONSTRAINT"}


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_each_statement_uses_the_migrations_columns_and_no_postgresql_syntax(name: str) -> None:
    statement = STATEMENTS[name]
    columns = outbox_columns()
    assert {"id", "topic", "message_id", "partition_key", "sent_at", "next_attempt_at", "attempts"} <= columns
    used = set(re.findall(r"\b(?:o|l|e)\.(\w+)", statement))
    assert used <= columns, used - columns
    for pattern in (r"(?<![:@])\bLIMIT\b", r"SKIP LOCKED", r"::", r"\bnow\(\)", r"\bANY\(", r"\bRETURNING\b", r"jsonb"):
        assert not re.search(pattern, statement, re.I), pattern


def test_the_take_skips_locked_rows_and_the_head_check_reads_past_none() -> None:
    assert "WITH (UPDLOCK, READPAST, ROWLOCK)" in TAKE and "ORDER BY o.id" in TAKE
    # The check for earlier rows of a key must see the rows other relays hold: no READPAST there.
    assert "READPAST" not in BEHIND and "e.id < l.id" in BEHIND and "e.sent_at IS NULL" in BEHIND


class Recorder:
    """A SQL Server engine stand-in: records the statements a pass runs and answers TAKE and BEHIND
    from a script (there is no SQL Server to run them on)."""

    dialect = SimpleNamespace(name="mssql")

    def __init__(self, taken: Sequence[tuple[Any, ...]], behind: Sequence[int]) -> None:
        self.taken, self.behind = list(taken), list(behind)
        self.statements: list[tuple[str, Any]] = []
        self.committed = 0

    async def execute(self, statement: Any, params: Any = None) -> Any:
        sql = str(statement)
        self.statements.append((sql, params))
        rows: list[tuple[Any, ...]] = []
        if sql == TAKE:
            rows = self.taken[: params["limit"]]
        elif sql == BEHIND:
            rows = [(i,) for i in self.behind if i in json.loads(params["ids"])]
        return SimpleNamespace(all=lambda: rows)

    @property
    def bind(self) -> Any:
        return self

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[Recorder]:
        yield self
        self.committed += 1

    def ran(self, statement: str) -> list[Any]:
        return [params for sql, params in self.statements if sql == statement]


async def test_write_outbox_on_sql_server_inserts_the_rows_in_the_callers_transaction() -> None:
    session = Recorder([], [])
    message = prepare(PublishRequest(payload={"n": 1}, partition_key="k", attributes={"a": "b"}))
    await write_outbox(session, "orders", [(message, "body")])
    [(sql, rows)] = session.statements
    assert sql == WRITE and session.committed == 0  # the caller commits
    assert rows == [{"topic": "orders", "message_id": str(message.message_id), "partition_key": "k",
                     "body": "body", "attributes": '{"a": "b"}', "now": rows[0]["now"]}]


async def test_write_outbox_refuses_a_database_without_the_table() -> None:
    session = Recorder([], [])
    session.dialect = SimpleNamespace(name="oracle")
    with pytest.raises(ConfigurationError, match="no table on 'oracle'"):
        await write_outbox(session, "orders", [(prepare(PublishRequest(payload=1)), "body")])


async def test_a_sql_server_pass_sends_in_order_leaves_rows_behind_a_held_key_and_marks(
    tmp_path: Path, moto_url: str,
) -> None:
    name = unique("t")
    sub = f"{name}.s"
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url,
                         [Topic(name=name, transport="aws", is_fifo=True)],
                         [Subscription(name=sub, topic=name, handler_key="h", partition_mode="Exclusive")]) as queue:
        messages = [prepare(PublishRequest(payload={"i": i}, partition_key=key))
                    for i, key in enumerate(["k", "k", None, "j"])]
        # SQL Server answers a uniqueidentifier in upper case; the deduplication id is the MessageID as published.
        rows = [(i + 1, name, str(m.message_id).upper(), m.partition_key, bodies.encode(name, m), "{}", 0)
                for i, m in enumerate(messages)]
        # Row 4 (key j) waits behind a row of j another relay holds.
        engine = Recorder(rows, behind=[4])
        report = await OutboxRelay(aws_of(queue), engine=engine).run_once()
        assert (report.sent, report.deferred) == (3, 0)
        assert [sql for sql, _ in engine.statements] == [TAKE, BEHIND, MARK_SENT]
        assert json.loads(engine.ran(BEHIND)[0]["ids"]) == [1, 2, 3, 4]
        assert json.loads(engine.ran(MARK_SENT)[0]["ids"]) == [1, 2, 3]
        assert engine.ran(DEFER) == [] and engine.committed == 1
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
        by_key = {k: [i for m, i in zip(got, ids, strict=True) if m["Attributes"]["MessageGroupId"] == k]
                  for k in ("k", "j")}
        assert by_key == {"k": [str(messages[0].message_id), str(messages[1].message_id)], "j": []}
        assert sorted(ids) == sorted(str(m.message_id) for m in messages[:3])

async def test_a_sql_server_pass_with_nothing_due_sends_nothing(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url,
                         [Topic(name=name, transport="aws")], []) as queue:
        engine = Recorder([], [])
        assert (await OutboxRelay(aws_of(queue), engine=engine).run_once()).sent == 0
        assert [sql for sql, _ in engine.statements] == [TAKE]
