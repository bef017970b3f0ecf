"""How jobs are taken and timed: strict and fair queue order, timeouts, unknown jobs, schedules, sync mode."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import ConfigurationError, JobContext, WorkQueue, WorkQueueSettings
from fastapi_workqueue.jobs import JobEvent, JobReleased
from fastapi_workqueue.jobs.watchdog import THREAD_NAME
from fastapi_workqueue.jobs.worker import UnwatchedQueues, check_fits_lease, parse_queues

from .support import FAST, wait_for

pytestmark = pytest.mark.timeout(90)

THIS_FILE = str(Path(__file__).resolve())


def names(n: int) -> list[str]:
    suffix = uuid.uuid4().hex[:6]
    return [f"q{i}-{suffix}" for i in range(n)]


def queue_with(url: str, queues: list[str], order: str | None, ran: list[str], **settings: Any) -> WorkQueue:
    queue = WorkQueue(WorkQueueSettings(database_url=url, auto_migrate=True, subscriptions=[],
                                        job_queues=order, **{**FAST, **settings}))
    for name in queues:
        @queue.job(f"job-{name}", queue=name)
        async def job(payload: dict[str, Any], job: JobContext) -> None:
            ran.append(job.queue)
            await asyncio.sleep(0.01)
    return queue


def test_a_queue_list_is_checked() -> None:
    assert parse_queues(None) == ["*"] and parse_queues("mail, *") == ["mail", "*"]
    with pytest.raises(ConfigurationError, match="empty entry"):
        parse_queues("mail,,default")
    with pytest.raises(ConfigurationError, match="twice"):
        parse_queues("mail,mail")
    with pytest.raises(ConfigurationError, match="not valid"):
        parse_queues("mail queue")


async def test_strict_order_takes_the_first_queue_before_any_job_of_the_next(database_url: str) -> None:
    first, second = names(2)
    ran: list[str] = []
    producer = queue_with(database_url, [first, second], None, ran, enabled=False)
    async with producer.lifespan(None):
        await producer.bulk([(f"job-{second}", {}) for _ in range(5)])  # older
        await producer.bulk([(f"job-{first}", {}) for _ in range(5)])
    worker = queue_with(database_url, [first, second], f"{first},{second}", ran, job_concurrency=1)
    async with worker.lifespan(None):
        await wait_for(lambda: len(ran) == 10, within=30)
    assert ran == [first] * 5 + [second] * 5


async def test_the_apps_host_takes_only_the_job_queues_its_list_names(database_url: str) -> None:
    """WORKQUEUE_JOB_QUEUES narrows an app's own host as --queue narrows a worker, with the default
    subscription plan (``*``) in place: a job of a queue the list leaves out stays Pending."""
    taken, left = names(2)
    ran: list[str] = []
    producer = queue_with(database_url, [taken, left], None, ran, enabled=False)
    async with producer.lifespan(None):
        await producer.dispatch(f"job-{left}", {})
        await producer.dispatch(f"job-{taken}", {})
    app = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, job_queues=taken, **FAST))
    for name in (taken, left):
        @app.job(f"job-{name}", queue=name)
        async def job(payload: dict[str, Any], job: JobContext) -> None:
            ran.append(job.queue)
    assert [p.name for p in app.settings.subscriptions] == ["*"]
    async with app.lifespan(None):
        await wait_for(lambda: ran == [taken], within=30)
        await asyncio.sleep(1.0)  # several polls of the host
        health = {s.subscription: s.state for s in app.health().subscriptions}
        [counts] = await app.stats(f"jobs.{left}")
    assert ran == [taken]
    assert health.get(f"jobs.{taken}") == "Running" and f"jobs.{left}" not in health
    assert counts.pending == 1


async def test_the_apps_host_warns_of_a_job_queue_nothing_uses(database_url: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    real, = names(1)
    app = queue_with(database_url, [real], f"{real},{real}-typo", [])
    with caplog.at_level(logging.WARNING, logger="fastapi_workqueue"):
        async with app.lifespan(None):
            pass
    warned = [r.getMessage() for r in caplog.records if "WORKQUEUE_JOB_QUEUES" in r.getMessage()]
    assert warned == [f"WORKQUEUE_JOB_QUEUES names job queue(s) '{real}-typo' that no job declares and the store "
                      f"does not hold; the app's job queues are {real}"]


async def test_fair_order_takes_the_oldest_due_job_of_any_queue(fresh_url: str) -> None:
    database_url = fresh_url
    a, b, c = names(3)
    ran: list[str] = []
    producer = queue_with(database_url, [a, b, c], None, ran, enabled=False)
    async with producer.lifespan(None):
        for name in (b, a, c, b, a):
            await producer.dispatch(f"job-{name}", {})
            await asyncio.sleep(0.002)  # distinct times of creation
    worker = queue_with(database_url, [a, b, c], None, ran, job_concurrency=1)  # every queue, fairly
    async with worker.lifespan(None):
        await wait_for(lambda: len(ran) == 5, within=30)
    assert ran == [b, a, c, b, a]


async def test_a_list_with_a_star_takes_the_named_queue_first_and_the_rest_fairly(fresh_url: str) -> None:
    database_url = fresh_url
    mail, x, y = names(3)
    ran: list[str] = []
    producer = queue_with(database_url, [mail, x, y], None, ran, enabled=False)
    async with producer.lifespan(None):
        for name in (x, y, mail, x, mail):
            await producer.dispatch(f"job-{name}", {})
            await asyncio.sleep(0.002)
    worker = queue_with(database_url, [mail, x, y], f"{mail},*", ran, job_concurrency=1)
    async with worker.lifespan(None):
        await wait_for(lambda: len(ran) == 5, within=30)
    assert ran == [mail, mail, x, y, x]


async def test_a_worker_warns_once_about_jobs_waiting_on_queues_it_does_not_take(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    taken, other = names(2)
    ran: list[str] = []
    queue = queue_with(database_url, [taken, other], None, ran, enabled=False)
    async with queue.lifespan(None):
        await queue.dispatch(f"job-{other}", {})
        watcher = UnwatchedQueues(queue.jobs, [taken])  # (other tests' queues in the database count too)
        assert other in await watcher.look()  # ready on a queue the list leaves out: named in a warning
        assert other not in await watcher.look()  # once only
        assert taken not in watcher._warned
        assert not UnwatchedQueues(queue.jobs, [taken, "*"]).watching  # a list with * leaves nothing out
    assert sum(other in r.getMessage() for r in caplog.records) == 1


async def test_a_lifespan_worker_with_a_strict_list_warns_on_its_own_when_idle(
    fresh_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    taken, other = names(2)
    ran: list[str] = []
    producer = queue_with(fresh_url, [taken, other], None, ran, enabled=False)
    async with producer.lifespan(None):
        await producer.dispatch(f"job-{other}", {})
        await producer.dispatch(f"job-{taken}", {})
    caplog.set_level("WARNING", logger="fastapi_workqueue.jobs")
    worker = queue_with(fresh_url, [taken, other], taken, ran)  # WORKQUEUE_JOB_QUEUES=taken
    async with worker.lifespan(None):
        await wait_for(lambda: any(other in r.getMessage() and "does not take" in r.getMessage()
                                   for r in caplog.records), within=15)
        await wait_for(lambda: ran == [taken])  # the job of the queue it takes runs; the other waits
    warnings = [r.getMessage() for r in caplog.records if "does not take" in r.getMessage()]
    assert len(warnings) == 1 and taken not in warnings[0].split("(it takes")[0], warnings


async def test_a_timeout_aborts_the_signal_and_the_job_comes_back(database_url: str) -> None:
    queue_name = names(1)[0]
    events: list[JobEvent] = []
    reasons: list[Any] = []
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        job_queues=queue_name, **FAST))
    queue.listen(JobEvent, events.append)

    @queue.job(f"slow-{queue_name}", timeout=0.3, tries=3, backoff=[0], queue=queue_name)
    async def slow(payload: dict[str, Any], job: JobContext) -> None:
        if job.attempt == 1:
            try:
                await asyncio.sleep(30)
            finally:
                reasons.append(job.signal.reason)

    async with queue.lifespan(None):
        await queue.dispatch(slow, {})
        await wait_for(lambda: any(type(e).__name__ == "JobProcessed" for e in events), within=30)
    released = [e for e in events if isinstance(e, JobReleased)]
    assert [e.reason for e in released] == ["timeout"]
    assert [str(r) for r in reasons] == ["MaxProcessingSeconds"]


async def test_a_job_that_blocks_the_loop_past_its_timeout_is_timed_out_not_processed(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The timer on the loop cannot fire while the job blocks it: the watchdog thread speaks up after
    the stop timeout (an app's host logs, it does not exit), and the attempt that returns late is a
    timed-out attempt, not a processed one."""
    queue_name = names(1)[0]
    events: list[JobEvent] = []
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        job_queues=queue_name, **FAST))  # (a stop timeout of 0.3 s)
    queue.listen(JobEvent, events.append)

    @queue.job(f"blocks-{queue_name}", timeout=0.2, tries=3, backoff=[0], queue=queue_name)
    async def blocks(payload: dict[str, Any], job: JobContext) -> None:
        if job.attempt == 1:
            time.sleep(1.5)  # noqa: ASYNC251 (on purpose: neither the timer nor a heartbeat can run)

    caplog.set_level(logging.CRITICAL, logger="fastapi_workqueue.jobs")
    async with queue.lifespan(None):
        await queue.dispatch(blocks, {})
        await wait_for(lambda: any(type(e).__name__ == "JobProcessed" for e in events), within=30)
    ended = [(type(e).__name__, e.attempt, getattr(e, "reason", None)) for e in events
             if type(e).__name__ != "JobProcessing"]
    assert ended == [("JobReleased", 1, "timeout"), ("JobProcessed", 2, None)], ended
    [alarm] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert alarm.threadName == THREAD_NAME and "still running 0.3 s after its timeout of 0.2 s" in alarm.getMessage()
    assert "blocks the event loop" in alarm.getMessage() and "workqueue work" in alarm.getMessage()
    assert queue.jobs.watchdog.watching == 0


