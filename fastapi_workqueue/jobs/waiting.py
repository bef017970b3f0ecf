"""``queue.wait(job_id, timeout=...)``: the job's result once it completed, or its failure raised.

On PostgreSQL the waiter asks the store to announce the job's end (LISTEN/NOTIFY, see
:mod:`fastapi_workqueue.database.end_notices`) and reads the status when told, and every few
seconds regardless; elsewhere (SQLite, SQL Server, memory, the fake, sync mode) it reads the
status with a growing pause, from 20 ms up to a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import TYPE_CHECKING

from .local_status import as_job_id
from .status import JobStatus

if TYPE_CHECKING:
    from pydantic import JsonValue

    from .layer import Jobs

FIRST_POLL = 0.02
"""The first pause of a polling waiter, in seconds; each next one doubles, up to :data:`LAST_POLL`."""
LAST_POLL = 1.0
RECHECK = 5.0
"""A waiter told by the store reads the status at least this often (a notice may be lost)."""


class JobNotFound(LookupError):
    """No job has this id (never dispatched, not committed yet, or purged with the retention)."""


class JobError(Exception):
    """A job that ended without completing; ``status`` is its :class:`~.status.JobStatus`."""

    def __init__(self, status: JobStatus) -> None:
        what = "failed" if status.state == "Failed" else "was discarded"
        detail = status.reason or "no reason given"
        last = (status.error or "").strip().splitlines()
        if last and last[-1] not in detail:
            detail = f"{detail}; last error: {last[-1]}"
        super().__init__(f"job {status.job or '?'} ({status.id}) {what}: {detail}")
        self.status = status
        self.reason = status.reason
        self.error = status.error


class JobFailedError(JobError):
    """The job failed for good (tries spent, or a ``FatalWorkError``): its state is Failed."""


class JobDiscardedError(JobError):
    """The job was discarded (``job.discard``, ``forget_job``, an operator): its state is Discarded."""


def _seconds(timeout: float | timedelta | None) -> float | None:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
        raise ValueError(f"timeout is seconds (or a timedelta) of 0 or more, or None to wait as long as it takes; "
                         f"got {timeout!r}")
    return float(seconds)


def outcome(status: JobStatus) -> JsonValue:
    """The result of an ended job, or its failure raised."""
    if status.state == "Failed":
        raise JobFailedError(status)
    if status.state == "Discarded":
        raise JobDiscardedError(status)
    return status.result


async def wait(jobs: Jobs, job_id: uuid.UUID | str, timeout: float | timedelta | None) -> JsonValue:  # noqa: ASYNC109
    """Waits until job ``job_id`` ends: returns its result (None without ``store_result``), raises
    :class:`JobFailedError` or :class:`JobDiscardedError`, :class:`JobNotFound` for an unknown id,
    and ``TimeoutError`` when ``timeout`` seconds pass first."""
    job_id = as_job_id(job_id)
    limit = _seconds(timeout)
    loop = asyncio.get_running_loop()
    deadline = None if limit is None else loop.time() + limit
    async with _watching(jobs, job_id) as ended:
        pause = FIRST_POLL
        while True:
            status = await jobs.status(job_id)
            if status is None:
                raise JobNotFound(f"no job has the id {job_id} (never dispatched, not committed yet, or purged "
                                  "with the retention)")
            if status.ended:
                return outcome(status)
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise TimeoutError(f"job {status.job or '?'} ({job_id}) is still {status.state} after waiting "
                                   f"{limit:g} s")
            if ended is not None:
                nap = RECHECK if left is None else min(RECHECK, left)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), nap)
                ended.clear()
            else:
                await asyncio.sleep(pause if left is None else min(pause, left))
                pause = min(pause * 2, LAST_POLL)


@contextlib.asynccontextmanager
async def _watching(jobs: Jobs, job_id: uuid.UUID) -> AsyncIterator[asyncio.Event | None]:
    """The store's notice of the job's end where it gives one (PostgreSQL), else None (poll)."""
    watcher = None if jobs.fake is not None or jobs.sync else jobs.kernel.ports.ends
    if watcher is None:
        yield None
        return
    async with watcher.watching_end(job_id) as event:
        yield event
