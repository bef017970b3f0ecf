"""The statuses of jobs run in this process (sync mode), and the job id a caller passes."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Iterable

from .status import JobStatus

KEPT = 10000
"""How many statuses sync mode keeps (the newest)."""


class LocalStatuses:
    """The newest :data:`KEPT` statuses of jobs that ran in this process, by id."""

    def __init__(self, kept: int = KEPT) -> None:
        self._kept = kept
        self._by_id: OrderedDict[uuid.UUID, JobStatus] = OrderedDict()

    def get(self, job_id: uuid.UUID) -> JobStatus | None:
        return self._by_id.get(job_id)

    def update(self, statuses: Iterable[JobStatus]) -> None:
        for status in statuses:
            self._by_id[status.id] = status
            self._by_id.move_to_end(status.id)
        while len(self._by_id) > self._kept:
            self._by_id.popitem(last=False)


def as_job_id(job_id: uuid.UUID | str) -> uuid.UUID:
    """``job_id`` as a UUID (the id ``dispatch`` returned, or its text)."""
    if isinstance(job_id, uuid.UUID):
        return job_id
    try:
        return uuid.UUID(str(job_id))
    except ValueError:
        raise ValueError(f"a job id is the UUID dispatch() returned, got {job_id!r}") from None
