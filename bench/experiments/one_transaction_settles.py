#!/usr/bin/env python3
"""How fast a worker runs jobs whose completion writes more than the delivery: a job declared
``store_result=True`` (its result kept with the completion), a chain of two jobs (the second
published with the first's completion) and a unique job (its key freed when it is done), against
the same no-op job without any of them.

    .venv/bin/python bench/experiments/one_transaction_settles.py                 # 10,000 jobs a case
    .venv/bin/python bench/experiments/one_transaction_settles.py --jobs 20000

Each case fills its jobs with a producer-only queue (``bulk``; ``chain`` for the chains, ``dispatch``
with ``unique=`` a key of its own for the unique jobs), then
one queue with a host (``queue.lifespan``, the job queue at its defaults) runs them; jobs/s is the
count over the time until every delivery is Completed (polled every 50 ms). The database
(``--database``, default ``bench_one_transaction``, on ``$BENCH_PG_URL`` or the local server) is
dropped and recreated for every case. Run it with another checkout's library first on
``PYTHONPATH`` to compare two builds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from probe_support import add_database_options, fresh_database

from fastapi_workqueue import JobContext, WorkQueue, WorkQueueSettings


class Item(BaseModel):
    """The payload of every job."""

    i: int


def make_queue(dsn: str, *, host: bool, store_result: bool) -> tuple[WorkQueue, Any, Any]:
    """A queue with two jobs, ``bench.first`` (keeping its result when ``store_result``) and ``bench.second``."""
    queue = WorkQueue(WorkQueueSettings(database_url=dsn, enabled=host, auto_migrate=True))

    async def first(payload: Item, job: JobContext) -> dict[str, int]:
        return {"i": payload.i}

    async def second(payload: Item, job: JobContext) -> None:
        return None

    return (queue, queue.job("bench.first", store_result=store_result)(first),
            queue.job("bench.second")(second))


async def one_case(url: str, database: str, case: str, n: int) -> float:
    admin, dsn = await fresh_database(url, database)
    producer, first, second = make_queue(dsn, host=False, store_result=case == "result")
    await producer.open()
    try:
        if case == "chain":
            for i in range(n // 2):
                await producer.chain([(first, {"i": i}), (second, {"i": i})])
        elif case == "unique":
            for i in range(n):
                await producer.dispatch(first, {"i": i}, unique=f"key-{i}")
        else:
            for start in range(0, n, 500):
                await producer.bulk([(first, {"i": i}) for i in range(start, min(n, start + 500))])
    finally:
        await producer.close()
    queue, _, _ = make_queue(dsn, host=True, store_result=case == "result")
    watcher = await asyncpg.connect(dsn)
    try:
        await queue.open()
        started = time.perf_counter()
        async with queue.lifespan(None):
            while await watcher.fetchval("SELECT count(*) FROM workqueue.delivery WHERE status = 'Completed'") < n:  # noqa: ASYNC110 - polled as the benchmarks poll
                await asyncio.sleep(0.05)
            took = time.perf_counter() - started
        await queue.close()
    finally:
        await watcher.close()
        await admin.close()
    return n / took


async def main(args: argparse.Namespace) -> None:
    rates: dict[str, float] = {}
    for case in ("plain", "result", "chain", "unique"):
        rates[case] = await one_case(args.url, args.database, case, args.jobs)
        print(f"{case:6s} {rates[case]:8.0f} jobs/s", flush=True)
    print(json.dumps({"jobs": args.jobs, "jobs_per_s": {k: round(v) for k, v in rates.items()}}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_database_options(ap, "bench_one_transaction")
    ap.add_argument("--jobs", type=int, default=10_000, help="jobs a case (a chain counts as two)")
    asyncio.run(main(ap.parse_args()))
