"""The stats history: one point per subscription a minute, written by the sweeper, read by the
dashboard's chart of throughput and depth.

A point holds the live counts when it was recorded and the deliveries Completed in the window
before it (``window_seconds`` long, ending 30 seconds before ``recorded_at``). A transport that keeps
the history implements :class:`StatsHistoryReader`; the database transports do.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol, runtime_checkable

from .wire import WireModel


class StatsPoint(WireModel):
    """One subscription's counts at ``recorded_at``, and its completions in the window before."""

    subscription: str
    recorded_at: datetime
    pending: int
    in_flight: int
    dead_lettered: int
    completed: int
    window_seconds: float

    @property
    def completed_per_minute(self) -> float:
        """The throughput of the point's window, in completions a minute."""
        return self.completed * 60.0 / self.window_seconds if self.window_seconds > 0 else 0.0


@runtime_checkable
class StatsHistoryReader(Protocol):
    """A transport that keeps the stats history."""

    async def stats_history(self, since: datetime, subscription: str | None = None) -> list[StatsPoint]:
        """The points recorded since ``since`` (at most a day back), oldest first."""
        ...
