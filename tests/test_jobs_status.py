"""A job's status and stored result on a real store (PostgreSQL and an SQLite file): each state
(Pending, Running, Completed, Failed, Discarded, and Pending while it waits out a retry), the
result of a ``store_result=True`` job (and none without it), a result too large or not JSON
failing the job, an unknown id, the REST route with its read scope and its 404, and ``wait``
(told by NOTIFY on PostgreSQL, polling on SQLite)."""

from __future__ import annotations

import asyncio
import functools
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from fastapi_workqueue import JobContext, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.keys import SCOPE_OPERATE, SCOPE_READ, create_key
from fastapi_workqueue.jobs import JobDiscardedError, JobError, JobFailedError, JobNotFound, JobStatus

from .support import FAST, wait_for

pytestmark = pytest.mark.timeout(90)


def make_queue(url: str) -> tuple[str, WorkQueue]:
    """A job queue of the test's own and a WorkQueue whose host takes only it."""
    name = f"status-{uuid.uuid4().hex[:8]}"
    return name, WorkQueue(WorkQueueSettings(database_url=url, auto_migrate=True, subscriptions=[],
                                             job_queues=name, job_concurrency=4, **FAST))


class Report(BaseModel):
    rows: int
    title: str


async def state_of(queue: WorkQueue, job_id: uuid.UUID, state: str) -> JobStatus | None:
    status = await queue.job_status(job_id)
    return status if status is not None and status.state == state else None


async def test_a_job_status_through_each_state_with_its_result(database_url: str) -> None:
    name, queue = make_queue(database_url)
    suffix = name.removeprefix("status-")
    gate = asyncio.Event()

    @queue.job(f"report-{suffix}", queue=name, store_result=True)
    async def report(payload: dict[str, Any]) -> Report:
        await gate.wait()
        return Report(rows=payload["rows"], title="Q3")

    @queue.job(f"plain-{suffix}", queue=name)
    async def plain(payload: dict[str, Any]) -> dict[str, int]:
        return {"ignored": 1}  # not kept: the job is not declared store_result=True

    @queue.job(f"doomed-{suffix}", queue=name, tries=1)
    async def doomed(payload: dict[str, Any]) -> None:
        raise RuntimeError("the printer is on fire; password=hunter2")

    @queue.job(f"flaky-{suffix}", queue=name, tries=3, backoff=[3600])
    async def flaky(payload: dict[str, Any]) -> None:
        raise RuntimeError("the upstream answered 503")

    @queue.job(f"unwanted-{suffix}", queue=name)
    async def unwanted(payload: dict[str, Any], job: JobContext) -> Any:
        return job.discard("the account no longer exists")

    async with queue.lifespan(None):
        later = await queue.dispatch(plain, {}, delay=timedelta(hours=1))
        pending = await queue.job_status(later)
        assert pending is not None and pending.state == "Pending" and pending.attempt == 0 and not pending.retrying
        assert pending.job == f"plain-{suffix}" and pending.queue == name and pending.tries == 3
        assert pending.run_at is not None and pending.run_at > datetime.now(UTC) + timedelta(minutes=59)
        assert pending.created_at is not None and pending.ended_at is None and pending.result is None

        built = await queue.dispatch(report, {"rows": 3})
        running = await wait_for(lambda: state_of(queue, built, "Running"), within=30)
        assert running.attempt == 1 and running.started_at is not None and running.run_at is None
        gate.set()
        done = await wait_for(lambda: state_of(queue, built, "Completed"), within=30)
        assert done.result == {"rows": 3, "title": "Q3"} and done.ended_at is not None and done.attempts == []
        assert done.ended

        returned = await queue.dispatch(plain, {})
        assert (await wait_for(lambda: state_of(queue, returned, "Completed"), within=30)).result is None

        doomed_id = await queue.dispatch(doomed, {})
        failed = await wait_for(lambda: state_of(queue, doomed_id, "Failed"), within=30)
        assert failed.error is not None and "the printer is on fire" in failed.error and "hunter2" not in failed.error
        assert [(a.attempt, a.outcome) for a in failed.attempts] == [(1, "DeadLettered")]
        assert failed.ended_at is not None and failed.reason is not None

        retrying_id = await queue.dispatch(flaky, {})
        retrying = await wait_for(lambda: _retrying(queue, retrying_id), within=30)
        assert retrying.attempt == 1 and retrying.error is not None and "503" in retrying.error
        assert retrying.run_at is not None and retrying.run_at > datetime.now(UTC) + timedelta(minutes=50)
        assert [(a.attempt, a.outcome) for a in retrying.attempts] == [(1, "Failed")]

        discarded_id = await queue.dispatch(unwanted, {})
        discarded = await wait_for(lambda: state_of(queue, discarded_id, "Discarded"), within=30)
        assert discarded.reason == "the account no longer exists"

        assert await queue.job_status(uuid.uuid4()) is None
        assert await queue.job_status(str(built)) == await queue.job_status(built)
        with pytest.raises(ValueError, match="a job id is the UUID dispatch"):
            await queue.job_status("not-a-job-id")


