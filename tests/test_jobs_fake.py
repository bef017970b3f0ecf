"""The jobs fake: dispatches checked and recorded, assertions, and work() run in the test's process."""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI
from pydantic import BaseModel, ConfigDict

from fastapi_workqueue import ConfigurationError, JobContext, WorkQueue, WorkQueueSettings
from fastapi_workqueue.jobs import JobEvent, JobPayloadInvalid, without_overlapping


class Reminder(BaseModel):
    user_id: int


def get_mailer() -> str:
    return "smtp"


def build() -> tuple[WorkQueue, dict[str, Any], list[Any]]:
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))
    sent: list[Any] = []
    events: list[str] = []
    queue.listen(JobEvent, lambda event: events.append(f"{type(event).__name__}:{event.job}"))

    @queue.job("billing.send-invoice-reminder", tries=3, queue="mail")
    async def send(payload: Reminder, job: JobContext, mailer: str = Depends(get_mailer)) -> Any:
        if payload.user_id == 0:
            return job.discard("the account no longer exists")
        if payload.user_id < 0 and job.attempt < 2:
            raise RuntimeError("mail server busy")
        await job.once(f"invoice-mail:{payload.user_id}", lambda: _append(sent, (payload.user_id, mailer)))
        return None

    @queue.job("stats.rebuild", middleware=[without_overlapping("stats")])
    async def rebuild(payload: dict[str, Any], job: JobContext) -> None:
        sent.append(("rebuild", await job.step("count", _count)))

    @queue.job("always.fails", tries=2)
    async def fails(payload: dict[str, Any]) -> None:
        raise ValueError("never works")

    return queue, {"send": send, "rebuild": rebuild, "fails": fails}, [sent, events]


async def _append(into: list[Any], item: Any) -> None:
    into.append(item)


async def _count() -> int:
    await asyncio.sleep(0)
    return 42


async def test_dispatches_are_recorded_and_work_runs_them_with_dependencies_and_chains() -> None:
    queue, jobs, (sent, events) = build()
    with queue.fake() as fake:
        first = await queue.dispatch(jobs["send"], {"user_id": 1})
        await queue.dispatch(jobs["send"], Reminder(user_id=0))
        ids = await queue.chain([(jobs["send"], {"user_id": 2}), (jobs["rebuild"], {})])
        assert first is not None and len(ids) == 2 and ids[0] != ids[1]
        fake.assert_dispatched(jobs["send"], times=3)
        fake.assert_dispatched(jobs["send"], times=1, where=lambda p: p.user_id == 2)
        # A failed assertion shows what was dispatched; a field the payload lacks is named.
        with pytest.raises(AssertionError, match=r"dispatched 0 time\(s\) with \{'user_id': 9\}, expected 1; "
                                                 r"'billing.send-invoice-reminder' was dispatched with: "
                                                 r"Reminder\(user_id=1\); Reminder\(user_id=0\)"):
            fake.assert_dispatched(jobs["send"], times=1, where={"user_id": 9})
        with pytest.raises(TypeError, match="where= names 'user', which Reminder has no field of"):
            fake.assert_dispatched(jobs["send"], where={"user": 1})
        fake.assert_not_dispatched(jobs["rebuild"])  # chained: queued when the one before succeeds
        assert fake.dispatched(jobs["send"]) == [Reminder(user_id=1), Reminder(user_id=0), Reminder(user_id=2)]
        counts = await fake.work()
        assert counts == {"processed": 3, "failed": 0, "released": 0, "discarded": 1}
        fake.assert_dispatched(jobs["rebuild"], times=1)
        assert await fake.work() == {"processed": 0, "failed": 0, "released": 0, "discarded": 0}
    assert sent == [(1, "smtp"), (2, "smtp"), ("rebuild", 42)]
    assert "JobDiscarded:billing.send-invoice-reminder" in events
    assert events.count("JobProcessed:billing.send-invoice-reminder") == 2


