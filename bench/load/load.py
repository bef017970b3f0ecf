#!/usr/bin/env python3
"""The load benchmark of the app's own path: HTTP request → publish in the request → handlers.

    .venv/bin/python bench/load/load.py             # full run: 4 set-ups × 1, 8, 50, 200 clients × 10 s × 3
    .venv/bin/python bench/load/load.py --smoke     # clients 1 and 8 for 2 s, once: well under a minute

Per set-up (``--setups host,worker,baseline,publish``) and round (``--repeats``), it drops and recreates
a database of its own (``--database``, on ``--pg-url``), starts bench/load/load_app.py (the example
app plus ``POST /orders-without-queue``) under uvicorn with 2 workers on a free port (the app
migrates at start), waits for ``/health/extensions``, then drives ``POST /orders`` with
bench/load/load_client.py (a process of its own) at each ``--clients`` level for ``--duration``
seconds, waits for the backlog to drain, reads what PostgreSQL counted, and checks every
accepted order against the database. Set-ups:

- ``host``: the app as it is, its host running in each uvicorn worker.
- ``worker``: ``WORKQUEUE_DISABLE_HOST=1`` in the app, and one ``workqueue work --app
  example_app.main:queue --subscription S`` process per subscription (the command runs one
  subscription per process today).
- ``baseline``: the ``host`` app, driven on ``POST /orders-without-queue``: the same order row in
  the same kind of request transaction, without the publish.
- ``publish``: the ``worker`` set-up with both subscriptions paused while the clients run and
  resumed when they stop: the requests publish with nothing consuming (what publishing costs
  against ``baseline``), and the workers drain the backlog afterwards.

It writes every figure to ``--output`` (JSON), renders ``--chart`` (PNG, through the chart venv
that bench/compare/run.py uses) and prints Markdown tables with the targets, met or not. See the "Load:
the app's own path" section of bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
from load_cpu import CpuMark, CpuSampler
from load_cpu import diff as cpu_diff
from load_probes import (
    SUBSCRIPTIONS,
    ActivitySampler,
    ActivityTally,
    Counters,
    NotifyCounter,
    recreate_database,
    server_dsn,
    server_facts,
)
from load_report import (
    CORE_PROCESSING_RATE,
    delta,
    end_to_end,
    request_figures,
    summarize_level,
    tables,
    targets,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the repository
DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432"
APP_WORKERS = 2
APP_MODULE = "load_app:app"  # bench/load/load_app.py, with --app-dir bench/load
WORKER_APP = "example_app.main:queue"
VERSIONS = ("fastapi-workqueue", "fastapi", "starlette", "uvicorn", "h11", "httptools", "uvloop", "aiohttp", "httpx",
            "sqlalchemy", "asyncpg", "pydantic")


@dataclass(frozen=True)
class Setup:
    name: str
    path: str
    app_env: dict[str, str]
    worker_subscriptions: tuple[str, ...]
    published: bool
    description: str
    database_settings: tuple[tuple[str, str], ...] = ()
    diagnostic: bool = False
    held_while_loaded: bool = False
    """The subscriptions are paused while the clients run and resumed when they stop: the requests
    publish with nothing consuming (what publishing alone costs), and the backlog drains after."""

    @property
    def listeners(self) -> int:
        """Processes that LISTEN for wake-ups: those that run a host or a worker (none without LISTEN)."""
        if self.app_env.get("WORKQUEUE_LISTEN") == "false":
            return 0
        return len(self.worker_subscriptions) if self.worker_subscriptions else APP_WORKERS


SETUPS = {
    "host": Setup("host", "/orders", {}, (), True,
                  f"the example app as it is: POST /orders, the host runs in each of the {APP_WORKERS} uvicorn "
                  "workers (both subscriptions, concurrency 4 each)"),
    "worker": Setup("worker", "/orders", {"WORKQUEUE_DISABLE_HOST": "1"}, ("orders.email", "orders.audit"), True,
                    "POST /orders with WORKQUEUE_DISABLE_HOST=1 in the app; one `workqueue work --app "
                    f"{WORKER_APP} --subscription S` process per subscription (concurrency 4), as the command "
                    "runs one subscription per process today"),
    "baseline": Setup("baseline", "/orders-without-queue", {}, (), False,
                      "the host set-up's app driven on POST /orders-without-queue: the same order row in the same "
                      "kind of request transaction (queue.session), no publish"),
    "publish": Setup("publish", "/orders", {"WORKQUEUE_DISABLE_HOST": "1"}, ("orders.email", "orders.audit"), True,
                     "POST /orders with WORKQUEUE_DISABLE_HOST=1 and both subscriptions paused while the clients "
                     "run (nothing consumes: what publishing costs the request), resumed when they stop so the "
                     "worker set-up's processes drain the backlog", held_while_loaded=True),
    # Diagnostic variants of ``host``, each with one cause of the collapse taken away; not in
    # the default --setups and not part of the targets.
    "host-poll": Setup("host-poll", "/orders", {"WORKQUEUE_LISTEN": "false"}, (), True,
                       "diagnostic: the host set-up with WORKQUEUE_LISTEN=false, so no NOTIFY wakes a consumer "
                       "(they poll: 250 ms, doubling to 5 s while idle)", diagnostic=True),
    "host-no-yield": Setup("host-no-yield", "/orders", {"WORKQUEUE_BUSY_REQUESTS": "0"}, (), True,
                           "diagnostic: the host set-up with WORKQUEUE_BUSY_REQUESTS=0, so the consumers claim at "
                           "full concurrency however many requests are in flight", diagnostic=True),
    "host-async-commit": Setup("host-async-commit", "/orders", {}, (), True,
                               "diagnostic: the host set-up with synchronous_commit = off on the database (no "
                               "commit waits for its WAL flush)", (("synchronous_commit", "off"),), diagnostic=True),
}

FULL = {"clients": "1,8,50,200", "duration": 10.0, "repeats": 3, "warmup": 2.0, "settle": 1.5,
        "drain_timeout": 300.0, "activity": "host:8,host:50,worker:50,baseline:50",
        "processing_orders": 2000}
SMOKE = {"clients": "1,8", "duration": 2.0, "repeats": 1, "warmup": 0.0, "settle": 1.1,
         "drain_timeout": 60.0, "activity": "host:8", "processing_orders": 50}


class Log:
    """Prints and appends to the run's log file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        with self.path.open("a") as fh:
            fh.write(text + "\n")