async def test_a_job_held_up_by_another_that_blocks_the_loop_is_not_blamed(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A job with a timeout awaits politely while another job, without a timeout, blocks the loop
    past the first one's timeout and stop timeout: its cancellation cannot run until the loop does.
    The watchdog does not blame it (no critical error, which ends a ``workqueue work`` worker with
    70): it warns once, naming the code that holds the loop, and gives the job the stop timeout
    again. Both then end as they should: the polite one timed out, the blocking one processed."""
    queue_name = names(1)[0]
    events: list[JobEvent] = []
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        job_queues=queue_name, **FAST))  # (a stop timeout of 0.3 s)
    queue.listen(JobEvent, events.append)

    polite_name, hog_name = f"polite-{queue_name}", f"hog-{queue_name}"
    polite_started = asyncio.Event()

    @queue.job(polite_name, timeout=1.0, tries=1, queue=queue_name)
    async def polite(payload: dict[str, Any], job: JobContext) -> None:
        polite_started.set()
        await asyncio.sleep(30)

    @queue.job(hog_name, tries=1, queue=queue_name)
    async def hog(payload: dict[str, Any], job: JobContext) -> None:
        await polite_started.wait()  # (so that the other's timer runs, and runs out, while this blocks)
        time.sleep(2.2)  # noqa: ASYNC251 (on purpose: the other job's timer and cancellation wait)

    def ended(name: str) -> list[str]:
        return [type(e).__name__ for e in events if e.job == name and type(e).__name__ != "JobProcessing"]

    caplog.set_level(logging.WARNING, logger="fastapi_workqueue.jobs")
    async with queue.lifespan(None):
        await queue.dispatch(hog, {})
        await queue.dispatch(polite, {})
        await wait_for(lambda: ended(polite_name) and ended(hog_name), within=30)
    assert ended(polite_name) == ["JobFailed"] and ended(hog_name) == ["JobProcessed"]
    assert [r for r in caplog.records if r.levelno >= logging.CRITICAL] == []
    [held] = [r for r in caplog.records if "blocked by other code" in r.getMessage()]
    assert held.threadName == THREAD_NAME and held.levelno == logging.WARNING
    message = held.getMessage()
    assert message.startswith(f"job {polite_name} (") and "is past its timeout of 1 s" in message
    assert f"{THIS_FILE}:" in message and " in hog)" in message
    assert queue.jobs.watchdog.watching == 0


async def test_a_job_that_blocks_the_loop_from_a_task_it_started_is_blamed_after_a_second_window(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The blocking code runs in a task the job started (``asyncio.gather``): the loop's task is not
    the job's, so the watchdog first takes it for other code and waits; held past the job's timeout
    and stop timeout once more (and the watchdog's floor, 30 s, lowered here), the job is blamed all
    the same (an app's host logs it critical)."""
    queue_name = names(1)[0]
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        job_queues=queue_name, **FAST))  # (a stop timeout of 0.3 s)
    queue.jobs.watchdog.held_floor = 0.0
    events: list[JobEvent] = []
    queue.listen(JobEvent, events.append)

    async def child() -> None:
        time.sleep(2.5)  # noqa: ASYNC251 (on purpose)

    @queue.job(f"spawns-{queue_name}", timeout=0.2, tries=1, queue=queue_name)
    async def spawns(payload: dict[str, Any], job: JobContext) -> None:
        await asyncio.gather(child())

    caplog.set_level(logging.WARNING, logger="fastapi_workqueue.jobs")
    async with queue.lifespan(None):
        await queue.dispatch(spawns, {})
        await wait_for(lambda: any(type(e).__name__ == "JobFailed" for e in events), within=30)
    found = [(r.levelno, r.getMessage()) for r in caplog.records if r.threadName == THREAD_NAME]
    assert [level for level, _ in found] == [logging.WARNING, logging.CRITICAL], found
    assert "blocked by other code (task " in found[0][1] and " in child)" in found[0][1]
    assert found[1][1].startswith(f"job spawns-{queue_name} (")


