"""Conformance C34-C41: flow control decided at claim time: priority (C34-C36), ``max_in_flight``
and ``key_concurrency`` (C37-C38), rate limits (C39-C40), and how full the limits are (C41).

A transport without the capability (``Capabilities.priority``, ``concurrency_limits``,
``rate_limits``: SQS has none) skips these, saying why.
"""

from __future__ import annotations

import pytest

from fastapi_workqueue.core.envelope import PublishRequest

from ...core.live_work import FlowStateReader
from ...core.ports import Ports
from ...core.transport import Claimed, ClaimedDelivery, HeldBack
from .harness import Harness, age, make_world, require


async def test_c34_priority_higher_first_then_publish_order(harness: Harness) -> None:
    require(harness, "priority", "priority")
    world = await make_world(harness.transport, [{"role": "s"}])
    levels = [0, 5, 0, 9, 5, 0]
    results = await world.publish(*[PublishRequest(payload=i, priority=p) for i, p in enumerate(levels)])
    ids = [r.message_id for r in results]
    order = [c.message_id for c in await world.drain("s")]
    assert order == [ids[3], ids[1], ids[4], ids[0], ids[2], ids[5]]


async def test_c34_one_claim_answers_its_deliveries_highest_priority_first(harness: Harness) -> None:
    require(harness, "priority", "priority")
    world = await make_world(harness.transport, [{"role": "s"}])
    results = await world.publish(*[PublishRequest(payload=i, priority=p) for i, p in enumerate([1, 0, 7, 3])])
    claimed = await world.claim("s", 3)
    assert [c.message_id for c in claimed] == [results[2].message_id, results[3].message_id, results[0].message_id]


async def test_c34_one_claim_answers_equal_priorities_in_the_order_they_became_due(harness: Harness) -> None:
    """Within a priority, the order is when each delivery became due, not when it was published:
    the answer of one claim runs in that order."""
    require(harness, "priority", "priority")
    world = await make_world(harness.transport, [{"role": "s"}])
    late, now, soon, urgent = await world.publish(
        PublishRequest(payload="late", delay_seconds=10), PublishRequest(payload="now"),
        PublishRequest(payload="soon", delay_seconds=5), PublishRequest(payload="urgent", delay_seconds=10, priority=1),
    )
    waiting = await harness.transport.list_deliveries(world["s"], "Pending")
    await age(harness, [d.delivery_id for d in waiting], 20)
    claimed = await world.claim("s", 4)
    assert [c.message_id for c in claimed] == [r.message_id for r in (urgent, now, soon, late)]


async def test_c35_priority_picks_keys_but_never_reorders_an_ordered_key(harness: Harness) -> None:
    require(harness, "priority", "priority")
    world = await make_world(harness.transport, [{"role": "o", "partition_mode": "Ordered"}])
    results = await world.publish(
        PublishRequest(partition_key="a", payload="a1", priority=0),
        PublishRequest(partition_key="a", payload="a2", priority=9),
        PublishRequest(partition_key="b", payload="b1", priority=5),
        PublishRequest(partition_key="a", payload="a3", priority=3),
    )
    ids = [r.message_id for r in results]
    # b's head has priority 5, a's head 0: b first; a's deliveries keep their publish order.
    assert [c.message_id for c in await world.drain("o")] == [ids[2], ids[0], ids[1], ids[3]]


async def test_c35_an_exclusive_key_still_runs_one_at_a_time_with_priorities(harness: Harness) -> None:
    require(harness, "priority", "priority")
    world = await make_world(harness.transport, [{"role": "x", "partition_mode": "Exclusive"}])
    await world.publish(*[PublishRequest(partition_key="k", payload=i, priority=9 if i else 0) for i in range(3)],
                        PublishRequest(partition_key="other", payload="o", priority=0))
    claimed = await world.claim("x", 10)
    assert sorted(c.partition_key or "" for c in claimed) == ["k", "other"]
    assert await world.claim("x", 10) == []


async def test_c36_high_priority_overtakes_a_backlog_in_the_next_claim(harness: Harness) -> None:
    require(harness, "priority", "priority")
    world = await make_world(harness.transport, [{"role": "s"}, {"role": "k", "partition_mode": "Exclusive"}])
    await world.publish(*[PublishRequest(payload=i, partition_key=f"k{i}") for i in range(300)])
    [urgent] = await world.publish(PublishRequest(payload="urgent", partition_key="late", priority=9))
    [first] = await world.claim("s", 1)
    assert first.message_id == urgent.message_id
    [first_key] = await world.claim("k", 1)
    assert first_key.message_id == urgent.message_id


# -- C37-C40: limits held across processes (the store counts and meters, not the process) --------


def held_back(claimed: list[ClaimedDelivery]) -> HeldBack | None:
    return claimed.held_back if isinstance(claimed, Claimed) else None


async def test_c37_max_in_flight_caps_what_is_in_flight_and_frees_on_settle_and_lease_expiry(
    harness: Harness,
) -> None:
    require(harness, "concurrency_limits", "max_in_flight")
    world = await make_world(harness.transport, [{"role": "s", "max_in_flight": 3}])
    await world.publish(*[PublishRequest(payload=i) for i in range(6)])
    first = await world.claim("s", 10)
    assert len(first) == 3
    held = held_back(first)
    assert held is not None and held.limit == "MaxInFlight" and held.retry_after is None
    second = await world.claim("s", 10)
    assert second == [] and held_back(second) is not None
    await world.settle(first[0])
    [third] = await world.claim("s", 10)
    assert third.attempt == 1
    # A holder that died keeps its slot until its lease runs out, then frees it.
    await harness.expire_lease(first[1].delivery_id)
    freed = await world.claim("s", 10)
    assert len(freed) >= 1 and all(d.attempt == 1 for d in freed)


