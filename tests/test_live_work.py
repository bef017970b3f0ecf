"""The dashboard's bounded reads of the live work: counts that stop at a cap, and the heads that
block Ordered keys, on a database of their own each."""

from __future__ import annotations

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.live_work import LiveWorkReader
from fastapi_workqueue.core.transport import Settlement
from fastapi_workqueue.database.routines import RoutineTransport

from .conftest import unique
from .test_migrations import scratch_url  # noqa: F401  (the store fixture's database)
from .test_stats_history import Store, store  # noqa: F401  (a fixture: a migrated transport of its own)

pytestmark = pytest.mark.timeout(60)


async def declare(transport: RoutineTransport, **policy: object) -> tuple[str, str]:
    topic, sub = unique("live"), unique("counted")
    await transport.sync_topology(
        [Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="h", **policy)]
    )
    return topic, sub


async def test_live_counts_stop_at_the_cap(store: Store) -> None:  # noqa: F811
    transport = store.transport
    assert isinstance(transport, LiveWorkReader)
    topic, sub = await declare(transport)
    # Pending on each kind of key: none (mode None claims them on their own), as published here.
    await transport.publish(topic, [prepare(PublishRequest(payload=i, partition_key=f"k{i % 3}")) for i in range(12)])
    claimed = await transport.claim(sub, 5)
    await transport.settle([Settlement(c.delivery_id, c.lease_token, "DeadLetter", reason="x") for c in claimed[:3]])
    # 7 Pending, 2 InFlight, 3 DeadLettered.
    [exact] = await transport.live_counts(sub)
    assert (exact.pending, exact.in_flight, exact.dead_lettered, exact.cap) == (7, 2, 3, 1000)
    [capped] = await transport.live_counts(sub, cap=3)
    assert (capped.pending, capped.in_flight, capped.dead_lettered, capped.cap) == (3, 2, 3, 3)
    assert sub in {c.subscription for c in await transport.live_counts()}


async def test_live_counts_of_keyed_subscriptions(store: Store) -> None:  # noqa: F811
    transport = store.transport
    for mode in ("Exclusive", "Ordered"):
        topic, sub = await declare(transport, partition_mode=mode)
        await transport.publish(topic, [prepare(PublishRequest(payload=i, partition_key=f"k{i % 4}"))
                                        for i in range(10)])
        await transport.publish(topic, [prepare(PublishRequest(payload="unkeyed"))])
        await transport.claim(sub, 10)  # one per key, and the unkeyed one
        [counts] = await transport.live_counts(sub, cap=4)
        assert (counts.pending, counts.in_flight) == (4, 4), mode
        [counts] = await transport.live_counts(sub)
        assert (counts.pending, counts.in_flight, counts.dead_lettered) == (6, 5, 0), mode


async def test_blocked_keys_are_the_dead_lettered_and_retrying_heads(store: Store) -> None:  # noqa: F811
    transport = store.transport
    topic, sub = await declare(transport, partition_mode="Ordered", backoff_base_seconds=3600,
                               backoff_max_seconds=3600)
    for key, count in (("dead", 3), ("retrying", 2), ("running", 2), ("fresh", 1)):
        await transport.publish(topic, [prepare(PublishRequest(payload=i, partition_key=key)) for i in range(count)])
    heads = {c.partition_key: c for c in await transport.claim(sub, 10)}
    assert set(heads) == {"dead", "retrying", "running", "fresh"}
    await transport.settle([
        Settlement(heads["dead"].delivery_id, heads["dead"].lease_token, "DeadLetter", reason="bad data"),
        Settlement(heads["retrying"].delivery_id, heads["retrying"].lease_token, "Fail", error="busy"),
        Settlement(heads["fresh"].delivery_id, heads["fresh"].lease_token, "Complete"),
    ])
    blocked = await transport.blocked_keys(sub)
    assert [(b.partition_key, b.head_status, b.head_attempt, b.waiting_items) for b in blocked] == [
        ("dead", "DeadLettered", 1, 2),
        ("retrying", "Pending", 1, 1),
    ]
    assert blocked[0].head_delivery_id == heads["dead"].delivery_id and blocked[0].head_reason == "bad data"
    assert blocked[1].head_visible_at is not None
    assert [b.partition_key for b in await transport.blocked_keys(sub, limit=1)] == ["dead"]
    assert [b.waiting_items for b in await transport.blocked_keys(sub, cap=1)] == [1, 1]

    # Replaying the dead head unblocks its key.
    assert (await transport.replay(sub, heads["dead"].delivery_id, "fixed")).ok
    assert [b.partition_key for b in await transport.blocked_keys(sub)] == ["retrying"]

    # Only Ordered subscriptions have blocked keys.
    _, parallel = await declare(transport)
    assert await transport.blocked_keys(parallel) == []
    assert await transport.blocked_keys(unique("missing")) == []


async def test_the_oldest_claimable_wait_and_the_stuck_in_flight(store: Store) -> None:  # noqa: F811
    from datetime import UTC, datetime, timedelta

    transport = store.transport
    for mode in ("None", "Exclusive"):
        topic, sub = await declare(transport, partition_mode=mode, backoff_base_seconds=3600, backoff_max_seconds=3600)
        [counts] = await transport.live_counts(sub)
        assert counts.oldest_pending_at is None and counts.stuck == 0
        before = datetime.now(UTC) - timedelta(seconds=1)
        await transport.publish(topic, [prepare(PublishRequest(payload=i, partition_key=f"k{i}")) for i in range(3)])
        after = datetime.now(UTC) + timedelta(seconds=1)
        [counts] = await transport.live_counts(sub, stuck_before=after)
        assert counts.oldest_pending_at is not None and before <= counts.oldest_pending_at <= after, mode
        assert counts.stuck == 0
        claimed = await transport.claim(sub, 3)
        assert len(claimed) == 3
        [counts] = await transport.live_counts(sub)
        assert counts.oldest_pending_at is None and counts.stuck == 0, mode  # no stuck_before: not counted
        [counts] = await transport.live_counts(sub, stuck_before=before)
        assert counts.stuck == 0, mode
        [counts] = await transport.live_counts(sub, stuck_before=after + timedelta(hours=1))
        assert counts.stuck == 3, mode
        # A delivery waiting out its retry backoff is Pending but waits for nobody yet.
        await transport.settle([Settlement(claimed[0].delivery_id, claimed[0].lease_token, "Fail", error="busy",
                                           delay_seconds=3600)])
        [counts] = await transport.live_counts(sub)
        assert counts.pending == 1 and counts.oldest_pending_at is not None, mode
        assert counts.oldest_pending_at > after + timedelta(minutes=30), mode
