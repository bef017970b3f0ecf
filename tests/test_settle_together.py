"""Completions that carry follow-ups or a result, on a real store (PostgreSQL and an SQLite file):
those that end at once are written together, in one transaction, with what each would write alone;
one whose follow-up the publish refuses holds back none of the others."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from fastapi_workqueue import PublishRequest, WorkMessage
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.outcomes import Complete, FollowUp
from fastapi_workqueue.core.transport import Settlement, SettleResult

from .conftest import unique
from .support import delivery_status, make_queue, wait_for

pytestmark = pytest.mark.timeout(90)


class SettleTogetherWatch:
    """Records what the transport's ``settle_together`` was given and answered (it wraps the
    transport's own method; the store under test is the real one)."""

    def __init__(self, transport: Any) -> None:
        self.calls: list[tuple[int, list[SettleResult] | None]] = []
        settle_together = transport.settle_together

        async def watched(settlements: list[Settlement]) -> list[SettleResult] | None:
            answers: list[SettleResult] | None = await settle_together(settlements)
            self.calls.append((len(settlements), answers))
            return answers

        transport.settle_together = watched


async def test_completions_ending_at_once_are_written_together_with_their_follow_ups(database_url: str) -> None:
    queue, topic, subs = make_queue(database_url, [{"role": "a"}], concurrency=4, auto_migrate=True)
    started, gate, followed = asyncio.Event(), asyncio.Event(), []
    running = [0]

    @queue.handler("a")
    async def handle(message: WorkMessage[str]) -> Complete | None:
        if message.payload.startswith("next"):
            followed.append(message.payload)
            return None
        running[0] += 1
        if running[0] == 4:
            started.set()
        await gate.wait()  # the four end at once: their settles meet in one batch
        return Complete(then=(FollowUp(topic, [prepare(PublishRequest(payload=f"next {message.payload}"))]),))

    async with queue.lifespan(None):
        watch = SettleTogetherWatch(queue.transport)
        published = await queue.publish(topic, [PublishRequest(payload=str(i)) for i in range(4)])
        await wait_for(started.is_set)
        gate.set()
        await wait_for(lambda: len(followed) == 4, within=30)
        assert sorted(followed) == ["next 0", "next 1", "next 2", "next 3"]
        for result in published:
            assert (await delivery_status(queue, subs["a"], result.message_id)).status == "Completed"
    assert (4, ["Completed"] * 4) in watch.calls, watch.calls


async def test_a_refused_follow_up_holds_back_none_of_the_completions_ending_with_it(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue, topic, subs = make_queue(database_url, [{"role": "a", "lease_seconds": 60}], concurrency=4,
                                    auto_migrate=True)
    started, gate, followed = asyncio.Event(), asyncio.Event(), []
    running = [0]
    nowhere = unique("no-such-topic")

    @queue.handler("a")
    async def handle(message: WorkMessage[str]) -> Complete | None:
        if message.payload.startswith("next"):
            followed.append(message.payload)
            return None
        running[0] += 1
        if running[0] == 4:
            started.set()
        await gate.wait()
        # The first one published ends first, so it comes first when each is written on its own.
        target = nowhere if message.payload == "0" else topic
        return Complete(then=(FollowUp(target, [prepare(PublishRequest(payload=f"next {message.payload}"))]),))

    caplog.set_level(logging.ERROR, logger="fastapi_workqueue.settler")
    async with queue.lifespan(None):
        watch = SettleTogetherWatch(queue.transport)
        published = await queue.publish(topic, [PublishRequest(payload=str(i)) for i in range(4)])
        await wait_for(started.is_set)
        gate.set()
        await wait_for(lambda: len(followed) == 3, within=30)
        assert sorted(followed) == ["next 1", "next 2", "next 3"]
        statuses = [(await delivery_status(queue, subs["a"], r.message_id)).status for r in published]
        # The refused one stays InFlight under its lease (it runs again once the lease runs out).
        assert statuses == ["InFlight", "Completed", "Completed", "Completed"]
    assert (4, None) in watch.calls, watch.calls
    [line] = [r.getMessage() for r in caplog.records if "settle failed" in r.getMessage()]
    assert line.startswith("settle failed for 1 delivery") and nowhere in line, line
