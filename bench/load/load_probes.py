"""What the load benchmark reads from PostgreSQL: counters, backlog, wake-ups, activity, checks.

Each probe has a connection of its own to the benchmark's database (asyncpg), so a slow one
does not hold up the others:

- :class:`Counters`: calls and time of the ``workqueue.*`` functions (``pg_stat_user_functions``, with
  ``track_functions = 'pl'`` set on the database), the database's commits and sessions
  (``pg_stat_database``), the server's WAL counters (``pg_stat_wal``, shared by every database),
  the backlog (Pending + InFlight), the listening sessions; and, after a level, the checks of
  its orders, messages and deliveries and their end-to-end latency.
- :class:`NotifyCounter`: a LISTEN of the benchmark itself on the queue's channel.
- :class:`ActivitySampler`: ``pg_stat_activity`` every 100 ms while it is on, into an
  :class:`ActivityTally` per level.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections import Counter
from typing import Any

import asyncpg

CHANNEL = "workqueue"
SUBSCRIPTIONS = 2
"""The example app's subscriptions of ``orders.created``: every accepted order has this many deliveries."""


def server_dsn(pg_url: str, database: str) -> str:
    """``postgresql://user@host:port`` + ``/database`` (a SQLAlchemy-style scheme is accepted)."""
    scheme, sep, rest = pg_url.partition("://")
    if not sep or scheme.split("+", 1)[0] not in ("postgresql", "postgres"):
        raise SystemExit(f"--pg-url {pg_url!r} is not a PostgreSQL URL such as postgresql://postgres@127.0.0.1:5432")
    host = rest.split("/", 1)[0]
    return f"postgresql://{host}/{database}"


async def recreate_database(pg_url: str, database: str, settings: dict[str, str] | None = None) -> None:
    """Drops the database (closing its sessions) and creates it with ``track_functions = 'pl'``
    and the given settings (``ALTER DATABASE … SET``)."""
    admin = await asyncpg.connect(server_dsn(pg_url, "postgres"))
    try:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            database)
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}"')
        await admin.execute(f'CREATE DATABASE "{database}"')
        # Counts the calls of PL/pgSQL functions (workqueue.claim …) in pg_stat_user_functions.
        await admin.execute(f"ALTER DATABASE \"{database}\" SET track_functions = 'pl'")
        for name, value in (settings or {}).items():
            await admin.execute(f'ALTER DATABASE "{database}" SET {name} = {value}')
    finally:
        await admin.close()


async def server_facts(pg_url: str) -> dict[str, Any]:
    conn = await asyncpg.connect(server_dsn(pg_url, "postgres"))
    try:
        names = ("server_version", "cluster_name", "synchronous_commit", "max_connections", "shared_buffers",
                 "wal_sync_method", "commit_delay", "fsync")
        return {n: await conn.fetchval(f"SHOW {n}") for n in names}
    finally:
        await conn.close()


