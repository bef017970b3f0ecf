"""Promises of the jobs layer checked end to end with the defaults (docs/jobs.md; the spec's jobs
section): unique keys freed however a job ends, the events of a cancelled job, payload models
with aliases, a debounced job's priority, a chain step's delay and the catch-up bound. Each runs
on PostgreSQL and on SQLite."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import pytest
from pydantic import BaseModel, Field

from fastapi_workqueue import JobContext, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.errors import TransportError
from fastapi_workqueue.jobs import JobEvent
from fastapi_workqueue.testing import MemoryTransport

from .support import wait_for

pytestmark = pytest.mark.timeout(120)


def qname() -> str:
    return f"rv-{uuid.uuid4().hex[:8]}"


def make(url: str, queue_name: str, **settings: Any) -> WorkQueue:
    """A queue with default settings, but for its store and the job queue its host takes."""
    return WorkQueue(WorkQueueSettings(database_url=url, auto_migrate=True, subscriptions=[],
                                       job_queues=queue_name, **settings))


async def delivery_of(queue: WorkQueue, job_id: uuid.UUID) -> Any:
    [info] = await queue.jobs.kernel.transport.message_deliveries(job_id)
    return info


async def state_becomes(queue: WorkQueue, job_id: uuid.UUID, state: str, within: float = 30.0) -> bool:
    for _ in range(int(within / 0.05)):
        status = await queue.job_status(job_id)
        if status is not None and status.state == state:
            return True
        await asyncio.sleep(0.05)
    return False


# -- 1. unique keys are not freed when the job ends outside the runner's own paths ---------------


async def test_cancelling_a_running_unique_job_frees_its_key(database_url: str) -> None:
    """docs/jobs.md: a unique key is "freed with unique_until="done" (the default) when the job ends
    (done, failed or discarded ...)"; a job is Discarded "by job.discard(reason), by forget_job, or
    by an operator"."""
    name = qname()
    started, finish = asyncio.Event(), asyncio.Event()
    queue = make(database_url, name, job_lease_seconds=3)  # (heartbeats each second: the cancel is seen soon)

    @queue.job(f"long-{name}", queue=name)
    async def long(payload: dict[str, Any], job: JobContext) -> None:
        started.set()
        await finish.wait()  # (the first is cancelled; the second ends when the test is done)

    async with queue.lifespan(None):
        first = await queue.dispatch(long, {}, unique="k")
        assert first is not None
        await asyncio.wait_for(started.wait(), 30)
        info = await delivery_of(queue, first)
        await queue.discard(info.subscription, info.delivery_id, "cancelled by the operator")
        assert await state_becomes(queue, first, "Discarded")
        second = await queue.dispatch(long, {}, unique="k")
        finish.set()
    assert second is not None, "the cancelled (Discarded) job still holds its unique key"


async def test_discarding_a_waiting_unique_job_frees_its_key(database_url: str) -> None:
    """Same promise, for a job an operator discards while it waits (delayed)."""
    name = qname()
    queue = make(database_url, name, enabled=False)

    @queue.job(f"later-{name}", queue=name)
    async def later(payload: dict[str, Any]) -> None:
        pass

    async with queue.lifespan(None):
        first = await queue.dispatch(later, {}, unique="k", delay=600)
        assert first is not None
        info = await delivery_of(queue, first)
        await queue.discard(info.subscription, info.delivery_id, "not wanted")
        assert await state_becomes(queue, first, "Discarded")
        second = await queue.dispatch(later, {}, unique="k")
    assert second is not None, "the discarded job still holds its unique key"


async def test_a_unique_job_that_fails_by_its_lease_on_its_last_try_frees_its_key(database_url: str) -> None:
    """Same promise, for a job that failed for good because its lease ran out on its last try
    (docs: "returns after its lease ran out ... JobReleased(reason="lease-lost") (or JobFailed on
    its last try)")."""
    name = qname()
    queue = make(database_url, name, job_lease_seconds=1.0)
    events: list[JobEvent] = []
    queue.listen(JobEvent, events.append)

    @queue.job(f"blocks-{name}", queue=name, tries=1)
    async def blocks(payload: dict[str, Any]) -> None:
        time.sleep(2.5)  # noqa: ASYNC251 (on purpose: it outlives its lease)

    async with queue.lifespan(None):
        first = await queue.dispatch(blocks, {}, unique="k")
        assert first is not None
        await wait_for(lambda: any(type(e).__name__ == "JobFailed" for e in events), within=30)
        assert await state_becomes(queue, first, "Failed")
        second = await queue.dispatch(blocks, {}, unique="k")
    assert second is not None, "the failed job still holds its unique key"