async def _retrying(queue: WorkQueue, job_id: uuid.UUID) -> JobStatus | None:
    status = await queue.job_status(job_id)
    return status if status is not None and status.state == "Pending" and status.retrying else None


async def test_results_of_jobs_that_end_at_once_are_each_kept_with_their_own_job(database_url: str) -> None:
    name, queue = make_queue(database_url)  # four at a time: their completions are written together
    suffix = name.removeprefix("status-")
    gate, running = asyncio.Event(), [0]

    @queue.job(f"count-{suffix}", queue=name, store_result=True)
    async def count(payload: dict[str, Any]) -> dict[str, int]:
        running[0] += 1
        if running[0] % 4 == 0:
            gate.set()
        await gate.wait()
        return {"n": payload["n"], "square": payload["n"] ** 2}

    async with queue.lifespan(None):
        ids = [await queue.dispatch(count, {"n": n}) for n in range(12)]
        for n, job_id in enumerate(ids):
            done = await wait_for(functools.partial(state_of, queue, job_id, "Completed"), within=30)
            assert done.result == {"n": n, "square": n * n}


async def test_a_result_that_cannot_be_stored_fails_the_job(database_url: str) -> None:
    name, queue = make_queue(database_url)
    suffix = name.removeprefix("status-")

    @queue.job(f"huge-{suffix}", queue=name, tries=3, store_result=True)
    async def huge(payload: dict[str, Any]) -> str:
        return "x" * 70_000

    @queue.job(f"odd-{suffix}", queue=name, tries=3, store_result=True)
    async def odd(payload: dict[str, Any]) -> object:
        return object()

    async with queue.lifespan(None):
        too_big = await queue.dispatch(huge, {})
        not_json = await queue.dispatch(odd, {})
        big = await wait_for(lambda: state_of(queue, too_big, "Failed"), within=30)
        strange = await wait_for(lambda: state_of(queue, not_json, "Failed"), within=30)
    # Failed at once, without a retry: another run would return the same.
    assert big.attempt == 1 and big.reason is not None and "at most 65536 bytes" in big.reason
    assert strange.attempt == 1 and strange.reason is not None and "which is not JSON" in strange.reason


async def test_the_status_route_needs_the_read_scope_and_answers_404_for_an_unknown_id(database_url: str) -> None:
    name, queue = make_queue(database_url)
    suffix = name.removeprefix("status-")

    @queue.job(f"sum-{suffix}", queue=name, store_result=True)
    async def total(payload: list[int]) -> int:
        return sum(payload)

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.router)
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://api") as http:
        read = (await create_key(queue.transport, f"read-{suffix}", [SCOPE_READ])).key
        operate = (await create_key(queue.transport, f"operate-{suffix}", [SCOPE_OPERATE])).key
        job_id = await queue.dispatch(total, [1, 2, 3])
        await wait_for(lambda: state_of(queue, job_id, "Completed"), within=30)
        answer = await http.get(f"/work-queue/jobs/{job_id}", headers={"Authorization": f"Bearer {read}"})
        assert answer.status_code == 200
        body = answer.json()
        assert (body["ID"], body["State"], body["Result"], body["Attempt"], body["Tries"]) == (
            str(job_id), "Completed", 6, 1, 3)
        assert body == (await queue.job_status(job_id)).model_dump(mode="json")  # type: ignore[union-attr]
        unknown = await http.get(f"/work-queue/jobs/{uuid.uuid4()}", headers={"Authorization": f"Bearer {read}"})
        assert unknown.status_code == 404 and "no job has the id" in unknown.json()["detail"]
        refused = await http.get(f"/work-queue/jobs/{job_id}", headers={"Authorization": f"Bearer {operate}"})
        assert refused.status_code == 403 and "workqueue:read" in refused.json()["detail"]
        assert (await http.get(f"/work-queue/jobs/{job_id}")).status_code == 401
        # /jobs/failed is still the failed jobs, not a job named "failed".
        listed = await http.get("/work-queue/jobs/failed", headers={"Authorization": f"Bearer {read}"})
        assert listed.status_code == 200


