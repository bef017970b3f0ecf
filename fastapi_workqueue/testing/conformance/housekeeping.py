"""Conformance C31–C33: retention, the sweep lock, stats and backlog."""

from __future__ import annotations

import asyncio
import uuid

from fastapi_workqueue.core.envelope import PublishRequest

from .harness import Harness, age, make_world


async def test_c31_retention_purges_terminal_only(harness: Harness) -> None:
    """Completed and Discarded deliveries go once their retention has passed (the harness's clock
    ages every delivery past it); Pending, InFlight and DeadLettered ones as old stay."""
    retention = 3600
    world = await make_world(
        harness.transport,
        [{"role": "a", "retention_seconds": retention, "max_attempts": 1, "lease_seconds": 2 * retention}],
    )
    results = await world.publish(*[PublishRequest(payload=i) for i in range(6)])
    c = await world.claim("a", 4)
    await world.settle(c[0], "Complete")
    await world.settle(c[1], "DeadLetter", reason="x")
    await world.settle(c[2], "Complete")
    assert (await harness.transport.discard(world["a"], c[2].delivery_id, "x")).result == "AlreadyTerminal"
    pending = await world.claim("a", 1)  # the fifth stays claimable below
    assert len(pending) == 1
    await world.settle(pending[0], "Release")
    in_flight = c[3]
    [sixth] = [d for d in await harness.transport.list_deliveries(world["a"], "Pending")
               if d.delivery_id != pending[0].delivery_id]
    assert (await harness.transport.discard(world["a"], sixth.delivery_id, "x")).result == "Discarded"
    ids = [*(d.delivery_id for d in c), pending[0].delivery_id, sixth.delivery_id]

    # Within retention nothing goes.
    assert (await harness.transport.sweep()).ran
    assert all([await harness.transport.get_delivery(i) is not None for i in ids])

    await age(harness, ids, retention + 1)
    for _ in range(20):  # a pass purges at most its limit; other tests' rows may be due too
        report = await harness.transport.sweep()
        assert report.ran
        if report.purged_deliveries == 0:
            break
    for gone in (c[0].delivery_id, c[2].delivery_id, sixth.delivery_id):
        assert await harness.transport.get_delivery(gone) is None
    for kept, status in ((c[1], "DeadLettered"), (in_flight, "InFlight"), (pending[0], "Pending")):
        info = await harness.transport.get_delivery(kept.delivery_id)
        assert info is not None and info.status == status
    assert len(results) == 6


async def test_c31_retention_purges_messages_nothing_refers_to_by_their_topic(harness: Harness) -> None:
    """A message goes once its deliveries are gone and its topic's retention has passed; a topic
    whose subscription keeps a week keeps its message. (Seen from outside: the same MessageID is
    Accepted again once its message is purged, and a Duplicate while it is stored.)"""
    short = await make_world(harness.transport, [{"role": "a", "retention_seconds": 0.2}])
    long = await make_world(harness.transport, [{"role": "b", "retention_seconds": 604800}])
    short_message = PublishRequest(message_id=uuid.uuid4(), payload="short")
    long_message = PublishRequest(message_id=uuid.uuid4(), payload="long")
    assert [r.status.value for r in await short.publish(short_message)] == ["Accepted"]
    assert [r.status.value for r in await long.publish(long_message)] == ["Accepted"]
    [drained] = await short.drain("a")
    assert len(await long.drain("b")) == 1
    await harness.advance(drained.delivery_id, 1)  # past the short topic's retention
    for _ in range(50):  # a pass purges at most its limit; other tests' rows may be due too
        report = await harness.transport.sweep()
        if report.ran and report.purged_deliveries == 0 and report.purged_messages == 0:
            break
    assert [r.status.value for r in await short.publish(short_message)] == ["Accepted"]
    assert [r.status.value for r in await long.publish(long_message)] == ["Duplicate"]


