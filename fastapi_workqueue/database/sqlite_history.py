"""The dashboard's routines for SQLite, as PostgreSQL's (``sql/postgresql/schema.sql``
says what they count and why): the stats history (``record_stats_history``, ``stats_history``) and
the bounded reads of the live work (``live_counts``, ``blocked_keys``, ``flow_state``).

SQLite has one writer, so the look at the last row and the insert that follows it cannot be
interleaved with another process's: no lock of their own is needed.
"""

from __future__ import annotations

import json
from datetime import datetime

from ..core.flow import parse_rate, refill
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


@routine
async def r_flow_state(c: Call, p_subscription: str, p_cap: int = 1000, p_now: datetime | None = None) -> list[Row]:
    """How full a subscription's flow limits are (as PostgreSQL's flow_state counts it)."""
    c = c.at(p_now)
    subs = await c.ex.fetch("subscription_get", name=p_subscription)
    if not subs:
        return []
    sub = subs[0]
    key_concurrency = sub["key_concurrency"] if sub["partition_mode"] == "None" else None
    rate = parse_rate(sub["rate_limit"]) if sub["rate_limit"] else None
    key_rate = parse_rate(sub["key_rate_limit"]) if sub["key_rate_limit"] else None
    [busy] = await c.ex.fetch("in_flight_count", subscription_id=sub["id"], now=c.now)
    in_flight = min(busy["n"], p_cap)
    buckets = await c.ex.fetch("rate_buckets", subscription_id=sub["id"]) if rate or key_rate else []
    tokens = None
    if rate is not None:
        own = [b for b in buckets if not b["per_key"]]
        tokens = refill(own[0]["tokens"] if own else None, own[0]["updated_at"] if own else None, c.now, rate)
    keys: set[str] = set()
    if key_concurrency is not None:
        keys |= {r["partition_key"] for r in await c.ex.fetch("in_flight_keys", subscription_id=sub["id"], now=c.now)
                 if r["n"] >= key_concurrency}
    if key_rate is not None:
        keys |= {b["partition_key"] for b in buckets
                 if b["per_key"] and refill(b["tokens"], b["updated_at"], c.now, key_rate) < 1}
    full = ((sub["max_in_flight"] is not None and in_flight >= sub["max_in_flight"])
            or (tokens is not None and tokens < 1))
    topic = await c.ex.fetch("topic_get", name=sub["topic"])
    paused = sub["status"] == "Paused" or (bool(topic) and topic[0]["status"] == "Paused")
    waiting = 0  # (paused: nothing is claimable, so no limit holds anything back)
    if not paused:
        [found] = await c.ex.fetch("flow_waiting", subscription_id=sub["id"], now=c.now, full=int(full),
                                   keys=json.dumps(sorted(keys)), cap=p_cap)
        waiting = found["n"]
    return [{"in_flight": in_flight, "tokens": tokens, "keys_at_limit": min(len(keys), p_cap),
             "waiting": waiting}]
