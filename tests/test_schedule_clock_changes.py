"""Schedules across changes of the local clock, and catch-up with nothing to count from.

A cron schedule in a timezone with summer time has an hour that repeats when summer time ends:
every tick in it is a tick of the schedule (SPEC §8: exactly one dispatch per tick). The ticks a
step back finds (``ticks_between``, what the dispatch loop queues after a busy spell, and
``catch_up``) must be the ones the loop's wake-ups (``next_after``) count, one by one.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from fastapi_workqueue import WorkQueue, WorkQueueSettings
from fastapi_workqueue.jobs.schedules import Schedule

from .support import FAST

CLOCK_CHANGES = [  # (timezone, a moment of the change in UTC)
    ("America/New_York", datetime(2026, 11, 1, 6, 0, tzinfo=UTC)),   # 02:00 EDT -> 01:00 EST
    ("America/New_York", datetime(2026, 3, 8, 7, 0, tzinfo=UTC)),    # 02:00 EST -> 03:00 EDT
    ("Europe/Berlin", datetime(2026, 10, 25, 1, 0, tzinfo=UTC)),     # 03:00 CEST -> 02:00 CET
    ("Europe/Berlin", datetime(2026, 3, 29, 1, 0, tzinfo=UTC)),      # 02:00 CET -> 03:00 CEST
    ("Australia/Sydney", datetime(2026, 4, 4, 16, 0, tzinfo=UTC)),   # 03:00 AEDT -> 02:00 AEST
]
# (Not Australia/Lord_Howe, whose clock goes back half an hour: croniter's next tick there skips the
# repeated half hour's ticks, so the wake-ups themselves miss them; see the jobs docs.)
CRONS = ["*/15 * * * *", "0 * * * *", "30 1 * * *", "0 2 * * *", "*/7 1-3 * * *"]


def _queue() -> WorkQueue:
    return WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///:memory:", enabled=False))


def _counted_forward(schedule: Schedule, after: datetime, until: datetime) -> list[datetime]:
    ticks, moment = [], after
    while (following := schedule.next_after(moment)) <= until:
        ticks.append(following)
        moment = following
    return ticks


@pytest.mark.parametrize(("timezone", "change"), CLOCK_CHANGES)
def test_a_step_back_finds_every_tick_the_wake_ups_count(timezone: str, change: datetime) -> None:
    queue = _queue()

    @queue.job("clock.tick")
    async def tick(payload: dict[str, Any]) -> None:
        pass

    for cron in CRONS:
        schedule = queue.schedule(tick, cron=cron, payload={}, timezone=timezone, name=f"{cron}@{timezone}")
        assert isinstance(schedule, Schedule)
        after, until = change - timedelta(hours=5), change + timedelta(hours=5)
        expected = _counted_forward(schedule, after, until)
        assert schedule.ticks_between(after, until) == expected, cron
        assert len(set(expected)) == len(expected)
        # Every window the loop may look back over, ending at each tick and just before it.
        for end in expected:
            for moment in (end, end - timedelta(microseconds=1), end + timedelta(minutes=1)):
                prior = [t for t in expected if t <= moment]
                found = schedule.previous_at_or_before(moment)
                assert found == max(prior) if prior else found <= after, (cron, moment, found)


async def test_the_repeated_hour_is_dispatched_tick_by_tick(tmp_path: Any) -> None:
    """The dispatch loop, driven at the wake-ups it would sleep until, through the end of summer
    time in New York: one job per tick, the repeated hour's four included."""
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", auto_migrate=True,
                                        enabled=False, **FAST))

    @queue.job("clock.quarter")
    async def quarter(payload: dict[str, Any]) -> None:
        pass

    schedule = queue.schedule(quarter, cron="*/15 * * * *", payload={}, timezone="America/New_York")
    assert isinstance(schedule, Schedule)
    start = datetime(2026, 11, 1, 4, 50, tzinfo=UTC)
    async with queue.lifespan(None):
        moment, queued, end = start, 0, datetime(2026, 11, 1, 7, 10, tzinfo=UTC)
        await queue.jobs.schedules.run_due(moment)
        while (wake := schedule.next_after(moment) + timedelta(milliseconds=30)) < end:
            moment = wake
            queued += await queue.jobs.schedules.run_due(moment)
        expected = _counted_forward(schedule, start, moment)
        known = await queue.transport.known_messages([schedule.tick_id(t) for t in expected])
    assert [t.strftime("%H:%M") for t in expected] == [
        "05:00", "05:15", "05:30", "05:45", "06:00", "06:15", "06:30", "06:45", "07:00"]  # 06:xx: 01:xx EST again
    assert queued == 9 and known == {schedule.tick_id(t) for t in expected}


