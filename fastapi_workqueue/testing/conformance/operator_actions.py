"""Conformance C25–C30: operator actions."""

from __future__ import annotations

import pytest

from fastapi_workqueue.core.envelope import PublishRequest
from fastapi_workqueue.core.errors import ActionRefused
from fastapi_workqueue.core.transport import HeartbeatRequest

from ...core.ports import Ports
from .harness import Harness, cancel_refused, make_world


async def test_c25_replay_dead_letter_keeps_message_id_resets_attempts_keeps_note(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 1}])
    [published] = await world.publish(PublishRequest(payload=1))
    delivery = await world.claim_one("a")
    await world.settle(delivery, "Fail", error="boom")
    [dead] = await harness.transport.list_deliveries(world["a"], "DeadLettered")
    assert dead.delivery_id == delivery.delivery_id and dead.last_error == "boom"

    result = await harness.transport.replay(world["a"], delivery.delivery_id, "deployed fix 1.2.3")
    assert result.ok and result.result == "Replayed" and result.status == "Pending"
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "Pending" and info.attempt == 0
    assert info.note == "deployed fix 1.2.3" and info.message_id == published.message_id
    again = await world.claim_one("a")
    assert again.message_id == published.message_id and again.attempt == 1

    # Only dead letters can be replayed.
    assert (await harness.transport.replay(world["a"], again.delivery_id, None)).result == "NotDeadLettered"
    assert (await harness.transport.replay(world["a"], "999999999", None)).result == "NotFound"


async def test_c25_a_delivery_id_is_read_only_as_the_listings_write_it(harness: Harness) -> None:
    """An id written another way (a leading zero, a sign, a blank) names no delivery: reading or
    acting on it answers not found, never the delivery whose number it parses to."""
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 1}])
    await world.publish(PublishRequest(payload=1))
    delivery = await world.claim_one("a")
    await world.settle(delivery, "Fail", error="boom")
    for other in (f"0{delivery.delivery_id}", f"+{delivery.delivery_id}", f" {delivery.delivery_id}"):
        assert await harness.transport.get_delivery(other) is None, other
        assert (await harness.transport.replay(world["a"], other, None)).result == "NotFound", other
        assert (await harness.transport.discard(world["a"], other, None)).result == "NotFound", other
    [dead] = await harness.transport.list_deliveries(world["a"], "DeadLettered")
    assert dead.delivery_id == delivery.delivery_id


async def test_c26_discard_pending_or_dead_lettered_keeps_reason(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 1}])
    await world.publish(PublishRequest(payload=1), PublishRequest(payload=2))
    dead = await world.claim_one("a")
    await world.settle(dead, "DeadLetter", reason="poison")
    pending_info = (await harness.transport.list_deliveries(world["a"], "Pending"))[0]

    for delivery_id in (dead.delivery_id, pending_info.delivery_id):
        result = await harness.transport.discard(world["a"], delivery_id, "operator skip")
        assert result.result == "Discarded" and not result.cancel_requested
        info = await harness.transport.get_delivery(delivery_id)
        assert info is not None and info.status == "Discarded" and info.reason == "operator skip"
    assert await world.claim("a") == []
    assert (await harness.transport.discard(world["a"], dead.delivery_id, "again")).result == "AlreadyTerminal"


