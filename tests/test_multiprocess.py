"""Several worker processes on one Exclusive and one Ordered subscription; one dies by SIGKILL.

The test runs once on PostgreSQL and once on SQLite (a fresh file per run, shared by every
process), with the same case name and the same assertions. Two worker processes
(``tests/workers/mp_worker.py``) run both subscriptions of one topic. While they work, the test
polls the database for two InFlight deliveries of one key (invariant 1) and for an Ordered
delivery running ahead of an earlier live one of its key. Once some work is done and the first
worker holds running handlers on both subscriptions, it is killed with SIGKILL and a replacement
starts. The killed worker's leases expire and the sweeper of a surviving process takes them
back. At the end every delivery is Completed, no key ever had two InFlight deliveries, each
Ordered key completed in publish order (invariant 2), and a message ran twice only when the store
took its delivery back by lease expiry.

Everything the test reads from the database goes through a :class:`Probe`: the PostgreSQL probe
runs its queries on asyncpg, the SQLite probe the same questions on plain autocommit connections
to the queue's file (WAL: its reads never wait for, nor block, the workers' writes).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import aiosqlite
import asyncpg
import pytest

from fastapi_workqueue import PublishRequest, PublishStatus, WorkQueue, WorkQueueSettings
from fastapi_workqueue.database.postgres import to_asyncpg_dsn
from tests.conftest import unique
from tests.support import wait_for
from tests.workers.mp_worker import (
    LEASE_SECONDS,
    LOG_TABLES_DDL,
    SQLITE_LOG_TABLES_DDL,
    SWEEPER_INTERVAL_MS,
    build_topology,
    open_sqlite,
)

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
KEYS = 20
PER_KEY = 15
ROUNDS = 3  # each key's messages are published in this many calls, in seq order
# Per subscription per worker: two workers have more slots than there are keys, so free slots keep
# asking for work while keys are held and single flight per key is what limits concurrency.
CONCURRENCY = 12
POLL_SECONDS = 0.05
KILL_AFTER_FRACTION = 0.2  # of the deliveries of each subscription completed before the kill
SETTLE_TIMEOUT = 60.0
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
# A dead holder's delivery must leave InFlight within its lease plus one sweeper interval
# (SPEC §4, invariant 4); the slack absorbs polling and scheduling delays.
RECOVERY_BOUND = LEASE_SECONDS + SWEEPER_INTERVAL_MS / 1000 + 2.5


# -- worker processes ------------------------------------------------------------------------


@dataclass
class Worker:
    label: str
    proc: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.stdout.read_text(errors="replace") if self.stdout.exists() else ""

    def tail(self, lines: int = 30) -> str:
        text = self.stderr.read_text(errors="replace") if self.stderr.exists() else ""
        last = "\n".join(text.splitlines()[-lines:])
        return f"--- {self.label} (pid {self.pid}, exit {self.proc.returncode}) stderr tail ---\n{last}"


def labelled(database_url: str, label: str) -> str:
    """The URL with ``application_name=label`` on PostgreSQL, so the probe can find that worker's sessions."""
    if database_url.startswith("sqlite"):
        return database_url
    return f"{database_url}{'&' if '?' in database_url else '?'}application_name={label}"


def start_worker(label: str, tmp_path: Path, database_url: str, topic: str, exclusive: str, ordered: str) -> Worker:
    stdout, stderr = tmp_path / f"{label}.out", tmp_path / f"{label}.err"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env["PYTHONUNBUFFERED"] = "1"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.workers.mp_worker",
                "--database-url",
                labelled(database_url, label),
                "--topic",
                topic,
                "--exclusive",
                exclusive,
                "--ordered",
                ordered,
                "--concurrency",
                str(CONCURRENCY),
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    return Worker(label, proc, stdout, stderr)


def tails(workers: Iterable[Worker]) -> str:
    return "\n".join(w.tail() for w in workers)


async def wait_ready(worker: Worker, within: float = READY_TIMEOUT) -> None:
    def ready() -> bool:
        if worker.proc.poll() is not None:
            pytest.fail(f"worker {worker.label} exited before it was ready\n{worker.tail()}")
        return f"READY {worker.pid}" in worker.output()

    await wait_for(ready, within=within, interval=0.05,
                   describe=lambda: f"worker {worker.label} was not ready\n{worker.tail()}")


