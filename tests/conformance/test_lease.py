"""Conformance C09–C13: claim, lease, heartbeat and fencing."""

from __future__ import annotations

import asyncio

import pytest

from fastapi_workqueue import PublishRequest
from fastapi_workqueue.core.transport import HeartbeatRequest, Settlement

from .harness import Harness, make_world

pytestmark = pytest.mark.timeout(60)


async def test_c09_claim_returns_at_most_limit_with_attempt_and_fresh_token(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "backoff_base_seconds": 0, "backoff_max_seconds": 0}])
    await world.publish(*[PublishRequest(payload=i) for i in range(5)])
    first = await world.claim("a", 3)
    assert len(first) == 3
    assert all(c.attempt == 1 for c in first)
    assert len({c.lease_token for c in first}) == 3
    rest = await world.claim("a", 10)
    assert len(rest) == 2
    assert await world.claim("a", 10) == []

    # A retried delivery comes back with attempt + 1 and a new token.
    delivery = first[0]
    assert await world.settle(delivery, "Retry", reason="again", delay_seconds=0) == "Pending"
    [again] = await world.claim("a", 10)
    assert again.delivery_id == delivery.delivery_id
    assert again.attempt == 2
    assert again.lease_token != delivery.lease_token


async def test_c10_heartbeat_renews_lease_and_stores_progress(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "lease_seconds": 0.6}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    for _ in range(4):
        await asyncio.sleep(0.3)
        [hb] = await harness.transport.heartbeat(
            [HeartbeatRequest(delivery.delivery_id, delivery.lease_token, 40, "m" * 500)]
        )
        assert hb.alive and not hb.cancel_requested
    # 1.2 s after the claim, well past the first 0.6 s lease, nothing expired.
    report = await harness.transport.sweep()
    assert report.ran
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "InFlight"
    assert info.progress_percent == 40 and info.progress_message == "m" * 500
    assert await world.settle(delivery) == "Completed"


async def test_c11_stale_token_changes_nothing_and_reports_lease_lost(harness: Harness) -> None:
    world = await make_world(
        harness.transport,
        [{"role": "a", "lease_seconds": 0.2, "backoff_base_seconds": 0, "backoff_max_seconds": 0}],
    )
    await world.publish_one(payload=1)
    old = await world.claim_one("a")
    await asyncio.sleep(0.35)
    await harness.transport.sweep()
    new = await world.claim_one("a")
    assert new.delivery_id == old.delivery_id and new.lease_token != old.lease_token

    [hb] = await harness.transport.heartbeat([HeartbeatRequest(old.delivery_id, old.lease_token)])
    assert not hb.alive
    for kind in ("Complete", "Retry", "Fail", "DeadLetter", "Release"):
        result = await harness.transport.settle([Settlement(old.delivery_id, old.lease_token, kind, reason="x")])  # type: ignore[arg-type]
        assert result == ["LeaseLost"], kind
    info = await harness.transport.get_delivery(new.delivery_id)
    assert info is not None and info.status == "InFlight" and info.attempt == 2
    [hb] = await harness.transport.heartbeat([HeartbeatRequest(new.delivery_id, new.lease_token)])
    assert hb.alive
    assert await world.settle(new) == "Completed"


async def test_c11_forged_token_settle_is_rejected(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    forged = Settlement(delivery.delivery_id, "00000000-0000-4000-8000-000000000000", "Complete")
    assert await harness.transport.settle([forged]) == ["LeaseLost"]
    assert await world.status(delivery.delivery_id) == "InFlight"


async def test_c12_expired_lease_makes_delivery_claimable_with_attempt_counted(harness: Harness) -> None:
    world = await make_world(
        harness.transport,
        [{"role": "a", "lease_seconds": 0.2, "max_attempts": 3, "backoff_base_seconds": 0, "backoff_max_seconds": 0}],
    )
    await world.publish_one(payload=1)
    first = await world.claim_one("a")
    assert await world.claim("a") == []
    await asyncio.sleep(0.35)
    report = await harness.transport.sweep()
    assert report.ran and report.retried >= 1
    info = await harness.transport.get_delivery(first.delivery_id)
    assert info is not None and info.status == "Pending" and info.attempt == 1
    assert info.reason == "lease expired"
    second = await world.claim_one("a")
    assert second.attempt == 2


async def test_c13_lease_expiring_on_final_attempt_dead_letters(harness: Harness) -> None:
    world = await make_world(
        harness.transport,
        [{"role": "a", "lease_seconds": 0.2, "max_attempts": 2, "backoff_base_seconds": 0, "backoff_max_seconds": 0}],
    )
    await world.publish_one(payload=1)
    for attempt in (1, 2):
        delivery = await world.claim_one("a")
        assert delivery.attempt == attempt
        await asyncio.sleep(0.35)
        await harness.transport.sweep()
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "DeadLettered"
    assert "final attempt" in (info.reason or "")
    assert await world.claim("a") == []
