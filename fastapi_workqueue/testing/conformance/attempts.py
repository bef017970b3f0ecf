"""Attempt history: an attempt off the happy path (a retry or dead-letter settle, a lease expiry,
a replay) is kept, oldest first, at most 50 a delivery, and removed with its delivery; a delivery
claimed and completed keeps none."""

from __future__ import annotations

import pytest

from fastapi_workqueue.core.attempts import ATTEMPTS_KEPT, AttemptHistoryReader
from fastapi_workqueue.core.envelope import PublishRequest
from fastapi_workqueue.core.ports import Ports
from fastapi_workqueue.core.processes import current_process

from .harness import Harness, make_world


def reader(harness: Harness) -> AttemptHistoryReader:
    found = Ports.of(harness.transport).attempts
    if found is None:
        pytest.skip(f"{harness.name}: the transport keeps no attempt history")
    return found


async def test_the_happy_path_keeps_no_attempt(harness: Harness) -> None:
    attempts = reader(harness)
    world = await make_world(harness.transport, [{"role": "a"}])
    await world.publish(PublishRequest(payload=1))
    delivery = await world.claim_one("a")
    assert await world.settle(delivery, "Complete") == "Completed"
    assert await attempts.delivery_attempts(delivery.delivery_id) == []
    assert await attempts.delivery_attempts("999999999") == []
    assert await attempts.delivery_attempts("not-an-id") == []


async def test_failures_a_lease_expiry_and_a_replay_are_kept_in_order(harness: Harness) -> None:
    attempts = reader(harness)
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 3, "backoff_base_seconds": 0,
                                                  "backoff_max_seconds": 0}])
    await world.publish(PublishRequest(payload=1))
    first = await world.claim_one("a")
    assert await world.settle(first, "Fail", error="ValueError: boom 1", delay_seconds=0) == "Pending"
    second = await world.claim_one("a")
    await harness.expire_lease(second.delivery_id)
    await harness.transport.sweep()
    third = await world.claim_one("a")
    assert await world.settle(third, "Fail", error="ValueError: boom 3") == "DeadLettered"
    assert (await harness.transport.replay(world["a"], first.delivery_id, "fixed in 1.2.3")).result == "Replayed"
    again = await world.claim_one("a")
    assert await world.settle(again, "Complete") == "Completed"

    kept = await attempts.delivery_attempts(first.delivery_id)
    assert [(a.attempt, a.outcome) for a in kept] == [
        (1, "Failed"), (2, "LeaseExpired"), (3, "DeadLettered"), (3, "Replayed")]
    assert kept[0].error == "ValueError: boom 1" and kept[2].error == "ValueError: boom 3"
    assert kept[1].error is not None and "lease expired" in kept[1].error
    assert kept[2].reason is not None and kept[2].reason.startswith("max attempts reached")
    assert kept[3].reason == "fixed in 1.2.3" and kept[3].holder is None and kept[3].started_at is None
    for attempt in kept[:3]:
        assert attempt.started_at is not None and attempt.started_at <= attempt.ended_at
        assert attempt.holder is not None and attempt.holder.process_id == current_process().id


async def test_at_most_50_attempts_are_kept_and_they_go_with_the_delivery(harness: Harness) -> None:
    attempts = reader(harness)
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 100, "backoff_base_seconds": 0,
                                                  "backoff_max_seconds": 0}])
    await world.publish(PublishRequest(payload=1))
    for n in range(ATTEMPTS_KEPT + 3):
        delivery = await world.claim_one("a")
        assert await world.settle(delivery, "Fail", error=f"boom {n + 1}", delay_seconds=0) == "Pending"
    kept = await attempts.delivery_attempts(delivery.delivery_id)
    assert len(kept) == ATTEMPTS_KEPT
    assert [a.attempt for a in kept] == list(range(4, ATTEMPTS_KEPT + 4))
    delivery = await world.claim_one("a")
    assert await world.settle(delivery, "Complete") == "Completed"
    assert await harness.transport.prune(0) >= 1
    assert await attempts.delivery_attempts(delivery.delivery_id) == []
