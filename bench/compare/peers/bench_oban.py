#!/usr/bin/env python3
"""Oban for Python 0.7 on the comparison's cases: publish, processing, latency (and worker memory).

Run it with the interpreter of a venv holding ``oban`` (Python 3.12 or newer; oban brings
psycopg 3, psycopg-pool, orjson and uvloop). ``bench/compare/run.py`` creates that venv and runs
this script once per round; README.md in this folder, section 8, describes the method.

Only Oban's public API is used: ``Oban``, ``Oban.create_pool``, ``oban.schema.install``,
``@worker``, ``Worker.new``, ``Oban.enqueue`` / ``enqueue_many``, ``Oban(queues=...)``'s
``start()`` / ``stop()``. Plain SQL empties the tables between runs and counts the jobs left.

Cases, each run ``--repeats`` times (median, min and max in the JSON):

* ``enqueue_seq``: ``--jobs`` jobs, one ``await oban.enqueue(Noop.new({...}))`` each, awaited one
  after another (100 untimed warm-ups first).
* ``enqueue_batch500``: the same jobs through ``enqueue_many`` in calls of ``--batch`` (one
  untimed warm-up call).
* ``process_c<N>``: ``--jobs`` jobs pre-filled, then one worker process (this script as
  ``_worker``) running the queue with limit N; jobs/s from the worker's READY until the database
  shows no job ``available``, ``scheduled``, ``executing`` or ``retryable``.
* ``process_default``: the same with the queue's defaults (``queues={"default": {}}``, whose
  limit is 10: for Oban it is the configuration of ``process_c10``, sampled twice).
* ``latency``: an idle default worker, then ``--lat-count`` jobs published one at a time on a
  ``--lat-spacing`` grid; latency = handler start - the time taken right before the call.
* ``mem`` (only when asked for): ``--mem-jobs`` jobs drained by the default worker; its VmHWM.

Oban has no mode that drains a queue and exits, so the parent stops the worker by its PID
(SIGTERM, mapped to ``oban.stop()``) once it has seen the queue empty. The worker is built the
way the ``oban start`` command builds one: uvloop, orjson as psycopg's JSON codec, the pool of
``Oban.create_pool`` (1 to 10 connections); the command's per-job log lines are left out.
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
DEFAULT_DSN = os.environ.get("PEER_DSN", "postgresql://postgres:postgres@127.0.0.1:5432/bench_oban")
QUEUE = "default"
# oban_jobs.worker holds "<module>.<class>" and the worker process resolves it: the name is fixed
# so that it is the same whether this file runs as __main__ or is imported.
WORKER_MODULE, WORKER_CLASS = "bench_oban", "Noop"
PENDING_STATES = ("available", "scheduled", "executing", "retryable")

_STATE: dict = {"counter": 0, "fh": None, "worker": None}


# ---------------------------------------------------------------- the job and the client
def noop_worker():
    """The no-op worker class, declared once per process."""
    if _STATE["worker"] is not None:
        return _STATE["worker"]
    from oban import worker

    class Noop:
        async def process(self, job):
            started = time.time()
            _STATE["counter"] += 1
            fh = _STATE["fh"]
            if fh is not None:
                t = job.args.get("t")
                if t is not None:
                    fh.write(f"{t!r} {started!r}\n")

    Noop.__module__ = WORKER_MODULE
    Noop.__qualname__ = Noop.__name__ = WORKER_CLASS
    _STATE["worker"] = worker(queue=QUEUE)(Noop)
    return _STATE["worker"]


async def make_client(dsn):
    """An Oban instance without queues, as an application holds one to enqueue."""
    from oban import Oban

    pool = await Oban.create_pool(dsn)  # the library's defaults: 1 to 10 connections
    return pool, Oban(pool=pool)


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


async def ensure_schema(dsn):
    """Installs Oban's tables on first use, as ``oban install`` does."""
    conn = await admin_conn(dsn)
    try:
        exists = await scalar(conn, "SELECT to_regclass('oban_jobs') IS NOT NULL")
    finally:
        await conn.close()
    if exists:
        return
    from oban.schema import install

    pool, _ = await make_client(dsn)
    try:
        await install(pool)
    finally:
        await pool.close()
    print("installed the oban schema", flush=True)


