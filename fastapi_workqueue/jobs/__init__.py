"""Jobs: the layer application developers reach for ("send this mail later").

Declare a job with ``@queue.job(name, ...)`` on an async function that takes its payload (a
pydantic model), a :class:`JobContext` and FastAPI dependencies; queue it with
``await queue.dispatch(job, payload)``. Each job queue is a topic and a subscription of the core,
so every guarantee of the queue (leases, fencing, heartbeats, dead letters, transactional publish,
the operator tools) holds for jobs.
"""

from .context import JobContext, JobDiscard, JobRelease
from .definition import Job, JobPayloadInvalid, JobPolicy
from .events import JobDiscarded, JobEvent, JobFailed, JobProcessed, JobProcessing, JobReleased
from .failed import FailedJob
from .fake import Dispatched, JobFake
from .groups import JobGroup
from .layer import JobDispatchError
from .local import JobCounts
from .middleware import JobAttempt, without_overlapping
from .registry import UnknownJob
from .results import MAX_RESULT_BYTES, ResultNotStorable
from .schedules import Schedule
from .status import JobStatus
from .waiting import JobDiscardedError, JobError, JobFailedError, JobNotFound

__all__ = [
    "MAX_RESULT_BYTES",
    "Dispatched",
    "FailedJob",
    "Job",
    "JobAttempt",
    "JobContext",
    "JobCounts",
    "JobDiscard",
    "JobDiscarded",
    "JobDiscardedError",
    "JobDispatchError",
    "JobError",
    "JobEvent",
    "JobFailed",
    "JobFailedError",
    "JobFake",
    "JobGroup",
    "JobNotFound",
    "JobPayloadInvalid",
    "JobPolicy",
    "JobProcessed",
    "JobProcessing",
    "JobRelease",
    "JobReleased",
    "JobStatus",
    "ResultNotStorable",
    "Schedule",
    "UnknownJob",
    "without_overlapping",
]
