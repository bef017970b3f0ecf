"""The queue routines for SQLite: the same names, parameters and results as PostgreSQL's functions.

Each routine runs the named statements of ``sql/sqlite/queries.sql`` through an :class:`Executor`
inside the one transaction the transport opened (``BEGIN IMMEDIATE``: SQLite's single writer),
so a routine is as atomic as its PostgreSQL twin. The logic mirrors ``sql/postgresql`` step by
step; comments name the differences.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from ..core.errors import TransportError
from ..core.flow import Rate, key_rooms, parse_rate, refill, take_limited, tokens_due_in
from ..core.lifecycle import (
    LEASE_EXPIRED_ERROR,
    BackoffPolicy,
    BatchItem,
    batch_refusals,
    classify_batch,
    expire_transition,
    granted_lease,
    matches,
    repeats_stored_call,
    settle_transition,
    split_claim,
    topic_refusal,
    unkeyed_share,
)
from ..core.topology import topic_move_refused

Row = dict[str, Any]


class Executor(Protocol):
    async def fetch(self, query: str, /, **params: Any) -> list[Row]: ...
    async def execute(self, query: str, /, **params: Any) -> int: ...


@dataclass
class Call:
    """One routine call: where to run statements, the time it runs at, who to wake afterwards."""

    ex: Executor
    now: float
    wake: set[int] = field(default_factory=set)

    def at(self, moment: datetime | None) -> Call:
        """This call at ``moment`` (a routine's ``p_now``: a test's clock) instead of the time it
        took, with the same statements and wake-ups; itself when ``moment`` is None."""
        return self if moment is None else Call(self.ex, moment.timestamp(), self.wake)


Routine = Callable[..., Awaitable[list[Row]]]
ROUTINES: dict[str, Routine] = {}
READ_ONLY = {"stats", "backlog", "get_delivery", "list_deliveries", "partitions", "list_subscriptions",
             "list_topics", "schema_versions", "api_key_list", "api_key_verify", "api_key_session", "known_messages",
             "message_deliveries", "delivery_attempts", "result_get", "group_members",
             "search_deliveries", "step_get", "stats_history", "live_counts", "blocked_keys", "flow_state",
             "list_processes"}
"""Routines that only read: they run in a deferred transaction, beside a writer (WAL)."""


def routine(fn: Routine) -> Routine:
    ROUTINES[fn.__name__.removeprefix("r_")] = fn
    return fn


def ts(value: float | None) -> datetime | None:
    """Epoch seconds → an aware UTC datetime."""
    return None if value is None else datetime.fromtimestamp(value, UTC)


def epoch(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def backoff_policy(d: Row) -> BackoffPolicy:
    """A delivery row's backoff (its subscription's, or the schedule it was published with: JSON)."""
    schedule = d["backoff_schedule"]
    return BackoffPolicy(d["backoff_base_seconds"], d["backoff_max_seconds"],
                         json.loads(schedule) if schedule else None)


# -- partitions ----------------------------------------------------------------------------------


async def refresh_partition(c: Call, subscription_id: int, key: str, mode: int) -> bool:
    """Re-derives a key's row from its deliveries; True when the key can be claimed now."""
    await c.ex.execute("partition_touch", subscription_id=subscription_id, key=key)
    [part] = await c.ex.fetch("partition_get", subscription_id=subscription_id, key=key)
    holder = part["holder_id"]
    if holder is not None:
        rows = await c.ex.fetch("delivery_status", id=holder)
        if not rows or rows[0]["status"] != "InFlight":
            holder = None
    next_id: int | None = None
    next_visible: float | None = None
    next_priority = 0
    blocked: int | None = None
    if mode == 2:
        heads = await c.ex.fetch("ordered_head", subscription_id=subscription_id, key=key)
        if heads:
            head = heads[0]
            if head["status"] == "InFlight":
                holder = head["id"]
            elif head["status"] == "DeadLettered":
                blocked = head["id"]
            elif holder is None:
                next_id, next_visible, next_priority = head["id"], head["visible_at"], head["priority"]
    elif holder is None:
        nxt = await c.ex.fetch("exclusive_next", subscription_id=subscription_id, key=key)
        if nxt:
            next_id, next_visible, next_priority = nxt[0]["id"], nxt[0]["visible_at"], nxt[0]["priority"]
    if holder is None and next_id is None and blocked is None:
        await c.ex.execute("partition_delete", subscription_id=subscription_id, key=key)
        return False
    await c.ex.execute(
        "partition_set", subscription_id=subscription_id, key=key, holder_id=holder, next_id=next_id,
        next_visible_at=next_visible, blocked_id=blocked, next_priority=next_priority,
    )
    return holder is None and next_visible is not None and next_visible <= c.now


async def _count_settled(c: Call, statuses: Sequence[tuple[int, str]], sign: int = 1) -> None:
    """Adds (or, with sign -1, takes away) Completed and Discarded deliveries to settled_count, one
    statement per subscription: stats reads the terminal counts there, not from the history."""
    tally: dict[int, list[int]] = {}
    for subscription_id, status in statuses:
        if status in ("Completed", "Discarded"):
            counts = tally.setdefault(subscription_id, [0, 0])
            counts[status == "Discarded"] += sign
    for subscription_id, (completed, discarded) in sorted(tally.items()):
        await c.ex.execute("settled_count_add", subscription_id=subscription_id, completed=completed,
                           discarded=discarded)


async def _refresh_keys(c: Call, keys: set[tuple[int, str, int]]) -> None:
    for subscription_id, key, mode in sorted(keys):
        if await refresh_partition(c, subscription_id, key, mode):
            c.wake.add(subscription_id)


# -- topology ------------------------------------------------------------------------------------


@routine
async def r_sync_topic(c: Call, p_name: str, p_max_payload_bytes: int | None, p_is_fifo: bool,
                       p_transport: str = "database") -> list[Row]:
    await c.ex.execute("topic_insert", name=p_name, transport=p_transport, max_payload_bytes=p_max_payload_bytes,
                       is_fifo=int(p_is_fifo), now=c.now)
    return [{"sync_topic": None}]


@routine
async def r_sync_subscription(c: Call, **p: Any) -> list[Row]:
    params = {k.removeprefix("p_"): v for k, v in p.items()}
    params.setdefault("status", "Active")
    existing = await c.ex.fetch("subscription_get", name=params["name"])
    if not existing:
        [row] = await c.ex.fetch("subscription_insert", **params, now=c.now)
        return [{"sync_subscription": row["id"]}]
    current = existing[0]
    if current["topic"] != params["topic"]:
        raise ValueError(topic_move_refused(params["name"], current["topic"], params["topic"]))
    live = (await c.ex.fetch("subscription_live_count", id=current["id"]))[0]["n"]
    if live and current["partition_mode"] != params["partition_mode"]:
        raise ValueError(
            f"subscription {params['name']} has live deliveries routed for partition mode {current['partition_mode']}; "
            f"change it to {params['partition_mode']} once they are settled or discarded, or create a new subscription"
        )
    params.pop("status")
    await c.ex.execute("subscription_update", **params, id=current["id"], now=c.now)
    return [{"sync_subscription": current["id"]}]


