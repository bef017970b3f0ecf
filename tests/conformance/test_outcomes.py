"""Conformance C14–C18: outcomes."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from fastapi_workqueue import PublishRequest

from .harness import Harness, make_world

pytestmark = pytest.mark.timeout(60)


async def test_c14_complete_is_never_delivered_again(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "lease_seconds": 30}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    assert await world.settle(delivery) == "Completed"
    await harness.advance(delivery.delivery_id, 60)  # past the lease it had and any retry delay
    await harness.transport.sweep()
    assert await world.claim("a") == []
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "Completed" and info.settled_at is not None


async def test_c15_retry_with_delay_is_invisible_until_the_delay_passes(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    assert await world.settle(delivery, "Retry", reason="rate limited", delay_seconds=30) == "Pending"
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "Pending" and info.attempt == 1 and info.reason == "rate limited"
    assert await world.claim("a") == []
    await harness.advance(delivery.delivery_id, 25)
    assert await world.claim("a") == []
    await harness.advance(delivery.delivery_id, 6)
    again = await world.claim_one("a")
    assert again.attempt == 2


async def test_c16_retry_without_delay_uses_full_jitter_backoff(harness: Harness) -> None:
    world = await make_world(
        harness.transport, [{"role": "a", "backoff_base_seconds": 10, "backoff_max_seconds": 25, "max_attempts": 10}]
    )
    await world.publish(*[PublishRequest(payload=i) for i in range(12)])
    claimed = await world.claim("a", 20)
    delays = []
    for delivery in claimed:
        before = datetime.now(UTC)
        assert await world.settle(delivery, "Fail", error="boom") == "Pending"
        info = await harness.transport.get_delivery(delivery.delivery_id)
        assert info is not None and info.visible_at is not None
        delays.append((info.visible_at - before).total_seconds())
    # attempt 1: uniform(0, min(25, 10 * 2^0)) = [0, 10]
    assert all(-0.5 <= d <= 10.5 for d in delays), delays
    assert len({round(d, 1) for d in delays}) > 3, "backoff has no jitter"
    assert await world.claim("a", 20) == []


async def test_c16_backoff_grows_and_is_capped(harness: Harness) -> None:
    world = await make_world(
        harness.transport,
        [{"role": "a", "backoff_base_seconds": 0.01, "backoff_max_seconds": 0.02, "max_attempts": 20}],
    )
    await world.publish_one(payload=1)
    for _ in range(6):
        delivery = None
        for _ in range(50):
            got = await world.claim("a", 1)
            if got:
                delivery = got[0]
                break
            await asyncio.sleep(0.01)
        assert delivery is not None
        before = datetime.now(UTC)
        await world.settle(delivery, "Fail", error="boom")
        info = await harness.transport.get_delivery(delivery.delivery_id)
        assert info is not None and info.visible_at is not None
        assert (info.visible_at - before).total_seconds() <= 0.02 + 0.5


async def test_c17_failure_on_last_attempt_dead_letters_with_reason_and_error(harness: Harness) -> None:
    world = await make_world(
        harness.transport, [{"role": "a", "max_attempts": 2, "backoff_base_seconds": 0, "backoff_max_seconds": 0}]
    )
    await world.publish_one(payload=1)
    first = await world.claim_one("a")
    assert await world.settle(first, "Fail", reason="ValueError", error="ValueError: first") == "Pending"
    second = await world.claim_one("a")
    assert second.attempt == 2
    assert await world.settle(second, "Fail", reason="ValueError", error="ValueError: second") == "DeadLettered"
    info = await harness.transport.get_delivery(second.delivery_id)
    assert info is not None and info.status == "DeadLettered"
    assert info.last_error == "ValueError: second"
    assert "ValueError" in (info.reason or "")
    assert await world.claim("a") == []


async def test_c17_explicit_retry_on_last_attempt_dead_letters(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 1}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    assert await world.settle(delivery, "Retry", reason="upstream down", delay_seconds=0) == "DeadLettered"
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and "upstream down" in (info.reason or "")


async def test_c18_dead_letter_outcome_dead_letters_at_once(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 5}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    assert await world.settle(delivery, "DeadLetter", reason="poison input") == "DeadLettered"
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "DeadLettered" and info.attempt == 1
    assert info.reason == "poison input"


async def test_publish_policy_overrides_are_kept_on_the_delivery(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 5}])
    await world.publish(PublishRequest(payload=1, max_attempts=2, backoff_seconds=[30, 60]))
    first = await world.claim_one("a")
    assert first.max_attempts == 2
    before = datetime.now(UTC)
    assert await world.settle(first, "Fail", error="x") == "Pending"
    info = await harness.transport.get_delivery(first.delivery_id)
    assert info is not None and info.visible_at is not None
    # The first step of the published schedule, not the subscription's backoff (at most 1 s).
    assert 29.9 <= (info.visible_at - before).total_seconds() <= 45
    assert await world.claim("a") == []
    await harness.advance(first.delivery_id, 31)
    second = await world.claim_one("a")
    assert await world.settle(second, "Fail", error="x") == "DeadLettered"


async def test_publish_delay_and_not_before_hold_the_message_back(harness: Harness) -> None:
    from datetime import timedelta

    world = await make_world(harness.transport, [{"role": "a"}])
    for request in (PublishRequest(payload="later", delay_seconds=30),
                    PublishRequest(payload="at", not_before=datetime.now(UTC) + timedelta(seconds=30))):
        await world.publish(request)
        assert await world.claim("a") == []
        [held] = await harness.transport.list_deliveries(world["a"], "Pending")
        await harness.advance(held.delivery_id, 25)
        assert await world.claim("a") == []
        await harness.advance(held.delivery_id, 6)
        [claimed] = await world.claim("a")
        assert claimed.delivery_id == held.delivery_id
        await world.settle(claimed)