def git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in VERSIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def workqueue_command() -> list[str]:
    script = Path(sys.executable).parent / "workqueue"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fastapi_workqueue"]


class Process:
    """A child process in a session of its own, its output in a log file; stopped by its pid."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log_path: Path, log_file: IO[bytes]) -> None:
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self._log_file = log_file

    @classmethod
    async def start(cls, name: str, cmd: list[str], env: dict[str, str], log_path: Path) -> Process:
        log_file = log_path.open("wb")
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, env=env, stdout=log_file,
                                                    stderr=subprocess.STDOUT, start_new_session=True)
        return cls(name, proc, log_path, log_file)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL to its process group after ``grace`` seconds."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        self._log_file.close()
        return self.proc.returncode


@dataclass
class Context:
    args: argparse.Namespace
    log: Log
    cpu: CpuSampler
    logs_dir: Path
    tallies: dict[str, ActivityTally]
    activity_levels: set[tuple[str, int]]


class Deployment:
    """One set-up running on a fresh database: the app under uvicorn, its workers, the probes."""

    def __init__(self, ctx: Context, setup: Setup, round_no: int) -> None:
        self.ctx = ctx
        self.setup = setup
        self.round_no = round_no
        self.app: Process | None = None
        self.workers: list[Process] = []
        self.url = ""
        self.counters: Counters | None = None
        self._drainer: Counters | None = None
        self.notify = NotifyCounter()
        self.activity = ActivitySampler()
        self.listeners = 0
        self.started_in = 0.0
        self.filled = 0

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        args = self.ctx.args
        env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
        host = server_dsn(args.pg_url, args.database).removeprefix("postgresql://")
        env["WORKQUEUE_DATABASE_URL"] = f"postgresql+asyncpg://{host}"
        env.update(extra)
        return env

    async def __aenter__(self) -> Deployment:
        ctx, setup, args = self.ctx, self.setup, self.ctx.args
        t0 = time.monotonic()
        await recreate_database(args.pg_url, args.database, dict(setup.database_settings))
        # Migrations and tables once, before the two workers start (load_app.py says why).
        prepare = await Process.start("prepare", [sys.executable, str(HERE / "load_app.py")],
                                      self.env({"WORKQUEUE_DISABLE_HOST": "1"}),
                                      ctx.logs_dir / f"{setup.name}-r{self.round_no}-prepare.log")
        if await asyncio.wait_for(prepare.proc.wait(), 120) != 0:
            raise RuntimeError(f"preparing the database failed:\n{prepare.tail()}")
        await prepare.stop()
        self.filled = 0
        if setup.name == "host" and args.processing_orders > 0:
            fill = await Process.start(
                "fill", [sys.executable, str(HERE / "load_app.py"), "--fill", str(args.processing_orders),
                         str(args.customers)],
                self.env({"WORKQUEUE_DISABLE_HOST": "1"}), ctx.logs_dir / f"{setup.name}-r{self.round_no}-fill.log")
            if await asyncio.wait_for(fill.proc.wait(), 300) != 0:
                raise RuntimeError(f"filling the processing backlog failed:\n{fill.tail()}")
            await fill.stop()
            self.filled = args.processing_orders
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        tag = f"{setup.name}-r{self.round_no}"
        self.app = await Process.start(
            "app",
            [sys.executable, "-m", "uvicorn", APP_MODULE, "--app-dir", str(HERE), "--host", "127.0.0.1",
             "--port", str(port), "--workers", str(APP_WORKERS), "--no-access-log", "--log-level", "warning"],
            self.env(setup.app_env), ctx.logs_dir / f"{tag}-app.log")
        ctx.cpu.set_roles({"app": {self.app.pid}})
        await self._wait_healthy()
        for sub in setup.worker_subscriptions:
            self.workers.append(await Process.start(
                f"worker {sub}", [*workqueue_command(), "work", "--app", WORKER_APP, "--subscription", sub],
                self.env({}), ctx.logs_dir / f"{tag}-worker-{sub}.log"))
        ctx.cpu.set_roles({"app": {self.app.pid}, "workers": {w.pid for w in self.workers}})
        self.counters = await Counters.open(args.pg_url, args.database)
        self._drainer = await Counters.open(args.pg_url, args.database)
        await self.notify.open(args.pg_url, args.database)
        await self.activity.open(args.pg_url, args.database)
        await self._wait_listeners()
        self.started_in = time.monotonic() - t0
        ctx.log(f"   {setup.name}: up in {self.started_in:.1f} s at {self.url} (app pid {self.app.pid}"
                + (f", workers {[w.pid for w in self.workers]}" if self.workers else "")
                + f"), {self.listeners} processes listening")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.activity.close()
        await self.notify.close()
        for counters in (self.counters, self._drainer):
            if counters is not None:
                await counters.close()
        for proc in [*self.workers, *([self.app] if self.app else [])]:
            rc = await proc.stop()
            if rc not in (0, -signal.SIGTERM):
                self.ctx.log(f"   !! {proc.name} exited with {rc}; last lines of {proc.log_path}:\n{proc.tail()}")

    @property
    def drainer(self) -> Counters:
        """A second connection to the database, that polls the backlog while the other reads counters."""
        assert self._drainer is not None
        return self._drainer

    async def _wait_healthy(self, limit: float = 120.0) -> None:
        """Waits for /health/extensions to answer 200 five times in a row."""
        assert self.app is not None
        deadline = time.monotonic() + limit
        good = 0
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:
            while good < 5:
                if self.app.proc.returncode is not None:
                    raise RuntimeError(f"the app exited with {self.app.proc.returncode}:\n{self.app.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"/health/extensions did not answer 200 within {limit:.0f} s:\n"
                                       f"{self.app.tail()}")
                try:
                    response = await client.get("/health/extensions")
                    good = good + 1 if response.status_code == 200 else 0
                except httpx.HTTPError:
                    good = 0
                await asyncio.sleep(0.1 if good else 0.25)

    async def _wait_listeners(self, limit: float = 60.0) -> None:
        """Waits until every process that consumes has its LISTEN connection open."""
        assert self.counters is not None
        deadline = time.monotonic() + limit
        while True:
            for w in self.workers:
                if w.proc.returncode is not None:
                    raise RuntimeError(f"{w.name} exited with {w.proc.returncode}:\n{w.tail()}")
            self.listeners = await self.counters.listeners([self.notify.backend_pid])
            if self.listeners >= self.setup.listeners or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.2)


# -- one level -----------------------------------------------------------------------------------


async def run_client(dep: Deployment, clients: int, duration: float, seed: int, out: Path,
                     on_go: Any = None, on_end: Any = None, on_done: Any = None) -> dict[str, Any]:
    """Runs bench/load/load_client.py with the handshake; calls the hooks at GO, END and DONE."""
    args = dep.ctx.args
    cmd = [sys.executable, str(HERE / "load_client.py"), "--url", dep.url, "--path", dep.setup.path,
           "--clients", str(clients), "--duration", str(duration), "--request-timeout", str(args.request_timeout),
           "--customers", str(args.customers), "--seed", str(seed), "--output", str(out), "--handshake",
           "--library", args.client_library]
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None
    dep.ctx.cpu.set_roles({"app": {dep.app.pid} if dep.app else set(), "workers": {w.pid for w in dep.workers},
                           "client": {proc.pid}})
    limit = duration + args.request_timeout + 60
    try:
        async def expect(word: str) -> None:
            line = await asyncio.wait_for(proc.stdout.readline(), limit)  # type: ignore[union-attr]
            if line.decode().strip() != word:
                raise RuntimeError(f"load client: expected {word}, got {line!r} (exit {proc.returncode})")

        await expect("READY")
        if on_go:
            await on_go()
        proc.stdin.write(b"GO\n")
        await proc.stdin.drain()
        await expect("END")
        if on_end:
            await on_end()
        await expect("DONE")
        if on_done:
            await on_done()
        rc = await asyncio.wait_for(proc.wait(), 60)
        if rc != 0:
            raise RuntimeError(f"load client exited with {rc}")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return await asyncio.to_thread(take_json, out, args.keep_client_records)


def take_json(path: Path, keep: bool = False) -> dict[str, Any]:
    """Reads the client's JSON and removes the file (unless ``keep``)."""
    result: dict[str, Any] = json.loads(path.read_text())
    if not keep:
        path.unlink()
    return result