@routine
async def r_set_subscription_status(c: Call, p_name: str, p_status: str) -> list[Row]:
    existing = await c.ex.fetch("subscription_get", name=p_name)
    if not existing:
        return []
    if p_status == "Paused" and existing[0]["retired_at"] is not None:
        return [{"subscription": p_name, "status": "Retired", "changed": False}]  # refused (PostgreSQL's words)
    old = _shown_status(existing[0]) if p_status == "Active" else existing[0]["status"]
    await c.ex.execute("subscription_set_status", name=p_name, status=p_status, now=c.now)
    if p_status == "Active" and old != "Active":
        c.wake.add(existing[0]["id"])
    return [{"subscription": p_name, "status": p_status, "changed": old != p_status}]


def _shown_status(row: Row) -> str:
    """A subscription's or topic's status as listings show it (Retired when retired and Active)."""
    return "Retired" if row["status"] == "Active" and row["retired_at"] is not None else str(row["status"])


@routine
async def r_retire_subscription(c: Call, p_name: str) -> list[Row]:
    existing = await c.ex.fetch("subscription_get", name=p_name)
    if not existing:
        return []
    await c.ex.execute("subscription_retire", name=p_name, now=c.now)
    if existing[0]["retired_at"] is None and existing[0]["status"] == "Paused":
        c.wake.add(existing[0]["id"])  # a paused one is paused no more: it drains
    return [{"subscription": p_name, "status": "Retired", "changed": existing[0]["retired_at"] is None}]


@routine
async def r_discard_pending(c: Call, p_subscription: str, p_reason: str | None, p_limit: int) -> list[Row]:
    subs = await c.ex.fetch("subscription_get", name=p_subscription)
    if not subs:
        return [{"discard_pending": 0}]
    sid = subs[0]["id"]
    gone = await c.ex.fetch("pending_discard", subscription_id=sid, reason=p_reason, limit=p_limit, now=c.now)
    await _count_settled(c, [(sid, "Discarded")] * len(gone))
    await _refresh_keys(c, {(sid, d["partition_key"], d["key_mode"]) for d in gone if d["key_mode"] > 0})
    return [{"discard_pending": len(gone)}]


@routine
async def r_delete_subscription(c: Call, p_name: str) -> list[Row]:
    subs = await c.ex.fetch("subscription_get", name=p_name)
    if not subs:
        return [{"subscription": p_name, "result": "NotFound", "remaining": 0}]
    sub = subs[0]
    if sub["retired_at"] is None:
        return [{"subscription": p_name, "result": "NotRetired", "remaining": 0}]
    [live] = await c.ex.fetch("subscription_live_count", id=sub["id"])
    if live["n"]:
        return [{"subscription": p_name, "result": "HasDeliveries", "remaining": live["n"]}]
    for statement in ("subscription_deliveries_delete", "subscription_keys_delete", "subscription_counts_delete",
                      "subscription_history_delete", "subscription_buckets_delete", "subscription_delete"):
        await c.ex.execute(statement, id=sub["id"])
    return [{"subscription": p_name, "result": "Deleted", "remaining": 0}]


@routine
async def r_set_topic_status(c: Call, p_name: str, p_status: str) -> list[Row]:
    if p_status not in ("Active", "Paused", "Retired"):
        raise ValueError(f"a topic's status is Active, Paused or Retired, not {p_status}")
    existing = await c.ex.fetch("topic_get", name=p_name)
    if not existing:
        return []
    await c.ex.execute("topic_set_status", name=p_name, status=p_status, now=c.now)
    row = existing[0]
    # What this call changes: a retire, whether the topic was retired; a pause, its status; a
    # resume, either (it un-retires too).
    if p_status == "Retired":
        changed = row["retired_at"] is None
    elif p_status == "Paused":
        changed = row["status"] != "Paused"
    else:
        changed = row["status"] != "Active" or row["retired_at"] is not None
    return [{"topic": p_name, "status": p_status, "changed": changed}]


@routine
async def r_delete_topic(c: Call, p_name: str) -> list[Row]:
    existing = await c.ex.fetch("topic_get", name=p_name)
    if not existing:
        return [{"topic": p_name, "result": "NotFound", "remaining": 0}]
    if existing[0]["retired_at"] is None:
        return [{"topic": p_name, "result": "NotRetired", "remaining": 0}]
    [subscriptions] = await c.ex.fetch("topic_subscription_count", name=p_name)
    if subscriptions["n"]:
        return [{"topic": p_name, "result": "HasSubscriptions", "remaining": subscriptions["n"]}]
    await c.ex.execute("topic_deduplication_delete", name=p_name)
    await c.ex.execute("topic_delete", name=p_name)
    return [{"topic": p_name, "result": "Deleted", "remaining": 0}]


@routine
async def r_list_subscriptions(c: Call) -> list[Row]:
    return await c.ex.fetch("subscription_list")


@routine
async def r_list_topics(c: Call) -> list[Row]:
    return await c.ex.fetch("topic_list")


# -- publish -------------------------------------------------------------------------------------

