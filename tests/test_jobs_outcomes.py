"""How a job's attempt can end, on a real store (PostgreSQL and an SQLite file): middleware of one's
own that releases or discards, FatalWorkError, overlap and once-busy releases with their event
reasons, listeners that fail, unique keys freed at processing, on failure and on discard, delay
and queue given at dispatch, a chain that a discard ends, and once/step with plain callables."""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from fastapi_workqueue import (
    ConfigurationError,
    FatalWorkError,
    JobContext,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.jobs import (
    JobDiscarded,
    JobEvent,
    JobFailed,
    JobProcessed,
    JobReleased,
    without_overlapping,
)

from .support import FAST, wait_for

pytestmark = pytest.mark.timeout(90)


def make_queue(url: str, queue_name: str, **settings: Any) -> WorkQueue:
    """A queue whose host takes ``queue_name`` only (job queues are named in the whole database)."""
    options = {**FAST, "job_concurrency": 4, "job_queues": queue_name, **settings}
    return WorkQueue(WorkQueueSettings(database_url=url, auto_migrate=True, subscriptions=[], **options))


def heard_queue(url: str, prefix: str) -> tuple[str, str, WorkQueue, list[JobEvent]]:
    """A suffix unique to the test, the job queue ``prefix-suffix``, a queue whose host takes it, and
    the events that queue hears."""
    suffix = uuid.uuid4().hex[:8]
    name = f"{prefix}-{suffix}"
    queue = make_queue(url, name)
    events: list[JobEvent] = []
    queue.listen(JobEvent, events.append)
    return suffix, name, queue, events


def kinds(events: list[JobEvent], job_id: uuid.UUID | None) -> list[str]:
    return [type(e).__name__ for e in events if e.job_id == job_id]


class Receipt(BaseModel):
    number: int


class Reminder(BaseModel):
    model_config = ConfigDict(strict=True)

    at: datetime
    user: uuid.UUID
    slots: tuple[int, int]


async def test_a_job_with_a_strict_payload_model_runs_with_what_was_dispatched(database_url: str) -> None:
    # The stored payload is JSON: a strict model gets its datetime, UUID and tuple back from their
    # JSON forms (validating the objects JSON reads as would refuse them and dead-letter the job).
    suffix, name, queue, events = heard_queue(database_url, "strict")
    ran: list[Reminder] = []

    @queue.job(f"remind-{suffix}", queue=name)
    async def remind(payload: Reminder) -> None:
        ran.append(payload)

    sent = Reminder(at=datetime(2026, 12, 24, 18, 30, tzinfo=UTC), user=uuid.uuid4(), slots=(2, 3))
    async with queue.lifespan(None):
        job = await queue.dispatch(remind, sent)
        await wait_for(lambda: "JobProcessed" in kinds(events, job), within=30)
    assert ran == [sent]
    assert kinds(events, job) == ["JobProcessing", "JobProcessed"]


async def test_middleware_of_ones_own_releases_or_discards_and_a_fatal_error_fails_at_once(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    suffix, name, queue, events = heard_queue(database_url, "outcomes")
    heard_async: list[JobEvent] = []
    ran: list[tuple[str, int]] = []

    async def hear(event: JobEvent) -> None:
        await asyncio.sleep(0)
        heard_async.append(event)

    def broken(event: JobProcessed) -> None:
        raise RuntimeError("the listener is broken")

    queue.listen(JobEvent, hear)
    queue.listen(JobProcessed, broken)

    async def gate(attempt: Any, call_next: Any) -> Any:
        kind = attempt.payload["kind"]
        if kind == "release" and attempt.job.attempt == 1:
            return attempt.job.release(0)
        if kind == "discard":
            return attempt.job.discard("the middleware said no")
        return await call_next()

    @queue.job(f"gated-{suffix}", tries=3, backoff=[0], queue=name, middleware=[gate])
    async def gated(payload: dict[str, Any], job: JobContext) -> None:
        ran.append((payload["kind"], job.attempt))

    @queue.job(f"fatal-{suffix}", tries=5, backoff=[0], queue=name)
    async def fatal(payload: dict[str, Any]) -> None:
        raise FatalWorkError("the card was declined for good")

    caplog.set_level(logging.ERROR, logger="fastapi_workqueue.jobs")
    async with queue.lifespan(None):
        released = await queue.dispatch(gated, {"kind": "release"})
        discarded = await queue.dispatch(gated, {"kind": "discard"})
        plain = await queue.dispatch(gated, {"kind": "plain"})
        failed = await queue.dispatch(fatal, {})
        await wait_for(lambda: len([e for e in events if isinstance(e, JobProcessed | JobDiscarded | JobFailed)])
                       == 4, within=30)
        await wait_for(lambda: len(heard_async) == len(events))
        [failed_job] = await queue.failed_jobs(name)
        infos = {job_id: (await queue.transport.message_deliveries(job_id))[0]
                 for job_id in (released, discarded, plain, failed)}

    assert sorted(ran) == [("plain", 1), ("release", 2)]  # the discarded job's function never ran
    assert kinds(events, released) == ["JobProcessing", "JobReleased", "JobProcessing", "JobProcessed"]
    assert [e.reason for e in events if isinstance(e, JobReleased)] == ["release"]
    assert kinds(events, discarded) == ["JobProcessing", "JobDiscarded"]
    assert kinds(events, plain) == ["JobProcessing", "JobProcessed"]
    assert kinds(events, failed) == ["JobProcessing", "JobFailed"]  # no retry, whatever tries are left
    [fail_event] = [e for e in events if isinstance(e, JobFailed)]
    assert isinstance(fail_event.exception, FatalWorkError) and fail_event.attempt == 1
    assert (fail_event.id, fail_event.name) == (failed, f"fatal-{suffix}")
    assert failed_job.id == failed and failed_job.attempts == 1 and "declined for good" in (failed_job.error or "")
    assert {k: (v.status, v.attempt) for k, v in infos.items()} == {
        released: ("Completed", 2), discarded: ("Discarded", 1), plain: ("Completed", 1), failed: ("DeadLettered", 1),
    }
    assert infos[discarded].reason == "the middleware said no"
    # The broken listener was logged twice (two JobProcessed) and changed nothing.
    assert sum("listener" in r.getMessage() and "JobProcessed" in r.getMessage() for r in caplog.records) == 2


async def test_a_taken_overlap_key_or_a_busy_once_key_sends_the_attempt_back_saying_why(database_url: str) -> None:
    suffix, name, queue, events = heard_queue(database_url, "busy")
    overlapped: list[tuple[uuid.UUID, int]] = []
    once_results: list[tuple[uuid.UUID, bool, int]] = []
    once_calls: list[uuid.UUID] = []
    # Whoever holds a key holds it until the other attempt was sent back for it (then it lets go).
    sent_back = {"overlap": asyncio.Event(), "once-busy": asyncio.Event()}
    queue.listen(JobReleased, lambda e: sent_back[e.reason].set() if e.reason in sent_back else None)

    @queue.job(f"overlap-{suffix}", tries=5, backoff=[0], queue=name,  # back after 1 s: the key is free by then
               middleware=[without_overlapping(key_or_fn=lambda p: f"report-{p['account']}", release_after=1)])
    async def overlapping(payload: dict[str, Any], job: JobContext) -> None:
        if job.attempt == 1:
            await asyncio.wait_for(sent_back["overlap"].wait(), 10)
        overlapped.append((job.id, job.attempt))

    @queue.job(f"once-{suffix}", tries=1, queue=name)  # one try: a once-busy return must not spend it
    async def mail_once(payload: dict[str, Any], job: JobContext) -> None:
        async def send() -> None:
            await asyncio.wait_for(sent_back["once-busy"].wait(), 10)
            once_calls.append(job.id)

        once_results.append((job.id, await job.once(f"mail-{suffix}", send), job.attempt))

    async with queue.lifespan(None):
        first, second = await queue.bulk([(overlapping, {"account": 7}), (overlapping, {"account": 7})])
        a, b = await queue.bulk([(mail_once, {}), (mail_once, {})])
        await wait_for(lambda: len(overlapped) == 2 and len(once_results) == 2, within=30,
                       describe=lambda: (overlapped, once_results, events))
    reasons = {e.job_id: e.reason for e in events if isinstance(e, JobReleased)}
    # Exactly one of each pair found its key taken and went back, saying why.
    assert sorted(reasons[j] for j in (first, second) if j in reasons) == ["overlap"]
    assert sorted(reasons[j] for j in (a, b) if j in reasons) == ["once-busy"]
    # The overlap counts as an attempt; the once-busy return does not.
    assert sorted(attempt for _, attempt in overlapped) == [1, 2]
    assert sorted((ran, attempt) for _, ran, attempt in once_results) == [(False, 1), (True, 1)]
    assert len(once_calls) == 1


async def test_unique_keys_are_freed_at_processing_on_failure_and_on_discard(database_url: str) -> None:
    suffix = uuid.uuid4().hex[:8]
    name = f"unique-{suffix}"
    producer = make_queue(database_url, name, enabled=False)
    worker = make_queue(database_url, name)
    started = asyncio.Event()
    go_on = asyncio.Event()

    for q in (producer, worker):
        @q.job(f"rebuild-{suffix}", tries=1, queue=name)
        async def rebuild(payload: dict[str, Any], job: JobContext) -> Any:
            if payload["how"] == "wait":
                started.set()
                await go_on.wait()
            elif payload["how"] == "fail":
                raise ValueError("no luck")
            elif payload["how"] == "discard":
                return job.discard("nothing to rebuild")
            return None

    job = f"rebuild-{suffix}"
    async with producer.lifespan(None):
        kept = await producer.dispatch(job, {"how": "wait"}, unique="members", unique_until="processing")
        assert kept is not None
        assert await producer.dispatch(job, {"how": "wait"}, unique="members", unique_until="processing") is None
        for how in ("fail", "discard"):
            assert await producer.dispatch(job, {"how": how}, unique=how) is not None
            assert await producer.dispatch(job, {"how": how}, unique=how) is None  # held until done
        async with worker.lifespan(None):
            await asyncio.wait_for(started.wait(), 30)
            # Started: a key held until processing is free again while the first job still runs.
            again = await producer.dispatch(job, {"how": "plain"}, unique="members", unique_until="processing")
            assert again is not None and again != kept
            go_on.set()
            await wait_for(_empty(producer, name), within=30)
        # The failed job and the discarded one freed their keys when they ended.
        assert await producer.dispatch(job, {"how": "plain"}, unique="fail") is not None
        assert await producer.dispatch(job, {"how": "plain"}, unique="discard") is not None


def _empty(queue: WorkQueue, name: str) -> Any:
    async def check() -> bool:
        return await queue.size(name) == 0

    return check


async def test_delay_and_queue_given_at_dispatch_override_the_declaration(database_url: str) -> None:
    suffix = uuid.uuid4().hex[:8]
    declared, other = f"declared-{suffix}", f"other-{suffix}"
    queue = make_queue(database_url, declared, enabled=False)

    @queue.job(f"later-{suffix}", queue=declared)
    async def later(payload: dict[str, Any]) -> None:
        return None

    async with queue.lifespan(None):
        before = datetime.now(UTC)
        job_id = await queue.dispatch(later, {}, delay=timedelta(minutes=5), queue=other)
        seconds_id = await queue.dispatch(later, {}, delay=90)
        assert await queue.size(declared) == 1 and await queue.size(other) == 1
        [info] = await queue.transport.message_deliveries(job_id)
        [in_seconds] = await queue.transport.message_deliveries(seconds_id)
    assert info.subscription == f"jobs.{other}" and in_seconds.subscription == f"jobs.{declared}"
    assert info.visible_at is not None and info.visible_at >= before + timedelta(minutes=5) - timedelta(seconds=1)
    assert in_seconds.visible_at is not None and in_seconds.visible_at >= before + timedelta(seconds=89)


async def test_a_discard_ends_its_chain_and_once_and_step_take_plain_callables(database_url: str) -> None:
    suffix, name, queue, events = heard_queue(database_url, "chain")
    ran: list[str] = []
    steps: list[Any] = []

    @queue.job(f"first-{suffix}", queue=name)
    async def first(payload: dict[str, Any], job: JobContext) -> Any:
        ran.append("first")
        return job.discard("the import is empty") if payload["empty"] else None

    @queue.job(f"second-{suffix}", tries=2, backoff=[0], queue=name)
    async def second(payload: dict[str, Any], job: JobContext) -> None:
        mailed = await job.once(f"sync-once-{job.id}", lambda: ran.append("mailed"))  # a plain callable
        receipt = await job.step("receipt", lambda: Receipt(number=7))  # a plain one returning a model
        steps.append((job.attempt, mailed, receipt))
        if job.attempt == 1:
            raise ValueError("the CRM is down")

    async with queue.lifespan(None):
        stopped, never = await queue.chain([(first, {"empty": True}), (second, {})])
        await wait_for(lambda: any(isinstance(e, JobDiscarded) for e in events), within=30)
        await queue.chain([(first, {"empty": False}), (second, {})])
        await wait_for(lambda: sum(isinstance(e, JobProcessed) for e in events) == 2, within=30)
        [info] = await queue.transport.message_deliveries(stopped)
        assert await queue.transport.message_deliveries(never) == []  # never queued
    [discard] = [e for e in events if isinstance(e, JobDiscarded)]
    assert discard.chain_ended and discard.job_id == stopped
    assert info.status == "Discarded" and "the chain ends here" in (info.reason or "")
    assert ran == ["first", "first", "mailed"]  # the discarded chain's second job never ran
    # Both attempts see the step's result as JSON gives it back; once ran its callable once.
    assert steps == [(1, True, {"number": 7}), (2, False, {"number": 7})]


def test_a_schedule_takes_every_as_a_timedelta_or_seconds() -> None:
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))

    @queue.job("stats.rebuild")
    async def rebuild(payload: dict[str, Any]) -> None:
        return None

    queue.schedule(rebuild, every=timedelta(minutes=5), payload={}, name="by-timedelta")
    queue.schedule(rebuild, every=300, payload={}, name="by-seconds")
    listing = queue.jobs.schedules.listing(datetime(2026, 1, 1, 12, 2, tzinfo=UTC))
    assert {row["Name"]: row["NextRun"] for row in listing} == {
        "by-timedelta": "2026-01-01T12:05:00+00:00", "by-seconds": "2026-01-01T12:05:00+00:00",
    }
    with pytest.raises(ConfigurationError, match="timedelta"):
        queue.schedule(rebuild, every="5m", payload={}, name="by-text")  # type: ignore[arg-type]  # text, on purpose


