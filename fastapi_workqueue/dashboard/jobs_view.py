"""What the dashboard shows of the jobs layer: the declared jobs with their own tries, backoff and
timeout, the schedules with their next tick and last dispatch, and a job's name and timeout on its
delivery. A job queue is the subscription ``jobs.<queue>``; its dead letters are the failed jobs
(retry is a replay, forget a discard)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from ..jobs.envelope import JobEnvelope, queue_of

if TYPE_CHECKING:
    from ..core.reports import DeliveryInfo
    from ..jobs.layer import Jobs

JOB_ATTRIBUTE = "job"


@dataclass(frozen=True)
class JobRow:
    """A declared job and what it is dispatched with unless the dispatch says otherwise."""

    name: str
    queue: str
    tries: int
    backoff: tuple[float, ...] | None
    """None: the queue's exponential backoff."""
    timeout: float | None
    encrypted: bool


@dataclass(frozen=True)
class ScheduleRow:
    name: str
    job: str
    queue: str
    when: str
    timezone: str
    catch_up: bool
    next_run: datetime
    last_dispatch: datetime | None


@dataclass(frozen=True)
class JobsPage:
    now: datetime
    jobs: list[JobRow]
    schedules: list[ScheduleRow]
    look_back: int


def job_queue(subscription: str) -> str | None:
    """The job queue a subscription serves, or None when it is not a job queue."""
    return queue_of(subscription)


def job_name(info: DeliveryInfo) -> str | None:
    """The job a delivery runs (from its message's attribute), or None."""
    return (info.attributes or {}).get(JOB_ATTRIBUTE)


def job_timeout(info: DeliveryInfo) -> float | None:
    """The timeout a job's envelope carries (read from the payload, which need not be shown)."""
    if job_name(info) is None or info.payload is None:
        return None
    try:
        return JobEnvelope.from_json(info.payload).timeout
    except (ValueError, KeyError, TypeError):
        return None


def declared_jobs(jobs: Jobs, on_queue: str | None = None) -> list[JobRow]:
    """The jobs this app declares (on ``on_queue`` only, when given), by name."""
    rows = [JobRow(name=job.name, queue=job.policy.queue, tries=job.policy.tries, backoff=job.policy.backoff,
                   timeout=job.policy.timeout, encrypted=job.encrypted)
            for job in jobs.registry]
    return sorted((r for r in rows if on_queue is None or r.queue == on_queue), key=lambda r: r.name)


async def jobs_page(jobs: Jobs, now: datetime) -> JobsPage:
    from ..jobs.schedules import LOOK_BACK

    schedules = jobs.schedules
    rows = []
    for item in sorted(schedules.items.values(), key=lambda s: s.name):
        rows.append(ScheduleRow(
            name=item.name, job=item.job.name, queue=item.queue or item.job.policy.queue,
            when=item.cron or f"every {item.every}", timezone=item.timezone, catch_up=item.catch_up,
            next_run=item.next_after(now), last_dispatch=await schedules.last_dispatch(item, now)))
    return JobsPage(now=now, jobs=declared_jobs(jobs), schedules=rows, look_back=LOOK_BACK)