async def _stored_hashes(c: Call, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """The topic and content hash of each id already stored (each id read once)."""
    stored: dict[str, tuple[str, str]] = {}
    for mid in dict.fromkeys(ids):
        if found := await c.ex.fetch("message_hash", id=mid):
            stored[mid] = (str(found[0]["topic"]), str(found[0]["content_hash"]))
    return stored


async def _repeats_stored_call(c: Call, topic: str, ids: Sequence[str], hashes: Sequence[str],
                               sizes: Sequence[int]) -> bool:
    """Whether a call to a retired topic repeats messages it stored before (lifecycle's rule)."""
    stored = await _stored_hashes(c, ids)
    items = [BatchItem(ids[i], hashes[i], None, sizes[i]) for i in range(len(ids))]
    return repeats_stored_call(items, topic=topic, stored=stored.get)


@routine
async def r_publish(
    c: Call, p_topic: str, p_message_ids: Sequence[Any], p_partition_keys: Sequence[str | None],
    p_attributes: Sequence[str], p_payloads: Sequence[str | None], p_payload_refs: Sequence[str | None],
    p_correlation_ids: Sequence[str | None], p_content_hashes: Sequence[str],
    p_deduplication_keys: Sequence[str | None], p_deduplication_ttls: Sequence[float | None],
    p_delays: Sequence[float | None], p_not_befores: Sequence[datetime | None],
    p_max_attempts: Sequence[int | None], p_backoff_schedules: Sequence[str | None],
    p_envelope_bytes: Sequence[int], p_priorities: Sequence[int | None] | None = None,
) -> list[Row]:
    n = len(p_message_ids)
    priorities = [0] * n if p_priorities is None else [p or 0 for p in p_priorities]
    ids = [str(m) for m in p_message_ids]
    topic = await c.ex.fetch("topic_get", name=p_topic)
    if not topic or topic[0]["retired_at"] is not None:
        if topic and await _repeats_stored_call(c, p_topic, ids, p_content_hashes, p_envelope_bytes):
            return [{"idx": i + 1, "status": "Duplicate", "message_id": ids[i], "error_code": None,
                     "error_message": None} for i in range(n)]
        code, text = topic_refusal(p_topic, exists=bool(topic))
        return [{"idx": i + 1, "status": "Rejected", "message_id": ids[i], "error_code": code,
                 "error_message": text} for i in range(n)]
    cap = topic[0]["max_payload_bytes"]

    # Classify every item before writing anything (as PostgreSQL's classify-first path does): the
    # stored hashes and live key holders are read first, the rule is lifecycle's.
    items = [BatchItem(ids[i], p_content_hashes[i], p_deduplication_keys[i], p_envelope_bytes[i]) for i in range(n)]
    hashes = await _stored_hashes(c, ids)
    holders: dict[str, str] = {}
    for dedup_key in dict.fromkeys(item.deduplication_key for item in items if item.deduplication_key is not None):
        if live := await c.ex.fetch("dedup_live", topic=p_topic, key=dedup_key, now=c.now):
            holders[dedup_key] = str(live[0]["message_id"])
    verdicts = classify_batch(items, cap, topic=p_topic, stored=hashes.get, live_holder=holders.get)
    refusals = batch_refusals(verdicts, items, topic=p_topic, cap=cap)
    if refusals is not None:
        return [{"idx": i + 1, "status": r.status, "message_id": verdicts[i][1], "error_code": r.code,
                 "error_message": r.text} for i, r in enumerate(refusals)]
    status = [v for v, _ in verdicts]
    result_ids = [mid for _, mid in verdicts]

    accepted = [i for i, s in enumerate(status) if s == "Accepted"]
    subscriptions = await c.ex.fetch("subscriptions_of_topic", topic=p_topic)
    filters = [None if s["filter"] is None else json.loads(s["filter"]) for s in subscriptions]
    for i in accepted:
        await c.ex.execute(
            "message_insert", id=ids[i], topic=p_topic, partition_key=p_partition_keys[i], attributes=p_attributes[i],
            payload=p_payloads[i], payload_ref=p_payload_refs[i], correlation_id=p_correlation_ids[i],
            deduplication_key=p_deduplication_keys[i], content_hash=p_content_hashes[i], now=c.now,
        )
        if p_deduplication_keys[i] is not None:
            ttl = p_deduplication_ttls[i]
            ttl = 300.0 if ttl is None else ttl
            await c.ex.execute("dedup_upsert", topic=p_topic, key=p_deduplication_keys[i], message_id=ids[i],
                               expires_at=c.now + ttl)

    # Fan-out: (item, subscription) pairs whose filter matches, in array order.
    pairs = []
    for i in accepted:
        attributes = json.loads(p_attributes[i]) if p_attributes[i] else {}
        for sub, spec in zip(subscriptions, filters, strict=True):
            if matches(spec, attributes):
                pairs.append((i, sub))
    keyed = sorted({(sub["id"], p_partition_keys[i]) for i, sub in pairs
                    if p_partition_keys[i] is not None and sub["partition_mode"] != "None"})
    for subscription_id, key in keyed:
        await c.ex.execute("partition_touch", subscription_id=subscription_id, key=key)

    first_of_key: dict[tuple[int, str], tuple[int, int, float, int]] = {}
    for i, sub in pairs:
        key = p_partition_keys[i]
        partition_mode = sub["partition_mode"]
        mode = 0 if key is None or partition_mode == "None" else (1 if partition_mode == "Exclusive" else 2)
        not_before = epoch(p_not_befores[i])
        visible = max(c.now, not_before if not_before is not None else c.now + (p_delays[i] or 0.0))
        [row] = await c.ex.fetch(
            "delivery_insert", subscription_id=sub["id"], message_id=ids[i], partition_key=key, key_mode=mode,
            max_attempts=p_max_attempts[i] or sub["max_attempts"], backoff_base_seconds=sub["backoff_base_seconds"],
            backoff_max_seconds=sub["backoff_max_seconds"], backoff_schedule=p_backoff_schedules[i],
            visible_at=visible, now=c.now, priority=priorities[i],
        )
        if mode == 0:
            if visible <= c.now:
                c.wake.add(sub["id"])
            continue
        current = first_of_key.get((sub["id"], key))  # type: ignore[arg-type]
        # Ordered: the first new delivery of the key; Exclusive: its earliest visible one.
        if current is None or (mode == 1 and (visible, row["id"]) < (current[2], current[1])):
            first_of_key[(sub["id"], key)] = (mode, row["id"], visible, priorities[i])  # type: ignore[index]
    for (subscription_id, key), (mode, delivery_id, visible, priority) in sorted(first_of_key.items()):
        advanced = await c.ex.execute(
            "partition_advance", subscription_id=subscription_id, key=key, id=delivery_id, visible_at=visible,
            key_mode=mode, priority=priority,
        )
        if advanced and visible <= c.now:
            c.wake.add(subscription_id)
    return [{"idx": i + 1, "status": status[i], "message_id": result_ids[i], "error_code": None,
             "error_message": None} for i in range(n)]


# -- consume -------------------------------------------------------------------------------------


@routine
async def r_claim(c: Call, p_subscription: str, p_limit: int, p_holder: Any = None,
                  p_now: datetime | None = None, p_lease_seconds: float | None = None) -> list[Row]:
    c = c.at(p_now)
    subs = await c.ex.fetch("subscription_active", name=p_subscription)
    if not subs or p_limit < 1:
        return []
    sub = {**subs[0], "lease_seconds": granted_lease(p_lease_seconds, subs[0]["lease_seconds"])}
    limits = Limits.of(sub)
    if limits is None:
        keyed: list[Row] = []
        if sub["partition_mode"] != "None":
            # Keys by the priority of their next delivery, then the earliest due.
            keyed = await _ranked(c, "partition_ready", sub["id"], p_limit)
        share = unkeyed_share(p_limit, len(keyed))
        unkeyed = await _ranked(c, "claimable_unkeyed", sub["id"], share) if share > 0 else []
        keyed, unkeyed = _split(p_limit, keyed, unkeyed)
        return await _take(c, sub, keyed, unkeyed, p_holder)
    return await _claim_limited(c, sub, limits, p_limit, p_holder)


def _split(room: int, keyed: list[Row], unkeyed: list[Row]) -> tuple[list[Row], list[Row]]:
    """The keys and the deliveries without a key that a claim of ``room`` takes."""
    return split_claim(room, keyed, unkeyed, lambda k: (-k["next_priority"], k["next_visible_at"], k["next_id"]),
                       lambda u: (-u["priority"], u["visible_at"], u["id"]))


async def _take(c: Call, sub: Row, keyed: list[Row], unkeyed: list[Row], holder: Any) -> list[Row]:
    """Claims the chosen keys' next deliveries and the chosen deliveries without a key lock."""
    out: list[Row] = []
    lease_expires = c.now + sub["lease_seconds"]
    stale: list[str] = []
    due: dict[Any, Any] = {}  # delivery id -> when it became due (the answer's order, after priority)
    for candidate, key, visible in ([(k["next_id"], k["partition_key"], k["next_visible_at"]) for k in keyed]
                                    + [(u["id"], None, u["visible_at"]) for u in unkeyed]):
        rows = await c.ex.fetch("delivery_claim", id=candidate, token=str(uuid.uuid4()),
                                lease_expires_at=lease_expires, now=c.now, holder=_text(holder))
        if not rows:
            if key is not None:
                stale.append(key)
            continue
        d = rows[0]
        if d["key_mode"] > 0:
            await c.ex.execute("partition_hold", subscription_id=sub["id"], key=d["partition_key"], id=d["id"])
        row = await _claimed_row(c, d)
        due[row["delivery_id"]] = visible
        out.append(row)
    # A key that pointed at a delivery no longer Pending is re-derived.
    mode = 1 if sub["partition_mode"] == "Exclusive" else 2
    for key in stale:
        await refresh_partition(c, sub["id"], key, mode)
    out.sort(key=lambda r: (-r["priority"], due[r["delivery_id"]], r["delivery_id"]))
    for row in out:
        del row["priority"]
    return out


@dataclass(frozen=True)
class Limits:
    """A subscription's flow limits as a claim applies them (None mode's key_concurrency only)."""

    max_in_flight: int | None
    key_concurrency: int | None
    rate: Rate | None
    key_rate: Rate | None

    @classmethod
    def of(cls, sub: Row) -> Limits | None:
        key_concurrency = sub["key_concurrency"] if sub["partition_mode"] == "None" else None
        rate = parse_rate(sub["rate_limit"]) if sub["rate_limit"] else None
        key_rate = parse_rate(sub["key_rate_limit"]) if sub["key_rate_limit"] else None
        if sub["max_in_flight"] is None and key_concurrency is None and rate is None and key_rate is None:
            return None
        return cls(sub["max_in_flight"], key_concurrency, rate, key_rate)


async def _claim_limited(c: Call, sub: Row, limits: Limits, limit: int, holder: Any) -> list[Row]:
    """claim under flow limits (docs/design/flow-control.md), as PostgreSQL's claim runs it; the
    file's single writer keeps other claimers out while it counts. A last row without a delivery
    says which limit kept claimable work back, and when a token is due."""
    sid = sub["id"]
    room, held = limit, None
    if limits.max_in_flight is not None:
        [busy] = await c.ex.fetch("in_flight_count", subscription_id=sid, now=c.now)
        if limits.max_in_flight - busy["n"] < room:
            room, held = max(limits.max_in_flight - busy["n"], 0), "MaxInFlight"
    buckets: dict[tuple[bool, str], Row] = {}
    if limits.rate or limits.key_rate:
        rows = await c.ex.fetch("rate_buckets", subscription_id=sid)
        buckets = {(bool(b["per_key"]), b["partition_key"]): b for b in rows}

    def tokens(per_key: bool, key: str, rate: Rate) -> float:
        b = buckets.get((per_key, key))
        return refill(None if b is None else b["tokens"], None if b is None else b["updated_at"], c.now, rate)

    sub_tokens = 0.0
    if limits.rate is not None:
        sub_tokens = tokens(False, "", limits.rate)
        if math.floor(sub_tokens) < room:
            room, held = math.floor(sub_tokens), "RateLimit"
    in_flight: dict[str, int] = {}
    if limits.key_concurrency is not None:
        in_flight = {r["partition_key"]: r["n"] for r in await c.ex.fetch("in_flight_keys", subscription_id=sid,
                                                                            now=c.now)}
    by_concurrency = key_rooms(limits.key_concurrency, in_flight)

    def key_room(key: str) -> float:
        spare = by_concurrency(key)
        return spare if limits.key_rate is None else min(spare, tokens(True, key, limits.key_rate))

    keys = set(in_flight) | {k for per_key, k in buckets if per_key}
    blocked = json.dumps(sorted(k for k in keys if key_room(k) < 1))
    keyed: list[Row] = []
    unkeyed: list[Row] = []
    if room > 0 and sub["partition_mode"] != "None":
        keyed = await _ranked(c, "partition_ready_past", sid, room, blocked=blocked)
    share = unkeyed_share(room, len(keyed))
    if share > 0:
        window = await _ranked(c, "claimable_unkeyed_past", sid, share * 4, blocked=blocked)
        window.sort(key=lambda r: (-r["priority"], r["visible_at"], r["id"]))
        unkeyed = take_limited(window, share, lambda r: r["partition_key"],
                               key_room if sub["partition_mode"] == "None" else lambda key: math.inf)
    unkeyed_found = len(unkeyed)  # before a claim of one keeps only one side
    keyed, unkeyed = _split(room, keyed, unkeyed)
    claimed_keys = {k["partition_key"]: 1 for k in keyed}
    for u in unkeyed:
        if u["partition_key"] is not None:
            claimed_keys[u["partition_key"]] = claimed_keys.get(u["partition_key"], 0) + 1
    out = await _take(c, sub, keyed, unkeyed, holder)
    got = len(out)
    if got and limits.rate is not None:
        await c.ex.execute("rate_bucket_put", subscription_id=sid, per_key=0, key="", tokens=sub_tokens - got,
                           now=c.now)
    if got and limits.key_rate is not None:
        for key, n in sorted(claimed_keys.items()):
            await c.ex.execute("rate_bucket_put", subscription_id=sid, per_key=1, key=key,
                               tokens=tokens(True, key, limits.key_rate) - n, now=c.now)
    if held is None and got < limit and blocked != "[]":
        spent = limits.key_rate is not None and any(
            tokens(True, k, limits.key_rate) < 1 for per_key, k in buckets if per_key)
        held = "KeyRateLimit" if limits.key_rate is not None and (spent or limits.key_concurrency is None) \
            else "KeyConcurrency"
    if held is None and got < limit and unkeyed_found < share:
        held = "KeyConcurrency" if limits.key_concurrency is not None else "KeyRateLimit"
    if held is None or got >= limit:
        return out
    [waiting] = await c.ex.fetch("work_waiting", subscription_id=sid, now=c.now)
    if not waiting["waiting"]:
        return out
    retry: float | None = None
    if held == "RateLimit" and limits.rate is not None:
        retry = tokens_due_in(sub_tokens - got, limits.rate)
    elif held == "KeyRateLimit" and limits.key_rate is not None:
        spent_buckets = [b for (per_key, _), b in buckets.items() if per_key] + [
            {"tokens": tokens(True, k, limits.key_rate) - n, "updated_at": c.now} for k, n in claimed_keys.items()]
        levels = [refill(b["tokens"], b["updated_at"], c.now, limits.key_rate) for b in spent_buckets]
        short = [t for t in levels if t < 1]
        retry = tokens_due_in(max(short), limits.key_rate) if short else None
    return [*out, held_row(held, retry)]


def held_row(limit: str, retry_after: float | None) -> Row:
    """The last row of a claim a flow limit held back: no delivery, the limit, when a token is due."""
    return {column: None for column in CLAIM_COLUMNS} | {"held_back": limit, "retry_after": retry_after}


CLAIM_COLUMNS = ("delivery_id", "lease_token", "attempt", "max_attempts", "lease_expires_at", "message_id", "topic",
                 "partition_key", "attributes", "payload", "payload_ref", "correlation_id", "published_at")


async def _ranked(c: Call, query: str, subscription_id: int, limit: int, **more: Any) -> list[Row]:
    """Up to ``limit`` rows of ``query`` (claimable deliveries, or keys that can run), those with a
    priority first (``<query>_priority``: an index that is empty without them), then the others."""
    rows = await c.ex.fetch(f"{query}_priority", subscription_id=subscription_id, now=c.now, limit=limit, **more)
    if len(rows) < limit:
        rows += await c.ex.fetch(query, subscription_id=subscription_id, now=c.now, limit=limit - len(rows), **more)
    return rows


async def _claimed_row(c: Call, d: Row) -> Row:
    """A claimed delivery (the row delivery_claim returned) with its message, as claim answers."""
    [m] = await c.ex.fetch("message_get", id=d["message_id"])
    return {
        "delivery_id": d["id"], "lease_token": d["lease_token"], "attempt": d["attempt"],
        "max_attempts": d["max_attempts"], "lease_expires_at": ts(d["lease_expires_at"]),
        "message_id": m["id"], "topic": m["topic"], "partition_key": m["partition_key"],
        "attributes": m["attributes"], "payload": m["payload"], "payload_ref": m["payload_ref"],
        "correlation_id": m["correlation_id"], "published_at": ts(m["published_at"]),
        "priority": d["priority"],
    }


@routine
async def r_claim_many(c: Call, p_subscriptions: Sequence[str], p_limit: int, p_holder: Any = None,
                       p_now: datetime | None = None, p_lease_seconds: Sequence[float | None] | None = None
                       ) -> list[Row]:
    """claim across several None-mode subscriptions: each one's claim index gives at most p_limit
    candidates, and the p_limit oldest due of them all (visible_at, then id) are claimed, each with
    its own subscription's lease. (SQLite's single writer keeps two claimers apart.)"""
    c = c.at(p_now)
    if p_limit < 1 or not p_subscriptions:
        return []
    subs = await c.ex.fetch("subscriptions_named", names=json.dumps(list(p_subscriptions)))
    keyed = [s for s in subs if s["partition_mode"] != "None" or s["limited"]]
    if keyed:
        what = (f"is {keyed[0]['partition_mode']}" if keyed[0]["partition_mode"] != "None"
                else "has flow limits")
        raise ValueError(
            f"claim_many takes None-mode subscriptions only ({keyed[0]['name']} {what}); "
            "claim an Exclusive or Ordered subscription, or one with flow limits, with claim"
        )
    asked = dict(zip(p_subscriptions, p_lease_seconds or (), strict=False))  # (each one's lease, as asked)
    candidates: list[tuple[int, float, int, Row]] = []
    for sub in subs:
        if sub["active"]:
            for row in await _ranked(c, "claimable_unkeyed", sub["id"], p_limit):
                candidates.append((-row["priority"], row["visible_at"], row["id"], sub))
    candidates.sort(key=lambda x: x[:3])
    out: list[Row] = []
    for _, _, candidate, sub in candidates[:p_limit]:
        lease = granted_lease(asked.get(sub["name"]), sub["lease_seconds"])
        rows = await c.ex.fetch("delivery_claim", id=candidate, token=str(uuid.uuid4()),
                                lease_expires_at=c.now + lease, now=c.now, holder=_text(p_holder))
        if rows:
            claimed = await _claimed_row(c, rows[0])
            del claimed["priority"]
            out.append({"subscription": sub["name"], **claimed})
    return out


@routine
async def r_heartbeat(c: Call, p_ids: Sequence[int], p_tokens: Sequence[str], p_percents: Sequence[int | None],
                      p_messages: Sequence[str | None], p_now: datetime | None = None,
                      p_lease_seconds: Sequence[float | None] | None = None) -> list[Row]:
    c = c.at(p_now)
    out = []
    leases = p_lease_seconds if p_lease_seconds is not None else [None] * len(p_ids)
    for delivery_id, token, percent, message, asked in zip(p_ids, p_tokens, p_percents, p_messages, leases,
                                                           strict=True):
        held = await c.ex.fetch("delivery_held", id=delivery_id, token=str(token))
        if not held:
            out.append({"delivery_id": delivery_id, "alive": False, "cancel_requested": False,
                        "lease_expires_at": ts(None)})
            continue
        [row] = await c.ex.fetch(
            "delivery_heartbeat", id=delivery_id, token=str(token), percent=percent, message=message,
            lease_expires_at=c.now + granted_lease(asked, held[0]["lease_seconds"]),
        )
        cancel = bool(row["cancel_requested"])
        out.append({"delivery_id": delivery_id, "alive": not cancel, "cancel_requested": cancel,
                    "lease_expires_at": ts(row["lease_expires_at"])})
    return out


@routine
async def r_settle(c: Call, p_ids: Sequence[int], p_tokens: Sequence[str], p_outcomes: Sequence[str],
                   p_delays: Sequence[float | None], p_reasons: Sequence[str | None],
                   p_errors: Sequence[str | None], p_draws: Sequence[float | None] | None = None,
                   p_now: datetime | None = None) -> list[Row]:
    c = c.at(p_now)
    out = []
    keys: set[tuple[int, str, int]] = set()
    draws = list(p_draws) if p_draws is not None else [None] * len(p_ids)
    items = sorted(zip(p_ids, p_tokens, p_outcomes, p_delays, p_reasons, p_errors, draws, strict=True))
    results: dict[int, str] = {}
    settled: list[tuple[int, str]] = []
    for delivery_id, token, outcome, delay, reason, error, draw in items:
        held = await c.ex.fetch("delivery_held", id=delivery_id, token=str(token))
        if not held:
            continue
        d = held[0]
        t = settle_transition(
            outcome, attempt=d["attempt"], max_attempts=d["max_attempts"], now=datetime.fromtimestamp(c.now, UTC),
            backoff=backoff_policy(d), draw=draw, delay=delay, reason=reason, error=error,
            cancel_requested=bool(d["cancel_requested"]), current_reason=d["reason"], current_error=d["last_error"],
        )
        new = t.status
        await c.ex.execute(
            "delivery_settle", id=delivery_id, status=new, attempt=t.attempt,
            visible_at=None if t.wait_seconds is None else c.now + t.wait_seconds, reason=t.reason,
            last_error=t.last_error, settled_at=c.now if t.terminal else None,
        )
        if new != "Completed" and not (outcome == "Release" and new == "Pending"):  # off the happy path
            await _record_attempt(c, delivery_id, "Failed" if new == "Pending" else new, t.reason, error)
        results[delivery_id] = new
        settled.append((d["subscription_id"], new))
        if d["key_mode"] > 0:
            keys.add((d["subscription_id"], d["partition_key"], d["key_mode"]))
    await _count_settled(c, settled)
    await _refresh_keys(c, keys)
    for delivery_id in p_ids:
        out.append({"delivery_id": delivery_id, "result": results.get(delivery_id, "LeaseLost")})
    return out


async def _record_attempt(c: Call, delivery_id: int, outcome: str, reason: str | None, error: str | None) -> None:
    """Keeps an attempt off the happy path (delivery_attempt), and only the newest 50 of the delivery."""
    await c.ex.execute("attempt_record", id=delivery_id, outcome=outcome, now=c.now, reason=reason, error=error,
                       attempt=None)
    await c.ex.execute("attempt_trim", id=delivery_id)


# -- sweeper -------------------------------------------------------------------------------------


@routine
async def r_expire_leases(c: Call, p_limit: int, p_now: datetime | None = None) -> list[Row]:
    c = c.at(p_now)
    expired = await c.ex.fetch("expired_leases", now=c.now, limit=p_limit)
    keys: set[tuple[int, str, int]] = set()
    out = []
    for d in expired:
        t = expire_transition(
            attempt=d["attempt"], max_attempts=d["max_attempts"], now=datetime.fromtimestamp(c.now, UTC),
            backoff=backoff_policy(d),
            cancel_requested=bool(d["cancel_requested"]), current_reason=d["reason"], current_error=d["last_error"],
        )
        new = t.status
        await c.ex.execute(
            "delivery_settle", id=d["id"], status=new, attempt=t.attempt,
            visible_at=None if t.wait_seconds is None else c.now + t.wait_seconds, reason=t.reason,
            last_error=t.last_error, settled_at=c.now if t.terminal else None,
        )
        await _record_attempt(c, d["id"], "LeaseExpired", t.reason, LEASE_EXPIRED_ERROR)  # (cancelled too)
        out.append({"delivery_id": d["id"], "result": new})
        if d["key_mode"] > 0:
            keys.add((d["subscription_id"], d["partition_key"], d["key_mode"]))
    await _count_settled(c, [(d["subscription_id"], e["result"]) for d, e in zip(expired, out, strict=True)])
    await _refresh_keys(c, keys)
    return out


@routine
async def r_purge(c: Call, p_limit: int, p_now: datetime | None = None) -> list[Row]:
    c = c.at(p_now)
    purged = {
        "purged_deliveries": await _delete_settled(c, "purge_deliveries", now=c.now, limit=p_limit),
        "purged_messages": await c.ex.execute("purge_messages", now=c.now, limit=p_limit),
        "purged_deduplication": await c.ex.execute("purge_deduplication", now=c.now, limit=p_limit),
    }
    await c.ex.execute("rate_buckets_purge", now=c.now, limit=p_limit)  # idle token buckets
    return [purged]


SWEEP_LOCK = "workqueue.sweep"


@routine
async def r_sweep(c: Call, p_limit: int = 1000, p_now: datetime | None = None) -> list[Row]:
    """One pass at a time: the pass holds the ``workqueue.sweep`` lock row while it runs (SQLite's
    single writer already keeps two passes from overlapping; the row also refuses a pass while
    another process holds it). The lock goes by the real time, the pass's rules by ``p_now``."""
    holder = str(uuid.uuid4())
    await c.ex.execute("lock_take", name=SWEEP_LOCK, holder=holder, expires_at=c.now + 60, now=c.now)
    owner = await c.ex.fetch("lock_holder", name=SWEEP_LOCK)
    if not owner or owner[0]["holder"] != holder:
        return [{"ran": False, "retried": 0, "dead_lettered": 0, "discarded": 0, "purged_deliveries": 0,
                 "purged_messages": 0, "purged_deduplication": 0, "taken_back": "[]"}]
    expired = await r_expire_leases(c, p_limit, p_now)
    results = {e["delivery_id"]: e["result"] for e in expired}
    taken_back = []
    if results:
        taken_back = [{**row, "result": results[row["delivery_id"]]}
                      for row in await c.ex.fetch("deliveries_taken_back", ids=json.dumps(list(results)))]
    [purged] = await r_purge(c, p_limit, p_now)
    await c.ex.execute("purge_once_markers", now=c.at(p_now).now, limit=p_limit)
    await c.ex.execute("lock_release", name=SWEEP_LOCK, holder=holder)
    return [{
        "ran": True,
        "retried": sum(1 for e in expired if e["result"] == "Pending"),
        "dead_lettered": sum(1 for e in expired if e["result"] == "DeadLettered"),
        "discarded": sum(1 for e in expired if e["result"] == "Discarded"),
        **purged,
        "taken_back": json.dumps(taken_back),
    }]


@routine
async def r_prune(c: Call, p_older_than_seconds: float, p_limit: int, p_now: datetime | None = None) -> list[Row]:
    c = c.at(p_now)
    removed = await _delete_settled(c, "prune_deliveries", cutoff=c.now - p_older_than_seconds, limit=p_limit)
    return [{"prune": removed}]


async def _delete_settled(c: Call, query: str, **params: Any) -> int:
    """Runs a DELETE of terminal deliveries that returns what it deleted, and counts them out."""
    gone = await c.ex.fetch(query, **params)
    await _count_settled(c, [(r["subscription_id"], r["status"]) for r in gone], sign=-1)
    return len(gone)


# -- operator actions ----------------------------------------------------------------------------


@routine
async def r_replay(c: Call, p_subscription: str, p_delivery_id: int, p_note: str | None) -> list[Row]:
    found = await c.ex.fetch("delivery_of_subscription", id=p_delivery_id, subscription=p_subscription)
    if not found:
        return [{"result": "NotFound", "delivery_status": None}]
    d = found[0]
    if await c.ex.execute("delivery_replay", id=p_delivery_id, note=p_note, now=c.now) == 0:
        if d["key_mode"] > 0:
            await refresh_partition(c, d["subscription_id"], d["partition_key"], d["key_mode"])
        [now] = await c.ex.fetch("delivery_status", id=p_delivery_id)
        return [{"result": "NotDeadLettered", "delivery_status": now["status"]}]
    # The replay is kept as an attempt of its own (of the attempt it ended), so the error before it
    # reads as a past attempt.
    await c.ex.execute("attempt_record", id=p_delivery_id, outcome="Replayed", now=c.now, reason=p_note,
                       error=None, attempt=d["attempt"])
    await c.ex.execute("attempt_trim", id=p_delivery_id)
    if d["key_mode"] == 0 or await refresh_partition(c, d["subscription_id"], d["partition_key"], d["key_mode"]):
        c.wake.add(d["subscription_id"])
    return [{"result": "Replayed", "delivery_status": "Pending"}]


@routine
async def r_discard(c: Call, p_subscription: str, p_delivery_id: int, p_reason: str | None) -> list[Row]:
    found = await c.ex.fetch("delivery_of_subscription", id=p_delivery_id, subscription=p_subscription)
    if not found:
        return [{"result": "NotFound", "cancel_requested": False, "delivery_status": None}]
    d = found[0]
    if await c.ex.execute("delivery_cancel", id=p_delivery_id, reason=p_reason):
        return [{"result": "CancelRequested", "cancel_requested": True, "delivery_status": "InFlight"}]
    if await c.ex.execute("delivery_discard", id=p_delivery_id, reason=p_reason, now=c.now):
        await _count_settled(c, [(d["subscription_id"], "Discarded")])
        if d["key_mode"] > 0 and await refresh_partition(c, d["subscription_id"], d["partition_key"], d["key_mode"]):
            c.wake.add(d["subscription_id"])
        return [{"result": "Discarded", "cancel_requested": False, "delivery_status": "Discarded"}]
    [now] = await c.ex.fetch("delivery_status", id=p_delivery_id)
    return [{"result": "AlreadyTerminal", "cancel_requested": False, "delivery_status": now["status"]}]


@routine
async def r_discard_dead_letters(c: Call, p_subscription: str, p_settled_before: datetime, p_limit: int) -> list[Row]:
    subs = await c.ex.fetch("subscription_get", name=p_subscription)
    if not subs:
        return [{"discard_dead_letters": 0}]
    sid = subs[0]["id"]
    gone = await c.ex.fetch("dead_letters_discard", subscription_id=sid, settled_before=epoch(p_settled_before),
                            limit=p_limit, now=c.now)
    await _count_settled(c, [(sid, "Discarded")] * len(gone))
    await _refresh_keys(c, {(sid, d["partition_key"], d["key_mode"]) for d in gone if d["key_mode"] > 0})
    return [{"discard_dead_letters": len(gone)}]


@routine
async def r_rewrite_payload(c: Call, p_message_id: Any, p_payload: str, p_content_hash: str,
                            p_envelope_bytes: int) -> list[Row]:
    mid = str(p_message_id)
    found = await c.ex.fetch("message_cap", id=mid)
    if not found:
        return [{"rewrite_payload": False}]
    topic, cap = found[0]["topic"], found[0]["max_payload_bytes"]
    if cap is not None and p_envelope_bytes > cap:
        raise TransportError(
            f"rewrite payload: the rewritten envelope is {p_envelope_bytes} bytes; topic '{topic}' accepts at most "
            f"{cap} bytes (max_payload_bytes)"
        )
    statuses = {r["status"] for r in await c.ex.fetch("message_delivery_statuses", message_id=mid)}
    if statuses & {"InFlight", "Completed", "Discarded"}:
        return [{"rewrite_payload": False}]
    await c.ex.execute("message_rewrite", id=mid, payload=p_payload, content_hash=p_content_hash)
    return [{"rewrite_payload": True}]


# -- operator reads ------------------------------------------------------------------------------

_TIMES = ("visible_at", "lease_expires_at", "created_at", "claimed_at", "settled_at", "oldest_pending_at",
          "head_visible_at", "expires_at", "revoked_at", "last_used_at", "published_at", "holder_started_at",
          "started_at", "last_seen_at", "stopped_at", "ended_at", "stored_at")


def with_times(rows: list[Row]) -> list[Row]:
    """Epoch columns as datetimes, as the other databases return them."""
    for row in rows:
        for name in _TIMES:
            if name in row:
                row[name] = ts(row[name])
    return rows


@routine
async def r_stats(c: Call, p_subscription: str | None = None) -> list[Row]:
    return with_times(await c.ex.fetch("stats", subscription=p_subscription, now=c.now))


@routine
async def r_backlog(c: Call, p_subscription: str) -> list[Row]:
    rows = await c.ex.fetch("backlog", subscription=p_subscription, now=c.now)
    for row in rows:
        row["backlog"] = row["claimable"] + row["in_flight"]
    return rows


@routine
async def r_get_delivery(c: Call, p_delivery_id: int) -> list[Row]:
    return with_times(await c.ex.fetch("delivery_get", id=p_delivery_id))


@routine
async def r_delivery_attempts(c: Call, p_delivery_id: int) -> list[Row]:
    return with_times(await c.ex.fetch("delivery_attempts", id=p_delivery_id))


_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


@routine
async def r_search_deliveries(c: Call, p_query: str, p_limit: int) -> list[Row]:
    """As PostgreSQL's: a delivery id, a MessageID, a partition key, a correlation ID or a job
    name, newest first; each branch through an index and at most ``p_limit`` messages."""
    limit = min(max(p_limit or 25, 1), 100)
    query = (p_query or "").strip()
    if not query:
        return []
    found: dict[int, Row] = {}
    if query.isascii() and query.isdigit() and len(query) <= 18:  # (not '³' or '٣': int() reads those)
        for row in await c.ex.fetch("delivery_get", id=int(query)):
            found[row["delivery_id"]] = {**row, "matched": "delivery id"}
    matched: dict[str, str] = {}
    if _UUID.match(query):
        matched[str(uuid.UUID(query))] = "MessageID"
    for statement, what in (("search_partition_key", "partition key"), ("search_correlation_id", "correlation ID"),
                            ("search_job", "job")):
        for row in await c.ex.fetch(statement, q=query, limit=limit):
            matched.setdefault(row["id"], what)
    if matched:
        for row in await c.ex.fetch("search_message_deliveries", ids=json.dumps(list(matched)), limit=limit):
            found.setdefault(row["delivery_id"], {**row, "matched": matched[row["message_id"]]})
    return with_times([found[i] for i in sorted(found, reverse=True)[:limit]])


@routine
async def r_known_messages(c: Call, p_ids: Sequence[Any]) -> list[Row]:
    return await c.ex.fetch("message_known", ids=json.dumps([str(i) for i in p_ids]))


@routine
async def r_message_deliveries(c: Call, p_message_id: Any) -> list[Row]:
    return with_times(await c.ex.fetch("message_deliveries", message_id=str(p_message_id)))


@routine
async def r_list_deliveries(
    c: Call, p_subscription: str, p_status: str, p_limit: int, p_after_id: int = 0
) -> list[Row]:
    return with_times(await c.ex.fetch("delivery_list", subscription=p_subscription, status=p_status, limit=p_limit,
                                       after_id=p_after_id))


@routine
async def r_partitions(c: Call, p_subscription: str, p_condition: str | None, p_limit: int) -> list[Row]:
    return with_times(await c.ex.fetch("partitions", subscription=p_subscription, condition=p_condition,
                                       limit=p_limit, now=c.now))


@routine
async def r_schema_versions(c: Call) -> list[Row]:
    return await c.ex.fetch("schema_versions")


# -- the process registry ------------------------------------------------------------------------

PROCESS_KEEP_SECONDS = 7 * 86400.0
"""A process row unseen for this long is deleted by the next beat (as PostgreSQL's process_beat)."""


@routine
async def r_process_beat(c: Call, p_id: Any, p_hostname: str, p_pid: int, p_started_at: datetime,
                         p_version: str, p_subscriptions: str, p_slots: int, p_busy: int,
                         p_beat_interval_seconds: float) -> list[Row]:
    await c.ex.execute("process_beat", id=str(p_id), hostname=p_hostname, pid=p_pid,
                       started_at=p_started_at.timestamp(), version=p_version, subscriptions=p_subscriptions,
                       slots=p_slots, busy=p_busy, beat_interval_seconds=p_beat_interval_seconds, now=c.now)
    await c.ex.execute("process_forget", before=c.now - PROCESS_KEEP_SECONDS)
    return []


@routine
async def r_process_stop(c: Call, p_id: Any) -> list[Row]:
    await c.ex.execute("process_stop", id=str(p_id), now=c.now)
    return []


@routine
async def r_list_processes(c: Call) -> list[Row]:
    return with_times(await c.ex.fetch("process_list", now=c.now))


def _text(value: Any) -> str | None:
    """A UUID parameter as the file stores it."""
    return None if value is None else str(value)


# -- once markers --------------------------------------------------------------------------------


@routine
async def r_once_begin(c: Call, p_key: str, p_running_seconds: float) -> list[Row]:
    token = str(uuid.uuid4())
    if await c.ex.execute("once_take", key=p_key, token=token, expires_at=c.now + p_running_seconds, now=c.now):
        return [{"state": "Run", "token": token}]
    [row] = await c.ex.fetch("once_get", key=p_key)
    return [{"state": "Done" if row["state"] == "Done" else "Busy", "token": None}]


@routine
async def r_once_finish(c: Call, p_key: str, p_token: str, p_ttl_seconds: float) -> list[Row]:
    done = await c.ex.execute("once_finish", key=p_key, token=str(p_token), expires_at=c.now + p_ttl_seconds)
    return [{"once_finish": done > 0}]


@routine
async def r_once_abort(c: Call, p_key: str, p_token: str) -> list[Row]:
    return [{"once_abort": await c.ex.execute("once_abort", key=p_key, token=str(p_token)) > 0}]


@routine
async def r_once_renew(c: Call, p_key: str, p_token: str, p_running_seconds: float) -> list[Row]:
    renewed = await c.ex.execute("once_renew", key=p_key, token=str(p_token), expires_at=c.now + p_running_seconds)
    return [{"once_renew": renewed > 0}]


# -- deduplication keys and step results -----------------------------------------------------------


@routine
async def r_release_deduplication_key(c: Call, p_topic: str, p_key: str, p_message_id: Any) -> list[Row]:
    gone = await c.ex.fetch("dedup_release", topic=p_topic, key=p_key, message_id=str(p_message_id))
    return [{"release_deduplication_key": any(r["expires_at"] > c.now for r in gone)}]


@routine
async def r_step_get(c: Call, p_message_id: Any, p_name: str) -> list[Row]:
    return await c.ex.fetch("step_get", message_id=str(p_message_id), name=p_name)


@routine
async def r_step_put(c: Call, p_message_id: Any, p_name: str, p_value: str) -> list[Row]:
    mid = str(p_message_id)
    if not await c.ex.fetch("message_hash", id=mid):
        raise TransportError(
            f"step put: message {mid} is not stored (never published, or purged): a step result belongs to a "
            "stored message"
        )
    await c.ex.execute("step_put", message_id=mid, name=p_name, value=p_value, now=c.now)
    return [{"step_put": None}]


# -- results -------------------------------------------------------------------------------------


@routine
async def r_result_put(c: Call, p_delivery_id: int, p_value: str) -> list[Row]:
    await c.ex.execute("result_put", delivery_id=p_delivery_id, value=p_value, now=c.now)
    return [{"result_put": None}]


@routine
async def r_result_get(c: Call, p_message_id: Any) -> list[Row]:
    return with_times(await c.ex.fetch("result_get", message_id=str(p_message_id)))


# -- debounce ------------------------------------------------------------------------------------


@routine
async def r_debounce(c: Call, p_topic: str, p_key: str, p_payload: str, p_content_hash: str, p_envelope_bytes: int,
                     p_seconds: float, p_now: datetime | None = None) -> list[Row]:
    """PostgreSQL's debounce: the message holding the key takes the payload and comes due
    ``p_seconds`` from now while it still waits out its window; else the key is freed (no row)."""
    c = c.at(p_now)
    held = await c.ex.fetch("dedup_holder", topic=p_topic, key=p_key)
    if not held:
        return []
    mid = str(held[0]["message_id"])
    waiting = await c.ex.fetch("message_deliveries_waiting", message_id=mid, now=c.now)
    if not waiting or not all(row["waiting"] for row in waiting):
        await c.ex.execute("dedup_delete", topic=p_topic, key=p_key)
        return []
    topic = await c.ex.fetch("topic_get", name=p_topic)
    cap = topic[0]["max_payload_bytes"] if topic else None
    if cap is not None and p_envelope_bytes > cap:
        raise TransportError(
            f"debounce: the debounced envelope is {p_envelope_bytes} bytes; topic '{p_topic}' accepts at most {cap} "
            "bytes (max_payload_bytes)"
        )
    due = c.now + p_seconds
    await c.ex.execute("message_rewrite", id=mid, payload=p_payload, content_hash=p_content_hash)
    await c.ex.execute("message_deliveries_push", message_id=mid, visible_at=due)
    await c.ex.execute("dedup_expire_at", topic=p_topic, key=p_key, expires_at=due)
    return [{"message_id": mid}]


# -- groups --------------------------------------------------------------------------------------


@routine
async def r_group_create(c: Call, p_group: Any, p_members: Sequence[Any], p_then: Any) -> list[Row]:
    """PostgreSQL's group_create; the trigger delivery_ended of schema.sql counts the members' ends."""
    group = str(p_group)
    ids = [str(m) for m in p_members]
    await c.ex.execute("group_insert", id=group, then_message_id=str(p_then), members=len(ids), now=c.now)
    for position, message_id in enumerate(ids, start=1):
        await c.ex.execute("group_member_insert", group_id=group, message_id=message_id, ordinal=position)
    await c.ex.execute("group_mark_members", group_id=group, ids=json.dumps(ids))
    await c.ex.execute("group_members_ended", group_id=group, now=c.now)
    [counted] = await c.ex.fetch("group_count", group_id=group)
    if counted["remaining"] == 0:
        await c.ex.execute("group_release", group_id=group, now=c.now)
        for row in await c.ex.fetch("message_release", message_id=str(p_then), now=c.now):
            c.wake.add(row["subscription_id"])
    return [{"remaining": counted["remaining"]}]


@routine
async def r_group_members(c: Call, p_group: Any) -> list[Row]:
    return with_times(await c.ex.fetch("group_members", group_id=str(p_group)))


# -- API keys ------------------------------------------------------------------------------------


@routine
async def r_api_key_create(c: Call, p_id: Any, p_name: str, p_prefix: str, p_key_hash: str, p_scopes: list[str],
                           p_expires_at: datetime | None, p_topics: list[str] | None = None) -> list[Row]:
    if await c.ex.fetch("api_key_live_name", name=p_name):
        raise ValueError(
            f"an API key named {p_name!r} exists already; revoke it first (workqueue api-keys revoke {p_name!r}) "
            "or pick another name"
        )
    await c.ex.execute("api_key_create", id=str(p_id), name=p_name, prefix=p_prefix, key_hash=p_key_hash,
                       scopes=json.dumps(p_scopes), now=c.now, expires_at=epoch(p_expires_at),
                       topics=None if p_topics is None else json.dumps(p_topics))
    return [{"api_key_create": None}]


@routine
async def r_api_key_verify(c: Call, p_prefix: str, p_key_hash: str) -> list[Row]:
    return await c.ex.fetch("api_key_verify", prefix=p_prefix, key_hash=p_key_hash, now=c.now)


@routine
async def r_api_key_session(c: Call, p_prefix: str) -> list[Row]:
    return await c.ex.fetch("api_key_session", prefix=p_prefix, now=c.now)


@routine
async def r_api_key_end_sessions(c: Call, p_id: Any, p_session_generation: int) -> list[Row]:
    await c.ex.execute("api_key_end_sessions", id=str(p_id), session_generation=p_session_generation)
    return [{"api_key_end_sessions": None}]


@routine
async def r_api_key_touch(c: Call, p_id: Any) -> list[Row]:
    await c.ex.execute("api_key_touch", id=str(p_id), now=c.now)
    return [{"api_key_touch": None}]


@routine
async def r_api_key_list(c: Call) -> list[Row]:
    return with_times(await c.ex.fetch("api_key_list"))


@routine
async def r_api_key_revoke(c: Call, p_key: str) -> list[Row]:
    return [{"api_key_revoke": await c.ex.execute("api_key_revoke", key=p_key, now=c.now)}]