async def test_c38_key_concurrency_caps_each_key_of_a_none_subscription(harness: Harness) -> None:
    require(harness, "concurrency_limits", "key_concurrency")
    world = await make_world(harness.transport, [{"role": "s", "key_concurrency": 2}])
    await world.publish(*[PublishRequest(partition_key=k, payload=i) for i, k in enumerate("aaaab")],
                        PublishRequest(payload="no key"))
    claimed = await world.claim("s", 10)
    assert sorted(c.partition_key or "-" for c in claimed) == ["-", "a", "a", "b"]
    again = await world.claim("s", 10)
    assert again == []
    held = held_back(again)
    assert held is not None and held.limit == "KeyConcurrency"
    await world.settle(next(c for c in claimed if c.partition_key == "a"))
    [more] = await world.claim("s", 10)
    assert more.partition_key == "a" and more.attempt == 1


async def test_c38_key_concurrency_claims_the_highest_priority_first(harness: Harness) -> None:
    require(harness, "concurrency_limits", "key_concurrency")
    require(harness, "priority", "priority")
    world = await make_world(harness.transport, [{"role": "s", "key_concurrency": 1}])
    results = await world.publish(PublishRequest(partition_key="a", payload="a0", priority=0),
                                  PublishRequest(partition_key="b", payload="b0", priority=0),
                                  PublishRequest(partition_key="a", payload="a9", priority=9),
                                  PublishRequest(payload="no key", priority=5))
    ids = [r.message_id for r in results]
    # Priority first, within each key's room: a's priority-9 delivery takes a's one slot.
    claimed = await world.claim("s", 2)
    assert [c.message_id for c in claimed] == [ids[2], ids[3]]
    assert [c.message_id for c in await world.claim("s", 10)] == [ids[1]]


async def test_c39_rate_limit_claims_within_its_tokens_and_says_when_the_next_is_due(harness: Harness) -> None:
    require(harness, "rate_limits", "rate_limit")
    world = await make_world(harness.transport, [{"role": "s", "rate_limit": "2/s"}])
    await world.publish(*[PublishRequest(payload=i) for i in range(5)])
    burst = await world.claim("s", 10)
    assert len(burst) == 2  # a bucket holds one second of tokens
    empty = await world.claim("s", 10)
    assert empty == []
    held = held_back(empty)
    assert held is not None and held.limit == "RateLimit"
    assert held.retry_after is not None and 0 < held.retry_after <= 0.5
    await harness.advance(burst[0].delivery_id, 0.5)
    [next_one] = await world.claim("s", 10)
    assert next_one.attempt == 1  # a delivery over the limit was not claimed: no attempt spent


async def test_c40_key_rate_limit_meters_each_key_on_its_own(harness: Harness) -> None:
    require(harness, "rate_limits", "key_rate_limit")
    world = await make_world(harness.transport, [{"role": "s", "key_rate_limit": "1/s"}])
    await world.publish(*[PublishRequest(partition_key=k, payload=i) for i, k in enumerate("aab")])
    claimed = await world.claim("s", 10)
    assert sorted(c.partition_key or "" for c in claimed) == ["a", "b"]
    empty = await world.claim("s", 10)
    held = held_back(empty)
    assert empty == [] and held is not None and held.limit == "KeyRateLimit"
    assert held.retry_after is not None and 0 < held.retry_after <= 1.0
    await harness.advance(claimed[0].delivery_id, 1.0)
    [a] = await world.claim("s", 10)
    assert a.partition_key == "a"


async def test_c41_flow_state_says_how_full_the_limits_are_and_what_waits(harness: Harness) -> None:
    require(harness, "concurrency_limits", "flow_state")
    reader = harness.transport
    if not isinstance(reader, FlowStateReader):
        pytest.skip(f"{harness.name}: the transport reads no flow state (FlowStateReader)")
    world = await make_world(harness.transport, [{"role": "s", "max_in_flight": 2, "rate_limit": "5/s"},
                                                 {"role": "k", "key_concurrency": 1}])
    await world.publish(*[PublishRequest(payload=i, partition_key="a" if i < 3 else "b") for i in range(5)])
    state = await reader.flow_state(world["s"])
    assert state is not None and (state.in_flight, state.waiting, state.keys_at_limit) == (0, 0, 0)
    assert state.tokens is not None and state.tokens >= 4.99
    await world.claim("s", 10)
    state = await reader.flow_state(world["s"])
    assert state is not None and (state.in_flight, state.waiting) == (2, 3)  # full: everything claimable waits
    assert state.tokens is not None and 2.99 <= state.tokens < 3.5
    await world.claim("k", 10)
    keyed = await reader.flow_state(world["k"])
    assert keyed is not None and (keyed.in_flight, keyed.keys_at_limit, keyed.waiting) == (2, 2, 3)
    assert keyed.tokens is None
    # Paused, the subscription or its topic: nothing is claimable, so no limit holds anything back.
    await harness.transport.set_subscription_status(world["s"], "Paused")
    paused = await reader.flow_state(world["s"])
    assert paused is not None and (paused.in_flight, paused.waiting) == (2, 0)
    lifecycle = Ports.of(harness.transport).lifecycle
    if lifecycle is not None:
        await lifecycle.set_topic_status(world.topic, "Paused")
        paused = await reader.flow_state(world["k"])
        assert paused is not None and (paused.keys_at_limit, paused.waiting) == (2, 0)
        await lifecycle.set_topic_status(world.topic, "Active")
    await harness.transport.set_subscription_status(world["s"], "Active")
    resumed = await reader.flow_state(world["s"])
    assert resumed is not None and resumed.waiting == 3
    assert await reader.flow_state("no-such-subscription") is None
