"""An app with jobs for the worker tests: ``workqueue work --app tests.apps.jobs_app:queue --queue Q``.

The store comes from ``WORKQUEUE_DATABASE_URL``; every job's queue is ``JOBS_APP_QUEUE``. The jobs
append JSON lines (with the process id and wall-clock times) to the file named by ``JOBS_APP_RECORD``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from fastapi_workqueue import JobContext, WorkQueue, WorkQueueSettings
from fastapi_workqueue.jobs import JobDiscarded, JobFailed, JobProcessed, JobReleased, without_overlapping

QUEUE = os.environ.get("JOBS_APP_QUEUE", "jobs-app")

queue = WorkQueue(WorkQueueSettings(
    subscriptions=[], auto_migrate=True, idle_poll_min_ms=20, idle_poll_max_ms=100, sweeper_interval_ms=200,
    reconcile_interval_ms=1000, job_lease_seconds=float(os.environ.get("JOBS_APP_LEASE", "90")),
))


def record(**fields: Any) -> None:
    with open(os.environ["JOBS_APP_RECORD"], "a", encoding="utf-8") as out:
        out.write(json.dumps({**fields, "pid": os.getpid(), "at": time.time()}) + "\n")


def recorded() -> list[dict[str, Any]]:
    with open(os.environ["JOBS_APP_RECORD"], encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (an exited process not yet reaped by its parent does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


@queue.job("app.stuck", timeout=0.5, queue=QUEUE)
async def stuck(payload: dict[str, Any], job: JobContext) -> None:
    """Ignores its timeout: swallows every cancellation."""
    record(event="stuck-start")
    while True:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            record(event="stuck-cancelled")


@queue.job("app.blocks", timeout=1, tries=3, backoff=[0], queue=QUEUE)
async def blocks(payload: dict[str, Any], job: JobContext) -> None:
    """Blocks the event loop on its first attempt (``time.sleep``), far past its timeout; a later
    attempt records whether the process of the first one still runs."""
    if job.attempt == 1:
        record(event="block-start", attempt=job.attempt, id=str(job.id))
        time.sleep(float(payload["seconds"]))  # noqa: ASYNC251 (on purpose: it blocks the loop)
        record(event="block-end", attempt=job.attempt, id=str(job.id))
        return
    [first] = [e for e in recorded() if e["event"] == "block-start" and e["id"] == str(job.id)]
    record(event="after-block", attempt=job.attempt, id=str(job.id), first_running=running(first["pid"]))


@queue.job("app.overlap", tries=200, queue=QUEUE,
           middleware=[without_overlapping("one-at-a-time", release_after=0.1)])
async def overlap(payload: dict[str, Any], job: JobContext) -> None:
    record(event="start", n=payload["n"])
    await asyncio.sleep(0.3)
    record(event="end", n=payload["n"])


@queue.job("app.overlap-long", tries=100, queue=QUEUE,
           middleware=[without_overlapping(lambda payload: payload["key"], release_after=0.5)])
async def overlap_long(payload: dict[str, Any], job: JobContext) -> None:
    """Runs ``seconds`` on its first attempt (0.1 s on a later one) under the overlap key ``key``."""
    record(event="long-start", n=payload["n"], attempt=job.attempt)
    await asyncio.sleep(float(payload["seconds"]) if job.attempt == 1 else 0.1)
    record(event="long-end", n=payload["n"], attempt=job.attempt)


@queue.job("app.steps", tries=5, backoff=[0], queue=QUEUE)
async def steps(payload: dict[str, Any], job: JobContext) -> None:
    async def charge() -> dict[str, Any]:
        record(event="charge", attempt=job.attempt)
        return {"charge": f"ch-{job.id}"}

    async def mail() -> None:
        record(event="mail", attempt=job.attempt)

    charged = await job.step("charge", charge)
    await job.once(f"mail:{job.id}", mail)
    if job.attempt == 1:
        record(event="waiting", attempt=job.attempt)
        await asyncio.sleep(60)  # killed here
    record(event="done", attempt=job.attempt, charge=charged["charge"])


@queue.job("app.slow", tries=1, queue=QUEUE)
async def slow(payload: dict[str, Any], job: JobContext) -> None:
    """Sleeps ``JOBS_APP_SLOW_SECONDS`` (else the payload's ``seconds``); one try only."""
    record(event="slow-start", n=payload["n"], attempt=job.attempt, id=str(job.id))
    await asyncio.sleep(float(os.environ.get("JOBS_APP_SLOW_SECONDS", payload["seconds"])))
    record(event="slow-end", n=payload["n"], attempt=job.attempt, id=str(job.id))


@queue.job("app.hogs", tries=1, queue=QUEUE)
async def hogs(payload: dict[str, Any], job: JobContext) -> None:
    """Blocks the event loop for the payload's ``seconds`` (no timeout); one try only."""
    record(event="hog-start", attempt=job.attempt, id=str(job.id))
    time.sleep(float(payload["seconds"]))  # noqa: ASYNC251 (on purpose: it blocks the loop past its lease)
    record(event="hog-end", attempt=job.attempt, id=str(job.id))


def record_release(event: JobReleased) -> None:
    if event.queue != QUEUE:  # (a job of an earlier test on the same database, whose lease a sweeper here took back)
        return
    record(event="released", reason=event.reason, id=str(event.job_id), attempt=event.attempt)


queue.listen(JobReleased, record_release)


if os.environ.get("JOBS_APP_RECORD_PROCESSED"):
    def record_processed(event: JobProcessed) -> None:
        record(event="processed", id=str(event.job_id), attempt=event.attempt)

    queue.listen(JobProcessed, record_processed)


if os.environ.get("JOBS_APP_RECORD_ENDS"):
    def record_end(event: JobFailed | JobDiscarded) -> None:
        if event.queue != QUEUE:  # (as above)
            return
        record(event="failed" if isinstance(event, JobFailed) else "discarded", id=str(event.job_id),
               attempt=event.attempt, tries=event.tries, job=event.job, reason=event.reason)

    queue.listen(JobFailed, record_end)
    queue.listen(JobDiscarded, record_end)


if os.environ.get("JOBS_APP_SCHEDULE"):
    @queue.job("app.tick", queue=QUEUE)
    async def tick(payload: dict[str, Any], job: JobContext) -> None:
        record(event="tick", id=str(job.id))

    queue.schedule(tick, every=1, payload={}, name="app.every-second")


@queue.job("app.long", timeout=100, queue=f"{QUEUE}-long")
async def long_job(payload: dict[str, Any]) -> None:
    return None
