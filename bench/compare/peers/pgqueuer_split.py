#!/usr/bin/env python3
"""Where the time of pgqueuer's enqueue goes, measured as ``bench/experiments/publish_split.py`` and
``bench/experiments/batch_split.py`` measure ours: the client's CPU and the server's, one call after
another on one connection (bench/README.md, "What bounds the remaining targets").

    /tmp/workqueue-bench-peers/pgqueuer/bin/python bench/compare/peers/pgqueuer_split.py

Run it with the pgqueuer venv that ``bench/compare/run.py`` builds. Each turn empties pgqueuer's
tables, then times ``--calls`` calls of ``Queries.enqueue("noop", payload)`` (200 warm-ups first)
and ``--messages`` jobs in calls of ``--batch`` (``enqueue([...], [...], [...])``). A line gives,
per job, the wall time, the client's CPU (``time.process_time``) and the server's CPU
(``/proc/<pid>/schedstat`` of the connection's backend, which also runs the NOTIFY trigger; the
server must run on this machine). The database (``--dsn``, default the benchmark's
``bench_pgqueuer``) must hold pgqueuer's schema (``Queries.install()``, done by the benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import asyncpg
from pgqueuer.db import AsyncpgDriver
from pgqueuer.queries import Queries


def server_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as fh:
        return int(fh.read().split()[0]) / 1e9


async def main(args: argparse.Namespace) -> None:
    conn = await asyncpg.connect(args.dsn)
    queries = Queries(AsyncpgDriver(conn))
    pid = conn.get_server_pid()
    try:
        for turn in range(args.turns):
            await conn.execute("TRUNCATE pgqueuer, pgqueuer_log")
            for _ in range(200):
                await queries.enqueue("noop", b"- w")
            s0, c0, t0 = server_cpu(pid), time.process_time(), time.perf_counter()
            for i in range(args.calls):
                await queries.enqueue("noop", b"- %d" % i)
            wall, client, server = time.perf_counter() - t0, time.process_time() - c0, server_cpu(pid) - s0
            n = args.calls
            print(f"turn {turn + 1} one per call   wall {wall / n * 1e6:6.1f} µs  client {client / n * 1e6:6.1f} µs  "
                  f"server {server / n * 1e6:6.1f} µs", flush=True)
            await conn.execute("TRUNCATE pgqueuer, pgqueuer_log")
            n, batch = args.messages, args.batch
            s0, c0, t0 = server_cpu(pid), time.process_time(), time.perf_counter()
            for start in range(0, n, batch):
                await queries.enqueue(["noop"] * batch, [b"- %d" % i for i in range(start, start + batch)], [0] * batch)
            wall, client, server = time.perf_counter() - t0, time.process_time() - c0, server_cpu(pid) - s0
            print(f"turn {turn + 1} batches of {batch} wall {wall / n * 1e6:6.1f} µs  "
                  f"client {client / n * 1e6:6.1f} µs  server {server / n * 1e6:6.1f} µs  ({n / wall:,.0f} jobs/s)",
                  flush=True)
    finally:
        await conn.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("PEER_DSN",
                                                    "postgresql://postgres:postgres@127.0.0.1:5432/bench_pgqueuer"))
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--turns", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
