"""Conformance C09–C13: claim, lease, heartbeat and fencing.

Leases are long (30 s) and run out through the harness's clock (``harness.advance``,
``harness.expire_lease``): a database harness moves the clock its transport reads, a broker's the
delivery's visibility. No case sleeps for a lease, and none races one on a loaded machine. One
case per transport still lets a short lease run out in real time
(``test_c12_a_short_lease_runs_out_in_real_time``).
"""

from __future__ import annotations

import time

import pytest

from fastapi_workqueue.core.envelope import PublishRequest
from fastapi_workqueue.core.ports import Ports
from fastapi_workqueue.core.processes import ProcessBeat, current_process
from fastapi_workqueue.core.transport import HeartbeatRequest, Settlement

from .harness import Harness, eventually, make_world

LEASE = 30.0


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


async def test_c09_a_claim_records_the_claiming_process(harness: Harness) -> None:
    registry = Ports.of(harness.transport).processes
    if registry is None:
        pytest.skip(f"{harness.transport.name}: no process registry (the broker knows no holder)")
    world = await make_world(harness.transport, [{"role": "a"}, {"role": "b"}])
    await world.publish(PublishRequest(payload=1))
    me = current_process()
    await registry.process_beat(ProcessBeat(me, (world["a"],), slots=4, busy=1, interval_seconds=30))
    held = await world.claim_one("a")
    [other] = await harness.transport.claim_many([world["b"]], 10)
    for delivery_id in (held.delivery_id, other[1].delivery_id):
        info = await harness.transport.get_delivery(delivery_id)
        assert info is not None and info.holder is not None
        assert (info.holder.process_id, info.holder.hostname, info.holder.pid) == (me.id, me.hostname, me.pid)
        assert info.holder.started_at is not None
        assert abs((info.holder.started_at - me.started_at).total_seconds()) < 0.01
    [listed] = [d for d in await harness.transport.list_deliveries(world["a"], "InFlight")
                if d.delivery_id == held.delivery_id]
    assert listed.holder == (await harness.transport.get_delivery(held.delivery_id)).holder  # type: ignore[union-attr]
    [mine] = [p for p in await registry.list_processes() if p.process_id == me.id]
    assert (mine.state, mine.pid, mine.subscriptions, mine.slots, mine.busy) == ("Running", me.pid, [world["a"]], 4, 1)
    assert mine.in_flight >= 2
    # The holder stays named after the attempt ends (it held the last attempt).
    assert await world.settle(held, "Complete") == "Completed"
    done = await harness.transport.get_delivery(held.delivery_id)
    assert done is not None and done.holder is not None and done.holder.process_id == me.id
    await registry.process_stop(me.id)
    [stopped] = [p for p in await registry.list_processes() if p.process_id == me.id]
    assert stopped.state == "Stopped" and stopped.stopped_at is not None


async def test_c10_heartbeat_renews_lease_and_stores_progress(harness: Harness) -> None:
    world = await make_world(
        harness.transport,
        [{"role": "a", "lease_seconds": LEASE, "backoff_base_seconds": 0, "backoff_max_seconds": 0}],
    )
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    for _ in range(4):
        await harness.advance(delivery.delivery_id, 20)  # two thirds of the lease
        [hb] = await harness.transport.heartbeat(
            [HeartbeatRequest(delivery.delivery_id, delivery.lease_token, 40, "m" * 500)]
        )
        assert hb.alive and not hb.cancel_requested
    # 100 s after the claim, well past the first 30 s lease: the renewals kept it.
    await harness.advance(delivery.delivery_id, 20)
    sweeps = harness.transport.capabilities.sweeps  # False: the broker expires leases itself (SQS)
    report = await harness.transport.sweep()
    assert report.ran or not sweeps
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "InFlight"
    assert info.progress_percent == 40 and info.progress_message == "m" * 500
    # Without a renewal the lease runs out 30 s after the last one.
    await harness.advance(delivery.delivery_id, 11)
    report = await harness.transport.sweep()
    assert (report.ran and report.retried >= 1) or not sweeps
    assert await world.status(delivery.delivery_id) == "Pending"
    assert await world.settle(delivery) == "LeaseLost"


async def test_c11_stale_token_changes_nothing_and_reports_lease_lost(harness: Harness) -> None:
    world = await make_world(
        harness.transport,
        [{"role": "a", "lease_seconds": LEASE, "backoff_base_seconds": 0, "backoff_max_seconds": 0}],
    )
    await world.publish_one(payload=1)
    old = await world.claim_one("a")
    await harness.expire_lease(old.delivery_id)
    await harness.transport.sweep()
    new = await world.claim_one("a")
    assert new.delivery_id == old.delivery_id and new.lease_token != old.lease_token

    [hb] = await harness.transport.heartbeat([HeartbeatRequest(old.delivery_id, old.lease_token)])
    assert not hb.alive
    for kind in ("Complete", "Retry", "Fail", "DeadLetter", "Release"):
        result = await harness.transport.settle([Settlement(old.delivery_id, old.lease_token, kind, reason="x")])
        assert result == ["LeaseLost"], kind
    info = await harness.transport.get_delivery(new.delivery_id)
    assert info is not None and info.status == "InFlight" and info.attempt == 2
    [hb] = await harness.transport.heartbeat([HeartbeatRequest(new.delivery_id, new.lease_token)])
    assert hb.alive
    assert await world.settle(new) == "Completed"