async def reset(dsn):
    """Empties the tables Oban's own reset empties."""
    conn = await admin_conn(dsn)
    try:
        await conn.execute("TRUNCATE oban_jobs, oban_leaders, oban_producers RESTART IDENTITY CASCADE")
    finally:
        await conn.close()


async def pending_count(conn):
    return await scalar(conn, "SELECT count(*) FROM oban_jobs WHERE state = ANY(%s::oban_job_state[])",
                        (list(PENDING_STATES),))


async def completed_count(conn):
    return await scalar(conn, "SELECT count(*) FROM oban_jobs WHERE state = 'completed'")


# ---------------------------------------------------------------- the worker process
def die_with_parent():
    """Linux: the kernel sends this worker SIGTERM if the benchmark dies first."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def worker_main(args):
    """The child process: one Oban instance running one queue until SIGTERM."""
    die_with_parent()
    _STATE["fh"] = open(args.latency_file, "a", buffering=1) if args.latency_file else None  # noqa: SIM115
    noop_worker()

    async def main():
        import orjson
        from oban import Oban
        from psycopg.types.json import set_json_dumps, set_json_loads

        set_json_dumps(orjson.dumps)  # as `oban start` sets them
        set_json_loads(orjson.loads)
        pool = await Oban.create_pool(args.dsn)
        # {}: the producer's defaults (limit 10); a number: that limit
        oban = Oban(pool=pool, queues={QUEUE: args.limit if args.limit else {}})
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        print(f"READY {time.time()!r}", flush=True)
        await oban.start()  # notifier, leader election, stager, producer loop
        await stop.wait()
        await oban.stop()
        print(f"DONE {_STATE['counter']} {time.time()!r}", flush=True)
        await pool.close()

    if args.loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
    if _STATE["fh"]:
        _STATE["fh"].close()
    if args.mem:
        st = read_proc_status()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        print(f"MEM {st.get('VmHWM', -1)} {st.get('VmRSS', -1)} {ru.ru_maxrss} {ru.ru_utime + ru.ru_stime!r}",
              flush=True)


def default_loop():
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


async def spawn_worker(dsn, loop, limit=None, latency_file=None, log_path=None, mem=False):
    """Starts the worker process; returns it with the time it printed READY."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "_worker", "--dsn", dsn, "--loop", loop]
    if limit:
        cmd += ["--limit", str(limit)]
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
    handled = t_end = mem = None
    for line in out.decode().splitlines():
        parts = line.split()
        if parts and parts[0] == "DONE":
            handled, t_end = int(parts[1]), float(parts[2])
        elif parts and parts[0] == "MEM":
            mem = {"vmhwm_kib": int(parts[1]), "vmrss_end_kib": int(parts[2]), "ru_maxrss_kib": int(parts[3]),
                   "cpu_s": float(parts[4])}
    return handled, t_end, mem


# ---------------------------------------------------------------- the cases
async def bench_enqueue_seq(dsn, n):
    await reset(dsn)
    noop = noop_worker()
    pool, oban = await make_client(dsn)
    try:
        for _ in range(100):  # warm-up: the pool's connections, prepared plans
            await oban.enqueue(noop.new({"i": -1}))
        t0 = time.perf_counter()
        for i in range(n):
            await oban.enqueue(noop.new({"i": i}))
        elapsed = time.perf_counter() - t0
    finally:
        await pool.close()
    return n / elapsed


async def _enqueue_batches(oban, n, batch):
    noop = noop_worker()
    for start in range(0, n, batch):
        await oban.enqueue_many([noop.new({"i": i}) for i in range(start, min(n, start + batch))])


async def bench_enqueue_batch(dsn, n, batch):
    await reset(dsn)
    pool, oban = await make_client(dsn)
    try:
        await _enqueue_batches(oban, batch, batch)  # warm-up
        t0 = time.perf_counter()
        await _enqueue_batches(oban, n, batch)
        elapsed = time.perf_counter() - t0
    finally:
        await pool.close()
    return n / elapsed


