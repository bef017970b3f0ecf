"""The clock a transport reads: claims, heartbeats, settles (a release is one) and sweeps run at the
time of the clock it was given, so leases, retries, delays and retention are tested without
waiting; the system clock (the default) passes no time and the database reads its own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.clock import SYSTEM_CLOCK, ManualClock, SystemClock, time_to_pass
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.transport import HeartbeatRequest, Settlement
from fastapi_workqueue.database import create_database_transport

from .conftest import unique
from .support import sweep_until_done

pytestmark = pytest.mark.timeout(60)

LEASE = 30.0


class FixedClock:
    """A clock that stands still until the test moves it: every time it gives is known exactly."""

    def __init__(self, start: datetime) -> None:
        self.time = start

    def now(self) -> datetime:
        return self.time

    def move(self, seconds: float) -> None:
        self.time += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> FixedClock:
    # An hour ahead of the real time: what is published now is due by the clock's time.
    return FixedClock(datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1))


@pytest.fixture
async def transport(database_url: str, clock: FixedClock) -> AsyncIterator[Any]:
    transport = create_database_transport(database_url, clock=clock, listen=False, pool_max_size=2)
    await transport.open()
    try:
        await transport.migrate()
        yield transport
    finally:
        await transport.close()


async def one_delivery(transport: Any, **subscription: Any) -> tuple[str, Any]:
    topic, sub = unique("clock"), unique("timed")
    await transport.sync_topology(
        [Topic(name=topic)],
        [Subscription(name=sub, topic=topic, handler_key="h", lease_seconds=LEASE, **subscription)],
    )
    await transport.publish(topic, [prepare(PublishRequest(payload={"n": 1}))])
    [claimed] = await transport.claim(sub, 1)
    return sub, claimed


async def test_a_claim_leases_from_the_clocks_time(transport: Any, clock: FixedClock) -> None:
    _, claimed = await one_delivery(transport)
    assert claimed.lease_expires_at == clock.time + timedelta(seconds=LEASE)
    info = await transport.get_delivery(claimed.delivery_id)
    assert info.claimed_at == clock.time and info.lease_expires_at == claimed.lease_expires_at


async def test_claim_many_leases_from_the_clocks_time(transport: Any, clock: FixedClock) -> None:
    topic, sub = unique("clock"), unique("many")
    await transport.sync_topology([Topic(name=topic)],
                                  [Subscription(name=sub, topic=topic, handler_key="h", lease_seconds=LEASE)])
    await transport.publish(topic, [prepare(PublishRequest(payload=1))])
    [(name, claimed)] = await transport.claim_many([sub], 5)
    assert name == sub and claimed.lease_expires_at == clock.time + timedelta(seconds=LEASE)


async def test_a_heartbeat_renews_from_the_clocks_time(transport: Any, clock: FixedClock) -> None:
    _, claimed = await one_delivery(transport)
    clock.move(20)
    [beat] = await transport.heartbeat([HeartbeatRequest(claimed.delivery_id, claimed.lease_token, 50, "half")])
    assert beat.alive and beat.lease_expires_at == clock.time + timedelta(seconds=LEASE)


async def test_a_lease_runs_out_when_the_clock_passes_it(transport: Any, clock: FixedClock) -> None:
    """The sweeper takes a lease back only once the clock is past it: no sleep, no rewritten row."""
    _, claimed = await one_delivery(transport)
    clock.move(LEASE - 1)
    await transport.sweep()
    assert (await transport.get_delivery(claimed.delivery_id)).status == "InFlight"
    clock.move(2)
    assert claimed.delivery_id in await sweep_until_done(transport)
    info = await transport.get_delivery(claimed.delivery_id)
    assert info.status == "Pending" and info.reason == "lease expired" and info.visible_at >= clock.time


async def test_a_retry_and_a_release_are_visible_after_their_delay_by_the_clock(
    transport: Any, clock: FixedClock
) -> None:
    sub, claimed = await one_delivery(transport)
    [result] = await transport.settle([Settlement(claimed.delivery_id, claimed.lease_token, "Retry", delay_seconds=30)])
    assert result == "Pending"
    assert (await transport.get_delivery(claimed.delivery_id)).visible_at == clock.time + timedelta(seconds=30)
    clock.move(29)
    assert await transport.claim(sub, 1) == []
    clock.move(2)
    [again] = await transport.claim(sub, 1)
    assert again.delivery_id == claimed.delivery_id and again.attempt == 2

    [result] = await transport.settle([Settlement(again.delivery_id, again.lease_token, "Release", delay_seconds=5)])
    info = await transport.get_delivery(again.delivery_id)
    assert result == "Pending" and info.attempt == 1 and info.visible_at == clock.time + timedelta(seconds=5)


async def test_a_completion_is_settled_and_purged_by_the_clock(transport: Any, clock: FixedClock) -> None:
    _, claimed = await one_delivery(transport, retention_seconds=60)
    [result] = await transport.settle([Settlement(claimed.delivery_id, claimed.lease_token, "Complete")])
    assert result == "Completed"
    assert (await transport.get_delivery(claimed.delivery_id)).settled_at == clock.time
    clock.move(59)
    await transport.sweep()
    assert await transport.get_delivery(claimed.delivery_id) is not None
    clock.move(2)
    report = await transport.sweep()
    assert report.purged_deliveries >= 1 and await transport.get_delivery(claimed.delivery_id) is None


async def test_prune_counts_its_age_by_the_clock(transport: Any, clock: FixedClock) -> None:
    _, claimed = await one_delivery(transport)
    await transport.settle([Settlement(claimed.delivery_id, claimed.lease_token, "Complete")])
    clock.move(20)
    await transport.prune(30)
    assert await transport.get_delivery(claimed.delivery_id) is not None
    clock.move(20)
    assert await transport.prune(30) >= 1
    assert await transport.get_delivery(claimed.delivery_id) is None


async def test_the_system_clock_passes_no_time_and_the_database_reads_its_own(database_url: str) -> None:
    transport = create_database_transport(database_url, listen=False, pool_max_size=2)
    assert transport.clock is SYSTEM_CLOCK and transport._now() is None
    await transport.open()
    try:
        await transport.migrate()
        before = datetime.now(UTC)
        _, claimed = await one_delivery(transport)
        after = datetime.now(UTC)
    finally:
        await transport.close()
    lease = timedelta(seconds=LEASE)
    slack = timedelta(seconds=1)  # the database's clock and this one, read at different moments
    assert before + lease - slack <= claimed.lease_expires_at <= after + lease + slack


def test_a_clock_must_tell_an_aware_time() -> None:
    with pytest.raises(TypeError, match="clock must have a now\\(\\) method"):
        create_database_transport("sqlite+aiosqlite:///unused.db", clock=object())

    class Naive:
        def now(self) -> datetime:
            return datetime(2030, 1, 1)

    with pytest.raises(ValueError, match="aware datetime"):
        time_to_pass(Naive())
    assert time_to_pass(SystemClock()) is None


def test_a_manual_clock_moves_forward_only() -> None:
    manual = ManualClock()
    start = manual.now()
    assert manual.advance(90) - start >= timedelta(seconds=90)
    assert time_to_pass(manual) is not None
    with pytest.raises(ValueError, match="moves forward"):
        manual.advance(-1)


TIMED = ("claim", "claim_many", "heartbeat", "settle", "expire_leases", "purge", "sweep", "prune")


@pytest.mark.parametrize("name", TIMED)
def test_each_timed_routine_reads_the_given_time_or_its_databases_once(name: str) -> None:
    """PostgreSQL: ``coalesce(p_now, now())`` once and no other ``now()``; SQL Server the same with
    ``SYSDATETIMEOFFSET()`` (no server runs here: the text is checked). A claim of a limited
    subscription reads the clock again once it holds the claim lock, and only without a given time."""
    from fastapi_workqueue.database import sql_files

    relock_pg = "IF p_now IS NULL THEN\n            v_now := clock_timestamp();"
    relock_ms = "IF @p_now IS NULL\n                BEGIN\n                    SET @v_now = SYSDATETIMEOFFSET();"

    pg = sql_files.read("postgresql", "schema.sql")
    start = pg.index(f"CREATE OR REPLACE FUNCTION workqueue.{name}(")
    function = pg[start: pg.index("\n$$;\n", pg.index("AS $$", start))]
    assert "p_now timestamptz DEFAULT NULL" in function[: function.index("AS $$")]
    assert function.count("now()") == 1 and "v_now timestamptz := coalesce(p_now, now());" in function
    assert function.count("clock_timestamp()") == function.count(relock_pg) == (name == "claim")

    ms = sql_files.read("mssql", "schema.sql")
    start = ms.index(f"CREATE OR ALTER PROCEDURE workqueue.{name}\n")
    procedure = ms[start: ms.index("\nGO\n", start)]
    assert "@p_now datetimeoffset(6) = NULL" in procedure[: procedure.index("\nAS\n")]
    assert procedure.count("SYSDATETIMEOFFSET()") == 1 + (name == "claim")
    assert "COALESCE(@p_now, SYSDATETIMEOFFSET())" in procedure and procedure.count(relock_ms) == (name == "claim")
