"""The REST routes of jobs, beside the operator API (``queue.router``):

``GET /work-queue/jobs/{id}`` (a job's status, ``workqueue:read``),
``GET /work-queue/jobs/failed`` (``workqueue:read``; payloads with ``workqueue:admin``),
``POST /work-queue/jobs/{id}/cancel`` (a waiting or running job, with an optional ``{"Reason": …}``),
``POST /work-queue/jobs/{id}/retry``, ``POST /work-queue/jobs/{id}/forget`` and
``POST /work-queue/jobs/failed/prune?older_than_days=N`` (``workqueue:operate``).
"""

# No ``from __future__ import annotations``: FastAPI reads the route signatures' annotations, and
# the aliases below are local to build_job_router.
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated, TypeVar

from fastapi import APIRouter, HTTPException, Path, Query, Security, status
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from ..core.errors import ConfigurationError, TransportError
from ..core.keys import SCOPE_ADMIN, SCOPE_OPERATE, SCOPE_READ, Principal
from ..core.reports import ActionResult
from ..core.wire import WireModel
from ..web.routes import DiscardBody, cannot_serve, document_errors
from .definition import check_queue_name
from .failed import MAX_DAYS, FailedJob, JobNotFailed
from .status import JobStatus

if TYPE_CHECKING:
    from ..web.auth import Authorizer
    from .layer import Jobs


T = TypeVar("T")


class Pruned(WireModel):
    pruned: int


def build_job_router(jobs: Callable[[], "Jobs"], authorize: "Authorizer", *, prefix: str = "",
                     route_class: type[APIRoute] = APIRoute) -> APIRouter:
    """The failed-job routes of the jobs layer ``jobs()`` (made when a route first needs it) under
    ``prefix`` + ``/jobs``, checked by ``authorize`` (the operator router includes them, under its
    own prefix, with its ``route_class``: its bound on bodies and its answers to unreadable ones)."""
    router = APIRouter(prefix=f"{prefix}/jobs", tags=["jobs"], route_class=route_class)
    Reader = Annotated[Principal, Security(authorize, scopes=[SCOPE_READ])]
    Operator = Annotated[Principal, Security(authorize, scopes=[SCOPE_OPERATE])]
    JobId = Annotated[uuid.UUID, Path(description="The job's id (its MessageID).")]

    def queue_name(name: str | None) -> str | None:
        if name is None:
            return None
        try:
            return check_queue_name(name)
        except ConfigurationError as exc:  # (as FastAPI's own 422: a list of errors, as the schema says)
            raise RequestValidationError([{"type": "value_error", "loc": ["query", "queue"], "msg": str(exc),
                                           "input": name}]) from None

    @router.get("/failed", response_model=list[FailedJob], summary="Jobs that failed for good")
    async def failed(
        principal: Reader,
        queue_filter: Annotated[str | None, Query(alias="queue")] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[FailedJob]:
        """The failed jobs with their reason and redacted error (payloads for ``workqueue:admin``,
        never an encrypted one's plaintext)."""
        return await _call(jobs().failed.list(queue_name(queue_filter), limit=limit,
                                              include_payload=principal.has(SCOPE_ADMIN)))

    @router.get("/{job_id}", response_model=JobStatus, summary="A job's status",
                responses={404: {"description": "No job has this id (never dispatched, or purged)."}})
    async def job_status(job_id: JobId, principal: Reader) -> JobStatus:
        """The job's state, attempts, tries, times, last error and stored result (an encrypted
        job's result is never shown), as ``queue.job_status`` answers."""
        found: JobStatus | None = await _call(jobs().status(job_id, reveal_encrypted=False))
        if found is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND,
                                detail=f"no job has the id {job_id} (never dispatched, or purged with the retention)")
        return found

    @router.post("/{job_id}/retry", response_model=ActionResult, summary="Queue a failed job again",
                 responses={404: {"description": "No failed job has this id."}})
    async def retry(job_id: JobId, principal: Operator) -> ActionResult:
        """The failed job is queued again with the same id, its tries counted afresh."""
        return await _call(jobs().failed.retry(job_id, None))

    @router.post("/{job_id}/cancel", response_model=ActionResult, summary="Cancel a waiting or running job",
                 responses={404: {"description": "No job with this id waits or runs."}})
    async def cancel(job_id: JobId, principal: Operator, body: DiscardBody | None = None) -> ActionResult:
        """A waiting job ends Discarded at once; a running one has its cancel requested
        (``CancelRequested``): it ends Discarded whatever it returns, never retried."""
        from .cancel import cancel_job

        return await _call(cancel_job(jobs(), job_id, body.reason if body is not None else None))

    @router.post("/{job_id}/forget", response_model=ActionResult, summary="Drop a failed job",
                 responses={404: {"description": "No failed job has this id."}})
    async def forget(job_id: JobId, principal: Operator) -> ActionResult:
        """The failed job is dropped (discarded)."""
        return await _call(jobs().failed.forget(job_id))

    @router.post("/failed/prune", response_model=Pruned, summary="Drop old failed jobs")
    async def prune(
        principal: Operator,
        older_than_days: Annotated[float, Query(ge=0, le=MAX_DAYS)],
        queue_filter: Annotated[str | None, Query(alias="queue")] = None,
    ) -> Pruned:
        """Drops the jobs that failed more than ``older_than_days`` ago."""
        pruned = jobs().failed.prune(timedelta(days=older_than_days), queue_name(queue_filter))
        return Pruned(pruned=await _call(pruned))

    document_errors(router)
    return router


async def _call(awaitable: Awaitable[T]) -> T:
    try:
        return await awaitable
    except JobNotFailed as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=str(exc).strip("'\"")) from None
    except ConfigurationError as exc:  # the app's database role lacks a privilege, say
        raise cannot_serve(exc) from exc
    except TransportError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, detail="the queue's store is unavailable; retry",
                            headers={"Retry-After": "1"}) from exc