async def test_catch_up_with_no_tick_known_starts_from_now(tmp_path: Any) -> None:
    """A catch_up schedule the store knows no tick of (new, or its jobs purged with the retention)
    has nothing to count from: it queues the tick that is due now, not the last 1,000."""
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", auto_migrate=True,
                                        enabled=False, **FAST))

    @queue.job(f"clock.daily-{uuid.uuid4().hex[:6]}")
    async def daily(payload: dict[str, Any]) -> None:
        pass

    schedule = queue.schedule(daily, cron="0 3 * * *", payload={}, catch_up=True)
    assert isinstance(schedule, Schedule)
    async with queue.lifespan(None):
        assert await queue.run_schedules(datetime(2026, 12, 1, 3, 0, 20, tzinfo=UTC)) == 1  # due now
        # Known from now on: a process that starts after two missed days catches those up.
        queue.jobs.schedules._last.clear()
        assert await queue.jobs.schedules.run_due(datetime(2026, 12, 3, 9, 0, tzinfo=UTC)) == 2
        assert await queue.size() == 3
    other = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'other.db'}",
                                        auto_migrate=True, enabled=False, **FAST))

    @other.job("clock.late")
    async def late_job(payload: dict[str, Any]) -> None:
        pass

    late = other.schedule(late_job, cron="0 3 * * *", payload={}, catch_up=True)
    assert isinstance(late, Schedule)
    async with other.lifespan(None):
        assert await other.jobs.schedules.run_due(datetime(2026, 12, 1, 9, 0, tzinfo=UTC)) == 0  # 03:00 long past
        assert await other.size() == 0


@pytest.mark.parametrize(("cron", "says"), [
    ("0 */5 * * * *", "is not a cron expression (five fields: minute hour day-of-month month day-of-week, "
                      "e.g. '*/5 * * * *') (a sixth field would be read as seconds)"),
    ("* * * * * *", "a sixth field would be read as seconds"),
    ("0 0 31 2 *", "never matches a date"),
])
def test_a_cron_that_cannot_mean_five_fields_or_never_matches_is_refused_at_declaration(cron: str, says: str) -> None:
    from fastapi_workqueue import ConfigurationError

    queue = _queue()

    @queue.job(f"tick-{uuid.uuid4().hex[:8]}")
    async def tick(payload: dict[str, Any]) -> None:
        return None

    with pytest.raises(ConfigurationError, match=re.escape(says)):
        queue.schedule(tick, cron=cron, payload={})
    assert queue.schedule(tick, cron="@hourly", payload={}, name="macro").cron == "@hourly"


async def test_a_schedule_whose_next_tick_fails_leaves_the_others_running(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", auto_migrate=True,
                                        enabled=False, **FAST))

    @queue.job(f"tick-{uuid.uuid4().hex[:8]}")
    async def tick(payload: dict[str, Any]) -> None:
        return None

    broken = queue.schedule(tick, every=timedelta(seconds=60), payload={}, name="broken")
    queue.schedule(tick, every=timedelta(seconds=60), payload={}, name="fine")

    for method in ("previous_at_or_before", "next_after"):
        original = getattr(Schedule, method)

        def failing(self: Schedule, moment: datetime, original: Any = original) -> datetime:
            if self.name == "broken":
                raise RuntimeError("no next tick")
            return original(self, moment)  # type: ignore[no-any-return]

        monkeypatch.setattr(Schedule, method, failing)
    async with queue.lifespan(None):
        schedules = queue.jobs.schedules
        with pytest.raises(RuntimeError, match="no next tick"):
            await schedules.run_due(datetime(2026, 12, 1, 8, 0, 1, tzinfo=UTC))
        assert "fine" in schedules._last and "broken" not in schedules._last  # the fine one ran its tick
        now = datetime.now(UTC)
        assert schedules._next_tick(broken, now) == now + timedelta(seconds=60)


def test_a_timezone_on_an_every_schedule_is_refused_saying_cron_takes_it() -> None:
    from fastapi_workqueue import ConfigurationError

    queue = _queue()

    @queue.job(f"tick-{uuid.uuid4().hex[:8]}")
    async def tick(payload: dict[str, Any]) -> None:
        return None

    with pytest.raises(ConfigurationError, match=re.escape(
            "timezone='Europe/Berlin' applies to cron schedules; an every= schedule ticks on whole multiples")):
        queue.schedule(tick, every=timedelta(days=1), payload={}, timezone="Europe/Berlin")
    assert queue.schedule(tick, every=timedelta(days=1), payload={}, timezone="UTC").every == timedelta(days=1)
    for name in ("Etc/UTC", "GMT", "Zulu"):  # UTC by its other names
        assert queue.schedule(tick, every=60, payload={}, timezone=name, name=f"in-{name}").timezone == name