async def prefill(dsn, n, batch=500):
    await reset(dsn)
    pool, oban = await make_client(dsn)
    try:
        await _enqueue_batches(oban, n, batch)
    finally:
        await pool.close()
    conn = await admin_conn(dsn)
    try:
        await conn.execute("ANALYZE oban_jobs")
    finally:
        await conn.close()


async def bench_process(dsn, n, loop, limit, log_path, timeout=300.0, mem=False):
    await prefill(dsn, n)
    conn = await admin_conn(dsn)
    proc = None
    try:
        proc, t_ready = await spawn_worker(dsn, loop, limit=limit, log_path=log_path, mem=mem)
        st_ready = read_proc_status(proc.pid)
        hwm_sampled = st_ready.get("VmHWM", 0)
        threads_max = st_ready.get("Threads", 0)
        deadline = time.time() + timeout
        t_done = t_first = left_at_first = None
        while time.time() < deadline:
            left = await pending_count(conn)
            if t_first is None and left < n:  # the first poll that sees a finished job
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
            raise RuntimeError("processing timed out")
        hwm_sampled = max(hwm_sampled, read_proc_status(proc.pid).get("VmHWM", 0))
        await stop_worker(proc)  # no drain mode: oban.stop() once the table shows the work done
        out = await asyncio.wait_for(proc.stdout.read(), timeout=60)
        handled, _, mem_out = parse_worker_output(out)
        ok = await completed_count(conn)
        res = {
            "jobs_per_s": n / (t_done - t_ready),
            "jobs_per_s_worker_exit": None,  # Oban has no drain-and-exit mode
            "seconds": t_done - t_ready,
            "first_done_seen_s": (t_first - t_ready) if t_first else None,
            # the rate from the first poll that saw a finished job on: start-up left out
            "jobs_per_s_after_first_done": (left_at_first / (t_done - t_first))
            if t_first and t_done > t_first else None,
            "handled": handled,
            "completed_in_db": ok,
            "worker_rc": proc.returncode,
            "worker_threads_max_sampled": threads_max,
        }
        if mem:
            res.update({"rss_at_ready_kib": st_ready.get("VmRSS"), "hwm_at_ready_kib": st_ready.get("VmHWM"),
                        "hwm_sampled_kib": hwm_sampled, "mem": mem_out})
        if ok != n:
            res["warning"] = f"expected {n} completed jobs, found {ok}"
        return res
    finally:
        if proc is not None:
            await stop_worker(proc)
        await conn.close()


