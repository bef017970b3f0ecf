"""Which job queues a worker takes, and the checks before it starts.

``--queue mail,default`` (or ``WORKQUEUE_JOB_QUEUES``) takes the queues in strict order: a job of
``mail`` before any job of ``default``. ``*`` in the list stands for every queue the list does not
name, taken fairly at its place (the oldest due job first); no list at all means every queue,
fairly. A worker with a list and no ``*`` warns once about jobs waiting on queues it does not take
(looking while it is idle, at most once a minute).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.errors import ConfigurationError
from ..core.host import GroupPlan
from ..core.redaction import redacting_logger
from ..core.tasks import TaskScope
from .definition import check_queue_name
from .envelope import TOPIC_PREFIX, queue_of, topic_of

if TYPE_CHECKING:
    from ..core.transport import Transport
    from .layer import Jobs

log = redacting_logger("fastapi_workqueue.jobs")

GROUP_NAME = "jobs"
OTHERS = "*"
WATCH_SECONDS = 60.0
"""The unwatched-queue warning looks at most this often."""
IDLE_POLL_SECONDS = 1.0
"""How often the warning's loop asks whether the worker is idle."""


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


def job_group(spec: str | None, concurrency: int, leaves: Callable[[str], str | None] | None = None) -> GroupPlan:
    """The host's group consumer for a queue list; ``*`` leaves the queues ``leaves`` names a reason
    for (another app's)."""
    patterns = tuple(f"{TOPIC_PREFIX}*" if name == OTHERS else topic_of(name) for name in parse_queues(spec))
    return GroupPlan(name=GROUP_NAME, patterns=patterns, concurrency=concurrency, leaves=leaves)


async def unknown_queues(jobs: Jobs, queues: list[str], transport: Transport) -> list[str]:
    """The named queues of a queue list (``*`` aside) that no declared job uses and the store holds
    no topic of: most likely misspelt, as a worker on them would wait for nothing."""
    declared = jobs.registry.queues()
    named = [q for q in queues if q != OTHERS and q not in declared]
    if not named:
        return []
    stored = {topic.name for topic in await transport.list_topics()}
    return [q for q in named if topic_of(q) not in stored]


def check_fits_lease(jobs: Jobs, queues: list[str], stop_timeout: float, *,
                     stop_timeout_name: str = "--stop-timeout") -> None:
    """Refuses a worker whose jobs' timeout plus the stop timeout does not fit in the lease
    (``stop_timeout_name``: what sets the stop timeout where the check runs)."""
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
            f"the job lease ({lease:g} s); lower the timeout or {stop_timeout_name}, or raise "
            "WORKQUEUE_JOB_LEASE_SECONDS"
        )


class UnwatchedQueues:
    """Warns once per queue about jobs ready on queues a strict list (no ``*``) does not take.

    It looks while the worker is idle (``idle()`` says so), at most once every ``interval``
    seconds, the first time as soon as the worker is first idle.
    """

    def __init__(self, jobs: Jobs, queues: list[str], interval: float = WATCH_SECONDS,
                 idle: Callable[[], bool] = lambda: True, poll: float = IDLE_POLL_SECONDS) -> None:
        self._jobs = jobs
        self._taken = set(queues)
        self._interval = interval
        self._idle = idle
        self._poll = poll
        self._warned: set[str] = set()
        self._tasks = TaskScope("workqueue-unwatched-queues")
        self._task: asyncio.Task[None] | None = None

    @property
    def watching(self) -> bool:
        """True when the list leaves queues out (no ``*``): only then is there anything to warn about."""
        return OTHERS not in self._taken

    def start(self) -> None:
        if self.watching and self._task is None:
            self._tasks.reopen()
            self._task = self._tasks.spawn(self._loop(), name="workqueue-unwatched-queues")

    async def stop(self) -> None:
        self._task = None
        await self._tasks.close()

    async def look(self) -> list[str]:
        """Queues outside the list with jobs ready now, not warned about before; warns, naming them."""
        ready = set()
        for stats in await self._jobs.kernel.operator.stats():
            queue = queue_of(stats.subscription)
            if queue is not None and queue not in self._taken and stats.claimable > 0:
                ready.add(queue)
        new = sorted(ready - self._warned)
        if new:
            self._warned.update(new)
            log.warning(
                "jobs are waiting on queue(s) %s, which this worker does not take (it takes %s); unless another "
                "worker takes them, start one for them, or add them (or *) to --queue / WORKQUEUE_JOB_QUEUES",
                ", ".join(new), ",".join(sorted(self._taken)),
            )
        return new

    async def _loop(self) -> None:
        last: float | None = None
        while True:
            await asyncio.sleep(self._poll)
            now = time.monotonic()
            if (last is not None and now - last < self._interval) or not self._idle():
                continue
            last = now
            try:
                await self.look()
            except Exception as exc:  # the store is away for a moment: the next look tries again
                log.debug("the look at unwatched job queues failed: %s", exc)
