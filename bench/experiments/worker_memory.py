#!/usr/bin/env python3
"""The memory of a ``workqueue work`` process, idle and draining 100,000 deliveries.

    .venv/bin/python bench/experiments/worker_memory.py                       # the work tree
    .venv/bin/python bench/experiments/worker_memory.py --library-ref main    # a commit (git archive)

``bench/compare/workqueue_bench.py --only mem`` measures a worker that an app starts itself
(``queue.lifespan``); this measures the other way to run one: ``python -m fastapi_workqueue work --app
worker_memory_app:queue --subscription bench-none`` (``worker_memory_app.py`` beside this file: the
benchmark's ``none`` topic and subscription, a handler that does nothing, the settings read from
``WORKQUEUE_DATABASE_URL`` and every other ``WORKQUEUE_*`` variable removed, so the defaults hold).

1. Idle: the worker starts on empty tables; VmRSS and VmHWM are read from ``/proc/<pid>/status``
   ``--idle-seconds`` after it logs that its subscription is running.
2. Draining: ``--deliveries`` are published first (the benchmark's fill), the worker starts, and the
   parent reads VmHWM at every poll until none is Pending or InFlight, and once more at the end.

The database (``--dsn``, default ``bench_worker_memory``) is created and migrated when missing and
emptied after. The library is compiled first, as an installed one is. JSON on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "bench" / "compare"))

import workqueue_bench as wb  # noqa: E402  (the benchmark's fill, reset and /proc readers)

READY = b"running ("
"""What the worker logs once its subscription runs (``bench-none: running (concurrency 4)``)."""


def snapshot(ref: str, dest: Path) -> str:
    """Extracts ``fastapi_workqueue/`` and ``sql/`` of commit ``ref`` into ``dest``; returns its short hash."""
    sha = subprocess.run(["git", "rev-parse", "--short", f"{ref}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", "--format=tar", sha, "fastapi_workqueue", "sql"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return sha


async def start(dsn: str, library: Path) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env.update(WORKQUEUE_DATABASE_URL=dsn, PYTHONPATH=f"{library}{os.pathsep}{HERE}")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fastapi_workqueue", "work", "--app", "worker_memory_app:queue",
        "--subscription", "bench-none", env=env, cwd=HERE,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    seen = b""
    while READY not in seen:
        line = await asyncio.wait_for(proc.stderr.readline(), timeout=60)
        if not line:
            raise RuntimeError(f"the worker exited before it ran: {seen.decode(errors='replace')}")
        seen += line
    asyncio.get_running_loop().create_task(proc.stderr.read())  # keep the pipe drained
    return proc


async def stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM to the worker we started (by its pid), then SIGKILL after 30 s."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=30)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def measure(args: argparse.Namespace, library: Path) -> dict[str, Any]:
    with contextlib.redirect_stdout(sys.stderr):  # (what it created or migrated: stdout is the JSON)
        await wb.ensure_database(args.dsn)
    await wb.reset(args.dsn)
    proc = await start(args.dsn, library)
    try:
        await asyncio.sleep(args.idle_seconds)
        idle = wb.read_proc_status(proc.pid)
    finally:
        await stop(proc)
    await wb.prefill(args.dsn, "none", args.deliveries, args.fill_batch, checkpoint=True)
    conn = await wb.connect(args.dsn)
    proc = await start(args.dsn, library)
    try:
        t_ready = time.perf_counter()
        ready = wb.read_proc_status(proc.pid)
        hwm, cur = ready.get("VmHWM", 0), 1
        while True:
            nxt = await conn.fetchval(
                "SELECT id FROM workqueue.delivery WHERE id BETWEEN $1 AND $2 "
                "AND status IN ('Pending', 'InFlight') ORDER BY id LIMIT 1", cur, args.deliveries)
            hwm = max(hwm, wb.read_proc_status(proc.pid).get("VmHWM", 0))
            if nxt is None:
                break
            if proc.returncode is not None:
                raise RuntimeError(f"the worker exited while draining (rc={proc.returncode})")
            cur = nxt
            await asyncio.sleep(args.poll)
        seconds = time.perf_counter() - t_ready
        end = wb.read_proc_status(proc.pid)
    finally:
        await stop(proc)
        await conn.close()
        await wb.reset(args.dsn)
    return {
        "idle_rss_kib": idle.get("VmRSS"), "idle_hwm_kib": idle.get("VmHWM"),
        "draining": {"deliveries": args.deliveries, "rss_at_ready_kib": ready.get("VmRSS"),
                     "vmhwm_kib": max(hwm, end.get("VmHWM", 0)), "rss_end_kib": end.get("VmRSS"),
                     "deliveries_per_s": round(args.deliveries / seconds)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get(
        "WORKQUEUE_BENCH_DSN", "postgresql://postgres:postgres@127.0.0.1:5432/bench_worker_memory"))
    ap.add_argument("--deliveries", type=int, default=100_000)
    ap.add_argument("--fill-batch", type=int, default=5000)
    ap.add_argument("--idle-seconds", type=float, default=3.0)
    ap.add_argument("--poll", type=float, default=0.05)
    ap.add_argument("--library-ref", default=None, help="measure this commit's library (git archive)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        library, commit = ROOT, None
        if args.library_ref:
            library = Path(tmp)
            commit = snapshot(args.library_ref, library)
        import compileall

        compileall.compile_dir(str(library / "fastapi_workqueue"), quiet=1)
        result = asyncio.run(measure(args, library))
    print(json.dumps({"library": commit or "work tree", **result}, indent=2))


if __name__ == "__main__":
    main()
