"""Conformance C19–C24: partition modes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fastapi_workqueue.core.envelope import PublishRequest

from .harness import Harness, make_world


async def test_c19_exclusive_one_in_flight_per_key_other_keys_run(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "x", "partition_mode": "Exclusive"}])
    await world.publish(*[PublishRequest(partition_key=k, payload=i) for i, k in enumerate("aabbc")])
    claimed = await world.claim("x", 10)
    assert sorted(c.partition_key or "" for c in claimed) == ["a", "b", "c"]
    assert await world.claim("x", 10) == []
    a = next(c for c in claimed if c.partition_key == "a")
    await world.settle(a)
    [next_a] = await world.claim("x", 10)
    assert next_a.partition_key == "a"
    for delivery in [next_a, *[c for c in claimed if c.partition_key != "a"]]:
        await world.settle(delivery)
    if harness.transport.capabilities.exact_backlog:
        assert [p.partition_key for p in await harness.transport.partitions(world["x"])] == ["b"]
    else:  # no backlog per key (SQS): what is left is b's second message, and then nothing
        assert [c.partition_key for c in await world.claim("x", 10)] == ["b"]
        assert await world.claim("x", 10) == []


async def test_c20_exclusive_delivery_in_backoff_does_not_hold_its_key(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "x", "partition_mode": "Exclusive"}])
    results = await world.publish(
        PublishRequest(partition_key="k", payload=1), PublishRequest(partition_key="k", payload=2)
    )
    first = await world.claim_one("x")
    assert first.message_id == results[0].message_id
    await world.settle(first, "Retry", reason="later", delay_seconds=30)
    if harness.transport.capabilities.retry_keeps_key_busy:
        # SQS FIFO: the retrying message keeps its key; the next one waits until it is done.
        assert await world.claim("x") == []
        await harness.advance(first.delivery_id, 31)
        again = await world.claim_one("x")
        assert again.delivery_id == first.delivery_id and again.attempt == 2
        assert await world.claim("x") == []
        await world.settle(again)
        assert (await world.claim_one("x")).message_id == results[1].message_id
        return
    second = await world.claim_one("x")
    assert second.message_id == results[1].message_id
    assert await world.claim("x") == []
    # Once its delay has passed, the first waits for the key like any other delivery of it.
    await harness.advance(first.delivery_id, 31)
    assert await world.claim("x") == []
    await world.settle(second)
    again = await world.claim_one("x")
    assert again.delivery_id == first.delivery_id and again.attempt == 2


async def test_c21_ordered_only_head_claimable_and_completion_in_publish_order(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "o", "partition_mode": "Ordered"}])
    results = await world.publish(*[PublishRequest(partition_key="k", payload=i) for i in range(5)])
    results += await world.publish(*[PublishRequest(partition_key="k", payload=i) for i in range(5, 8)])
    order = []
    while True:
        claimed = await world.claim("o", 10)
        if not claimed:
            break
        assert len(claimed) == 1, "only the head of an Ordered key may be in flight"
        order.append(claimed[0].message_id)
        await world.settle(claimed[0])
    assert order == [r.message_id for r in results]
    # A key with no live work is not listed.
    assert await harness.transport.partitions(world["o"]) == []


async def test_c22_ordered_head_in_backoff_blocks_key_until_retried_and_completed(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "o", "partition_mode": "Ordered"}])
    results = await world.publish(*[PublishRequest(partition_key="k", payload=i) for i in range(3)])
    await world.publish(PublishRequest(partition_key="other", payload="x"))
    head = (await world.claim("o", 10))
    head_k = next(c for c in head if c.partition_key == "k")
    await world.settle(head_k, "Retry", reason="wait", delay_seconds=30)
    # The key waits for its head; other keys are not affected.
    claimed = await world.claim("o", 10)
    assert all(c.partition_key != "k" for c in claimed)
    for c in claimed:
        await world.settle(c)
    await harness.advance(head_k.delivery_id, 25)
    assert await world.claim("o", 10) == []
    await harness.advance(head_k.delivery_id, 6)
    again = await world.claim_one("o")
    assert again.message_id == results[0].message_id and again.attempt == 2
    assert await world.claim("o") == []
    await world.settle(again)
    rest = await world.drain("o")
    assert [c.message_id for c in rest] == [r.message_id for r in results[1:]]


async def test_c23_ordered_dead_lettered_head_blocks_replay_keeps_position(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "o", "partition_mode": "Ordered"}])
    results = await world.publish(*[PublishRequest(partition_key="k", payload=i) for i in range(3)])
    head = await world.claim_one("o")
    await world.settle(head, "DeadLetter", reason="bad")
    assert await world.claim("o") == []
    blocked = await harness.transport.partitions(world["o"], "Blocked")
    assert [(p.partition_key, p.head_delivery_id, p.waiting_items) for p in blocked] == [("k", head.delivery_id, 2)]

    replayed = await harness.transport.replay(world["o"], head.delivery_id, "fixed the bad data")
    assert replayed.result == "Replayed"
    again = await world.claim_one("o")
    assert again.delivery_id == head.delivery_id and again.message_id == results[0].message_id
    assert again.attempt == 1
    assert await world.claim("o") == []
    await world.settle(again)
    rest = await world.drain("o")
    assert [c.message_id for c in rest] == [r.message_id for r in results[1:]]


async def test_c23_ordered_discarding_dead_lettered_head_unblocks_at_once(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "o", "partition_mode": "Ordered"}])
    results = await world.publish(*[PublishRequest(partition_key="k", payload=i) for i in range(3)])
    head = await world.claim_one("o")
    await world.settle(head, "DeadLetter", reason="bad")
    assert await world.claim("o") == []
    discarded = await harness.transport.discard(world["o"], head.delivery_id, "not needed")
    assert discarded.result == "Discarded"
    rest = await world.drain("o")
    assert [c.message_id for c in rest] == [r.message_id for r in results[1:]]


async def test_c24_none_mode_runs_one_key_in_parallel(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "n"}])
    await world.publish(*[PublishRequest(partition_key="same", payload=i) for i in range(4)])
    claimed = await world.claim("n", 10)
    assert len(claimed) == 4
    assert {c.partition_key for c in claimed} == {"same"}


async def test_keyless_deliveries_on_keyed_subscription_are_not_serialized(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "x", "partition_mode": "Exclusive"}])
    await world.publish(*[PublishRequest(payload=i) for i in range(3)], PublishRequest(partition_key="k", payload=9))
    claimed = await world.claim("x", 10)
    assert len(claimed) == 4


async def test_claim_of_one_takes_the_first_in_claim_order_keyed_or_not(harness: Harness) -> None:
    """A claim of one on a keyed subscription takes whichever delivery comes first in claim order,
    with a key or without: neither side waits for the other's backlog to empty (a consumer of
    concurrency 1 with slow handlers claims one at a time)."""
    if not harness.transport.capabilities.priority:
        pytest.skip(f"{harness.name}: no claim order to keep (no priority, no due time)")
    world = await make_world(harness.transport, [{"role": "x", "partition_mode": "Exclusive"}])
    published = []
    for key in (None, "a", "b", "c", None, "d", None):
        published += await world.publish(PublishRequest(partition_key=key, payload=key))
    drained = await world.drain("x")
    assert [d.message_id for d in drained] == [r.message_id for r in published]


@pytest.mark.parametrize("limits", [{}, {"max_in_flight": 100}, {"rate_limit": "100/s"}],
                         ids=["no-limit", "max_in_flight", "rate_limit"])
@pytest.mark.parametrize("keys_first", [True, False])
async def test_a_claim_on_a_keyed_subscription_shares_its_room(
    harness: Harness, keys_first: bool, limits: dict[str, Any]
) -> None:
    """A claim of several on a keyed subscription gives neither side every slot: with more keys and
    more deliveries without a key ready than it has room for, a claim of 4 takes 2 keys and 2
    without a key, whichever were published first, under a flow limit with room to spare as
    without one (the in-memory transport once took the first 4 in claim order)."""
    caps = harness.transport.capabilities
    if not caps.priority:
        pytest.skip(f"{harness.name}: no claim order to keep (no priority, no due time)")
    if ("max_in_flight" in limits and not caps.concurrency_limits) or ("rate_limit" in limits and not caps.rate_limits):
        pytest.skip(f"{harness.name}: the transport has no such flow limit")
    world = await make_world(harness.transport, [{"role": "x", "partition_mode": "Exclusive", **limits}])
    keyed = [PublishRequest(partition_key=f"k{i}", payload=i) for i in range(6)]
    unkeyed = [PublishRequest(payload=i) for i in range(6)]
    for batch in ((keyed, unkeyed) if keys_first else (unkeyed, keyed)):
        await world.publish(*batch)
    claimed = await world.claim("x", 4)
    assert sorted(d.partition_key is None for d in claimed) == [False, False, True, True], claimed
    # Each side in its own claim order: the first keys, the first deliveries without a key.
    assert sorted(d.partition_key for d in claimed if d.partition_key is not None) == ["k0", "k1"]
    assert sorted(json.loads(d.payload_json or "0") for d in claimed if d.partition_key is None) == [0, 1]


async def test_claim_of_one_on_a_keyed_subscription_follows_priority(harness: Harness) -> None:
    """The same with priorities: the highest first, keyed or not, then the one due earliest."""
    if not harness.transport.capabilities.priority:
        pytest.skip(f"{harness.name}: the transport refuses priorities")
    world = await make_world(harness.transport, [{"role": "o", "partition_mode": "Ordered"}])
    sent = [(None, 0), ("a", 0), ("b", 0), (None, 5), ("c", 3), (None, 3)]
    ids = {}
    for key, priority in sent:
        [result] = await world.publish(PublishRequest(partition_key=key, payload=[key, priority], priority=priority))
        ids[result.message_id] = (key, priority)
    drained = [ids[d.message_id] for d in await world.drain("o")]
    assert drained == [(None, 5), ("c", 3), (None, 3), (None, 0), ("a", 0), ("b", 0)]


@pytest.mark.parametrize("mode", ["Exclusive", "Ordered"])
async def test_claim_of_one_in_one_publish_call_follows_its_order(harness: Harness, mode: str) -> None:
    """The messages of one publish call are due at the same time: claim order is then the order of
    the call (the delivery id), for the keys among themselves as for the deliveries without a key."""
    if not harness.transport.capabilities.priority:
        pytest.skip(f"{harness.name}: no claim order to keep (no priority, no due time)")
    world = await make_world(harness.transport, [{"role": "x", "partition_mode": mode}])
    keys = ["b", None, "a", "c", None]
    published = await world.publish(*[PublishRequest(partition_key=k, payload=k) for k in keys])
    key_of = {r.message_id: k for r, k in zip(published, keys, strict=True)}
    assert [key_of[d.message_id] for d in await world.drain("x")] == keys