async def test_a_payload_that_no_key_decrypts_fails_at_once_without_the_secret_in_its_record(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from cryptography.fernet import Fernet

    lost, current = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    suffix = uuid.uuid4().hex[:8]
    name, job_name = f"undecryptable-{suffix}", f"secret-{suffix}"
    secret = f"reset-link-{uuid.uuid4().hex}"
    producer = make_queue(database_url, name, enabled=False, app_key=lost)
    worker = make_queue(database_url, name, app_key=current)  # the old key is gone, not in the previous keys
    events: list[JobEvent] = []
    worker.listen(JobEvent, events.append)
    for q in (producer, worker):
        @q.job(job_name, encrypted=True, tries=5, queue=name)
        async def send_reset(payload: dict[str, str]) -> None:
            raise AssertionError("never runs")

    async with producer.lifespan(None):
        job_id = await producer.dispatch(job_name, {"link": secret})
    async with worker.lifespan(None):
        await wait_for(lambda: any(isinstance(e, JobFailed) for e in events), within=30)
        [failed] = await worker.failed_jobs(name, include_payload=True)
        [info] = await worker.transport.message_deliveries(job_id)
        with caplog.at_level(logging.WARNING, logger="fastapi_workqueue.jobs"):
            assert await worker.reencrypt_jobs() == 0  # it skips the job no key decrypts, and says so
        assert any("no key decrypts" in r.getMessage() and str(job_id) in r.getMessage() for r in caplog.records)
    assert kinds(events, job_id) == ["JobFailed"] and events[-1].attempt == 1  # no retry
    assert failed.id == job_id and info.status == "DeadLettered" and info.attempt == 1
    record = failed.model_dump_json()
    assert secret not in record and lost not in record and current not in record
    assert "key" in (failed.reason or "").lower(), failed.reason


async def test_a_job_keeps_the_policy_it_was_dispatched_with_through_a_deploy(database_url: str) -> None:
    suffix = uuid.uuid4().hex[:8]
    name, job_name = f"deploy-{suffix}", f"sync-crm-{suffix}"
    before = make_queue(database_url, name, enabled=False)
    after = make_queue(database_url, name)
    attempts: list[int] = []

    @before.job(job_name, tries=2, backoff=[0], queue=name)
    async def old_version(payload: dict[str, Any]) -> None:
        raise AssertionError("the old version never runs here")

    @after.job(job_name, tries=6, backoff=[60], queue=name)  # the new release asks for more, and slower
    async def new_version(payload: dict[str, Any], job: JobContext) -> None:
        attempts.append(job.attempt)
        assert job.tries == 2
        raise ValueError("the CRM is down")

    async with before.lifespan(None):
        job_id = await before.dispatch(job_name, {})
    async with after.lifespan(None):
        await wait_for(lambda: after.failed_jobs(name), within=30)
        [failed] = await after.failed_jobs(name)
    assert failed.id == job_id and failed.attempts == 2 and attempts == [1, 2]  # tries and backoff of dispatch


async def test_the_queues_log_lines_of_a_job_name_the_job(database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    suffix, name, queue, _ = heard_queue(database_url, "logs")

    @queue.job(f"notes.send-digest-{suffix}", queue=name, tries=1)
    async def send_digest(payload: Receipt) -> None:
        raise LookupError("no digest for today")

    @queue.job(f"notes.archive-{suffix}", queue=name, tries=1)
    async def archive(payload: Receipt, job: JobContext) -> None:  # the general path (a context, a failure)
        raise FatalWorkError("the archive is read-only")

    caplog.set_level(logging.WARNING, logger="fastapi_workqueue.runtime")
    async with queue.lifespan(None):
        first = await queue.dispatch(send_digest, Receipt(number=1))
        second = await queue.dispatch(archive, Receipt(number=2))
        await wait_for(lambda: len([r for r in caplog.records if "attempt 1 of 1" in r.getMessage()]) == 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "fastapi_workqueue.runtime"]
    [digest] = [line for line in lines if f"(job notes.send-digest-{suffix})" in line]
    [archived] = [line for line in lines if f"(job notes.archive-{suffix})" in line]
    assert f"(message {first})" in digest and "LookupError" in digest
    assert "FatalWorkError: the archive is read-only" in archived
    assert str(second) not in digest


async def test_a_step_that_blocks_in_a_thread_keeps_the_lease(database_url: str) -> None:
    """A step whose blocking call (a synchronous HTTP client, say) takes longer than the job's
    lease, given as the docs say (``lambda: asyncio.to_thread(...)``): the loop goes on (heartbeats
    renew the lease), and the step and the job run once."""
    import time

    suffix = uuid.uuid4().hex[:8]
    name = f"blocking-step-{suffix}"
    queue = make_queue(database_url, name, job_lease_seconds=1.0)
    charged: list[int] = []
    attempts: list[int] = []
    ticks: list[float] = []

    def charge(order: int) -> dict[str, int]:
        time.sleep(2.5)  # blocks its thread, past the 1 s lease
        charged.append(order)
        return {"id": order}

    @queue.job(f"fulfil-{suffix}", queue=name, tries=3, store_result=True)
    async def fulfil(payload: dict[str, Any], job: JobContext) -> Any:
        attempts.append(job.attempt)
        ticker = asyncio.ensure_future(_tick(ticks))
        try:
            return await job.step("charge", lambda: asyncio.to_thread(charge, 7))
        finally:
            ticker.cancel()

    async with queue.lifespan(None):
        job_id = await queue.dispatch(fulfil, {})
        assert await queue.wait(job_id, timeout=30) == {"id": 7}
    assert charged == [7] and attempts == [1]
    assert len(ticks) >= 10  # the loop ran on while the step blocked (a tick every 50 ms)


async def _tick(ticks: list[float]) -> None:
    while True:
        await asyncio.sleep(0.05)
        ticks.append(asyncio.get_running_loop().time())


async def test_a_steps_function_runs_on_the_loop_once(database_url: str) -> None:
    """A plain function given to a step runs on the event loop, once: one that builds its
    awaitable with the loop (``asyncio.gather``) works, and what it does runs one time."""
    suffix = uuid.uuid4().hex[:8]
    name = f"loop-step-{suffix}"
    queue = make_queue(database_url, name)
    calls: list[int] = []

    async def fetch(n: int) -> int:
        await asyncio.sleep(0)
        return n

    def both() -> Any:
        calls.append(1)  # (a side effect before the loop is asked for)
        return asyncio.gather(fetch(1), fetch(2))

    @queue.job(f"both-{suffix}", queue=name, tries=1, store_result=True)
    async def run(payload: dict[str, Any], job: JobContext) -> Any:
        return await job.step("fetch-both", both)

    async with queue.lifespan(None):
        job_id = await queue.dispatch(run, {})
        assert await queue.wait(job_id, timeout=30) == [1, 2]
    assert calls == [1]