def cpu_per_delivery(cpu: dict[str, Any], deliveries: int) -> dict[str, float] | None:
    """CPU-ms per delivery of the app's processes and of PostgreSQL's backends over a drain."""
    if not deliveries:
        return None
    seconds = cpu.get("seconds", {})
    return {role: round(1000 * seconds.get(role, 0.0) / deliveries, 3) for role in ("app", "workers", "pg_backends")}


STEADY_SKIP = 0.1
"""The share of a backlog's deliveries settled first that its rate leaves out: the app's start and
cold pools for the pre-filled backlog, the consumers' switch from the busy limit to their full
concurrency for the backlog a load leaves. Both rates are read the same way (``steady_rate``)."""


def steady_rate(times: list[float]) -> tuple[float | None, float, int]:
    """(deliveries/s, seconds measured, deliveries skipped) of a backlog's settle times: the
    deliveries settled after the first ``STEADY_SKIP`` of them, over the time they took, by the
    deliveries' own ``settled_at`` (no poll interval in the figure)."""
    skip = int(len(times) * STEADY_SKIP)
    span = times[-1] - times[skip] if len(times) > skip + 1 else 0.0
    return (round((len(times) - 1 - skip) / span, 1) if span > 0 else None), span, skip


async def measure_processing(dep: Deployment) -> dict[str, Any] | None:
    """The rate at which the host drains the backlog filled before it started, with no HTTP load
    (``steady_rate``: the app's start and its cold pools do not count)."""
    if not dep.filled:
        return None
    args = dep.ctx.args
    before = dep.ctx.cpu.mark()
    drain_s, left = await dep.drainer.drain(args.drain_timeout)
    cpu = cpu_diff(dep.ctx.cpu.mark(), before)
    times = await dep.drainer.settle_times()
    rate, span, skip = steady_rate(times)
    result = {"orders": dep.filled, "deliveries": len(times), "left": left, "rate": rate,
              "seconds_measured": round(span, 3), "skipped_first": skip,
              "drained_seconds_since_up": None if drain_s is None else round(drain_s, 3),
              "cpu": cpu, "cpu_ms_per_delivery": cpu_per_delivery(cpu, len(times))}
    dep.ctx.log(f"       host processing of {dep.filled} pre-filled orders, no HTTP load: {rate} deliveries/s "
                f"({len(times) - 1 - skip} deliveries in {span:.2f} s after the first {skip}); CPU-ms per delivery "
                f"{result['cpu_ms_per_delivery']}")
    return result


