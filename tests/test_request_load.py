"""Requests first: a web process busy with requests claims less, and drains at full speed after."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue import Outcome, PublishRequest, WorkMessage, WorkOutcome
from fastapi_workqueue.core.request_load import RequestLoad

from .support import make_queue, wait_for

pytestmark = pytest.mark.timeout(60)


def test_the_limit_applies_only_while_enough_requests_are_in_flight() -> None:
    load = RequestLoad(busy_at=2, busy_concurrency=1)
    told: list[str] = []
    load.subscribe(lambda: told.append("idle"))
    load.enter()
    assert not load.busy and load.limit(4) == 4
    load.enter()
    assert load.busy and load.limit(4) == 1
    load.leave()
    assert not load.busy and told == ["idle"]
    load.leave()
    assert told == ["idle"] and load.in_flight == 0
    never = RequestLoad(busy_at=0)
    for _ in range(10):
        never.enter()
    assert not never.busy and never.limit(4) == 4


async def test_consumers_hold_one_delivery_while_requests_are_busy_and_all_when_they_end(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "work"}], concurrency=4, busy_requests=2,
                                    busy_concurrency=1)
    app = FastAPI()
    requests_go_on = asyncio.Event()
    handlers_go_on = asyncio.Event()
    done: list[int] = []

    @app.get("/hold")
    async def hold(session: AsyncSession = queue.session) -> dict[str, bool]:
        await session.execute(text("SELECT 1"))
        await requests_go_on.wait()
        return {"ok": True}

    @queue.handler("work")
    async def work(message: WorkMessage[int]) -> WorkOutcome:
        await handlers_go_on.wait()
        done.append(message.payload)
        return Outcome.complete()

    async with queue.lifespan(None), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        assert queue.host is not None
        consumer = queue.host.consumers[subs["work"]]
        held = [asyncio.create_task(client.get("/hold")) for _ in range(2)]
        await wait_for(lambda: queue.request_load.busy)
        # A claim already under way when the requests came sized itself before: it may still take
        # four of what is published next. Publish once the consumer is between claims.
        await wait_for(lambda: consumer.claim_loop == "waiting_for_work", interval=0.001)
        await queue.publish(topic, [PublishRequest(payload=i) for i in range(6)])
        # It holds one and waits for a slot to free: wake-ups and polls claim nothing more meanwhile.
        await wait_for(lambda: consumer.claim_loop == "waiting_for_slot" and consumer.held >= 1,
                       describe=lambda: (consumer.claim_loop, consumer.held))
        assert consumer.held == 1 and queue.request_load.busy_claims >= 1

        requests_go_on.set()
        assert all(r.status_code == 200 for r in await asyncio.gather(*held))
        assert queue.request_load.in_flight == 0
        await wait_for(lambda: consumer.held == 4)  # full concurrency again as soon as they ended
        handlers_go_on.set()
        await wait_for(lambda: len(done) == 6)
    assert sorted(done) == list(range(6))


async def test_a_handler_that_takes_the_request_session_is_not_counted_as_a_request(pg_url: str) -> None:
    """``queue.session`` in a handler (as the app's endpoints take it) is the host's own work: four
    handlers holding it at once do not make the process busy, and the consumer keeps its full
    concurrency (it fell to ``busy_concurrency``, one, and slowed its own host)."""
    queue, topic, subs = make_queue(pg_url, [{"role": "work"}], concurrency=4, busy_requests=2,
                                    busy_concurrency=1)
    go_on = asyncio.Event()
    holding: list[int] = []
    done: list[int] = []

    @queue.handler("work")
    async def work(message: WorkMessage[int], session: AsyncSession = queue.session) -> WorkOutcome:
        await session.execute(text("SELECT 1"))
        holding.append(message.payload)
        await go_on.wait()
        done.append(message.payload)
        return Outcome.complete()

    async with queue.lifespan(FastAPI(lifespan=queue.lifespan)):
        assert queue.host is not None
        consumer = queue.host.consumers[subs["work"]]
        await queue.publish(topic, [PublishRequest(payload=i) for i in range(6)])
        await wait_for(lambda: len(holding) == 4, describe=lambda: (holding, queue.request_load.in_flight))
        assert queue.request_load.in_flight == 0 and not queue.request_load.busy
        assert consumer.active == 4
        go_on.set()
        await wait_for(lambda: len(done) == 6)
    assert sorted(done) == list(range(6)) and queue.request_load.busy_claims == 0
