"""Who may call the store operations of the jobs layer: the runtime role runs jobs (claim_many,
follow-ups, steps, unique keys, known messages, a message's deliveries), the operator role prunes
dead letters and rewrites payloads."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from fastapi_workqueue import ConfigurationError, PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.outcomes import FollowUp
from fastapi_workqueue.core.transport import Settlement
from fastapi_workqueue.database.postgres import PostgresTransport

from .conftest import unique
from .test_roles import admin, app_login, login_with, runtime_role, scripted_role, url_as  # noqa: F401

pytestmark = pytest.mark.timeout(60)

async def test_a_runtime_login_runs_jobs_but_cannot_prune_or_rewrite(pg_url: str, app_login: str) -> None:  # noqa: F811
    transport = PostgresTransport(url_as(pg_url, app_login), listen=False, pool_max_size=2)
    await transport.open()
    try:
        topic, chained, mail, reports = unique("jobs"), unique("next"), unique("mail"), unique("reports")
        await transport.sync_topology(
            [Topic(name=topic), Topic(name=chained)],
            [Subscription(name=mail, topic=topic, handler_key="h"), Subscription(name=reports, topic=topic,
                                                                                 handler_key="h", max_attempts=1),
             Subscription(name=unique("then"), topic=chained, handler_key="h")])
        [job] = await transport.publish(topic, [prepare(PublishRequest(payload=1, deduplication_key="u"))])
        assert job.message_id is not None
        assert await transport.known_messages([job.message_id]) == {job.message_id}
        claimed = dict(await transport.claim_many([mail, reports], 10))
        await transport.step_put(job.message_id, "s", '"v"')
        assert await transport.step_get(job.message_id, "s") == (True, '"v"')
        one = claimed[mail]
        assert await transport.settle_with_follow_ups(Settlement(
            one.delivery_id, one.lease_token, "Complete",
            follow_ups=(FollowUp(chained, [prepare(PublishRequest(payload="next"))]),))) == "Completed"
        two = claimed[reports]
        assert await transport.settle([Settlement(two.delivery_id, two.lease_token, "DeadLetter")]) == ["DeadLettered"]
        assert [d.status for d in await transport.message_deliveries(job.message_id)] == ["Completed", "DeadLettered"]
        assert await transport.release_deduplication_key(topic, "u", job.message_id) is True
        for denied in (transport.discard_dead_letters(reports, datetime.now(UTC)),
                       transport.rewrite_payload(job.message_id, '"x"', "h", 3)):
            with pytest.raises(ConfigurationError, match="permission denied"):
                await denied
    finally:
        await transport.close()


async def test_prune_over_rest_says_what_the_runtime_login_lacks(
    pg_url: str, pg_transport: PostgresTransport, app_login: str  # noqa: F811
) -> None:
    """An app on a runtime-only login serves POST /jobs/failed/prune with an operate key: the store
    refuses the privilege, and the answer is a 503 that names the role script, not a bare 500."""
    import httpx
    from fastapi import FastAPI

    from fastapi_workqueue import WorkQueue, WorkQueueSettings
    from fastapi_workqueue.core.keys import SCOPE_OPERATE, create_key

    key = (await create_key(pg_transport, unique("pruner"), [SCOPE_OPERATE])).key
    queue = WorkQueue(WorkQueueSettings(database_url=url_as(pg_url, app_login), enabled=False, sync_topology=False,
                                        subscriptions=[]))
    queue_name = unique("prune-q")
    await pg_transport.sync_topology([Topic(name=f"jobs.{queue_name}")],
                                     [Subscription(name=f"jobs.{queue_name}", topic=f"jobs.{queue_name}",
                                                   handler_key="h")])
    app = FastAPI()
    app.include_router(queue.router)
    async with queue.lifespan(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://api"
    ) as http:
        answer = await http.post("/work-queue/jobs/failed/prune", params={"older_than_days": 0, "queue": queue_name},
                                 headers={"X-API-Key": key})
    assert answer.status_code == 503, answer.text
    detail = answer.json()["detail"]
    assert "lacks a privilege" in detail and "operator_role.sql" in detail, detail


async def test_an_operator_login_prunes_and_rewrites_but_cannot_run_jobs(
    pg_url: str, admin: asyncpg.Connection[Any], pg_transport: PostgresTransport  # noqa: F811
) -> None:
    topic, sub = unique("jobs"), unique("failed")
    await pg_transport.sync_topology([Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="h",
                                                                        max_attempts=1)])
    [dead, waiting] = await pg_transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(2)])
    [claimed] = await pg_transport.claim(sub, 1)
    await pg_transport.settle([Settlement(claimed.delivery_id, claimed.lease_token, "DeadLetter")])
    assert waiting.message_id is not None and dead.message_id is not None
    async with scripted_role(admin, "workqueue_operator") as role, login_with(admin, role) as login:
        transport = PostgresTransport(url_as(pg_url, login), listen=False, pool_max_size=1)
        await transport.open()
        try:
            assert await transport.discard_dead_letters(sub, datetime.now(UTC)) == 1
            assert await transport.rewrite_payload(waiting.message_id, '"re-encrypted"', "h2", 14) is True
            assert [d.status for d in await transport.message_deliveries(dead.message_id)] == ["Discarded"]
            for denied in (transport.claim_many([sub], 1), transport.step_put(dead.message_id, "s", "1"),
                           transport.known_messages([dead.message_id])):
                with pytest.raises(ConfigurationError, match="permission denied"):
                    await denied
        finally:
            await transport.close()
