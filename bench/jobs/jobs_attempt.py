#!/usr/bin/env python3
"""CPU per attempt of a job against a core delivery, in one process (issue 13).

    .venv/bin/python bench/jobs/jobs_attempt.py                      # 5,000 jobs, then 5,000 core deliveries
    .venv/bin/python bench/jobs/jobs_attempt.py --case jobs -n 20000
    .venv/bin/python bench/jobs/jobs_attempt.py --case jobs --profile 40   # cProfile of the processing only

Each case fills ``-n`` no-op work items in a database of its own, made fresh (``jobs``: jobs of
``bench/jobs/jobs_bench.py``'s no-op job queued with ``bulk`` into a database that holds only its
queue, as in ``jobs_process``; ``jobs6``: the same in a database that holds six job queues, so the
group consumer claims across all of them with ``claim_many``; ``core``: messages
to ``bench/compare/workqueue_bench.py``'s no-op subscription), then processes them IN THIS PROCESS with the
library's host at its defaults (``queue.open()`` and ``queue.lifespan(None)``) until none waits or
runs. It reports, per attempt: the Python process's CPU (``time.process_time()``, from the host's
start to the last settle), the CPU of the PostgreSQL backends of the database (``/proc/<pid>/stat``
of the backends open at the end, when readable), and the server time per call of claim,
claim_many and settle (``pg_stat_user_functions``; the database gets ``track_functions = 'all'``).
Nothing else runs in the process: ``--profile K`` runs cProfile from the host's start to the last
settle (not the fill) and prints its K top functions by own time (the profile slows the process,
so its CPU figures are not comparable with a run without it).
"""

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "compare")]  # jobs_bench, then the core benchmark

import jobs_bench  # noqa: E402
import run as core_run  # noqa: E402
import workqueue_bench as core  # noqa: E402  (strips WORKQUEUE_* from the environment)

from fastapi_workqueue import WorkMessage  # noqa: E402

DB = "bench_jobs_attempt"
FUNCTIONS = ("claim", "claim_many", "settle")
STATS_SQL = (
    "SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions "
    "WHERE schemaname = 'workqueue' AND funcname = ANY($1::text[])"
)
BACKENDS_SQL = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu(pids: list[int]) -> float | None:
    """Seconds of CPU the processes ``pids`` used (utime + stime), or None when unreadable."""
    total = 0
    try:
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None
    return total / TICK


async def prepare_db(dsn: str) -> None:
    """A fresh database with the schema and ``track_functions = 'all'`` for its sessions."""
    base, _, name = dsn.rpartition("/")
    admin = await core.connect(f"{base}/postgres")
    try:
        await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", name)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}"')
        await admin.execute(f"ALTER DATABASE \"{name}\" SET track_functions = 'all'")
    finally:
        await admin.close()


async def fill(case: str, dsn: str, n: int, batch: int) -> None:
    if case in ("jobs", "jobs6"):
        queues = jobs_bench.ONE + (jobs_bench.FIVE if case == "jobs6" else ())
        queue, _ = jobs_bench.make_jobs_queue(dsn, queues, host=False)
        await queue.migrate()
        await queue.open()  # the job queues' topics and subscriptions
        await queue.close()
        await jobs_bench.fill_jobs(dsn, jobs_bench.ONE, n, batch)
    else:
        await core.ensure_database(dsn)
        await core.prefill(dsn, "none", n, batch)


def host_queue(case: str, dsn: str) -> tuple[Any, list[int]]:
    if case in ("jobs", "jobs6"):
        queue, jobs = jobs_bench.make_jobs_queue(dsn, jobs_bench.ONE, host=True)
        return queue, jobs["counter"]
    queue = core.make_queue(dsn, host=True)
    counter = [0]

    @queue.handler("bench.none")
    async def noop(message: WorkMessage[core.Item]) -> None:
        counter[0] += 1

    return queue, counter