async def test_c32_two_sweepers_only_one_pass_runs(harness: Harness) -> None:
    world = await make_world(
        harness.transport,
        [{"role": "a", "lease_seconds": 30, "max_attempts": 3, "backoff_base_seconds": 0, "backoff_max_seconds": 0}],
    )
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    await harness.expire_lease(delivery.delivery_id)
    async with harness.hold_sweep_lock():
        report = await harness.transport.sweep()
        assert report.ran is False
        assert report.expired == 0
        # The pass that did not run did no work: the expired lease is still there.
        assert await world.status(delivery.delivery_id) == "InFlight"
    reports = await asyncio.gather(*(harness.transport.sweep() for _ in range(4)))
    assert any(r.ran for r in reports)
    assert sum(r.retried for r in reports) >= 1
    assert await world.status(delivery.delivery_id) == "Pending"
    assert (await harness.transport.sweep()).ran


async def test_c33_stats_and_backlog_agree_with_deliveries(harness: Harness) -> None:
    world = await make_world(
        harness.transport, [{"role": "x", "partition_mode": "Exclusive", "max_attempts": 1}]
    )
    # key a: 3 deliveries, key b: 2, no key: 2
    await world.publish(
        *[PublishRequest(partition_key="a", payload=i) for i in range(3)],
        *[PublishRequest(partition_key="b", payload=i) for i in range(2)],
        *[PublishRequest(payload=i) for i in range(2)],
    )
    [stats] = await harness.transport.stats(world["x"])
    assert (stats.pending, stats.claimable, stats.in_flight) == (7, 4, 0)
    backlog = await harness.transport.backlog(world["x"])
    assert backlog is not None and (backlog.claimable, backlog.in_flight, backlog.backlog) == (4, 0, 4)

    claimed = await world.claim("x", 2)  # which two is the transport's choice
    [stats] = await harness.transport.stats(world["x"])
    assert stats.in_flight == 2 and stats.pending == 5
    backlog = await harness.transport.backlog(world["x"])
    assert backlog is not None and backlog.in_flight == 2
    assert backlog.backlog == backlog.claimable + 2
    # Settle everything one way or another and check the counts by state.
    await world.settle(claimed[0], "Complete")
    await world.settle(claimed[1], "DeadLetter", reason="x")
    rest = await world.drain("x")
    assert len(rest) == 5
    [stats] = await harness.transport.stats(world["x"])
    assert (stats.pending, stats.in_flight, stats.dead_lettered, stats.completed, stats.discarded) == (0, 0, 1, 6, 0)
    backlog = await harness.transport.backlog(world["x"])
    assert backlog is not None and backlog.backlog == 0


async def test_c33_stats_count_every_state_and_a_blocked_ordered_key_not_at_all(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "o", "partition_mode": "Ordered", "max_attempts": 1}])
    # key a: 3 deliveries, key b: 2, no key: 3
    await world.publish(
        *[PublishRequest(partition_key="a", payload=i) for i in range(3)],
        *[PublishRequest(partition_key="b", payload=i) for i in range(2)],
        *[PublishRequest(payload=i) for i in range(3)],
    )
    claimed = await world.claim("o", 10)
    assert sorted(c.partition_key or "-" for c in claimed) == ["-", "-", "-", "a", "b"]  # the heads only
    head_a = next(c for c in claimed if c.partition_key == "a")
    head_b = next(c for c in claimed if c.partition_key == "b")
    completed, in_flight, released = [c for c in claimed if c.partition_key is None]
    assert await world.settle(head_a, "DeadLetter", reason="poison") == "DeadLettered"  # blocks key a
    assert await world.settle(head_b, "Release") == "Pending"
    assert await world.settle(completed) == "Completed"
    assert await world.settle(released, "Release") == "Pending"
    assert (await harness.transport.discard(world["o"], released.delivery_id, "x")).result == "Discarded"

    [stats] = await harness.transport.stats(world["o"])
    # Pending: a1, a2 (behind a dead-lettered head), b0, b1; claimable: key b once, key a not at all.
    assert (stats.pending, stats.claimable, stats.in_flight) == (4, 1, 1)
    assert (stats.dead_lettered, stats.completed, stats.discarded) == (1, 1, 1)
    backlog = await harness.transport.backlog(world["o"])
    assert backlog is not None and (backlog.claimable, backlog.in_flight, backlog.backlog) == (1, 1, 2)

    # Discarding the blocking head frees key a: it counts once too.
    assert (await harness.transport.discard(world["o"], head_a.delivery_id, "skip")).result == "Discarded"
    await world.settle(in_flight)
    [stats] = await harness.transport.stats(world["o"])
    assert (stats.pending, stats.claimable, stats.in_flight) == (4, 2, 0)
    assert (stats.dead_lettered, stats.completed, stats.discarded) == (0, 2, 2)
    backlog = await harness.transport.backlog(world["o"])
    assert backlog is not None and (backlog.claimable, backlog.in_flight, backlog.backlog) == (2, 0, 2)