async def warm_up(dep: Deployment, seconds: float) -> None:
    """A short untimed load (8 clients), then the drain: pools and caches warm before the levels."""
    assert dep.counters is not None
    await run_client(dep, 8, seconds, 0, dep.ctx.logs_dir / "warmup.json")
    await dep.counters.drain(dep.ctx.args.drain_timeout)


async def run_level(dep: Deployment, clients: int, seed: int) -> dict[str, Any]:
    """One level: the load, the backlog's drain, the counters, the checks; every figure of the run."""
    ctx, setup, counters = dep.ctx, dep.setup, dep.counters
    assert counters is not None
    marks: dict[str, CpuMark] = {}
    snaps: dict[str, dict[str, Any]] = {}
    wall: dict[str, float] = {}
    backlog: dict[str, int] = {}
    notifies: dict[str, int] = {}
    drain: dict[str, asyncio.Task[tuple[float | None, int]]] = {}
    sampled = (setup.name, clients) in ctx.activity_levels
    key = f"{setup.name}, {clients} clients"
    orders_before = await counters.orders_count()
    load_before = loadavg()

    async def hold(status: str) -> None:
        for subscription in setup.worker_subscriptions:
            await counters.conn.execute("SELECT * FROM workqueue.set_subscription_status($1, $2)", subscription,
                                        status)

    if setup.held_while_loaded:
        await hold("Paused")

    async def go() -> None:
        snaps["go"] = await counters.snapshot()
        notifies["go"] = dep.notify.count
        marks["go"] = ctx.cpu.mark()
        wall["go"] = time.time()
        if sampled:
            dep.activity.start(ctx.tallies.setdefault(key, ActivityTally()))

    async def end() -> None:
        wall["end"] = time.time()
        await dep.activity.stop()
        backlog["end"] = await counters.backlog()
        if setup.held_while_loaded:
            await hold("Active")

    async def done() -> None:
        marks["done"] = ctx.cpu.mark()
        wall["done"] = time.time()
        backlog["done"] = await counters.backlog()
        wall["done_db"] = await counters.db_epoch()
        # The drain is timed from this reading, polled on a connection of its own meanwhile.
        drain["task"] = asyncio.create_task(dep.drainer.drain(ctx.args.drain_timeout, since=time.monotonic()))
        snaps["done"] = await counters.snapshot()

    out = ctx.logs_dir / f"client-{setup.name}-{clients}-r{dep.round_no}.json"
    client = await run_client(dep, clients, ctx.args.duration, seed, out, go, end, done)
    drain_s, left = await drain["task"]
    marks["drained"] = ctx.cpu.mark()
    drain_rate, drain_span, _ = steady_rate(await counters.settle_times(wall["done_db"]))
    await asyncio.sleep(ctx.args.settle)  # the backends flush their function counters at most once a second
    snaps["after"] = await counters.snapshot()
    notifies["after"] = dep.notify.count

    figures = request_figures(client)
    accepted = [(r[3], r[4]) for r in client["records"] if r[2] == "201" and r[3] is not None and r[4] is not None]
    check = await counters.check_level(accepted, setup.published)
    orders_after = await counters.orders_count()
    calls = delta(snaps["after"]["calls"], snaps["go"]["calls"])
    load_window = wall["done"] - wall["go"]
    db_load = delta(snaps["done"]["db"], snaps["go"]["db"])
    wal_load = delta(snaps["done"]["wal"], snaps["go"]["wal"])
    run: dict[str, Any] = {
        "setup": setup.name, "clients": clients, "round": dep.round_no, "seed": seed,
        **figures,
        "client_cpu_seconds": round(client["cpu_seconds"], 2),
        "client_cpu_share": round(client["cpu_seconds"] / load_window, 3),
        "client_loop": client["loop"],
        "load_window_s": round(load_window, 3),
        "tail_after_end_s": round(wall["done"] - wall["end"], 3),
        "backlog_at_end": backlog["end"],
        "backlog_at_stop": backlog["done"],
        "drained": left == 0,
        "backlog_left_after_drain_timeout": left,
        "drain_seconds": None if drain_s is None else round(drain_s, 3),
        # Read as the processing rate is (steady_rate), so the drain target compares like with like.
        "drain_rate": drain_rate if backlog["done"] else None,
        "drain_seconds_measured": round(drain_span, 3),
        "drain_rate_wall": round(backlog["done"] / drain_s, 1) if drain_s and backlog["done"] else None,
        "calls": {k: v for k, v in sorted(calls.items()) if v},
        # Time inside each routine (total, nested calls included), milliseconds per accepted order.
        "function_ms_per_order": {
            k: round((snaps["after"]["function_ms"].get(k, 0.0) - snaps["go"]["function_ms"].get(k, 0.0))
                     / max(len(accepted), 1), 3)
            for k in sorted(snaps["after"]["function_ms"]) if calls.get(k)},
        "commits_per_s": round(db_load.get("xact_commit", 0) / load_window, 1),
        "rollbacks": db_load.get("xact_rollback", 0),
        "sessions_opened": db_load.get("sessions", 0),
        "server_wal_during_load": {**wal_load, "note": "pg_stat_wal is the whole server's, other databases too"},
        "cpu_load": cpu_diff(marks["done"], marks["go"]),
        "cpu_drain": cpu_diff(marks["drained"], marks["done"]),
        "cpu_drain_ms_per_delivery": cpu_per_delivery(cpu_diff(marks["drained"], marks["done"]), backlog["done"]),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "check": check,
        "orders_without_201": orders_after - orders_before - len(accepted),
        "violations": check["violations"] + figures["accepted_without_ids"],
    }
    if setup.published:
        mids = [m for _, m in accepted]
        run.update(end_to_end(client, await counters.settled_at(mids)))
        claims = calls.get("claim", 0)
        completed = check["deliveries"] - check["deliveries_not_completed"]
        with_work = await counters.claims_with_work(mids)
        publishes = calls.get("publish", 0) + calls.get("publish_one", 0)
        run.update({
            "publish_calls": publishes,
            "deliveries_completed": completed,
            "claims": claims,
            "claims_with_work": with_work,
            "claims_empty": max(0, claims - with_work),
            "claims_per_delivery": round(claims / completed, 3) if completed else None,
            "empty_claim_share": round(max(0, claims - with_work) / claims, 3) if claims else None,
            "notifies": notifies["after"] - notifies["go"],
            "listeners": dep.listeners,
            "notifies_per_publish": round((notifies["after"] - notifies["go"]) / len(accepted), 3)
            if accepted else None,
            "wakeups_per_publish": round((notifies["after"] - notifies["go"]) * dep.listeners / len(accepted), 3)
            if accepted else None,
        })
    else:
        run["listeners"] = dep.listeners
    cores = run["cpu_load"]["seconds"]
    ctx.log(
        f"   {setup.name:>8} {clients:>3} clients: {run['rps']:7.1f} req/s, p50 {run['latency_p50_ms']} ms, "
        f"p99 {run['latency_p99_ms']} ms, errors {run['errors']} {run['errors_by_kind'] or ''}"
        + (f", e2e p50 {run.get('e2e_p50_ms')} ms, claims/delivery {run.get('claims_per_delivery')}, "
           f"empty {run.get('claims_empty')}/{run.get('claims')}, backlog {run['backlog_at_stop']} drained in "
           f"{run['drain_seconds']} s (CPU-ms per delivery {run['cpu_drain_ms_per_delivery']})"
           if setup.published else "")
        + f"; CPU s app {cores.get('app', 0)}, workers {cores.get('workers', 0)}, pg {cores.get('pg_backends', 0)}, "
        f"client {cores.get('client', 0)}, other {cores.get('other', 0)}; load {run['loadavg_after'][0]}"
        + (f"; !! {run['violations']} violations {check}" if run["violations"] else ""))
    return run