@pytest.mark.parametrize("outcome", ["Complete", "Retry", "Fail", "DeadLetter", "Release"])
async def test_c27_discard_in_flight_requests_cancel_then_discarded_never_retried(
    harness: Harness, outcome: str
) -> None:
    world = await make_world(
        harness.transport,
        [{"role": "x", "partition_mode": "Exclusive", "backoff_base_seconds": 0, "backoff_max_seconds": 0}],
    )
    await world.publish(PublishRequest(partition_key="k", payload=1), PublishRequest(partition_key="k", payload=2))
    running = await world.claim_one("x")
    if await cancel_refused(harness, world, "x", running, "hung"):
        # No cancel (SQS): the key stays busy and the holder's outcome stands as it would.
        assert await world.claim("x") == []
        settled = await world.settle(running, outcome, reason=f"handler says {outcome}", error="e", delay_seconds=0)
        expected = {"Complete": "Completed", "DeadLetter": "DeadLettered"}.get(outcome, "Pending")
        assert settled == expected
        assert await world.status(running.delivery_id) == expected
        return
    result = await harness.transport.discard(world["x"], running.delivery_id, "hung")
    assert result.result == "CancelRequested" and result.cancel_requested
    # A second cancel answers the same and keeps the first one's reason.
    again = await harness.transport.discard(world["x"], running.delivery_id, "asked again")
    assert again.result == "CancelRequested" and again.cancel_requested
    # A replay, refused, says the delivery's state as a listing does: InFlight, its cancel requested.
    refused = await harness.transport.replay(world["x"], running.delivery_id, None)
    assert (refused.result, refused.status, refused.cancel_requested) == ("NotDeadLettered", "InFlight", True)
    [hb] = await harness.transport.heartbeat([HeartbeatRequest(running.delivery_id, running.lease_token)])
    assert hb.cancel_requested and not hb.alive
    # The heartbeat renews the lease of the handler that winds down: its holder is alive, and lease
    # expiry (the holder's death) would discard it and free its key while the handler still runs.
    await harness.advance(running.delivery_id, 50)  # of its 60 s lease
    before = await harness.transport.get_delivery(running.delivery_id)
    await harness.transport.heartbeat([HeartbeatRequest(running.delivery_id, running.lease_token)])
    after = await harness.transport.get_delivery(running.delivery_id)
    assert before is not None and after is not None and before.lease_expires_at is not None
    assert after.lease_expires_at is not None and after.lease_expires_at > before.lease_expires_at
    await harness.advance(running.delivery_id, 30)  # past the lease it had before the renewal
    assert (await harness.transport.sweep()).ran
    assert await world.status(running.delivery_id) == "InFlight"
    # The key stays busy until the holder returns ...
    assert await world.claim("x") == []
    # ... and whatever it returns, the delivery is Discarded and the key is free.
    settled = await world.settle(running, outcome, reason=f"handler says {outcome}", error="e", delay_seconds=0)
    assert settled == "Discarded"
    info = await harness.transport.get_delivery(running.delivery_id)
    assert info is not None and info.status == "Discarded" and info.reason == "hung"
    nxt = await world.claim_one("x")
    assert nxt.delivery_id != running.delivery_id
    await world.settle(nxt)
    assert await world.claim("x") == []


async def test_c28_cancel_requested_with_dead_holder_is_discarded_at_lease_expiry(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "lease_seconds": 30}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    if await cancel_refused(harness, world, "a", delivery, "stuck"):
        return  # no cancel (SQS): nothing is cancel-requested, so nothing is discarded at the lease's expiry
    assert (await harness.transport.discard(world["a"], delivery.delivery_id, "stuck")).cancel_requested
    # The holder is dead: nothing settles. Until the lease runs out the delivery stays InFlight.
    await harness.advance(delivery.delivery_id, 25)
    assert (await harness.transport.sweep()).ran
    assert await world.status(delivery.delivery_id) == "InFlight"
    await harness.expire_lease(delivery.delivery_id)
    report = await harness.transport.sweep()
    assert report.discarded >= 1
    assert await world.status(delivery.delivery_id) == "Discarded"
    assert await world.claim("a") == []
    attempts = Ports.of(harness.transport).attempts
    if attempts is not None:  # the kept attempt says how it ended, in every store's words
        [kept] = await attempts.delivery_attempts(delivery.delivery_id)
        assert (kept.outcome, kept.error) == ("LeaseExpired", "lease expired: the holder stopped renewing it")


async def test_c29_release_on_shutdown_returns_to_pending_without_consuming_attempt(harness: Harness) -> None:
    # The released delivery is its key's next either way: Ordered, or Exclusive where there is no Ordered (SQS FIFO).
    mode = "Ordered" if harness.transport.capabilities.ordered else "Exclusive"
    world = await make_world(harness.transport, [{"role": "o", "partition_mode": mode}])
    await world.publish(PublishRequest(partition_key="k", payload=1), PublishRequest(partition_key="k", payload=2))
    delivery = await world.claim_one("o")
    assert await world.settle(delivery, "Release", reason="shutdown") == "Pending"
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "Pending" and info.attempt == 0
    again = await world.claim_one("o")
    assert again.delivery_id == delivery.delivery_id and again.attempt == 1


