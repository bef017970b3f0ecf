"""The transactional outbox of the aws topics, and the relay that forwards it to SNS.

A publish with a session writes rows to ``aws_outbox`` in that transaction (a rollback leaves
none). The relay takes committed rows oldest first, keeps only each key's earliest unsent rows
(so one relay at a time forwards a key, in order), publishes them with PublishBatch (10 per call,
the MessageIDs kept as FIFO deduplication ids) and marks them sent.

* PostgreSQL and SQL Server: the take locks the rows (``FOR UPDATE SKIP LOCKED``; ``UPDLOCK,
  READPAST, ROWLOCK``) in the relay's transaction, which stays open across the SNS call and
  commits with the mark.
* SQLite: the rows are taken under a lease (``relay_token``, ``relay_until``) in a short write
  transaction, so the file's write lock is never held across an SNS call.

Every statement is a database routine of the dialect (:mod:`.outbox_store`, chosen once by dialect).

A relay that dies between the send and the mark leaves the rows unsent: the next pass sends them
again with the same MessageIDs, which FIFO topics deduplicate within 5 minutes and handlers must
absorb otherwise (at-least-once). Throttling (``Throttling``, ``ThrottlingException``) defers the
rows with a growing delay and slows the relay.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..core.envelope import PreparedMessage
from ..core.redaction import redacting_logger
from ..core.tasks import TaskScope
from ..core.words import count
from . import body as bodies
from .outbox_store import SQLITE_LEASE_SECONDS, OutboxRow, OutboxStore, PassReport, store_for

if TYPE_CHECKING:
    from .transport import AwsTransport

log = redacting_logger("fastapi_workqueue.aws.outbox")

BATCH = 10
TAKE = 100
THROTTLED = {"Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled", "TooManyRequestsException"}

__all__ = ["BATCH", "SQLITE_LEASE_SECONDS", "TAKE", "OutboxRelay", "OutboxRow", "PassReport", "write_outbox"]


async def write_outbox(session: Any, topic: str, items: Sequence[tuple[PreparedMessage, str]]) -> None:
    """Writes ``(message, body)`` rows of ``topic`` in the session's transaction."""
    await store_for(session).write(session, topic, items)


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
        self._store: OutboxStore | None = None
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
        engine = self.engine if self.engine is not None else self.transport.kernel.sessions.engine
        if self._store is None:
            self._store = store_for(engine)
        return await self._store.relay_pass(engine, limit, self._send, self._delay, self.clock)

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
                entries: list[dict[str, Any]] = []
                rest: list[OutboxRow] = []
                size = 0
                for row in pending:
                    key = (topic, row.partition_key) if row.partition_key is not None else None
                    if key is not None and key in blocked:
                        continue
                    if rest:  # (the call is full: what follows waits, in order)
                        rest.append(row)
                        continue
                    entry = self._entry(row, len(chunk), fifo)
                    grows = bodies.entry_size(entry)
                    if chunk and (len(chunk) == BATCH or size + grows > bodies.SNS_MAX_BYTES):
                        rest.append(row)  # 10 a call, and at most SNS's 256 KiB in all
                        continue
                    chunk.append(row)
                    entries.append(entry)
                    size += grows
                pending = rest
                if not chunk:
                    break
                if throttled:
                    failed.extend((r.id, "throttled") for r in chunk)
                    continue
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
        if failed and not throttled:
            _log_refused(rows, failed)
        return sent, failed, throttled

    @staticmethod
    def _entry(row: OutboxRow, index: int, fifo: bool) -> dict[str, Any]:
        attributes = dict(row.attributes)
        deduplication_id = attributes.pop(bodies.DEDUPLICATION_ATTRIBUTE, None)
        entry: dict[str, Any] = {"Id": str(index), "Message": row.body,
                                 "MessageAttributes": bodies.sns_attributes(attributes)}
        if fifo:
            entry["MessageGroupId"] = row.partition_key or row.message_id
            entry["MessageDeduplicationId"] = deduplication_id or row.message_id
        return entry

    @staticmethod
    def _delay(attempts: int) -> float:
        return random.uniform(0, min(300.0, 1.0 * 2 ** min(attempts, 10)))


def _log_refused(rows: list[OutboxRow], failed: list[tuple[int, str]]) -> None:
    """One WARNING per topic for the committed rows SNS (or the bindings) refused this pass: they
    stay in the outbox and are tried again later, and only the log says why."""
    topic_of = {row.id: row.topic for row in rows}
    by_topic: dict[str, list[str]] = {}
    for row_id, error in failed:
        by_topic.setdefault(topic_of.get(row_id, "?"), []).append(error)
    for topic, errors in by_topic.items():
        log.warning("outbox: %s of topic %s not sent (%s); kept in the outbox and tried again later: check the "
                    "topic's AWS resources and permissions (`workqueue validate-bindings --transport aws`)",
                    count(len(errors), "committed message"), topic, errors[0])
