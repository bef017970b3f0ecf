"""Completions that carry follow-ups or a result, on a real store (PostgreSQL and an SQLite file):
those that end at once are written together, in one transaction, with what each would write alone;
one whose follow-up the publish refuses holds back none of the others."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from fastapi_workqueue import PublishRequest, PublishResult, WorkMessage
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


class FourAtOnce:
    """A queue (four at a time) whose handler holds the first four deliveries until all four run,
    then completes each with a follow-up message to the topic, or, for the first one published, to
    ``first_to`` when given; the follow-ups' payloads are recorded as they run."""

    def __init__(self, database_url: str, *, first_to: str | None = None) -> None:
        self.queue, self.topic, self.subs = make_queue(database_url, [{"role": "a", "lease_seconds": 60}],
                                                       concurrency=4, auto_migrate=True)
        self.started, self.gate, self.followed = asyncio.Event(), asyncio.Event(), list[str]()
        running = [0]

        @self.queue.handler("a")
        async def handle(message: WorkMessage[str]) -> Complete | None:
            if message.payload.startswith("next"):
                self.followed.append(message.payload)
                return None
            running[0] += 1
            if running[0] == 4:
                self.started.set()
            await self.gate.wait()  # the four end at once: their settles meet in one batch
            # The first one published ends first, so it comes first when each is written on its own.
            target = first_to if first_to is not None and message.payload == "0" else self.topic
            return Complete(then=(FollowUp(target, [prepare(PublishRequest(payload=f"next {message.payload}"))]),))

    async def run_four(self) -> list[PublishResult]:
        """Publishes the four, waits until all run, and lets them end."""
        published = await self.queue.publish(self.topic, [PublishRequest(payload=str(i)) for i in range(4)])
        await wait_for(self.started.is_set)
        self.gate.set()
        return list(published)

    async def statuses(self, published: list[PublishResult]) -> list[str]:
        return [(await delivery_status(self.queue, self.subs["a"], r.message_id)).status for r in published]


async def test_completions_ending_at_once_are_written_together_with_their_follow_ups(database_url: str) -> None:
    four = FourAtOnce(database_url)
    async with four.queue.lifespan(None):
        watch = SettleTogetherWatch(four.queue.transport)
        published = await four.run_four()
        await wait_for(lambda: len(four.followed) == 4, within=30)
        assert sorted(four.followed) == ["next 0", "next 1", "next 2", "next 3"]
        assert await four.statuses(published) == ["Completed"] * 4
    assert (4, ["Completed"] * 4) in watch.calls, watch.calls


async def test_a_refused_follow_up_holds_back_none_of_the_completions_ending_with_it(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    nowhere = unique("no-such-topic")
    four = FourAtOnce(database_url, first_to=nowhere)
    caplog.set_level(logging.ERROR, logger="fastapi_workqueue.settler")
    async with four.queue.lifespan(None):
        watch = SettleTogetherWatch(four.queue.transport)
        published = await four.run_four()
        await wait_for(lambda: len(four.followed) == 3, within=30)
        assert sorted(four.followed) == ["next 1", "next 2", "next 3"]
        # The refused one stays InFlight under its lease (it runs again once the lease runs out).
        assert await four.statuses(published) == ["InFlight", "Completed", "Completed", "Completed"]
    assert (4, None) in watch.calls, watch.calls
    [line] = [r.getMessage() for r in caplog.records if "settle failed" in r.getMessage()]
    assert line.startswith("settle failed for 1 delivery") and nowhere in line, line


async def test_a_stops_deadline_is_that_stops_only(database_url: str) -> None:
    """A settler started again after a stop (a host's second start) writes its settles: the first
    stop's deadline for giving up no longer holds."""
    import time

    from fastapi_workqueue import PublishRequest, Subscription, Topic
    from fastapi_workqueue.core.envelope import prepare
    from fastapi_workqueue.core.settler import Settler
    from fastapi_workqueue.core.transport import Settlement
    from fastapi_workqueue.database import create_database_transport

    from .conftest import unique

    transport = create_database_transport(database_url)
    await transport.open()
    try:
        await transport.migrate()
        topic, name = unique("deadline"), unique("deadline-sub")
        await transport.sync_topology([Topic(name=topic)], [Subscription(name=name, topic=topic, handler_key="h")])
        await transport.publish(topic, [prepare(PublishRequest(payload=1))])
        [claimed] = await transport.claim(name, 1)
        settler = Settler(transport)
        settler.start()
        settler.give_up_by(time.monotonic() + 0.05)  # what a host's stop does
        await settler.close()
        await asyncio.sleep(0.1)  # that deadline has passed
        settler.start()
        results: list[object] = []
        settler.submit(Settlement(claimed.delivery_id, claimed.lease_token, "Complete"),
                       lambda settlement, result: results.append(result))
        await settler.flush()
        await settler.close()
        assert results == ["Completed"]
    finally:
        await transport.close()