async def test_a_wait_beside_work_gets_the_result_and_the_status_is_never_missing() -> None:
    """docs/jobs.md: under the fake "a wait on it times out unless something runs work()
    meanwhile, and one it ran is what came of it": a wait started before work() returns the result
    (it raised JobNotFound while work() ran), and the status goes Pending -> Completed, never None."""
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))

    @queue.job("answer.later", store_result=True)
    async def answer(payload: dict[str, Any]) -> int:
        return 42

    @queue.job("answer.slowly")
    async def slowly(payload: dict[str, Any]) -> None:
        await asyncio.sleep(0.05)

    with queue.fake() as fake:
        job_id = await queue.dispatch(answer, {})
        slow_id = await queue.dispatch(slowly, {})
        seen: list[str | None] = []

        async def watch() -> None:
            while True:
                status = await queue.job_status(slow_id)
                seen.append(None if status is None else status.state)
                await asyncio.sleep(0.005)

        waiter = asyncio.create_task(queue.wait(job_id, timeout=5))
        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.01)
        counts = await fake.work()
        await asyncio.sleep(0.02)
        watcher.cancel()
        assert counts.processed == 2
        assert await waiter == 42
    assert None not in seen and seen[0] == "Pending" and seen[-1] == "Completed", seen


async def test_retries_happen_in_work_and_a_job_that_keeps_failing_counts_as_failed() -> None:
    queue, jobs, (sent, events) = build()
    with queue.fake() as fake:
        await queue.dispatch(jobs["send"], {"user_id": -5})
        await queue.dispatch(jobs["fails"], {})
        counts = await fake.work()
    assert counts == {"processed": 1, "failed": 1, "released": 2, "discarded": 0}
    assert sent == [(-5, "smtp")]
    assert events.count("JobReleased:billing.send-invoice-reminder") == 1
    assert events.count("JobFailed:always.fails") == 1
    assert "JobFailed:billing.send-invoice-reminder" not in events  # a flaky job that succeeds never fails


async def test_dispatches_are_checked_like_real_ones() -> None:
    queue, jobs, _ = build()

    @queue.job("secret.job", encrypted=True)
    async def secret(payload: dict[str, Any]) -> None:
        return None

    with queue.fake() as fake:
        with pytest.raises(JobPayloadInvalid):
            await queue.dispatch(jobs["send"], {"user_id": "x"})
        with pytest.raises(JobPayloadInvalid):
            await queue.bulk([(jobs["send"], {"user_id": 1}), (jobs["send"], {"nope": 1})])
        with pytest.raises(ConfigurationError, match="WORKQUEUE_APP_KEY"):
            await queue.dispatch(secret, {})
        fake.assert_not_dispatched(jobs["send"])  # bulk queued none of its jobs
        with pytest.raises(AssertionError, match=r"was not dispatched"):
            fake.assert_dispatched(jobs["send"])


async def test_a_unique_key_is_held_until_the_job_ran() -> None:
    queue, jobs, _ = build()
    with queue.fake() as fake:
        assert await queue.dispatch(jobs["rebuild"], {}, unique="members") is not None
        assert await queue.dispatch(jobs["rebuild"], {}, unique="members") is None
        await fake.work()
        assert await queue.dispatch(jobs["rebuild"], {}, unique="members") is not None
        fake.assert_dispatched(jobs["rebuild"], times=2)


async def test_dependency_overrides_of_the_app_apply_in_work() -> None:
    queue, jobs, (sent, _) = build()
    app = FastAPI()
    app.dependency_overrides[get_mailer] = lambda: "fake-mailer"
    queue.bind_app(app)
    with queue.fake() as fake:
        await queue.dispatch(jobs["send"], {"user_id": 7})
        await fake.work()
    assert sent == [(7, "fake-mailer")]


def app_dispatching(queue: WorkQueue, job: Any, **app_options: Any) -> FastAPI:
    """An app with a route that dispatches ``job`` for a user."""
    app = FastAPI(**app_options)

    @app.post("/users/{user_id}/remind")
    async def remind(user_id: int) -> dict[str, str]:
        return {"id": str(await queue.dispatch(job, {"user_id": user_id}))}

    return app


