"""The outbox on SQL Server: the statements that write it and the relay's pass over it.

A pass runs in one transaction that stays open across the SNS call and commits with the mark:

1. :data:`TAKE` locks the oldest due unsent rows with ``UPDLOCK, READPAST, ROWLOCK`` (SQL Server's
   ``FOR UPDATE SKIP LOCKED``): rows another relay holds are skipped, not waited for;
2. :data:`BEHIND` answers which of them have an earlier unsent row of their key that this pass did
   not take (another relay holds it, or the limit cut it off); those are left for a later pass, so
   one relay at a time forwards a key, in order;
3. the rest are sent (:meth:`.OutboxRelay._send`), then :data:`MARK_SENT` and :data:`DEFER` mark them.

The statements use ``:name`` parameters (SQLAlchemy renders them for the driver); lists travel
as a JSON array read with ``OPENJSON``. They are checked by parsing (sqlfluff's ``tsql`` dialect),
not on a server: see docs/sql-server.md.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .outbox import OutboxRelay, PassReport

WRITE = (
    "INSERT INTO workqueue.aws_outbox (topic, message_id, partition_key, body, attributes) "
    "VALUES (:topic, CAST(:message_id AS uniqueidentifier), :partition_key, :body, :attributes)"
)
"""One outbox row, in the caller's transaction."""

TAKE = """
SELECT TOP (:limit) o.id, o.topic, o.message_id, o.partition_key, o.body, o.attributes, o.attempts
FROM workqueue.aws_outbox AS o WITH (UPDLOCK, READPAST, ROWLOCK)
WHERE o.sent_at IS NULL AND o.next_attempt_at <= SYSDATETIMEOFFSET()
ORDER BY o.id
"""
"""The oldest due unsent rows, locked until the pass commits; rows other relays hold are skipped."""

BEHIND = """
SELECT l.id
FROM workqueue.aws_outbox AS l
WHERE l.id IN (SELECT t.id FROM OPENJSON(:ids) WITH (id bigint '$') AS t)
  AND l.partition_key IS NOT NULL
  AND EXISTS (
      SELECT 1
      FROM workqueue.aws_outbox AS e
      WHERE e.topic = l.topic AND e.partition_key = l.partition_key AND e.sent_at IS NULL AND e.id < l.id
        AND e.id NOT IN (SELECT x.id FROM OPENJSON(:ids) WITH (id bigint '$') AS x)
  )
"""
"""Which taken rows wait behind an earlier unsent row of their key that this pass does not hold."""

MARK_SENT = """
UPDATE workqueue.aws_outbox
SET sent_at = SYSDATETIMEOFFSET(), attempts = attempts + 1, last_error = NULL
WHERE id IN (SELECT t.id FROM OPENJSON(:ids) WITH (id bigint '$') AS t)
"""
"""Marks the sent rows."""

DEFER = """
UPDATE workqueue.aws_outbox
SET attempts = attempts + 1, last_error = :error,
    next_attempt_at = DATEADD(millisecond, :delay_ms, SYSDATETIMEOFFSET())
WHERE id = :id
"""
"""Puts a row SNS refused (or throttled) off by ``delay_ms``."""

STATEMENTS = {"WRITE": WRITE, "TAKE": TAKE, "BEHIND": BEHIND, "MARK_SENT": MARK_SENT, "DEFER": DEFER}
"""Every statement of this module, by name (the tests parse each)."""


async def mssql_pass(relay: OutboxRelay, engine: Any, limit: int) -> PassReport:
    """One relay pass on SQL Server (see the module's text)."""
    from sqlalchemy import text

    from .outbox import PassReport

    async with engine.begin() as conn:
        taken = [relay._row(r) for r in (await conn.execute(text(TAKE), {"limit": limit})).all()]
        if not taken:
            return PassReport()
        keyed = [r.id for r in taken if r.partition_key is not None]
        behind: set[int] = set()
        if keyed:
            found = await conn.execute(text(BEHIND), {"ids": json.dumps([r.id for r in taken])})
            behind = {int(row[0]) for row in found.all()}
        rows = [r for r in taken if r.id not in behind]
        if not rows:
            return PassReport()
        sent, failed, throttled = await relay._send(rows)
        if sent:
            await conn.execute(text(MARK_SENT), {"ids": json.dumps(sent)})
        attempts = {r.id: r.attempts for r in rows}
        for row_id, error in failed:
            delay_ms = round(relay._delay(attempts[row_id]) * 1000)
            await conn.execute(text(DEFER), {"id": row_id, "error": error[:4000], "delay_ms": delay_ms})
    return PassReport(sent=len(sent), deferred=len(failed), throttled=throttled)
