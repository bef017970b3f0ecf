#!/usr/bin/env python3
"""The jobs benchmark: the jobs layer against the core it is built on, and against pgqueuer.

    .venv/bin/python bench/jobs/jobs_bench.py            # full run: 5 rounds, about 15 min
    .venv/bin/python bench/jobs/jobs_bench.py --smoke    # tiny counts, 1 round, no peer, under a minute

Every round measures, in one process (``_round``), each pair of cases one after the other
(which goes first alternates by round):

  dispatch_seq / publish_seq      N x ``await queue.dispatch(job, {"i": i})`` vs N x the core's
                                  ``await queue.publish(topic, [PublishRequest(payload={"i": i})])``
                                  (100 warm-ups each), interleaved in turns of 500 (who goes
                                  first alternates by turn), each side's turns timed apart.
  bulk / publish_batch            calls of ``queue.bulk`` with 500 jobs vs the core's publish of 500,
                                  interleaved in turns of 10 calls.
  jobs_five                       N jobs spread over five queues, one worker taking them
                                  fairly (no queue list: every queue, fairly), vs jobs_process.
  jobs_process / process_default  N no-op jobs (resp. deliveries) pre-filled, then ONE worker
    / pgqueuer                    process at the library's defaults; N / (done - READY); and
                                  pgqueuer's processing case at its defaults
                                  (``bench/compare/peers/bench_pgqueuer.py --only process``, its own venv,
                                  as ``bench/compare/run.py`` does); in ``--turns`` turns a round (3), who
                                  goes first rotating by turn, each side's items over its turns'
                                  seconds.

The core cases are ``bench/compare/workqueue_bench.py``'s own
functions, on a database of their own; the jobs cases use the same timing points. Medians over
the rounds, the ratios and the targets go to ``--out`` (default ``bench/jobs/results``):
``results.json``, ``results.md``, ``run.log`` and, unless ``--no-chart``, ``results.png``.
"""

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the repository
COMPARE = HERE.parent / "compare"  # the core benchmark this one reuses
sys.path[:0] = [str(HERE), str(COMPARE)]

import run as core_run  # noqa: E402
import workqueue_bench as core  # noqa: E402  (strips WORKQUEUE_* from the environment)
from pydantic import BaseModel  # noqa: E402

from fastapi_workqueue import JobContext, WorkQueue, WorkQueueSettings  # noqa: E402

SCRIPT = Path(__file__).resolve()
FIVE = ("a", "b", "c", "d", "e")
ONE = ("default",)
FULL = {"jobs": 40000, "dispatches": 20000, "bulk_jobs": 100000, "batch": 500, "turns": 3}
SMOKE = {"jobs": 300, "dispatches": 300, "bulk_jobs": 300, "batch": 100, "turns": 2}
"""Items per case: ``jobs`` processed (and pgqueuer's), ``dispatches`` one per call, ``bulk_jobs`` in
calls of ``batch``: each case of the full run measures for two seconds or more."""
WARMUPS = 100
CORE_DB_SUFFIX = "_core"
FIVE_DB_SUFFIX = "_five"
"""The five-queue case has a database of its own: the one-queue case's holds only ``default``'s
subscription, as a deployment with one job queue does (its worker claims like the core's)."""


class Item(BaseModel):
    """The payload of every benchmark job (the core cases' ``Item`` without the latency field)."""

    i: int


# ---------------------------------------------------------------- the jobs queue
def make_jobs_queue(dsn: str, queues: tuple[str, ...], *, host: bool) -> tuple[WorkQueue, dict[str, Any]]:
    """A queue with one no-op job per job queue (``bench.noop.<queue>``); returns it and the jobs."""
    settings: dict[str, Any] = {"database_url": dsn}
    if not host:
        settings["enabled"] = False  # a producer-only process
    queue = WorkQueue(WorkQueueSettings(**settings))
    counter = [0]
    jobs: dict[str, Any] = {"counter": counter}
    for name in queues:

        async def noop(payload: Item, job: JobContext) -> None:
            counter[0] += 1

        queue.job(f"bench.noop.{name}", queue=name)(noop)
        jobs[name] = noop
    return queue, jobs


