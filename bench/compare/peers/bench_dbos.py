#!/usr/bin/env python3
"""DBOS Transact 3.4 durable queues on the comparison's cases: publish, processing, latency (and memory).

Run it with the interpreter of a venv holding ``dbos`` (it brings SQLAlchemy 2 and psycopg 3).
``bench/compare/run.py`` creates that venv and runs this script once per round; README.md in this
folder, section 9, describes the method.

Only DBOS's public API is used: ``DBOS(config=...)``, ``DBOS.listen_queues``, ``DBOS.launch`` /
``destroy``, ``@DBOS.workflow`` / ``@DBOS.step``, ``DBOS.register_queue_async``,
``Queue.enqueue_async``. Plain SQL empties the tables between runs, counts the jobs left and
counts the rows DBOS keeps per job.

A job is one workflow enqueued on the queue ``bench``: the no-op ``async def`` workflow
``bench_noop`` (``--fn step`` enqueues the no-op step ``bench_noop_step`` instead, which DBOS
wraps in a one-step workflow and which adds an ``operation_outputs`` row per job).

Cases, each run ``--repeats`` times (median, min and max in the JSON):

* ``enqueue_seq``: ``--jobs`` jobs, one ``await queue.enqueue_async(fn, i)`` each, awaited one
  after another (100 untimed warm-ups first).
* ``enqueue_batch500``: recorded as null: DBOS 3.4 has no call that enqueues many at once.
* ``process_c<N>``: jobs pre-filled (``enqueue_async``, 16 calls in flight), then one worker
  process (this script as ``_worker``, a DBOS application of its own) with the queue registered
  as ``worker_concurrency=N``; jobs/s from the worker's READY until the database shows no
  workflow of the queue ``ENQUEUED``, ``PENDING`` or ``DELAYED``. The queue is polled once per
  ``polling_interval_sec`` (1 s by default) and each poll starts at most N workflows, so this
  case runs ``--c10-jobs`` jobs (1,000 by default) rather than ``--jobs``.
* ``process_default``: ``--jobs`` jobs with the queue's defaults (no concurrency limit, no rate
  limit, polling every second).
* ``latency``: an idle default worker, then ``--lat-count`` jobs published one at a time on a
  ``--lat-spacing`` grid; latency = workflow start - the time taken right before the call.
* ``mem`` (only when asked for): ``--mem-jobs`` jobs run by the default worker; its VmHWM.

The parent is a DBOS application too, listening to no queue (``DBOS.listen_queues([])``), so it
never runs a job. DBOS has no mode that drains a queue and exits: the parent stops the worker by
its PID (SIGTERM, mapped to ``DBOS.destroy()``) once it has seen the queue empty.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import resource
import signal
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DSN = os.environ.get("PEER_DSN", "postgresql://postgres:postgres@127.0.0.1:5432/bench_dbos")
QUEUE = "bench"
APP_NAME = "bench_dbos"
# Fixed so that producer and worker agree: DBOS otherwise derives the version from a hash of the
# registered code, a worker dequeues only its own version's workflows, and rows of an older
# version would be left behind.
APP_VERSION = "bench"
PENDING_STATUSES = ("ENQUEUED", "PENDING", "DELAYED")
# the tables DBOS may write per job, emptied between runs (queues, application_versions and the
# migration table stay)
JOB_TABLES = ("workflow_status", "workflow_input", "workflow_output", "operation_outputs")
RESET_TABLES = (*JOB_TABLES, "notifications", "workflow_events", "workflow_events_history", "streams")

_STATE: dict = {"counter": 0, "fh": None, "fns": None}


# ---------------------------------------------------------------- the job and the application
def functions():
    """The no-op workflow and step, registered once per process before launch."""
    if _STATE["fns"] is not None:
        return _STATE["fns"]
    from dbos import DBOS

    def record(t):
        started = time.time()
        _STATE["counter"] += 1
        fh = _STATE["fh"]
        if fh is not None and t is not None:
            fh.write(f"{t!r} {started!r}\n")

    @DBOS.workflow(name="bench_noop")
    async def noop(i: int, t: float | None = None) -> None:
        record(t)

    @DBOS.step(name="bench_noop_step")
    async def noop_step(i: int, t: float | None = None) -> None:
        record(t)

    _STATE["fns"] = {"workflow": noop, "step": noop_step}
    return _STATE["fns"]


def make_config(dsn, executor_id):
    return {
        "name": APP_NAME,
        "system_database_url": dsn,
        "application_version": APP_VERSION,
        # DBOS tells processes apart by executor_id: worker_concurrency counts per executor, and the
        # recovery at launch takes up only this executor's workflows
        "executor_id": executor_id,
    }


def launch_producer(dsn):
    """DBOS in this (parent) process: it enqueues and never dequeues."""
    from dbos import DBOS

    functions()
    DBOS(config=make_config(dsn, "bench-producer"))
    DBOS.listen_queues([])
    DBOS.launch()  # creates or migrates the system schema too


async def register_queue(worker_concurrency=None, polling_interval=1.0):
    """Stores the queue's configuration, which the worker reads again at every poll."""
    from dbos import DBOS

    return await DBOS.register_queue_async(QUEUE, worker_concurrency=worker_concurrency,
                                           polling_interval_sec=polling_interval, on_conflict="always_update")


