"""An app with a group's jobs for the test of groups across processes:
``workqueue work --app tests.apps.group_app:queue --queue Q``.

The store comes from ``WORKQUEUE_DATABASE_URL``; the jobs' queue is ``GROUP_APP_QUEUE``. A member
records its start, waits until the file ``GROUP_APP_RELEASE`` exists, and returns its number; the
``then`` job records what it found in ``job.group_results``. Records are JSON lines (with the process
id) appended to ``GROUP_APP_RECORD``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from fastapi_workqueue import JobContext, WorkQueue, WorkQueueSettings

QUEUE = os.environ.get("GROUP_APP_QUEUE", "group-app")

queue = WorkQueue(WorkQueueSettings(
    subscriptions=[], auto_migrate=True, idle_poll_min_ms=20, idle_poll_max_ms=100, sweeper_interval_ms=200,
    reconcile_interval_ms=1000,
))


def record(**fields: Any) -> None:
    with open(os.environ["GROUP_APP_RECORD"], "a", encoding="utf-8") as out:
        out.write(json.dumps({**fields, "pid": os.getpid(), "at": time.time()}) + "\n")


@queue.job("group-app.member", queue=QUEUE, store_result=True)
async def member(payload: dict[str, int], job: JobContext) -> int:
    record(event="member-start", id=str(job.id))
    await released(os.environ["GROUP_APP_RELEASE"])
    return payload["n"]


async def released(path: str) -> None:
    """Waits until ``path`` exists: the test creates it to let every member return at once."""
    while not await asyncio.to_thread(os.path.exists, path):  # noqa: ASYNC110 - another process's signal
        await asyncio.sleep(0.01)


@queue.job("group-app.then", queue=QUEUE)
async def then(payload: dict[str, str], job: JobContext) -> None:
    results = job.group_results or []
    record(event="then", group=payload["group"], group_id=str(job.group_id),
           members=[[str(s.id), s.state, s.result] for s in results])