async def post(app: FastAPI, path: str) -> None:
    """A request through httpx's ASGI transport, which runs no lifespan (the usual async test client)."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
        assert (await client.post(path)).status_code == 200


async def test_work_applies_the_apps_overrides_when_its_lifespan_did_not_run() -> None:
    queue, jobs, (sent, _) = build()
    app = app_dispatching(queue, jobs["send"], lifespan=queue.lifespan)
    app.dependency_overrides[get_mailer] = lambda: "fake-mailer"
    with queue.fake() as fake:
        await post(app, "/users/7/remind")
        fake.assert_dispatched(jobs["send"], times=1)
        assert await fake.work() == {"processed": 1, "failed": 0, "released": 0, "discarded": 0}
    assert sent == [(7, "fake-mailer")]  # the override ran, not the real dependency
    assert queue.health().status == "Stopped" and queue.bound_app is None  # no lifespan ran, none bound


async def test_work_finds_an_app_that_includes_the_queues_router_or_is_given_one() -> None:
    queue, jobs, (sent, _) = build()
    app = app_dispatching(queue, jobs["send"])  # a lifespan of its own (none here), the queue's routes
    app.include_router(queue.router)
    app.dependency_overrides[get_mailer] = lambda: "router-app-mailer"
    with queue.fake() as fake:
        await post(app, "/users/1/remind")
        await fake.work()
    other = app_dispatching(queue, jobs["send"], lifespan=queue.lifespan)  # two apps serve the queue now
    other.dependency_overrides[get_mailer] = lambda: "other-mailer"
    with queue.fake() as fake:
        await post(other, "/users/2/remind")
        with pytest.raises(ConfigurationError, match=r"found 2 apps.*queue.fake\(app=app\)"):
            await fake.work()
    with queue.fake(app=other) as fake:
        await post(other, "/users/3/remind")
        await fake.work()
    assert sent == [(1, "router-app-mailer"), (3, "other-mailer")]


async def test_work_that_finds_no_app_says_the_overrides_do_not_apply(caplog: pytest.LogCaptureFixture) -> None:
    """No app serves the queue (its lifespan reaches the queue some other way) and none is bound:
    the jobs' dependencies run as declared, and work() says so once."""
    queue, jobs, (sent, _) = build()
    with queue.fake() as fake, caplog.at_level(logging.WARNING, logger="fastapi_workqueue.jobs"):
        await queue.dispatch(jobs["send"], {"user_id": 4})
        await fake.work()
        await queue.dispatch(jobs["send"], {"user_id": 5})
        await fake.work()
    told = [r.getMessage() for r in caplog.records if "no app serves this queue" in r.getMessage()]
    assert len(told) == 1 and "queue.fake(app=app)" in told[0]
    assert [user for user, _ in sent] == [4, 5]


def test_the_fake_fixture_comes_with_the_package(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("""
import pytest
from typing import Any
from fastapi_workqueue import WorkQueue, WorkQueueSettings

queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))

@queue.job("hello.job")
async def hello(payload: dict[str, Any]) -> None:
    return None

@pytest.fixture
def workqueue_queue() -> WorkQueue:
    return queue
""")
    pytester.makepyfile("""
import asyncio
from conftest import hello, queue

def test_it(workqueue_fake):
    asyncio.run(queue.dispatch(hello, {"a": 1}))
    workqueue_fake.assert_dispatched(hello, times=1)
    assert asyncio.run(workqueue_fake.work())["processed"] == 1
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_fake_fixture_finds_the_apps_queue_without_being_told(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(myapp="""
from typing import Any
from pydantic import BaseModel
from fastapi_workqueue import JobContext, WorkQueue, WorkQueueSettings

queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))
plain = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))  # declares no job

class Reminder(BaseModel):
    user_id: int

@queue.job("hello.remind", tries=2)
async def remind(payload: Reminder, job: JobContext) -> Any:
    if payload.user_id == 0:
        return job.discard("gone")
    if payload.user_id < 0:
        raise ValueError("never works")
    return None
""")
    pytester.makepyfile(test_user="""
import asyncio
import pytest
from myapp import Reminder, queue, remind

async def dispatch_some():
    await queue.dispatch(remind, {"user_id": 1})
    await queue.dispatch(remind, Reminder(user_id=2))
    await queue.dispatch(remind, {"user_id": 0})
    await queue.dispatch(remind, {"user_id": -1})

