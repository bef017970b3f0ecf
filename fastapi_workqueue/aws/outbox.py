"""The transactional outbox of the aws topics, and the relay that forwards it to SNS.

A publish with a session writes rows to ``aws_outbox`` in that transaction (a rollback leaves
none). The relay takes committed rows oldest first, keeps only each key's earliest unsent rows
(so one relay at a time forwards a key, in order), publishes them with PublishBatch (10 per call,
the MessageIDs kept as FIFO deduplication ids) and marks them sent.

* PostgreSQL: the rows are locked with ``FOR UPDATE SKIP LOCKED`` in the relay's transaction,
  which stays open across the SNS call and commits with the mark.
* SQL Server: the same with ``UPDLOCK, READPAST, ROWLOCK`` (:mod:`.outbox_mssql`).
* SQLite: the rows are taken under a lease (``relay_token``, ``relay_until``) in a short write
  transaction, so the file's write lock is never held across an SNS call.

A relay that dies between the send and the mark leaves the rows unsent: the next pass sends them
again with the same MessageIDs, which FIFO topics deduplicate within 5 minutes and handlers must
absorb otherwise (at-least-once). Throttling (``Throttling``, ``ThrottlingException``) defers the
rows with a growing delay and slows the relay.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.envelope import PreparedMessage
from ..core.errors import ConfigurationError
from ..core.redaction import redacting_logger
from ..core.tasks import TaskScope
from . import body as bodies

if TYPE_CHECKING:
    from .transport import AwsTransport

log = redacting_logger("fastapi_workqueue.aws.outbox")

BATCH = 10
TAKE = 100
SQLITE_LEASE_SECONDS = 60.0
THROTTLED = {"Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled", "TooManyRequestsException"}

_PG_TAKE = """
WITH locked AS (
    SELECT o.id, o.topic, o.partition_key
    FROM workqueue.aws_outbox o
    WHERE o.sent_at IS NULL AND o.next_attempt_at <= now()
    ORDER BY o.id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
SELECT o.id, o.topic, o.message_id, o.partition_key, o.body, o.attributes, o.attempts
FROM locked l
JOIN workqueue.aws_outbox o ON o.id = l.id
WHERE l.partition_key IS NULL OR NOT EXISTS (
    SELECT 1 FROM workqueue.aws_outbox e
    WHERE e.topic = l.topic AND e.partition_key = l.partition_key AND e.sent_at IS NULL AND e.id < l.id
      AND e.id NOT IN (SELECT x.id FROM locked x)
)
ORDER BY o.id
"""


def _dialect(session: Any) -> str:
    bind = getattr(session, "bind", None)
    if bind is None or not hasattr(bind, "dialect"):
        bind = session
    return str(bind.dialect.name)


async def write_outbox(session: Any, topic: str, items: Sequence[tuple[PreparedMessage, str]]) -> None:
    """Writes ``(message, body)`` rows of ``topic`` in the session's transaction."""
    from sqlalchemy import text

    dialect = _dialect(session)
    now = time.time()
    rows = [
        {
            "topic": topic,
            "message_id": str(m.message_id),
            "partition_key": m.partition_key,
            "body": body,
            "attributes": json.dumps(m.attributes),
            "now": now,
        }
        for m, body in items
    ]
    if dialect == "sqlite":
        statement = (
            "INSERT INTO aws_outbox (topic, message_id, partition_key, body, attributes, created_at, "
            "next_attempt_at) VALUES (:topic, :message_id, :partition_key, :body, :attributes, :now, :now)"
        )
    elif dialect == "postgresql":
        statement = (
            "INSERT INTO workqueue.aws_outbox (topic, message_id, partition_key, body, attributes) "
            "VALUES (:topic, CAST(:message_id AS uuid), :partition_key, :body, CAST(:attributes AS jsonb))"
        )
    elif dialect == "mssql":
        from .outbox_mssql import WRITE

        statement = WRITE
    else:
        raise ConfigurationError(
            f"the aws outbox has no table on {dialect!r}: use PostgreSQL, SQLite or SQL Server for the queue's database"
        )
    await session.execute(text(statement), rows)


@dataclass
class OutboxRow:
    id: int
    topic: str
    message_id: str
    partition_key: str | None
    body: str
    attributes: dict[str, str]
    attempts: int


@dataclass
class PassReport:
    """What one relay pass did."""

    sent: int = 0
    deferred: int = 0
    throttled: bool = False


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


class OutboxRelay:
    """Forwards committed outbox rows to SNS, in order per key; one pass at a time per key across processes."""

    def __init__(
        self, transport: AwsTransport, *, interval_seconds: float | None = None,
        clock: Callable[[], float] = time.time, engine: Any = None,
    ) -> None:
        self.transport = transport
        self.engine = engine
        """The engine of the outbox's database: the queue's when None."""
        self.clock = clock
        """Epoch seconds of the SQLite leases (tests move it past a dead relay's lease)."""
        self.interval = (
            interval_seconds if interval_seconds is not None else transport.settings.aws_relay_interval_ms / 1000
        )
        self._tasks = TaskScope("workqueue-aws-outbox-relay")
        self._task: asyncio.Task[None] | None = None
        self._throttle_streak = 0
        self.after_batch: Callable[[list[OutboxRow]], Awaitable[None]] | None = None
        """Called after each PublishBatch, before the rows are marked (tests stop a pass there)."""

    def start(self) -> None:
        if self._task is None:
            self._tasks.reopen()
            self._task = self._tasks.spawn(self._run(), name="workqueue-aws-outbox-relay")

    async def stop(self) -> None:
        self._task = None
        await self._tasks.close()

    async def _run(self) -> None:
        while True:
            try:
                report = await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("outbox relay pass failed (%s); trying again", exc)
                report = PassReport()
            if report.throttled:
                self._throttle_streak += 1
                await asyncio.sleep(random.uniform(0, min(30.0, 0.5 * 2**self._throttle_streak)))
                continue
            self._throttle_streak = 0
            if report.sent == 0:
                await asyncio.sleep(self.interval)

    async def run_once(self, limit: int = TAKE) -> PassReport:
        """One pass: takes, sends and marks up to ``limit`` rows."""
        engine = self.engine if self.engine is not None else self.transport.queue.engine
        dialect = engine.dialect.name
        if dialect == "sqlite":
            return await self._sqlite_pass(engine, limit)
        if dialect == "mssql":
            from .outbox_mssql import mssql_pass

            return await mssql_pass(self, engine, limit)
        if dialect == "postgresql":
            return await self._locked_pass(engine, limit)
        raise ConfigurationError(f"the aws outbox relay cannot run on {dialect!r}")

    # -- sending -----------------------------------------------------------------------------------

    async def _send(self, rows: list[OutboxRow]) -> tuple[list[int], list[tuple[int, str]], bool]:
        """Sends rows in order, by topic, 10 per call; a key whose row fails sends nothing after it.
        Answers the sent ids, the failed (id, error) and whether SNS throttled."""
        sent: list[int] = []
        failed: list[tuple[int, str]] = []
        blocked: set[tuple[str, str]] = set()
        throttled = False
        by_topic: dict[str, list[OutboxRow]] = {}
        for row in rows:
            by_topic.setdefault(row.topic, []).append(row)
        for topic, items in by_topic.items():
            arn = self.transport.topic_arn(topic)
            if arn is None:
                failed.extend((r.id, f"topic {topic!r} is not bound") for r in items)
                continue
            fifo = self.transport._topics[topic].is_fifo if topic in self.transport._topics else False
            pending = list(items)
            while pending:
                chunk: list[OutboxRow] = []
                rest: list[OutboxRow] = []
                for row in pending:
                    key = (topic, row.partition_key) if row.partition_key is not None else None
                    if key is not None and key in blocked:
                        continue
                    (chunk if len(chunk) < BATCH else rest).append(row)
                pending = rest
                if not chunk:
                    break
                if throttled:
                    failed.extend((r.id, "throttled") for r in chunk)
                    continue
                entries = [self._entry(r, i, fifo) for i, r in enumerate(chunk)]
                try:
                    answer = await self.transport.sns.publish_batch(TopicArn=arn, PublishBatchRequestEntries=entries)
                except Exception as exc:
                    code = _code(exc)
                    if not code:
                        raise
                    throttled = throttled or code in THROTTLED
                    failed.extend((r.id, f"{code}: {exc}") for r in chunk)
                    blocked.update((topic, r.partition_key) for r in chunk if r.partition_key is not None)
                    continue
                bad = {
                    int(f["Id"]): f"{f.get('Code', '')} {f.get('Message', '')}".strip()
                    for f in answer.get("Failed", [])
                }
                for index, row in enumerate(chunk):
                    if index in bad:
                        failed.append((row.id, bad[index]))
                        throttled = throttled or bad[index].split(" ", 1)[0] in THROTTLED
                        if row.partition_key is not None:
                            blocked.add((topic, row.partition_key))
                    else:
                        sent.append(row.id)
                if self.after_batch is not None:
                    await self.after_batch(chunk)
        return sent, failed, throttled

    @staticmethod
    def _entry(row: OutboxRow, index: int, fifo: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {"Id": str(index), "Message": row.body}
        if row.attributes:
            entry["MessageAttributes"] = bodies.sns_attributes(row.attributes)
        if fifo:
            entry["MessageGroupId"] = row.partition_key or row.message_id
            entry["MessageDeduplicationId"] = row.message_id
        return entry

    @staticmethod
    def _row(r: Any) -> OutboxRow:
        attributes = r[5] if isinstance(r[5], dict) else json.loads(r[5])
        return OutboxRow(
            id=int(r[0]),
            topic=r[1],
            message_id=str(r[2]).lower(),  # SQL Server answers a uniqueidentifier in upper case
            partition_key=r[3],
            body=r[4],
            attributes=attributes,
            attempts=int(r[6]),
        )

    @staticmethod
    def _delay(attempts: int) -> float:
        return random.uniform(0, min(300.0, 1.0 * 2 ** min(attempts, 10)))

    # -- PostgreSQL: row locks -------------------------------------------------------------------

    async def _locked_pass(self, engine: Any, limit: int) -> PassReport:
        from sqlalchemy import text

        async with engine.begin() as conn:
            rows = [self._row(r) for r in (await conn.execute(text(_PG_TAKE), {"limit": limit})).all()]
            if not rows:
                return PassReport()
            sent, failed, throttled = await self._send(rows)
            if sent:
                await conn.execute(
                    text(
                        "UPDATE workqueue.aws_outbox SET sent_at = now(), attempts = attempts + 1, last_error = NULL "
                        "WHERE id = ANY(CAST(:ids AS bigint[]))"
                    ),
                    {"ids": sent},
                )
            attempts = {r.id: r.attempts for r in rows}
            for row_id, error in failed:
                await conn.execute(
                    text(
                        "UPDATE workqueue.aws_outbox SET attempts = attempts + 1, last_error = :error, "
                        "next_attempt_at = now() + make_interval(secs => :delay) WHERE id = :id"
                    ),
                    {"id": row_id, "error": error[:4000], "delay": self._delay(attempts[row_id])},
                )
        return PassReport(sent=len(sent), deferred=len(failed), throttled=throttled)

    # -- SQLite: leases --------------------------------------------------------------------------

    async def _sqlite_pass(self, engine: Any, limit: int) -> PassReport:
        from sqlalchemy import text

        token = uuid.uuid4().hex
        now = self.clock()
        async with engine.begin() as conn:
            candidates = (
                await conn.execute(
                    text(
                        "SELECT id, topic, message_id, partition_key, body, attributes, attempts FROM aws_outbox "
                        "WHERE sent_at IS NULL AND next_attempt_at <= :now "
                        "AND (relay_until IS NULL OR relay_until < :now) "
                        "ORDER BY id LIMIT :limit"
                    ),
                    {"now": now, "limit": limit},
                )
            ).all()
            rows = [self._row(r) for r in candidates]
            ids = {r.id for r in rows}
            heads: list[OutboxRow] = []
            for row in rows:
                if row.partition_key is not None:
                    earlier = (
                        (
                            await conn.execute(
                                text(
                                    "SELECT id FROM aws_outbox WHERE topic = :topic AND partition_key = :key "
                            "AND sent_at IS NULL "
                                    "AND id < :id"
                                ),
                                {"topic": row.topic, "key": row.partition_key, "id": row.id},
                            )
                        )
                        .scalars()
                        .all()
                    )
                    if any(e not in ids for e in earlier):
                        continue
                heads.append(row)
            if not heads:
                return PassReport()
            taken = 0
            for row in heads:
                taken += (
                    await conn.execute(
                        text(
                            "UPDATE aws_outbox SET relay_token = :token, relay_until = :until WHERE id = :id "
                            "AND sent_at IS NULL AND (relay_until IS NULL OR relay_until < :now)"
                        ),
                        {"token": token, "until": now + SQLITE_LEASE_SECONDS, "id": row.id, "now": now},
                    )
                ).rowcount
            if taken != len(heads):
                await conn.rollback()
                return PassReport()
        sent, failed, throttled = await self._send(heads)
        attempts = {r.id: r.attempts for r in heads}
        async with engine.begin() as conn:
            for row_id in sent:
                await conn.execute(
                    text(
                        "UPDATE aws_outbox SET sent_at = :now, attempts = attempts + 1, last_error = NULL, "
                        "relay_token = NULL, relay_until = NULL WHERE id = :id AND relay_token = :token"
                    ),
                    {"now": self.clock(), "id": row_id, "token": token},
                )
            for row_id, error in failed:
                await conn.execute(
                    text(
                        "UPDATE aws_outbox SET attempts = attempts + 1, last_error = :error, next_attempt_at = :at, "
                        "relay_token = NULL, relay_until = NULL WHERE id = :id AND relay_token = :token"
                    ),
                    {
                        "error": error[:4000],
                        "at": self.clock() + self._delay(attempts[row_id]),
                        "id": row_id,
                        "token": token,
                    },
                )
            # rows skipped behind a failed key: free their lease for the next pass
            await conn.execute(
                text(
                    "UPDATE aws_outbox SET relay_token = NULL, relay_until = NULL WHERE relay_token = :token "
                    "AND sent_at IS NULL"
                ),
                {"token": token},
            )
        return PassReport(sent=len(sent), deferred=len(failed), throttled=throttled)
