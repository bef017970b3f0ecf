"""The dashboard's routines for SQLite, as PostgreSQL's (``sql/postgresql/schema.sql``
says what they count and why): the stats history (``record_stats_history``, ``stats_history``) and
the bounded reads of the live work (``live_counts``, ``blocked_keys``).

SQLite has one writer, so the look at the last row and the insert that follows it cannot be
interleaved with another process's: no lock of their own is needed.
"""

from __future__ import annotations

from datetime import datetime

from .sqlite_routines import Call, Row, epoch, routine, ts

SETTLE_LAG_SECONDS = 30.0
"""Completions are counted up to this long before the pass: a settle's time is taken when its
transaction starts, and one still running has not committed."""
LONGEST_WINDOW_SECONDS = 3600.0
"""A previous row older than this starts a fresh one-minute window, so a count never scans more."""


@routine
async def r_record_stats_history(c: Call, p_keep_seconds: float = 86400.0, p_now: datetime | None = None) -> list[Row]:
    now = c.now if p_now is None else float(epoch(p_now) or c.now)
    [last_row] = await c.ex.fetch("stats_history_last")
    last = last_row["recorded_at"]
    if last is not None and last >= now - now % 60:
        return [{"record_stats_history": 0}]
    counted_to = now - SETTLE_LAG_SECONDS
    if last is not None and last > now - LONGEST_WINDOW_SECONDS:
        counted_from = last - SETTLE_LAG_SECONDS
    else:
        counted_from = counted_to - 60
    written = await c.ex.execute(
        "stats_history_insert", now=now, counted_from=counted_from, counted_to=counted_to,
        window_seconds=counted_to - counted_from,
    )
    await c.ex.execute("stats_history_purge", before=now - p_keep_seconds)
    return [{"record_stats_history": written}]


@routine
async def r_stats_history(c: Call, p_since: datetime, p_subscription: str | None = None) -> list[Row]:
    since = max(float(epoch(p_since) or 0.0), c.now - 86400.0)
    rows = await c.ex.fetch("stats_history", since=since, subscription=p_subscription)
    for row in rows:
        row["recorded_at"] = ts(row["recorded_at"])
    return rows


@routine
async def r_live_counts(c: Call, p_subscription: str | None = None, p_cap: int = 1000,
                        p_stuck_before: datetime | None = None) -> list[Row]:
    rows = await c.ex.fetch("live_counts", subscription=p_subscription, cap=p_cap,
                            stuck_before=None if p_stuck_before is None else p_stuck_before.timestamp())
    for row in rows:
        row["oldest_pending_at"] = ts(row["oldest_pending_at"])
    return rows


@routine
async def r_blocked_keys(c: Call, p_subscription: str, p_limit: int, p_cap: int = 1000) -> list[Row]:
    rows = await c.ex.fetch("blocked_keys", subscription=p_subscription, limit=p_limit, cap=p_cap, now=c.now)
    for row in rows:
        row["head_visible_at"] = ts(row["head_visible_at"])
    return rows