def one_second_lease(database_url: str, queue_name: str, events: list[JobEvent]) -> WorkQueue:
    """A worker of ``queue_name`` whose jobs are leased for 1 s, its job events kept in ``events``."""
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        job_queues=queue_name, job_lease_seconds=1.0, **FAST))
    queue.listen(JobEvent, events.append)
    return queue


async def test_a_job_that_returns_after_its_lease_ran_out_is_not_processed(database_url: str) -> None:
    """A job without a timeout that blocks the loop past its lease: when it returns, the lease may
    be another worker's, so the attempt ends as a lost lease would (JobReleased lease-lost), not
    as a processed one."""
    queue_name = names(1)[0]
    events: list[JobEvent] = []
    queue = one_second_lease(database_url, queue_name, events)

    @queue.job(f"blocks-{queue_name}", tries=3, backoff=[0], queue=queue_name)
    async def blocks(payload: dict[str, Any], job: JobContext) -> None:
        if job.attempt == 1:
            time.sleep(1.5)  # noqa: ASYNC251 (on purpose: it blocks the loop past the lease)

    async with queue.lifespan(None):
        await queue.dispatch(blocks, {})
        await wait_for(lambda: any(type(e).__name__ == "JobProcessed" for e in events), within=30)
    ended = [(type(e).__name__, e.attempt, getattr(e, "reason", None)) for e in events
             if type(e).__name__ != "JobProcessing"]
    assert ended == [("JobReleased", 1, "lease-lost"), ("JobProcessed", 2, None)], ended