async def test_c30_paused_subscription_accrues_but_is_not_claimed_until_resumed(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    assert await harness.transport.set_subscription_status(world["a"], "Paused") is True
    await world.publish(PublishRequest(payload=1), PublishRequest(payload=2))
    assert await world.claim("a", 10) == []
    [stats] = await harness.transport.stats(world["a"])
    assert stats.pending == 2 and stats.status == "Paused"
    backlog = await harness.transport.backlog(world["a"])
    assert backlog is not None and backlog.claimable == 0
    assert await harness.transport.set_subscription_status(world["a"], "Active") is True
    assert len(await world.claim("a", 10)) == 2
    assert await harness.transport.set_subscription_status("no-such-subscription", "Paused") is None


async def test_c30_a_retired_subscription_is_never_shown_paused(harness: Harness) -> None:
    """Retired and Paused exclude each other: a retired subscription cannot be paused (it would show
    Paused, where deliveries accrue, while it takes none), and a paused one that is retired is
    paused no more: it shows Retired and drains."""
    lifecycle = Ports.of(harness.transport).lifecycle
    if lifecycle is None:
        pytest.skip(f"{harness.name}: subscriptions cannot be retired (TopologyLifecycle)")
    world = await make_world(harness.transport, [{"role": "a"}, {"role": "b"}])
    await world.publish(PublishRequest(payload=1))
    await lifecycle.retire_subscription(world["a"])
    with pytest.raises(ActionRefused, match=r"is retired and cannot be paused.*--discard-pending"):
        await harness.transport.set_subscription_status(world["a"], "Paused")
    [stats] = await harness.transport.stats(world["a"])
    assert stats.status == "Retired" and stats.pending == 1
    # Paused, then retired: no longer paused, it drains what it holds.
    assert await harness.transport.set_subscription_status(world["b"], "Paused") is True
    await lifecycle.retire_subscription(world["b"])
    [stats] = await harness.transport.stats(world["b"])
    assert stats.status == "Retired"
    assert len(await world.claim("b", 10)) == 1
    # Resume takes either back.
    assert await harness.transport.set_subscription_status(world["a"], "Active") is True
    assert await harness.transport.set_subscription_status(world["a"], "Paused") is True


async def test_listings_fill_every_field_a_single_delivery_has(harness: Harness) -> None:
    """list_deliveries answers with every field of get_delivery (topic, visibility, lease, claim
    time, cancel, progress), in every state a listing is asked for."""
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 1}])
    await world.publish(
        PublishRequest(payload=1, partition_key="k", attributes={"kind": "x"}, correlation_id="c-1"),
        PublishRequest(payload=2),
        PublishRequest(payload=3, delay_seconds=60),
    )
    running, failing = await world.claim("a", 2)
    [beat] = await harness.transport.heartbeat(
        [HeartbeatRequest(running.delivery_id, running.lease_token, percent=40, message="half way")])
    assert beat.alive
    assert (await harness.transport.discard(world["a"], running.delivery_id, "stop")).result == "CancelRequested"
    assert await world.settle(failing, "Fail", error="boom") == "DeadLettered"

    listed = 0
    for status in ("InFlight", "DeadLettered", "Pending"):
        rows = await harness.transport.list_deliveries(world["a"], status, include_payload=True)
        assert len(rows) == 1, status
        single = await harness.transport.get_delivery(rows[0].delivery_id, include_payload=True)
        assert single is not None
        assert rows[0].model_dump() == single.model_dump(), status
        listed += 1
    assert listed == 3
    [in_flight] = await harness.transport.list_deliveries(world["a"], "InFlight")
    assert in_flight.topic == world.topic and in_flight.cancel_requested
    assert in_flight.lease_expires_at is not None and in_flight.claimed_at is not None
    assert (in_flight.progress_percent, in_flight.progress_message) == (40, "half way")
    [pending] = await harness.transport.list_deliveries(world["a"], "Pending")
    assert pending.visible_at is not None and pending.claimed_at is None
