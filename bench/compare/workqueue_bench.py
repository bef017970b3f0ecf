#!/usr/bin/env python3
"""Throughput, latency, backlog and memory benchmark of fastapi-workqueue on PostgreSQL.

Run with the project's interpreter (``.venv/bin/python``); ``bench/compare/run.py`` calls it and runs the
two peer libraries beside it with the same counts. It uses the library as an application would:
``WorkQueue``, ``WorkQueueSettings``, ``Topic``/``Subscription``, ``@queue.handler``,
``queue.publish`` and ``queue.lifespan``. The claim-cost case also times the claim call that the
consumer makes, through the queue's public ``transport`` property. Plain SQL is used only to
reset the benchmark tables between runs (``TRUNCATE``), to ``ANALYZE``/``CHECKPOINT`` after a
fill, and to poll how many deliveries are still unfinished.

The method mirrors ``bench/compare/peers/bench_pgqueuer.py`` and ``bench/compare/peers/bench_procrastinate.py``
(same counts, same timing points; see bench/README.md):

  publish_seq        N messages, one ``await queue.publish(topic, [request])`` per message,
                     awaited one after another (100 warm-ups first).
  publish_batch      N messages in calls of 500 (one warm-up call first).
  process_default    N deliveries pre-filled, then ONE worker process with the library's
                     defaults; deliveries/s = N / (done - READY).
  process_cK         the same with ``SubscriptionPlan(concurrency=K)``.
  latency            idle default worker; 200 messages published one at a time on a 20 ms grid;
                     latency = handler start - time taken right before the publish call.
  exclusive/ordered  process_default on an Exclusive / Ordered subscription, --keyed-jobs messages
                     (100,000) over 500 partition keys, compared with keyed_none: the None case
                     at the same count.
  fanout             N/5 messages to a topic with five subscriptions (N deliveries), one default
                     worker runs all five.
  backlog_small/large  claim round trip (``queue.transport.claim``) and processing rate of the
                     first 20,000 deliveries with 10,000 vs 1,000,000 Pending (two databases,
                     both filled first; their claims are timed in turns).
  mem                peak RSS (VmHWM) of a default worker draining 100,000 deliveries.
"""

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
from typing import Any

from pydantic import BaseModel

from fastapi_workqueue import (
    PublishRequest,
    Subscription,
    SubscriptionPlan,
    Topic,
    WorkMessage,
    WorkQueue,
    WorkQueueSettings,
)

SCRIPT = Path(__file__).resolve()
HERE = SCRIPT.parent
MAX_IN_FLIGHT_ENV = "WORKQUEUE_BENCH_MAX_IN_FLIGHT"
DEFAULT_DSN = os.environ.get(
    "WORKQUEUE_BENCH_DSN", "postgresql://postgres:postgres@127.0.0.1:5432/bench_workqueue"
)
FANOUT = 5
# case -> (topic, subscriptions, partition mode); every subscription of a case has the same handler key.
CASES: dict[str, tuple[str, list[str], str]] = {
    "none": ("bench.none", ["bench-none"], "None"),
    "exclusive": ("bench.exclusive", ["bench-exclusive"], "Exclusive"),
    "ordered": ("bench.ordered", ["bench-ordered"], "Ordered"),
    "fanout": ("bench.fanout", [f"bench-fanout-{i}" for i in range(1, FANOUT + 1)], "None"),
}
KEEP_TABLES = {"topic", "subscription", "schema_migration"}
# The worker must run the library's defaults: settings from the environment would change them.
STRIPPED_ENV = sorted(k for k in os.environ if k.startswith("WORKQUEUE_") and k != "WORKQUEUE_BENCH_DSN")
for _k in STRIPPED_ENV:
    del os.environ[_k]


class Item(BaseModel):
    """The payload of every benchmark message (``t`` only in the latency test)."""

    i: int
    t: float | None = None


