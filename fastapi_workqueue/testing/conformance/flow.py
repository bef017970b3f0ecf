"""Conformance C34-C36: flow control decided at claim time (priority).

A transport without the capability (``Capabilities.priority``: SQS) skips these, saying why.
"""

from __future__ import annotations

from fastapi_workqueue import PublishRequest

from .harness import Harness, make_world, require


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