async def counted_by_listing(harness: Harness, subscription: str) -> dict[str, int]:
    counts = {}
    for status in ("Pending", "InFlight", "DeadLettered", "Completed", "Discarded"):
        counts[status] = len(await harness.transport.list_deliveries(subscription, status, limit=1000))
    return counts


async def assert_stats_agree(harness: Harness, subscription: str) -> dict[str, int]:
    [stats] = await harness.transport.stats(subscription)
    listed = await counted_by_listing(harness, subscription)
    assert {"Pending": stats.pending, "InFlight": stats.in_flight, "DeadLettered": stats.dead_lettered,
            "Completed": stats.completed, "Discarded": stats.discarded} == listed
    return listed


async def test_c33_terminal_counts_stay_exact_through_discard_expiry_purge_and_prune(harness: Harness) -> None:
    """Completed and Discarded are counted without reading the history: every way into those states
    (complete, a cancelled settle, discard, a cancelled lease that expires) and every way out of the
    table (retention purge, prune) keeps stats equal to the deliveries."""
    world = await make_world(harness.transport, [{"role": "a", "retention_seconds": 60.0, "lease_seconds": 30,
                                                      "backoff_base_seconds": 0, "backoff_max_seconds": 0}])
    await world.publish(*[PublishRequest(payload=i) for i in range(8)])
    claimed = await world.claim("a", 5)
    assert len(claimed) == 5
    await world.settle(claimed[0], "Complete")
    await world.settle(claimed[1], "Complete")
    cancelled = await harness.transport.discard(world["a"], claimed[2].delivery_id, "stop")
    assert cancelled.result == "CancelRequested"
    assert await world.settle(claimed[2], "Complete") == "Discarded"
    expiring = await harness.transport.discard(world["a"], claimed[3].delivery_id, "stop")
    assert expiring.result == "CancelRequested"
    [waiting, *_] = await harness.transport.list_deliveries(world["a"], "Pending", limit=1)
    assert (await harness.transport.discard(world["a"], waiting.delivery_id, "not needed")).result == "Discarded"
    for held in (claimed[3], claimed[4]):  # the two leases still held run out
        await harness.expire_lease(held.delivery_id)
    assert (await harness.transport.sweep()).discarded >= 1  # (other tests' leases may be swept too)
    assert await world.status(claimed[3].delivery_id) == "Discarded"
    listed = await assert_stats_agree(harness, world["a"])
    assert (listed["Completed"], listed["Discarded"], listed["Pending"]) == (2, 3, 3)

    # Retention: everything settled more than 60 s ago goes; the counts follow.
    settled = [d.delivery_id for status in ("Completed", "Discarded")
               for d in await harness.transport.list_deliveries(world["a"], status, limit=100)]
    await age(harness, settled, 120)
    for _ in range(50):  # a pass purges at most its limit; other tests' rows may be due too
        report = await harness.transport.sweep()
        if report.ran and report.purged_deliveries == 0:
            break
    listed = await assert_stats_agree(harness, world["a"])
    assert (listed["Completed"], listed["Discarded"]) == (0, 0)

    # More settles, then prune (the operator's removal, whatever the retention).
    more = await world.drain("a")
    assert len(more) == 3  # two never claimed and the one whose lease expired
    await assert_stats_agree(harness, world["a"])
    assert await harness.transport.prune(0) >= 3
    listed = await assert_stats_agree(harness, world["a"])
    assert (listed["Completed"], listed["Discarded"]) == (0, 0)
