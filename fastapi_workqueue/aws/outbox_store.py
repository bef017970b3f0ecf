"""Where the aws outbox and the bindings live: one store per dialect, chosen once by :func:`store_for`.

Every statement calls a database routine of the dialect, the same names and parameters in each:

* PostgreSQL: the SECURITY DEFINER functions ``workqueue.aws_outbox_write``, ``aws_outbox_take``,
  ``aws_outbox_mark_sent``, ``aws_outbox_defer``, ``aws_binding_list`` and ``aws_binding_replace``
  (``sql/postgresql/schema.sql``), which ``roles/aws_role.sql`` grants (all but the replace);
* SQL Server: the procedures of the same names (``sql/mssql/schema.sql``, ``roles/aws_role.sql``),
  lists passed as JSON arrays; checked by parsing here, not on a server (docs/sql-server.md);
* SQLite: the named statements ``aws_*`` of ``sql/sqlite/queries.sql``.

A relay pass on PostgreSQL and SQL Server runs in one transaction that stays open across the SNS
call: the take locks the rows (``FOR UPDATE SKIP LOCKED``; ``UPDLOCK, READPAST, ROWLOCK``) until
the marks commit. SQLite has no row locks: the rows are taken under a lease (``relay_token``,
``relay_until``) in a short write transaction, so the file's write lock is never held across an
SNS call, and marked in a second one.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from ..core.envelope import PreparedMessage
from ..core.errors import ConfigurationError
from . import body as bodies

SQLITE_LEASE_SECONDS = 60.0
"""How long a SQLite relay holds the rows it took (a dead relay's rows are taken again after it)."""

NOT_MIGRATED = (
    "the database has no bindings table ({table}): it is not migrated yet; run `workqueue migrate` "
    "(as the schema owner), then try again"
)


@dataclass
class OutboxRow:
    """One unsent outbox row a relay took."""

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


@dataclass(frozen=True)
class BindingRow:
    """One stored binding: a topic's or a subscription's, as JSON text or a decoded object."""

    kind: str
    name: str
    region: str
    binding: Any


Send = Callable[[list[OutboxRow]], Awaitable[tuple[list[int], list[tuple[int, str]], bool]]]
"""Sends taken rows; answers the sent ids, the failed (id, error) and whether SNS throttled."""


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


def _dialect(bind: Any) -> str:
    """The dialect of a session, connection or engine."""
    inner = getattr(bind, "bind", None)
    if inner is not None and hasattr(inner, "dialect"):
        bind = inner
    return str(bind.dialect.name)


class OutboxStore:
    """The outbox and bindings operations of one dialect (see the module's text)."""

    dialect: ClassVar[str]
    binding_table: ClassVar[str] = "workqueue.aws_binding"
    statements: ClassVar[dict[str, str]]
    """Every statement the store sends, by routine name (the tests check them)."""

    async def write(
        self, session: Any, topic: str, items: Sequence[tuple[PreparedMessage, str]], now: datetime | None = None,
    ) -> None:
        """Writes ``(message, body)`` rows of ``topic`` in the session's transaction."""
        raise NotImplementedError

    async def relay_pass(
        self, engine: Any, limit: int, send: Send, delay: Callable[[int], float], clock: Callable[[], float],
    ) -> PassReport:
        """One relay pass: takes up to ``limit`` rows, sends them with ``send``, marks them sent or
        defers them by ``delay(attempts)`` seconds. ``clock`` (epoch seconds) times SQLite's leases."""
        raise NotImplementedError

    async def list_bindings(self, engine: Any) -> list[BindingRow]:
        """The stored bindings, by kind and name."""
        from sqlalchemy import text

        async with engine.connect() as conn:
            await self._require_bindings(conn)
            rows = (await conn.execute(text(self.statements["aws_binding_list"]))).all()
        return [BindingRow(kind=r[0], name=r[1], region=r[2], binding=r[3]) for r in rows]

    async def replace_bindings(
        self, engine: Any, region: str, rows: Sequence[tuple[str, str, str]], now: datetime | None = None,
    ) -> None:
        """Replaces the stored bindings with ``rows`` of ``(kind, name, binding JSON)``, in one transaction."""
        from sqlalchemy import text

        async with engine.begin() as conn:
            await self._require_bindings(conn)
            await conn.execute(text(self.statements["aws_binding_replace"]), self._replace_params(region, rows, now))

    def _replace_params(self, region: str, rows: Sequence[tuple[str, str, str]], now: datetime | None) -> Any:
        raise NotImplementedError

    async def _require_bindings(self, conn: Any) -> None:
        """Raises a one-line ConfigurationError saying to migrate when the bindings are not there."""
        from sqlalchemy import text

        if not (await conn.execute(text(self.statements["aws_binding_exists"]))).scalar():
            raise ConfigurationError(NOT_MIGRATED.format(table=self.binding_table))


class _LockingStore(OutboxStore):
    """PostgreSQL and SQL Server: the take locks the rows until the pass's transaction commits."""

    def _list(self, values: list[Any]) -> Any:
        """A list as the dialect's routine takes it."""
        raise NotImplementedError

    async def write(
        self, session: Any, topic: str, items: Sequence[tuple[PreparedMessage, str]], now: datetime | None = None,
    ) -> None:
        from sqlalchemy import text

        await session.execute(text(self.statements["aws_outbox_write"]), {
            "topic": topic,
            "message_ids": self._list([m.message_id for m, _ in items]),
            "partition_keys": self._list([m.partition_key for m, _ in items]),
            "bodies": self._list([body for _, body in items]),
            "attributes": self._list([json.dumps(bodies.outbox_attributes(m)) for m, _ in items]),
            "now": now,
        })

    async def relay_pass(
        self, engine: Any, limit: int, send: Send, delay: Callable[[int], float], clock: Callable[[], float],
    ) -> PassReport:
        from sqlalchemy import text

        async with engine.begin() as conn:
            taken = await conn.execute(text(self.statements["aws_outbox_take"]), {"limit": limit, "now": None})
            rows = [_row(r) for r in taken.all()]
            if not rows:
                return PassReport()
            sent, failed, throttled = await send(rows)
            if sent:
                mark = text(self.statements["aws_outbox_mark_sent"])
                await conn.execute(mark, {"ids": self._list(sent), "now": None})
            attempts = {r.id: r.attempts for r in rows}
            for row_id, error in failed:
                await conn.execute(text(self.statements["aws_outbox_defer"]), {
                    "id": row_id, "error": error[:4000], "delay": delay(attempts[row_id]), "now": None,
                })
        return PassReport(sent=len(sent), deferred=len(failed), throttled=throttled)

    def _replace_params(self, region: str, rows: Sequence[tuple[str, str, str]], now: datetime | None) -> Any:
        return {
            "region": region,
            "kinds": self._list([kind for kind, _, _ in rows]),
            "names": self._list([name for _, name, _ in rows]),
            "bindings": self._list([binding for _, _, binding in rows]),
            "now": now,
        }


class PostgresOutboxStore(_LockingStore):
    """PostgreSQL: the ``workqueue.aws_*`` functions; lists travel as arrays."""

    dialect = "postgresql"
    statements: ClassVar[dict[str, str]] = {
        "aws_outbox_write": (
            "SELECT workqueue.aws_outbox_write(CAST(:topic AS text), CAST(:message_ids AS uuid[]), "
            "CAST(:partition_keys AS text[]), CAST(:bodies AS text[]), CAST(:attributes AS jsonb[]), "
            "CAST(:now AS timestamptz))"
        ),
        "aws_outbox_take": (
            "SELECT id, topic, message_id, partition_key, body, attributes, attempts "
            "FROM workqueue.aws_outbox_take(CAST(:limit AS integer), CAST(:now AS timestamptz))"
        ),
        "aws_outbox_mark_sent": (
            "SELECT workqueue.aws_outbox_mark_sent(CAST(:ids AS bigint[]), CAST(:now AS timestamptz))"
        ),
        "aws_outbox_defer": (
            "SELECT workqueue.aws_outbox_defer(CAST(:id AS bigint), CAST(:error AS text), "
            "CAST(:delay AS double precision), CAST(:now AS timestamptz))"
        ),
        "aws_binding_list": "SELECT kind, name, region, binding FROM workqueue.aws_binding_list()",
        "aws_binding_replace": (
            "SELECT workqueue.aws_binding_replace(CAST(:region AS text), CAST(:kinds AS text[]), "
            "CAST(:names AS text[]), CAST(:bindings AS jsonb[]), CAST(:now AS timestamptz))"
        ),
        "aws_binding_exists": "SELECT to_regprocedure('workqueue.aws_binding_list()') IS NOT NULL",
    }

    def _list(self, values: list[Any]) -> Any:
        return values


class MssqlOutboxStore(_LockingStore):
    """SQL Server: the ``workqueue.aws_*`` procedures; lists travel as JSON arrays."""

    dialect = "mssql"
    statements: ClassVar[dict[str, str]] = {
        "aws_outbox_write": (
            "EXEC workqueue.aws_outbox_write @p_topic = :topic, @p_message_ids = :message_ids, "
            "@p_partition_keys = :partition_keys, @p_bodies = :bodies, @p_attributes = :attributes, @p_now = :now"
        ),
        "aws_outbox_take": "EXEC workqueue.aws_outbox_take @p_limit = :limit, @p_now = :now",
        "aws_outbox_mark_sent": "EXEC workqueue.aws_outbox_mark_sent @p_ids = :ids, @p_now = :now",
        "aws_outbox_defer": (
            "EXEC workqueue.aws_outbox_defer @p_id = :id, @p_error = :error, @p_delay_seconds = :delay, "
            "@p_now = :now"
        ),
        "aws_binding_list": "EXEC workqueue.aws_binding_list",
        "aws_binding_replace": (
            "EXEC workqueue.aws_binding_replace @p_region = :region, @p_kinds = :kinds, @p_names = :names, "
            "@p_bindings = :bindings, @p_now = :now"
        ),
        "aws_binding_exists": (
            "SELECT CASE WHEN OBJECT_ID(N'workqueue.aws_binding_list', N'P') IS NULL THEN 0 ELSE 1 END"
        ),
    }

    def _list(self, values: list[Any]) -> Any:
        return json.dumps([str(v) if isinstance(v, uuid.UUID) else v for v in values])


@functools.cache
def _sqlite_queries() -> dict[str, str]:
    from ..database.sqlite import load_queries

    return {name: sql for name, sql in load_queries().items() if name.startswith("aws_")}


class SqliteOutboxStore(OutboxStore):
    """SQLite: the named statements ``aws_*`` of ``sql/sqlite/queries.sql``; the relay takes rows under a lease."""

    dialect = "sqlite"
    binding_table = "aws_binding"

    @property
    def statements(self) -> dict[str, str]:  # type: ignore[override]
        return _sqlite_queries()

    async def write(
        self, session: Any, topic: str, items: Sequence[tuple[PreparedMessage, str]], now: datetime | None = None,
    ) -> None:
        import time

        from sqlalchemy import text

        at = now.timestamp() if now is not None else time.time()
        rows = [
            {"topic": topic, "message_id": str(m.message_id), "partition_key": m.partition_key, "body": body,
             "attributes": json.dumps(bodies.outbox_attributes(m)), "now": at}
            for m, body in items
        ]
        await session.execute(text(self.statements["aws_outbox_write"]), rows)

    async def relay_pass(
        self, engine: Any, limit: int, send: Send, delay: Callable[[int], float], clock: Callable[[], float],
    ) -> PassReport:
        from sqlalchemy import text

        q = self.statements
        token = uuid.uuid4().hex
        now = clock()
        async with engine.begin() as conn:
            candidates = await conn.execute(text(q["aws_outbox_candidates"]), {"now": now, "limit": limit})
            rows = [_row(r) for r in candidates.all()]
            ids = {r.id for r in rows}
            heads: list[OutboxRow] = []
            for row in rows:
                if row.partition_key is not None:
                    earlier = await conn.execute(
                        text(q["aws_outbox_earlier"]), {"topic": row.topic, "key": row.partition_key, "id": row.id},
                    )
                    if any(e not in ids for e in earlier.scalars().all()):
                        continue
                heads.append(row)
            if not heads:
                return PassReport()
            taken = 0
            for row in heads:
                leased = await conn.execute(
                    text(q["aws_outbox_lease"]),
                    {"token": token, "until": now + SQLITE_LEASE_SECONDS, "id": row.id, "now": now},
                )
                taken += leased.rowcount
            if taken != len(heads):
                await conn.rollback()
                return PassReport()
        sent, failed, throttled = await send(heads)
        attempts = {r.id: r.attempts for r in heads}
        async with engine.begin() as conn:
            for row_id in sent:
                await conn.execute(text(q["aws_outbox_mark_sent"]), {"now": clock(), "id": row_id, "token": token})
            for row_id, error in failed:
                await conn.execute(text(q["aws_outbox_defer"]), {
                    "error": error[:4000], "at": clock() + delay(attempts[row_id]), "id": row_id, "token": token,
                })
            # rows skipped behind a failed key: free their lease for the next pass
            await conn.execute(text(q["aws_outbox_release"]), {"token": token})
        return PassReport(sent=len(sent), deferred=len(failed), throttled=throttled)

    async def replace_bindings(
        self, engine: Any, region: str, rows: Sequence[tuple[str, str, str]], now: datetime | None = None,
    ) -> None:
        import time

        from sqlalchemy import text

        at = now.timestamp() if now is not None else time.time()
        async with engine.begin() as conn:
            await self._require_bindings(conn)
            await conn.execute(text(self.statements["aws_binding_clear"]))
            if rows:
                await conn.execute(text(self.statements["aws_binding_insert"]), [
                    {"kind": kind, "name": name, "region": region, "binding": binding, "at": at}
                    for kind, name, binding in rows
                ])


_STORES: dict[str, OutboxStore] = {
    "postgresql": PostgresOutboxStore(), "mssql": MssqlOutboxStore(), "sqlite": SqliteOutboxStore(),
}


def store_for(bind: Any) -> OutboxStore:
    """The store of a session's, connection's or engine's dialect (one per dialect; stores keep no
    state); a ConfigurationError for a database the aws outbox has no routines on."""
    dialect = _dialect(bind)
    try:
        return _STORES[dialect]
    except KeyError:
        raise ConfigurationError(
            f"the aws outbox has no table on {dialect!r}: use PostgreSQL, SQLite or SQL Server for the queue's database"
        ) from None