async def wait_exit(worker: Worker, within: float) -> int | None:
    """Its exit code once it exits; None when it still runs after ``within`` seconds."""
    try:
        await wait_for(lambda: worker.proc.poll() is not None, within=within, interval=0.05)
    except AssertionError:
        return None
    return worker.proc.returncode


async def stop_worker(worker: Worker) -> int | None:
    """SIGTERM (a graceful stop), then SIGKILL if it does not exit in time; returns the exit code."""
    if worker.proc.poll() is None:
        worker.proc.send_signal(signal.SIGTERM)
        code = await wait_exit(worker, STOP_TIMEOUT)
        if code is not None:
            return code
        worker.proc.kill()
    worker.proc.wait(timeout=10)
    return None


# -- the invariant monitor -------------------------------------------------------------------

KEY_VIOLATIONS = """
SELECT subscription_id, partition_key, count(*) AS n, array_agg(id ORDER BY id) AS ids
FROM workqueue.delivery
WHERE subscription_id = ANY($1::int[]) AND status = 'InFlight' AND partition_key IS NOT NULL
GROUP BY 1, 2
HAVING count(*) > 1
"""

# An InFlight Ordered delivery with an earlier live (Pending, InFlight, DeadLettered) one of its key.
ORDER_VIOLATIONS = """
SELECT d.partition_key, d.id, array_agg(e.id ORDER BY e.id) AS earlier
FROM workqueue.delivery d
JOIN workqueue.delivery e
  ON e.subscription_id = d.subscription_id AND e.partition_key = d.partition_key AND e.key_mode = 2
 AND e.id < d.id AND e.status IN ('Pending', 'InFlight', 'DeadLettered')
WHERE d.subscription_id = $1 AND d.key_mode = 2 AND d.status = 'InFlight'
GROUP BY 1, 2
"""

IN_FLIGHT = "SELECT count(*) FROM workqueue.delivery WHERE subscription_id = ANY($1::int[]) AND status = 'InFlight'"


@dataclass
class Monitor:
    violations: list[str] = field(default_factory=list)
    polls: int = 0
    polls_with_work: int = 0
    peak_in_flight: int = 0


async def watch(
    open_probe: Callable[[], Awaitable[Probe]],
    subscription_ids: list[int],
    ordered_id: int,
    report: Monitor,
    stop: asyncio.Event,
) -> None:
    """Polls the database every POLL_SECONDS until ``stop`` is set, recording every invariant violation."""
    probe = await open_probe()  # a connection of its own
    try:
        while not stop.is_set():
            for row in await probe.key_violations(subscription_ids):
                report.violations.append(
                    f"subscription {row['subscription_id']} key {row['partition_key']!r}: "
                    f"{row['n']} InFlight deliveries {row['ids']}"
                )
            for row in await probe.order_violations(ordered_id):
                report.violations.append(
                    f"Ordered key {row['partition_key']!r}: delivery {row['id']} InFlight while earlier "
                    f"{row['earlier']} are live"
                )
            in_flight = await probe.in_flight(subscription_ids)
            report.polls += 1
            report.polls_with_work += in_flight > 0
            report.peak_in_flight = max(report.peak_in_flight, in_flight)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_SECONDS)
    finally:
        await probe.close()


# -- database helpers ------------------------------------------------------------------------

# InFlight deliveries whose current attempt runs (or ran) in the handler of process $2.
HELD_BY = """
SELECT d.id, d.subscription_id, d.attempt
FROM workqueue.delivery d
JOIN public.mp_started s ON s.delivery_id = d.id AND s.attempt = d.attempt
WHERE d.subscription_id = ANY($1::int[]) AND d.status = 'InFlight' AND s.pid = $2
"""

STATUS_COUNTS = """
SELECT subscription_id, status, count(*) AS n FROM workqueue.delivery
WHERE subscription_id = ANY($1::int[]) GROUP BY 1, 2
"""

# Of the deliveries ($1) the killed worker held at attempts $2: those still InFlight at that attempt.
STUCK = """
SELECT count(*) FROM workqueue.delivery d JOIN unnest($1::bigint[], $2::int[]) AS h(id, attempt)
ON h.id = d.id WHERE d.status = 'InFlight' AND d.attempt = h.attempt
"""

