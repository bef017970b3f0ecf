"""The soak and chaos run of fastapi-workqueue on PostgreSQL: one command, one report.

    .venv/bin/python -m tests.soak.run                                  # full: 50,000 messages over 10 minutes
    .venv/bin/python -m tests.soak.run --messages 3000 --duration 75    # the short version CI runs

What it does (docs/soak.md has the details and the last full report):

1. Creates a fresh database (``--database-url``; by default ``workqueue_soak`` on a private
   PostgreSQL cluster that the run creates in a temp folder and removes at the end, see
   ``tests/private_cluster.py``; dropped at the end unless ``--keep-database``), migrates it,
   declares the soak topology (``tests/soak/app.py``: topic ``soak.events``; subscriptions ``soak.none``,
   ``soak.exclusive``, ``soak.ordered`` on one handler that sleeps 0–200 ms and raises
   ``TransientWorkError`` 2 % of the time) and creates two API keys: ``workqueue:publish`` for the
   producers, ``workqueue:read`` + ``workqueue:operate`` for the cancels.
2. Starts the app under uvicorn with its host on (the REST API the producers use) and
   ``--workers`` ``workqueue work`` processes per subscription.
3. Runs ``--keys`` producers (500), one per partition key, that publish ``--messages`` messages
   spread over ``--duration`` seconds through ``POST /work-queue/topics/soak.events/messages``
   with ``WorkQueueApiPublisher``, each awaiting the acceptance of its message before the next
   (retrying with the same MessageID until it is accepted).
4. Meanwhile: SIGKILLs a worker process ``--kills`` times (a ``workqueue work`` process, the app,
   another one …) and restarts it; cancels ``--cancels`` InFlight deliveries through
   ``POST …/deliveries/{id}/discard``; restarts the private cluster once (``pg_ctl -D DATA``,
   the cluster it created or ``--pg-data-dir``; never a server it was not given), unless
   ``--no-pg-restart``. Every 100 ms a checker asks the database for two InFlight
   deliveries of one Exclusive or Ordered key, an Ordered delivery InFlight behind a live earlier
   one of its key, and an InFlight delivery whose lease ran out long ago.
5. Waits until no delivery is Pending or InFlight, stops the processes with SIGTERM, checks the
   invariants (listed in :func:`analyse`), prints a text report, writes the JSON report
   (``--report``, by default ``report.json`` in the log folder) and exits 1 on any violation
   (2 when the run could not be set up).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import httpx

from fastapi_workqueue import PublishRequest, PublishStatus, WorkQueue, WorkQueueSettings
from fastapi_workqueue.client import PublishApiError, WorkQueueApiPublisher
from fastapi_workqueue.core.keys import SCOPE_OPERATE, SCOPE_PUBLISH, SCOPE_READ, create_key
from fastapi_workqueue.database.postgres import to_asyncpg_dsn
from fastapi_workqueue.testing.conformance.harness import eventually

from ..private_cluster import ClusterError, private_cluster, restart_command_for, running_port
from . import app as soak_app

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATABASE = "workqueue_soak"
"""The database's name on the private cluster the run creates when it is given no ``--database-url``."""
TOPIC = soak_app.TOPIC
NONE, EXCLUSIVE, ORDERED = soak_app.NONE, soak_app.EXCLUSIVE, soak_app.ORDERED
SUBSCRIPTIONS = soak_app.SUBSCRIPTIONS
TERMINAL = ("Completed", "DeadLettered", "Discarded")
CHECK_INTERVAL = 0.1
READY_TIMEOUT = 90.0
STOP_TIMEOUT = 30.0
RESTART_DELAY = 1.0
CANCEL_WINDOW = 60.0
PRODUCERS_PER_CLIENT = 20
RETRYABLE_PUBLISH = {0, 429, 500, 502, 503, 504}
KILL_SLOTS = (0.15, 0.35, 0.75, 0.25, 0.85, 0.45, 0.65, 0.9, 0.1, 0.3)
"""Moments of the kills, as fractions of the publish phase (the first ``--kills`` of them, sorted)."""
KILL_ORDER = ("work-ordered-1", "app", "work-exclusive-1", "work-none-1")
"""Whom the kills hit, in turn."""


class SetupError(Exception):
    """The run could not be set up (exit code 2)."""


# -- options ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.soak.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=50_000, help="messages to publish (default 50000)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of the publish phase (default 600)")
    parser.add_argument("--workers", type=int, default=1,
                        help="`workqueue work` processes per subscription, besides the app (default 1)")
    parser.add_argument("--keys", type=int, default=500, help="partition keys, one producer each (default 500)")
    parser.add_argument("--concurrency", type=int, default=12,
                        help="handlers per subscription per process (default 12)")
    parser.add_argument("--database-url", default=None,
                        help="the database to create, use and drop (default: workqueue_soak on a private cluster "
                        "the run creates in a temp folder and removes at the end); dropped and recreated at the "
                        "start. A database on another server needs --pg-data-dir, --pg-restart-command or "
                        "--no-pg-restart")
    parser.add_argument("--keep-database", action="store_true",
                        help="keep the database at the end (a private cluster the run created goes anyway)")
    parser.add_argument("--report", type=Path, default=None,
                        help="where to write the JSON report (default: report.json in the log folder); "
                        "the text report goes next to it (.txt)")
    parser.add_argument("--log-dir", type=Path, default=None, help="the processes' logs (default: a new temp folder)")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILL + restart of a worker process (default 3)")
    parser.add_argument("--cancels", type=int, default=10, help="InFlight deliveries to cancel (default 10)")
    parser.add_argument("--no-pg-restart", action="store_true", help="do not restart PostgreSQL")
    parser.add_argument("--pg-data-dir", type=Path, default=None,
                        help="the data folder of the private cluster that --database-url is on (the run restarts "
                        "it with pg_ctl as the folder's owner; its port must be the URL's)")
    parser.add_argument("--pg-restart-command", default=None,
                        help="how to restart PostgreSQL (default: pg_ctl -D DATA -m fast restart of the private "
                        "cluster: the one the run creates, or --pg-data-dir)")
    parser.add_argument("--pg-restart-at", type=float, default=0.55,
                        help="when to restart PostgreSQL, as a fraction of the publish phase (default 0.55)")
    parser.add_argument("--lease-seconds", type=float, default=5.0, help="lease of the subscriptions (default 5)")
    parser.add_argument("--fail-rate", type=float, default=0.02, help="share of runs that fail (default 0.02)")
    parser.add_argument("--max-sleep-ms", type=int, default=200, help="handlers sleep 0..this (default 200)")
    parser.add_argument("--drain-timeout", type=float, default=300.0,
                        help="how long to wait for every delivery to end after publishing (default 300)")
    parser.add_argument("--recovery-slack", type=float, default=5.0,
                        help="seconds allowed beyond lease + sweeper interval for a killed worker's deliveries "
                        "to leave InFlight, and for an expired lease to be taken back (default 5)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the producers' jitter and the chaos choices")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.duration <= 0 or args.workers < 1 or args.keys < 1 or args.concurrency < 1:
        parser.error("--messages, --duration, --workers, --keys and --concurrency must be positive")
    if not 0 < args.pg_restart_at < 1:
        parser.error("--pg-restart-at is a fraction of the publish phase, between 0 and 1")
    if args.pg_data_dir is not None and args.database_url is None:
        parser.error("--pg-data-dir names the cluster of --database-url: give both, or neither for a private "
                     "cluster of the run's own")
    if args.database_url is not None and not (args.pg_data_dir or args.pg_restart_command or args.no_pg_restart):
        parser.error("the soak run restarts only a PostgreSQL cluster it was given: with --database-url, pass "
                     "--pg-data-dir (the data folder of that private cluster), --pg-restart-command, or "
                     "--no-pg-restart; without --database-url the run creates a private cluster of its own")
    return args


# -- time ------------------------------------------------------------------------------------