async def fill_jobs(dsn: str, queues: tuple[str, ...], n: int, batch: int) -> float:
    """Empties the tables and queues ``n`` jobs round-robin over ``queues`` with ``bulk``; returns seconds."""
    await core.reset(dsn)
    queue, jobs = make_jobs_queue(dsn, queues, host=False)
    await queue.open()
    try:
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            items = [(jobs[queues[i % len(queues)]], {"i": i}) for i in range(start, min(n, start + batch))]
            await queue.bulk(items)
        seconds = time.perf_counter() - t0
    finally:
        await queue.close()
    await core.analyze(dsn)
    return seconds


SEQ_CHUNK = 500
"""Dispatches (and core publishes) per turn of the interleaved one-per-call case."""
BULK_CALLS = 10
"""Calls of ``batch`` items per side and turn of the interleaved bulk case."""

Turn = Callable[[int, int], Awaitable[None]]
"""One side's work of a turn: ``count`` items numbered from ``start``."""


async def timed_turns(sides: dict[str, Turn], n: int, chunk: int, first: str) -> dict[str, float]:
    """Runs ``n`` items of each side in turns of ``chunk``, who goes first alternating by turn
    (``first`` the first turn), and returns each side's seconds. A shared machine's speed and
    commit latency drift over seconds; taking turns puts both sides through the same stretches."""
    order = [first, next(side for side in sides if side != first)]
    spent = dict.fromkeys(sides, 0.0)
    for turn, start in enumerate(range(0, n, chunk)):
        count = min(chunk, n - start)
        for side in order if turn % 2 == 0 else reversed(order):
            t0 = time.perf_counter()
            await sides[side](start, count)
            spent[side] += time.perf_counter() - t0
    return spent


@contextlib.asynccontextmanager
async def producers(dsn: str, core_dsn: str) -> AsyncIterator[tuple[Any, Any, WorkQueue, str]]:
    """Both tables emptied, then (jobs queue, its no-op job, core producer, core topic), open;
    closed on the way out."""
    await core.reset(dsn)
    await core.reset(core_dsn)
    queue, jobs = make_jobs_queue(dsn, ONE, host=False)
    producer = core.make_queue(core_dsn, host=False)
    await queue.open()
    await producer.open()
    try:
        yield queue, jobs[ONE[0]], producer, core.CASES["none"][0]
    finally:
        await queue.close()
        await producer.close()


async def bench_seq_interleaved(dsn: str, core_ctx: dict[str, Any], n: int, first: str) -> tuple[float, float]:
    """``n`` dispatches one per call and ``n`` core publishes one per call, in turns of
    ``SEQ_CHUNK`` (:func:`timed_turns`): a call at a time is bound by each commit's flush.
    Returns (jobs/s, messages/s)."""
    from fastapi_workqueue import PublishRequest

    async with producers(dsn, core_ctx["dsn"]) as (queue, job, producer, topic):

        async def dispatch(start: int, count: int) -> None:
            for i in range(start, start + count):
                if await queue.dispatch(job, {"i": i}) is None:
                    raise RuntimeError("dispatch returned no job id")

        async def publish(start: int, count: int) -> None:
            for i in range(start, start + count):
                [result] = await producer.publish(topic, [PublishRequest(payload={"i": i})])
                if not result.ok:
                    raise RuntimeError(f"publish refused: {result}")

        await dispatch(-WARMUPS, WARMUPS)
        await publish(-WARMUPS, WARMUPS)
        spent = await timed_turns({"jobs": dispatch, "core": publish}, n, SEQ_CHUNK, first)
    return n / spent["jobs"], n / spent["core"]


async def bench_bulk_interleaved(dsn: str, core_ctx: dict[str, Any], n: int, batch: int,
                                 first: str) -> tuple[float, float]:
    """``n`` jobs in calls of ``queue.bulk`` with ``batch`` jobs and ``n`` core messages in
    publishes of ``batch`` (one warm-up call each), in turns of ``BULK_CALLS`` calls
    (:func:`timed_turns`). Returns (jobs/s, messages/s)."""
    async with producers(dsn, core_ctx["dsn"]) as (queue, job, producer, topic):

        async def bulk(start: int, count: int) -> None:
            for at in range(start, start + count, batch):
                size = min(batch, start + count - at)
                ids = await queue.bulk([(job, {"i": i}) for i in range(at, at + size)])
                if len(ids) != size:
                    raise RuntimeError(f"bulk queued {len(ids)} jobs")

        async def publish(start: int, count: int) -> None:
            await core.publish_batches(producer, topic, count, batch)

        await bulk(-batch, batch)
        await publish(0, batch)
        spent = await timed_turns({"jobs": bulk, "core": publish}, n, batch * BULK_CALLS, first)
    return n / spent["jobs"], n / spent["core"]