class Counters:
    """Readings of the benchmark's database, on one connection."""

    def __init__(self, conn: asyncpg.Connection[Any], database: str) -> None:
        self.conn = conn
        self.database = database

    @classmethod
    async def open(cls, pg_url: str, database: str) -> Counters:
        return cls(await asyncpg.connect(server_dsn(pg_url, database)), database)

    async def close(self) -> None:
        await self.conn.close()

    async def snapshot(self) -> dict[str, Any]:
        """Function calls, database and WAL counters, now (the stats snapshot cleared first)."""
        await self.conn.execute("SELECT pg_stat_clear_snapshot()")
        rows = await self.conn.fetch(
            "SELECT funcname, sum(calls)::bigint AS calls, sum(total_time) AS total_ms, sum(self_time) AS self_ms "
            "FROM pg_stat_user_functions WHERE schemaname = 'workqueue' GROUP BY funcname")
        calls = {r["funcname"]: r["calls"] for r in rows}
        times = {r["funcname"]: float(r["total_ms"]) for r in rows}
        db = await self.conn.fetchrow(
            "SELECT xact_commit, xact_rollback, sessions FROM pg_stat_database WHERE datname = $1", self.database)
        wal = await self.conn.fetchrow("SELECT wal_records, wal_bytes::bigint AS wal_bytes, wal_write, wal_sync "
                                       "FROM pg_stat_wal")
        return {"at": time.time(), "calls": calls, "function_ms": times, "db": dict(db) if db else {},
                "wal": dict(wal) if wal else {}}

    async def backlog(self) -> int:
        """Deliveries Pending or InFlight (0 before the schema exists)."""
        try:
            return int(await self.conn.fetchval(
                "SELECT count(*) FROM workqueue.delivery WHERE status IN ('Pending', 'InFlight')"))
        except asyncpg.UndefinedTableError:
            return 0

    async def listeners(self, exclude: list[int]) -> int:
        """Sessions of the database that run the queue's LISTEN connection (its last statement is
        the LISTEN or the listener's ``SELECT 1`` ping), the backends in ``exclude`` aside."""
        return int(await self.conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> ALL($2::int[]) "
            "AND state = 'idle' AND (query ILIKE 'LISTEN%' OR query = 'SELECT 1')", self.database, exclude))

    async def drain(self, limit: float, since: float | None = None, poll: float = 0.05) -> tuple[float | None, int]:
        """Waits until no delivery is Pending or InFlight; answers (seconds since ``since`` (a
        ``time.monotonic()``, by default now) or None when ``limit`` passed, deliveries left)."""
        started = time.monotonic() if since is None else since
        while True:
            left = await self.backlog()
            if left == 0:
                return time.monotonic() - started, 0
            if time.monotonic() - started > limit:
                return None, left
            await asyncio.sleep(poll)

    async def check_level(self, accepted: list[tuple[int, str]], published: bool) -> dict[str, Any]:
        """Checks the level's accepted orders (order_id, MessageID) against the database.

        Published (POST /orders): every 201 order exists with its MessageID, has exactly one
        message and ``SUBSCRIPTIONS`` deliveries, and every delivery ended Completed. Baseline: every
        201 order exists and no message was published for it. Violations are defects."""
        ids = [o for o, _ in accepted]
        mids = [uuid.UUID(m) for _, m in accepted]
        rows = await self.conn.fetch("SELECT id, message_id FROM orders WHERE id = ANY($1::int[])", ids)
        stored = {r["id"]: r["message_id"] for r in rows}
        missing = [o for o, m in accepted if stored.get(o) != uuid.UUID(m)]
        messages = {r["id"] for r in await self.conn.fetch(
            "SELECT id FROM workqueue.message WHERE id = ANY($1::uuid[])", mids)}
        result: dict[str, Any] = {"accepted": len(accepted), "orders_missing": len(missing)}
        if not published:
            result["messages_published"] = len(messages)
            result["violations"] = len(missing) + len(messages)
            return result
        deliveries = await self.conn.fetch(
            "SELECT message_id, count(*) AS n, count(*) FILTER (WHERE status = 'Completed') AS completed, "
            "max(settled_at) AS last FROM workqueue.delivery WHERE message_id = ANY($1::uuid[]) GROUP BY message_id",
            mids)
        per = {r["message_id"]: r for r in deliveries}
        not_two = sum(1 for m in mids if m not in per or per[m]["n"] != SUBSCRIPTIONS)
        not_completed = sum(r["n"] - r["completed"] for r in deliveries)
        result.update({
            "messages_missing": len(mids) - len(messages),
            "messages_without_all_deliveries": not_two,
            "deliveries": sum(r["n"] for r in deliveries),
            "deliveries_not_completed": not_completed,
        })
        result["violations"] = len(missing) + result["messages_missing"] + not_two + not_completed
        return result

    async def db_epoch(self) -> float:
        """The database's clock now (epoch seconds), to compare with the deliveries' ``settled_at``."""
        return float(await self.conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8"))

    async def settle_times(self, after: float | None = None) -> list[float]:
        """The ``settled_at`` (epoch) of every delivery settled after ``after`` (all when None), in order."""
        rows = await self.conn.fetch(
            "SELECT extract(epoch FROM settled_at)::float8 AS t FROM workqueue.delivery "
            "WHERE settled_at IS NOT NULL AND ($1::float8 IS NULL OR settled_at > to_timestamp($1)) "
            "ORDER BY settled_at", after)
        return [r["t"] for r in rows]

    async def settled_at(self, message_ids: list[str]) -> dict[str, float]:
        """The epoch of each message's last settled delivery (all its deliveries settled only)."""
        rows = await self.conn.fetch(
            "SELECT message_id, extract(epoch FROM max(settled_at))::float8 AS last, "
            "count(*) FILTER (WHERE settled_at IS NULL) AS open "
            "FROM workqueue.delivery WHERE message_id = ANY($1::uuid[]) GROUP BY message_id",
            [uuid.UUID(m) for m in message_ids])
        return {str(r["message_id"]): r["last"] for r in rows if r["open"] == 0 and r["last"] is not None}

    async def claims_with_work(self, message_ids: list[str]) -> int:
        """Claim calls that returned something, counted from the deliveries: a claim stamps the
        deliveries it takes with its transaction's ``now()`` as ``claimed_at``, so each distinct
        (subscription, claimed_at) is one claim that found work (a delivery claimed again keeps
        only its last claim: a lower bound when deliveries were retried)."""
        return int(await self.conn.fetchval(
            "SELECT count(DISTINCT (subscription_id, claimed_at)) FROM workqueue.delivery "
            "WHERE message_id = ANY($1::uuid[]) AND claimed_at IS NOT NULL",
            [uuid.UUID(m) for m in message_ids]))

    async def orders_count(self) -> int:
        try:
            return int(await self.conn.fetchval("SELECT count(*) FROM orders"))
        except asyncpg.UndefinedTableError:
            return 0


class NotifyCounter:
    """Counts the notifications on the queue's channel, on a LISTEN connection of its own."""

    def __init__(self) -> None:
        self.count = 0
        self.conn: asyncpg.Connection[Any] | None = None

    def _on(self, *_args: object) -> None:
        self.count += 1

    async def open(self, pg_url: str, database: str) -> None:
        self.conn = await asyncpg.connect(server_dsn(pg_url, database))
        await self.conn.add_listener(CHANNEL, self._on)

    @property
    def backend_pid(self) -> int:
        assert self.conn is not None
        return self.conn.get_server_pid()

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()
            self.conn = None


_ROUTINE = re.compile(r"workqueue\.(\w+)\s*\(")


def statement_label(query: str) -> str:
    """A short name for a statement: the ``workqueue.*`` routine it calls, or its first words."""
    match = _ROUTINE.search(query)
    if match:
        return f"workqueue.{match.group(1)}"
    words = query.strip().split()
    if not words:
        return "(none)"
    head = " ".join(words[:3]) if words[0].upper() in ("INSERT", "SELECT", "UPDATE", "DELETE") else words[0]
    return head[:48]


class ActivityTally:
    """Session-samples of ``pg_stat_activity``, added up over the repeats of one level."""

    def __init__(self) -> None:
        self.samples = 0
        self.sessions = 0
        self.by_state: Counter[str] = Counter()
        self.by_statement: Counter[str] = Counter()
        self.open_xact_ms: list[float] = []

    def add(self, rows: list[Any]) -> None:
        self.samples += 1
        for r in rows:
            state = r["state"] or "?"
            wait = f"{r['wait_event_type']}:{r['wait_event']}" if r["wait_event_type"] else "-"
            self.sessions += 1
            self.by_state[f"{state} | {wait}"] += 1
            if state in ("active", "idle in transaction"):
                self.by_statement[f"{state} | {statement_label(r['query'] or '')} | {wait}"] += 1
                if r["xact_ms"] is not None:
                    self.open_xact_ms.append(float(r["xact_ms"]))

    def summary(self) -> dict[str, Any]:
        """Shares of session-samples (of all the database's client sessions) and the busiest statements;
        the age of the transactions that were open (active or idle in transaction) when sampled."""
        total = max(self.sessions, 1)
        xact = sorted(self.open_xact_ms)

        def pct(q: float) -> float | None:
            return round(xact[min(len(xact) - 1, int(q * len(xact)))], 1) if xact else None

        return {
            "samples": self.samples,
            "sessions_per_sample": round(self.sessions / max(self.samples, 1), 1),
            "by_state_and_wait": {k: round(v / total, 4) for k, v in self.by_state.most_common(12)},
            "busy_by_statement": {k: round(v / total, 4) for k, v in self.by_statement.most_common(15)},
            "open_transaction_age_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)},
        }


class ActivitySampler:
    """Samples ``pg_stat_activity`` of the database every ``interval`` seconds into a tally while on."""

    SQL = ("SELECT state, wait_event_type, wait_event, query, "
           "extract(epoch FROM (clock_timestamp() - xact_start)) * 1000 AS xact_ms "
           "FROM pg_stat_activity "
           "WHERE datname = $1 AND pid <> pg_backend_pid() AND backend_type = 'client backend'")

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.conn: asyncpg.Connection[Any] | None = None
        self.database = ""
        self._task: asyncio.Task[None] | None = None

    async def open(self, pg_url: str, database: str) -> None:
        self.conn = await asyncpg.connect(server_dsn(pg_url, database))
        self.database = database

    async def close(self) -> None:
        await self.stop()
        if self.conn is not None:
            await self.conn.close()
            self.conn = None

    def start(self, tally: ActivityTally) -> None:
        self._task = asyncio.create_task(self._run(tally))

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def _run(self, tally: ActivityTally) -> None:
        assert self.conn is not None
        next_at = time.monotonic()
        while True:
            tally.add(await self.conn.fetch(self.SQL, self.database))
            next_at += self.interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