class Clock:
    """Seconds since the publish phase began (negative before), and wall-clock stamps."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.wall0 = time.time()

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.wall0 = time.time()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def wall(self, t: float) -> datetime:
        """The wall-clock time of moment ``t`` (comparable with the database's timestamps: same host)."""
        return datetime.fromtimestamp(self.wall0 + t, UTC)

    def at(self, when: datetime) -> float:
        return when.timestamp() - self.wall0

    async def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            await asyncio.sleep(delay)


# -- a database connection that survives a restart of the server -------------------------------


def is_connection_error(exc: BaseException) -> bool:
    """The connection is gone or unusable: open another one.

    ``InternalClientError`` ("cannot switch to state 12; another operation (2) is in progress")
    is asyncpg leaving a connection in a broken protocol state, seen around a server restart and
    under load (an open asyncpg issue); the connection must be replaced.
    """
    if isinstance(exc, OSError | TimeoutError | asyncpg.InterfaceError | asyncpg.exceptions.InternalClientError):
        return True
    code = getattr(exc, "sqlstate", None)
    return isinstance(code, str) and code.startswith(("08", "57P"))


class Db:
    """One asyncpg connection, re-opened whenever it is lost (the server restarts during the run)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()  # an asyncpg connection runs one query at a time
        self.reconnects = 0

    async def _connection(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncpg.connect(self.dsn, timeout=5)
        return self._conn

    async def drop(self) -> None:
        """Forgets the connection; ``terminate`` never waits (``close`` can hang on a pending cancel)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.terminate()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 2)
            if not conn.is_closed():
                conn.terminate()

    async def fetch(
        self, sql: str, *args: Any, within: float = 120.0, query_timeout: float = 60.0
    ) -> list[asyncpg.Record]:
        """Runs a query; reconnects and runs it again while the server is away, for up to ``within`` s."""
        deadline = time.monotonic() + within
        while True:
            try:
                async with self._lock:
                    conn = await self._connection()
                    return list(await conn.fetch(sql, *args, timeout=query_timeout))
            except Exception as exc:
                if not is_connection_error(exc) or time.monotonic() > deadline:
                    raise
                await self.drop()
                self.reconnects += 1
                await asyncio.sleep(0.2)

    async def fetchval(self, sql: str, *args: Any, within: float = 120.0) -> Any:
        rows = await self.fetch(sql, *args, within=within)
        return rows[0][0] if rows else None



def database_name(url: str) -> tuple[str, str]:
    """(admin DSN on the ``postgres`` database, the database's name)."""
    base, _, name = to_asyncpg_dsn(url).rpartition("/")
    return f"{base}/postgres", name.split("?", 1)[0]


async def recreate_database(url: str) -> None:
    admin_dsn, name = database_name(url)
    admin = await asyncpg.connect(admin_dsn)
    try:
        exists = await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if exists and "soak" not in name:
            raise SetupError(f"refusing to drop database {name!r}: the soak run recreates its database; "
                             "use a name that contains 'soak'")
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()


async def drop_database(url: str) -> None:
    admin_dsn, name = database_name(url)
    deadline = time.monotonic() + 60
    while True:
        try:
            admin = await asyncpg.connect(admin_dsn, timeout=5)
            try:
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 "
                    "AND pid <> pg_backend_pid()", name,
                )
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
                return
            finally:
                await admin.close()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)


def url_port(url: str) -> int:
    return urlsplit(to_asyncpg_dsn(url)).port or 5432


def resolve_restart_command(args: argparse.Namespace, url: str) -> list[str] | None:
    """How the run restarts PostgreSQL: ``--pg-restart-command``, else ``pg_ctl`` on the private
    cluster's data folder (``--pg-data-dir``, or the cluster the run created), never anything else.

    The data folder's running server must be the one ``url`` names (its port), so a restart can
    only hit the cluster the run works on.
    """
    if args.no_pg_restart:
        return None
    if args.pg_restart_command:
        return shlex.split(args.pg_restart_command)
    data: Path | None = args.pg_data_dir
    if data is None:
        raise SetupError("no cluster to restart: pass --pg-data-dir, --pg-restart-command or --no-pg-restart")
    port = running_port(data)
    if port is None:
        raise SetupError(f"no PostgreSQL server runs on {data} (no postmaster.pid): --pg-data-dir must be the data "
                         "folder of the running cluster that --database-url is on")
    if port != url_port(url):
        raise SetupError(f"the server on {data} listens on port {port}, but --database-url is on port "
                         f"{url_port(url)}: the run restarts only the cluster it works on")
    try:
        return restart_command_for(data)
    except ClusterError as exc:
        raise SetupError(str(exc)) from exc


# -- processes -------------------------------------------------------------------------------


@dataclass
class Instance:
    """One OS process of a child: started, and how it ended."""

    pid: int
    generation: int
    log: Path
    started: float
    ended: float | None = None
    end: str | None = None  # "killed", "stopped", "exited <code>"


@dataclass
class Child:
    """A worker process we start, kill and restart: the app under uvicorn, or a ``workqueue work``."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_dir: Path
    clock: Clock
    subscription: str | None = None  # None for the app
    proc: subprocess.Popen[bytes] | None = None
    expected_exit: bool = False
    instances: list[Instance] = field(default_factory=list)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def current(self) -> Instance:
        return self.instances[-1]

    def start(self) -> None:
        generation = len(self.instances) + 1
        path = self.log_dir / f"{self.name}.{generation}.log"
        with path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.expected_exit = False
        self.instances.append(Instance(self.proc.pid, generation, path, self.clock.now()))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        path = self.current.log
        return path.read_text(errors="replace") if path.exists() else ""

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def mark_ended(self, how: str) -> None:
        if self.instances and self.current.ended is None:
            self.current.ended = self.clock.now()
            self.current.end = how

    async def wait_exit(self, within: float) -> int | None:
        deadline = time.monotonic() + within
        while self.proc is not None and self.proc.poll() is None:
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)
        return None if self.proc is None else self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.expected_exit = True
            self.proc.kill()


# -- the run ---------------------------------------------------------------------------------


@dataclass
class PublishStats:
    accepted: dict[uuid.UUID, tuple[str, int]] = field(default_factory=dict)
    accepted_at: list[float] = field(default_factory=list)
    duplicate_answers: int = 0
    retried_calls: int = 0
    gave_up: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    http_status: Counter[int] = field(default_factory=Counter)
    http_500: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    finished_at: float | None = None


@dataclass
class CheckerStats:
    polls: int = 0
    failed_polls: int = 0
    longest_gap: float = 0.0
    peak_in_flight: int = 0
    peak_keyed_in_flight: int = 0
    violations: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def violation(self, kind: str, ident: str, t: float, detail: str) -> None:
        key = f"{kind}:{ident}"
        seen = self.violations.get(key)
        if seen is None:
            self.violations[key] = {"kind": kind, "first_seen_s": round(t, 2), "polls": 1, "detail": detail}
        else:
            seen["polls"] += 1


KEY_VIOLATIONS = """
SELECT s.name AS subscription, d.partition_key, count(*) AS n, array_agg(d.id ORDER BY d.id) AS ids
FROM workqueue.delivery d JOIN workqueue.subscription s ON s.id = d.subscription_id
WHERE d.subscription_id = ANY($1::int[]) AND d.status = 'InFlight' AND d.partition_key IS NOT NULL
GROUP BY 1, 2 HAVING count(*) > 1
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

# InFlight deliveries (all, keyed) and those whose lease ran out more than $2 seconds ago.
IN_FLIGHT = """
SELECT count(*) AS n,
       count(*) FILTER (WHERE subscription_id = ANY($1::int[])) AS keyed,
       coalesce(array_agg(id ORDER BY id) FILTER (
           WHERE lease_expires_at < now() - make_interval(secs => $2)), '{}') AS overdue
FROM workqueue.delivery WHERE status = 'InFlight'
"""

# Of the deliveries InFlight now, those whose current claim ran its handler in process $1.
KILL_WAIT_S = 5.0
"""How long a kill waits for its process to hold an InFlight delivery before it kills anyway."""

HELD_BY = """
SELECT DISTINCT d.id, d.claim_count, s.name AS subscription
FROM public.soak_run r
JOIN workqueue.delivery d ON d.id = r.delivery_id AND d.attempt = r.attempt AND d.status = 'InFlight'
JOIN workqueue.subscription s ON s.id = d.subscription_id
WHERE r.pid = $1
"""

