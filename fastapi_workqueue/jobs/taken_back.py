"""What became of a job whose lease a sweeper pass took back, as a job event.

A worker that stops in the middle of an attempt (killed, out of memory, its event loop blocked past
the lease) hears nothing more of it: the attempt's end is written by the sweeper of whichever
process takes the lease back. That process emits the job's event, once across the fleet:
:class:`JobFailed` when it was the last try, :class:`JobDiscarded` when an operator had cancelled
it, :class:`JobReleased` (``reason="lease-lost"``) when it comes back. A worker that returns after
its lease was taken back emits nothing for that attempt (its settle answers ``LeaseLost``).
"""

from __future__ import annotations

from datetime import UTC, datetime

from ..core.reports import DeliveryInfo, TakenBack
from .envelope import EnvelopeInvalid, JobEnvelope
from .events import JobDiscarded, JobEvent, JobFailed, JobReleased

LEASE_RAN_OUT_ON_LAST_TRY = (
    "its lease ran out on its last try: the process running it stopped renewing it (it was killed, ran out "
    "of memory, or blocked its event loop past the lease)"
)


def taken_back_event(item: TakenBack, info: DeliveryInfo, queue: str, now: datetime | None = None) -> JobEvent:
    """The event of a job's delivery ``info`` whose lease the sweeper took back as ``item`` says."""
    job = (info.attributes or {}).get("job") or "(unknown)"
    chained = 0
    try:
        envelope = JobEnvelope.from_json(info.payload)
    except EnvelopeInvalid:
        pass
    else:
        job, chained = envelope.job, len(envelope.chain)
    job_id, attempt, tries = info.message_id, item.attempt, info.max_attempts
    chain_note = f"; the chain ends here: the {chained} job(s) queued after it will not run" if chained else ""
    if item.result == "DeadLettered":
        return JobFailed(job=job, job_id=job_id, queue=queue, attempt=attempt, tries=tries,
                         reason=LEASE_RAN_OUT_ON_LAST_TRY + chain_note, chain_ended=bool(chained))
    if item.result == "Discarded":
        return JobDiscarded(job=job, job_id=job_id, queue=queue, attempt=attempt, tries=tries,
                            reason="cancelled by an operator" + chain_note, chain_ended=bool(chained))
    delay = None
    if info.visible_at is not None:
        delay = max(0.0, (info.visible_at - (now or datetime.now(UTC))).total_seconds())
    return JobReleased(job=job, job_id=job_id, queue=queue, attempt=attempt, tries=tries, reason="lease-lost",
                       delay_seconds=delay)
