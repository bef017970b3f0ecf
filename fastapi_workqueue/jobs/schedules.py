"""Schedules: ``queue.schedule(job, cron="*/5 * * * *" | every=timedelta(minutes=5), payload=...)``.

Every process whose host runs keeps the schedules and dispatches each tick that falls due, with a
MessageID made from the schedule's name and the tick's time. The store keeps one message per
MessageID, so whichever process comes first queues the job and the others are told it exists:
exactly one dispatch per tick, with no leader that could vanish. A tick missed while every process
was down is not queued afterwards, unless the schedule has ``catch_up=True``; then the ticks since
the last one the store knows are queued (the newest :data:`MAX_CATCH_UP` of them; none when the
store knows no earlier tick: a new schedule, or one whose jobs the retention purged).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ..core.envelope import MAX_DELAY_SECONDS, PublishStatus
from ..core.errors import ConfigurationError, missing_extra
from ..core.redaction import redacting_logger
from ..core.tasks import TaskScope
from .definition import Job

if TYPE_CHECKING:
    from .layer import Jobs

log = redacting_logger("fastapi_workqueue.jobs.schedules")

NAMESPACE = uuid.UUID("6f1c1f0e-5d2a-4f54-9a53-0f3a5b1d7c41")
"""The namespace of tick MessageIDs (uuid5 of the schedule's name and the tick)."""
LATE_GRACE = timedelta(minutes=1)
"""A tick is still queued when the scheduler sees it this late (it was busy, or just started)."""
MAX_CATCH_UP = 1000
"""The most missed ticks a ``catch_up=True`` schedule queues (the newest)."""
CATCH_UP_PROBES = 13
"""How far back, in doublings of the newest MAX_CATCH_UP ticks' span, a catch-up looks for a tick the
store knows when none of those is known (13: 4,096 spans, over 7 years of a minutely schedule)."""
PROBE_TICKS = 3
"""Consecutive ticks looked up at each of those points."""
CLOCK_CHANGE_WINDOW = timedelta(hours=3)
"""How far back a step back in local time looks for a change of the clock (summer time shifts it by
an hour, two at most anywhere)."""
MAX_SLEEP_SECONDS = 60.0
LOOK_BACK = 60
"""Ticks :meth:`Schedules.last_dispatch` looks back over."""


_UTC_NAMES = frozenset({"UTC", "Etc/UTC", "Etc/UCT", "UCT", "Etc/GMT", "GMT", "Etc/Zulu", "Zulu", "Etc/Universal",
                        "Universal", "Etc/Greenwich", "Greenwich", "GMT0", "Etc/GMT0", "Etc/GMT+0", "Etc/GMT-0"})
"""UTC's other names in the time zone database: no offset, ever."""


def _always_utc(zone: ZoneInfo) -> bool:
    """Whether ``zone`` is UTC by one of its names (``Etc/UTC``, ``GMT``, ``Zulu``)."""
    return zone.key in _UTC_NAMES


@dataclass(slots=True)
class Schedule:
    """One schedule: a job, its payload and when it runs."""

    name: str
    job: Job
    payload: Any
    cron: str | None = None
    every: timedelta | None = None
    timezone: str = "UTC"
    catch_up: bool = False
    queue: str | None = None
    _tz: ZoneInfo = field(init=False, repr=False)
    _data: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.every is None):
            raise ConfigurationError(f"schedule {self.name!r}: give either cron='*/5 * * * *' or every=timedelta(...)")
        try:
            self._tz = ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ConfigurationError(
                f"schedule {self.name!r}: unknown timezone {self.timezone!r}; use an IANA name such as 'Europe/Berlin'"
            ) from None
        if self.cron is not None:
            try:
                from croniter import croniter
            except ImportError as exc:
                raise missing_extra(f"schedule {self.name!r} (a cron expression)", "croniter", "jobs") from exc
            fields = self.cron.split()
            if not croniter.is_valid(self.cron) or (len(fields) != 5 and not self.cron.startswith("@")):
                seconds = " (a sixth field would be read as seconds)" if len(fields) == 6 else ""
                raise ConfigurationError(
                    f"schedule {self.name!r}: {self.cron!r} is not a cron expression (five fields: minute hour "
                    f"day-of-month month day-of-week, e.g. '*/5 * * * *'){seconds}"
                )
            try:
                croniter(self.cron, datetime.now(self._tz)).get_next(datetime)
            except Exception:  # croniter's CroniterBadDateError: no date within its search matches
                raise ConfigurationError(
                    f"schedule {self.name!r}: {self.cron!r} never matches a date (a day that no month has, such as "
                    "'0 0 31 2 *'); check the day-of-month and month fields"
                ) from None
        elif self.every is not None and self.every.total_seconds() < 1:
            raise ConfigurationError(f"schedule {self.name!r}: every must be at least one second, got {self.every}")
        elif self.every is not None and self.every.total_seconds() > MAX_DELAY_SECONDS:
            raise ConfigurationError(
                f"schedule {self.name!r}: every must be at most 100 years ({MAX_DELAY_SECONDS:.0f} s), "
                f"got {self.every}")
        elif self.every is not None and not _always_utc(self._tz):
            raise ConfigurationError(
                f"schedule {self.name!r}: timezone={self.timezone!r} applies to cron schedules; an every= schedule "
                "ticks on whole multiples of its interval counted in UTC. For a run at a local time, give a cron "
                "expression with the timezone (cron='0 0 * * *' for local midnight)"
            )
        self._data = self.job.validate(self.payload)

    def ticks_between(self, after: datetime, until: datetime) -> list[datetime]:
        """The ticks t with ``after < t <= until`` (UTC), oldest first: the newest MAX_CATCH_UP of them."""
        ticks: list[datetime] = []
        current = self.previous_at_or_before(until)
        while current > after and len(ticks) < MAX_CATCH_UP:
            ticks.append(current)
            earlier = self.previous_at_or_before(current - timedelta(microseconds=1))
            if earlier >= current:  # (never expected; a guard against a clock change's repeated hour)
                break
            current = earlier
        ticks.reverse()
        return ticks

    def ticks_back(self, moment: datetime, count: int) -> list[datetime]:
        """The ``count`` ticks at or before ``moment``, newest first."""
        ticks = [self.previous_at_or_before(moment)]
        while len(ticks) < count:
            ticks.append(self.previous_at_or_before(ticks[-1] - timedelta(microseconds=1)))
        return ticks

    def next_after(self, moment: datetime) -> datetime:
        """The first tick after ``moment`` (UTC in, UTC out)."""
        if self.every is not None:
            step = self.every.total_seconds()
            epoch = moment.timestamp()
            return datetime.fromtimestamp((epoch // step + 1) * step, UTC)
        from croniter import croniter

        local = moment.astimezone(self._tz)
        following: datetime = croniter(str(self.cron), local).get_next(datetime)
        return following.astimezone(UTC)

    def previous_at_or_before(self, moment: datetime) -> datetime:
        """The last tick at or before ``moment``."""
        if self.every is not None:
            step = self.every.total_seconds()
            return datetime.fromtimestamp((moment.timestamp() // step) * step, UTC)
        from croniter import croniter

        local = moment.astimezone(self._tz)
        itr = croniter(str(self.cron), local + timedelta(microseconds=1))
        found: datetime = itr.get_prev(datetime).astimezone(UTC)
        if found > moment:
            # A step back in local time inside an hour the clock repeats (summer time ended) can
            # land after ``moment``: start again from before that hour.
            found = self.previous_at_or_before(moment - CLOCK_CHANGE_WINDOW)
        # And one that crosses the repeated hour lands before it, skipping its ticks: counted
        # forward, as the dispatch loop counts (next_after), every tick is found once.
        while (following := self.next_after(found)) <= moment:
            found = following
        return found

    def tick_id(self, tick: datetime) -> uuid.UUID:
        """The job id of this schedule's dispatch at ``tick``: the same in every process, so one
        tick is one job however many processes dispatch it."""
        return uuid.uuid5(NAMESPACE, f"{self.name}@{tick.astimezone(UTC).isoformat()}")


class Schedules:
    """The schedules of one queue and the loop that dispatches their ticks."""

    def __init__(self, jobs: Jobs) -> None:
        self._jobs = jobs
        self.items: dict[str, Schedule] = {}
        self._tasks = TaskScope("workqueue-schedules")
        self._task: asyncio.Task[None] | None = None
        self._last: dict[str, datetime] = {}

    def add(self, job: Any, *, cron: str | None = None, every: timedelta | float | None = None,
            payload: Any = None, timezone: str = "UTC", catch_up: bool = False, name: str | None = None,
            queue: str | None = None) -> Schedule:
        definition = self._jobs.registry.resolve(job)
        key = name or definition.name
        if every is not None and not isinstance(every, timedelta):
            if isinstance(every, bool) or not isinstance(every, int | float):
                raise ConfigurationError(
                    f"schedule {key!r}: every={every!r} is neither a timedelta nor a number of seconds; "
                    "write every=timedelta(minutes=5) or every=300"
                )
            if not math.isfinite(every) or every > MAX_DELAY_SECONDS:
                raise ConfigurationError(f"schedule {key!r}: every={every!r} must be a finite number of seconds, at "
                                         f"most {MAX_DELAY_SECONDS:.0f} (100 years)")
            every = timedelta(seconds=every)
        if key in self.items:
            raise ConfigurationError(
                f"schedule {key!r} is declared twice; give the second one name='...' of its own"
            )
        schedule = Schedule(name=key, job=definition, payload=payload, cron=cron, every=every, timezone=timezone,
                            catch_up=catch_up, queue=queue)
        self.items[key] = schedule
        return schedule

    def listing(self, now: datetime | None = None) -> list[dict[str, Any]]:
        """Each schedule with its next run (``workqueue schedules``)."""
        moment = now or datetime.now(UTC)
        return [
            {"Name": s.name, "Job": s.job.name, "Queue": s.queue or s.job.policy.queue,
             "When": s.cron or f"every {s.every}", "Timezone": s.timezone, "CatchUp": s.catch_up,
             "NextRun": s.next_after(moment).isoformat()}
            for s in sorted(self.items.values(), key=lambda x: x.name)
        ]

    # -- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        if self.items and self._task is None:
            self._tasks.reopen()
            self._task = self._tasks.spawn(self._loop(), name="workqueue-schedules")

    async def stop(self) -> None:
        self._task = None
        await self._tasks.close()

    def forget_looks(self) -> None:
        """Forgets when each schedule last looked: the next :meth:`run_due` is a first look (a
        test's ``queue.fake()`` starts so, whatever an earlier test's fake ran)."""
        self._last.clear()

    async def run_due(self, now: datetime | None = None) -> int:
        """Dispatches every tick due at ``now``; returns how many this process queued."""
        if now is not None and now.utcoffset() is None:
            raise ValueError(f"now={now!r} has no time zone; give an aware datetime (datetime(..., tzinfo=UTC))")
        moment = now or datetime.now(UTC)
        queued = 0
        failed: Exception | None = None
        for schedule in list(self.items.values()):
            try:  # (one schedule's failure leaves the others to run)
                for tick in await self._due(schedule, moment):
                    if await self._dispatch(schedule, tick):
                        queued += 1
            except Exception as exc:
                failed = failed or exc
                continue
            self._last[schedule.name] = moment
        if failed is not None:
            raise failed
        return queued

    async def _due(self, schedule: Schedule, moment: datetime) -> list[datetime]:
        last_seen = self._last.get(schedule.name)
        if last_seen is not None:
            return schedule.ticks_between(last_seen, moment)
        # First look since this process started.
        latest = schedule.previous_at_or_before(moment)
        on_time = [latest] if moment - latest <= LATE_GRACE else []
        if not schedule.catch_up:
            return await self._late_ticks(schedule, moment) if on_time else on_time
        missed = await self._since_last_known(schedule, latest)
        if missed is None:
            log.info("schedule %s: the store holds none of its earlier ticks (a new schedule, or its jobs were "
                     "purged with the retention): nothing to catch up, it runs from now on", schedule.name)
            return on_time
        return missed

    async def _late_ticks(self, schedule: Schedule, moment: datetime) -> list[datetime]:
        """The ticks of the last :data:`LATE_GRACE` that came after the newest one the store
        knows (a schedule of less than a minute, across a restart of every process: each tick
        seen up to a minute late is queued); the newest alone when the store knows none of them
        (a new schedule starts from now, not with a minute of ticks at once)."""
        recent = schedule.ticks_between(moment - LATE_GRACE - timedelta(microseconds=1), moment)
        if len(recent) <= 1:
            return recent
        ids = [schedule.tick_id(t) for t in recent]
        known = await self._known(ids)
        newest_known = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] in known), None)
        if newest_known is not None:
            return recent[newest_known + 1:]
        # None of the last minute's: every one of them came after the newest the store knows, if it
        # knows an earlier one (all processes were down for longer than the minute); else the
        # schedule is new and starts from now.
        return recent if await self._known_before(schedule, moment, recent[0]) else recent[-1:]

    async def _known(self, ids: list[uuid.UUID]) -> set[uuid.UUID]:
        """Which of the tick ids ``ids`` the store (or the fake) holds a job for."""
        fake = self._jobs.fake
        if fake is not None:
            return {entry.id for entry in fake.records} & set(ids)
        return await self._jobs.kernel.transport.known_messages(ids)

    async def last_dispatch(self, schedule: Schedule, now: datetime | None = None, *,
                            look_back: int = LOOK_BACK) -> datetime | None:
        """The newest of the schedule's last ``look_back`` ticks that the store holds a job for
        (queued by any process), or None (none of them; or pruned since)."""
        ticks = schedule.ticks_back(now or datetime.now(UTC), look_back)
        known = await self._jobs.kernel.transport.known_messages([schedule.tick_id(t) for t in ticks])
        return next((tick for tick in ticks if schedule.tick_id(tick) in known), None)

    async def _since_last_known(self, schedule: Schedule, latest: datetime) -> list[datetime] | None:
        """Ticks after the newest one the store has a message for, up to ``latest``; None when it
        has none of the last MAX_CATCH_UP: there is nothing to count from (every one of them would
        be queued for a schedule that never ran)."""
        candidates = schedule.ticks_back(latest, MAX_CATCH_UP)
        known = await self._jobs.kernel.transport.known_messages([schedule.tick_id(t) for t in candidates])
        missing: list[datetime] = []
        for tick in candidates:
            if schedule.tick_id(tick) in known:
                return sorted(missing)
            missing.append(tick)
        if await self._known_before(schedule, latest, candidates[-1]):
            log.warning("schedule %s: every process was down for more than %d of its ticks (since before %s): the "
                        "newest %d are queued, the older ones are not", schedule.name, MAX_CATCH_UP,
                        candidates[-1].isoformat(), MAX_CATCH_UP)
            return sorted(missing)
        return None

    async def _known_before(self, schedule: Schedule, latest: datetime, oldest: datetime) -> bool:
        """Whether the store knows a tick older than ``oldest``, which tells a schedule that was down
        longer than MAX_CATCH_UP ticks from one that never ran: the MAX_CATCH_UP ticks before it, and
        a few ticks at 2, 4, 8 ... times their span further back (up to :data:`CATCH_UP_PROBES`
        doublings), where a schedule that ran for a while before it went down left ticks."""
        ids = await asyncio.to_thread(_probe_ids, schedule, latest, oldest)  # (a cron's ticks cost CPU)
        return bool(ids) and bool(await self._known(ids))

    async def _dispatch(self, schedule: Schedule, tick: datetime) -> bool:
        jobs = self._jobs
        target = schedule.queue or schedule.job.policy.queue
        request = jobs.request(schedule.job, schedule._data, job_id=schedule.tick_id(tick))
        if jobs.fake is not None:  # (a test's queue.fake(): the tick is recorded, once)
            if any(entry.id == request.message_id for entry in jobs.fake.records):
                return False
            return jobs.fake.record(schedule.job, schedule._data, target, request) is not None
        topic = await jobs.ensure_queue(target)
        # (an encrypted job's tick differs byte for byte from process to process: the one another
        # process queued answers MessageIDConflict here, as a plain job's answers Duplicate)
        [result] = await jobs.kernel.publish(topic, [request], conflict_expected=True)
        if result.status == PublishStatus.ACCEPTED:
            log.info("schedule %s: queued job %s for %s (%s)", schedule.name, schedule.job.name, tick.isoformat(),
                     result.message_id)
            return True
        if result.status in (PublishStatus.DUPLICATE, PublishStatus.MESSAGE_ID_CONFLICT):
            return False  # another process queued this tick
        log.error("schedule %s: the tick %s was refused: %s", schedule.name, tick.isoformat(),
                  result.error.message if result.error else result.status.value)
        return False

    async def _loop(self) -> None:
        while True:
            try:
                await self.run_due()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store is away: the next look tries again
                log.warning("schedules: could not queue the due ticks (%s)", exc)
            now = datetime.now(UTC)
            upcoming = min((self._next_tick(s, now) for s in self.items.values()), default=now + timedelta(seconds=60))
            await asyncio.sleep(min(max((upcoming - now).total_seconds(), 0.05), MAX_SLEEP_SECONDS))

    def _next_tick(self, schedule: Schedule, now: datetime) -> datetime:
        """The schedule's next tick after ``now``; a minute from now for one whose next tick cannot
        be found (logged), so that one schedule never stops the others."""
        try:
            return schedule.next_after(now)
        except Exception as exc:
            log.error("schedule %s: cannot find its next tick (%s); the other schedules run on", schedule.name, exc)
            return now + timedelta(seconds=60)


def _probe_ids(schedule: Schedule, latest: datetime, oldest: datetime) -> list[uuid.UUID]:
    """The tick ids :meth:`Schedules._known_before` looks up."""
    span = max(latest - oldest, timedelta(seconds=1))
    ticks: list[datetime] = []
    try:
        ticks += schedule.ticks_back(oldest - timedelta(microseconds=1), MAX_CATCH_UP)
        for power in range(1, CATCH_UP_PROBES):
            ticks += schedule.ticks_back(oldest - span * (2 ** power), PROBE_TICKS)
    except (OverflowError, ValueError, OSError):  # (before the first year a datetime holds)
        pass
    return [schedule.tick_id(tick) for tick in ticks]