# The delivery of a cancel's own message on its subscription, and whether its handler runs now.
HOLD_DELIVERY = """
SELECT d.id, d.status, d.attempt,
       EXISTS (SELECT 1 FROM public.soak_run r
               WHERE r.delivery_id = d.id AND r.attempt = d.attempt AND r.finished_at IS NULL) AS running
FROM workqueue.delivery d JOIN workqueue.subscription s ON s.id = d.subscription_id
WHERE d.message_id = $1 AND s.name = $2
"""

STILL_HELD = """
SELECT count(*) FROM workqueue.delivery d JOIN unnest($1::bigint[], $2::int[]) AS h(id, claims)
ON h.id = d.id WHERE d.status = 'InFlight' AND d.claim_count = h.claims
"""

LIVE = """
SELECT count(*) FILTER (WHERE status = 'Pending') AS pending, count(*) FILTER (WHERE status = 'InFlight') AS in_flight
FROM workqueue.delivery WHERE status IN ('Pending', 'InFlight')
"""

DELIVERIES = """
SELECT d.id, s.name AS subscription, d.message_id, d.partition_key, d.status, d.attempt, d.claim_count,
       d.settled_at, d.reason, d.last_error, d.cancel_requested, d.visible_at, d.lease_expires_at,
       (m.payload::jsonb ->> 'seq')::int AS seq
FROM workqueue.delivery d
JOIN workqueue.subscription s ON s.id = d.subscription_id
JOIN workqueue.message m ON m.id = d.message_id
WHERE s.topic = $1
ORDER BY d.id
"""

MESSAGES = """
SELECT id, partition_key, (payload::jsonb ->> 'seq')::int AS seq, published_at FROM workqueue.message WHERE topic = $1
"""