# ---------------------------------------------------------------- helpers
def summarize(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def pct(sorted_vals, p):
    """Nearest-rank percentile of a sorted list."""
    if not sorted_vals:
        return None
    return sorted_vals[max(0, math.ceil(p / 100.0 * len(sorted_vals)) - 1)]


def read_proc_status(pid="self"):
    """VmRSS, VmHWM (KiB) and Threads of a process ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:", "Threads:")):
                    key, val = line.split(":", 1)
                    out[key] = int(val.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


async def admin_conn(dsn):
    import psycopg

    return await psycopg.AsyncConnection.connect(dsn, autocommit=True)


async def scalar(conn, sql, params=None):
    cur = await conn.execute(sql, params)
    return (await cur.fetchone())[0]


async def reset(dsn):
    conn = await admin_conn(dsn)
    try:
        await conn.execute("TRUNCATE " + ", ".join(f"dbos.{t}" for t in RESET_TABLES) + " CASCADE")
    finally:
        await conn.close()


async def pending_count(conn):
    return await scalar(conn, "SELECT count(*) FROM dbos.workflow_status WHERE queue_name = %s AND status = ANY(%s)",
                        (QUEUE, list(PENDING_STATUSES)))


async def success_count(conn):
    return await scalar(conn, "SELECT count(*) FROM dbos.workflow_status WHERE queue_name = %s "
                        "AND status = 'SUCCESS'", (QUEUE,))


async def job_rows(conn):
    return {t: await scalar(conn, f"SELECT count(*) FROM dbos.{t}") for t in JOB_TABLES}


# ---------------------------------------------------------------- the worker process
def die_with_parent():
    """Linux: the kernel sends this worker SIGTERM if the benchmark dies first."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def worker_main(args):
    """The child process: one DBOS application that dequeues the queue until SIGTERM."""
    die_with_parent()
    _STATE["fh"] = open(args.latency_file, "a", buffering=1) if args.latency_file else None  # noqa: SIM115
    functions()

    async def main():
        from dbos import DBOS

        DBOS(config=make_config(args.dsn, "bench-worker"))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        print(f"READY {time.time()!r}", flush=True)
        # Launched inside the running loop, so the async workflows run on it. Launch connects,
        # checks the migrations, recovers this executor's PENDING workflows, starts the queue threads.
        DBOS.launch()
        print(f"LAUNCHED {time.time()!r}", flush=True)
        await stop.wait()
        DBOS.destroy()
        print(f"DONE {_STATE['counter']} {time.time()!r}", flush=True)

    asyncio.run(main())
    if _STATE["fh"]:
        _STATE["fh"].close()
    if args.mem:
        st = read_proc_status()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        print(f"MEM {st.get('VmHWM', -1)} {st.get('VmRSS', -1)} {ru.ru_maxrss} {ru.ru_utime + ru.ru_stime!r}",
              flush=True)


async def spawn_worker(dsn, latency_file=None, log_path=None, mem=False):
    """Starts the worker process; returns it with the time it printed READY."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "_worker", "--dsn", dsn]
    if latency_file:
        cmd += ["--latency-file", str(latency_file)]
    if mem:
        cmd += ["--mem"]
    errf = open(log_path, "ab") if log_path else asyncio.subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=errf)
    finally:
        if log_path:
            errf.close()
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
    parts = line.decode().split()
    if not parts or parts[0] != "READY":
        await stop_worker(proc)
        raise RuntimeError(f"the worker did not start: {line!r}")
    return proc, float(parts[1])


async def stop_worker(proc, timeout=20):
    """Stops the worker this script started, by its PID: SIGTERM, then SIGKILL after ``timeout``."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), timeout=timeout)
    except asyncio.TimeoutError:
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()


def parse_worker_output(out):
    handled = t_end = t_launched = mem = None
    for line in out.decode().splitlines():
        parts = line.split()
        if parts and parts[0] == "DONE":
            handled, t_end = int(parts[1]), float(parts[2])
        elif parts and parts[0] == "LAUNCHED":
            t_launched = float(parts[1])
        elif parts and parts[0] == "MEM":
            mem = {"vmhwm_kib": int(parts[1]), "vmrss_end_kib": int(parts[2]), "ru_maxrss_kib": int(parts[3]),
                   "cpu_s": float(parts[4])}
    return handled, t_end, t_launched, mem


# ---------------------------------------------------------------- the cases
async def bench_enqueue_seq(dsn, n, fn):
    await reset(dsn)
    queue = await register_queue()
    for _ in range(100):  # warm-up: the pool, DBOS's threads, the plans
        await queue.enqueue_async(fn, -1)
    t0 = time.perf_counter()
    for i in range(n):
        await queue.enqueue_async(fn, i)
    return n / (time.perf_counter() - t0)


async def prefill(dsn, n, fn, queue, in_flight=16):
    """``n`` jobs through ``Queue.enqueue_async``, ``in_flight`` calls at a time (not timed)."""
    await reset(dsn)
    numbers = iter(range(n))

    async def feeder():
        for i in numbers:
            await queue.enqueue_async(fn, i)

    await asyncio.gather(*(feeder() for _ in range(in_flight)))
    conn = await admin_conn(dsn)
    try:
        await conn.execute("ANALYZE dbos.workflow_status")
    finally:
        await conn.close()


async def bench_process(dsn, n, fn, worker_concurrency, polling_interval, log_path, timeout=300.0, mem=False):
    queue = await register_queue(worker_concurrency, polling_interval)
    t0 = time.time()
    await prefill(dsn, n, fn, queue)
    fill_s = time.time() - t0
    conn = await admin_conn(dsn)
    proc = None
    try:
        proc, t_ready = await spawn_worker(dsn, log_path=log_path, mem=mem)
        st_ready = read_proc_status(proc.pid)
        hwm_sampled = st_ready.get("VmHWM", 0)
        threads_max = st_ready.get("Threads", 0)
        deadline = time.time() + timeout
        t_done = t_first = left_at_first = None
        while time.time() < deadline:
            left = await pending_count(conn)
            if t_first is None and left < n:  # the first poll that sees a finished job (claimed ones are PENDING)
                t_first, left_at_first = time.time(), left
            if left == 0:
                t_done = time.time()
                break
            if proc.returncode is not None:
                raise RuntimeError(f"the worker exited early (rc={proc.returncode})")
            st = read_proc_status(proc.pid)
            hwm_sampled = max(hwm_sampled, st.get("VmHWM", 0))
            threads_max = max(threads_max, st.get("Threads", 0))
            await asyncio.sleep(0.1)
        if t_done is None:
            left = await pending_count(conn)
            raise RuntimeError(f"processing timed out ({left} of {n} still pending)")
        hwm_sampled = max(hwm_sampled, read_proc_status(proc.pid).get("VmHWM", 0))
        await stop_worker(proc)  # no drain mode: DBOS.destroy() once the table shows the work done
        out = await asyncio.wait_for(proc.stdout.read(), timeout=60)
        handled, _, t_launched, mem_out = parse_worker_output(out)
        ok = await success_count(conn)
        res = {
            "jobs": n,
            "jobs_per_s": n / (t_done - t_ready),
            "jobs_per_s_worker_exit": None,  # DBOS has no drain-and-exit mode
            "seconds": t_done - t_ready,
            "launch_s": (t_launched - t_ready) if t_launched else None,
            "first_done_seen_s": (t_first - t_ready) if t_first else None,
            # the rate from the first poll that saw a finished job on: start-up left out, which for
            # DBOS is mostly the first polling interval
            "jobs_per_s_after_first_done": (left_at_first / (t_done - t_first))
            if t_first and t_done > t_first else None,
            "handled": handled,
            "succeeded_in_db": ok,
            "rows_in_db": await job_rows(conn),
            "worker_rc": proc.returncode,
            "worker_threads_max_sampled": threads_max,
            "fill_seconds": fill_s,
        }
        if mem:
            res.update({"rss_at_ready_kib": st_ready.get("VmRSS"), "hwm_at_ready_kib": st_ready.get("VmHWM"),
                        "hwm_sampled_kib": hwm_sampled, "mem": mem_out})
        if ok != n:
            res["warning"] = f"expected {n} SUCCESS workflows, found {ok}"
        return res
    finally:
        if proc is not None:
            await stop_worker(proc)
        await conn.close()


async def bench_latency(dsn, fn, count, spacing, log_path, lat_path, timeout=60.0):
    await reset(dsn)
    queue = await register_queue()  # the library's defaults
    if lat_path.exists():
        lat_path.unlink()
    proc, _ = await spawn_worker(dsn, latency_file=lat_path, log_path=log_path)
    try:
        await asyncio.sleep(2.0)  # the worker goes idle, its queue thread polling
        calls = []
        for _ in range(5):  # warm-up, without t: not measured
            await queue.enqueue_async(fn, -1)
        await asyncio.sleep(1.0)
        start = time.perf_counter()
        for i in range(count):
            delay = start + i * spacing - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            t = time.time()
            await queue.enqueue_async(fn, i, t)
            calls.append(time.time() - t)
        deadline = time.time() + timeout
        lines = []
        while time.time() < deadline:
            lines = lat_path.read_text().splitlines() if lat_path.exists() else []
            if len(lines) >= count:
                break
            await asyncio.sleep(0.1)
        lats = sorted((float(b) - float(a)) * 1000.0 for a, b in (ln.split() for ln in lines))
        calls.sort()
        # not measured: the last workflows record SUCCESS before the worker is stopped
        # (DBOS.destroy() cancels the workflow tasks still running)
        conn = await admin_conn(dsn)
        try:
            settle = time.time() + 10
            while time.time() < settle and await pending_count(conn) > 0:
                await asyncio.sleep(0.1)
        finally:
            await conn.close()
        return {
            "received": len(lats),
            "p50_ms": pct(lats, 50),
            "p99_ms": pct(lats, 99),
            "max_ms": lats[-1] if lats else None,
            "mean_ms": statistics.mean(lats) if lats else None,
            "enqueue_call_p50_ms": pct(calls, 50) * 1000.0,
        }
    finally:
        await stop_worker(proc)


# ---------------------------------------------------------------- driver
async def run_all(args):
    import importlib.metadata

    from dbos import DBOS

    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    # SIGTERM cancels the run, so the finally blocks stop the worker this script started
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    fn = functions()[args.fn]
    launch_producer(args.dsn)
    try:
        conn = await admin_conn(args.dsn)
        server_version = await scalar(conn, "SHOW server_version")
        await conn.close()

        which = set(args.only.split(","))
        raw: dict[str, list] = {}
        conc = args.concurrency
        c10_jobs = args.c10_jobs if args.c10_jobs else args.jobs
        for r in range(args.repeats):
            if "enqueue" in which:
                v = await asyncio.wait_for(bench_enqueue_seq(args.dsn, args.jobs, fn), 900)
                raw.setdefault("enqueue_seq_jobs_per_s", []).append(v)
                print(f"[run {r + 1}] enqueue_seq: {v:.0f} jobs/s", flush=True)
                raw.setdefault("enqueue_batch500_jobs_per_s", []).append(None)  # no batch API in DBOS 3.4
                print(f"[run {r + 1}] enqueue_batch{args.batch}: none (DBOS has no batch API)", flush=True)
            if "process" in which:
                for label, wc, n in ((f"process_c{conc}", conc, c10_jobs), ("process_default", None, args.jobs)):
                    # a worker_concurrency=c worker starts at most c workflows per poll: such a run
                    # gets twice that bound
                    poll_deadline = 300.0
                    if wc:
                        poll_deadline = max(poll_deadline, 2.0 * n * args.polling_interval / wc + 60.0)
                    res = await asyncio.wait_for(
                        bench_process(args.dsn, n, fn, wc, args.polling_interval, log_dir / f"dbos_{label}.log",
                                      timeout=poll_deadline), poll_deadline + 900)
                    raw.setdefault(label, []).append(res)
                    print(f"[run {r + 1}] {label}: {res}", flush=True)
            if "latency" in which:
                res = await asyncio.wait_for(
                    bench_latency(args.dsn, fn, args.lat_count, args.lat_spacing, log_dir / "dbos_latency.log",
                                  out_dir / "dbos_latency_samples.txt"), 300)
                raw.setdefault("latency", []).append(res)
                print(f"[run {r + 1}] latency: {res}", flush=True)
            if "mem" in which:
                res = await asyncio.wait_for(
                    bench_process(args.dsn, args.mem_jobs, fn, None, args.polling_interval, log_dir / "dbos_mem.log",
                                  timeout=1800, mem=True), 3600)
                raw.setdefault("mem", []).append(res)
                print(f"[run {r + 1}] mem: {res}", flush=True)
        await reset(args.dsn)
        await register_queue()  # the queue is left at its defaults
    finally:
        DBOS.destroy()

    summary = {}
    for key, runs in raw.items():
        if key.startswith("enqueue"):
            summary[key] = summarize(runs)
        elif key.startswith("process"):
            summary[key + "_jobs_per_s"] = summarize([x["jobs_per_s"] for x in runs])
        elif key == "latency":
            summary["latency_p50_ms"] = summarize([x["p50_ms"] for x in runs])
            summary["latency_p99_ms"] = summarize([x["p99_ms"] for x in runs])
        elif key == "mem":
            summary["mem_worker_vmhwm_kib"] = summarize([x["mem"]["vmhwm_kib"] if x.get("mem") else None
                                                         for x in runs])
            summary["mem_worker_rss_at_ready_kib"] = summarize([x.get("rss_at_ready_kib") for x in runs])
            summary["mem_drain_jobs_per_s"] = summarize([x["jobs_per_s"] for x in runs])
    versions = {}
    for pkg in ("dbos", "sqlalchemy", "psycopg", "psycopg-binary"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    job = ("bench_noop, an async @DBOS.workflow" if args.fn == "workflow"
           else "bench_noop_step, an async @DBOS.step run as a one-step workflow")
    result = {
        "peer": "dbos",
        "version": versions["dbos"],
        "versions": versions,
        "python": platform.python_version(),
        "postgres": server_version,
        "settings": {
            "jobs": args.jobs,
            "jobs_concurrency_run": c10_jobs,
            "batch": args.batch,
            "enqueue_batch": "none: DBOS 3.4 has no call that enqueues many workflows at once",
            "job_function": f"{args.fn} ({job})",
            "concurrency_run": f"register_queue('{QUEUE}', worker_concurrency={conc}, "
            f"polling_interval_sec={args.polling_interval})",
            "repeats": args.repeats,
            "latency_count": args.lat_count,
            "latency_spacing_s": args.lat_spacing,
            "mem_jobs": args.mem_jobs if "mem" in which else None,
            "worker_defaults": "register_queue's defaults: no global or per-worker concurrency limit, no rate "
            "limit, polling_interval_sec 1.0 (each poll claims every ENQUEUED workflow of the queue); system "
            "database engine pool_size 20, max_overflow 0, pool_pre_ping; executor threads without a cap; "
            "LISTEN/NOTIFY used for notifications and events, not for queues",
            "queue_polling_interval_s": args.polling_interval,
            "drain_mode": "none: the worker is stopped with SIGTERM (DBOS.destroy()) once the poll saw the "
            "queue empty",
            "ready": "READY printed right before DBOS.launch() (which connects, checks the migrations, recovers "
            "and starts the queue threads); launch_s in each run",
            "producer": "a DBOS application in the parent process with listen_queues([]), executor_id "
            "bench-producer; prefill through enqueue_async, 16 calls in flight",
            "worker_event_loop": "asyncio (stdlib; DBOS.launch() inside asyncio.run, so async workflows run on "
            "that loop; database calls run in DBOS's thread pool)",
            "producer_event_loop": "asyncio (stdlib)",
            "uses_listen_notify": False,
        },
        "summary": summary,
        "raw": raw,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("_worker", help="internal: one worker process")
    w.add_argument("--dsn", default=DEFAULT_DSN)
    w.add_argument("--latency-file", default=None)
    w.add_argument("--mem", action="store_true")

    ap.add_argument("--dsn", default=DEFAULT_DSN, help="database ($PEER_DSN)")
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=500,
                    help="accepted like the other peers' scripts; DBOS has no batch API (recorded as none)")
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--c10-jobs", type=int, default=1000,
                    help="jobs of the worker_concurrency run, which starts at most --concurrency workflows "
                    "per poll; 0 = --jobs")
    ap.add_argument("--polling-interval", type=float, default=1.0,
                    help="the queue's polling_interval_sec in the processing runs (library default 1.0; "
                    "latency always runs at the default)")
    ap.add_argument("--fn", choices=["workflow", "step"], default="workflow",
                    help="what is enqueued: the no-op workflow (default) or the no-op step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lat-count", type=int, default=200)
    ap.add_argument("--lat-spacing", type=float, default=0.020)
    ap.add_argument("--mem-jobs", type=int, default=100_000, help="jobs the default worker runs for --only mem")
    ap.add_argument("--only", default="enqueue,process,latency",
                    help="comma list of enqueue,process,latency,mem (mem is not in the default)")
    ap.add_argument("--out", default=str(HERE / "results" / "dbos.json"))
    args = ap.parse_args()
    if args.cmd == "_worker":
        worker_main(args)
    else:
        asyncio.run(run_all(args))


if __name__ == "__main__":
    main()