# -- the whole run -------------------------------------------------------------------------------


def parse_levels(text: str, option: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{option} {text!r}: give whole numbers separated by commas, e.g. 1,8,50,200") from None
    if not levels or min(levels) < 1:
        raise SystemExit(f"{option} {text!r}: every level must be at least 1 client")
    return levels


def parse_activity(text: str) -> set[tuple[str, int]]:
    out = set()
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, clients = item.partition(":")
        if not sep or name not in SETUPS or not clients.isdigit():
            raise SystemExit(f"--activity {item!r}: give SETUP:CLIENTS items such as host:8,host:50")
        out.add((name, int(clients)))
    return out


def render_chart(result_path: Path, chart: Path, log: Log) -> None:
    """Renders bench/load/load_chart.py in the chart venv bench/compare/run.py keeps (created when missing)."""
    sys.path.insert(0, str(HERE.parent / "compare"))
    from run import CHART_PIP, DEFAULT_PEERS_DIR, ensure_venv

    python = shutil.which("python3.11") or sys.executable
    try:
        py = ensure_venv(Path(DEFAULT_PEERS_DIR), "chart", CHART_PIP, python, log)  # type: ignore[arg-type]
        subprocess.run([str(py), str(HERE / "load_chart.py"), str(result_path), str(chart)], check=True, timeout=300)
        log(f"chart: {chart}")
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        log(f"!! chart not rendered: {exc}")


async def measure(args: argparse.Namespace, log: Log, logs_dir: Path) -> dict[str, Any]:
    facts = await server_facts(args.pg_url)
    cpu = CpuSampler(args.database, cluster=str(facts.get("cluster_name") or ""))
    cpu.start()
    ctx = Context(args, log, cpu, logs_dir, {}, parse_activity(args.activity))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {str(c): [] for c in args.levels} for s in args.setups}
    started: dict[str, float] = {}
    processing: list[dict[str, Any]] = []
    try:
        for r in range(1, args.repeats + 1):
            shift = (r - 1) % len(args.setups)
            order = args.setups[shift:] + args.setups[:shift]  # who goes first rotates with the rounds
            log(f"== round {r}/{args.repeats}: {', '.join(order)} (load {loadavg()})")
            for name in order:
                setup = SETUPS[name]
                async with Deployment(ctx, setup, r) as dep:
                    started.setdefault(name, dep.started_in)
                    if (measured := await measure_processing(dep)) is not None:
                        processing.append(measured)
                    if args.warmup > 0:
                        await warm_up(dep, args.warmup)
                    for i, clients in enumerate(args.levels):
                        seed = args.seed * 10_000 + r * 100 + i
                        runs[name][str(clients)].append(await run_level(dep, clients, seed))
    finally:
        cpu.stop()
    summary = {s: {c: summarize_level(rs) for c, rs in levels.items() if rs} for s, levels in runs.items()}
    return {"server": facts, "runs": runs, "summary": summary,
            "activity": {k: t.summary() for k, t in ctx.tallies.items()}, "startup_seconds": started,
            "processing": processing}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="clients 1,8 for 2 s, once, no warm-up, no chart")
    ap.add_argument("--setups", default="host,worker,baseline,publish",
                    help="set-ups to run: host,worker,baseline, and the diagnostic host-poll,host-async-commit")
    ap.add_argument("--clients", default=None, help=f"client levels (default {FULL['clients']}; smoke "
                    f"{SMOKE['clients']})")
    ap.add_argument("--duration", type=float, default=None, help="seconds of load per level (default 10; smoke 2)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds over every set-up (default 3; smoke 1)")
    ap.add_argument("--request-timeout", type=float, default=30.0,
                    help="a request slower than this is an error of kind timeout (default 30)")
    ap.add_argument("--customers", type=int, default=1000, help="distinct customers, the partition keys (1000)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds of untimed load at 8 clients after each start (default 2; smoke 0)")
    ap.add_argument("--settle", type=float, default=None,
                    help="seconds to wait after the drain before reading the counters (default 1.5; smoke 1.1)")
    ap.add_argument("--drain-timeout", type=float, default=None,
                    help="longest wait for the backlog to drain (default 300; smoke 60)")
    ap.add_argument("--activity", default=None,
                    help="SETUP:CLIENTS levels whose pg_stat_activity is sampled every 100 ms "
                    f"(default {FULL['activity']}; smoke {SMOKE['activity']})")
    ap.add_argument("--pg-url", default=DEFAULT_PG, help=f"the PostgreSQL server (default {DEFAULT_PG})")
    ap.add_argument("--database", default="bench_load", help="the benchmark's database, dropped and recreated")
    ap.add_argument("--seed", type=int, default=1, help="seed of the clients' random bodies")
    ap.add_argument("--output", default=str(HERE / "results" / "load.json"), help="the JSON with every figure")
    ap.add_argument("--chart", default=None,
                    help="the PNG chart (default bench/load/last-run.png; none with --smoke unless given)")
    ap.add_argument("--no-chart", action="store_true", help="do not render the chart")
    ap.add_argument("--from-json", default=None, metavar="JSON",
                    help="measure nothing: summarize the runs of an earlier JSON again, print, chart, write --output")
    ap.add_argument("--core-rate", type=float, default=CORE_PROCESSING_RATE,
                    help="deliveries/s of the core benchmark at the defaults (bench/README.md); the drain target "
                    "when no processing rate was measured")
    ap.add_argument("--client-library", choices=("aiohttp", "httpx"), default="aiohttp",
                    help="the load client's HTTP library (aiohttp: about a sixth of httpx's CPU per request)")
    ap.add_argument("--keep-client-records", action="store_true",
                    help="keep each level's client JSON (every request's record) in the logs folder")
    ap.add_argument("--processing-orders", type=int, default=None,
                    help="orders stored before the host set-up's app starts, whose drain with no HTTP load is "
                    "the processing rate the drain target compares with (default 2000; smoke 50; 0: none)")
    args = ap.parse_args()
    mode = SMOKE if args.smoke else FULL
    for key, value in mode.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.levels = parse_levels(args.clients, "--clients")
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown or not args.setups:
        ap.error(f"--setups {unknown or args.setups}: choose from {','.join(SETUPS)}")
    if args.duration <= 0 or args.repeats < 1 or args.request_timeout <= 0 or args.customers < 1:
        ap.error("--duration and --request-timeout must be above 0, --repeats and --customers at least 1")
    if not args.database.replace("_", "").isalnum():
        ap.error(f"--database {args.database!r}: use letters, digits and underscores")
    chart = None if args.no_chart else Path(args.chart) if args.chart else None if args.smoke else HERE / "last-run.png"

    output = Path(args.output).resolve()
    if args.from_json:
        earlier = json.loads(Path(args.from_json).read_text())
        report(earlier, output, chart, Log(output.with_suffix(".report.log")), args.core_rate)
        return
    log = Log(output.with_suffix(".log"))
    logs_dir = output.parent / f"{output.stem}-logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    commit = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--", "fastapi_workqueue", "sql", "example_app", "bench"))
    meta: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "commit": commit, "uncommitted_changes": dirty,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "mode": "smoke" if args.smoke else "full",
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                 "loadavg_start": loadavg()},
        "versions": versions(),
    }
    log(f"== load benchmark ({meta['mode']}) at commit {commit}{' (uncommitted changes)' if dirty else ''}, "
        f"{meta['date_utc']} UTC: set-ups {args.setups}, clients {args.levels}, {args.duration:g} s each, "
        f"{args.repeats} repeats; load {loadavg()}")
    if "worker" in args.setups:
        log("   worker set-up: one `workqueue work` process per subscription (orders.email, orders.audit): "
            "the command runs one subscription per process today")
    t0 = time.time()

    async def guarded() -> dict[str, Any]:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)  # stops the children too
        return await measure(args, log, logs_dir)

    measured = asyncio.run(guarded())
    meta["minutes"] = round((time.time() - t0) / 60, 1)
    meta["host"]["loadavg_end"] = loadavg()
    result: dict[str, Any] = {
        "meta": meta,
        "settings": {
            "setups": {s: {"description": SETUPS[s].description, "path": SETUPS[s].path,
                           "app_env": SETUPS[s].app_env, "database_settings": dict(SETUPS[s].database_settings),
                           "worker_subscriptions": list(SETUPS[s].worker_subscriptions),
                           "listening_processes": SETUPS[s].listeners} for s in args.setups},
            "clients": args.levels, "duration_s": args.duration, "repeats": args.repeats,
            "request_timeout_s": args.request_timeout, "customers": args.customers, "warmup_s": args.warmup,
            "settle_s": args.settle, "drain_timeout_s": args.drain_timeout, "activity_levels": args.activity,
            "database": args.database, "pg_url": args.pg_url.rsplit("@", 1)[-1], "seed": args.seed,
            "app": f"uvicorn {APP_MODULE} --app-dir bench/load --workers {APP_WORKERS}", "worker_app": WORKER_APP,
            "subscriptions_per_message": SUBSCRIPTIONS, "core_processing_rate": args.core_rate,
            "processing_orders": args.processing_orders, "client_library": args.client_library,
        },
        **measured,
    }
    result["header_markdown"] = (
        f"Run of {meta['date_utc']} UTC, commit {commit}{' (uncommitted changes)' if dirty else ''}, "
        f"{meta['mode']} mode: clients {args.levels}, {args.duration:g} s per level, medians of {args.repeats} "
        f"[min–max], {meta['minutes']} min; load average {meta['host']['loadavg_start']} at the start, "
        f"{meta['host']['loadavg_end']} at the end (the machine is shared: see the 'other' CPU column).")
    report(result, output, chart, log, args.core_rate)