RUNS = """
SELECT id, delivery_id, message_id, subscription, partition_key, seq, attempt, pid, started_at, finished_at, outcome
FROM public.soak_run ORDER BY id
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def longest_gap(times: Sequence[float], start: float, end: float) -> float:
    """The longest interval within [start, end] that holds none of ``times``."""
    inside = sorted(t for t in times if start <= t <= end)
    edges = [start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(edges))


def r2(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.url: str = args.database_url
        self.dsn = to_asyncpg_dsn(self.url)
        self.log_dir: Path = args.log_dir or Path(tempfile.mkdtemp(prefix="workqueue-soak-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.report_path: Path = args.report or self.log_dir / "report.json"
        self.clock = Clock()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.children: dict[str, Child] = {}
        self.publish = PublishStats()
        self.checker = CheckerStats()
        self.violations: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []
        self.cancels: list[dict[str, Any]] = []
        self.holds: dict[uuid.UUID, tuple[str, int]] = {}  # the cancels' own messages: (key, seq)
        self.restart: dict[str, Any] | None = None
        self.restart_command: list[str] | None = None
        self.tasks: list[asyncio.Task[Any]] = []
        self.db = Db(self.dsn)
        self.sub_ids: dict[str, int] = {}
        self.publish_key = ""
        self.operator_key = ""
        self.stopping = False
        self.timings: dict[str, float | None] = {}
        self.database_created = False

    # -- helpers -------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        entry = {"t_s": round(self.clock.now(), 2), "kind": kind, **fields}
        self.events.append(entry)
        print(f"[{entry['t_s']:8.2f} s] {kind}: " + ", ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
        return entry

    def violation(self, text: str) -> None:
        self.violations.append(text)
        print(f"VIOLATION: {text}", flush=True)

    async def one_more_check(self, within: float = 30.0) -> None:
        """Until the checker has made a whole pass over the final state (two more passes: the one
        under way may have begun before it)."""
        target = self.checker.polls + 2
        try:
            await eventually(lambda: self.checker.polls >= target, within, CHECK_INTERVAL / 2)
        except AssertionError:
            self.violation(f"the checker made no pass over the final state within {within:g} s "
                           f"({self.checker.failed_polls} failed polls)")

    def spawn(self, name: str, subscription: str | None) -> Child:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKQUEUE_", "SOAK_"))}
        args = self.args
        env.update(
            PYTHONUNBUFFERED="1",
            SOAK_LOG_LEVEL="INFO",
            WORKQUEUE_DATABASE_URL=self.url,
            SOAK_LEASE_SECONDS=str(args.lease_seconds),
            SOAK_FAIL_RATE=str(args.fail_rate),
            SOAK_MAX_SLEEP_MS=str(args.max_sleep_ms),
        )
        if subscription is None:
            env.update(
                WORKQUEUE_SUBSCRIPTIONS=json.dumps([{"name": "*", "concurrency": args.concurrency}]),
                WORKQUEUE_POOL_SIZE="8",
            )
            argv = [sys.executable, "-m", "uvicorn", "tests.soak.app:app", "--host", "127.0.0.1",
                    "--port", str(self.port), "--no-access-log", "--log-level", "warning"]
        else:
            env.update(WORKQUEUE_POOL_SIZE="4")
            argv = [sys.executable, "-m", "fastapi_workqueue", "work", "--app", "tests.soak.app:queue",
                    "--subscription", subscription, "--concurrency", str(args.concurrency)]
        child = Child(name, argv, env, self.log_dir, self.clock, subscription)
        self.children[name] = child
        child.start()
        return child

    async def is_ready(self, child: Child, http: httpx.AsyncClient) -> bool:
        if child.subscription is None:
            try:
                response = await http.get(f"{self.base_url}/soak/ready", timeout=2)
            except httpx.HTTPError:
                return False
            return response.status_code == 200 and response.json().get("pid") == child.pid
        return f"{child.subscription}: running (concurrency" in child.log_text()

    async def wait_ready(self, child: Child, within: float = READY_TIMEOUT) -> float | None:
        """Seconds until the child is ready, or None (and a violation) when it never is."""
        started = time.monotonic()
        async with httpx.AsyncClient() as http:
            while True:
                if await self.is_ready(child, http):
                    return time.monotonic() - started
                if not child.alive():
                    self.violation(f"{child.name} (pid {child.pid}) exited before it was ready:\n{child.tail()}")
                    return None
                if time.monotonic() - started > within:
                    self.violation(f"{child.name} (pid {child.pid}) not ready after {within} s:\n{child.tail()}")
                    return None
                await asyncio.sleep(0.1)

    # -- set-up --------------------------------------------------------------------------

    async def setup(self) -> None:
        began = time.monotonic()
        self.restart_command = resolve_restart_command(self.args, self.url)  # before touching any database
        await recreate_database(self.url)
        self.database_created = True
        ops = WorkQueue(
            WorkQueueSettings(database_url=self.url, enabled=False, listen=False, pool_size=2, auto_migrate=True),
            topics=[soak_app.build_topology()[0]],
            subscriptions=soak_app.build_topology()[1],
        )
        await ops.open()  # migrates and declares the topology
        try:
            store: Any = ops.transport
            self.publish_key = (await create_key(store, "soak-producers", [SCOPE_PUBLISH])).key
            self.operator_key = (await create_key(store, "soak-operator", [SCOPE_READ, SCOPE_OPERATE])).key
        finally:
            await ops.close()
        for statement in soak_app.RUN_LOG_DDL.split(";"):
            if statement.strip():
                await self.db.fetch(statement)
        rows = await self.db.fetch("SELECT name, id FROM workqueue.subscription WHERE topic = $1", TOPIC)
        self.sub_ids = {r["name"]: r["id"] for r in rows}
        self.timings["setup_s"] = time.monotonic() - began

    async def start_workers(self) -> None:
        began = time.monotonic()
        children = [self.spawn("app", None)]
        for sub in SUBSCRIPTIONS:
            short = sub.split(".", 1)[1]
            for n in range(1, self.args.workers + 1):
                children.append(self.spawn(f"work-{short}-{n}", sub))
        ready = await asyncio.gather(*(self.wait_ready(c) for c in children))
        if any(r is None for r in ready):
            raise SetupError("the worker processes did not start; see the log folder")
        self.timings["start_workers_s"] = time.monotonic() - began
        for c in children:
            self.event("started", process=c.name, pid=c.pid)

    # -- producers -----------------------------------------------------------------------

    async def produce(self, publisher: WorkQueueApiPublisher, key: str, count: int, give_up_at: float) -> None:
        spacing = self.args.duration / count
        for seq in range(count):
            await self.clock.sleep_until((seq + self.rng.random()) * spacing)
            message_id = uuid.uuid4()
            request = PublishRequest(message_id=message_id, partition_key=key, payload={"key": key, "seq": seq})
            began = time.monotonic()
            while True:
                try:
                    [result] = await publisher.publish(TOPIC, [request])
                except PublishApiError as exc:
                    if exc.status_code in RETRYABLE_PUBLISH and self.clock.now() < give_up_at:
                        self.publish.retried_calls += 1
                        await asyncio.sleep(self.rng.uniform(0.5, 1.0))
                        continue
                    self.publish.gave_up.append(f"{key} seq {seq} ({message_id}): HTTP {exc.status_code} {exc.detail}")
                    return  # the key's later messages would break its order: stop this producer
                if result.status == PublishStatus.ACCEPTED or (
                    result.status == PublishStatus.DUPLICATE and result.message_id == message_id
                ):
                    if result.status == PublishStatus.DUPLICATE:
                        self.publish.duplicate_answers += 1  # an earlier try was stored; its answer was lost
                    self.publish.accepted[message_id] = (key, seq)
                    self.publish.accepted_at.append(self.clock.now())
                    self.publish.latencies.append(time.monotonic() - began)
                    break
                self.publish.unexpected.append(f"{key} seq {seq} ({message_id}): {result.status} {result.error}")
                return

    async def run_producers(self) -> None:
        async def count_status(response: httpx.Response) -> None:
            self.publish.http_status[response.status_code] += 1
            if response.status_code == 500 and len(self.publish.http_500) < 20:
                await response.aread()
                self.publish.http_500.append(f"t={self.clock.now():.2f} s: {response.text[:300]}")

        keys = [f"key-{k:03d}" for k in range(self.args.keys)]
        per_key, extra = divmod(self.args.messages, len(keys))
        counts = [per_key + (1 if i < extra else 0) for i in range(len(keys))]
        give_up_at = self.args.duration + 120.0
        # Producers share small HTTP clients: one pool for all of them costs O(waiting x connections)
        # per request in httpcore and makes the runner, not the queue, the bottleneck.
        width = max(1, PRODUCERS_PER_CLIENT // 4)
        limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
        async with contextlib.AsyncExitStack() as stack:
            jobs: list[Coroutine[Any, Any, None]] = []
            for first in range(0, len(keys), PRODUCERS_PER_CLIENT):
                http = await stack.enter_async_context(httpx.AsyncClient(
                    base_url=self.base_url, timeout=15.0, limits=limits, event_hooks={"response": [count_status]}
                ))
                publisher = WorkQueueApiPublisher(self.base_url, self.publish_key, client=http, retries=3,
                                                  backoff_seconds=0.2)
                group = range(first, min(first + PRODUCERS_PER_CLIENT, len(keys)))
                jobs.extend(self.produce(publisher, keys[i], counts[i], give_up_at) for i in group if counts[i] > 0)
            await asyncio.gather(*jobs)
        self.publish.finished_at = self.clock.now()

    # -- the checker ---------------------------------------------------------------------

    async def check_loop(self, stop: asyncio.Event) -> None:
        db = Db(self.dsn)
        keyed = [self.sub_ids[EXCLUSIVE], self.sub_ids[ORDERED]]
        ordered = self.sub_ids[ORDERED]
        grace = self.sweeper_seconds + self.args.recovery_slack
        last_ok = time.monotonic()
        stats = self.checker
        try:
            while not stop.is_set():
                began = time.monotonic()
                try:
                    t = self.clock.now()
                    for row in await db.fetch(KEY_VIOLATIONS, keyed, within=0, query_timeout=10):
                        stats.violation(
                            "two-in-flight", f"{row['subscription']}/{row['partition_key']}/{row['ids']}", t,
                            f"{row['subscription']} key {row['partition_key']!r}: {row['n']} InFlight deliveries "
                            f"{list(row['ids'])}",
                        )
                    for row in await db.fetch(ORDER_VIOLATIONS, ordered, within=0, query_timeout=10):
                        stats.violation(
                            "ordered-ahead", f"{row['id']}", t,
                            f"{ORDERED} key {row['partition_key']!r}: delivery {row['id']} InFlight while earlier "
                            f"{list(row['earlier'])} are live",
                        )
                    [row] = await db.fetch(IN_FLIGHT, keyed, grace, within=0, query_timeout=10)
                    for delivery_id in row["overdue"]:
                        stats.violation(
                            "lease-overdue", f"{delivery_id}", t,
                            f"delivery {delivery_id} still InFlight more than {grace:.1f} s after its lease ran out",
                        )
                    stats.peak_in_flight = max(stats.peak_in_flight, row["n"])
                    stats.peak_keyed_in_flight = max(stats.peak_keyed_in_flight, row["keyed"])
                    stats.polls += 1
                    stats.longest_gap = max(stats.longest_gap, time.monotonic() - last_ok)
                    last_ok = time.monotonic()
                except Exception as exc:
                    stats.failed_polls += 1
                    if not is_connection_error(exc) and len(stats.errors) < 10:
                        stats.errors.append(f"t={self.clock.now():.2f} s: {exc!r}")
                    await db.drop()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, CHECK_INTERVAL - (time.monotonic() - began)))
        finally:
            await db.close()

    @property
    def sweeper_seconds(self) -> float:
        return float(soak_app.SETTINGS_DEFAULTS["sweeper_interval_ms"]) / 1000

    async def watchdog(self, stop: asyncio.Event) -> None:
        """Restarts a worker process that died on its own (a violation)."""
        while not stop.is_set():
            for child in list(self.children.values()):
                if child.proc is not None and child.proc.poll() is not None and not child.expected_exit:
                    code = child.proc.returncode
                    child.mark_ended(f"exited {code}")
                    self.violation(f"{child.name} (pid {child.pid}) exited by itself with code {code}:\n{child.tail()}")
                    self.event("unexpected-exit", process=child.name, pid=child.pid, code=code)
                    child.start()
                    self.event("restarted", process=child.name, pid=child.pid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    # -- chaos ---------------------------------------------------------------------------

    def schedule(self) -> list[tuple[float, str, Any]]:
        d = self.args.duration
        plan: list[tuple[float, str, Any]] = []
        for i, fraction in enumerate(sorted(KILL_SLOTS[: self.args.kills])):
            plan.append((fraction * d, "kill", KILL_ORDER[i % len(KILL_ORDER)]))
        for i in range(self.args.cancels):
            fraction = 0.2 + 0.7 * (i + 0.5) / max(1, self.args.cancels)
            plan.append((fraction * d, "cancel", SUBSCRIPTIONS[i % len(SUBSCRIPTIONS)]))
        if self.restart_command is not None:
            plan.append((self.args.pg_restart_at * d, "pg-restart", None))
        return sorted(plan, key=lambda p: p[0])

    async def chaos(self) -> None:
        """Kills and the PostgreSQL restart one after the other; the cancels beside them."""

        async def run(kinds: tuple[str, ...]) -> None:
            for at, kind, target in self.schedule():
                if kind not in kinds:
                    continue
                await self.clock.sleep_until(at)
                if kind == "kill":
                    await self.kill_and_restart(target)
                elif kind == "cancel":
                    await self.cancel_one(target, len(self.cancels) + 1)
                else:
                    await self.restart_postgres()

        await asyncio.gather(run(("kill", "pg-restart")), run(("cancel",)))

    async def kill_and_restart(self, name: str) -> None:
        child = self.children.get(name) or next(iter(self.children.values()))
        pid = child.pid
        # A kill is meant to land while the process holds deliveries (what the lease and the sweeper
        # must recover): it waits, for at most KILL_WAIT_S, until the process runs a handler. A fast
        # handler path leaves a worker idle between claims often enough for a kill at a fixed
        # moment to find it holding nothing.
        waited_until = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < waited_until and not await self.db.fetch(HELD_BY, pid):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        child.kill()
        killed_at = self.clock.now()
        code = await child.wait_exit(10)
        child.mark_ended("killed")
        held = await self.db.fetch(HELD_BY, pid)
        entry = self.event("kill", process=child.name, pid=pid, exit=code, held_in_flight=len(held))
        record: dict[str, Any] = {
            "process": child.name, "pid": pid, "t_s": round(killed_at, 2), "held_in_flight": len(held),
            "held_by_subscription": dict(Counter(r["subscription"] for r in held)),
            "recovered_after_s": None, "restarted_pid": None, "ready_after_s": None,
        }
        self.kills.append(record)
        bound = self.args.lease_seconds + self.sweeper_seconds + self.args.recovery_slack
        self.tasks.append(asyncio.create_task(self.track_recovery(record, held, killed_at, bound)))
        await asyncio.sleep(RESTART_DELAY)
        child.start()
        record["restarted_pid"] = child.pid
        ready = await self.wait_ready(child)
        record["ready_after_s"] = r2(ready)
        entry["restarted_pid"] = child.pid
        self.event("restarted", process=child.name, pid=child.pid, ready_after_s=r2(ready))

    async def track_recovery(
        self, record: dict[str, Any], held: list[asyncpg.Record], killed_at: float, bound: float
    ) -> None:
        """Waits until none of the killed worker's deliveries is InFlight under its claim any more."""
        ids = [r["id"] for r in held]
        claims = [r["claim_count"] for r in held]
        while ids:
            try:
                still = int(await self.db.fetchval(STILL_HELD, ids, claims))
            except Exception as exc:
                self.violation(f"cannot follow the deliveries of killed {record['process']}: {exc!r}")
                return
            if still == 0:
                break
            if self.clock.now() - killed_at > max(60.0, 3 * bound):
                self.violation(f"{still} deliveries of killed {record['process']} (pid {record['pid']}) "
                               f"still InFlight {self.clock.now() - killed_at:.1f} s after the kill")
                return
            await asyncio.sleep(0.1)
        after = self.clock.now() - killed_at
        record["recovered_after_s"] = r2(after)
        record["bound_s"] = r2(bound)
        if after > bound:
            self.violation(f"the deliveries of killed {record['process']} (pid {record['pid']}) left InFlight after "
                           f"{after:.1f} s (bound: lease + sweeper interval + slack = {bound:.1f} s)")

    async def cancel_one(self, subscription: str, number: int) -> None:
        """Cancels a running handler with ``POST …/discard``, which must answer CancelRequested.

        The producers' handlers run 0–200 ms, less than the REST call may take on a loaded
        machine, so the target is a message of its own: published through the REST API as the
        producers publish, on a key of its own (``cancel-NN``, outside the producers' keys and
        their order), it asks the handler on ``subscription`` to run until it is aborted (on the
        other subscriptions it is handled as usual). The runner waits until that handler runs,
        then discards its delivery: the heartbeat reports the cancel, the runtime aborts the
        handler with ``Cancelled`` and the delivery becomes Discarded.
        """
        deadline = time.monotonic() + CANCEL_WINDOW
        key = f"cancel-{number:02d}"
        message_id = uuid.uuid4()
        request = PublishRequest(message_id=message_id, partition_key=key,
                                 payload={"key": key, "seq": 0, "hold": subscription})
        operator = {"Authorization": f"Bearer {self.operator_key}"}
        answers: Counter[str] = Counter()
        async with httpx.AsyncClient(base_url=self.base_url, timeout=15.0) as http:
            publisher = WorkQueueApiPublisher(self.base_url, self.publish_key, client=http, retries=3,
                                              backoff_seconds=0.2)
            while True:
                try:
                    [result] = await publisher.publish(TOPIC, [request])
                except PublishApiError as exc:
                    answers[f"publish {exc.status_code}"] += 1
                    if exc.status_code in RETRYABLE_PUBLISH and time.monotonic() < deadline:
                        await asyncio.sleep(0.5)
                        continue
                    self.violation(f"cancel #{number} on {subscription}: its message was not accepted "
                                   f"({dict(answers)})")
                    return
                if not result.ok:
                    self.violation(f"cancel #{number} on {subscription}: its message was refused: {result.error}")
                    return
                break
            self.holds[message_id] = (key, 0)
            rows: list[Any] = []
            while not (rows and rows[0]["status"] == "InFlight" and rows[0]["running"]):
                if time.monotonic() > deadline:
                    self.violation(f"cancel #{number} on {subscription}: its handler did not start within "
                                   f"{CANCEL_WINDOW:g} s (last seen {[dict(r) for r in rows]})")
                    return
                await asyncio.sleep(0.1)
                with contextlib.suppress(Exception):
                    rows = await self.db.fetch(HOLD_DELIVERY, message_id, subscription, within=5)
            delivery_id, attempt = rows[0]["id"], rows[0]["attempt"]
            while True:
                asked_at = self.clock.now()
                try:
                    answer = await http.post(
                        f"/work-queue/subscriptions/{subscription}/deliveries/{delivery_id}/discard",
                        json={"Reason": f"soak: cancel #{number}"}, headers=operator,
                    )
                except httpx.HTTPError as exc:  # the app is restarting (a kill): try again
                    answers[type(exc).__name__] += 1
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.5)
                    continue
                took_ms = round(1000 * (self.clock.now() - asked_at), 1)
                body = answer.json() if answer.headers.get("content-type", "").startswith("application/json") else {}
                result_name = body.get("Result") if isinstance(body, dict) else None
                answers[f"{answer.status_code} {result_name}"] += 1
                if answer.status_code == 503 and time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
                    continue
                if answer.status_code == 200 and result_name == "CancelRequested":
                    self.cancels.append({
                        "number": number, "subscription": subscription, "delivery_id": int(delivery_id),
                        "message_id": str(message_id), "t_s": round(asked_at, 2), "attempt": attempt,
                        "answered_in_ms": took_ms,
                    })
                    self.event("cancel", subscription=subscription, delivery=delivery_id, answered_in_ms=took_ms)
                    return
                break
        self.violation(f"cancel #{number} on {subscription}: the discard of running delivery {delivery_id} did not "
                       f"answer CancelRequested ({dict(answers)})")

    async def restart_postgres(self) -> None:
        assert self.restart_command is not None
        began = self.clock.now()
        self.event("pg-restart-begin", command=" ".join(self.restart_command))
        # Output to a file, not a pipe: a server the command starts would hold a pipe open.
        output = self.log_dir / "pg-restart.log"
        with output.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *self.restart_command, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT
            )
            try:
                await asyncio.wait_for(proc.wait(), 120)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        ended = self.clock.now()
        alive = [c.current.pid for c in self.children.values() if c.alive()]
        self.restart = {
            "t_s": round(began, 2), "command_s": round(ended - began, 2), "exit": proc.returncode,
            "output": output.read_text(errors="replace").strip()[-500:], "began": began, "ended": ended,
            "alive_pids": alive,
        }
        self.event("pg-restart-end", exit=proc.returncode, took_s=round(ended - began, 2))
        if proc.returncode != 0:
            self.violation(f"the PostgreSQL restart failed ({proc.returncode}): {self.restart['output']}")
            return
        await self.db.fetchval("SELECT 1")
        self.restart["database_back_after_s"] = r2(self.clock.now() - began)

    # -- the end -------------------------------------------------------------------------

    async def drain(self) -> dict[str, Any]:
        began = time.monotonic()
        deadline = began + self.args.drain_timeout
        while True:
            row = (await self.db.fetch(LIVE))[0]
            if row["pending"] == 0 and row["in_flight"] == 0:
                return {"drained": True, "drain_s": round(time.monotonic() - began, 2)}
            if time.monotonic() > deadline:
                self.violation(f"{row['pending']} Pending and {row['in_flight']} InFlight deliveries left "
                               f"{self.args.drain_timeout} s after publishing ended")
                return {"drained": False, "drain_s": round(time.monotonic() - began, 2)}
            await asyncio.sleep(0.5)

    async def stop_workers(self) -> dict[str, Any]:
        codes: dict[str, Any] = {}
        for child in self.children.values():
            if child.alive():
                child.expected_exit = True
                assert child.proc is not None
                child.proc.send_signal(signal.SIGTERM)
        for child in self.children.values():
            if child.proc is None:
                continue
            code = await child.wait_exit(STOP_TIMEOUT)
            if code is None:
                child.kill()
                code = await child.wait_exit(10)
                self.violation(f"{child.name} (pid {child.pid}) did not stop within {STOP_TIMEOUT} s of SIGTERM")
            child.mark_ended("stopped")
            codes[child.name] = code
            allowed = (0, -signal.SIGTERM) if child.subscription is None else (0,)
            if code not in allowed:
                self.violation(f"{child.name} (pid {child.pid}) exited {code} on SIGTERM:\n{child.tail()}")
        return codes

    def kill_everything(self) -> None:
        for child in self.children.values():
            child.kill()
            if child.proc is not None:
                with contextlib.suppress(Exception):
                    child.proc.wait(timeout=10)

    async def run(self) -> dict[str, Any]:
        began = time.monotonic()
        stop = asyncio.Event()
        report: dict[str, Any] = {}
        background: list[asyncio.Task[Any]] = []
        try:
            await self.setup()
            await self.start_workers()
            self.clock.start()
            self.event("publish-begin", messages=self.args.messages, keys=self.args.keys,
                       duration_s=self.args.duration)
            checker = asyncio.create_task(self.check_loop(stop))
            watchdog = asyncio.create_task(self.watchdog(stop))
            chaos = asyncio.create_task(self.chaos())
            background = [checker, watchdog, chaos]
            await self.run_producers()
            self.event("publish-end", accepted=len(self.publish.accepted))
            await chaos
            drained = await self.drain()
            self.event("drained", **drained)
            await asyncio.gather(*self.tasks)
            await self.one_more_check()
            stop.set()
            await asyncio.gather(checker, watchdog)
            codes = await self.stop_workers()
            self.event("stopped", **{k: v for k, v in codes.items()})
            finished = self.clock.now()
            report = await self.analyse(drained, codes, finished)
            report["timings"]["total_s"] = round(time.monotonic() - began, 1)
            return report
        finally:
            stop.set()
            for task in [*self.tasks, *background]:
                task.cancel()
            await asyncio.gather(*self.tasks, *background, return_exceptions=True)
            self.kill_everything()
            await self.db.close()
            if self.database_created and not self.args.keep_database:
                await drop_database(self.url)

    # -- the checks ----------------------------------------------------------------------

    async def analyse(self, drained: dict[str, Any], codes: dict[str, Any], finished: float) -> dict[str, Any]:
        """Every check of the run; each failure is a violation.

        - every delivery is Completed, DeadLettered or Discarded (none Pending or stuck InFlight);
        - every Accepted message is stored and has exactly one delivery per subscription;
        - no Exclusive or Ordered key ever had two InFlight deliveries, no Ordered delivery ran
          ahead of a live earlier one of its key, no expired lease stayed InFlight (the checker);
        - Ordered: per key, publish order is delivery order, and Completed deliveries settled in
          that order; the handler's successful runs of a key follow it too;
        - every Completed delivery has at least one successful handler run (at-least-once);
          deliveries with more than one are duplicates, counted and reported;
        - every cancelled delivery ended Discarded, and only those were Discarded;
        - a killed worker's deliveries left InFlight within lease + sweeper interval + slack;
        - every worker process that lived through the PostgreSQL restart completed work after it
          and re-established its LISTEN connection;
        - no producer gave up, no publish answered 500, no worker process died by itself, every
          worker stopped cleanly on SIGTERM.
        """
        db = Db(self.dsn)
        try:
            deliveries = await db.fetch(DELIVERIES, TOPIC)
            messages = await db.fetch(MESSAGES, TOPIC)
            runs = await db.fetch(RUNS)
        finally:
            await db.close()

        by_sub: dict[str, Counter[str]] = {s: Counter() for s in SUBSCRIPTIONS}
        for d in deliveries:
            by_sub[d["subscription"]][d["status"]] += 1
        live = [d for d in deliveries if d["status"] not in TERMINAL]
        for d in live[:20]:
            self.violation(f"delivery {d['id']} of {d['subscription']} ended {d['status']} (attempt {d['attempt']}, "
                           f"visible_at {d['visible_at']}, lease {d['lease_expires_at']}, reason {d['reason']!r}, "
                           f"last error {d['last_error']!r})")
        if len(live) > 20:
            self.violation(f"... and {len(live) - 20} more deliveries not terminal")

        # Every Accepted message reached every subscription, once.
        stored = {m["id"]: m for m in messages}
        per_message: dict[uuid.UUID, Counter[str]] = defaultdict(Counter)
        for d in deliveries:
            per_message[d["message_id"]][d["subscription"]] += 1
        accepted = {**self.publish.accepted, **self.holds}  # the producers' messages and the cancels' own
        lost = [m for m in accepted if m not in stored]
        for m in lost[:20]:
            self.violation(f"Accepted message {m} {accepted[m]} is not stored")
        fan_out_errors = [
            (m, dict(per_message[m])) for m in accepted
            if m in stored and any(per_message[m][s] != 1 for s in SUBSCRIPTIONS)
        ]
        for m, seen in fan_out_errors[:20]:
            self.violation(f"Accepted message {m} has deliveries {seen}, not one per subscription")
        unacknowledged = [m for m in stored if m not in accepted]
        for m, row in stored.items():
            if m in accepted and (row["partition_key"], row["seq"]) != accepted[m]:
                self.violation(f"message {m} is stored with other content than was published")

        # Ordered: delivery order is publish order, completions follow it.
        ordered_keys: dict[str, list[asyncpg.Record]] = defaultdict(list)
        for d in deliveries:
            if d["subscription"] == ORDERED:
                ordered_keys[d["partition_key"]].append(d)
        order_errors = 0
        for key, items in ordered_keys.items():
            seqs = [d["seq"] for d in items]
            if seqs != sorted(seqs) or len(set(seqs)) != len(seqs):
                order_errors += 1
                self.violation(f"{ORDERED} key {key!r}: deliveries are not in publish order: seqs {seqs}")
            done = [d for d in items if d["status"] == "Completed"]
            for a, b in itertools.pairwise(done):
                if not a["settled_at"] < b["settled_at"]:
                    order_errors += 1
                    self.violation(f"{ORDERED} key {key!r}: seq {b['seq']} completed at {b['settled_at']}, "
                                   f"not after seq {a['seq']} ({a['settled_at']})")

        # What the handlers saw.
        runs_by_delivery: dict[int, list[asyncpg.Record]] = defaultdict(list)
        for r in runs:
            runs_by_delivery[r["delivery_id"]].append(r)
        killed_pids = {i.pid for c in self.children.values() for i in c.instances if i.end == "killed"}
        outcomes = Counter(
            (r["outcome"] or ("killed" if r["pid"] in killed_pids else "end-not-recorded")).split(":")[0] for r in runs
        )
        aborted = Counter(r["outcome"].split(":", 1)[1] for r in runs if (r["outcome"] or "").startswith("aborted:"))
        ok_runs_per_completed: Counter[int] = Counter()
        duplicates: list[dict[str, Any]] = []
        duplicates_by_sub: Counter[str] = Counter()
        never_ran = []
        for d in deliveries:
            if d["status"] != "Completed":
                continue
            ok = [r for r in runs_by_delivery.get(d["id"], []) if r["outcome"] == "ok"]
            ok_runs_per_completed[len(ok)] += 1
            if not ok:
                never_ran.append(d)
            elif len(ok) > 1:
                duplicates_by_sub[d["subscription"]] += 1
                if len(duplicates) < 10:
                    duplicates.append({
                        "delivery_id": d["id"], "subscription": d["subscription"], "key": d["partition_key"],
                        "seq": d["seq"], "claims": d["claim_count"],
                        "runs": [{"pid": r["pid"], "attempt": r["attempt"],
                                  "finished_s": r2(self.clock.at(r["finished_at"]))} for r in ok],
                    })
        for d in never_ran[:20]:
            self.violation(f"delivery {d['id']} of {d['subscription']} is Completed without a successful handler run")

        handler_order_errors = 0
        overlaps: list[str] = []
        runs_by_key: dict[tuple[str, str], list[asyncpg.Record]] = defaultdict(list)
        for r in runs:
            if r["subscription"] in (EXCLUSIVE, ORDERED) and r["finished_at"] is not None:
                runs_by_key[(r["subscription"], r["partition_key"])].append(r)
        for (sub, key), items in runs_by_key.items():
            items.sort(key=lambda r: r["started_at"])
            for a, b in itertools.pairwise(items):
                if a["outcome"] in ("ok", "transient") and b["started_at"] < a["finished_at"]:
                    overlaps.append(f"{sub} key {key!r}: run of seq {b['seq']} (pid {b['pid']}) started before "
                                    f"the run of seq {a['seq']} (pid {a['pid']}) ended")
            if sub == ORDERED:
                seqs = [r["seq"] for r in sorted(items, key=lambda r: r["finished_at"]) if r["outcome"] == "ok"]
                collapsed = [s for i, s in enumerate(seqs) if i == 0 or seqs[i - 1] != s]
                if any(b <= a for a, b in itertools.pairwise(collapsed)):
                    handler_order_errors += 1
                    self.violation(f"{ORDERED} key {key!r}: the handler completed seqs in the order {seqs}")

        # Cancels and discards.
        status_of = {d["id"]: d for d in deliveries}
        cancelled_ids = {c["delivery_id"] for c in self.cancels}
        bound = self.args.lease_seconds + self.sweeper_seconds + self.args.recovery_slack
        for c in self.cancels:
            cancelled = status_of.get(c["delivery_id"])
            c["final_status"] = None if cancelled is None else cancelled["status"]
            if cancelled is not None and cancelled["settled_at"] is not None:
                c["discarded_after_s"] = r2(self.clock.at(cancelled["settled_at"]) - c["t_s"])
            c["runs"] = [r["outcome"] for r in runs_by_delivery.get(c["delivery_id"], [])]
            if c["final_status"] != "Discarded":
                self.violation(f"cancelled delivery {c['delivery_id']} of {c['subscription']} ended "
                               f"{c['final_status']}, not Discarded")
            elif c.get("discarded_after_s", 0) > bound:
                self.violation(f"cancelled delivery {c['delivery_id']} of {c['subscription']} became Discarded "
                               f"{c['discarded_after_s']} s after the cancel (bound: lease + sweeper interval + "
                               f"slack = {bound:.1f} s)")
        for d in deliveries:
            if d["status"] == "Discarded" and d["id"] not in cancelled_ids:
                self.violation(f"delivery {d['id']} of {d['subscription']} was Discarded although nobody cancelled it "
                               f"(reason {d['reason']!r})")
        dead_letters = [
            {"delivery_id": d["id"], "subscription": d["subscription"], "attempt": d["attempt"],
             "reason": d["reason"], "last_error": (d["last_error"] or "")[:200]}
            for d in deliveries if d["status"] == "DeadLettered"
        ]

        # The checker's findings.
        for v in self.checker.violations.values():
            self.violation(f"checker ({v['kind']}, first at {v['first_seen_s']} s, seen in {v['polls']} polls): "
                           f"{v['detail']}")
        if self.checker.errors:
            self.violation(f"the checker's queries failed: {self.checker.errors}")
        if self.checker.polls < 10:
            self.violation(f"the checker completed only {self.checker.polls} polls")

        # Producers.
        for text in self.publish.gave_up[:20]:
            self.violation(f"a producer gave up: {text}")
        for text in self.publish.unexpected[:20]:
            self.violation(f"unexpected publish answer: {text}")
        if self.publish.http_status.get(500):
            self.violation(f"the publish endpoint answered 500 {self.publish.http_status[500]} times: "
                           f"{self.publish.http_500[:3]}")
        expected_accepted = self.args.messages
        if len(self.publish.accepted) != expected_accepted and not self.publish.gave_up and not self.publish.unexpected:
            self.violation(f"{len(self.publish.accepted)} messages accepted, {expected_accepted} expected")

        # The PostgreSQL restart: who lived through it, and did they work after it?
        restart_report: dict[str, Any] | None = None
        if self.restart is not None:
            restart_report = {k: v for k, v in self.restart.items() if k not in ("began", "ended", "alive_pids")}
            ended = self.restart["ended"]
            ended_wall = self.clock.wall(ended)
            began = self.restart["began"]
            restart_report["longest_publish_gap_s"] = r2(longest_gap(self.publish.accepted_at, began - 1, ended + 30))
            completions = [self.clock.at(r["finished_at"]) for r in runs
                           if r["outcome"] == "ok" and r["finished_at"] is not None]
            restart_report["longest_completion_gap_s"] = r2(longest_gap(completions, began - 1, ended + 30))
            first_ok: dict[int, datetime] = {}
            for r in runs:
                if r["outcome"] == "ok" and r["finished_at"] is not None and r["finished_at"] > ended_wall:
                    first_ok[r["pid"]] = min(first_ok.get(r["pid"], r["finished_at"]), r["finished_at"])
            survivors = []
            for child in self.children.values():
                for inst in child.instances:
                    if inst.started < self.restart["began"] and (inst.ended is None or inst.ended > ended + 15):
                        resumed = first_ok.get(inst.pid)
                        text = inst.log.read_text(errors="replace") if inst.log.exists() else ""
                        listen = "LISTEN connection re-established" in text
                        survivors.append({
                            "process": child.name, "pid": inst.pid,
                            "first_completion_after_s": r2(None if resumed is None
                                                           else self.clock.at(resumed) - ended),
                            "listen_reestablished": listen,
                        })
                        if resumed is None:
                            self.violation(f"{child.name} (pid {inst.pid}) lived through the PostgreSQL restart but "
                                           "completed no handler run after it")
                        if not listen:
                            self.violation(f"{child.name} (pid {inst.pid}) lived through the PostgreSQL restart but "
                                           "never re-established its LISTEN connection")
            restart_report["processes"] = survivors
        elif not self.args.no_pg_restart:
            self.violation("PostgreSQL was not restarted")

        # Exit codes, kills.
        for kill in self.kills:
            if kill["held_in_flight"] == 0:
                kill["note"] = "the killed process held no InFlight delivery at that moment"

        # Throughput.
        completed = sum(c["Completed"] for c in by_sub.values())
        first_publish = min((m["published_at"] for m in messages), default=None)
        last_settle = max((d["settled_at"] for d in deliveries if d["settled_at"] is not None), default=None)
        span = (last_settle - first_publish).total_seconds() if first_publish and last_settle else None
        latencies = sorted(self.publish.latencies)
        publish_s = self.publish.finished_at or 0.0
        self.timings["publish_s"] = publish_s
        self.timings["drain_s"] = drained.get("drain_s")

        return {
            "ok": not self.violations,
            "violations": self.violations,
            "config": {
                "messages": self.args.messages, "duration_s": self.args.duration, "keys": self.args.keys,
                "workers_per_subscription": self.args.workers, "concurrency": self.args.concurrency,
                "processes": [c.name for c in self.children.values()], "lease_seconds": self.args.lease_seconds,
                "sweeper_interval_s": self.sweeper_seconds, "max_attempts": soak_app.MAX_ATTEMPTS,
                "fail_rate": self.args.fail_rate, "handler_sleep_ms": [0, self.args.max_sleep_ms],
                "kills": self.args.kills, "cancels": self.args.cancels,
                "pg_restart": None if self.restart_command is None else " ".join(self.restart_command),
                "database": database_name(self.url)[1], "log_dir": str(self.log_dir),
                "cpus": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            },
            "timings": {k: r2(v) for k, v in self.timings.items()},
            "throughput": {
                "accepted_per_s": r2(len(self.publish.accepted) / publish_s) if publish_s else None,
                "completed_deliveries": completed,
                "first_publish_to_last_settle_s": r2(span),
                "completed_per_s": r2(completed / span) if span else None,
            },
            "publish": {
                "accepted": len(self.publish.accepted),
                "answered_duplicate_on_retry": self.publish.duplicate_answers,
                "calls_retried_by_producers": self.publish.retried_calls,
                "http_status": {str(k): v for k, v in sorted(self.publish.http_status.items())},
                "latency_ms": {
                    "p50": r2(1000 * statistics.median(latencies)) if latencies else None,
                    "p99": r2(1000 * latencies[int(0.99 * (len(latencies) - 1))]) if latencies else None,
                    "max": r2(1000 * latencies[-1]) if latencies else None,
                },
                "stored_messages": len(messages),
                "cancel_messages": len(self.holds),
                "stored_but_never_acknowledged": len(unacknowledged),
                "gave_up": len(self.publish.gave_up),
            },
            "deliveries": {s: dict(sorted(c.items())) for s, c in by_sub.items()},
            "dead_letters": dead_letters[:20],
            "handler_runs": {
                "total": len(runs),
                "by_outcome": dict(sorted(outcomes.items())),
                "aborted_by_reason": dict(sorted(aborted.items())),
                "ok_runs_per_completed_delivery": {str(k): v for k, v in sorted(ok_runs_per_completed.items())},
                "duplicates": sum(duplicates_by_sub.values()),
                "duplicates_by_subscription": dict(duplicates_by_sub),
                "duplicate_samples": duplicates,
                "overlapping_runs_of_one_key": len(overlaps),
                "overlap_samples": overlaps[:10],
            },
            "ordered": {"keys": len(ordered_keys), "order_violations": order_errors,
                        "handler_order_violations": handler_order_errors},
            "checker": {
                "polls": self.checker.polls, "failed_polls": self.checker.failed_polls,
                "longest_gap_s": r2(self.checker.longest_gap), "peak_in_flight": self.checker.peak_in_flight,
                "peak_keyed_in_flight": self.checker.peak_keyed_in_flight,
                "violations": len(self.checker.violations),
            },
            "chaos": {
                "kills": self.kills, "cancels": self.cancels,
                "pg_restart": restart_report, "events": self.events,
            },
            "exit_codes": codes,
            "finished_s": r2(finished),
        }