async def measure(case: str, dsn: str, n: int, batch: int, profile: int = 0) -> dict[str, Any]:
    await prepare_db(dsn)
    await fill(case, dsn, n, batch)
    conn = await core.connect(dsn)
    try:
        await conn.execute("SELECT pg_stat_reset()")
        queue, counter = host_queue(case, dsn)
        await queue.open()
        pids = [r["pid"] for r in await conn.fetch(BACKENDS_SQL)]
        db_before = backend_cpu(pids)
        profiler = cProfile.Profile() if profile else None
        # The fill left garbage of its own: collected now, so that no full collection of it lands
        # in one case's measurement and not in the other's.
        gc.collect()
        if profiler is not None:
            profiler.enable()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        async with queue.lifespan(None):
            while counter[0] < n:  # noqa: ASYNC110 - the handlers count; nothing to wait on
                await asyncio.sleep(0.01)
            while await conn.fetchval(core.PENDING_SQL):  # noqa: ASYNC110 - the settles are in the store
                await asyncio.sleep(0.01)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            if profiler is not None:
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
            pids_after = [r["pid"] for r in await conn.fetch(BACKENDS_SQL)]
            db_after = backend_cpu(pids_after)
        await queue.close()
        completed = await conn.fetchval(core.COMPLETED_SQL)
        await asyncio.sleep(0.6)  # the backends' function statistics reach the collector
        stats = {r["funcname"]: dict(r) for r in await conn.fetch(STATS_SQL, list(FUNCTIONS))}
    finally:
        await conn.close()
    db_cpu = None
    if db_after is not None and db_before is not None:
        db_cpu = db_after - (db_before if set(pids) <= set(pids_after) else 0.0)
    per_call = {
        name: {"calls": s["calls"], "ms_per_call": s["total_time"] / s["calls"] if s["calls"] else None,
               "us_per_attempt": 1000 * s["total_time"] / n}
        for name, s in stats.items()
    }
    return {"case": case, "n": n, "completed": completed, "seconds": wall, "per_s": n / wall,
            "python_us_per_attempt": 1e6 * cpu / n, "db_us_per_attempt": None if db_cpu is None else 1e6 * db_cpu / n,
            "functions": per_call}


def show(result: dict[str, Any]) -> None:
    db = result["db_us_per_attempt"]
    print(f"{result['case']}: {result['n']} in {result['seconds']:.2f} s ({result['per_s']:.0f}/s), "
          f"completed {result['completed']}; CPU per attempt: Python {result['python_us_per_attempt']:.1f} µs, "
          f"PostgreSQL backends {'n/a' if db is None else f'{db:.1f} µs'}")
    for name, f in sorted(result["functions"].items()):
        ms = "n/a" if f["ms_per_call"] is None else f"{f['ms_per_call']:.3f} ms"
        print(f"    {name}: {f['calls']} calls, {ms} per call, {f['us_per_attempt']:.1f} µs per attempt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=("jobs", "jobs6", "core", "both", "all"), default="both",
                    help="both: jobs and core; all: jobs, jobs6 and core")
    ap.add_argument("-n", type=int, default=5000, help="work items per case (5,000)")
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--dsn", default=core_run.db_url(core_run.DEFAULT_PG, DB),
                    help=f"database of the case, made anew (default <$BENCH_PG_URL>/{DB}; the core's gets _core)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of the cases (their order alternates); the medians follow the rounds")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="profile the processing and print its K top functions by own time")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default=None, help="default: uvloop when installed")
    args = ap.parse_args()
    cases = {"both": ("jobs", "core"), "all": ("jobs", "jobs6", "core")}.get(args.case, (args.case,))

    async def go() -> None:
        results: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
        for r in range(args.repeats):
            for case in cases if r % 2 == 0 else tuple(reversed(cases)):
                dsn = args.dsn if case == "jobs" else args.dsn + ("_core" if case == "core" else "_six")
                result = await measure(case, dsn, args.n, args.batch, args.profile)
                results[case].append(result)
                show(result)
        if args.repeats > 1:
            for case, runs in results.items():
                print(f"{case}, medians of {len(runs)} rounds: " + ", ".join(
                    f"{key} {statistics.median(x[key] for x in runs):.1f}"
                    for key in ("per_s", "python_us_per_attempt", "db_us_per_attempt")
                    if all(x[key] is not None for x in runs)))

    if (args.loop or core.default_loop()) == "uvloop":
        import uvloop

        uvloop.run(go())
    else:
        asyncio.run(go())


if __name__ == "__main__":
    main()