DELIVERIES = """
SELECT d.id, d.subscription_id, d.partition_key, d.key_mode, d.claim_count, d.last_error, d.settled_at,
       (m.payload::jsonb ->> 'seq')::int AS seq
FROM workqueue.delivery d JOIN workqueue.message m ON m.id = d.message_id
WHERE d.subscription_id = ANY($1::int[]) ORDER BY d.id
"""

RUNS = """
SELECT s.run_id, s.subscription, s.partition_key, s.seq, s.message_id, s.pid, s.started_at,
       l.id AS log_id, l.finished_at
FROM public.mp_started s LEFT JOIN public.mp_log l ON l.run_id = s.run_id
WHERE s.subscription = ANY($1::text[]) ORDER BY s.started_at
"""

Row = dict[str, Any]


class Probe(Protocol):
    """What the test asks the database, on one connection of its own."""

    async def create_log_tables(self) -> None: ...
    async def subscription_ids(self, names: Sequence[str]) -> dict[str, int]: ...
    async def key_violations(self, subscription_ids: list[int]) -> list[Row]:
        """Keys with more than one InFlight delivery: subscription_id, partition_key, n, ids."""
        ...
    async def order_violations(self, ordered_id: int) -> list[Row]:
        """InFlight Ordered deliveries with an earlier live one of their key: partition_key, id, earlier."""
        ...
    async def in_flight(self, subscription_ids: list[int]) -> int: ...
    async def held_by(self, subscription_ids: list[int], pid: int) -> list[Row]: ...
    async def status_counts(self, subscription_ids: list[int]) -> dict[tuple[int, str], int]: ...
    async def stuck(self, held_attempts: dict[int, int]) -> int: ...
    async def sessions(self, label: str) -> int | None:
        """How many database sessions the worker ``label`` has open (None where the store has no sessions)."""
        ...
    async def sessions_closed(self, label: str, within: float) -> None:
        """Returns once no database session of the worker ``label`` is left (a COMMIT the worker sent
        just before it died runs to its end on the server first)."""
        ...
    async def deliveries(self, subscription_ids: list[int]) -> list[Row]: ...
    async def runs(self, subscriptions: list[str]) -> list[Row]: ...
    async def close(self) -> None: ...


