"""Edges of the queue's rules, the same on every store: a retry past 1,024 attempts, a delivery
named twice in one settle call, and the lease a claiming process counts.

Each runs on the in-memory transport, PostgreSQL and SQLite, with a transport that reads a
ManualClock (as the conformance suite's harnesses do), so that leases and delays pass without sleeping.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fastapi_workqueue.core.clock import ManualClock
from fastapi_workqueue.core.memory import MemoryTransport
from fastapi_workqueue.database.postgres import PostgresTransport
from fastapi_workqueue.database.sqlite import SqliteTransport
from fastapi_workqueue.testing.conformance.harness import make_world

from .support import sweep_until_done


@pytest.fixture(params=["memory", "postgresql", "sqlite"])
async def store(request: pytest.FixtureRequest, pg_url: str, sqlite_url: str) -> AsyncIterator[tuple[Any, ManualClock]]:
    """A transport on each store, reading a ManualClock of its own."""
    clock = ManualClock()
    if request.param == "memory":
        transport: Any = MemoryTransport(f"memory://edges-{uuid.uuid4().hex}", clock=clock)
    elif request.param == "postgresql":
        transport = PostgresTransport(pg_url, listen=False, pool_max_size=4, clock=clock)
    else:
        transport = SqliteTransport(sqlite_url, clock=clock)
    await transport.open()
    try:
        yield transport, clock
    finally:
        await transport.close()


async def test_backoff_overflow_after_1024_failures_wedges_settle_and_sweep(store: tuple[Any, ManualClock]) -> None:
    """SPEC §3 allows max_attempts up to 2^31-1, and §4 says a failed attempt goes "Pending after
    backoff, or DeadLettered when attempts are spent" and (invariant 4) "none stays InFlight longer
    than its lease plus one sweeper interval". base·2^(attempt−1) overflows a double at attempt 1025
    (2.0 ** 1024): the settle raises, the delivery stays InFlight, and the sweep raises on it too,
    so every other expired lease of every subscription stays InFlight with it."""
    transport, clock = store
    w = await make_world(transport, [dict(role="a", max_attempts=5000, backoff_base_seconds=0,
                                          backoff_max_seconds=0, lease_seconds=10)])
    other = await make_world(transport, [dict(role="b", lease_seconds=10)])
    await w.publish_one(payload=1)
    for _ in range(1024):
        [d] = await w.claim("a", 1)
        assert await w.settle(d, "Fail", reason="boom") == "Pending"
    [d] = await w.claim("a", 1)
    assert d.attempt == 1025
    await other.publish_one(payload=2)
    bystander = await other.claim_one("b")
    clock.advance(11)  # both leases run out (and other tests' in the session's database)
    await sweep_until_done(transport, survive_errors=True)
    # The sweep must take back the bystander's expired lease (and the retrying delivery's).
    assert await other.status(bystander.delivery_id) == "Pending"
    assert await w.status(d.delivery_id) == "Pending"
    # and a failure of attempt 1025 settles as every other one does.
    [d2] = await w.claim("a", 1)
    assert await w.settle(d2, "Fail", reason="boom") == "Pending"


async def test_a_settlement_named_twice_in_one_settle_call_is_fenced_once(store: tuple[Any, ManualClock]) -> None:
    """SPEC §4: "settle with the current token only; a stale token changes nothing (fencing)". Once
    the first settlement of a call ends the attempt, the second one's token is stale: it must change
    nothing and answer LeaseLost (memory). PostgreSQL answers the first's result for both; SQLite
    sorts the call by outcome name, so the later Complete wins over the earlier Retry (the delivery
    ends Completed) and the Retry is answered "Completed"."""
    from fastapi_workqueue.core.transport import Settlement

    transport, _ = store
    w = await make_world(transport, [dict(role="a", max_attempts=5)])
    await w.publish_one(payload=1)
    d = await w.claim_one("a")
    results = await transport.settle([
        Settlement(d.delivery_id, d.lease_token, "Retry", delay_seconds=0, reason="again"),
        Settlement(d.delivery_id, d.lease_token, "Complete"),
    ])
    assert (await w.status(d.delivery_id), results) == ("Pending", ["Pending", "LeaseLost"])


@pytest.mark.parametrize("asked", [None, 7.5])
async def test_a_claim_and_a_renewal_lease_for_what_the_process_counts(
    store: tuple[Any, ManualClock], asked: float | None,
) -> None:
    """Inside ``counting`` a claim (and ``claim_many``) leases for the lease the claiming process
    counts, and a heartbeat that names a lease renews for it; without them both take the
    subscription's own (here 60 s). A newer deploy's shorter lease thus never runs out in the store
    under a process that still counts the old one. (Within half a second: the test's clock may move
    with the real one between the call and the reading.)"""
    from fastapi_workqueue.core.leases import counting
    from fastapi_workqueue.core.transport import HeartbeatRequest

    transport, clock = store
    w = await make_world(transport, [dict(role="a", lease_seconds=60), dict(role="b", lease_seconds=60)])
    await w.publish_one(payload=1)
    expected = 60 if asked is None else asked
    names = [w.subs["a"], w.subs["b"]]
    with counting({name: asked for name in names} if asked is not None else {}):
        [d] = await transport.claim(w.subs["a"], 1)
        [(_, e)] = await transport.claim_many([w.subs["b"]], 1)
    for claimed in (d, e):
        assert claimed.lease_expires_at is not None
        assert (claimed.lease_expires_at - clock.now()).total_seconds() == pytest.approx(expected, abs=0.5)
    clock.advance(1)
    beats = await transport.heartbeat([HeartbeatRequest(c.delivery_id, c.lease_token, lease_seconds=asked)
                                       for c in (d, e)])
    for beat in beats:
        assert beat.alive and beat.lease_expires_at is not None
        assert (beat.lease_expires_at - clock.now()).total_seconds() == pytest.approx(expected, abs=0.5)


@pytest.mark.parametrize("kind", ["memory", "postgresql", "sqlite"])
async def test_the_oldest_pending_wait_counts_from_when_a_delivery_became_due(
        kind: str, pg_url: str, sqlite_url: str) -> None:
    """``stats().oldest_pending_at`` (and ``workqueue_oldest_pending_age_seconds``, which operators
    alert on) is since when the longest-waiting due delivery waits: a message delayed by an hour
    is not waiting, however long ago it was published (it counted from its creation)."""
    from datetime import UTC, datetime, timedelta

    if kind == "memory":
        transport: Any = MemoryTransport(f"memory://oldest-{uuid.uuid4().hex}")
    elif kind == "postgresql":
        transport = PostgresTransport(pg_url, listen=False, pool_max_size=4)
    else:
        transport = SqliteTransport(sqlite_url)
    await transport.open()
    try:
        w = await make_world(transport, [dict(role="a")])
        await w.publish_one(payload="later", not_before=datetime.now(UTC) + timedelta(hours=1))
        [stats] = await transport.stats(w["a"])
        assert stats.pending == 1 and stats.oldest_pending_at is None
        before = datetime.now(UTC)
        await w.publish_one(payload="now")
        after = datetime.now(UTC)
        [stats] = await transport.stats(w["a"])
        assert stats.pending == 2 and stats.oldest_pending_at is not None
        assert before - timedelta(seconds=1) <= stats.oldest_pending_at <= after + timedelta(seconds=1)
    finally:
        await transport.close()
