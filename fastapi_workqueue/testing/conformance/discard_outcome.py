"""Conformance C18b: the Discard outcome of settle (a job that is no longer wanted).

The delivery becomes Discarded with its reason, is never retried, frees its key as a completion
does, and counts as Discarded in stats; a cancel-requested delivery ends as it did before.
"""

from __future__ import annotations

from fastapi_workqueue.core.envelope import PublishRequest
from fastapi_workqueue.core.transport import Settlement

from .harness import Harness, cancel_refused, make_world


async def test_c18b_discard_ends_the_delivery_with_its_reason_and_never_retries(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 5, "lease_seconds": 30}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    assert await world.settle(delivery, "Discard", reason="the invoice was paid meanwhile") == "Discarded"
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "Discarded" and info.attempt == 1
    assert info.reason == "the invoice was paid meanwhile" and info.settled_at is not None
    # Neither a sweep nor the passing of any backoff brings it back.
    await harness.advance(delivery.delivery_id, 3600)
    await harness.transport.sweep()
    assert await world.claim("a") == []
    [stats] = await harness.transport.stats(world["a"])
    assert (stats.pending, stats.in_flight, stats.dead_lettered) == (0, 0, 0)
    if harness.transport.capabilities.terminal_counts:  # SQS counts no deleted message
        assert (stats.discarded, stats.completed) == (1, 0)


async def test_c18b_discard_frees_an_exclusive_key(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "x", "partition_mode": "Exclusive"}])
    results = await world.publish(*[PublishRequest(partition_key="k", payload=i) for i in range(2)])
    first = await world.claim_one("x")
    assert await world.claim("x") == []
    assert await world.settle(first, "Discard", reason="not wanted") == "Discarded"
    second = await world.claim_one("x")
    assert second.message_id == results[1].message_id


async def test_c18b_a_discarded_ordered_head_unblocks_its_key(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "o", "partition_mode": "Ordered"}])
    results = await world.publish(*[PublishRequest(partition_key="k", payload=i) for i in range(3)])
    head = await world.claim_one("o")
    assert head.message_id == results[0].message_id
    assert await world.claim("o") == []
    assert await world.settle(head, "Discard", reason="superseded") == "Discarded"
    done = await world.drain("o")
    assert [d.message_id for d in done] == [r.message_id for r in results[1:]]
    assert await harness.transport.partitions(world["o"]) == []


async def test_c18b_a_cancel_requested_delivery_keeps_the_operators_reason(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    if await cancel_refused(harness, world, "a", delivery, "cancelled by the operator"):
        # No cancel (SQS): the handler's own Discard stands, with its reason.
        assert await world.settle(delivery, "Discard", reason="the handler's own") == "Discarded"
        info = await harness.transport.get_delivery(delivery.delivery_id)
        assert info is not None and info.status == "Discarded" and info.reason == "the handler's own"
        return
    cancel = await harness.transport.discard(world["a"], delivery.delivery_id, "cancelled by the operator")
    assert cancel.result == "CancelRequested"
    assert await world.settle(delivery, "Discard", reason="the handler's own") == "Discarded"
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "Discarded" and info.reason == "cancelled by the operator"
    [stats] = await harness.transport.stats(world["a"])
    assert stats.discarded == 1


async def test_c18b_discard_with_a_stale_token_changes_nothing(harness: Harness) -> None:
    world = await make_world(
        harness.transport, [{"role": "a", "lease_seconds": 30, "backoff_base_seconds": 0, "backoff_max_seconds": 0}]
    )
    await world.publish_one(payload=1)
    first = await world.claim_one("a")
    await harness.expire_lease(first.delivery_id)
    await harness.transport.sweep()
    second = await world.claim_one("a")
    assert await world.settle(first, "Discard", reason="too late") == "LeaseLost"
    info = await harness.transport.get_delivery(second.delivery_id)
    assert info is not None and info.status == "InFlight" and info.attempt == 2
    assert await world.settle(second, "Complete") == "Completed"


async def test_c18b_a_batch_counts_discards_and_completions_apart(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    await world.publish(*[PublishRequest(payload=i) for i in range(5)])
    claimed = await world.claim("a", 5)
    kinds = ["Discard", "Complete", "Discard", "Complete", "Discard"]
    results = await harness.transport.settle(
        [Settlement(c.delivery_id, c.lease_token, kind, reason="r") for c, kind in zip(claimed, kinds, strict=True)]  # type: ignore[arg-type]
    )
    assert results == ["Discarded", "Completed", "Discarded", "Completed", "Discarded"]
    [stats] = await harness.transport.stats(world["a"])
    assert (stats.pending, stats.in_flight) == (0, 0)
    if harness.transport.capabilities.terminal_counts:  # SQS counts no deleted message
        assert (stats.discarded, stats.completed) == (3, 2)