# -- 2. an operator's cancel of a running job emits no event --------------------------------------


async def test_cancelling_a_running_job_emits_job_discarded(database_url: str) -> None:
    """SPEC §8 "events: processing, processed, released (with the reason), failed, discarded": a job an
    operator cancels while it runs is heard as JobDiscarded("cancelled by an operator")."""
    name = qname()
    started = asyncio.Event()
    queue = make(database_url, name, job_lease_seconds=3)
    events: list[JobEvent] = []
    queue.listen(JobEvent, events.append)

    @queue.job(f"long-{name}", queue=name)
    async def long(payload: dict[str, Any], job: JobContext) -> None:
        started.set()
        await asyncio.sleep(60)

    async with queue.lifespan(None):
        first = await queue.dispatch(long, {})
        await asyncio.wait_for(started.wait(), 30)
        info = await delivery_of(queue, first)
        await queue.discard(info.subscription, info.delivery_id, "cancelled by the operator")
        assert await state_becomes(queue, first, "Discarded")
        await asyncio.sleep(0.5)
    assert [type(e).__name__ for e in events] == ["JobProcessing", "JobDiscarded"]


async def test_a_sweep_that_takes_back_jobs_leases_tells_what_became_of_each(database_url: str) -> None:
    """A job's worker that stops mid-attempt hears nothing more: the sweep that takes its lease back
    emits what became of the job (docs/jobs.md, Events): JobFailed on its last try, JobDiscarded
    when an operator had cancelled it, JobReleased("lease-lost") when it comes back."""
    name = qname()
    queue = make(database_url, name, job_lease_seconds=1.0, enabled=False)  # (no host: this test holds the leases)
    events: list[JobEvent] = []
    queue.listen(JobEvent, events.append)

    @queue.job(f"last-{name}", queue=name, tries=1)
    async def last(payload: dict[str, Any]) -> None: ...

    @queue.job(f"again-{name}", queue=name, tries=3, backoff=[30])
    async def again(payload: dict[str, Any]) -> None: ...

    async with queue.lifespan(None):
        failed = await queue.dispatch(last, {})
        released = await queue.dispatch(again, {})
        cancelled = await queue.dispatch(again, {})
        transport = queue.jobs.kernel.transport
        claimed = await transport.claim(f"jobs.{name}", 10)  # (a worker that claims them and stops)
        assert {c.message_id for c in claimed} == {failed, released, cancelled}
        info = await delivery_of(queue, cancelled)
        await queue.discard(info.subscription, info.delivery_id, "stop it")
        await asyncio.sleep(1.2)
        await queue.sweep()
        await wait_for(lambda: len(events) == 3, within=10, describe=lambda: events)
    by_id = {e.job_id: e for e in events}
    assert (type(by_id[failed]).__name__, by_id[failed].job, by_id[failed].attempt, by_id[failed].tries) == (
        "JobFailed", f"last-{name}", 1, 1)
    assert "lease ran out on its last try" in getattr(by_id[failed], "reason", "")
    assert (type(by_id[released]).__name__, getattr(by_id[released], "reason", None)) == ("JobReleased", "lease-lost")
    assert 20 < (getattr(by_id[released], "delay_seconds", None) or 0) <= 30
    assert (type(by_id[cancelled]).__name__, getattr(by_id[cancelled], "reason", None)) == (
        "JobDiscarded", "cancelled by an operator")


