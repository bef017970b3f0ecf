"""claim_many: one claim across several None-mode subscriptions (a worker of several job queues),
the oldest due delivery first whatever its subscription, each leased with its own subscription's
lease."""

from __future__ import annotations

import pytest

from fastapi_workqueue.core.envelope import PublishRequest

from .harness import Harness, World, make_world


async def two_queues(harness: Harness) -> tuple[World, World]:
    """Two topics with a None-mode subscription each, leases of 30 s and 90 s."""
    mail = await make_world(harness.transport, [{"role": "q", "lease_seconds": 30}])
    reports = await make_world(harness.transport, [{"role": "q", "lease_seconds": 90}])
    return mail, reports


async def test_the_oldest_due_delivery_comes_first_across_subscriptions(harness: Harness) -> None:
    mail, reports = await two_queues(harness)
    # Due in 10, 20, 30 and 40 s: r0, m0, r1, m1, whatever the order they were published in.
    m = await mail.publish(*[PublishRequest(payload=f"m{i}", delay_seconds=20 * i + 20) for i in range(2)])
    r = await reports.publish(*[PublishRequest(payload=f"r{i}", delay_seconds=20 * i + 10) for i in range(2)])
    names = [mail["q"], reports["q"]]
    assert await harness.transport.claim_many(names, 3) == []
    [waiting, *_] = await harness.transport.list_deliveries(mail["q"], "Pending")
    await harness.advance(waiting.delivery_id, 41)

    first = await harness.transport.claim_many(names, 3)
    assert [(name, d.message_id) for name, d in first] == [
        (reports["q"], r[0].message_id), (mail["q"], m[0].message_id), (reports["q"], r[1].message_id)]
    rest = await harness.transport.claim_many(names, 3)
    assert [(name, d.message_id) for name, d in rest] == [(mail["q"], m[1].message_id)]
    assert await harness.transport.claim_many(names, 3) == []
    for _, delivery in [*first, *rest]:
        assert delivery.attempt == 1 and delivery.lease_token
        assert await mail.settle(delivery) == "Completed"


async def test_each_delivery_is_leased_for_its_own_subscription(harness: Harness) -> None:
    mail, reports = await two_queues(harness)
    await mail.publish_one(payload="m")
    await reports.publish_one(payload="r")
    claimed = dict(await harness.transport.claim_many([mail["q"], reports["q"]], 10))
    assert set(claimed) == {mail["q"], reports["q"]}
    for name, lease in ((mail["q"], 30), (reports["q"], 90)):
        info = await harness.transport.get_delivery(claimed[name].delivery_id)
        assert info is not None and info.status == "InFlight" and info.subscription == name
        assert info.lease_expires_at == claimed[name].lease_expires_at
        assert info.claimed_at is not None and info.lease_expires_at is not None
        assert (info.lease_expires_at - info.claimed_at).total_seconds() == pytest.approx(lease, abs=1e-3)
    # The lease fences as a claim's does: the token settles, and only once.
    delivery = claimed[reports["q"]]
    assert await reports.settle(delivery) == "Completed"
    assert await reports.settle(delivery) == "LeaseLost"


async def test_the_limit_holds_and_invisible_work_waits(harness: Harness) -> None:
    mail, reports = await two_queues(harness)
    await mail.publish(*[PublishRequest(payload=i) for i in range(4)])
    await reports.publish(*[PublishRequest(payload=i) for i in range(4)])
    await reports.publish(PublishRequest(payload="later", delay_seconds=60))
    names = [mail["q"], reports["q"]]
    assert len(await harness.transport.claim_many(names, 5)) == 5
    assert len(await harness.transport.claim_many(names, 5)) == 3
    assert await harness.transport.claim_many(names, 5) == []
    assert await harness.transport.claim_many(names, 0) == []
    assert await harness.transport.claim_many([], 5) == []


async def test_paused_and_unknown_subscriptions_give_nothing(harness: Harness) -> None:
    mail, reports = await two_queues(harness)
    await mail.publish_one(payload="m")
    await reports.publish_one(payload="r")
    names = [mail["q"], reports["q"], "no-such-subscription"]
    assert await harness.transport.set_subscription_status(reports["q"], "Paused") is True
    assert [name for name, _ in await harness.transport.claim_many(names, 10)] == [mail["q"]]
    assert await harness.transport.claim_many(names, 10) == []
    assert await harness.transport.set_subscription_status(reports["q"], "Active") is True
    assert [name for name, _ in await harness.transport.claim_many(names, 10)] == [reports["q"]]


async def test_exclusive_and_ordered_subscriptions_are_refused(harness: Harness) -> None:
    mail, _ = await two_queues(harness)
    await mail.publish_one(payload="m")
    # Ordered where the transport has it (SQS has no Ordered: the Exclusive subscription is refused alone).
    modes = [("x", "Exclusive"), *([("o", "Ordered")] if harness.transport.capabilities.ordered else [])]
    keyed = await make_world(harness.transport, [{"role": role, "partition_mode": mode} for role, mode in modes])
    for role, mode in modes:
        with pytest.raises(ValueError, match="claim_many takes None-mode subscriptions only") as refused:
            await harness.transport.claim_many([mail["q"], keyed[role]], 10)
        assert f"{keyed[role]} is {mode}" in str(refused.value)
    # Nothing was claimed by the refused calls.
    assert len(await harness.transport.claim_many([mail["q"]], 10)) == 1
    with pytest.raises(TypeError, match="sequence of subscription names"):
        await harness.transport.claim_many(mail["q"], 10)