async def test_a_unique_job_that_returns_after_its_lease_ran_out_keeps_its_key(database_url: str) -> None:
    """The attempt that returns after its lease ran out does not free the job's unique key: the
    job is not done (its next attempt runs it), so a dispatch with the same key is still refused
    until that attempt ends."""
    queue_name = names(1)[0]
    events: list[JobEvent] = []
    queue = one_second_lease(database_url, queue_name, events)
    second_started, finish = asyncio.Event(), asyncio.Event()

    @queue.job(f"blocks-{queue_name}", tries=3, backoff=[0], queue=queue_name)
    async def blocks(payload: dict[str, Any], job: JobContext) -> None:
        if job.attempt == 1:
            time.sleep(1.5)  # noqa: ASYNC251 (on purpose: it blocks the loop past the lease)
        else:
            second_started.set()
            await finish.wait()

    async with queue.lifespan(None):
        first = await queue.dispatch(blocks, {}, unique="the-key")
        assert first is not None
        await asyncio.wait_for(second_started.wait(), 30)
        assert await queue.dispatch(blocks, {}, unique="the-key") is None  # still held: the job runs
        finish.set()
        await wait_for(lambda: any(type(e).__name__ == "JobProcessed" for e in events), within=30)
        again = await queue.dispatch(blocks, {}, unique="the-key")  # done: the key is free
        assert again is not None and again != first
    ended = [(type(e).__name__, e.attempt, getattr(e, "reason", None)) for e in events
             if type(e).__name__ != "JobProcessing" and e.job_id == first]
    assert ended == [("JobReleased", 1, "lease-lost"), ("JobProcessed", 2, None)], ended