async def test_a_sweep_emits_only_the_events_of_jobs_its_app_declares(database_url: str) -> None:
    """Two apps on one database: a sweep takes back every lease of the database, the other app's
    too; its process hears the events of its own app's jobs only."""
    mine, theirs = qname(), qname()
    app_a = make(database_url, mine, job_lease_seconds=1.0, enabled=False)
    app_b = make(database_url, theirs, job_lease_seconds=1.0, enabled=False)
    heard: list[JobEvent] = []
    app_a.listen(JobEvent, heard.append)

    @app_a.job(f"a-{mine}", queue=mine, tries=1)
    async def a_job(payload: dict[str, Any]) -> None: ...

    @app_b.job(f"b-{theirs}", queue=theirs, tries=1)
    async def b_job(payload: dict[str, Any]) -> None: ...

    async with app_a.lifespan(None), app_b.lifespan(None):
        a_id = await app_a.dispatch(a_job, {})
        b_id = await app_b.dispatch(b_job, {})
        for queue, name in ((app_a, mine), (app_b, theirs)):  # (each app's worker claims, then dies)
            assert len(await queue.jobs.kernel.transport.claim(f"jobs.{name}", 10)) == 1
        await asyncio.sleep(1.2)
        report = await app_a.sweep()
        assert {t.subscription for t in report.taken_back} >= {f"jobs.{mine}", f"jobs.{theirs}"}
        await wait_for(lambda: heard, within=10)
        await asyncio.sleep(0.3)
    assert [(type(e).__name__, e.job_id) for e in heard] == [("JobFailed", a_id)], heard
    assert b_id is not None


async def test_a_failure_whose_settle_answer_was_lost_is_still_heard(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store wrote a job's failure, but the answer was lost (the connection dropped after the
    commit): the settler writes it again and the store answers LeaseLost, since the first write
    ended the lease. No sweeper will take that lease back, so the worker emits JobFailed itself."""
    transport_class: Any = None
    lost: list[Any] = []
    name = qname()
    queue = make(database_url, name)
    heard: list[JobEvent] = []
    queue.listen(JobEvent, heard.append)

    @queue.job(f"boom-{name}", queue=name, tries=1)
    async def boom(payload: dict[str, Any]) -> None:
        raise RuntimeError("boom")

    async with queue.lifespan(None):
        transport_class = type(queue.jobs.kernel.transport)
        real_settle = transport_class.settle

        async def answer_lost(self: Any, settlements: Any) -> Any:
            results = await real_settle(self, settlements)
            if not lost and any(s.kind in ("Fail", "DeadLetter") for s in settlements):
                lost.append(results)
                raise TransportError("the connection dropped after the commit", retryable=True)
            return results

        monkeypatch.setattr(transport_class, "settle", answer_lost)
        job_id = await queue.dispatch(boom, {})
        assert await state_becomes(queue, job_id, "Failed")
        await wait_for(lambda: any(type(e).__name__ == "JobFailed" for e in heard), within=10,
                       describe=lambda: heard)
    assert lost == [["DeadLettered"]]
    assert [type(e).__name__ for e in heard] == ["JobProcessing", "JobFailed"]


# -- 3. a payload model with field aliases is accepted at dispatch and fails at once in the worker --


class Aliased(BaseModel):
    user_id: int = Field(alias="userId")


async def test_a_payload_model_with_aliases_runs(database_url: str) -> None:
    """docs/jobs.md: the payload is "annotated with a pydantic model or any type pydantic validates";
    a type pydantic cannot write as JSON and read back "is refused at declaration with the reason";
    `dispatch` "validates the payload before anything is written". Here the dispatch is accepted
    and the job then fails for good: "userId: Field required"."""
    name = qname()
    queue = make(database_url, name)
    events: list[JobEvent] = []
    queue.listen(JobEvent, events.append)
    got: list[int] = []

    @queue.job(f"aliased-{name}", queue=name, tries=1)
    async def aliased(payload: Aliased) -> None:
        got.append(payload.user_id)

    async with queue.lifespan(None):
        await queue.dispatch(aliased, {"userId": 7})
        await wait_for(lambda: any(type(e).__name__ in ("JobProcessed", "JobFailed") for e in events), within=30)
    assert got == [7], [e for e in events if type(e).__name__ == "JobFailed"]


# -- 4. a debounced dispatch drops its priority ---------------------------------------------------


async def test_a_debounced_dispatch_keeps_its_priority(database_url: str) -> None:
    """docs/jobs.md: "`priority` (0 to 9) the declared priority, for this job"; debounce goes "with
    neither `delay` ... nor `unique`" (priority is not excluded) and "joins the caller's transaction
    as any other". The same test with delay= instead of debounce= passes."""
    name = qname()
    ran: list[str] = []

    def declare(queue: WorkQueue) -> Any:
        @queue.job(f"p-{name}", queue=name)
        async def p(payload: dict[str, Any]) -> None:
            ran.append(payload["n"])
        return p

    producer = make(database_url, name, enabled=False)
    p = declare(producer)
    async with producer.lifespan(None):
        for i in range(3):
            await producer.dispatch(p, {"n": f"low{i}"})
        await producer.dispatch(p, {"n": "high"}, debounce=0.2, debounce_key="k", priority=9)
    await asyncio.sleep(0.6)  # every job is due
    worker = make(database_url, name, job_concurrency=1)
    declare(worker)
    async with worker.lifespan(None):
        await wait_for(lambda: len(ran) == 4, within=30)
    assert ran[0] == "high", ran