# ---------------------------------------------------------------- helpers
def summarize(values: list[Any]) -> dict[str, Any] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def pct(sorted_vals: list[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not sorted_vals:
        return None
    k = max(0, math.ceil(p / 100.0 * len(sorted_vals)) - 1)
    return sorted_vals[k]


def read_proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM in KiB from /proc/<pid>/status ({} if the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, val = line.split(":", 1)
                    out[key] = int(val.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def open_log(path: Path) -> Any:
    return path.open("ab")


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def default_loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def asyncpg_dsn(dsn: str) -> str:
    return "postgresql://" + dsn.partition("://")[2]


def make_queue(dsn: str, *, host: bool, concurrency: int | None = None) -> WorkQueue:
    """The benchmark's queue: every case's topic and subscriptions, declared in code."""
    settings: dict[str, Any] = {"database_url": dsn}
    if not host:
        settings["enabled"] = False  # a producer-only process
    if concurrency:
        settings["subscriptions"] = [SubscriptionPlan(concurrency=concurrency)]
    topics = [Topic(name=topic) for topic, _, _ in CASES.values()]
    # --max-in-flight N (passed on to the workers in the environment): every subscription gets that
    # limit, to measure what a limit costs while it is never reached.
    limit = os.environ.get(MAX_IN_FLIGHT_ENV)
    extra: dict[str, Any] = {"max_in_flight": int(limit)} if limit else {}
    subscriptions = [
        Subscription(name=name, topic=topic, handler_key=f"bench.{case}", partition_mode=mode, **extra)
        for case, (topic, names, mode) in CASES.items()
        for name in names
    ]
    return WorkQueue(WorkQueueSettings(**settings), topics=topics, subscriptions=subscriptions)


async def connect(dsn: str) -> Any:
    import asyncpg

    return await asyncpg.connect(asyncpg_dsn(dsn))


async def ensure_database(dsn: str, *, fresh: bool = False) -> None:
    """Creates the database if it does not exist (``fresh``: drops it first), applies the
    migrations, syncs the topology."""
    import asyncpg

    base, _, name = asyncpg_dsn(dsn).rpartition("/")
    exists = not fresh
    if exists:
        try:
            conn = await asyncpg.connect(asyncpg_dsn(dsn))
            await conn.close()
        except asyncpg.InvalidCatalogNameError:
            exists = False
    if not exists:
        admin = await asyncpg.connect(f"{base}/postgres")
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        print(f"created database {name}", flush=True)
    queue = make_queue(dsn, host=False)
    applied = await queue.migrate()
    if applied:
        print(f"applied migrations: {', '.join(applied)}", flush=True)
    await queue.open()  # writes the declared topics and subscriptions
    await queue.close()


async def reset(dsn: str) -> None:
    """Empties the work tables (fresh heaps, ids from 1); the topology stays."""
    conn = await connect(dsn)
    try:
        tables = [
            r["tablename"]
            for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'workqueue'")
            if r["tablename"] not in KEEP_TABLES
        ]
        await conn.execute(
            "TRUNCATE " + ", ".join(f"workqueue.{t}" for t in sorted(tables)) + " RESTART IDENTITY"
        )
    finally:
        await conn.close()


async def analyze(dsn: str, checkpoint: bool = False) -> None:
    conn = await connect(dsn)
    try:
        await conn.execute("ANALYZE workqueue.delivery, workqueue.message, workqueue.partition")
        if checkpoint:
            await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


def requests_for(start: int, count: int, keys: int | None) -> list[PublishRequest]:
    if keys:
        return [PublishRequest(partition_key=f"key-{i % keys}", payload={"i": i}) for i in range(start, start + count)]
    return [PublishRequest(payload={"i": i}) for i in range(start, start + count)]


async def publish_batches(queue: WorkQueue, topic: str, n: int, batch: int, keys: int | None = None) -> None:
    for start in range(0, n, batch):
        results = await queue.publish(topic, requests_for(start, min(n, start + batch) - start, keys))
        if not all(r.ok for r in results):
            bad = next(r for r in results if not r.ok)
            raise RuntimeError(f"publish refused: {bad.status} {bad.error}")


async def prefill(dsn: str, case: str, messages: int, batch: int, keys: int | None = None,
                  checkpoint: bool = False) -> float:
    """Resets, publishes ``messages`` with the batch API, ANALYZE; returns the publish seconds."""
    await reset(dsn)
    queue = make_queue(dsn, host=False)
    await queue.open()
    try:
        t0 = time.perf_counter()
        await publish_batches(queue, CASES[case][0], messages, batch, keys)
        seconds = time.perf_counter() - t0
    finally:
        await queue.close()
    await analyze(dsn, checkpoint)
    return seconds


# ---------------------------------------------------------------- worker process
def worker_main(args: argparse.Namespace) -> None:
    """Runs in the child process: ONE worker, the queue's lifespan with its host."""
    counter = [0]
    fh = open(args.latency_file, "a", buffering=1) if args.latency_file else None  # noqa: SIM115

    async def main() -> None:
        queue = make_queue(args.dsn, host=True, concurrency=args.concurrency)

        @queue.handler(f"bench.{args.case}")
        async def noop(message: WorkMessage[Item]) -> None:
            t_start = time.time()
            counter[0] += 1
            if fh is not None and message.payload.t is not None:
                fh.write(f"{message.payload.t!r} {t_start!r}\n")

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        parent = os.getppid()

        async def orphan_guard() -> None:  # never outlive the benchmark that started us
            while os.getppid() == parent:  # noqa: ASYNC110 - nothing to wait on but the parent's pid
                await asyncio.sleep(1.0)
            stop.set()

        guard = asyncio.create_task(orphan_guard())
        await queue.open()  # connect (pool + LISTEN) and sync the topology
        print(f"READY {time.time()!r}", flush=True)
        try:
            async with queue.lifespan(None):  # starts the host: consumers, sweeper, reconcile
                await stop.wait()
        finally:
            guard.cancel()
            await queue.close()  # the last close stops the host and closes the pool
        print(f"DONE {counter[0]} {time.time()!r}", flush=True)

    if args.loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
    if fh:
        fh.close()
    st = read_proc_status()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(f"MEM {st.get('VmHWM', -1)} {st.get('VmRSS', -1)} {ru.ru_maxrss} {ru.ru_utime + ru.ru_stime!r}",
          flush=True)


async def spawn_worker(ctx: dict[str, Any], case: str, label: str, concurrency: int | None = None,
                       latency_file: Path | None = None) -> tuple[Any, float]:
    # Started as a module (``-m``), so it runs from the bytecode ``compile_library`` wrote, as an
    # app's own modules do; as ``__main__`` from its path it would be compiled in every worker.
    cmd = [sys.executable, "-m", SCRIPT.stem, "_worker", "--dsn", ctx["dsn"], "--case", case,
           "--loop", ctx["loop"]]
    if concurrency:
        cmd += ["--concurrency", str(concurrency)]
    if latency_file:
        cmd += ["--latency-file", str(latency_file)]
    errf = open_log(ctx["log_dir"] / f"workqueue_{label}.log")
    try:
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=errf,
                                                    cwd=HERE)
    finally:
        errf.close()
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
    parts = line.decode().split()
    if not parts or parts[0] != "READY":
        await stop_worker(proc)
        raise RuntimeError(f"worker did not start: {line!r} (see {ctx['log_dir']}/workqueue_{label}.log)")
    return proc, float(parts[1])


async def stop_worker(proc: Any, grace: float = 20) -> None:
    """Stops the worker we started, by its PID (SIGTERM, then SIGKILL)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=grace)
        except TimeoutError:
            os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()


async def finish_worker(proc: Any) -> dict[str, Any]:
    """SIGTERM, wait for exit, parse DONE and MEM."""
    await stop_worker(proc, grace=30)
    out = await asyncio.wait_for(proc.stdout.read(), timeout=30)
    res: dict[str, Any] = {"worker_rc": proc.returncode, "handled": None, "mem": None}
    for line in out.decode().splitlines():
        parts = line.split()
        if parts and parts[0] == "DONE":
            res["handled"] = int(parts[1])
        elif parts and parts[0] == "MEM":
            res["mem"] = {"vmhwm_kib": int(parts[1]), "vmrss_end_kib": int(parts[2]),
                          "ru_maxrss_kib": int(parts[3]), "cpu_s": float(parts[4])}
    return res


# ---------------------------------------------------------------- measurements
async def bench_publish_seq(ctx: dict[str, Any], n: int) -> float:
    dsn = ctx["dsn"]
    await reset(dsn)
    queue = make_queue(dsn, host=False)
    topic = CASES["none"][0]
    await queue.open()
    try:
        for _ in range(100):  # warm-up (pool, prepared statements)
            await queue.publish(topic, [PublishRequest(payload={"i": -1})])
        t0 = time.perf_counter()
        for i in range(n):
            [result] = await queue.publish(topic, [PublishRequest(payload={"i": i})])
            if not result.ok:
                raise RuntimeError(f"publish refused: {result}")
        dt = time.perf_counter() - t0
    finally:
        await queue.close()
    return n / dt


async def bench_publish_batch(ctx: dict[str, Any], n: int, batch: int) -> float:
    dsn = ctx["dsn"]
    await reset(dsn)
    queue = make_queue(dsn, host=False)
    topic = CASES["none"][0]
    await queue.open()
    try:
        await publish_batches(queue, topic, batch, batch)  # warm-up
        t0 = time.perf_counter()
        await publish_batches(queue, topic, n, batch)
        dt = time.perf_counter() - t0
    finally:
        await queue.close()
    return n / dt


AV_SQL = (
    "SELECT coalesce(string_agg(datname || ': ' || query, ' | '), '') FROM pg_stat_activity "
    "WHERE backend_type = 'autovacuum worker'"
)
INFLIGHT_SQL = "SELECT count(*) FROM workqueue.delivery WHERE status = 'InFlight'"
PENDING_SQL = "SELECT count(*) FROM workqueue.delivery WHERE status IN ('Pending', 'InFlight')"
COMPLETED_SQL = "SELECT count(*) FROM workqueue.delivery WHERE status = 'Completed'"


async def bench_process(ctx: dict[str, Any], case: str, label: str, messages: int, concurrency: int | None = None,
                        keys: int | None = None, limit_s: float = 300.0) -> dict[str, Any]:
    """Pre-fill, ONE worker, poll (100 ms) until no delivery is Pending/InFlight (the peers' method)."""
    dsn = ctx["dsn"]
    deliveries = messages * len(CASES[case][1])
    fill_s = await prefill(dsn, case, messages, ctx["batch"], keys)
    conn = await connect(dsn)
    proc = None
    try:
        proc, t_ready = await spawn_worker(ctx, case, label, concurrency)
        deadline = time.time() + limit_s
        t_done = None
        polls = 0
        while time.time() < deadline:
            polls += 1
            if await conn.fetchval(PENDING_SQL) == 0:
                t_done = time.time()
                break
            if proc.returncode is not None:
                raise RuntimeError(f"{label}: worker exited early (rc={proc.returncode})")
            await asyncio.sleep(0.1)
        if t_done is None:
            raise RuntimeError(f"{label}: processing timed out after {limit_s}s")
        fin = await finish_worker(proc)
        completed = await conn.fetchval(COMPLETED_SQL)
        res = {
            "deliveries_per_s": deliveries / (t_done - t_ready),
            "seconds": t_done - t_ready,
            "messages": messages,
            "deliveries": deliveries,
            "prefill_publish_seconds": fill_s,
            "prefill_messages_per_s": messages / fill_s,
            "prefill_deliveries_per_s": deliveries / fill_s,
            "completed_in_db": completed,
            "polls": polls,
            **fin,
        }
        if completed != deliveries or (fin["handled"] is not None and fin["handled"] < deliveries):
            res["warning"] = f"expected {deliveries} completed, db has {completed}, handled {fin['handled']}"
        return res
    finally:
        if proc is not None:
            await stop_worker(proc)
        await conn.close()


async def bench_latency(ctx: dict[str, Any], count: int, spacing: float, limit_s: float = 60.0) -> dict[str, Any]:
    dsn = ctx["dsn"]
    await reset(dsn)
    lat_path: Path = ctx["out_dir"] / "workqueue_latency_samples.txt"
    lat_path.unlink(missing_ok=True)  # noqa: ASYNC240
    proc, _ = await spawn_worker(ctx, "none", "latency", latency_file=lat_path)
    try:
        await asyncio.sleep(2.0)  # let the worker go idle (LISTEN + wait)
        queue = make_queue(dsn, host=False)
        topic = CASES["none"][0]
        enq_durations = []
        await queue.open()
        try:
            for _ in range(5):  # warm-up, not measured (no t)
                await queue.publish(topic, [PublishRequest(payload={"i": -1})])
            await asyncio.sleep(1.0)
            start = time.perf_counter()
            for i in range(count):
                delay = start + i * spacing - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                t = time.time()
                await queue.publish(topic, [PublishRequest(payload={"i": i, "t": t})])
                enq_durations.append(time.time() - t)
        finally:
            await queue.close()
        deadline = time.time() + limit_s
        lines: list[str] = []
        while time.time() < deadline:
            lines = read_lines(lat_path)
            if len(lines) >= count:
                break
            await asyncio.sleep(0.1)
        lats = sorted((float(b) - float(a)) * 1000.0 for a, b in (ln.split() for ln in lines))
        enq_durations.sort()
        return {
            "received": len(lats),
            "p50_ms": pct(lats, 50),
            "p99_ms": pct(lats, 99),
            "max_ms": lats[-1] if lats else None,
            "mean_ms": statistics.mean(lats) if lats else None,
            "publish_call_p50_ms": (pct(enq_durations, 50) or 0.0) * 1000.0,
        }
    finally:
        await stop_worker(proc)


def small_dsn(dsn: str) -> str:
    """The database of the small backlog: the large one's name with ``_small``."""
    base, mark, query = dsn.partition("?")
    return f"{base}_small{mark}{query}"


async def bench_backlogs(ctx: dict[str, Any], small: int, large: int, first_n: int
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The small and the large backlog, each in a database of its own and both there at once.

    Fill each (calls of --fill-batch), ANALYZE, CHECKPOINT; then --claim-calls claims of
    --claim-limit through ``queue.transport.claim`` on each, timed one by one and taken in turns
    (after 10 warm-up calls each; which of the two goes first alternates), so that what the
    machine does meanwhile weighs on both alike. Each fill holds that many extra deliveries, so
    ``small`` and ``large`` are still Pending after the claims. Then, per backlog, the processing
    of its next ``first_n`` deliveries (:func:`process_first`).
    """
    limit, calls, warm = ctx["claim_limit"], ctx["claim_calls"], 10
    extra = (warm + calls) * limit
    small_ctx = {**ctx, "dsn": ctx["small_dsn"]}
    fills = []
    for c, backlog in ((small_ctx, small), (ctx, large)):
        t0 = time.perf_counter()
        await prefill(c["dsn"], "none", backlog + extra, ctx["fill_batch"], checkpoint=True)
        fills.append(time.perf_counter() - t0)
    sub = CASES["none"][1][0]
    queues = [make_queue(c["dsn"], host=False) for c in (small_ctx, ctx)]
    times: list[list[float]] = [[], []]
    try:
        for queue in queues:
            await queue.open()
        for i in range(warm + calls):
            turn = list(zip(queues, times, strict=True))
            for queue, timed in turn if i % 2 else reversed(turn):  # which goes first alternates
                t = time.perf_counter()
                got = await queue.transport.claim(sub, limit)
                dt = time.perf_counter() - t
                if len(got) != limit:
                    raise RuntimeError(f"claim returned {len(got)} deliveries, expected {limit}")
                if i >= warm:
                    timed.append(dt * 1000.0)
    finally:
        for queue in queues:
            await queue.close()
    return (await process_first(small_ctx, "backlog_small", small, min(small, first_n), extra, fills[0], times[0]),
            await process_first(ctx, "backlog_large", large, min(large, first_n), extra, fills[1], times[1]))


async def process_first(ctx: dict[str, Any], label: str, backlog: int, first_n: int, extra: int, fill_s: float,
                        times: list[float]) -> dict[str, Any]:
    """ONE default worker on ``ctx``'s database, which holds ``backlog`` Pending after the ``extra``
    that the claims took: time from READY until the next ``first_n`` deliveries (in id order, which
    is claim order) are finished; the worker is stopped and the tables are emptied. The result
    carries the backlog's fill time and claim times."""
    dsn, limit, calls = ctx["dsn"], ctx["claim_limit"], ctx["claim_calls"]
    times = sorted(times)
    conn = await connect(dsn)
    proc = None
    try:
        await conn.execute("CHECKPOINT")
        lo = await conn.fetchval(
            "SELECT id FROM workqueue.delivery WHERE status = 'Pending' ORDER BY id LIMIT 1")
        hi = lo + first_n - 1
        mark = lo + max(1, first_n // 10) - 1
        proc, t_ready = await spawn_worker(ctx, "none", label)
        st_ready = read_proc_status(proc.pid)
        cur, t_mark, t_done, polls, inflight_max = lo, None, None, 0, 0
        av_seen: set[str] = set()
        deadline = time.time() + 900
        while time.time() < deadline:
            polls += 1
            nxt = await conn.fetchval(
                "SELECT id FROM workqueue.delivery WHERE id BETWEEN $1 AND $2 "
                "AND status IN ('Pending', 'InFlight') ORDER BY id LIMIT 1", cur, hi)
            now = time.time()
            av = await conn.fetchval(AV_SQL)
            if av:
                av_seen.update(x.strip() for x in av.split("|"))
            if polls % 20 == 1:  # about once a second: deliveries claimed and not yet settled
                inflight_max = max(inflight_max, await conn.fetchval(INFLIGHT_SQL) - extra)
            if t_mark is None and (nxt is None or nxt > mark):
                t_mark = now
            if nxt is None:
                t_done = now
                break
            cur = nxt
            if proc.returncode is not None:
                raise RuntimeError(f"{label}: worker exited early (rc={proc.returncode})")
            await asyncio.sleep(ctx["poll"])
        if t_done is None or t_mark is None:
            raise RuntimeError(f"{label}: processing timed out")
        fin = await finish_worker(proc)
        done_ok = await conn.fetchval(
            "SELECT count(*) FROM workqueue.delivery WHERE id BETWEEN $1 AND $2 AND status = 'Completed'", lo, hi)
        res = {
            "backlog": backlog,
            "first_n": first_n,
            "fill_rows": backlog + extra,
            "fill_seconds": fill_s,
            "claim_limit": limit,
            "claim_calls": calls,
            "claim_p10_ms": pct(times, 10),
            "claim_p50_ms": pct(times, 50),
            "claim_p90_ms": pct(times, 90),
            "claim_mean_ms": statistics.mean(times),
            "claim_min_ms": times[0],
            "deliveries_per_s": first_n / (t_done - t_ready),
            "seconds": t_done - t_ready,
            "deliveries_per_s_after_first_10pct": (first_n - (mark - lo + 1)) / (t_done - t_mark)
            if t_done > t_mark else None,
            "rss_at_ready_kib": st_ready.get("VmRSS"),
            "completed_in_first_n": done_ok,
            "inflight_max_sampled": inflight_max,
            "autovacuum_seen_while_timing": sorted(av_seen),
            "polls": polls,
            **fin,
        }
        if done_ok != first_n:
            res["warning"] = f"first-N verification failed: {done_ok} of {first_n} Completed"
        return res
    finally:
        if proc is not None:
            await stop_worker(proc)
        await conn.close()
        await reset(dsn)


async def bench_mem(ctx: dict[str, Any], n: int) -> dict[str, Any]:
    """Peak RSS of one default worker draining ``n`` deliveries."""
    dsn = ctx["dsn"]
    t0 = time.perf_counter()
    await prefill(dsn, "none", n, ctx["fill_batch"], checkpoint=True)
    fill_s = time.perf_counter() - t0
    conn = await connect(dsn)
    proc = None
    try:
        proc, t_ready = await spawn_worker(ctx, "none", "mem")
        st_ready = read_proc_status(proc.pid)
        hwm_sampled = st_ready.get("VmHWM", 0)
        cur, t_done, polls, inflight_max = 1, None, 0, 0
        av_seen: set[str] = set()
        deadline = time.time() + 1800
        while time.time() < deadline:
            polls += 1
            nxt = await conn.fetchval(
                "SELECT id FROM workqueue.delivery WHERE id BETWEEN $1 AND $2 "
                "AND status IN ('Pending', 'InFlight') ORDER BY id LIMIT 1", cur, n)
            av = await conn.fetchval(AV_SQL)
            if av:
                av_seen.update(x.strip() for x in av.split("|"))
            if polls % 20 == 1:  # about once a second: deliveries claimed and not yet settled
                inflight_max = max(inflight_max, await conn.fetchval(INFLIGHT_SQL))
            hwm_sampled = max(hwm_sampled, read_proc_status(proc.pid).get("VmHWM", 0))
            if nxt is None:
                t_done = time.time()
                break
            cur = nxt
            if proc.returncode is not None:
                raise RuntimeError(f"mem: worker exited early (rc={proc.returncode})")
            await asyncio.sleep(ctx["poll"])
        if t_done is None:
            raise RuntimeError("mem: processing timed out")
        fin = await finish_worker(proc)
        completed = await conn.fetchval(COMPLETED_SQL)
        res = {
            "deliveries": n,
            "fill_seconds": fill_s,
            "deliveries_per_s": n / (t_done - t_ready),
            "seconds": t_done - t_ready,
            "rss_at_ready_kib": st_ready.get("VmRSS"),
            "hwm_at_ready_kib": st_ready.get("VmHWM"),
            "hwm_sampled_kib": hwm_sampled,
            "vmhwm_kib": fin["mem"]["vmhwm_kib"] if fin["mem"] else hwm_sampled,
            "completed_in_db": completed,
            "inflight_max_sampled": inflight_max,
            "autovacuum_seen_while_timing": sorted(av_seen),
            "polls": polls,
            **fin,
        }
        if completed != n:
            res["warning"] = f"expected {n} completed, db has {completed}"
        return res
    finally:
        if proc is not None:
            await stop_worker(proc)
        await conn.close()
        await reset(dsn)


# ---------------------------------------------------------------- driver
ALL_CASES = "publish,process,latency,exclusive,ordered,fanout,backlog,mem"


def summarize_raw(raw: dict[str, list[Any]]) -> dict[str, Any]:
    """Median/min/max of every headline figure (also used by run.py on merged rounds)."""
    s: dict[str, Any] = {}

    def col(key: str, field: str) -> list[Any]:
        return [x.get(field) if isinstance(x, dict) else None for x in raw.get(key, [])]

    for key in ("publish_seq_msgs_per_s", "publish_batch_msgs_per_s"):
        if raw.get(key):
            s[key] = summarize(raw[key])
    for key in raw:
        if key.startswith("process_") or key in ("keyed_none", "exclusive", "ordered", "fanout"):
            s[f"{key}_deliveries_per_s"] = summarize(col(key, "deliveries_per_s"))
    if raw.get("fanout"):
        s["fanout_publish_messages_per_s"] = summarize(col("fanout", "prefill_messages_per_s"))
        s["fanout_publish_deliveries_per_s"] = summarize(col("fanout", "prefill_deliveries_per_s"))
    if raw.get("latency"):
        s["latency_p50_ms"] = summarize(col("latency", "p50_ms"))
        s["latency_p99_ms"] = summarize(col("latency", "p99_ms"))
        s["latency_publish_call_p50_ms"] = summarize(col("latency", "publish_call_p50_ms"))
    none = s.get("process_default_deliveries_per_s")
    for key in ("exclusive", "ordered", "fanout"):
        base = s.get("keyed_none_deliveries_per_s") if key != "fanout" else none
        if base and s.get(f"{key}_deliveries_per_s"):
            s[f"{key}_over_none"] = s[f"{key}_deliveries_per_s"]["median"] / base["median"]
    for key in ("backlog_small", "backlog_large"):
        if raw.get(key):
            for field in ("claim_p10_ms", "claim_p50_ms", "claim_mean_ms", "deliveries_per_s",
                          "deliveries_per_s_after_first_10pct", "fill_seconds"):
                s[f"{key}_{field}"] = summarize(col(key, field))
    if raw.get("backlog_small") and raw.get("backlog_large"):
        s["claim_large_over_small"] = (s["backlog_large_claim_p50_ms"]["median"]
                                       / s["backlog_small_claim_p50_ms"]["median"])
        s["claim_large_over_small_per_repeat"] = summarize(
            [b["claim_p50_ms"] / a["claim_p50_ms"] for a, b in zip(raw["backlog_small"], raw["backlog_large"],
                                                                   strict=False)])
        if s.get("backlog_small_claim_p10_ms") and s.get("backlog_large_claim_p10_ms"):
            s["claim_p10_large_over_small"] = (s["backlog_large_claim_p10_ms"]["median"]
                                               / s["backlog_small_claim_p10_ms"]["median"])
        s["processing_small_over_large"] = (s["backlog_small_deliveries_per_s"]["median"]
                                            / s["backlog_large_deliveries_per_s"]["median"])
    if raw.get("mem"):
        s["mem_vmhwm_kib"] = summarize(col("mem", "vmhwm_kib"))
        s["mem_rss_at_ready_kib"] = summarize(col("mem", "rss_at_ready_kib"))
        s["mem_deliveries_per_s"] = summarize(col("mem", "deliveries_per_s"))
        s["mem_fill_seconds"] = summarize(col("mem", "fill_seconds"))
    return s


def compile_library() -> None:
    """Writes the library's bytecode, as installing it does (the peers run installed, compiled):
    from a checkout with PYTHONDONTWRITEBYTECODE=1 each worker would compile every module it
    imports as it starts, which costs start-up time and about 1.5 MB of its memory (bench/README.md)."""
    import compileall

    import fastapi_workqueue

    compileall.compile_dir(str(Path(fastapi_workqueue.__file__).parent), quiet=1)
    compileall.compile_file(str(SCRIPT), quiet=1)


async def run_all(args: argparse.Namespace) -> None:
    import importlib.metadata

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out.parent / "logs"
    log_dir.mkdir(exist_ok=True)
    ctx: dict[str, Any] = {
        "dsn": args.dsn, "loop": args.loop or default_loop(), "out_dir": out.parent, "log_dir": log_dir,
        "batch": args.batch, "fill_batch": args.fill_batch, "poll": args.poll,
        "claim_limit": args.claim_limit, "claim_calls": args.claim_calls,
    }
    compile_library()
    await ensure_database(args.dsn)
    if "backlog" in args.only.split(","):
        ctx["small_dsn"] = small_dsn(args.dsn)
        await ensure_database(ctx["small_dsn"], fresh=True)
    conn = await connect(args.dsn)
    server_version = await conn.fetchval("SHOW server_version")
    migrations = [r["name"] for r in await conn.fetch("SELECT name FROM workqueue.schema_migration ORDER BY version")]
    await conn.close()

    which = [w for w in args.only.split(",") if w]
    unknown = set(which) - set(ALL_CASES.split(","))
    if unknown:
        raise SystemExit(f"unknown cases: {sorted(unknown)}")
    raw: dict[str, list[Any]] = {}
    conc = args.concurrency

    async def bounded(coro: Any, limit_s: float) -> Any:
        return await asyncio.wait_for(coro, timeout=limit_s)

    def record(key: str, value: Any, r: int) -> None:
        raw.setdefault(key, []).append(value)
        shown = f"{value:.0f}" if isinstance(value, float) else json.dumps(value)
        print(f"[run {r + 1}] {key}: {shown}", flush=True)

    for r in range(args.repeats):
        if "publish" in which:
            record("publish_seq_msgs_per_s", await bounded(bench_publish_seq(ctx, args.jobs), 600), r)
            record("publish_batch_msgs_per_s", await bounded(bench_publish_batch(ctx, args.jobs, args.batch), 300), r)
        if "process" in which:
            record(f"process_c{conc}", await bounded(bench_process(ctx, "none", f"process_c{conc}", args.jobs, conc),
                                                     900), r)
            record("process_default", await bounded(bench_process(ctx, "none", "process_default", args.jobs), 900), r)
        if "latency" in which:
            record("latency", await bounded(bench_latency(ctx, args.lat_count, args.lat_spacing), 300), r)
        if "exclusive" in which or "ordered" in which:
            # The keyed cases and the None case they are compared with, at --keyed-jobs: long enough
            # that what a run pays once (start, the last poll) does not decide the ratio.
            record("keyed_none", await bounded(bench_process(ctx, "none", "keyed_none", args.keyed_jobs), 900), r)
        for case in ("exclusive", "ordered"):
            if case in which:
                record(case, await bounded(bench_process(ctx, case, case, args.keyed_jobs, keys=args.keys), 900), r)
        if "fanout" in which:
            record("fanout", await bounded(bench_process(ctx, "fanout", "fanout", max(1, args.jobs // FANOUT)), 900), r)
    for r in range(args.slow_repeats if args.slow_repeats is not None else args.repeats):
        if "backlog" in which:
            small, large = await bounded(bench_backlogs(ctx, args.small, args.large, args.first_n), 5400)
            record("backlog_small", small, r)
            record("backlog_large", large, r)
        if "mem" in which:
            record("mem", await bounded(bench_mem(ctx, args.mem_jobs), 3600), r)
    await reset(args.dsn)

    import fastapi_workqueue

    versions = {}
    for pkg in ("fastapi-workqueue", "asyncpg", "uvloop", "pydantic", "fastapi"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    summary = summarize_raw(raw)
    result = {
        "library": "fastapi-workqueue",
        "versions": versions,
        "python": platform.python_version(),
        "postgres": server_version,
        "migrations": migrations,
        "library_path": str(Path(fastapi_workqueue.__file__).parent),
        "settings": {
            "jobs": args.jobs, "batch": args.batch, "concurrency_run": f"SubscriptionPlan(concurrency={conc})",
            "repeats": args.repeats, "slow_repeats": args.slow_repeats, "latency_count": args.lat_count,
            "latency_spacing_s": args.lat_spacing, "keys": args.keys, "keyed_jobs": args.keyed_jobs,
            "fanout": FANOUT,
            "backlog_small": args.small, "backlog_large": args.large, "first_n": args.first_n,
            "mem_jobs": args.mem_jobs, "fill_batch": args.fill_batch, "claim_limit": args.claim_limit,
            "claim_calls": args.claim_calls, "poll_s_backlog_mem": args.poll, "poll_s_process": 0.1,
            "worker_defaults": "WorkQueueSettings(database_url=...) only: subscriptions=[SubscriptionPlan()] "
            "(name '*', concurrency 4), pool_size 10, listen True, idle poll 250-5000 ms, sweeper and "
            "reconcile loops on; Subscription defaults (lease 60 s, Auto heartbeats)",
            "handler": "async def noop(message: WorkMessage[Item]) -> None (Item: pydantic model {i: int, t: float?})",
            "worker_event_loop": ctx["loop"],
            "producer_event_loop": "asyncio (stdlib)",
            "uses_listen_notify": True,
            "stripped_env": STRIPPED_ENV,
        },
        "summary": summary,
        "raw": raw,
    }
    out.write_text(json.dumps(result, indent=2))  # noqa: ASYNC240
    print(json.dumps(summary, indent=2))


async def main_with_signals(args: argparse.Namespace) -> None:
    """SIGTERM/SIGINT cancel the run, so every worker started so far is stopped by the finally blocks."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    await run_all(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("_worker", help="internal: run one worker process")
    w.add_argument("--dsn", default=DEFAULT_DSN)
    w.add_argument("--case", choices=sorted(CASES), default="none")
    w.add_argument("--loop", choices=["uvloop", "asyncio"], default=default_loop())
    w.add_argument("--concurrency", type=int, default=None)
    w.add_argument("--latency-file", default=None)

    ap.add_argument("--dsn", default=DEFAULT_DSN)
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slow-repeats", type=int, default=None, help="repeats of backlog and mem (default: --repeats)")
    ap.add_argument("--lat-count", type=int, default=200)
    ap.add_argument("--lat-spacing", type=float, default=0.020)
    ap.add_argument("--keys", type=int, default=500, help="partition keys of the Exclusive and Ordered cases")
    ap.add_argument("--keyed-jobs", type=int, default=100_000,
                    help="deliveries of the Exclusive and Ordered cases and of the None case they are compared with")
    ap.add_argument("--small", type=int, default=10_000, help="small backlog")
    ap.add_argument("--large", type=int, default=1_000_000, help="large backlog")
    ap.add_argument("--first-n", type=int, default=20_000, help="deliveries timed per backlog run")
    ap.add_argument("--mem-jobs", type=int, default=100_000)
    ap.add_argument("--fill-batch", type=int, default=5000, help="publish batch of the backlog and mem fills")
    ap.add_argument("--claim-limit", type=int, default=4, help="deliveries per timed claim call")
    ap.add_argument("--claim-calls", type=int, default=250, help="timed claim calls per backlog run")
    ap.add_argument("--poll", type=float, default=0.05, help="poll interval of the backlog and mem cases (s)")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default=None,
                    help="worker event loop (default: uvloop if installed)")
    ap.add_argument("--only", default=ALL_CASES)
    ap.add_argument("--out", default=str(HERE / "results" / "workqueue.json"))
    ap.add_argument("--max-in-flight", type=int, default=None,
                    help="give every subscription this max_in_flight (the cost of a limit never reached)")
    args = ap.parse_args()
    if getattr(args, "max_in_flight", None):
        os.environ[MAX_IN_FLIGHT_ENV] = str(args.max_in_flight)
    if args.cmd == "_worker":
        worker_main(args)
    else:
        asyncio.run(main_with_signals(args))


if __name__ == "__main__":
    main()
