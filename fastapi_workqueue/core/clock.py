"""The clock a transport reads for the time-based rules: leases, retry and delay visibility,
retention.

A transport given the :data:`SYSTEM_CLOCK` (its default) passes no time at all, and the database
reads its own clock (PostgreSQL's ``now()``, SQL Server's ``SYSDATETIMEOFFSET()``, the time an
SQLite routine starts): every process agrees on one clock whatever its own says. A test passes a
clock it moves instead (:class:`ManualClock`); claims, heartbeats, settles (a release is one),
sweeps and prunes then run at that clock's time, so a lease runs out or a retry comes due without waiting.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """What a transport reads the time from."""

    def now(self) -> datetime:
        """The current time, timezone-aware."""
        ...


class SystemClock:
    """The real time. A transport given it lets the database read its own clock."""

    def now(self) -> datetime:
        return datetime.now(UTC)


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock a test moves: the real time plus what :meth:`advance` added, so work published at
    the real time is already due at the clock's and a lease runs out when the test says so."""

    def __init__(self) -> None:
        self.offset = timedelta()

    def now(self) -> datetime:
        """The real time plus every :meth:`advance` so far, timezone-aware."""
        return datetime.now(UTC) + self.offset

    def advance(self, seconds: float) -> datetime:
        """Moves the clock ``seconds`` forward (never back); returns the new time."""
        if not seconds >= 0:
            raise ValueError(f"a clock moves forward: advance by zero seconds or more, got {seconds!r}")
        self.offset += timedelta(seconds=seconds)
        return self.now()


def time_to_pass(clock: Clock) -> datetime | None:
    """The time a transport passes to a routine as ``p_now``: None for the system clock (the
    database reads its own, and a NULL parameter costs nothing), the clock's time otherwise."""
    if isinstance(clock, SystemClock):
        return None
    moment = clock.now()
    if moment.tzinfo is None:
        raise ValueError(f"{type(clock).__name__}.now() must return an aware datetime, e.g. datetime.now(UTC); "
                         f"got {moment!r}")
    return moment



@runtime_checkable
class StoreClock(Protocol):
    """A transport that tells the time by its store's clock (the database's, where it has one)."""

    async def store_now(self) -> datetime: ...


async def store_now(clock: StoreClock | None) -> datetime:
    """The time by the store's clock (``queue.ports.clock``), for ages of what it stamped (the
    oldest Pending delivery's wait, a delivery's time in flight): a process whose clock is off from
    the database's would otherwise read ages off by as much. The process's clock without one."""
    return datetime.now(UTC) if clock is None else await clock.store_now()