def test_a_timeout_that_does_not_fit_the_lease_is_refused_at_start() -> None:
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db", job_lease_seconds=60))

    @queue.job("long.job", timeout=55)
    async def long(payload: dict[str, Any]) -> None:
        return None

    with pytest.raises(ConfigurationError, match=r"'long.job' \(timeout 55 s\).*stop timeout \(8 s\).*lease \(60 s\)"):
        check_fits_lease(queue.jobs, ["*"], 8.0)
    check_fits_lease(queue.jobs, ["other"], 8.0)  # a worker that does not take its queue does not care


async def dispatched_by_a_new_release(database_url: str, queue_name: str) -> Any:
    """The id of job ``new-<queue_name>`` (two tries, no backoff), dispatched by a release that
    declares it and runs no worker."""
    producer = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                           enabled=False, **FAST))

    @producer.job(f"new-{queue_name}", tries=2, backoff=[0], queue=queue_name)
    async def new(payload: dict[str, Any]) -> None:
        return None

    async with producer.lifespan(None):
        return await producer.dispatch(new, {})


def release_before(database_url: str, queue_name: str, events: list[JobEvent], **settings: Any) -> WorkQueue:
    """A worker of the release before on ``queue_name``: it declares another job of the queue, not
    the new one; its job events go to ``events``."""
    old = WorkQueue(WorkQueueSettings(database_url=database_url, subscriptions=[], job_queues=queue_name,
                                      **settings, **FAST))

    @old.job(f"other-{queue_name}", queue=queue_name)  # this release does not know the new job yet
    async def other(payload: dict[str, Any]) -> None:
        return None

    old.listen(JobEvent, events.append)
    return old


async def test_a_job_no_worker_knows_goes_back_until_its_tries_are_spent(database_url: str) -> None:
    """Past its grace (here none), a job this worker does not declare spends its tries."""
    queue_name = names(1)[0]
    job_id = await dispatched_by_a_new_release(database_url, queue_name)
    events: list[JobEvent] = []
    old = release_before(database_url, queue_name, events, job_unknown_grace_seconds=0)
    async with old.lifespan(None):
        await wait_for(lambda: any(type(e).__name__ == "JobFailed" for e in events), within=30)
        [failed] = await old.failed_jobs(queue_name)
    assert [type(e).__name__ for e in events] == ["JobReleased", "JobFailed"]
    assert isinstance(events[0], JobReleased) and events[0].reason == "unknown-job"
    assert failed.id == job_id and "declare it with @queue.job" in (failed.error or "")