# -- 5. a chain step's delay ----------------------------------------------------------------------


async def test_a_chain_step_waits_its_delay(database_url: str) -> None:
    """A chain step may carry {"delay": ...} (as a bulk item may): the first step waits it from now,
    a next one from when the one before succeeded."""
    name = qname()
    queue = make(database_url, name)
    done: list[str] = []

    @queue.job(f"a-{name}", queue=name)
    async def a(payload: dict[str, Any]) -> None:
        done.append(payload["step"])

    async with queue.lifespan(None):
        _, second = await queue.chain([(a, {"step": "first"}), (a, {"step": "second"}, {"delay": 600})])
        await wait_for(lambda: done == ["first"], within=30)
        later = None
        for _ in range(200):
            later = await queue.job_status(second)
            if later is not None:
                break
            await asyncio.sleep(0.05)
        delayed = await queue.chain([(a, {"step": "third"}, {"delay": 600}), (a, {"step": "fourth"})])
        status = await queue.job_status(delayed[0])
    assert later is not None and later.run_at is not None and later.created_at is not None
    assert (later.run_at - later.created_at).total_seconds() > 500, "the second step's delay was ignored"
    assert status is not None and status.run_at is not None and status.created_at is not None
    assert (status.run_at - status.created_at).total_seconds() > 500, "the first step's delay was ignored"
    assert done == ["first"]


async def test_a_whole_chain_is_waited_for_by_its_ids_in_order(database_url: str) -> None:
    """docs/jobs.md (Chains): a later step's id is unknown until the one before succeeded
    (JobNotFound), and waiting for the ids in order waits for the whole chain."""
    from fastapi_workqueue.jobs.waiting import JobNotFound

    name = qname()
    queue = make(database_url, name)
    gate = asyncio.Event()

    @queue.job(f"step-{name}", queue=name, store_result=True)
    async def step(payload: dict[str, Any]) -> int:
        if payload["n"] == 1:
            await gate.wait()
        return int(payload["n"]) * 10

    async with queue.lifespan(None):
        ids = await queue.chain([(step, {"n": n}) for n in (1, 2, 3)])
        assert await queue.job_status(ids[2]) is None
        with pytest.raises(JobNotFound):
            await queue.wait(ids[2], timeout=5)
        gate.set()
        results = [await queue.wait(job_id, timeout=30) for job_id in ids]
    assert results == [10, 20, 30]


# -- 6. catch_up queues at most 1,000 ticks ---------------------------------------------------------------


def minutely_catching_up(database_url: str) -> tuple[WorkQueue, str]:
    """A queue (no host) with a job ``tick-<queue>`` scheduled every minute with ``catch_up``; and its queue's name."""
    name = qname()
    queue = make(database_url, name, enabled=False)

    @queue.job(f"tick-{name}", queue=name)
    async def tick(payload: dict[str, Any]) -> None:
        pass

    queue.schedule(tick, every=60, payload={}, catch_up=True)
    return queue, name