def test_it(workqueue_fake):
    asyncio.run(dispatch_some())
    workqueue_fake.assert_dispatched(remind, times=4)
    workqueue_fake.assert_dispatched(remind, where={"user_id": 2}, times=1)
    workqueue_fake.assert_dispatched(remind, where=lambda p: p.user_id > 0, times=2)
    with pytest.raises(AssertionError, match="user_id"):
        workqueue_fake.assert_dispatched(remind, where={"user_id": 3})
    assert workqueue_fake.dispatched(remind)[1] == Reminder(user_id=2)
    counts = asyncio.run(workqueue_fake.work())
    assert (counts.processed, counts.discarded, counts.failed, counts.released) == (2, 1, 1, 1)
    assert counts == {"processed": 2, "discarded": 1, "failed": 1, "released": 1}
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_fake_fixture_says_what_to_set_when_it_cannot_tell_the_queue(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user="""
def test_it(workqueue_fake):
    pass
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*no WorkQueue that declares a job*workqueue_queue*"])


APP_WITH_A_LIFESPAN_OF_ITS_OWN = """
import contextlib
from typing import Any
from fastapi import Depends, FastAPI
from fastapi_workqueue import WorkQueue, WorkQueueSettings

queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))
sent = []

def get_mailer() -> str:
    return "smtp"

@queue.job("hello.mail")
async def mail(payload: dict[str, Any], mailer: str = Depends(get_mailer)) -> None:
    sent.append(mailer)

@contextlib.asynccontextmanager
async def lifespan(app):
    async with queue.lifespan(app):
        yield

app = FastAPI(lifespan=lifespan)

@app.post("/mail")
async def send() -> None:
    await queue.dispatch(mail, {})
"""

USER_TEST = """
import asyncio
import httpx
from myapp import app, get_mailer, mail, sent

async def post():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
        assert (await client.post("/mail")).status_code == 200

def test_it(workqueue_fake):
    app.dependency_overrides[get_mailer] = lambda: "fake"
    asyncio.run(post())
    workqueue_fake.assert_dispatched(mail, times=1)
    assert asyncio.run(workqueue_fake.work())["processed"] == 1
    assert sent == ["fake"]
"""


def test_the_fake_fixture_applies_the_overrides_of_an_app_whose_lifespan_wraps_the_queues(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(myapp=APP_WITH_A_LIFESPAN_OF_ITS_OWN, test_user=USER_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_fake_fixture_takes_the_app_from_the_workqueue_app_option(pytester: pytest.Pytester) -> None:
    # A lifespan the fake cannot trace to the queue (it reaches it through the app's state): named instead.
    pytester.makepyfile(myapp=APP_WITH_A_LIFESPAN_OF_ITS_OWN.replace(
        "    async with queue.lifespan(app):", "    async with app.state.queue.lifespan(app):",
    ).replace("app = FastAPI(lifespan=lifespan)", "app = FastAPI(lifespan=lifespan)\napp.state.queue = queue"),
        test_user=USER_TEST)
    pytester.makeini("[pytest]\nworkqueue_app = myapp:app\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


class StrictReminder(BaseModel):
    model_config = ConfigDict(strict=True)

    at: datetime
    user: uuid.UUID


async def test_the_fake_takes_a_strict_payload_model_as_a_real_queue_does() -> None:
    # The fake records what the job would receive from its stored JSON: a strict model's datetime
    # and UUID come back from their JSON forms, as the real runner gives them.
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))

    @queue.job("remind")
    async def remind(payload: StrictReminder) -> None:
        return None

    sent = StrictReminder(at=datetime(2026, 12, 24, 18, 30, tzinfo=UTC), user=uuid.uuid4())
    with queue.fake() as fake:
        await queue.dispatch(remind, sent)
        assert fake.dispatched(remind) == [sent]
        counts = await fake.work()
    assert (counts.processed, counts.failed) == (1, 0)


def test_the_queue_option_may_be_quoted_in_pytest_ini(pytester: pytest.Pytester) -> None:
    """docs/jobs.md writes the option ``workqueue_queue = "myapp.main:queue"``: pytest.ini keeps the
    quotes in the value (pyproject.toml does not), which made the module '"myapp' unknown."""
    pytester.makeini('[pytest]\nworkqueue_queue = "myapp:queue"\n')
    pytester.makepyfile(myapp="""