async def test_c11_one_call_naming_a_delivery_twice_weighs_each_token(harness: Harness) -> None:
    """A settle held back past its lease can share a call with the next attempt's (a consumer
    settles in batches): the stale token is LeaseLost and the current one settles, in either
    order; a heartbeat call naming both answers each on its own."""
    world = await make_world(
        harness.transport,
        [{"role": "a", "lease_seconds": LEASE, "max_attempts": 2, "backoff_base_seconds": 0,
          "backoff_max_seconds": 0}],
    )
    for stale_first in (True, False):
        await world.publish_one(payload=stale_first)
        old = await world.claim_one("a")
        await harness.expire_lease(old.delivery_id)
        await harness.transport.sweep()
        new = await world.claim_one("a")
        assert new.delivery_id == old.delivery_id and new.attempt == 2

        beats = await harness.transport.heartbeat([HeartbeatRequest(old.delivery_id, old.lease_token),
                                                   HeartbeatRequest(new.delivery_id, new.lease_token)])
        assert [b.alive for b in beats] == [False, True]
        stale = Settlement(old.delivery_id, old.lease_token, "Fail", reason="held back", error="x")
        current = Settlement(new.delivery_id, new.lease_token, "Complete")
        pair = [stale, current] if stale_first else [current, stale]
        results = await harness.transport.settle(pair)
        assert results == (["LeaseLost", "Completed"] if stale_first else ["Completed", "LeaseLost"])
        info = await harness.transport.get_delivery(new.delivery_id)
        assert info is not None and info.status == "Completed" and info.attempt == 2


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
        [{"role": "a", "lease_seconds": LEASE, "max_attempts": 3, "backoff_base_seconds": 0,
          "backoff_max_seconds": 0}],
    )
    await world.publish_one(payload=1)
    first = await world.claim_one("a")
    assert await world.claim("a") == []
    # A lease with time left is not taken back.
    await harness.advance(first.delivery_id, LEASE - 5)
    sweeps = harness.transport.capabilities.sweeps  # False: the broker expires leases itself (SQS)
    assert (await harness.transport.sweep()).ran or not sweeps
    assert await world.status(first.delivery_id) == "InFlight"
    assert await world.claim("a") == []

    await harness.advance(first.delivery_id, 6)
    report = await harness.transport.sweep()
    assert (report.ran and report.retried >= 1) or not sweeps
    if sweeps:
        # The pass names what it took back, and from whom (the sweeper logs it).
        [lease] = [t for t in report.taken_back if t.delivery_id == first.delivery_id]
        assert (lease.subscription, lease.result, lease.attempt) == (world["a"], "Pending", 1)
        assert lease.holder is not None and lease.holder.process_id == current_process().id
    info = await harness.transport.get_delivery(first.delivery_id)
    assert info is not None and info.status == "Pending" and info.attempt == 1
    assert info.reason == "lease expired"
    second = await world.claim_one("a")
    assert second.attempt == 2


async def test_c12_a_short_lease_runs_out_in_real_time(harness: Harness) -> None:
    """The real-time path: no harness clock, a 0.5 s lease (the shortest a subscription takes), and
    sweeps until it is taken back."""
    lease = 0.5
    world = await make_world(
        harness.transport,
        [{"role": "a", "lease_seconds": lease, "max_attempts": 3, "backoff_base_seconds": 0,
          "backoff_max_seconds": 0}],
    )
    await world.publish_one(payload=1)
    began = time.monotonic()
    first = await world.claim_one("a")

    async def taken_back() -> bool:
        await harness.transport.sweep()
        return await world.status(first.delivery_id) == "Pending"

    await eventually(taken_back, within=20, interval=0.05)
    assert time.monotonic() - began >= lease  # never before the lease ran out
    info = await harness.transport.get_delivery(first.delivery_id)
    assert info is not None and info.attempt == 1 and info.reason == "lease expired"
    second = await world.claim_one("a")
    assert second.delivery_id == first.delivery_id and second.attempt == 2
    assert await world.settle(first) == "LeaseLost"
    assert await world.settle(second) == "Completed"


async def test_c13_lease_expiring_on_final_attempt_dead_letters(harness: Harness) -> None:
    world = await make_world(
        harness.transport,
        [{"role": "a", "lease_seconds": LEASE, "max_attempts": 2, "backoff_base_seconds": 0,
          "backoff_max_seconds": 0}],
    )
    await world.publish_one(payload=1)
    for attempt in (1, 2):
        delivery = await world.claim_one("a")
        assert delivery.attempt == attempt
        await harness.expire_lease(delivery.delivery_id)
        report = await harness.transport.sweep()
        if harness.transport.capabilities.sweeps:
            assert [t.result for t in report.taken_back if t.delivery_id == delivery.delivery_id] == [
                "Pending" if attempt == 1 else "DeadLettered"]
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "DeadLettered"
    assert "final attempt" in (info.reason or "")
    assert await world.claim("a") == []