async def test_catch_up_queues_at_most_1000_ticks(database_url: str) -> None:
    """docs/jobs.md (Schedules): with catch_up=True "the ticks since the last one the store knows are
    then queued (at most 1,000)"."""
    queue, name = minutely_catching_up(database_url)
    async with queue.lifespan(None):
        queued = await queue.jobs.schedules.run_due()
        size = await queue.size(name)
    assert queued <= 1000 and size <= 1000, (queued, size)


@pytest.mark.parametrize("down_minutes", [999, 1500])
async def test_catch_up_after_an_outage_longer_than_1000_ticks_queues_the_newest_1000(
    database_url: str, down_minutes: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Every process down for 1,500 ticks of a minutely schedule (25 hours): the newest 1,000 are
    queued, with a warning. It queued none: a tick the store knew lay past the 1,000 it looked at,
    so the schedule was taken for a new one ("nothing to catch up")."""
    from datetime import UTC, datetime, timedelta

    queue, name = minutely_catching_up(database_url)
    start = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    async with queue.lifespan(None):
        assert await queue.jobs.schedules.run_due(start) == 1  # (the schedule's first tick, on time)
        queue.jobs.schedules.forget_looks()  # (every process down: the next look is a first look)
        with caplog.at_level(logging.INFO, logger="fastapi_workqueue.jobs.schedules"):
            queued = await queue.jobs.schedules.run_due(start + timedelta(minutes=down_minutes))
        size = await queue.size(name)
    assert queued == min(down_minutes, 1000) and size == 1 + queued, (queued, size)
    said = [r.getMessage() for r in caplog.records if r.name == "fastapi_workqueue.jobs.schedules"]
    assert not any("nothing to catch up" in line for line in said), said
    assert any("the newest 1000 are queued" in line for line in said) == (down_minutes > 1000), said


async def test_a_restart_queues_every_tick_of_the_last_minute_after_the_newest_known(database_url: str) -> None:
    """docs/jobs.md (Schedules): "A tick missed while every process was down is not queued
    afterwards (a tick seen up to a minute late still is)". A schedule of every 5 s across a
    restart of 22 s: only the newest tick was queued, the four before it (7 to 17 s late) never;
    and after an outage of more than a minute, none of the last minute's but the newest. A new
    schedule still starts with one tick, and an outage still loses the ticks more than a minute late."""
    from datetime import UTC, datetime, timedelta

    name = qname()
    queue = make(database_url, name, enabled=False)

    @queue.job(f"every5-{name}", queue=name)
    async def tick(payload: dict[str, Any]) -> None:
        pass

    queue.schedule(tick, every=5, payload={})
    start = datetime(2026, 12, 1, 12, 0, 1, tzinfo=UTC)
    schedules = queue.jobs.schedules
    async with queue.lifespan(None):
        assert await queue.run_schedules(start) == 1  # (new: its newest tick, not a minute of them)
        assert await queue.run_schedules(start + timedelta(seconds=5)) == 1
        schedules.forget_looks()  # (every process down from +5 s to +27 s)
        assert await queue.run_schedules(start + timedelta(seconds=27)) == 4  # (+10, +15, +20, +25)
        schedules.forget_looks()  # (and again, the newest known tick inside the minute: nothing new)
        assert await queue.run_schedules(start + timedelta(seconds=28)) == 0
        schedules.forget_looks()  # (down for more than the minute: the last minute's, +145 to +200, not the rest)
        assert await queue.run_schedules(start + timedelta(seconds=200)) == 12
        assert await queue.size(name) == 18


def test_ticks_between_keeps_the_newest_1000() -> None:
    """A process that missed more than 1,000 ticks (its loop blocked) queues the newest 1,000."""
    from datetime import UTC, datetime, timedelta

    from fastapi_workqueue.jobs.schedules import MAX_CATCH_UP, Schedule

    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///:memory:", enabled=False))

    @queue.job("tick-bound")
    async def tick(payload: dict[str, Any]) -> None:
        pass

    schedule = queue.schedule(tick, every=60, payload={})
    assert isinstance(schedule, Schedule)
    start = datetime(2026, 12, 1, tzinfo=UTC)
    ticks = schedule.ticks_between(start, start + timedelta(minutes=1500))
    assert len(ticks) == MAX_CATCH_UP
    assert ticks[-1] == start + timedelta(minutes=1500)
    assert ticks[0] == start + timedelta(minutes=501)
    assert ticks == sorted(ticks)
    few = schedule.ticks_between(start, start + timedelta(minutes=3, seconds=30))
    assert few == [start + timedelta(minutes=m) for m in (1, 2, 3)]


# -- the settle of an attempt that ended in time waits past the lease -----------------------------


class SettlesLate(MemoryTransport):
    """A store whose first settle waits past the lease while a sweep takes the lease back: what
    another process's write lock held that long does on SQLite."""

    def __init__(self, wait: float) -> None:
        super().__init__()
        self.wait = wait
        self.first = True

    async def _late(self) -> None:
        if self.first:
            self.first = False
            await asyncio.sleep(self.wait)
            await self.sweep()

    async def settle(self, settlements: Any) -> Any:
        await self._late()
        return await super().settle(settlements)

    async def settle_with_follow_ups(self, settlement: Any) -> Any:
        await self._late()
        return await super().settle_with_follow_ups(settlement)


async def test_a_completion_the_store_refused_after_the_lease_ran_out_is_not_heard_processed() -> None:
    """docs/jobs.md: when a sweeper took the lease back first, "the outcome is not written: that
    sweeper's process emits JobReleased(reason="lease-lost") ..., and the worker that comes back
    emits nothing more for that attempt". An attempt that returned within its lease but whose
    settle waited past it was heard JobProcessed, and again when it ran a second time."""
    name = qname()
    queue = WorkQueue(WorkQueueSettings(database_url=None, subscriptions=[], job_queues=name, job_lease_seconds=1),
                      transport=SettlesLate(wait=1.5))
    events: list[JobEvent] = []
    queue.listen(JobEvent, events.append)
    runs: list[int] = []

    @queue.job(f"quick-{name}", queue=name)
    async def quick(payload: dict[str, Any], job: JobContext) -> None:
        runs.append(job.attempt)

    async with queue.lifespan(None):
        job_id = await queue.dispatch(quick, {})
        assert await state_becomes(queue, job_id, "Completed")
        await asyncio.sleep(0.3)  # (time for a late event, were there one)
    assert runs == [1, 2]
    processed = [e.attempt for e in events if type(e).__name__ == "JobProcessed"]
    assert processed == [2], [(type(e).__name__, e.attempt) for e in events]


async def test_a_running_job_cancelled_then_stopped_by_a_shutdown_is_heard_discarded(database_url: str) -> None:
    """docs/jobs.md: a job "cancelled by an operator while it runs" ends Discarded with
    JobDiscarded(reason="cancelled by an operator"). Cancelled, then stopped by a shutdown before a
    heartbeat told it of the cancel, it ended Discarded in the store but was heard JobReleased
    (reason="shutdown"): a listener was told it would come back, and it never does."""
    name = qname()
    started = asyncio.Event()
    queue = make(database_url, name)  # (a 90 s lease: no heartbeat tells the attempt of the cancel)
    events: list[JobEvent] = []
    queue.listen(JobEvent, events.append)

    @queue.job(f"long-{name}", queue=name)
    async def long(payload: dict[str, Any], job: JobContext) -> None:
        started.set()
        await asyncio.Event().wait()

    async with queue.lifespan(None):
        job_id = await queue.dispatch(long, {})
        await asyncio.wait_for(started.wait(), 30)
        assert (await queue.cancel_job(job_id, "op cancel")).result == "CancelRequested"
    async with make(database_url, name, enabled=False).lifespan(None) as state:
        status = await state["workqueue"].job_status(job_id)
    assert status is not None and status.state == "Discarded"
    ends = [(type(e).__name__, getattr(e, "reason", None)) for e in events if type(e).__name__ != "JobProcessing"]
    assert ends == [("JobDiscarded", "cancelled by an operator")], ends