async def test_a_rolling_deploys_new_job_waits_for_a_worker_that_declares_it_without_spending_tries(
    database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker of the release before, meeting a job the new release dispatched on their app's
    queue, gives it back again and again within the grace, no try spent (it used to spend the
    default five tries in seconds and fail a job that never ran); a worker that declares it then
    runs it on its first try. The warning is given once, however often the job comes back."""
    from fastapi_workqueue.jobs import runner

    monkeypatch.setattr(runner, "UNKNOWN_JOB_BACK_SECONDS", 0.1, raising=False)
    queue_name = names(1)[0]
    job_id = await dispatched_by_a_new_release(database_url, queue_name)
    events: list[JobEvent] = []
    old = release_before(database_url, queue_name, events)
    with caplog.at_level(logging.WARNING, logger="fastapi_workqueue.jobs"):
        async with old.lifespan(None):
            await wait_for(lambda: len(events) >= 5, within=30, describe=lambda: events)
            status = await old.job_status(job_id)
            assert status is not None and status.state == "Pending", status
            assert await old.failed_jobs(queue_name) == []
    assert {(type(e).__name__, e.attempt, getattr(e, "reason", None)) for e in events} == {
        ("JobReleased", 1, "unknown-job")}
    warnings = [r.getMessage() for r in caplog.records if "is not declared in this process" in r.getMessage()]
    assert len(warnings) == 1 and "WORKQUEUE_JOB_UNKNOWN_GRACE_SECONDS" in warnings[0], warnings

    ran: list[int] = []
    new_release = WorkQueue(WorkQueueSettings(database_url=database_url, subscriptions=[], job_queues=queue_name,
                                              **FAST))

    @new_release.job(f"new-{queue_name}", tries=2, backoff=[0], queue=queue_name)
    async def new_here(payload: dict[str, Any], job: JobContext) -> None:
        ran.append(job.attempt)

    async with new_release.lifespan(None):
        await wait_for(lambda: ran, within=30)
    assert ran == [1]


async def test_a_worker_leaves_another_apps_job_queue_without_spending_its_jobs_tries(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two apps on one database, each with job queues of its own: a worker taking every queue
    (``*``) that meets a job it does not know on a queue none of its jobs uses gives the job back
    untouched and leaves that queue (health: Undeclared); the app that declares the job runs it."""
    mine, theirs = names(2)
    ran: list[str] = []
    app_a = queue_with(database_url, [mine], None, ran)  # (every queue, fairly)
    app_b = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        job_queues=theirs, **FAST))

    @app_b.job(f"b-{theirs}", queue=theirs, tries=1)
    async def b_job(payload: dict[str, Any]) -> None:
        ran.append(f"b:{payload['n']}")

    producer_b = WorkQueue(WorkQueueSettings(database_url=database_url, subscriptions=[], enabled=False, **FAST))

    @producer_b.job(f"b-{theirs}", queue=theirs, tries=1)
    async def b_sent(payload: dict[str, Any]) -> None: ...

    async with app_a.lifespan(None):
        async with producer_b.lifespan(None):  # (app b's web process: no worker of b runs yet)
            ids = [await producer_b.dispatch(b_sent, {"n": n}) for n in range(3)]
        with caplog.at_level(logging.WARNING, logger="fastapi_workqueue.jobs"):
            await wait_for(lambda: any("taken for another app's" in r.getMessage() and repr(theirs) in r.getMessage()
                                       for r in caplog.records), within=30)
            await asyncio.sleep(0.5)
        health = {s.subscription: s for s in app_a.health().subscriptions}
        assert health[f"jobs.{theirs}"].state == "Undeclared", health
        assert "no code of this app declares" in (health[f"jobs.{theirs}"].reason or "")
        assert health[f"jobs.{mine}"].state == "Running"
        assert not any(r.startswith("b:") for r in ran)
        async with app_b.lifespan(None):
            async def ended() -> list[Any]:
                statuses = [await app_b.job_status(i) for i in ids if i is not None]
                return [(s.state, s.attempt) for s in statuses if s is not None and s.state != "Pending"
                        and s.state != "Running"]

            async def all_ended() -> bool:
                return len(await ended()) == 3

            await wait_for(all_ended, within=30)
            assert await ended() == [("Completed", 1)] * 3  # (not a try spent by the app that left them)
    assert sorted(r for r in ran if r.startswith("b:")) == ["b:0", "b:1", "b:2"]
    warned = [r for r in caplog.records
              if "taken for another app's" in r.getMessage() and repr(theirs) in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]  # (once; other tests' queues may be left too)


