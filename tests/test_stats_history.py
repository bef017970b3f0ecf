"""The stats history the sweeper writes and the dashboard charts.

Each case runs on a database of its own, PostgreSQL and SQLite, with the routine's clock given
(``now=``) and the settle times of completed deliveries set with a direct statement, so the
windows it counts are known exactly.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiosqlite
import asyncpg
import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.history import StatsHistoryReader
from fastapi_workqueue.core.transport import Settlement
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn
from fastapi_workqueue.database.routines import RoutineTransport
from fastapi_workqueue.database.sqlite import SqliteTransport

from .conftest import unique
from .test_migrations import scratch_url  # noqa: F401  (a fixture: an empty database of its own)

pytestmark = pytest.mark.timeout(60)


@dataclass
class Store:
    dialect: str
    transport: RoutineTransport
    url: str

    async def set_settled_at(self, delivery_ids: list[str], when: datetime) -> None:
        """Moves the settle time of deliveries (as if they had been settled at ``when``)."""
        ids = [int(i) for i in delivery_ids]
        if self.dialect == "postgresql":
            conn = await asyncpg.connect(to_asyncpg_dsn(self.url))
            try:
                await conn.execute("UPDATE workqueue.delivery SET settled_at = $1 WHERE id = ANY($2)", when, ids)
            finally:
                await conn.close()
            return
        assert isinstance(self.transport, SqliteTransport)
        async with aiosqlite.connect(self.transport.path, timeout=10) as db:
            await db.executemany("UPDATE delivery SET settled_at = ? WHERE id = ?",
                                 [(when.timestamp(), i) for i in ids])
            await db.commit()

    async def drop_history_routine(self) -> None:
        conn = await asyncpg.connect(to_asyncpg_dsn(self.url))
        try:
            await conn.execute("DROP FUNCTION workqueue.record_stats_history(double precision, timestamptz)")
        finally:
            await conn.close()


@pytest.fixture(params=["postgresql", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path, scratch_url: str) -> AsyncIterator[Store]:  # noqa: F811
    transport: RoutineTransport
    if request.param == "postgresql":
        url = scratch_url
        transport = PostgresTransport(url, listen=False, pool_max_size=2)
    else:
        url = f"sqlite+aiosqlite:///{tmp_path / 'history.db'}"
        transport = SqliteTransport(url)
    await transport.open()
    try:
        await transport.migrate()
        yield Store(request.param, transport, url)
    finally:
        await transport.close()


async def a_subscription_with_work(transport: RoutineTransport) -> tuple[str, list[str]]:
    """A subscription with 2 Pending, 1 InFlight, 1 DeadLettered and 3 Completed deliveries;
    returns its name and the ids of the completed ones."""
    topic, sub = unique("history"), unique("charted")
    await transport.sync_topology([Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="h")])
    await transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(7)])
    claimed = await transport.claim(sub, 5)
    await transport.settle([Settlement(c.delivery_id, c.lease_token, "Complete") for c in claimed[:3]]
                           + [Settlement(claimed[3].delivery_id, claimed[3].lease_token, "DeadLetter", reason="x")])
    return sub, [c.delivery_id for c in claimed[:3]]


def minute(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)


async def points(transport: RoutineTransport, sub: str, since: datetime) -> list[Any]:
    return await transport.stats_history(since, sub)


async def test_a_point_holds_the_live_counts_and_the_completions_of_its_window(store: Store) -> None:
    transport = store.transport
    assert isinstance(transport, StatsHistoryReader)
    sub, completed = await a_subscription_with_work(transport)
    start = minute(datetime.now(UTC)) + timedelta(minutes=10)  # a minute no other pass has written
    # Two completions inside the first window (the minute ending 30 s before the pass), one after it.
    await store.set_settled_at(completed[:2], start - timedelta(seconds=60))
    await store.set_settled_at(completed[2:], start - timedelta(seconds=10))

    assert await transport.record_stats_history(now=start + timedelta(seconds=5)) == 1
    [first] = await points(transport, sub, start - timedelta(hours=1))
    assert (first.pending, first.in_flight, first.dead_lettered) == (2, 1, 1)
    assert (first.completed, first.window_seconds) == (2, 60.0)
    assert first.recorded_at == start + timedelta(seconds=5)
    assert first.completed_per_minute == 2.0

    # Once a minute: a second pass in the same minute writes nothing.
    assert await transport.record_stats_history(now=start + timedelta(seconds=50)) == 0
    assert len(await points(transport, sub, start - timedelta(hours=1))) == 1

    # The next window starts where the first ended: the third completion is counted once.
    assert await transport.record_stats_history(now=start + timedelta(seconds=65)) == 1
    second = (await points(transport, sub, start - timedelta(hours=1)))[-1]
    assert (second.completed, second.window_seconds) == (1, 60.0)

    # An hour without a pass (no host ran): the next window is one minute again, not the gap.
    later = start + timedelta(hours=2)
    assert await transport.record_stats_history(now=later) == 1
    third = (await points(transport, sub, start - timedelta(hours=1)))[-1]
    assert (third.completed, third.window_seconds) == (0, 60.0)


async def test_points_older_than_the_keeping_time_are_deleted(store: Store) -> None:
    transport = store.transport
    sub, _ = await a_subscription_with_work(transport)
    start = minute(datetime.now(UTC)) - timedelta(minutes=50)
    for step in range(3):
        assert await transport.record_stats_history(now=start + timedelta(minutes=step)) == 1
    kept = await points(transport, sub, start - timedelta(hours=1))
    assert len(kept) == 3
    # A pass 40 minutes on, keeping half an hour: the three older points go.
    assert await transport.record_stats_history(now=start + timedelta(minutes=40), keep_seconds=1800) == 1
    assert [p.recorded_at for p in await points(transport, sub, start - timedelta(hours=1))] == [
        start + timedelta(minutes=40)
    ]


async def test_the_history_of_all_subscriptions_and_of_one(store: Store) -> None:
    transport = store.transport
    one, _ = await a_subscription_with_work(transport)
    other, _ = await a_subscription_with_work(transport)
    at = minute(datetime.now(UTC)) - timedelta(minutes=5)
    assert await transport.record_stats_history(now=at) == 2
    every = await transport.stats_history(at - timedelta(minutes=1))
    assert sorted(p.subscription for p in every) == sorted([one, other])
    assert [p.subscription for p in await transport.stats_history(at - timedelta(minutes=1), other)] == [other]
    assert await transport.stats_history(at + timedelta(seconds=1)) == []


async def test_a_sweep_that_ran_records_the_minute(store: Store) -> None:
    transport = store.transport
    sub, _ = await a_subscription_with_work(transport)
    before = datetime.now(UTC) - timedelta(seconds=1)
    assert (await transport.sweep()).ran
    [point] = await points(transport, sub, before)
    assert (point.pending, point.in_flight, point.dead_lettered) == (2, 1, 1)
    assert (await transport.sweep()).ran  # the same minute: no second point
    assert len(await points(transport, sub, before)) == 1


async def test_a_sweep_stands_when_the_history_cannot_be_written(
    scratch_url: str, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """A database whose history routine is missing (not migrated to it, or the role lacks
    EXECUTE) still sweeps; the pass logs why the chart lacks the minute, once as a warning."""
    transport = PostgresTransport(scratch_url, listen=False, pool_max_size=2)
    await transport.open()
    try:
        await transport.migrate()
        await Store("postgresql", transport, scratch_url).drop_history_routine()
        with caplog.at_level(logging.DEBUG, logger="fastapi_workqueue.database"):
            assert (await transport.sweep()).ran
            transport._history_minute = None  # as in the next minute
            assert (await transport.sweep()).ran
    finally:
        await transport.close()
    records = [r for r in caplog.records if "stats history was not recorded" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG]