async def bench_latency(dsn, loop, count, spacing, log_path, lat_path, timeout=60.0):
    await reset(dsn)
    if lat_path.exists():
        lat_path.unlink()
    noop = noop_worker()
    proc, _ = await spawn_worker(dsn, loop, latency_file=lat_path, log_path=log_path)
    try:
        await asyncio.sleep(2.0)  # the worker goes idle, listening
        pool, oban = await make_client(dsn)
        calls = []
        try:
            for _ in range(5):  # warm-up, without "t": not measured
                await oban.enqueue(noop.new({"i": -1}))
            await asyncio.sleep(1.0)
            start = time.perf_counter()
            for i in range(count):
                delay = start + i * spacing - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                t = time.time()
                await oban.enqueue(noop.new({"t": t, "i": i}))
                calls.append(time.time() - t)
        finally:
            await pool.close()
        deadline = time.time() + timeout
        lines = []
        while time.time() < deadline:
            lines = lat_path.read_text().splitlines() if lat_path.exists() else []
            if len(lines) >= count:
                break
            await asyncio.sleep(0.1)
        lats = sorted((float(b) - float(a)) * 1000.0 for a, b in (ln.split() for ln in lines))
        calls.sort()
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

    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    loop = args.loop or default_loop()
    # SIGTERM cancels the run, so the finally blocks stop the worker this script started
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    await ensure_schema(args.dsn)
    conn = await admin_conn(args.dsn)
    server_version = await scalar(conn, "SHOW server_version")
    await conn.close()

    which = set(args.only.split(","))
    raw: dict[str, list] = {}
    conc = args.concurrency
    for r in range(args.repeats):
        if "enqueue" in which:
            v = await asyncio.wait_for(bench_enqueue_seq(args.dsn, args.jobs), 600)
            raw.setdefault("enqueue_seq_jobs_per_s", []).append(v)
            print(f"[run {r + 1}] enqueue_seq: {v:.0f} jobs/s", flush=True)
            v = await asyncio.wait_for(bench_enqueue_batch(args.dsn, args.jobs, args.batch), 300)
            raw.setdefault("enqueue_batch500_jobs_per_s", []).append(v)
            print(f"[run {r + 1}] enqueue_batch{args.batch}: {v:.0f} jobs/s", flush=True)
        if "process" in which:
            for label, limit in ((f"process_c{conc}", conc), ("process_default", None)):
                res = await asyncio.wait_for(
                    bench_process(args.dsn, args.jobs, loop, limit, log_dir / f"oban_{label}.log"), 900)
                raw.setdefault(label, []).append(res)
                print(f"[run {r + 1}] {label}: {res}", flush=True)
        if "latency" in which:
            res = await asyncio.wait_for(
                bench_latency(args.dsn, loop, args.lat_count, args.lat_spacing, log_dir / "oban_latency.log",
                              out_dir / "oban_latency_samples.txt"), 300)
            raw.setdefault("latency", []).append(res)
            print(f"[run {r + 1}] latency: {res}", flush=True)
        if "mem" in which:
            res = await asyncio.wait_for(
                bench_process(args.dsn, args.mem_jobs, loop, None, log_dir / "oban_mem.log", timeout=1800,
                              mem=True), 2400)
            raw.setdefault("mem", []).append(res)
            print(f"[run {r + 1}] mem: {res}", flush=True)
    await reset(args.dsn)

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
    for pkg in ("oban", "psycopg", "psycopg-pool", "psycopg-binary", "orjson", "uvloop"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    result = {
        "peer": "oban",
        "version": versions["oban"],
        "versions": versions,
        "python": platform.python_version(),
        "postgres": server_version,
        "settings": {
            "jobs": args.jobs,
            "batch": args.batch,
            "concurrency_run": f"queues={{'{QUEUE}': {conc}}} (queue limit {conc})",
            "repeats": args.repeats,
            "latency_count": args.lat_count,
            "latency_spacing_s": args.lat_spacing,
            "mem_jobs": args.mem_jobs if "mem" in which else None,
            "worker_defaults": f"queues={{'{QUEUE}': {{}}}}: producer limit 10, debounce 5 ms; stager every "
            "1 s (also the fallback when a notification is missed); notifier LISTENs on a connection of its "
            "own; pool of Oban.create_pool (1 to 10); leader election on; pruner max_age 1 day; lifeline "
            "rescue_after 300 s; no per-job log lines",
            "process_default_equals_c10": conc == 10,
            "drain_mode": "none: the worker is stopped with SIGTERM (oban.stop()) once the poll saw the queue empty",
            "enqueue_client": "Oban(pool=Oban.create_pool(dsn)) without queues, not started; enqueue_many "
            "runs one INSERT per job in one transaction",
            "worker_event_loop": loop,
            "worker_json": "orjson (as `oban start`)",
            "producer_event_loop": "asyncio (stdlib)",
            "uses_listen_notify": True,
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
    w.add_argument("--loop", choices=["uvloop", "asyncio"], default=default_loop())
    w.add_argument("--limit", type=int, default=None)
    w.add_argument("--latency-file", default=None)
    w.add_argument("--mem", action="store_true")

    ap.add_argument("--dsn", default=DEFAULT_DSN, help="database ($PEER_DSN)")
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lat-count", type=int, default=200)
    ap.add_argument("--lat-spacing", type=float, default=0.020)
    ap.add_argument("--mem-jobs", type=int, default=100_000, help="jobs the default worker drains for --only mem")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default=None,
                    help="the worker's event loop (default: uvloop when installed, as `oban start`)")
    ap.add_argument("--only", default="enqueue,process,latency",
                    help="comma list of enqueue,process,latency,mem (mem is not in the default)")
    ap.add_argument("--out", default=str(HERE / "results" / "oban.json"))
    args = ap.parse_args()
    if args.cmd == "_worker":
        worker_main(args)
    else:
        asyncio.run(run_all(args))


if __name__ == "__main__":
    main()
