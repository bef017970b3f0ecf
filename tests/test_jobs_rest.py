"""The failed-job routes of the REST API: list (read; payloads for admins), retry, forget, prune (operate)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from fastapi_workqueue import JobContext, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.keys import SCOPE_ADMIN, SCOPE_OPERATE, SCOPE_READ, create_key

from .support import FAST, wait_for

pytestmark = pytest.mark.timeout(90)


async def test_failed_jobs_over_rest_with_scopes(database_url: str) -> None:
    queue_name = f"rest-{uuid.uuid4().hex[:8]}"
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        job_queues=queue_name, **FAST))

    @queue.job(f"rest-fail-{queue_name}", tries=1, queue=queue_name)
    async def fail(payload: dict[str, Any]) -> None:
        raise RuntimeError("Authorization: Bearer sk-123 rejected")

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.router)
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://api") as http:
        keys = {scope: (await create_key(queue.transport, f"{scope}-{queue_name}", scopes)).key for scope, scopes in {
            "read": [SCOPE_READ], "admin": [SCOPE_READ, SCOPE_ADMIN], "operate": [SCOPE_OPERATE]}.items()}

        def auth(label: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {keys[label]}"}

        job_id = await queue.dispatch(fail, {"order": 7})
        await wait_for(lambda: queue.failed_jobs(queue_name), within=30)
        listed = await http.get("/work-queue/jobs/failed", params={"queue": queue_name}, headers=auth("read"))
        assert listed.status_code == 200
        [item] = listed.json()
        assert item["ID"] == str(job_id) and item["Payload"] is None
        assert item["Error"].splitlines()[-1] == "RuntimeError: Authorization: Bearer *** rejected"
        as_admin = await http.get("/work-queue/jobs/failed", params={"queue": queue_name}, headers=auth("admin"))
        assert as_admin.json()[0]["Payload"] == {"order": 7}
        bad = await http.get("/work-queue/jobs/failed", params={"queue": "bad queue"}, headers=auth("read"))
        # (the shape the OpenAPI schema declares for 422: a list of errors, not a string)
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "queue"], bad.text
        refused = await http.post(f"/work-queue/jobs/{job_id}/retry", headers=auth("read"))
        assert refused.status_code == 403 and "workqueue:operate" in refused.json()["detail"]
        retried = await http.post(f"/work-queue/jobs/{job_id}/retry", headers=auth("operate"))
        assert retried.status_code == 200 and retried.json()["Result"] == "Replayed"
        await wait_for(lambda: queue.failed_jobs(queue_name), within=30)  # it failed again
        assert (await http.post(f"/work-queue/jobs/{uuid.uuid4()}/forget", headers=auth("operate"))).status_code == 404
        pruned = await http.post("/work-queue/jobs/failed/prune", params={"older_than_days": 0, "queue": queue_name},
                                 headers=auth("operate"))
        assert pruned.status_code == 200 and pruned.json() == {"Pruned": 1}
        assert await queue.failed_jobs(queue_name) == []


async def test_the_job_routes_document_their_scopes_and_errors(database_url: str) -> None:
    """Like the operator routes: 401, 403 naming the scope (and ``x-required-scopes``), 503."""
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[], **FAST))
    app = FastAPI()
    app.include_router(queue.router)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
        schema = (await http.get("/openapi.json")).json()
    expected = {("get", "/work-queue/jobs/failed"): SCOPE_READ,
                ("post", "/work-queue/jobs/{job_id}/retry"): SCOPE_OPERATE,
                ("post", "/work-queue/jobs/{job_id}/forget"): SCOPE_OPERATE,
                ("post", "/work-queue/jobs/failed/prune"): SCOPE_OPERATE}
    for (method, path), scope in expected.items():
        operation = schema["paths"][path][method]
        assert {"200", "401", "403", "503"} <= set(operation["responses"]), path
        if "requestBody" in operation:
            assert {"400", "413"} <= set(operation["responses"]), path
        assert operation["x-required-scopes"] == [scope], path
        assert f"Requires the scope `{scope}`" in operation["description"], path
        assert {name for requirement in operation["security"] for name in requirement} == {"HTTPBearer",
                                                                                            "APIKeyHeader"}


async def test_a_job_is_cancelled_by_its_id_waiting_or_running(database_url: str) -> None:
    queue_name = f"cancel-{uuid.uuid4().hex[:8]}"
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        job_queues=queue_name, job_lease_seconds=3, **FAST))  # (a beat a second)
    started: list[uuid.UUID] = []

    @queue.job(f"export-{queue_name}", queue=queue_name, tries=3)
    async def export(payload: dict[str, Any], job: JobContext) -> None:
        started.append(job.id)
        await asyncio.sleep(60)  # until it is stopped

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.router)
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://api") as http:
        operate = {"Authorization": f"Bearer {(await create_key(queue.transport, queue_name, [SCOPE_OPERATE])).key}"}
        running = await queue.dispatch(export, {})
        await wait_for(lambda: started == [running], within=30)
        asked = await http.post(f"/work-queue/jobs/{running}/cancel", json={"Reason": "export no longer needed"},
                                headers=operate)
        assert asked.status_code == 200 and asked.json()["Result"] == "CancelRequested", asked.text
        status = await wait_for(lambda: _ended(queue, running), within=30)
        assert status.state == "Discarded" and status.reason == "export no longer needed"

        waiting = await queue.dispatch(export, {}, delay=3600)
        with pytest.raises(ValueError, match="the reason is 2001 characters; at most 2000 are allowed"):
            await queue.cancel_job(waiting, "x" * 2001)
        result = await queue.cancel_job(waiting, "moved: postgresql://ops:s3cret@db/app")
        assert result.result == "Discarded"
        ended = await queue.job_status(waiting)
        assert ended is not None and ended.state == "Discarded"
        assert ended.reason is not None and "s3cret" not in ended.reason  # (redacted, as every stored reason)
        assert started == [running]  # the waiting one never ran

        with pytest.raises(LookupError, match=f"no job with the id {waiting} is waiting or running"):
            await queue.cancel_job(waiting)
        unknown = await http.post(f"/work-queue/jobs/{uuid.uuid4()}/cancel", headers=operate)
        assert unknown.status_code == 404 and "never dispatched" in unknown.json()["detail"]


async def _ended(queue: WorkQueue, job_id: uuid.UUID) -> Any:
    status = await queue.job_status(job_id)
    return status if status is not None and status.state in ("Discarded", "Completed", "Failed") else None
