"""The request sessions' gate: first come, first served, under contention and through the app."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue.web.admission import FairGate

from .support import make_queue, wait_for

pytestmark = pytest.mark.timeout(60)


async def test_a_freed_place_goes_to_the_longest_waiter_not_to_a_newcomer() -> None:
    gate = FairGate(1)
    assert await gate.acquire(1)
    order: list[int] = []

    async def wait(n: int) -> None:
        assert await gate.acquire(5)
        order.append(n)
        await asyncio.sleep(0)
        gate.release()

    waiters = []
    for n in range(5):
        waiters.append(asyncio.create_task(wait(n)))
        await asyncio.sleep(0)  # each is queued before the next comes
    assert gate.waiting == 5
    gate.release()
    # A newcomer that arrives as the place is handed on queues behind the five.
    late = asyncio.create_task(wait(99))
    await asyncio.gather(*waiters, late)
    assert order == [0, 1, 2, 3, 4, 99]
    assert gate.held == 0 and gate.waiting == 0


async def test_a_waiter_that_times_out_holds_nothing_and_the_next_one_gets_the_place() -> None:
    gate = FairGate(1)
    assert await gate.acquire(1)
    assert await gate.acquire(0.05) is False  # nobody released in time
    assert gate.held == 1 and gate.waiting == 0
    got = asyncio.create_task(gate.acquire(5))
    await asyncio.sleep(0)
    gate.release()
    assert await got is True
    assert gate.held == 1
    gate.release()
    assert gate.held == 0


async def test_a_cancelled_waiter_is_skipped_and_a_place_handed_to_it_as_it_went_is_passed_on() -> None:
    gate = FairGate(1)
    assert await gate.acquire(1)
    cancelled = asyncio.create_task(gate.acquire(5))
    second = asyncio.create_task(gate.acquire(5))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    gate.release()
    assert await second is True
    # The place handed over at the moment its waiter is cancelled goes on to the next one.
    third = asyncio.create_task(gate.acquire(5))
    fourth = asyncio.create_task(gate.acquire(5))
    await asyncio.sleep(0)
    gate.release()  # hands the place to third ...
    third.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await third
    assert await fourth is True
    assert gate.held == 1
    gate.release()
    assert gate.held == 0


def test_a_gate_needs_a_place() -> None:
    with pytest.raises(ValueError, match="limit must be at least 1"):
        FairGate(0)


async def test_requests_waiting_for_the_session_pool_are_served_in_the_order_they_came(database_url: str) -> None:
    queue, _, _ = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True,
                             session_pool_size=1, session_pool_timeout_ms=10_000)
    app = FastAPI(lifespan=queue.lifespan)
    served: list[int] = []
    holding, release = asyncio.Event(), asyncio.Event()

    @app.get("/hold")
    async def hold(session: AsyncSession = queue.session) -> dict[str, bool]:
        holding.set()
        await release.wait()
        return {"ok": True}

    @app.get("/n/{n}")
    async def numbered(n: int, session: AsyncSession = queue.session) -> dict[str, int]:
        await session.execute(text("SELECT 1"))
        served.append(n)
        return {"n": n}

    transport = httpx.ASGITransport(app=app)
    async with queue.lifespan(app), httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        first = asyncio.create_task(http.get("/hold"))
        await asyncio.wait_for(holding.wait(), 10)
        gate = queue._sessions.gate
        waiting = []
        for n in range(8):
            waiting.append(asyncio.create_task(http.get(f"/n/{n}")))
            queued = n + 1  # this one queued before the next is sent
            await wait_for(lambda: gate.waiting == queued, interval=0.001,  # noqa: B023 (awaited here)
                           describe=lambda: gate.waiting)
        release.set()
        answers = await asyncio.gather(first, *waiting)
    assert all(a.status_code == 200 for a in answers)
    assert served == list(range(8))