# ---------------------------------------------------------------- worker process
def worker_main(args: argparse.Namespace) -> None:
    """Runs in the child process: ONE worker, the queue's lifespan with its host at the defaults."""
    queues = tuple(args.queues.split(","))

    async def main() -> None:
        queue, jobs = make_jobs_queue(args.dsn, queues, host=True)
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
        await queue.open()
        print(f"READY {time.time()!r}", flush=True)
        try:
            async with queue.lifespan(None):  # the host: the job queues' group consumer, sweeper, reconcile
                await stop.wait()
        finally:
            guard.cancel()
            await queue.close()
        print(f"DONE {jobs['counter'][0]} {time.time()!r}", flush=True)

    if args.loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


async def bench_jobs_process(ctx: dict[str, Any], queues: tuple[str, ...], label: str, n: int,
                             limit_s: float = 300.0) -> dict[str, Any]:
    """Pre-fill ``n`` jobs over ``queues``, ONE worker, poll (100 ms) until none waits or runs."""
    dsn = ctx["dsn"]
    fill_s = await fill_jobs(dsn, queues, n, ctx["batch"])
    cmd = [sys.executable, str(SCRIPT), "_worker", "--dsn", dsn, "--queues", ",".join(queues), "--loop", ctx["loop"]]
    conn = await core.connect(dsn)
    errf = core.open_log(ctx["log_dir"] / f"jobs_{label}.log")
    try:
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=errf)
    finally:
        errf.close()
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)  # type: ignore[union-attr]
        parts = line.decode().split()
        if not parts or parts[0] != "READY":
            raise RuntimeError(f"worker did not start: {line!r} (see {ctx['log_dir']}/jobs_{label}.log)")
        t_ready = float(parts[1])
        deadline, t_done, polls = time.time() + limit_s, None, 0
        while time.time() < deadline:
            polls += 1
            if await conn.fetchval(core.PENDING_SQL) == 0:
                t_done = time.time()
                break
            if proc.returncode is not None:
                raise RuntimeError(f"{label}: worker exited early (rc={proc.returncode})")
            await asyncio.sleep(0.1)
        if t_done is None:
            raise RuntimeError(f"{label}: processing timed out after {limit_s}s")
        fin = await core.finish_worker(proc)
        completed = await conn.fetchval(core.COMPLETED_SQL)
        res = {
            "deliveries_per_s": n / (t_done - t_ready), "seconds": t_done - t_ready, "jobs": n,
            "deliveries": n, "queues": list(queues), "prefill_bulk_seconds": fill_s, "completed_in_db": completed,
            "polls": polls, **fin,
        }
        if completed != n or (fin["handled"] is not None and fin["handled"] < n):
            res["warning"] = f"expected {n} completed, db has {completed}, handled {fin['handled']}"
        return res
    finally:
        await core.stop_worker(proc)
        await conn.close()


PROCESS_TURNS = 3
"""Turns per round of the processing cases (one queue's jobs, the core's subscription, pgqueuer's worker)."""


