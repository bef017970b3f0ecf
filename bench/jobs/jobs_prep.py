#!/usr/bin/env python3
"""Per-item CPU cost of a bulk's preparation: the jobs layer against the core, without a database.

    .venv/bin/python bench/jobs/jobs_prep.py                  # 20,000 items per trial, best of 5
    .venv/bin/python bench/jobs/jobs_prep.py --items 5000 --trials 3 --batch 500

Both sides run the real call on a queue whose transport answers at once (every message Accepted,
from a list built once): ``queue.bulk([(job, {"i": i}), ...])`` of a no-op job (payload model
``Item``) against ``queue.publish(topic, [PublishRequest(payload={"i": i}), ...])``, as
``bench/jobs/jobs_bench.py``'s bulk and publish_batch cases do. So each side's figure is everything it
does before the database call: building its items, validation, the envelope, ``prepare()``. CPU
time is ``time.process_time()`` over ``--items`` items in calls of ``--batch``; the best of
``--trials`` is printed as µs per item, with the ratio (jobs / core). Then the same for one per
call: ``queue.dispatch(job, {"i": i})`` against a publish of one ``PublishRequest``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from fastapi_workqueue import JobContext, PublishRequest, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.envelope import PreparedMessage, PublishResult, PublishStatus

TOPIC = "bench.prep"


class Item(BaseModel):
    """The payload of the benchmark job (``bench/jobs/jobs_bench.py``'s)."""

    i: int


class InstantTransport:
    """A transport whose publish answers Accepted at once; nothing else is called."""

    name = "instant"

    def __init__(self, batch: int) -> None:
        self._results = [PublishResult(status=PublishStatus.ACCEPTED, message_id=uuid.uuid4()) for _ in range(batch)]

    async def publish(self, topic: str, messages: Sequence[PreparedMessage], *, session: Any = None) -> list[Any]:
        return self._results[: len(messages)]

    async def sync_topology(self, topics: Any, subscriptions: Any) -> None:
        return None


def make_queue(batch: int) -> tuple[WorkQueue, Any]:
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///:memory:", enabled=False),
                      topics=[Topic(name=TOPIC)], transport=InstantTransport(batch))  # type: ignore[arg-type]

    @queue.job("bench.noop")
    async def noop(payload: Item, job: JobContext) -> None:
        return None

    queue.jobs._synced.add("jobs.default")  # as after open(): the job queue is in the store
    return queue, noop


async def jobs_side(queue: WorkQueue, job: Any, items: int, batch: int) -> None:
    for start in range(0, items, batch):
        await queue.bulk([(job, {"i": i}) for i in range(start, min(items, start + batch))])


async def core_side(queue: WorkQueue, job: Any, items: int, batch: int) -> None:
    for start in range(0, items, batch):
        await queue.publish(TOPIC, [PublishRequest(payload={"i": i}) for i in range(start, min(items, start + batch))])


async def dispatch_side(queue: WorkQueue, job: Any, items: int, batch: int) -> None:
    for i in range(items):
        await queue.dispatch(job, {"i": i})


async def publish_one_side(queue: WorkQueue, job: Any, items: int, batch: int) -> None:
    for i in range(items):
        await queue.publish(TOPIC, [PublishRequest(payload={"i": i})])


def best(side: Any, queue: WorkQueue, job: Any, items: int, batch: int, trials: int) -> float:
    """The best per-item µs of ``trials`` runs of ``side`` over ``items`` items."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(side(queue, job, batch, batch))  # warm-up
        times = []
        for _ in range(trials):
            gc.collect()
            t0 = time.process_time()
            loop.run_until_complete(side(queue, job, items, batch))
            times.append(time.process_time() - t0)
    finally:
        loop.close()
    return min(times) / items * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    queue, job = make_queue(args.batch)
    core = best(core_side, queue, job, args.items, args.batch, args.trials)
    jobs = best(jobs_side, queue, job, args.items, args.batch, args.trials)
    print(f"core publish prep: {core:.2f} µs/item")
    print(f"jobs bulk prep:    {jobs:.2f} µs/item")
    print(f"ratio jobs/core:   {jobs / core:.2f}x  (items {args.items}, batch {args.batch}, best of {args.trials})")
    one = best(publish_one_side, queue, job, args.items, args.batch, args.trials)
    dispatch = best(dispatch_side, queue, job, args.items, args.batch, args.trials)
    print(f"core publish of 1: {one:.2f} µs/item")
    print(f"jobs dispatch:     {dispatch:.2f} µs/item")
    print(f"ratio jobs/core:   {dispatch / one:.2f}x")


if __name__ == "__main__":
    main()
