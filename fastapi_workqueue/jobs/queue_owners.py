"""Which job queues are this app's, and which a worker leaves as another app's.

Job queues live in the database, so with two apps on one database a worker that takes every
queue (``*``) sees the other app's queues too. A job it does not know, found on a queue that nothing
marks as its app's, goes back untouched (no try used) and the worker leaves that queue for
:data:`LEAVE_SECONDS` (health: ``Undeclared``), then looks again. A queue is the app's when one of
its jobs declares it, the worker's queue list names it, the process dispatched to it or ran one of
the app's jobs from it, or one of the first jobs waiting or running on it is the app's: there an
unknown job is a rolling deploy's, and spends its tries.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..core.redaction import redacting_logger
from ..core.tasks import TaskScope
from .envelope import queue_of, topic_of

if TYPE_CHECKING:
    from ..core.host import Host
    from .layer import Jobs

log = redacting_logger("fastapi_workqueue.jobs")

LEAVE_SECONDS = 300.0
"""How long a worker leaves a job queue it took for another app's before it looks again."""
OWN_JOBS_LOOKED_AT = 100
"""How many waiting (and running) jobs of a queue are read to learn whether the queue is the app's."""


class QueueOwners:
    """The job queues of one app (one :class:`~.layer.Jobs`) as this process knows them."""

    def __init__(self, jobs: Jobs) -> None:
        self._jobs = jobs
        self.left: dict[str, tuple[str, float]] = {}
        """The queues left as another app's: the reason, and until when (``time.monotonic()``)."""
        self.own: set[str] = set()
        """The queues a job of this app ran from, in this process: never left."""
        self.named: set[str] = set()
        """The queues a queue list of this process names."""
        self._host: Host | None = None
        self._replan_pending = False
        self._replanning = TaskScope("workqueue-jobs-replan")

    def watch(self, host: Host) -> None:
        """``host`` runs this process's job group: it is the one re-planned when a queue is left."""
        self._host = host
        if self._replan_pending:
            self._replan_pending = False
            self._replanning.spawn(host.replan(), name="workqueue-jobs-replan")

    async def close(self) -> None:
        """Ends a re-plan under way; the host is forgotten."""
        await self._replanning.close()
        self._replanning.reopen()
        self._host = None

    async def leave(self, queue: str, job: str) -> bool:
        """Called for a job this process does not know, found on ``queue``: True when the queue is
        taken for another app's (left now, or still left), so the job goes back untouched; False
        when the queue is this app's, so the job spends its tries (a rolling deploy)."""
        jobs = self._jobs
        if (queue in self.own or queue in self.named or topic_of(queue) in jobs.kernel.topics
                or queue in jobs.registry.queues() or await self._holds_own_jobs(queue)
                or queue in self.own):  # (again: a job of the app may have run from it meanwhile)
            return False
        now = time.monotonic()
        left = self.left.get(queue)
        if left is None or left[1] <= now:
            reason = (
                f"job queue {queue!r} holds job {job!r}, which no code of this app declares, and nothing says the "
                "queue is this app's (no job of it uses the queue, nor was one dispatched to or run from it here): "
                "it is taken for another app's (two apps on one database?), and this process leaves its jobs to "
                f"the app that declares them, looking again every {LEAVE_SECONDS / 60:g} minutes; name the queue in "
                "the worker's queue list (--queue, WORKQUEUE_JOB_QUEUES) to take it anyway"
            )
            self.left[queue] = (reason, now + LEAVE_SECONDS)
            log.log(logging.WARNING if left is None else logging.DEBUG, "%s", reason)
            self._replan_soon()
        return True

    def ran_from(self, queue: str) -> None:
        """Notes that a job this app declares ran from ``queue``: the queue is the app's."""
        self.own.add(queue)
        if self.left.pop(queue, None) is not None:
            self._replan_soon()

    def leaves(self, subscription: str) -> str | None:
        """Why the job group leaves ``subscription`` now (a :class:`~..core.host.GroupPlan`'s
        ``leaves``), or None to take it."""
        queue = queue_of(subscription)
        left = None if queue is None else self.left.get(queue)
        return None if left is None or left[1] <= time.monotonic() else left[0]

    async def _holds_own_jobs(self, queue: str) -> bool:
        """Whether a job this app declares waits or runs on ``queue`` (the first ones of each
        state are looked at; an error answers True: the queue is kept)."""
        jobs = self._jobs
        try:
            for state in ("Pending", "InFlight"):
                for info in await jobs.kernel.transport.list_deliveries(topic_of(queue), state,
                                                                        limit=OWN_JOBS_LOOKED_AT):
                    name = (info.attributes or {}).get("job")
                    if name is not None and jobs.registry.find(name) is not None:
                        self.ran_from(queue)
                        return True
        except Exception as exc:
            log.warning("job queue %r holds a job this app does not declare, and its jobs could not be read "
                        "(%s): the queue is kept", queue, exc)
            return True
        return False

    def _replan_soon(self) -> None:
        """Has the host of this process's job group re-plan now (not at its next reconcile)."""
        host = self._host
        if host is None:  # (not known yet: watch() re-plans once it is)
            self._replan_pending = True
            return
        self._replanning.spawn(host.replan(), name="workqueue-jobs-replan")