def report(result: dict[str, Any], output: Path, chart: Path | None, log: Log, core_rate: float) -> None:
    """Summaries, targets and tables from the runs; writes the JSON, prints, renders the chart."""
    meta = result["meta"]
    result["summary"] = {s: {c: summarize_level(rs) for c, rs in levels.items() if rs}
                         for s, levels in result["runs"].items()}
    rates = sorted(p["rate"] for p in result.get("processing", []) if p.get("rate"))
    processing_rate = rates[len(rates) // 2] if rates else None
    result["processing_rate"] = processing_rate
    result["targets"] = targets(result["summary"], core_rate, processing_rate, result["runs"],
                                result.get("processing"))
    result["violations"] = [
        {"setup": r["setup"], "clients": r["clients"], "round": r["round"], "check": r["check"],
         "accepted_without_ids": r["accepted_without_ids"]}
        for levels in result["runs"].values() for rs in levels.values() for r in rs if r["violations"]]
    result["table_markdown"] = tables(result)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2, default=str))
    log("")
    log(result["header_markdown"])
    log("")
    log(result["table_markdown"])
    if result["violations"]:
        log(f"!! {len(result['violations'])} runs with violations (defects): see 'violations' in {output}")
    if chart is not None:
        render_chart(output, chart, log)
    log(f"results: {output} ({meta['minutes']} min)")


if __name__ == "__main__":
    main()
