"""Debounced dispatch on a real store (PostgreSQL and an SQLite file), time driven by the
transport's clock: dispatches with one key within the window make one job, run once the window has
passed since the last of them, with the last payload; concurrent dispatchers make one job too; a
dispatch after the job started makes a new one; bad options are refused."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest

from fastapi_workqueue import WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.clock import ManualClock
from fastapi_workqueue.database import create_database_transport

from .support import FAST

pytestmark = pytest.mark.timeout(90)

WINDOW = timedelta(seconds=30)


def clocked_queue(url: str) -> tuple[str, WorkQueue, ManualClock]:
    """A queue whose host takes a job queue of the test's own, on a transport that reads ``clock``."""
    name = f"debounce-{uuid.uuid4().hex[:8]}"
    clock = ManualClock()
    settings = WorkQueueSettings(database_url=url, auto_migrate=True, subscriptions=[], job_queues=name,
                                 job_concurrency=4, **FAST)
    return name, WorkQueue(settings, transport=create_database_transport(url, clock=clock)), clock


async def test_a_debounced_key_runs_once_with_the_last_payload(database_url: str) -> None:
    name, queue, clock = clocked_queue(database_url)
    ran: list[dict[str, Any]] = []

    @queue.job(f"notify-{name}", queue=name, store_result=True)
    async def notify(payload: dict[str, Any]) -> int:
        ran.append(payload)
        return int(payload["n"])

    async with queue.lifespan(None):
        first = await queue.dispatch(notify, {"user": 7, "n": 1}, debounce=WINDOW, debounce_key="user:7")
        clock.advance(10)
        second = await queue.dispatch(notify, {"user": 7, "n": 2}, debounce=WINDOW, debounce_key="user:7")
        other = await queue.dispatch(notify, {"user": 8, "n": 1}, debounce=WINDOW, debounce_key="user:8")
        clock.advance(25)  # 35 s after the first dispatch, 25 s after the last: not due yet
        third = await queue.dispatch(notify, {"user": 7, "n": 3}, debounce=WINDOW, debounce_key="user:7")
        assert first == second == third and other != first
        waiting = await queue.job_status(first)
        assert waiting is not None and waiting.state == "Pending" and waiting.attempt == 0
        assert waiting.run_at is not None and waiting.run_at - clock.now() > timedelta(seconds=29)
        assert await queue.size(name) == 2  # one job per key

        clock.advance(31)  # the window has passed since the last dispatch of each key
        assert await queue.wait(first, timeout=30) == 3
        assert await queue.wait(other, timeout=30) == 1
        assert sorted(ran, key=lambda p: p["user"]) == [{"user": 7, "n": 3}, {"user": 8, "n": 1}]

        # The job ran: the next dispatch with the key makes a new job.
        again = await queue.dispatch(notify, {"user": 7, "n": 4}, debounce=WINDOW, debounce_key="user:7")
        assert again != first
        clock.advance(31)
        assert await queue.wait(again, timeout=30) == 4


async def test_concurrent_debounced_dispatches_make_one_job(database_url: str) -> None:
    name, queue, clock = clocked_queue(database_url)
    ran: list[int] = []

    @queue.job(f"rebuild-{name}", queue=name)
    async def rebuild(payload: dict[str, int]) -> None:
        ran.append(payload["n"])

    async with queue.lifespan(None):
        ids = await asyncio.gather(*(
            queue.dispatch(rebuild, {"n": n}, debounce=WINDOW, debounce_key="stats") for n in range(8)))
        assert len(set(ids)) == 1
        assert await queue.size(name) == 1
        clock.advance(31)
        await queue.wait(ids[0], timeout=30)
        assert len(ran) == 1 and ran[0] in range(8)


async def test_debounce_options_are_checked(database_url: str) -> None:
    name, queue, _ = clocked_queue(database_url)

    @queue.job(f"noop-{name}", queue=name)
    async def noop(payload: dict[str, Any]) -> None:
        return None

    async with queue.lifespan(None):
        with pytest.raises(ValueError, match="debounce needs a debounce_key"):
            await queue.dispatch(noop, {}, debounce=WINDOW)
        with pytest.raises(ValueError, match="debounce_key needs debounce="):
            await queue.dispatch(noop, {}, debounce_key="k")
        with pytest.raises(ValueError, match="either unique= or debounce="):
            await queue.dispatch(noop, {}, debounce=WINDOW, debounce_key="k", unique="k")
        with pytest.raises(ValueError, match="give debounce= and no delay"):
            await queue.dispatch(noop, {}, debounce=WINDOW, debounce_key="k", delay=5)
        with pytest.raises(ValueError, match="debounce must be a timedelta or seconds above 0"):
            await queue.dispatch(noop, {}, debounce=0, debounce_key="k")
        assert await queue.size(name) == 0
