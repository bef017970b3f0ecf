"""Wake-ups coalesce: a NOTIFY heard by every process does not cost every consumer a claim."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

from fastapi_workqueue import (
    Outcome,
    PublishRequest,
    SubscriptionPlan,
    WorkMessage,
    WorkOutcome,
    WorkQueue,
    WorkQueueSettings,
)

from .support import FAST, make_queue, wait_for

pytestmark = pytest.mark.timeout(60)

QUIET_POLLS: dict[str, Any] = {"idle_poll_min_ms": 5000, "idle_poll_max_ms": 5000}
"""Idle polls far apart, so every claim in these tests is one a wake-up asked for."""


async def test_wake_ups_during_empty_claims_back_off_and_work_is_still_taken(
    pg_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "idle"}], concurrency=2, **QUIET_POLLS)
    done: list[int] = []

    @queue.handler("idle")
    async def idle(message: WorkMessage[int]) -> WorkOutcome:
        done.append(message.payload)
        return Outcome.complete()

    async with queue.lifespan(None):
        assert queue.host is not None
        consumer = queue.host.consumers[subs["idle"]]
        real_claim = consumer.transport.claim
        loop = asyncio.get_running_loop()
        claimed_at: list[float] = []

        async def claim_while_notified(subscription: str, limit: int, *args: Any, **kwargs: Any) -> Any:
            claimed_at.append(loop.time())
            consumer.wake()  # a NOTIFY arrives during every claim: the worst case
            return await real_claim(subscription, limit, *args, **kwargs)

        monkeypatch.setattr(consumer.transport, "claim", claim_while_notified)
        consumer.wake()
        await wait_for(lambda: consumer.empty_wake_claims >= 5)
        # the pauses between wake-up claims that found nothing: 10 ms doubling (each at least that)
        first = len(claimed_at) - 5
        assert claimed_at[-1] - claimed_at[first] >= 0.9 * (0.01 + 0.02 + 0.04 + 0.08)

        await queue.publish(topic, [PublishRequest(payload=7)])
        await wait_for(lambda: done == [7], within=5)


COALESCING = {**QUIET_POLLS, "wake_backoff_ms": 2000}
"""The pause after empty wake-up claims may grow to 2 s: above the slowest publish cycle (publish,
NOTIFY, claim, handle, settle) a busy machine gives this test. A cycle longer than the pause is a
quiet spell, after which a wake-up claims at once by design; with the 100 ms default the count below
would measure the machine's speed instead of the back-off."""


async def test_two_processes_hearing_every_publish_do_not_both_claim_each_time(pg_url: str) -> None:
    first, topic, subs = make_queue(pg_url, [{"role": "orders"}], concurrency=4, **COALESCING)
    settings = WorkQueueSettings(
        database_url=pg_url,
        subscriptions=[SubscriptionPlan(name=subs["orders"], concurrency=4)],
        **{**FAST, **COALESCING},
    )
    second = WorkQueue(settings, topics=list(first.topics.values()),
                       subscriptions=list(first.subscriptions.values()))
    handled: list[int] = []
    for queue in (first, second):

        @queue.handler("orders")
        async def orders(message: WorkMessage[int]) -> WorkOutcome:
            handled.append(message.payload)
            return Outcome.complete()

    publishes = 30

    def handled_all(n: int) -> bool:
        return len(handled) == n

    async with first.lifespan(None), second.lifespan(None):
        consumers = [q.host.consumers[subs["orders"]] for q in (first, second) if q.host is not None]
        assert len(consumers) == 2
        for i in range(publishes):
            await first.publish(topic, [PublishRequest(payload=i)])
            await wait_for(functools.partial(handled_all, i + 1), within=5, interval=0.002)
        empty = sum(c.empty_wake_claims for c in consumers)
    assert sorted(handled) == list(range(publishes))
    # without the back-off, the process that loses the race claims in vain at every publish
    assert empty < publishes * 0.6, empty