async def test_a_worker_looks_again_at_a_queue_it_left(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue taken for another app's is left for a while, not for good: once the while has
    passed, the worker takes it again (and a job of its own app found there keeps it)."""
    from fastapi_workqueue.jobs import queue_owners

    monkeypatch.setattr(queue_owners, "LEAVE_SECONDS", 1.0)
    theirs = names(1)[0]
    ran: list[str] = []
    app_a = queue_with(database_url, [], None, ran, reconcile_interval_ms=200)
    other = WorkQueue(WorkQueueSettings(database_url=database_url, subscriptions=[], enabled=False, **FAST))

    @other.job(f"b-{theirs}", queue=theirs)
    async def b_sent(payload: dict[str, Any]) -> None: ...

    @other.job(f"a-{theirs}")  # (app a's web process, later: it sends a job of app a there)
    async def a_sent(payload: dict[str, Any]) -> None: ...

    @app_a.job(f"a-{theirs}")  # (app a declares a job it may send there later)
    async def a_job(payload: dict[str, Any]) -> None:
        ran.append("a")

    def state() -> str | None:
        found = {s.subscription: s.state for s in app_a.health().subscriptions}
        return found.get(f"jobs.{theirs}")

    async with app_a.lifespan(None):
        async with other.lifespan(None):
            await other.dispatch(b_sent, {})
        await wait_for(lambda: state() == "Undeclared", within=30, describe=state)
        await wait_for(lambda: state() == "Running", within=30, describe=state)  # (looked again)
        async with other.lifespan(None):
            await other.dispatch(a_sent, {}, queue=theirs)  # (a job of app a, on that queue)
        await wait_for(lambda: ran == ["a"], within=30, describe=lambda: (ran, state()))
        await asyncio.sleep(1.5)
        assert state() == "Running"  # (its own job ran from it: the queue is app a's from now on)


async def test_a_worker_keeps_a_queue_its_app_dispatches_to_though_an_unknown_job_waits_there(
    database_url: str
) -> None:
    """A queue the app uses through ``dispatch(..., queue=...)`` only (no job declares it) is the
    app's: a worker process that never dispatches, meeting a job it does not know there (a job a
    rolling deploy renamed), still takes the queue, since a job of its app waits there too; the
    unknown job spends its tries, as on any of the app's queues."""
    urgent = names(1)[0]
    old_release = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                              enabled=False, **FAST))

    @old_release.job(f"notify-{urgent}", tries=1)
    async def notify_old(payload: dict[str, Any]) -> None: ...

    producer = WorkQueue(WorkQueueSettings(database_url=database_url, subscriptions=[], enabled=False, **FAST))

    @producer.job(f"notify2-{urgent}")
    async def notify_sent(payload: dict[str, Any]) -> None: ...

    async with old_release.lifespan(None):
        old_id = await old_release.dispatch(notify_old, {"n": "old"}, queue=urgent)
    async with producer.lifespan(None):
        mine = [await producer.dispatch(notify_sent, {"n": n}, queue=urgent) for n in range(3)]

    ran: list[Any] = []
    worker = WorkQueue(WorkQueueSettings(database_url=database_url, subscriptions=[], job_unknown_grace_seconds=0,
                                         **FAST))  # (every queue; the unknown job spends its tries at once)

    @worker.job(f"notify2-{urgent}")
    async def notify2(payload: dict[str, Any]) -> None:
        ran.append(payload["n"])

    async with worker.lifespan(None):
        await wait_for(lambda: sorted(ran) == [0, 1, 2], within=30, describe=lambda: ran)
        status = {s.subscription: s.state for s in worker.health().subscriptions}
        assert status[f"jobs.{urgent}"] == "Running", status
        async with producer.lifespan(None):
            await producer.dispatch(notify_sent, {"n": 3}, queue=urgent)
        await wait_for(lambda: 3 in ran, within=30, describe=lambda: ran)

        async def old_failed() -> bool:
            found = await worker.job_status(old_id)
            return found is not None and found.state == "Failed"

        await wait_for(old_failed, within=30)
    assert all(job_id is not None for job_id in mine)


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
async def test_two_processes_dispatch_each_tick_of_a_schedule_once(
    database_url: str, encrypted: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Each tick is queued once, quietly: the process that finds it queued says nothing (an
    encrypted job's tick, other bytes in each process, answers MessageIDConflict there)."""
    from cryptography.fernet import Fernet

    queue_name = names(1)[0]
    key = Fernet.generate_key().decode()
    processes = []
    for _ in range(2):
        queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                            enabled=False, app_key=key, **FAST))

        @queue.job(f"tick-{queue_name}", queue=queue_name, encrypted=encrypted)
        async def tick(payload: dict[str, Any]) -> None:
            return None

        queue.schedule(tick, cron="*/5 * * * *", payload={"n": 1})
        processes.append(queue)
    start = datetime(2026, 12, 1, 10, 0, 30, tzinfo=UTC)
    async with processes[0].lifespan(None), processes[1].lifespan(None):
        queued = 0
        for minute in range(0, 16):
            moment = start + timedelta(minutes=minute)
            results = await asyncio.gather(*(p.jobs.schedules.run_due(moment) for p in processes))
            queued += sum(results)
        # Ticks 10:00 (seen 30 s late, within the grace), 10:05, 10:10, 10:15.
        assert queued == 4
        assert await processes[0].size(queue_name) == 4
        listing = processes[0].jobs.schedules.listing(start)
        assert listing[0]["NextRun"] == "2026-12-01T10:05:00+00:00"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_missed_tick_is_queued_only_with_catch_up(database_url: str) -> None:
    queue_name = names(1)[0]
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        enabled=False, **FAST))

    @queue.job(f"hourly-{queue_name}", queue=queue_name)
    async def hourly(payload: dict[str, Any]) -> None:
        return None

    plain = queue.schedule(hourly, cron="0 * * * *", payload={}, name=f"plain-{queue_name}")
    caught = queue.schedule(hourly, cron="0 * * * *", payload={}, name=f"caught-{queue_name}", catch_up=True)
    async with queue.lifespan(None):
        await queue.jobs.schedules.run_due(datetime(2026, 12, 1, 8, 0, 10, tzinfo=UTC))  # both queue 08:00
        queue.jobs.schedules._last.clear()  # everything was down from 08:00 to 11:20
        assert await queue.jobs.schedules.run_due(datetime(2026, 12, 1, 11, 20, tzinfo=UTC)) == 3
        known = await queue.transport.known_messages([
            s.tick_id(datetime(2026, 12, 1, h, tzinfo=UTC)) for s in (plain, caught) for h in (9, 10, 11)])
        assert known == {caught.tick_id(datetime(2026, 12, 1, h, tzinfo=UTC)) for h in (9, 10, 11)}