class PostgresProbe:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    @classmethod
    async def open(cls, url: str) -> PostgresProbe:
        return cls(await asyncpg.connect(to_asyncpg_dsn(url)))

    async def create_log_tables(self) -> None:
        await self.conn.execute(LOG_TABLES_DDL)

    async def subscription_ids(self, names: Sequence[str]) -> dict[str, int]:
        rows = await self.conn.fetch(
            "SELECT name, id FROM workqueue.subscription WHERE name = ANY($1::text[])", list(names)
        )
        return {r["name"]: r["id"] for r in rows}

    async def key_violations(self, subscription_ids: list[int]) -> list[Row]:
        return [dict(r) for r in await self.conn.fetch(KEY_VIOLATIONS, subscription_ids)]

    async def order_violations(self, ordered_id: int) -> list[Row]:
        return [dict(r) for r in await self.conn.fetch(ORDER_VIOLATIONS, ordered_id)]

    async def in_flight(self, subscription_ids: list[int]) -> int:
        return int(await self.conn.fetchval(IN_FLIGHT, subscription_ids))

    async def held_by(self, subscription_ids: list[int], pid: int) -> list[Row]:
        return [dict(r) for r in await self.conn.fetch(HELD_BY, subscription_ids, pid)]

    async def status_counts(self, subscription_ids: list[int]) -> dict[tuple[int, str], int]:
        rows = await self.conn.fetch(STATUS_COUNTS, subscription_ids)
        return {(r["subscription_id"], r["status"]): r["n"] for r in rows}

    async def stuck(self, held_attempts: dict[int, int]) -> int:
        return int(await self.conn.fetchval(STUCK, list(held_attempts), list(held_attempts.values())))

    async def sessions(self, label: str) -> int | None:
        return int(await self.conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", label))

    async def sessions_closed(self, label: str, within: float) -> None:
        async def closed() -> bool:
            return not await self.sessions(label)

        await wait_for(closed, within=within, describe=lambda: f"database sessions of {label} still open")

    async def deliveries(self, subscription_ids: list[int]) -> list[Row]:
        return [dict(r) for r in await self.conn.fetch(DELIVERIES, subscription_ids)]

    async def runs(self, subscriptions: list[str]) -> list[Row]:
        return [dict(r) for r in await self.conn.fetch(RUNS, subscriptions)]

    async def close(self) -> None:
        await self.conn.close()


def placeholders(values: Sequence[Any]) -> str:
    return ", ".join("?" * len(values))


def sqlite_time(value: float | None) -> datetime | None:
    """An epoch-seconds column as the aware datetime PostgreSQL returns."""
    return None if value is None else datetime.fromtimestamp(value, UTC)


class SqliteProbe:
    """The same questions on the queue's SQLite file (tables without the ``workqueue.`` schema).

    The connection is in autocommit mode: each query is one read transaction on a consistent
    snapshot (WAL), taken beside whichever process writes at that moment.
    """

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self.conn = conn

    @classmethod
    async def open(cls, url: str) -> SqliteProbe:
        return cls(await open_sqlite(url))

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        cursor = await self.conn.execute(sql, tuple(params))
        try:
            rows = await cursor.fetchall()
            columns = [c[0] for c in cursor.description or ()]
        finally:
            await cursor.close()
        return [dict(zip(columns, row, strict=True)) for row in rows]

    async def fetchval(self, sql: str, params: Sequence[Any] = ()) -> Any:
        rows = await self.fetch(sql, params)
        return next(iter(rows[0].values())) if rows else None

    async def create_log_tables(self) -> None:
        await self.conn.executescript(SQLITE_LOG_TABLES_DDL)

    async def subscription_ids(self, names: Sequence[str]) -> dict[str, int]:
        rows = await self.fetch(f"SELECT name, id FROM subscription WHERE name IN ({placeholders(names)})", names)
        return {r["name"]: r["id"] for r in rows}

    async def key_violations(self, subscription_ids: list[int]) -> list[Row]:
        rows = await self.fetch(
            "SELECT subscription_id, partition_key, count(*) AS n, json_group_array(id) AS ids FROM delivery "
            f"WHERE subscription_id IN ({placeholders(subscription_ids)}) AND status = 'InFlight' "
            "AND partition_key IS NOT NULL GROUP BY 1, 2 HAVING count(*) > 1",
            subscription_ids,
        )
        return [{**r, "ids": sorted(json.loads(r["ids"]))} for r in rows]

    async def order_violations(self, ordered_id: int) -> list[Row]:
        rows = await self.fetch(
            "SELECT d.partition_key, d.id, json_group_array(e.id) AS earlier FROM delivery d "
            "JOIN delivery e ON e.subscription_id = d.subscription_id AND e.partition_key = d.partition_key "
            "AND e.key_mode = 2 AND e.id < d.id AND e.status IN ('Pending', 'InFlight', 'DeadLettered') "
            "WHERE d.subscription_id = ? AND d.key_mode = 2 AND d.status = 'InFlight' GROUP BY 1, 2",
            [ordered_id],
        )
        return [{**r, "earlier": sorted(json.loads(r["earlier"]))} for r in rows]

    async def in_flight(self, subscription_ids: list[int]) -> int:
        return int(await self.fetchval(
            f"SELECT count(*) FROM delivery WHERE subscription_id IN ({placeholders(subscription_ids)}) "
            "AND status = 'InFlight'",
            subscription_ids,
        ))

    async def held_by(self, subscription_ids: list[int], pid: int) -> list[Row]:
        return await self.fetch(
            "SELECT d.id, d.subscription_id, d.attempt FROM delivery d "
            "JOIN mp_started s ON s.delivery_id = d.id AND s.attempt = d.attempt "
            f"WHERE d.subscription_id IN ({placeholders(subscription_ids)}) AND d.status = 'InFlight' AND s.pid = ?",
            [*subscription_ids, pid],
        )

    async def status_counts(self, subscription_ids: list[int]) -> dict[tuple[int, str], int]:
        rows = await self.fetch(
            "SELECT subscription_id, status, count(*) AS n FROM delivery "
            f"WHERE subscription_id IN ({placeholders(subscription_ids)}) GROUP BY 1, 2",
            subscription_ids,
        )
        return {(r["subscription_id"], r["status"]): r["n"] for r in rows}

    async def stuck(self, held_attempts: dict[int, int]) -> int:
        ids = list(held_attempts)
        rows = await self.fetch(
            f"SELECT id, attempt FROM delivery WHERE status = 'InFlight' AND id IN ({placeholders(ids)})", ids
        )
        return sum(1 for r in rows if held_attempts[r["id"]] == r["attempt"])

    async def sessions(self, label: str) -> int | None:
        return None

    async def sessions_closed(self, label: str, within: float) -> None:
        """A killed process's SQLite writes end with it: what it committed is in the file, the rest
        is rolled back by the next opener."""

    async def deliveries(self, subscription_ids: list[int]) -> list[Row]:
        rows = await self.fetch(
            "SELECT d.id, d.subscription_id, d.partition_key, d.key_mode, d.claim_count, d.last_error, d.settled_at, "
            "CAST(json_extract(m.payload, '$.seq') AS INTEGER) AS seq "
            "FROM delivery d JOIN message m ON m.id = d.message_id "
            f"WHERE d.subscription_id IN ({placeholders(subscription_ids)}) ORDER BY d.id",
            subscription_ids,
        )
        return [{**r, "settled_at": sqlite_time(r["settled_at"])} for r in rows]

    async def runs(self, subscriptions: list[str]) -> list[Row]:
        rows = await self.fetch(
            "SELECT s.run_id, s.subscription, s.partition_key, s.seq, s.message_id, s.pid, s.started_at, "
            "l.id AS log_id, l.finished_at "
            "FROM mp_started s LEFT JOIN mp_log l ON l.run_id = s.run_id "
            f"WHERE s.subscription IN ({placeholders(subscriptions)}) ORDER BY s.started_at",
            subscriptions,
        )
        return [
            {**r, "started_at": sqlite_time(r["started_at"]), "finished_at": sqlite_time(r["finished_at"])}
            for r in rows
        ]

    async def close(self) -> None:
        await self.conn.close()


async def open_probe(database: str, url: str) -> Probe:
    if database == "sqlite":
        return await SqliteProbe.open(url)
    return await PostgresProbe.open(url)


@pytest.fixture(params=["postgresql", "sqlite"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(name, URL): the session's PostgreSQL database, or a fresh SQLite file of this test.

    The SQLite file is created and migrated by the test's publisher (``auto_migrate`` is on by
    default for SQLite); the workers' own start-up migration then finds nothing to do.
    """
    if request.param == "postgresql":
        return "postgresql", request.getfixturevalue("pg_url")
    return "sqlite", f"sqlite+aiosqlite:///{tmp_path / 'workqueue.db'}"


def taken_back_by_expiry(delivery: Row) -> bool:
    """Whether the store took the delivery back from a holder whose lease ran out (the sweeper
    counts a failed attempt and writes why)."""
    return delivery["claim_count"] >= 2 and (delivery["last_error"] or "").startswith("lease expired")


def collapse_repeats(values: list[int]) -> list[int]:
    """[0, 1, 1, 2] → [0, 1, 2]: a handler that ran twice in a row (at-least-once) counts once."""
    out: list[int] = []
    for value in values:
        if not out or out[-1] != value:
            out.append(value)
    return out


# -- the test --------------------------------------------------------------------------------


async def test_sigkilled_worker_keeps_exclusive_and_ordered_invariants(
    database: tuple[str, str], tmp_path: Path
) -> None:
    began = time.monotonic()
    dialect, url = database
    topic_name, exclusive, ordered = unique("mp-topic"), unique("mp-exclusive"), unique("mp-ordered")
    topic, subscriptions = build_topology(topic_name, exclusive, ordered)
    publisher = WorkQueue(
        WorkQueueSettings(database_url=url, enabled=False, listen=False, pool_size=2),
        topics=[topic],
        subscriptions=subscriptions,
    )
    per_subscription = KEYS * PER_KEY
    keys = [f"key-{k:02d}" for k in range(KEYS)]
    workers: list[Worker] = []
    report = Monitor()
    stop_monitor = asyncio.Event()
    monitor: asyncio.Task[None] | None = None
    db: Probe | None = None
    try:
        await publisher.open()  # migrates (SQLite), syncs the topic and both subscriptions
        db = await open_probe(dialect, url)
        await db.create_log_tables()
        ids = await db.subscription_ids([exclusive, ordered])
        exclusive_id, ordered_id = ids[exclusive], ids[ordered]
        sub_ids = [exclusive_id, ordered_id]
        monitor = asyncio.create_task(
            watch(lambda: open_probe(dialect, url), sub_ids, ordered_id, report, stop_monitor)
        )

        args = (tmp_path, url, topic_name, exclusive, ordered)
        workers = [start_worker("worker-a", *args), start_worker("worker-b", *args)]
        await asyncio.gather(*(wait_ready(w) for w in workers))
        victim = workers[0]

        # Publish each key's messages in seq order, in ROUNDS calls per key, while the workers run.
        size = PER_KEY // ROUNDS
        for round_no in range(ROUNDS):
            for key in keys:
                results = await publisher.publish(
                    topic_name,
                    [
                        PublishRequest(partition_key=key, payload={"seq": seq})
                        for seq in range(round_no * size, (round_no + 1) * size)
                    ],
                )
                assert [r.status for r in results] == [PublishStatus.ACCEPTED] * size, results

        # Wait until some work is done and the victim runs handlers of both subscriptions, then kill it.
        probe = db
        counts: dict[tuple[int, str], int] = {}

        async def time_to_kill() -> bool:
            nonlocal counts
            assert victim.proc.poll() is None, f"the victim exited on its own\n{victim.tail()}"
            counts = await probe.status_counts(sub_ids)
            held = await probe.held_by(sub_ids, victim.pid)
            done = all(counts.get((s, "Completed"), 0) >= KILL_AFTER_FRACTION * per_subscription for s in sub_ids)
            return done and {r["subscription_id"] for r in held} == set(sub_ids)

        await wait_for(time_to_kill, within=30, interval=0.01,
                       describe=lambda: f"no moment to kill the victim: {counts}\n{tails(workers)}")
        assert await db.sessions(victim.label) != 0, "the victim's database sessions do not carry its label"
        victim.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        assert await wait_exit(victim, 10) == -signal.SIGKILL
        await db.sessions_closed(victim.label, 10)
        held = await db.held_by(sub_ids, victim.pid)
        completed_at_kill = await db.status_counts(sub_ids)
        workers.append(start_worker("worker-c", *args))

        # The dead holder's deliveries leave InFlight once their lease runs out and a sweeper runs.
        held_attempts = {r["id"]: r["attempt"] for r in held}
        recovered_after: float | None = None
        if held_attempts:
            async def recovered() -> bool:
                return await probe.stuck(held_attempts) == 0

            await wait_for(recovered, within=SETTLE_TIMEOUT - (time.monotonic() - killed_at), interval=POLL_SECONDS,
                           describe=lambda: "held deliveries stay InFlight")
            recovered_after = time.monotonic() - killed_at
        await wait_ready(workers[-1])

        # Every delivery of both subscriptions ends terminal.
        async def all_terminal() -> bool:
            nonlocal counts
            for w in workers[1:]:
                assert w.proc.poll() is None, f"worker {w.label} died\n{w.tail()}"
            counts = await probe.status_counts(sub_ids)
            return not any(n for (_, st), n in counts.items() if st in ("Pending", "InFlight"))

        await wait_for(all_terminal, within=SETTLE_TIMEOUT, interval=0.1,
                       describe=lambda: f"deliveries still live: {counts}\n{tails(workers)}")
        # One more monitor pass over the final state: one that began after it.
        passes = report.polls
        await wait_for(lambda: report.polls >= passes + 2, describe=lambda: report)
        stop_monitor.set()
        await monitor  # raises if the monitor itself failed
        exit_codes = {w.label: await stop_worker(w) for w in workers[1:]}
        elapsed = time.monotonic() - began

        # -- what the store says -------------------------------------------------------------
        diagnostics = tails(workers)
        assert report.violations == [], "\n".join(report.violations[:20]) + "\n" + diagnostics
        assert report.polls_with_work >= 5, f"the monitor barely saw work running: {report}"
        expected = {(s, "Completed"): per_subscription for s in sub_ids}
        assert counts == expected, f"not everything Completed: {counts}\n{diagnostics}"
        assert held, "the victim held no InFlight delivery when it was killed"
        assert recovered_after is not None and recovered_after <= RECOVERY_BOUND, (
            f"the killed worker's deliveries left InFlight after {recovered_after} s (bound {RECOVERY_BOUND} s)"
        )
        rows = await db.deliveries(sub_ids)
        by_id = {r["id"]: r for r in rows}
        for delivery_id in held_attempts:
            taken_back = by_id[delivery_id]
            assert taken_back_by_expiry(taken_back), (
                f"delivery {delivery_id} held by the killed worker was not taken back by lease expiry: "
                f"{taken_back}"
            )
        deliveries: dict[tuple[int, str], list[Row]] = defaultdict(list)
        for r in rows:
            deliveries[(r["subscription_id"], r["partition_key"])].append(r)
        assert len(deliveries) == 2 * KEYS
        key_modes = {(r["subscription_id"], r["key_mode"]) for r in rows}
        assert key_modes == {(exclusive_id, 1), (ordered_id, 2)}, f"deliveries routed with key modes {key_modes}"
        for (sub_id, key), items in deliveries.items():
            # Publish order is delivery id order, and it is seq order.
            assert [r["seq"] for r in items] == list(range(PER_KEY)), (sub_id, key)
            if sub_id == ordered_id:
                # Completion order per Ordered key equals publish order, strictly.
                settled = [r["settled_at"] for r in items]
                assert all(a < b for a, b in itertools.pairwise(settled)), (
                    f"Ordered key {key!r} completed out of publish order: "
                    f"{[(r['seq'], r['settled_at'].isoformat()) for r in items]}"
                )

        # -- what the handlers saw -----------------------------------------------------------
        runs = await db.runs([exclusive, ordered])
        finished = [r for r in runs if r["log_id"] is not None]
        per_message = Counter((r["subscription"], r["message_id"]) for r in finished)
        assert len(per_message) == 2 * per_subscription, "some messages never finished a handler run"
        duplicates = {k: n for k, n in per_message.items() if n > 1}
        unfinished = [r for r in runs if r["log_id"] is None]
        assert all(r["pid"] == victim.pid for r in unfinished), (
            f"handler runs that never finished outside the killed worker: {unfinished}"
        )
        held_messages = {
            (by_id[i]["subscription_id"], by_id[i]["partition_key"], by_id[i]["seq"]) for i in held_attempts
        }
        name_of = {exclusive_id: exclusive, ordered_id: ordered}
        held_named = {(name_of[s], k, q) for s, k, q in held_messages}
        message_key = {
            (r["subscription"], r["message_id"]): (r["subscription"], r["partition_key"], r["seq"]) for r in finished
        }
        # A message runs again only when the store took its delivery back by lease expiry: every
        # delivery the killed worker held, and any whose holder could not renew or settle within the
        # lease (a survivor whose writes waited on a slow disk or on the file's write lock: the
        # finished run's settle then answers LeaseLost and its outcome is ignored).
        expired = {
            (name_of[r["subscription_id"]], r["partition_key"], r["seq"]) for r in rows if taken_back_by_expiry(r)
        }
        assert {message_key[m] for m in duplicates} <= expired, (
            f"a message ran twice although the store never took its delivery back: {duplicates}\n{diagnostics}"
        )

        runs_by_key: dict[tuple[str, str], list[Row]] = defaultdict(list)
        for r in finished:
            runs_by_key[(r["subscription"], r["partition_key"])].append(r)
        for (sub_name, key), items in runs_by_key.items():
            # Single flight per key, as the handlers saw it: the runs of one key never overlap.
            for a, b in itertools.pairwise(items):
                assert a["finished_at"] < b["started_at"], (
                    f"{sub_name} key {key!r}: seq {a['seq']} ran until {a['finished_at']} but seq {b['seq']} "
                    f"started at {b['started_at']}"
                )
            if sub_name == ordered:
                seqs = [r["seq"] for r in sorted(items, key=lambda r: r["log_id"])]
                assert collapse_repeats(seqs) == list(range(PER_KEY)), f"Ordered key {key!r} ran out of order: {seqs}"

        assert exit_codes == {w.label: 0 for w in workers[1:]}, (
            f"workers did not stop cleanly: {exit_codes}\n{tails(workers[1:])}"
        )
        summary: dict[str, Any] = {
            "database": dialect,
            "elapsed_s": round(elapsed, 1),
            "completed_at_kill": {name_of[s]: completed_at_kill.get((s, "Completed"), 0) for s in sub_ids},
            "held_by_killed_worker": len(held),
            "recovered_after_s": round(recovered_after, 2),
            "handler_runs": len(runs),
            "unfinished_runs": len(unfinished),
            "duplicates": len(duplicates),
            "expired_beyond_held": len(expired - held_named),
            "monitor_polls": report.polls,
            "peak_in_flight": report.peak_in_flight,
        }
        print(f"multiprocess run: {summary}")
    finally:
        stop_monitor.set()
        if monitor is not None and not monitor.done():
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait(timeout=10)
        await publisher.close()
        if db is not None:
            await db.close()
