"""Job status, results, wait, debounce and groups without a worker: the test fake
(``queue.fake()``) and sync mode (``WORKQUEUE_JOBS_MODE=sync``)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import JobContext, WorkQueue, WorkQueueSettings
from fastapi_workqueue.jobs import JobDiscardedError, JobFailedError, JobNotFound


def build(**settings: Any) -> tuple[WorkQueue, dict[str, Any]]:
    queue = WorkQueue(WorkQueueSettings(**{"database_url": "sqlite+aiosqlite:///unused.db", **settings}))

    @queue.job("local.total", store_result=True)
    async def total(payload: list[int]) -> int:
        return sum(payload)

    @queue.job("local.fails", tries=2)
    async def fails(payload: dict[str, Any]) -> None:
        raise ValueError("never works")

    @queue.job("local.unwanted")
    async def unwanted(payload: dict[str, Any], job: JobContext) -> Any:
        return job.discard("not wanted")

    return queue, {"total": total, "fails": fails, "unwanted": unwanted}


async def test_the_fake_answers_job_status_before_and_after_work() -> None:
    queue, jobs = build()
    with queue.fake() as fake:
        summed = await queue.dispatch(jobs["total"], [1, 2, 3])
        failing = await queue.dispatch(jobs["fails"], {})
        unwanted = await queue.dispatch(jobs["unwanted"], {})
        waiting = await queue.job_status(summed)
        assert waiting is not None and (waiting.state, waiting.attempt, waiting.job) == ("Pending", 0, "local.total")
        assert await queue.job_status(uuid.uuid4()) is None
        await fake.work()
        done = await queue.job_status(summed)
        failed = await queue.job_status(failing)
        discarded = await queue.job_status(unwanted)
    assert done is not None and (done.state, done.result, done.attempt) == ("Completed", 6, 1)
    assert failed is not None and failed.state == "Failed" and failed.attempt == 2
    assert failed.error is not None and "never works" in failed.error
    assert discarded is not None and (discarded.state, discarded.reason) == ("Discarded", "not wanted")


async def test_sync_mode_answers_job_status_of_the_jobs_it_ran(tmp_path: Path) -> None:
    queue, jobs = build(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", auto_migrate=True,
                        jobs_mode="sync", enabled=False)
    async with queue.lifespan(None):
        summed = await queue.dispatch(jobs["total"], [4, 5])
        done = await queue.job_status(summed)
        assert done is not None and (done.state, done.result) == ("Completed", 9)
        with pytest.raises(ValueError, match="never works"):
            await queue.dispatch(jobs["fails"], {})
        assert await queue.job_status(uuid.uuid4()) is None


async def test_wait_under_the_fake_and_in_sync_mode(tmp_path: Path) -> None:
    queue, jobs = build()
    with queue.fake() as fake:
        summed = await queue.dispatch(jobs["total"], [1, 2])
        failing = await queue.dispatch(jobs["fails"], {})
        unwanted = await queue.dispatch(jobs["unwanted"], {})
        with pytest.raises(TimeoutError, match="is still Pending"):
            await queue.wait(summed, timeout=0.05)  # recorded, not run until work()
        await fake.work()
        assert await queue.wait(summed, timeout=1) == 3
        with pytest.raises(JobFailedError, match="never works"):
            await queue.wait(failing, timeout=1)
        with pytest.raises(JobDiscardedError, match="not wanted"):
            await queue.wait(unwanted, timeout=1)
        with pytest.raises(JobNotFound):
            await queue.wait(uuid.uuid4(), timeout=1)

    synced, sync_jobs = build(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", auto_migrate=True,
                              jobs_mode="sync", enabled=False)
    async with synced.lifespan(None):
        assert await synced.wait(await synced.dispatch(sync_jobs["total"], [5, 5]), timeout=1) == 10


async def test_the_fake_keeps_one_debounced_job_per_key_with_the_last_payload(tmp_path: Path) -> None:
    queue, _ = build()
    ran: list[int] = []

    @queue.job("local.debounced")
    async def debounced(payload: dict[str, int]) -> None:
        ran.append(payload["n"])

    window = timedelta(seconds=30)
    with queue.fake() as fake:
        first = await queue.dispatch(debounced, {"n": 1}, debounce=window, debounce_key="k")
        second = await queue.dispatch(debounced, {"n": 2}, debounce=window, debounce_key="k")
        other = await queue.dispatch(debounced, {"n": 9}, debounce=window, debounce_key="other")
        assert first == second != other
        assert fake.dispatched(debounced) == [{"n": 2}, {"n": 9}]
        assert (await fake.work()).processed == 2
        third = await queue.dispatch(debounced, {"n": 3}, debounce=window, debounce_key="k")
        assert third != first  # the job ran: a new one
        await fake.work()
    assert ran == [2, 9, 3]

    synced, _ = build(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", auto_migrate=True,
                      jobs_mode="sync", enabled=False)
    now: list[int] = []

    @synced.job("local.debounced")
    async def at_once(payload: dict[str, int]) -> None:
        now.append(payload["n"])

    async with synced.lifespan(None):
        await synced.dispatch(at_once, {"n": 1}, debounce=window, debounce_key="k")
        await synced.dispatch(at_once, {"n": 2}, debounce=window, debounce_key="k")
    assert now == [1, 2]  # sync mode runs each dispatch at once: the window is not waited for


def with_collector(queue: WorkQueue) -> tuple[Any, list[list[tuple[str, Any]]]]:
    seen: list[list[tuple[str, Any]]] = []

    @queue.job("local.collect")
    async def collect(payload: dict[str, Any], job: JobContext) -> None:
        seen.append([(s.state, s.result) for s in job.group_results or []])

    return collect, seen


EXPECTED_GROUP = [("Completed", 3), ("Failed", None), ("Discarded", None), ("Completed", 3)]


async def test_the_fake_runs_a_groups_then_job_after_its_members() -> None:
    queue, jobs = build()
    collect, seen = with_collector(queue)
    members = [(jobs["total"], [1, 2]), (jobs["fails"], {}), (jobs["unwanted"], {}), (jobs["total"], [3])]
    with queue.fake() as fake:
        group = await queue.group(members, then=(collect, {}))
        held = await queue.job_status(group.then_id)
        assert held is not None and held.state == "Pending"
        fake.assert_dispatched(collect, times=1)
        counts = await fake.work()
        assert (counts.processed, counts.failed, counts.discarded) == (3, 1, 1)
        done = await queue.job_status(group.then_id)
    assert done is not None and done.state == "Completed"
    assert seen == [EXPECTED_GROUP]


async def test_sync_mode_runs_a_group_and_its_then_job_at_once(tmp_path: Path) -> None:
    queue, jobs = build(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", auto_migrate=True,
                        jobs_mode="sync", enabled=False)
    collect, seen = with_collector(queue)
    async with queue.lifespan(None):
        ok = await queue.group([(jobs["total"], [1, 2]), (jobs["total"], [5])], then=(collect, {}))
        assert seen == [[("Completed", 3), ("Completed", 5)]]
        assert await queue.wait(ok.then_id, timeout=1) is None
        members = [(jobs["total"], [1, 2]), (jobs["fails"], {}), (jobs["unwanted"], {}), (jobs["total"], [3])]
        with pytest.raises(ValueError, match="never works"):  # a member that failed: its error, as dispatch raises
            await queue.group(members, then=(collect, {}))
    assert seen[1] == EXPECTED_GROUP  # then ran before the failure was raised


async def test_sync_mode_keeps_a_steps_result_across_the_jobs_tries(database_url: str) -> None:
    """docs/jobs.md, sync mode: the job "goes through the same steps" as in a worker; a durable
    step's function runs once, and a later try gets its stored result (the step's result is kept
    beside the job, in the run's own store, whatever the queue's store is)."""
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, jobs_mode="sync",
                                        enabled=False, subscriptions=[]))
    charged: list[int] = []

    @queue.job(f"charge-{uuid.uuid4().hex[:8]}", tries=3, backoff=[0], store_result=True)
    async def charge(payload: dict[str, Any], job: JobContext) -> dict[str, Any]:
        async def pay() -> dict[str, Any]:
            charged.append(job.attempt)
            return {"charge": "ch-1"}

        result = await job.step("pay", pay)
        if job.attempt == 1:
            raise RuntimeError("the mail server is down")
        return {**result, "attempt": job.attempt}

    async with queue.lifespan(None):
        job_id = await queue.dispatch(charge, {})
        status = await queue.job_status(job_id)
    assert charged == [1]
    assert status is not None and (status.state, status.result) == ("Completed", {"charge": "ch-1", "attempt": 2})
