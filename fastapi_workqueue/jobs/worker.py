"""Which job queues a worker takes, and the checks before it starts.

``--queue mail,default`` (or ``WORKQUEUE_JOB_QUEUES``) takes the queues in strict order: a job of
``mail`` before any job of ``default``. ``*`` in the list stands for every queue the list does not
name, taken fairly at its place (the oldest due job first); no list at all means every queue,
fairly. A worker with a list and no ``*`` warns once about jobs waiting on queues it does not take.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from ..core.errors import ConfigurationError
from ..core.host import GroupPlan
from .definition import check_queue_name
from .envelope import TOPIC_PREFIX, queue_of, topic_of

if TYPE_CHECKING:
    from .layer import Jobs

log = logging.getLogger("fastapi_workqueue.jobs")

GROUP_NAME = "jobs"
OTHERS = "*"
WATCH_SECONDS = 60.0


def parse_queues(spec: str | None) -> list[str]:
    """``"mail,*"`` → ``["mail", "*"]``; None or empty → ``["*"]``. Raises ConfigurationError."""
    if spec is None or not spec.strip():
        return [OTHERS]
    names = [part.strip() for part in spec.split(",")]
    if any(not n for n in names):
        raise ConfigurationError(
            f"the queue list {spec!r} has an empty entry; write it like 'mail,default' or 'mail,*'"
        )
    for name in names:
        if name != OTHERS:
            check_queue_name(name)
    if len(set(names)) != len(names):
        raise ConfigurationError(f"the queue list {spec!r} names a queue twice")
    return names


def job_group(spec: str | None, concurrency: int) -> GroupPlan:
    """The host's group consumer for a queue list."""
    patterns = tuple(f"{TOPIC_PREFIX}*" if name == OTHERS else topic_of(name) for name in parse_queues(spec))
    return GroupPlan(name=GROUP_NAME, patterns=patterns, concurrency=concurrency)


def check_fits_lease(jobs: Jobs, queues: list[str], stop_timeout: float) -> None:
    """Refuses a worker whose jobs' timeout plus the stop timeout does not fit in the lease."""
    lease = jobs.lease_seconds
    takes_all = OTHERS in queues
    problems = [
        f"{job.name!r} (timeout {job.policy.timeout:g} s)"
        for job in jobs.registry
        if job.policy.timeout is not None and (takes_all or job.policy.queue in queues)
        and job.policy.timeout + stop_timeout > lease
    ]
    if problems:
        raise ConfigurationError(
            f"job(s) {', '.join(problems)}: the timeout plus the stop timeout ({stop_timeout:g} s) does not fit in "
            f"the job lease ({lease:g} s); lower the timeout or --stop-timeout, or raise WORKQUEUE_JOB_LEASE_SECONDS"
        )


class UnwatchedQueues:
    """Warns once per queue about jobs ready on queues a strict list does not take."""

    def __init__(self, jobs: Jobs, queues: list[str], interval: float = WATCH_SECONDS) -> None:
        self._jobs = jobs
        self._taken = set(queues)
        self._interval = interval
        self._seen_once: set[str] = set()
        self._warned: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if OTHERS not in self._taken and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="workqueue-unwatched-queues")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def look(self) -> list[str]:
        """Queues outside the list with ready jobs at two looks in a row; each is warned about once."""
        ready = set()
        for stats in await self._jobs.queue.stats():
            queue = queue_of(stats.subscription)
            if queue is not None and queue not in self._taken and stats.claimable > 0:
                ready.add(queue)
        twice = sorted((ready & self._seen_once) - self._warned)
        self._seen_once = ready
        if twice:
            self._warned.update(twice)
            log.warning(
                "jobs are waiting on queue(s) %s, which this worker does not take (it takes %s); start a worker "
                "for them, or add them (or *) to --queue / WORKQUEUE_JOB_QUEUES",
                ", ".join(twice), ",".join(sorted(self._taken)),
            )
        return twice

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            with contextlib.suppress(Exception):
                await self.look()
