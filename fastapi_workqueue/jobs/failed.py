"""Failed jobs: the dead letters of the job queues, as jobs (list, retry, forget, prune).

A failed job keeps its id (its MessageID), so a retry is a replay of its dead letter: the same id,
its tries counted afresh. Forgetting discards the dead letter; pruning discards those that failed
more than N days ago. The error text shown is redacted (the store's ``last_error`` already is; the
app's keys are masked too).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..core.operator import operator_text
from ..core.redaction import redact
from ..core.reports import ActionResult, DeliveryInfo
from ..core.wire import WireModel
from .envelope import JobEnvelope, queue_of, topic_of

if TYPE_CHECKING:
    from .layer import Jobs

PRUNE_BATCH = 1000
MAX_DAYS = 36500.0
"""The oldest failure a prune can name: a hundred years."""


class FailedJob(WireModel):
    """A job that failed for good."""

    id: uuid.UUID
    job: str | None
    queue: str
    attempts: int
    reason: str | None = None
    error: str | None = None
    failed_at: datetime | None = None
    delivery_id: str
    payload: Any = None
    """Only when asked for (and never the plaintext of an encrypted job)."""


class JobNotFailed(LookupError):
    """No failed job has this id."""


def _failed_job(info: DeliveryInfo, include_payload: bool) -> FailedJob:
    job_name = (info.attributes or {}).get("job")
    payload = None
    if include_payload and info.payload is not None:
        try:
            envelope = JobEnvelope.from_json(info.payload)
            job_name = job_name or envelope.job
            payload = None if envelope.is_encrypted else envelope.payload
        except ValueError:
            payload = info.payload
    return FailedJob(
        id=info.message_id, job=job_name, queue=queue_of(info.subscription) or info.subscription,
        attempts=info.attempt, reason=None if info.reason is None else redact(info.reason),
        error=None if info.last_error is None else redact(info.last_error), failed_at=info.settled_at,
        delivery_id=info.delivery_id, payload=payload,
    )


class FailedJobs:
    """The failed jobs of one queue's job queues."""

    def __init__(self, jobs: Jobs) -> None:
        self._jobs = jobs

    async def _queues(self, queue: str | None) -> list[str]:
        if queue is not None:
            return [topic_of(queue)]
        return sorted(s.name for s in await self._jobs.kernel.transport.list_subscriptions()
                      if queue_of(s.name) is not None)

    async def list(
        self, queue: str | None = None, *, limit: int = 100, include_payload: bool = False
    ) -> list[FailedJob]:
        """The failed jobs, oldest first per queue, at most ``limit`` in all."""
        failed: list[FailedJob] = []
        for subscription in await self._queues(queue):
            if len(failed) >= limit:
                break
            infos = await self._jobs.kernel.transport.list_deliveries(
                subscription, "DeadLettered", limit=limit - len(failed), include_payload=include_payload
            )
            failed.extend(_failed_job(info, include_payload) for info in infos)
        return failed

    async def _dead_letter_of(self, job_id: uuid.UUID) -> DeliveryInfo:
        for info in await self._jobs.kernel.transport.message_deliveries(job_id):
            if info.status == "DeadLettered" and queue_of(info.subscription) is not None:
                return info
        raise JobNotFailed(f"no failed job has the id {job_id} (it may have been retried, forgotten or pruned)")

    async def retry(self, job_id: uuid.UUID, note: str | None = None) -> ActionResult:
        """Queues a failed job again: the same id, its tries counted afresh."""
        text = operator_text(note, "the note") or "retried as a failed job"
        info = await self._dead_letter_of(job_id)
        return await self._jobs.kernel.transport.replay(info.subscription, info.delivery_id, text)

    async def forget(self, job_id: uuid.UUID) -> ActionResult:
        """Drops a failed job (its dead letter is discarded, then purged with the retention)."""
        info = await self._dead_letter_of(job_id)
        return await self._jobs.kernel.transport.discard(info.subscription, info.delivery_id, "forgotten failed job")

    async def prune(self, older_than: timedelta, queue: str | None = None) -> int:
        """Forgets the jobs that failed more than ``older_than`` ago; returns how many."""
        if not timedelta(0) <= older_than <= timedelta(days=MAX_DAYS):
            raise ValueError(f"older_than must be between 0 and {MAX_DAYS:g} days, got {older_than}")
        cutoff = datetime.now(UTC) - older_than
        total = 0
        for subscription in await self._queues(queue):
            total += await self._jobs.kernel.transport.discard_dead_letters(subscription, cutoff, PRUNE_BATCH)
        return total