def combine_turns(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """One processing figure from a round's turns: every turn's deliveries over every turn's
    seconds (each turn timed from its worker's READY to its last settle), the turns kept."""
    deliveries = sum(t["deliveries"] for t in turns)
    seconds = sum(t["seconds"] for t in turns)
    warnings = [t["warning"] for t in turns if t.get("warning")]
    out: dict[str, Any] = {"deliveries_per_s": deliveries / seconds, "seconds": seconds, "deliveries": deliveries,
                           "completed_in_db": sum(t["completed_in_db"] for t in turns), "turns": turns}
    if warnings:
        out["warning"] = "; ".join(warnings)
    return out


async def pgqueuer_process(peer: dict[str, Any], n: int, batch: int, label: str) -> dict[str, Any]:
    """One run of pgqueuer's processing case at its defaults (``bench/compare/peers/bench_pgqueuer.py
    --only process --repeats 1``, in its own venv): its ``process_default`` figure, with the
    pgqueuer version and settings it reports."""
    out = peer["log_dir"] / f"pgqueuer_{label}.json"
    errf = core.open_log(peer["log_dir"] / f"pgqueuer_{label}.log")
    try:
        proc = await asyncio.create_subprocess_exec(
            peer["python"], str(COMPARE / "peers" / core_run.PEERS["pgqueuer"]["script"]), "--dsn", peer["dsn"],
            "--jobs", str(n), "--batch", str(batch), "--repeats", "1", "--only", "process", "--out", str(out),
            stdout=errf, stderr=errf)
    finally:
        errf.close()
    if await proc.wait() != 0:
        raise RuntimeError(f"pgqueuer's processing case exited {proc.returncode} (see {peer['log_dir']})")
    doc = json.loads(out.read_text())
    [run] = doc["raw"]["process_default"]
    return {**run, "version": doc.get("version"), "settings": doc.get("settings")}


async def bench_process_interleaved(jobs_ctx: dict[str, Any], core_ctx: dict[str, Any], n: int, turns: int,
                                    first: str, peer: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """``turns`` turns of the processing cases, ``n`` items each side a turn: one queue's jobs,
    the core's subscription and, with ``peer``, pgqueuer's default worker. Who goes first
    rotates by turn (``first`` the first turn): one worker's rate moves by a fifth and more from
    one stretch of seconds to the next on a shared machine, so every side is timed through the
    same stretches, as the one-per-call case is. Returns each side's turns combined, by side."""
    cases: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
        "jobs": lambda: bench_jobs_process(jobs_ctx, ONE, "jobs_process", n),
        "core": lambda: core.bench_process(core_ctx, "none", "process_default", n),
    }
    if peer is not None:
        cases["pgqueuer"] = lambda: pgqueuer_process(peer, n, jobs_ctx["batch"], "process_default")
    sides = list(cases)
    sides.insert(0, sides.pop(sides.index(first)))
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for turn in range(turns):
        for side in sides[turn % len(sides):] + sides[:turn % len(sides)]:
            runs[side].append(await asyncio.wait_for(cases[side](), timeout=900))
    combined = {side: combine_turns(runs[side]) for side in ("jobs", "core")}
    if peer is not None:
        pg = runs["pgqueuer"]
        combined["pgqueuer"] = {"jobs_per_s": n * len(pg) / sum(t["seconds"] for t in pg),
                                "seconds": sum(t["seconds"] for t in pg), "jobs": n * len(pg), "turns": pg,
                                "version": pg[0]["version"], "settings": pg[0]["settings"]}
    return combined


# ---------------------------------------------------------------- one round
async def round_main(args: argparse.Namespace) -> None:
    """One round of every case (jobs on --dsn, the core on --core-dsn); JSON to --out."""
    out = Path(args.out)
    log_dir = out.parent / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    loop = args.loop or core.default_loop()
    jobs_ctx: dict[str, Any] = {"dsn": args.dsn, "loop": loop, "log_dir": log_dir, "batch": args.batch}
    five_ctx: dict[str, Any] = {**jobs_ctx, "dsn": args.five_dsn}
    core_ctx: dict[str, Any] = {"dsn": args.core_dsn, "loop": loop, "log_dir": log_dir, "out_dir": out.parent,
                                "batch": args.batch}
    await core.ensure_database(args.core_dsn)
    for dsn, queues in ((args.dsn, ONE), (args.five_dsn, FIVE)):
        queue, _ = make_jobs_queue(dsn, queues, host=False)
        await queue.migrate()
        await queue.open()  # writes the job queues' topics and subscriptions
        await queue.close()

    n, batch = args.jobs, args.batch
    dispatches, bulk_n = args.dispatches or n, args.bulk_jobs or n
    raw: dict[str, list[Any]] = {}
    first = "jobs" if args.round % 2 else "core"
    jobs_rate, core_rate = await asyncio.wait_for(
        bench_seq_interleaved(args.dsn, core_ctx, dispatches, first), timeout=900)
    for key, value in (("dispatch_seq_jobs_per_s", jobs_rate), ("publish_seq_msgs_per_s", core_rate)):
        raw.setdefault(key, []).append(value)
        print(f"[round {args.round}] {key}: {value:.0f} (interleaved)", flush=True)
    jobs_rate, core_rate = await asyncio.wait_for(
        bench_bulk_interleaved(args.dsn, core_ctx, bulk_n, batch, first), timeout=900)
    for key, value in (("bulk_jobs_per_s", jobs_rate), ("publish_batch_msgs_per_s", core_rate)):
        raw.setdefault(key, []).append(value)
        print(f"[round {args.round}] {key}: {value:.0f} (interleaved)", flush=True)
    peer = None
    if args.peer_python:
        peer = {"python": args.peer_python, "dsn": args.peer_dsn, "log_dir": log_dir}
    processed = await bench_process_interleaved(jobs_ctx, core_ctx, n, args.turns, first, peer)
    for key, side in (("jobs_process", "jobs"), ("process_default", "core"), ("pgqueuer_process", "pgqueuer")):
        if side not in processed:
            continue
        value = processed[side]
        raw.setdefault(key, []).append(value)
        rate = "jobs_per_s" if side == "pgqueuer" else "deliveries_per_s"
        turns = ", ".join(f"{t[rate]:.0f}" for t in value["turns"])
        print(f"[round {args.round}] {key}: {value[rate]:.0f} over {args.turns} turns ({turns})", flush=True)
    five = await asyncio.wait_for(bench_jobs_process(five_ctx, FIVE, "jobs_five", n), timeout=900)
    raw.setdefault("jobs_five", []).append(five)
    print(f"[round {args.round}] jobs_five: {json.dumps(five)}", flush=True)
    for dsn in (args.dsn, args.five_dsn, args.core_dsn):
        await core.reset(dsn)
    import importlib.metadata

    versions = {}
    for pkg in ("fastapi-workqueue", "asyncpg", "uvloop", "pydantic"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    out.write_text(json.dumps({"raw": raw, "versions": versions, "worker_event_loop": loop}, indent=2))  # noqa: ASYNC240


# ---------------------------------------------------------------- summary and report
def summarize(raw: dict[str, list[Any]]) -> dict[str, Any]:
    """Median/min/max of every figure over the rounds."""
    s: dict[str, Any] = {}
    for key in ("dispatch_seq_jobs_per_s", "publish_seq_msgs_per_s", "bulk_jobs_per_s", "publish_batch_msgs_per_s"):
        if raw.get(key):
            s[key] = core.summarize(raw[key])
    for key in ("jobs_process", "process_default", "jobs_five"):
        if raw.get(key):
            s[f"{key}_per_s"] = core.summarize([x.get("deliveries_per_s") for x in raw[key]])
    return s


def per_round(raw: dict[str, list[Any]], key: str) -> list[float | None]:
    """One figure per round, in round order (processing cases: their deliveries/s)."""
    values = raw.get(key) or []
    return [v.get("deliveries_per_s") if isinstance(v, dict) else v for v in values]


def targets_of(ours: dict[str, Any], pgq: dict[str, Any], batch: int, raw: dict[str, list[Any]] | None = None,
               praw: dict[str, list[Any]] | None = None) -> list[dict[str, Any]]:
    """The targets, each read as the ratio of the two medians; ``rounds`` lists the same ratio
    round by round (from ``raw`` and the peer's ``praw``) and ``rounds_median`` its median."""
    raw, praw = raw or {}, praw or {}

    def med(key: str, where: dict[str, Any] = ours) -> float | None:
        stat = where.get(key)
        return None if not stat else stat["median"]

    def target(name: str, a: float | None, b: float | None, limit: float, detail: str,
               rounds: list[float]) -> dict[str, Any]:
        value = core_run.ratio(a, b)
        return {"target": name, "value": value, "limit": limit, "op": ">=", "unit": "×", "detail": detail,
                "met": None if value is None else value >= limit, "rounds": rounds,
                "rounds_median": statistics.median(rounds) if rounds else None}

    one, five = med("jobs_process_per_s"), med("jobs_five_per_s")
    pgq_rounds = [x.get("jobs_per_s") for x in praw.get("process_default") or []]
    return [
        target("dispatch, one per call, vs the core's publish", med("dispatch_seq_jobs_per_s"),
               med("publish_seq_msgs_per_s"), 0.95, "jobs/s over messages/s",
               core_run.paired_ratios(per_round(raw, "dispatch_seq_jobs_per_s"),
                                      per_round(raw, "publish_seq_msgs_per_s"))),
        target(f"bulk of {batch} vs the core's batch publish of {batch}", med("bulk_jobs_per_s"),
               med("publish_batch_msgs_per_s"), 0.95, "jobs/s over messages/s",
               core_run.paired_ratios(per_round(raw, "bulk_jobs_per_s"), per_round(raw, "publish_batch_msgs_per_s"))),
        target("processing no-op jobs at the defaults vs the core's subscription", one,
               med("process_default_per_s"), 0.85, "jobs/s over deliveries/s",
               core_run.paired_ratios(per_round(raw, "jobs_process"), per_round(raw, "process_default"))),
        target("processing no-op jobs at the defaults vs pgqueuer's defaults", one,
               med("process_default_jobs_per_s", pgq), 2.0, "jobs/s over pgqueuer's jobs/s",
               core_run.paired_ratios(per_round(raw, "jobs_process"), pgq_rounds)),
        target("five queues taken fairly vs one queue (loss at most 15 %)", five, one, 0.85,
               "jobs/s over jobs/s, same total",
               core_run.paired_ratios(per_round(raw, "jobs_five"), per_round(raw, "jobs_process"))),
    ]


def report(result: dict[str, Any]) -> str:
    ours = result["jobs"]["summary"]
    pgq = (result.get("pgqueuer") or {}).get("summary") or {}
    batch = result["settings"]["batch"]
    fmt, num = core_run.fmt_stat, core_run.fmt_num
    rows = [
        ("dispatch, one per call (jobs/s)", ours.get("dispatch_seq_jobs_per_s"),
         "core publish, one per call (msgs/s)", ours.get("publish_seq_msgs_per_s")),
        (f"bulk of {batch} (jobs/s)", ours.get("bulk_jobs_per_s"),
         f"core publish, batches of {batch} (msgs/s)", ours.get("publish_batch_msgs_per_s")),
        ("processing no-op jobs, defaults (jobs/s)", ours.get("jobs_process_per_s"),
         "core no-op subscription, defaults (deliveries/s)", ours.get("process_default_per_s")),
        ("processing no-op jobs, defaults (jobs/s)", ours.get("jobs_process_per_s"),
         f"pgqueuer {result['versions'].get('pgqueuer') or '(not run)'}, defaults (jobs/s)",
         pgq.get("process_default_jobs_per_s")),
        ("five queues taken fairly (jobs/s)", ours.get("jobs_five_per_s"),
         "one queue (jobs/s)", ours.get("jobs_process_per_s")),
    ]
    lines = ["| jobs case | median [min–max] | compared with | median [min–max] | ratio |",
             "| --- | --- | --- | --- | ---: |"]
    for label, a, other, b in rows:
        r = core_run.ratio(core_run.med(a), core_run.med(b))
        lines.append(f"| {label} | {fmt(a)} | {other} | {fmt(b)} | {num(r, 2)}× |")
    lines += ["", "| target | measured | round by round (median) | limit | met |",
              "| --- | --- | --- | --- | --- |"]
    for t in result["targets"]:
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}×"
        rounds = t.get("rounds") or []
        by_round = ("n/a" if not rounds else
                    f"{', '.join(f'{r:.2f}' for r in rounds)} ({t['rounds_median']:.2f}×)")
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {value} | {by_round} | ≥ {t['limit']:g}× | {met} |")
    return "\n".join(lines)


def chart(out: Path, peers_dir: Path, python: str, log: core_run.Log) -> None:
    py = core_run.ensure_venv(peers_dir, "chart", core_run.CHART_PIP, python, log)
    subprocess.run([str(py), str(HERE / "jobs_chart.py"), str(out / "results.json"), str(out / "results.png")],
                   check=True, timeout=300)
    log(f"chart: {out / 'results.png'}")


# ---------------------------------------------------------------- driver
def driver(args: argparse.Namespace) -> None:
    counts = dict(SMOKE if args.smoke else FULL)
    for key in FULL:
        if getattr(args, key) is not None:
            counts[key] = getattr(args, key)
    repeats = args.repeats or (1 if args.smoke else 5)
    run_peer = not args.skip_peers and (args.peers or not args.smoke)
    draw = args.chart if args.chart is not None else not args.smoke
    quiet = args.quiet_wait if args.quiet_wait is not None else (0.0 if args.smoke else 180.0)
    out = Path(args.out).resolve()
    rounds_dir = out / "rounds"
    rounds_dir.mkdir(parents=True, exist_ok=True)
    for old in rounds_dir.glob("*.json"):
        old.unlink()
    (out / "run.log").unlink(missing_ok=True)
    log = core_run.Log(out / "run.log")
    started = time.time()
    dsn = args.dsn or core_run.db_url(args.pg_url, "bench_jobs")
    core_dsn = args.core_dsn or dsn + CORE_DB_SUFFIX
    five_dsn = dsn + FIVE_DB_SUFFIX
    meta: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": core_run.git("rev-parse", "--short", "HEAD"),
        "library_changes_uncommitted": bool(core_run.git("status", "--porcelain", "--", "fastapi_workqueue", "sql")),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                 "loadavg_start": os.getloadavg()},
        "uptime_start": _uptime(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "mode": "smoke" if args.smoke else "full",
    }
    log(f"== jobs benchmark ({meta['mode']}) commit {meta['commit']} at {meta['date_utc']} UTC; {meta['uptime_start']}")
    log(f"   counts {counts}, repeats {repeats}, pgqueuer {run_peer}")
    for url in (dsn, five_dsn, core_dsn):  # fresh databases: the schema is the work tree's
        base, _, name = url.rpartition("/")
        core_run.ensure_databases(base, [name], log, recreate=True)
    peer = core_run.PEERS["pgqueuer"]
    peer_py = None
    peer_error = None
    if run_peer:
        core_run.ensure_databases(args.pg_url, [peer["db"]], log)
        try:
            peer_py = core_run.ensure_venv(Path(args.peers_dir), "pgqueuer", peer["pip"], args.peer_python, log)
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            peer_error = f"venv/install failed: {exc}"
            log(f"!! pgqueuer: {peer_error}")
    monitor = core_run.NoiseMonitor({u.rpartition("/")[2] for u in (dsn, five_dsn, core_dsn)} | {peer["db"]})
    monitor.start()
    noise: list[dict[str, Any]] = []
    failures: list[str] = []
    ours_files: list[Path] = []
    for r in range(1, repeats + 1):
        f = rounds_dir / f"jobs_r{r}.json"
        cmd = [sys.executable, str(SCRIPT), "_round", "--dsn", dsn, "--five-dsn", five_dsn, "--core-dsn", core_dsn,
               "--jobs", str(counts["jobs"]), "--dispatches", str(counts["dispatches"]),
               "--bulk-jobs", str(counts["bulk_jobs"]), "--batch", str(counts["batch"]), "--round", str(r),
               "--turns", str(counts["turns"]), "--out", str(f)]
        if peer_py is not None:  # pgqueuer's processing case takes turns with ours in the round
            cmd += ["--peer-python", str(peer_py), "--peer-dsn", core_run.db_url(args.pg_url, peer["db"])]
        log(f"== round {r}/{repeats}: {'jobs, pgqueuer' if peer_py is not None else 'jobs'}")
        rc = core_run.run_step(cmd, log, timeout=3600, monitor=monitor, noise=noise, label=f"jobs round {r}",
                               quiet_wait=quiet)
        if rc != 0 or not f.exists():
            failures.append(f"jobs round {r}: exit {rc}")
        else:
            ours_files.append(f)
    monitor.stopped.set()
    raw, docs = core_run.merge_raw(ours_files)
    result: dict[str, Any] = {
        "meta": meta,
        "settings": {**counts, "repeats": repeats, "warmups": WARMUPS, "queues_one": list(ONE),
                     "queues_five": list(FIVE),
                     "jobs_worker": "WorkQueueSettings(database_url=...) only: the job queues' group consumer, "
                     "every queue fairly (no WORKQUEUE_JOB_QUEUES), concurrency 4 (WORKQUEUE_JOB_CONCURRENCY), "
                     "job lease 90 s; a no-op job per queue, payload Item(i: int)",
                     "core_worker": "bench/compare/workqueue_bench.py's default worker "
                                    "(SubscriptionPlan(), concurrency 4)",
                     "jobs_database": dsn, "jobs_five_database": five_dsn, "core_database": core_dsn},
        "versions": {**(docs[0].get("versions", {}) if docs else {})},
        "jobs": {"summary": summarize(raw), "raw": raw,
                 "worker_event_loop": docs[0].get("worker_event_loop") if docs else None},
    }
    if peer_error:
        result["pgqueuer"] = {"error": peer_error}
    elif raw.get("pgqueuer_process"):
        pruns = raw["pgqueuer_process"]
        result["pgqueuer"] = {"summary": core_run.summarize_peer({"process_default": pruns}),
                              "raw": {"process_default": pruns}, "settings": pruns[0].get("settings")}
        result["versions"]["pgqueuer"] = pruns[0].get("version")
    else:
        result["pgqueuer"] = None
    result["targets"] = targets_of(result["jobs"]["summary"], (result.get("pgqueuer") or {}).get("summary") or {},
                                   counts["batch"], raw, (result.get("pgqueuer") or {}).get("raw"))
    busy = sum(sum(n["other_cpu_s"].values()) for n in noise)
    wall = sum(n["seconds"] for n in noise) or 1
    meta.update({"minutes": (time.time() - started) / 60, "failures": failures, "other_cpu_per_step": noise,
                 "other_cpu_share": busy / wall, "loadavg_end": os.getloadavg(), "uptime_end": _uptime()})
    header = (f"Run of {meta['date_utc']} UTC, commit {meta['commit']}"
              f"{' (library files modified in the work tree)' if meta['library_changes_uncommitted'] else ''}, "
              f"{meta['mode']} mode, {repeats} rounds, {meta['minutes']:.0f} min; median [min–max] of the rounds. "
              f"Other processes used {busy:,.0f} CPU-seconds during the {wall / 60:.0f} min of measurement "
              f"({100 * busy / wall:.0f} % of one core; per step in run.log); load average "
              f"{meta['host']['loadavg_start'][0]:.2f} at the start, {meta['loadavg_end'][0]:.2f} at the end.")
    table = report(result)
    result["header_markdown"], result["table_markdown"] = header, table
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(header + "\n\n" + table + "\n")
    log("")
    log(header)
    log("")
    log(table)
    if draw:
        try:
            chart(out, Path(args.peers_dir), args.peer_python, log)
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            log(f"!! chart not rendered: {exc}")
    log(f"results: {out / 'results.json'}, {out / 'results.md'} ({meta['minutes']:.1f} min)")
    if failures:
        log("!! failures: " + "; ".join(failures))
        sys.exit(1)


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("_worker", help="internal: one jobs worker process")
    w.add_argument("--dsn", required=True)
    w.add_argument("--queues", required=True)
    w.add_argument("--loop", choices=["uvloop", "asyncio"], default=core.default_loop())
    rd = sub.add_parser("_round", help="internal: one round of every case")
    rd.add_argument("--dsn", required=True)
    rd.add_argument("--five-dsn", required=True)
    rd.add_argument("--core-dsn", required=True)
    rd.add_argument("--jobs", type=int, required=True)
    rd.add_argument("--dispatches", type=int, default=None)
    rd.add_argument("--bulk-jobs", type=int, default=None)
    rd.add_argument("--batch", type=int, required=True)
    rd.add_argument("--round", type=int, default=1)
    rd.add_argument("--turns", type=int, default=PROCESS_TURNS)
    rd.add_argument("--peer-python", default=None, help="pgqueuer's venv: its processing case joins the turns")
    rd.add_argument("--peer-dsn", default=None)
    rd.add_argument("--loop", choices=["uvloop", "asyncio"], default=None)
    rd.add_argument("--out", required=True)

    ap.add_argument("--smoke", action="store_true", help="tiny counts, 1 round, pgqueuer skipped unless --peers")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 5; 1 with --smoke)")
    ap.add_argument("--skip-peers", action="store_true", help="do not run pgqueuer")
    ap.add_argument("--peers", action="store_true", help="run pgqueuer in --smoke mode too")
    ap.add_argument("--out", default=str(HERE / "results"), help="output folder")
    ap.add_argument("--pg-url", default=core_run.DEFAULT_PG, help="server URL without database ($BENCH_PG_URL)")
    ap.add_argument("--dsn", default=None, help="database of the jobs cases (default <pg-url>/bench_jobs; "
                    "the five-queue case uses --dsn + '_five')")
    ap.add_argument("--core-dsn", default=None, help="database of the core cases (default: --dsn + '_core')")
    ap.add_argument("--quiet-wait", type=float, default=None,
                    help="wait up to this many seconds before each step for other processes to go quiet "
                    "(default 180; 0 with --smoke)")
    ap.add_argument("--peers-dir", default=core_run.DEFAULT_PEERS_DIR, help="cache of the peer venvs")
    ap.add_argument("--peer-python", default=core_run.shutil.which("python3.11") or sys.executable,
                    help="interpreter that creates the peer venvs")
    ap.add_argument("--chart", action=argparse.BooleanOptionalAction, default=None,
                    help="render results.png (default: on, off with --smoke)")
    for key, value in FULL.items():
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None, dest=key,
                        help=f"default {value} (smoke {SMOKE[key]})")
    args = ap.parse_args()
    if args.cmd == "_worker":
        worker_main(args)
    elif args.cmd == "_round":
        asyncio.run(round_main(args))
    else:
        signal.signal(signal.SIGTERM, _stop)
        driver(args)


if __name__ == "__main__":
    main()
