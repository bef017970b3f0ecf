#!/usr/bin/env python3
"""What a delivery costs the server by partition mode: claim and settle on one connection, for a
subscription of each mode (bench/README.md, "What bounds the remaining targets").

    .venv/bin/python bench/experiments/keyed_cost.py                    # 3 turns of 8,000 deliveries
    .venv/bin/python bench/experiments/keyed_cost.py --deliveries 20000 --limit 16

Each turn publishes ``--deliveries`` messages over 500 partition keys to the topic of one mode
(None, Exclusive, Ordered), then claims ``--limit`` at a time with ``transport.claim`` and settles
each batch Complete with ``transport.settle``, one call after the other, until none is left. A line
gives the wall time and the server's CPU per delivery (the database's backends, from
``/proc/<pid>/schedstat``), and, from ``pg_stat_user_functions`` (``track_functions = 'all'`` for the
database), the time spent in ``claim``, in ``settle`` and in ``release_keys`` (the key hand-over
a settle of a keyed delivery calls) per delivery. The database (``--database``, default
``bench_keyed_cost``, on ``$BENCH_PG_URL`` or the local server, which must run on this machine) is
dropped and recreated at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from probe_support import add_database_options, backends, figures, fresh_database, medians, server_cpu

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.transport import Settlement

MODES = ("None", "Exclusive", "Ordered")
FUNCTIONS = ("claim", "settle", "release_keys")


async def function_ms(queue: WorkQueue, conn: asyncpg.Connection) -> dict[str, float]:
    """Milliseconds spent in each function so far. A backend reports its counts when it goes idle at
    least a second after its last report: the pause and one more call make the pool's do it."""
    await asyncio.sleep(1.1)
    await queue.transport.list_topics()
    await asyncio.sleep(0.2)
    rows = await conn.fetch("SELECT funcname, total_time FROM pg_stat_user_functions WHERE schemaname = 'workqueue'")
    return {r["funcname"]: r["total_time"] for r in rows}


async def one_turn(queue: WorkQueue, admin: asyncpg.Connection, conn: asyncpg.Connection, database: str,
                   mode: str, deliveries: int, limit: int) -> dict[str, float]:
    await conn.execute("TRUNCATE workqueue.delivery, workqueue.message, workqueue.partition CASCADE")
    for start in range(0, deliveries, 500):
        await queue.publish(f"cost.{mode.lower()}", [PublishRequest(payload={"i": i}, partition_key=f"key-{i % 500}")
                                                     for i in range(start, min(deliveries, start + 500))])
    await conn.execute("ANALYZE workqueue.delivery, workqueue.partition")
    pids = await backends(admin, database)
    before = await function_ms(queue, conn)
    s0, t0 = server_cpu(pids), time.perf_counter()
    done = 0
    while done < deliveries:
        claimed = await queue.transport.claim(f"cost-{mode.lower()}", limit)
        if not claimed:
            raise RuntimeError(f"{mode}: nothing to claim after {done} of {deliveries}")
        await queue.transport.settle([Settlement(delivery_id=d.delivery_id, lease_token=d.lease_token,
                                                 kind="Complete") for d in claimed])
        done += len(claimed)
    wall, server = time.perf_counter() - t0, server_cpu(pids) - s0
    after = await function_ms(queue, conn)
    got = {"wall_us": wall / done * 1e6, "server_cpu_us": server / done * 1e6}
    for name in FUNCTIONS:
        got[f"{name}_us"] = (after.get(name, 0.0) - before.get(name, 0.0)) / done * 1e3
    return got


async def main(args: argparse.Namespace) -> None:
    admin, dsn = await fresh_database(args.url, args.database)
    await admin.execute(f"ALTER DATABASE \"{args.database}\" SET track_functions = 'all'")
    queue = WorkQueue(
        WorkQueueSettings(database_url=dsn, enabled=False),
        topics=[Topic(name=f"cost.{m.lower()}") for m in MODES],
        subscriptions=[Subscription(name=f"cost-{m.lower()}", topic=f"cost.{m.lower()}", handler_key=m,
                                    partition_mode=m) for m in MODES],
    )
    await queue.migrate()
    await queue.open()
    conn = await asyncpg.connect(dsn)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for turn in range(args.turns):
            for mode in MODES:
                got = await one_turn(queue, admin, conn, args.database, mode, args.deliveries, args.limit)
                runs[mode].append(got)
                print(f"turn {turn + 1} {mode:9s} {figures(got)}", flush=True)
    finally:
        await conn.close()
        await queue.close()
        await admin.close()
    print(f"medians of {args.turns} turns, µs per delivery, claims of {args.limit}:")
    for mode, got in medians(runs).items():
        print(f"  {mode:9s} {figures(got)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_database_options(ap, "bench_keyed_cost")
    ap.add_argument("--deliveries", type=int, default=8000)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