async def test_sync_mode_runs_a_job_at_its_dispatch(tmp_path: Path) -> None:
    ran: list[int] = []
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", auto_migrate=True,
                                        jobs_mode="sync", enabled=False))

    @queue.job("sync.job", tries=2)
    async def job(payload: dict[str, int], context: JobContext) -> None:
        if payload["n"] < 0:
            raise ValueError("never works")
        ran.append(payload["n"])

    async with queue.lifespan(None):
        await queue.dispatch(job, {"n": 1})
        assert ran == [1]  # ran before dispatch returned
        with pytest.raises(ValueError, match="never works"):
            await queue.dispatch(job, {"n": -1})
        assert await queue.size() == 0  # nothing was queued


async def test_a_sync_mode_job_that_fails_once_leaves_the_request_that_dispatched_it_to_commit(tmp_path: Path) -> None:
    """``jobs_mode="sync"`` runs a job inside the request that dispatches it. Its first attempt
    fails: the request's own session (not the job's) keeps its outcome, and commits."""
    import httpx
    from fastapi import Depends, FastAPI
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession

    url = f"sqlite+aiosqlite:///{tmp_path / 'sync.db'}"
    queue = WorkQueue(WorkQueueSettings(database_url=url, auto_migrate=True, jobs_mode="sync", enabled=False))
    attempts: list[int] = []

    def settings_dependency() -> str:
        return "settings"

    @queue.job("flaky", tries=2)
    async def flaky(payload: dict[str, Any], job: JobContext, s: str = Depends(settings_dependency)) -> None:
        attempts.append(job.attempt)
        if job.attempt == 1:
            raise ValueError("the first try fails, the second works")

    app = FastAPI(lifespan=queue.lifespan)

    @app.post("/order")
    async def order(session: AsyncSession = queue.session) -> dict[str, str]:
        await session.execute(text("INSERT INTO sync_orders (n) VALUES (1)"))
        await queue.dispatch(flaky, {})
        return {"ok": "yes"}

    async with queue.lifespan(app):
        async with queue.engine.begin() as conn:
            await conn.execute(text("CREATE TABLE sync_orders (n INTEGER)"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            assert (await client.post("/order")).status_code == 200
        async with queue.engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM sync_orders"))).scalar_one() == 1
    assert attempts == [1, 2]


@pytest.mark.parametrize("job_queues", [None, "other,default"])
async def test_a_job_dispatched_to_a_queue_no_job_declares_runs(database_url: str, job_queues: str | None) -> None:
    """``dispatch(job, queue="other")`` makes the queue's topic and subscription when the host runs:
    they share the jobs' one handler with the declared queues, and are served, never taken for a
    renamed subscription (which a release stops running)."""
    other = f"other-{uuid.uuid4().hex[:8]}"
    queues = {} if job_queues is None else {"job_queues": job_queues.replace("other", other)}
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, **queues, **FAST))
    ran: list[int] = []

    @queue.job(f"count-{other}")
    async def count(payload: dict[str, int]) -> None:
        ran.append(payload["n"])

    async with queue.lifespan(None):
        await queue.dispatch(count, {"n": 1})
        job_id = await queue.dispatch(count, {"n": 2}, queue=other)
        assert queue.host is not None
        await wait_for(lambda: sorted(ran) == [1, 2], within=20,
                       describe=lambda: (ran, [(h.subscription, h.state) for h in queue.health().subscriptions]))
        await wait_for(lambda: _completed(queue, job_id), within=20)  # (its settle follows the run)


async def _completed(queue: WorkQueue, job_id: uuid.UUID | None) -> bool:
    assert job_id is not None
    status = await queue.job_status(job_id)
    return status is not None and status.state == "Completed"
