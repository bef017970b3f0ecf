"""A job's status as ``queue.job_status(job_id)`` and ``GET /work-queue/jobs/{id}`` answer it.

A job is one message with one delivery on its queue's subscription; its state is the delivery's,
named for jobs:

| delivery | job |
|---|---|
| Pending | Pending (never run yet, or waiting out its backoff after a failed attempt: ``retrying``) |
| InFlight | Running |
| Completed | Completed (with its ``result`` when the job is declared ``store_result=True``) |
| DeadLettered | Failed |
| Discarded | Discarded |

The attempts are those the store keeps off the happy path (a failed attempt, a lease that ran out,
a dead letter, a discard, a replay); an attempt that completed leaves none.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from pydantic import JsonValue

from ..core.attempts import AttemptInfo
from ..core.message_state import HELD_UNTIL
from ..core.redaction import redact
from ..core.reports import DeliveryInfo
from ..core.wire import WireModel
from .envelope import queue_of
from .results import decode_result

if TYPE_CHECKING:
    from ..core.attempts import AttemptHistoryReader
    from ..core.message_state import MessageState
    from ..core.transport import OperatorReads
    from .encryption import PayloadCipher

JobState = Literal["Pending", "Running", "Completed", "Failed", "Discarded"]
"""A job's state: Pending (waiting to run, or to run again after a failed attempt), Running,
Completed, Failed (a dead letter: tries spent, or a fatal error) or Discarded."""
TERMINAL_STATES: frozenset[str] = frozenset(("Completed", "Failed", "Discarded"))

_STATE_OF: dict[str, JobState] = {
    "Pending": "Pending", "InFlight": "Running", "Completed": "Completed", "DeadLettered": "Failed",
    "Discarded": "Discarded",
}


class JobStatus(WireModel):
    """Where a job is: its state, attempts, times, last error and (Completed) result."""

    id: uuid.UUID
    job: str | None
    """The job's name."""
    queue: str
    state: JobState
    attempt: int
    """Attempts started so far (the running one included); 0 before the first."""
    tries: int
    """Attempts it may make in all."""
    retrying: bool = False
    """Pending after a failed attempt: it runs again at ``run_at`` (``error`` says why it failed)."""
    created_at: datetime | None = None
    """When it was dispatched."""
    run_at: datetime | None = None
    """Pending: when it is due (its delay, its backoff after a failed attempt, a debounce window);
    None while it waits for something else than time (the ``then`` job of a group)."""
    started_at: datetime | None = None
    """When its latest attempt started."""
    ended_at: datetime | None = None
    """Completed, Failed or Discarded: when it ended."""
    reason: str | None = None
    """Why it failed, was discarded, or was retried (redacted)."""
    error: str | None = None
    """The error of its latest failed attempt (redacted)."""
    result: JsonValue = None
    """Completed: what the job returned, when it is declared ``store_result=True`` (JSON)."""
    attempts: list[AttemptInfo] = []
    """The attempts kept off the happy path, oldest first (a completed attempt leaves none)."""

    @property
    def ended(self) -> bool:
        """True once the job is Completed, Failed or Discarded."""
        return self.state in TERMINAL_STATES


def job_delivery(infos: list[DeliveryInfo]) -> DeliveryInfo | None:
    """The delivery of a job among a message's deliveries (the one on a job queue), or None."""
    return next((info for info in infos if queue_of(info.subscription) is not None), None)


def status_of(info: DeliveryInfo, attempts: list[AttemptInfo], result: Any) -> JobStatus:
    """The status of the job whose delivery is ``info``."""
    state = _STATE_OF[info.status]
    held = info.visible_at is not None and info.visible_at >= HELD_UNTIL  # a group's then: due at no time
    return JobStatus(
        id=info.message_id, job=(info.attributes or {}).get("job"), queue=queue_of(info.subscription) or "",
        state=state, attempt=info.attempt, tries=info.max_attempts,
        retrying=state == "Pending" and info.attempt > 0, created_at=info.created_at,
        run_at=info.visible_at if state == "Pending" and not held else None,
        started_at=info.claimed_at, ended_at=info.settled_at if state in TERMINAL_STATES else None,
        reason=None if info.reason is None else redact(info.reason),
        error=None if info.last_error is None else redact(info.last_error),
        result=result,
        attempts=[a.model_copy(update={"reason": None if a.reason is None else redact(a.reason),
                                       "error": None if a.error is None else redact(a.error)})
                  for a in attempts],
    )


async def read_status(
    job_id: uuid.UUID,
    reads: OperatorReads,
    state: MessageState | None,
    history: AttemptHistoryReader | None,
    cipher: PayloadCipher | None,
    *,
    reveal_encrypted: bool = True,
) -> JobStatus | None:
    """The status of job ``job_id`` from a store, or None when the store has no job with that id."""
    info = job_delivery(await reads.message_deliveries(job_id))
    if info is None:
        return None
    attempts = await history.delivery_attempts(info.delivery_id) if history is not None else []
    result: Any = None
    if info.status == "Completed" and state is not None:
        text = await state.result_get(job_id)
        if text is not None:
            result = decode_result(text, cipher, job_id, reveal_encrypted=reveal_encrypted)
    return status_of(info, attempts, result)