from fastapi_workqueue import WorkQueue, WorkQueueSettings

queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))
other = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))

@queue.job("hello.greet")
async def greet(payload: dict) -> None:
    return None

@other.job("hello.other")
async def other_job(payload: dict) -> None:
    return None
""")
    pytester.makepyfile(test_user="""
import asyncio
from myapp import greet, queue

def test_it(workqueue_fake):
    asyncio.run(queue.dispatch(greet, {"n": 1}))
    workqueue_fake.assert_dispatched(greet, times=1)
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize(("option", "says"), [
    ("myapp:queu", "workqueue_queue = 'myapp:queu': 'myapp' has no 'queu'"),
    ("myapp:app", "workqueue_queue = 'myapp:app' is a FastAPI, not a WorkQueue; name the queue"),
    ("nomodule:queue", "workqueue_queue = 'nomodule:queue': module 'nomodule' cannot be imported"),
])
def test_a_queue_option_that_names_no_queue_says_which_option(pytester: pytest.Pytester, option: str,
                                                               says: str) -> None:
    pytester.makeini(f"[pytest]\nworkqueue_queue = {option}\n")
    pytester.makepyfile(myapp="""
from fastapi import FastAPI
from fastapi_workqueue import WorkQueue, WorkQueueSettings

queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))
app = FastAPI()
""")
    pytester.makepyfile(test_user="""
def test_it(workqueue_fake):
    pass
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert says in result.stdout.str() + result.stderr.str()


async def test_a_schedule_is_tested_by_running_its_ticks_at_a_given_time() -> None:
    """``queue.run_schedules(now)`` under the fake records each due tick once, with the schedule's
    payload, and ``work()`` runs them: a schedule is tested without waiting for the clock."""
    queue, jobs, (sent, _) = build()
    queue.schedule(jobs["send"], cron="*/5 * * * *", payload={"user_id": 7})
    with queue.fake() as fake:
        assert await queue.run_schedules(datetime(2026, 12, 1, 8, 0, 10, tzinfo=UTC)) == 1
        assert await queue.run_schedules(datetime(2026, 12, 1, 8, 0, 40, tzinfo=UTC)) == 0  # the same tick
        assert await queue.run_schedules(datetime(2026, 12, 1, 8, 11, tzinfo=UTC)) == 2     # 08:05 and 08:10
        fake.assert_dispatched(jobs["send"], times=3, where={"user_id": 7})
        assert len({entry.id for entry in fake.records}) == 3
        assert (await fake.work()).processed == 3
    assert sent == [(7, "smtp")]  # (job.once: one mail per user, whatever the ticks)
    with queue.fake() as again:  # (a later test's fake starts afresh, whatever the one before ran)
        assert await queue.run_schedules(datetime(2026, 12, 1, 8, 5, 10, tzinfo=UTC)) == 1
        again.assert_dispatched(jobs["send"], times=1)
    with pytest.raises(ValueError, match="has no time zone; give an aware datetime"):
        await queue.run_schedules(datetime(2026, 12, 1, 8, 15))


async def test_a_schedule_of_seconds_first_looks_back_a_minute_under_the_fake() -> None:
    """A first look (a fake starts as a process does) records the ticks of the last minute after
    the newest one recorded, and only the newest when none is: as on a store."""
    queue, jobs, _ = build()
    queue.schedule(jobs["send"], every=10, payload={"user_id": 8})
    with queue.fake() as fake:
        assert await queue.run_schedules(datetime(2026, 12, 1, 8, 0, 1, tzinfo=UTC)) == 1  # 08:00:00
        queue.jobs.schedules.forget_looks()
        assert await queue.run_schedules(datetime(2026, 12, 1, 8, 0, 35, tzinfo=UTC)) == 3  # :10, :20, :30
        assert sorted(e.id for e in fake.records) == sorted({e.id for e in fake.records})