# -- the report ------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    """The report for people."""
    c, t, p, h = report["config"], report["timings"], report["publish"], report["handler_runs"]
    lines = [
        f"fastapi-workqueue soak: {'PASS' if report['ok'] else 'FAIL'}",
        f"  {c['messages']} messages, {c['keys']} keys, publish phase {c['duration_s']:g} s; processes "
        f"{', '.join(c['processes'])}; concurrency {c['concurrency']} per subscription per process; "
        f"{c['cpus']} CPUs, load {c['load_average_at_end']}",
        f"  timings: setup {t.get('setup_s')} s, start {t.get('start_workers_s')} s, publish {t.get('publish_s')} s, "
        f"drain {t.get('drain_s')} s, total {t.get('total_s')} s",
        f"  throughput: {report['throughput']['accepted_per_s']} accepted/s; "
        f"{report['throughput']['completed_deliveries']} deliveries completed at "
        f"{report['throughput']['completed_per_s']}/s (first publish to last settle "
        f"{report['throughput']['first_publish_to_last_settle_s']} s)",
        f"  publish: {p['accepted']} accepted ({p['answered_duplicate_on_retry']} answered Duplicate on a retry), "
        f"{p['calls_retried_by_producers']} calls retried, HTTP {p['http_status']}, latency p50 "
        f"{p['latency_ms']['p50']} ms p99 {p['latency_ms']['p99']} ms max {p['latency_ms']['max']} ms; "
        f"stored {p['stored_messages']} (the cancels' own {p['cancel_messages']}), "
        f"never acknowledged {p['stored_but_never_acknowledged']}",
        "  deliveries: " + "; ".join(f"{s} {d}" for s, d in report["deliveries"].items()),
        f"  handler runs: {h['total']} {h['by_outcome']}, aborted {h['aborted_by_reason']}; ok runs per Completed "
        f"delivery {h['ok_runs_per_completed_delivery']}; duplicates {h['duplicates']} "
        f"{h['duplicates_by_subscription']}; overlapping runs of one key {h['overlapping_runs_of_one_key']}",
        f"  ordered: {report['ordered']}",
        f"  checker: {report['checker']}",
    ]
    for kill in report["chaos"]["kills"]:
        lines.append(f"  kill {kill['process']} (pid {kill['pid']}) at {kill['t_s']} s: held {kill['held_in_flight']} "
                     f"{kill['held_by_subscription']}, back out of InFlight after {kill['recovered_after_s']} s, "
                     f"restarted as {kill['restarted_pid']}, ready after {kill['ready_after_s']} s")
    cancels = report["chaos"]["cancels"]
    lines.append(f"  cancels: {len(cancels)}: " + ", ".join(
        f"{x['subscription']}#{x['delivery_id']}→{x.get('final_status')}"
        f"({x.get('discarded_after_s')} s, handler {'/'.join(str(r) for r in x.get('runs') or ['?'])})"
        for x in cancels))
    restart = report["chaos"]["pg_restart"]
    if restart is not None:
        lines.append(f"  PostgreSQL restart at {restart['t_s']} s: took {restart['command_s']} s, database back after "
                     f"{restart.get('database_back_after_s')} s; around it the longest time without an accepted "
                     f"publish was {restart.get('longest_publish_gap_s')} s, without a completed handler run "
                     f"{restart.get('longest_completion_gap_s')} s")
        for proc in restart.get("processes", []):
            lines.append(f"    {proc['process']} (pid {proc['pid']}): first completion "
                         f"{proc['first_completion_after_s']} s after, LISTEN re-established "
                         f"{proc['listen_reestablished']}")
    lines.append(f"  exit codes: {report['exit_codes']}")
    if report["violations"]:
        lines.append(f"  VIOLATIONS ({len(report['violations'])}):")
        lines.extend(f"    - {v}" for v in report["violations"][:50])
    else:
        lines.append("  violations: none")
    lines.append(f"  logs: {c['log_dir']}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    soak = Soak(args)
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    print(f"soak: database {database_name(soak.url)[1]}, logs in {soak.log_dir}", flush=True)
    try:
        report = await soak.run()
    except SetupError:
        raise
    except Exception as exc:
        # The runner itself failed: still a report, so whoever runs it sees why.
        traceback.print_exc()
        report = {"ok": False, "violations": [*soak.violations, f"the soak runner failed: {exc!r}"],
                  "chaos": {"events": soak.events, "kills": soak.kills, "cancels": soak.cancels}}
        soak.report_path.parent.mkdir(parents=True, exist_ok=True)
        soak.report_path.write_text(json.dumps(report, indent=2, default=str))
        print(f"report: {soak.report_path}", flush=True)
        return 1
    soak.report_path.parent.mkdir(parents=True, exist_ok=True)
    soak.report_path.write_text(json.dumps(report, indent=2, default=str))
    text = render(report)
    soak.report_path.with_suffix(".txt").write_text(text + "\n")
    print(text, flush=True)
    print(f"report: {soak.report_path}", flush=True)
    return 0 if report["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.database_url is None:
            # A cluster of the run's own, removed at the end: the restart reaches nobody else's work.
            try:
                cluster = stack.enter_context(private_cluster())
            except ClusterError as exc:
                print(f"soak: {exc}", file=sys.stderr)
                return 2
            args.database_url = cluster.url(DEFAULT_DATABASE)
            args.pg_data_dir = cluster.data
            print(f"soak: a private PostgreSQL cluster on 127.0.0.1:{cluster.port} in {cluster.root}", flush=True)
        try:
            return asyncio.run(main_async(args))
        except SetupError as exc:
            print(f"soak: {exc}", file=sys.stderr)
            return 2
    raise AssertionError("unreachable")


if __name__ == "__main__":
    sys.exit(main())
