"""Cancelling a job by its id: the waiting job is dropped, the running one asked to stop.

A job is a message of its queue's topic; its one delivery is what the operator's discard acts on.
A Pending job ends Discarded at once; a Running one has its cancel requested (its ``job.signal``
aborts, the attempt ends Discarded whatever it returns, never retried). A failed job has ended:
``forget_job`` drops it.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from ..core.operator import operator_text
from ..core.reports import ActionResult
from .envelope import queue_of
from .failed import JobNotFailed

if TYPE_CHECKING:
    from .layer import Jobs


class JobNotCancellable(JobNotFailed):
    """No job with this id is waiting or running (never dispatched, already ended, or purged)."""


LIVE_STATES = ("Pending", "InFlight")


async def cancel_job(jobs: Jobs, job_id: uuid.UUID, reason: str | None = None) -> ActionResult:
    """Cancels job ``job_id`` (see the module); raises :class:`JobNotCancellable` when it has ended
    or no job has the id."""
    text = operator_text(reason, "the reason") or "cancelled by an operator"
    transport = jobs.kernel.transport
    found = [info for info in await transport.message_deliveries(job_id) if queue_of(info.subscription) is not None]
    for info in found:
        if info.status in LIVE_STATES:
            result = await transport.discard(info.subscription, info.delivery_id, text)
            if result.result in ("AlreadyTerminal", "NotFound"):  # it ended between the look and the discard
                raise JobNotCancellable(f"no job with the id {job_id} is waiting or running (it ended "
                                        f"{result.status or 'just now'})")
            return result
    if any(info.status == "DeadLettered" for info in found):
        raise JobNotCancellable(f"job {job_id} has failed, so it runs no more; drop it with forget_job "
                                f"(`workqueue jobs forget {job_id}`) or queue it again with retry_job")
    ended = (f" (it ended {found[0].status})" if found else
             " (never dispatched; a later link of a chain, queued only when the one before completes: cancel "
             "that one; or purged with the retention)")
    raise JobNotCancellable(f"no job with the id {job_id} is waiting or running{ended}")