async def test_wait_returns_the_stored_result_and_raises_what_became_of_a_job(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A waiter on PostgreSQL is told by NOTIFY: with no re-check before the test's timeout, only the
    # notice can end its wait. Elsewhere the waiter polls.
    monkeypatch.setattr("fastapi_workqueue.jobs.waiting.RECHECK", 600.0)
    name, queue = make_queue(database_url)
    suffix = name.removeprefix("status-")
    gate = asyncio.Event()

    @queue.job(f"slow-sum-{suffix}", queue=name, store_result=True)
    async def slow_sum(payload: list[int]) -> dict[str, int]:
        await gate.wait()
        return {"total": sum(payload)}

    @queue.job(f"broken-{suffix}", queue=name, tries=2, backoff=[0])
    async def broken(payload: dict[str, Any]) -> None:
        raise RuntimeError("the disk is full")

    @queue.job(f"skipped-{suffix}", queue=name)
    async def skipped(payload: dict[str, Any], job: JobContext) -> Any:
        return job.discard("nothing to do")

    async with queue.lifespan(None):
        assert (queue.ports.ends is not None) == database_url.startswith("postgresql")
        summed = await queue.dispatch(slow_sum, [1, 2, 3])
        await wait_for(lambda: state_of(queue, summed, "Running"), within=30)
        reads: list[str] = []
        read_status = queue.jobs.status

        async def counted(job_id: Any, **options: Any) -> JobStatus | None:
            found = await read_status(job_id, **options)
            reads.append(found.state if found is not None else "unknown")
            return found

        monkeypatch.setattr(queue.jobs, "status", counted)
        waiter = asyncio.create_task(queue.wait(summed, timeout=60))
        await wait_for(lambda: reads)  # the waiter found it Running: it waits for the end now
        assert reads == ["Running"]
        gate.set()
        assert await waiter == {"total": 6}
        assert await queue.wait(summed) == {"total": 6}  # an ended job answers at once

        failing = await queue.dispatch(broken, {})
        with pytest.raises(JobFailedError, match="the disk is full") as failed:
            await queue.wait(failing, timeout=timedelta(seconds=60))
        assert failed.value.status.state == "Failed" and failed.value.status.attempt == 2
        assert failed.value.reason is not None and "max attempts reached" in failed.value.reason

        discarded = await queue.dispatch(skipped, {})
        with pytest.raises(JobDiscardedError, match="nothing to do") as gone:
            await queue.wait(discarded, timeout=60)
        assert isinstance(gone.value, JobError) and gone.value.status.state == "Discarded"

        later = await queue.dispatch(broken, {}, delay=3600)
        with pytest.raises(TimeoutError, match=r"is still Pending after waiting 0\.2 s"):
            await queue.wait(later, timeout=0.2)
        with pytest.raises(JobNotFound, match="no job has the id"):
            await queue.wait(uuid.uuid4(), timeout=5)
        with pytest.raises(ValueError, match="timeout is seconds"):
            await queue.wait(later, timeout=-1)


async def test_wait_polls_where_nothing_announces_the_end(database_url: str) -> None:
    """With LISTEN turned off (WORKQUEUE_LISTEN=0) a waiter on PostgreSQL polls, as on SQLite."""
    name = f"status-{uuid.uuid4().hex[:8]}"
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        job_queues=name, listen=False, **FAST))

    @queue.job(f"echo-{name}", queue=name, store_result=True)
    async def echo(payload: str) -> str:
        return payload

    async with queue.lifespan(None):
        assert await queue.wait(await queue.dispatch(echo, "hello"), timeout=30) == "hello"
