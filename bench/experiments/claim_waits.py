#!/usr/bin/env python3
"""What the server does while a worker drains a keyed and an unkeyed subscription: how much of the
time a claim and a settle are running, and what they wait for (bench/README.md, "What bounds the
remaining targets").

    .venv/bin/python bench/experiments/claim_waits.py                   # Exclusive against None
    .venv/bin/python bench/experiments/claim_waits.py --case ordered    # Ordered against None

It runs ``bench/compare/workqueue_bench.py --only <case> --repeats 1`` (its None case of 100,000
deliveries, then the keyed one) on a database of its own and samples ``pg_stat_activity`` of that
database every ``--every`` seconds from a connection of its own. Each sample is put in the phase
of the subscription whose deliveries are InFlight (None, Exclusive or Ordered; looked up twice a
second), and each active backend in the routine it runs (``claim``, ``settle`` or other). For each
phase it prints the share of samples in which a claim (a settle) was running, split by what the
backend waited for: nothing (on CPU or waiting for one), the WAL being flushed (``IO:WALSync``,
``LWLock:WALWrite``, ``IO:WALWrite``), or something else. The sampler itself takes some CPU (one
query every 2 ms), so the rates it prints beside are lower than the benchmark's own.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_support import add_database_options, fresh_database

BENCH = Path(__file__).resolve().parents[1] / "compare" / "workqueue_bench.py"
WAL_WAITS = {("IO", "WALSync"), ("LWLock", "WALWrite"), ("IO", "WALWrite")}
PHASE_SQL = """
SELECT s.partition_mode FROM workqueue.subscription s
WHERE EXISTS (SELECT 1 FROM workqueue.delivery d WHERE d.subscription_id = s.id AND d.status = 'InFlight')
LIMIT 1
"""
ACTIVITY_SQL = """
SELECT wait_event_type, wait_event, query FROM pg_stat_activity
WHERE datname = $1 AND state = 'active' AND backend_type = 'client backend' AND pid <> pg_backend_pid()
"""


def routine(query: str) -> str:
    for name in ("claim", "settle"):
        if f"workqueue.{name}(" in query:
            return name
    return "other"


async def sample(dsn: str, database: str, every: float, done: asyncio.Event) -> dict[str, collections.Counter[str]]:
    """Samples until ``done``: per phase, how many samples, and in how many each routine ran and waited."""
    watcher = await asyncpg.connect(dsn)
    sampler = await asyncpg.connect(dsn)
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    phase, checked = None, 0.0
    try:
        while not done.is_set():
            now = time.monotonic()
            if now - checked >= 0.5:
                try:
                    phase = await watcher.fetchval(PHASE_SQL)
                except asyncpg.UndefinedTableError:  # the benchmark has not made its tables yet
                    phase = None
                checked = now
            if phase is not None:
                seen: set[str] = set()
                for row in await sampler.fetch(ACTIVITY_SQL, database):
                    name = routine(row["query"] or "")
                    wait = (row["wait_event_type"], row["wait_event"])
                    kind = "cpu" if wait == (None, None) else "wal" if wait in WAL_WAITS else "other"
                    seen.add(f"{name}:{kind}")
                    seen.add(name)
                counts[phase]["samples"] += 1
                counts[phase].update(seen)
            await asyncio.sleep(every)
    finally:
        await watcher.close()
        await sampler.close()
    return counts


async def main(args: argparse.Namespace) -> None:
    admin, dsn = await fresh_database(args.url, args.database)
    await admin.close()
    with tempfile.TemporaryDirectory(prefix="claim_waits_") as scratch:
        await sample_run(args, dsn, Path(scratch) / "workqueue.json")


async def sample_run(args: argparse.Namespace, dsn: str, out: Path) -> None:
    """Runs the benchmark into ``out`` while sampling; prints what the samples say."""
    bench = await asyncio.create_subprocess_exec(
        sys.executable, str(BENCH), "--dsn", dsn, "--only", args.case, "--repeats", "1", "--out", str(out),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    done = asyncio.Event()
    sampling = asyncio.create_task(sample(dsn, args.database, args.every, done))
    code = await bench.wait()
    done.set()
    counts = await sampling
    if code != 0:
        raise SystemExit(f"the benchmark failed (exit {code}); run it alone to see why")
    raw = json.loads(await asyncio.to_thread(out.read_text))["raw"]
    rates = {key: runs[0]["deliveries_per_s"] for key, runs in raw.items()
             if isinstance(runs, list) and runs and isinstance(runs[0], dict) and "deliveries_per_s" in runs[0]}
    print(f"deliveries/s while sampled: {', '.join(f'{k} {v:,.0f}' for k, v in rates.items())}")
    print("share of samples   | claim running: on CPU, WAL flush, other | settle running: on CPU, WAL flush, other")
    for phase, c in sorted(counts.items()):
        n = c["samples"]

        def share(key: str, n: int = n, c: collections.Counter[str] = c) -> str:
            return f"{100 * c[key] / n:5.1f} %"

        print(f"{phase:<9} {n:>6} samples | {share('claim')}: {share('claim:cpu')}, {share('claim:wal')}, "
              f"{share('claim:other')} | {share('settle')}: {share('settle:cpu')}, {share('settle:wal')}, "
              f"{share('settle:other')}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_database_options(ap, "bench_claim_waits")
    ap.add_argument("--case", choices=["exclusive", "ordered"], default="exclusive")
    ap.add_argument("--every", type=float, default=0.002, help="seconds between samples")
    asyncio.run(main(ap.parse_args()))
