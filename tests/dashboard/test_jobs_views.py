"""The dashboard reads jobs as jobs: a job's name in the lists, its own tries, backoff and timeout
instead of its queue's defaults, failed jobs to retry or forget, schedules with their next tick and
last dispatch; and absolute UTC times beside relative ones. Over HTTP on PostgreSQL and SQLite."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from fastapi_workqueue import JobContext, SubscriptionPlan, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.keys import SCOPE_OPERATE, SCOPE_READ, create_key

from ..conftest import unique
from .shop import SECRET, wait_until
from .test_pages import UI, post, sign_in

pytestmark = pytest.mark.timeout(60)


class Reports:
    """An app with one job (it always fails) on a queue of its own, and a schedule of it."""

    def __init__(self, database_url: str) -> None:
        self.queue_name = unique("reports").replace("-", "_")
        self.job_name = f"{self.queue_name}.export"
        self.subscription = f"jobs.{self.queue_name}"
        self.queue = WorkQueue(WorkQueueSettings(
            database_url=database_url, subscriptions=[SubscriptionPlan(name=self.subscription, concurrency=2)],
            idle_poll_min_ms=20, idle_poll_max_ms=100, reconcile_interval_ms=200, shutdown_drain_ms=300,
            dashboard_secret=SECRET,
        ))

        @self.queue.job(self.job_name, tries=1, backoff=[2, 10], timeout=30, queue=self.queue_name)
        async def export(payload: dict[str, Any], job: JobContext) -> None:
            raise RuntimeError(f"the export of report {payload['report']} ran out of disk")

        self.export = export
        self.schedule = self.queue.schedule(export, every=timedelta(minutes=1), payload={"report": 0},
                                            name=unique("nightly"))
        self.app = FastAPI(lifespan=self.queue.lifespan)
        self.app.mount(UI, self.queue.dashboard())


@pytest.fixture(params=["postgresql", "sqlite"])
async def reports(request: pytest.FixtureRequest, pg_url: str, sqlite_url: str) -> AsyncIterator[Reports]:
    app = Reports(pg_url if request.param == "postgresql" else sqlite_url)
    async with app.queue.lifespan(app.app):
        yield app


@asynccontextmanager
async def client(app: Reports, *scopes: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.app), base_url="http://dashboard.test") as http:
        key = await create_key(app.queue.transport, unique("person"), list(scopes))
        assert (await sign_in(http, key.key)).status_code == 303
        yield http


def text_of(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()


async def failed(app: Reports, *job_ids: Any) -> list[Any]:
    """The dead letters of these jobs, once all of them failed (the schedule's ticks fail too)."""
    async def dead() -> list[Any] | None:
        letters = [i for i in await app.queue.dead_letters(app.subscription, limit=100) if i.message_id in job_ids]
        return letters if len(letters) == len(job_ids) else None

    result: list[Any] = await wait_until(dead)
    return result


async def test_a_job_queue_lists_failed_jobs_by_name_to_retry_or_forget(reports: Reports) -> None:
    first = await reports.queue.dispatch(reports.export, {"report": 7})
    second = await reports.queue.dispatch(reports.export, {"report": 8})
    letters = await failed(reports, first, second)
    async with client(reports, SCOPE_READ, SCOPE_OPERATE) as http:
        page = (await http.get(f"{UI}/subscriptions/{reports.subscription}")).text
        dead = re.search(r'<section class="panel" id="dead-letters" data-live>(.*?)</section>', page, re.S)
        assert dead and "<h2>Failed jobs</h2>" in dead.group(1)
        for info in letters:
            row = re.search(rf'<tr data-delivery="{info.delivery_id}">(.*?)</tr>', dead.group(1), re.S)
            assert row, info.delivery_id
            assert f'<span class="job" title="the job it runs">{reports.job_name}</span>' in row.group(1)
            assert ">Retry</button>" in row.group(1) and ">Forget</button>" in row.group(1)
            assert ">Replay</button>" not in row.group(1)
        # The job's own policy beside the queue's defaults.
        jobs = re.search(r'<table class="grid jobs">(.*?)</table>', page, re.S)
        assert jobs, "a job queue's page lists the jobs declared on it"
        job_row = re.search(rf'<tr data-job="{re.escape(reports.job_name)}">(.*?)</tr>', jobs.group(1), re.S)
        assert job_row, reports.job_name
        assert text_of(job_row.group(1)) == f"{reports.job_name} 1 2.0, 10.0 s 30 s", text_of(job_row.group(1))
        # Forget one, retry the other: forget discards its dead letter, retry replays it (it fails again).
        by_id = {str(i.message_id): i for i in letters}
        forget, retry = by_id[str(first)], by_id[str(second)]
        here = f"{UI}/subscriptions/{reports.subscription}"
        answer = await post(http, here, f"{UI}/deliveries/{forget.delivery_id}/discard", back=here)
        assert answer.status_code == 303
        answer = await post(http, here, f"{UI}/deliveries/{retry.delivery_id}/replay", back=here)
        assert answer.status_code == 303
        forgotten = await reports.queue.get_delivery(forget.delivery_id)
        assert forgotten is not None and forgotten.status == "Discarded"

        async def failed_again() -> bool:
            info = await reports.queue.get_delivery(retry.delivery_id)
            return info is not None and info.status == "DeadLettered" and info.note is not None

        await wait_until(failed_again)


async def test_a_jobs_delivery_shows_its_own_tries_and_timeout_not_its_queues(reports: Reports) -> None:
    job_id = await reports.queue.dispatch(reports.export, {"report": 9})
    [info] = await failed(reports, job_id)
    state = next(s for s in await reports.queue.transport.list_subscriptions() if s.name == reports.subscription)
    assert state.max_attempts != 1, "the queue's default differs from the job's own tries"
    async with client(reports, SCOPE_READ) as http:  # a read key: the payload is not shown
        page = (await http.get(f"{UI}/deliveries/{info.delivery_id}")).text
    job = re.search(r'<dd class="job-fields">(.*?)</dd>', page, re.S)
    assert job, "a job's delivery names its job"
    line = text_of(job.group(1))
    assert line.startswith(f"{reports.job_name} on the job queue {reports.queue_name}"), line
    assert "its own tries: 1" in line and "timeout 30.0 s" in line and "backoff 2.0, 10.0 s" in line, line
    assert "Attempt</dt><dd>1 of 1</dd>" in page
    assert "report 9" not in page.split("<h2>Payload</h2>")[1], "a read key sees no payload"


async def test_the_jobs_page_shows_declared_jobs_and_schedules_with_next_tick_and_last_dispatch(
    reports: Reports,
) -> None:
    schedules = reports.queue.jobs.schedules
    now = datetime.now(UTC)
    async with client(reports, SCOPE_READ) as http:
        before = (await http.get(f"{UI}/jobs")).text
        row = re.search(rf'<tr data-schedule="{re.escape(reports.schedule.name)}">(.*?)</tr>', before, re.S)
        assert row, "the schedule is listed"
        assert "none in the last 60 ticks" in row.group(1) or "ago" in row.group(1)
        upcoming = reports.schedule.next_after(now)
        assert upcoming.strftime("%H:%M:00 UTC") in row.group(1) or upcoming.strftime("%H:%M") in row.group(1)
        # Its tick at the current minute is queued by whichever process comes first (here: this one).
        await schedules.run_due(reports.schedule.previous_at_or_before(now))
        after = (await http.get(f"{UI}/jobs")).text
    tick = reports.schedule.previous_at_or_before(now)
    row = re.search(rf'<tr data-schedule="{re.escape(reports.schedule.name)}">(.*?)</tr>', after, re.S)
    assert row
    cells = re.findall(r"<td>(.*?)</td>", row.group(1), re.S)
    assert f'datetime="{tick.isoformat()}"' in cells[-1], cells[-1]
    job = re.search(rf'<tr data-job="{re.escape(reports.job_name)}">(.*?)</tr>', after, re.S)
    assert job and text_of(job.group(1)) == f"{reports.job_name} {reports.queue_name} 1 2.0, 10.0 s 30 s"


async def test_times_show_absolute_utc_beside_relative(reports: Reports) -> None:
    job_id = await reports.queue.dispatch(reports.export, {"report": 1})
    [info] = await failed(reports, job_id)
    async with client(reports, SCOPE_READ) as http:
        page = (await http.get(f"{UI}/deliveries/{info.delivery_id}")).text
    settled = re.search(r"<dt>Settled</dt><dd>(.*?)</dd>", page, re.S)
    assert settled and info.settled_at is not None
    expected = info.settled_at.astimezone(UTC).strftime("%H:%M:%S UTC")
    assert re.search(rf'ago <span class="abs">{re.escape(expected)}</span>', settled.group(1)), settled.group(1)
