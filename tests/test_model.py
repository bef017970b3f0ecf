"""Model-based tests of the delivery state machine (SPEC §4) on the real transports.

A hypothesis state machine drives a transport (PostgreSQL and SQLite, each in a database of its
own) with random interleavings of publish (new, repeated and conflicting MessageIDs), claim,
heartbeat and settle with the current or a stale lease token, every outcome kind, lease expiry
(dead holders' leases moved into the past, then a sweep), discard (Pending, InFlight: cancel,
DeadLettered), replay and sweep, against a small model kept in the test. After every step the
whole topic is read back from the store and compared with the model, and SPEC §4's invariants are
checked: at most one InFlight delivery per key on Exclusive and Ordered subscriptions (in the
rows and through ``list_deliveries``), stale tokens change nothing, an Ordered delivery is claimed
only when every earlier delivery of its key is Completed or Discarded and completes in publish
order, no delivery is lost, a cancel-requested delivery ends Discarded; ``stats`` and
``partitions`` agree.

The machine runs in a sync test that owns an event loop (``asyncio.Runner``) and its transport, so
the session loop of pytest-asyncio is never blocked. ``WORKQUEUE_MODEL_EXAMPLES`` raises the number
of runs per transport (default 25; WORKQUEUE_MODEL_STEPS, 40, the steps of each) for long local runs.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.lifecycle import BackoffPolicy, expire_transition, next_claimable, settle_transition
from fastapi_workqueue.core.transport import HeartbeatRequest, SettleKind, Settlement, Transport
from fastapi_workqueue.database.postgres import PostgresTransport
from fastapi_workqueue.database.sqlite import SqliteTransport

from .conftest import PG_URL, drop_database, recreate_database, unique

T = TypeVar("T")

EXAMPLES = int(os.environ.get("WORKQUEUE_MODEL_EXAMPLES", "25"))
STEPS = int(os.environ.get("WORKQUEUE_MODEL_STEPS", "40"))

pytestmark = pytest.mark.timeout(max(120, EXAMPLES * 20))

ROLES = ("none", "excl", "ord")
MODES: dict[str, Any] = {"none": "None", "excl": "Exclusive", "ord": "Ordered"}
KEY_MODES = {"none": 0, "excl": 1, "ord": 2}
KEYS = (None, "a", "b", "c")
LEASE = 30.0  # a run takes far less: a lease runs out only when the test moves it into the past
MAX_ATTEMPTS = 3
FAR = 3600.0  # a delay no run outlives: such a delivery stays invisible
SLACK = 0.02  # seconds of clock rounding allowed when deciding whether a lease had expired
KINDS: tuple[SettleKind, ...] = ("Complete", "Retry", "Fail", "DeadLetter", "Release")
LIVE = ("Pending", "InFlight", "DeadLettered")
NO_BACKOFF = BackoffPolicy(0.0, 0.0)  # the model's subscriptions retry at once

Row = dict[str, Any]


# -- the stores --------------------------------------------------------------------------------


PG_SNAPSHOT = """
SELECT d.id, s.name AS sub, d.message_id::text AS message_id, d.partition_key, d.key_mode, d.status,
       d.attempt, d.max_attempts, d.lease_token::text AS lease_token,
       extract(epoch FROM d.lease_expires_at)::float8 AS lease_expires_at,
       extract(epoch FROM d.visible_at)::float8 AS visible_at, d.cancel_requested,
       d.progress_percent, d.progress_message, d.note, m.id IS NOT NULL AS has_message, m.payload,
       m.partition_key AS message_key
FROM workqueue.delivery d
JOIN workqueue.subscription s ON s.id = d.subscription_id
LEFT JOIN workqueue.message m ON m.id = d.message_id
WHERE s.topic = $1
ORDER BY d.id
"""

SQLITE_SNAPSHOT = """
SELECT d.id, s.name AS sub, d.message_id, d.partition_key, d.key_mode, d.status, d.attempt, d.max_attempts,
       d.lease_token, d.lease_expires_at, d.visible_at, d.cancel_requested, d.progress_percent,
       d.progress_message, d.note, m.id IS NOT NULL AS has_message, m.payload, m.partition_key AS message_key
FROM delivery d
JOIN subscription s ON s.id = d.subscription_id
LEFT JOIN message m ON m.id = d.message_id
WHERE s.topic = ?
ORDER BY d.id
"""


@dataclass
class Store:
    """A transport on a database of its own, and a way to read a topic's deliveries raw."""

    name: str
    transport: Transport
    read_rows: Callable[[str], Coroutine[Any, Any, list[Row]]]
    cleanup: Callable[[], Coroutine[Any, Any, None]]
    run_out: Callable[[Sequence[int]], Coroutine[Any, Any, None]]
    """Lets these InFlight deliveries' leases run out: their expiry moves one second into the
    database's past, as if their holders had died that long ago. (Not the transport's clock: stats
    and partitions, which the model checks after every step, read the database's own time.)"""

    async def snapshot(self, topic: str) -> dict[int, Row]:
        rows = await self.read_rows(topic)
        out = {}
        for row in rows:
            row["cancel_requested"] = bool(row["cancel_requested"])
            row["has_message"] = bool(row["has_message"])
            out[int(row["id"])] = row
        return out


async def open_store(name: str, tmp_path: Path) -> Store:
    if name == "postgresql":
        url = PG_URL.rsplit("/", 1)[0] + f"/workqueue_model_{os.getpid()}"
        await recreate_database(url)
        pg = PostgresTransport(url, listen=False, pool_max_size=2)
        await pg.open()
        await pg.migrate()

        async def pg_rows(topic: str) -> list[Row]:
            rows = await pg.run_in_connection(lambda conn: conn.fetch(PG_SNAPSHOT, topic))
            return [dict(r.items()) for r in rows]

        async def pg_cleanup() -> None:
            await pg.close()
            await drop_database(url)

        async def pg_run_out(ids: Sequence[int]) -> None:
            await pg.run_in_connection(lambda conn: conn.execute(
                "UPDATE workqueue.delivery SET lease_expires_at = now() - interval '1 second' "
                "WHERE id = ANY($1::bigint[]) AND status = 'InFlight'", list(ids)))

        return Store(name, pg, pg_rows, pg_cleanup, pg_run_out)

    path = tmp_path / "model.db"
    sqlite = SqliteTransport(f"sqlite+aiosqlite:///{path}")
    await sqlite.open()
    await sqlite.migrate()
    # A plain sqlite3 connection in WAL mode: a read beside the transport's writer, taken in one go.
    reader = sqlite3.connect(path, timeout=10)
    reader.row_factory = sqlite3.Row

    async def sqlite_rows(topic: str) -> list[Row]:
        return [dict(r) for r in reader.execute(SQLITE_SNAPSHOT, (topic,)).fetchall()]

    async def sqlite_cleanup() -> None:
        reader.close()
        await sqlite.close()

    async def sqlite_run_out(ids: Sequence[int]) -> None:
        with reader:  # one write transaction, committed at the end of the block
            reader.executemany("UPDATE delivery SET lease_expires_at = ? WHERE id = ? AND status = 'InFlight'",
                               [(time.time() - 1, i) for i in ids])

    return Store(name, sqlite, sqlite_rows, sqlite_cleanup, sqlite_run_out)


# -- the model ---------------------------------------------------------------------------------


@dataclass
class Message:
    message_id: uuid.UUID
    key: str | None
    n: int
    seq: int

    @property
    def content(self) -> tuple[str | None, int]:
        return (self.key, self.n)


@dataclass
class Delivery:
    """What the model expects of one delivery."""

    role: str
    message_id: uuid.UUID
    key: str | None
    seq: int
    id: int = 0
    status: str = "Pending"
    attempt: int = 0
    far: bool = False  # Pending with a visibility time no run reaches
    token: str | None = None
    stale: list[str] = field(default_factory=list)
    cancel: bool = False
    progress: tuple[int | None, str | None] = (None, None)
    note: str | None = None

    @property
    def keyed(self) -> bool:
        return self.key is not None and self.role != "none"

    @property
    def visible(self) -> bool:
        return self.status == "Pending" and not self.far

    @property
    def visible_at(self) -> datetime:
        """Far in the future for a delivery waiting out a delay no run reaches, long past otherwise."""
        return datetime.max.replace(tzinfo=UTC) if self.far else datetime.min.replace(tzinfo=UTC)

    def lose_lease(self) -> None:
        assert self.token is not None
        self.stale.append(self.token)
        self.token = None


def payload_of(n: int) -> dict[str, int]:
    return {"n": n}


class DeliveryMachine(RuleBasedStateMachine):
    """One topic with a None, an Exclusive and an Ordered subscription, driven against the model."""

    def __init__(self, runner: asyncio.Runner, store: Store) -> None:
        super().__init__()
        self.runner = runner
        self.store = store
        self.transport = store.transport
        self.topic = unique("model")
        self.subs = {role: unique(f"model-{role}") for role in ROLES}
        self.role_of = {name: role for role, name in self.subs.items()}
        self.messages: dict[uuid.UUID, Message] = {}
        self.deliveries: dict[int, Delivery] = {}
        self.completed_order: dict[str | None, list[int]] = defaultdict(list)
        self.counter = 0
        self.seq = 0
        self.rows: dict[int, Row] = {}
        self.run(self.transport.sync_topology(
            [Topic(name=self.topic)],
            [
                Subscription(
                    name=self.subs[role], topic=self.topic, handler_key="model", partition_mode=MODES[role],
                    lease_seconds=LEASE, max_attempts=MAX_ATTEMPTS, backoff_base_seconds=0, backoff_max_seconds=0,
                )
                for role in ROLES
            ],
        ))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)

    # -- helpers -------------------------------------------------------------------------------

    def of_role(self, role: str) -> list[Delivery]:
        return [d for d in self.deliveries.values() if d.role == role]

    def key_deliveries(self, role: str, key: str | None) -> list[Delivery]:
        return sorted((d for d in self.of_role(role) if d.keyed and d.key == key), key=lambda d: d.seq)

    def claimable(self, role: str) -> tuple[list[Delivery], set[str]]:
        """Visible unkeyed deliveries, and keys that a claim may take now."""
        unkeyed = [d for d in self.of_role(role) if not d.keyed and d.visible]
        keys: set[str] = set()
        if role != "none":
            now = datetime.now(UTC)
            for key in KEYS:
                if key is not None and next_claimable(MODES[role], self.key_deliveries(role, key), now) is not None:
                    keys.add(key)
        return unkeyed, keys

    def key_head(self, role: str, key: str, rows: dict[int, Row]) -> tuple[float, int]:
        """When a claimable key's next delivery became due, and its id: the order a claim takes keys
        in. Exclusive: its earliest due Pending delivery (a retried one comes due after the later
        ones that never ran); Ordered: its head."""
        ds = self.key_deliveries(role, key)
        if role == "excl":
            return min((rows[d.id]["visible_at"], d.id) for d in ds if d.visible)
        head = next_claimable(MODES[role], ds, datetime.now(UTC))
        assert head is not None, f"key {key!r} is not claimable"
        return (rows[head.id]["visible_at"], head.id)

    def pick(self, candidates: list[Delivery], index: int) -> Delivery | None:
        """One of ``candidates`` (None when there is none: the step does nothing)."""
        candidates = sorted(candidates, key=lambda d: d.id)
        return candidates[index % len(candidates)] if candidates else None

    def stale_candidates(self) -> list[Delivery]:
        return [d for d in self.deliveries.values() if d.stale or d.status == "InFlight"]

    def stale_token(self, d: Delivery, index: int) -> str:
        """A token that is not the delivery's current one: an old lease's, or one never issued."""
        tokens = [*d.stale, str(uuid.uuid4())]
        return tokens[index % len(tokens)]

    def assert_unchanged(self, what: str) -> None:
        after = self.run(self.store.snapshot(self.topic))
        assert after == self.rows, f"{what} changed the store"

    def after_lease_lost(self, d: Delivery, new_status: str) -> None:
        """A lease ended (settled or expired): the model moves the delivery to ``new_status``."""
        d.lose_lease()
        d.status = new_status
        if new_status == "Completed" and d.role == "ord" and d.keyed:
            order = self.completed_order[d.key]
            assert not order or order[-1] < d.seq, f"Ordered key {d.key!r} completed out of publish order"
            order.append(d.seq)

    # -- publish -------------------------------------------------------------------------------

    @rule(
        items=st.lists(
            st.tuples(
                st.sampled_from(KEYS),
                st.one_of(
                    st.none(), st.none(), st.none(),
                    st.tuples(st.just("stored"), st.integers(0, 10**6), st.booleans()),
                    st.tuples(st.just("batch"), st.just(0), st.booleans()),
                ),
            ),
            min_size=1, max_size=3,
        )
    )
    def publish(self, items: list[tuple[str | None, tuple[str, int, bool] | None]]) -> None:
        requests: list[tuple[uuid.UUID, tuple[str | None, int]]] = []
        expected: list[str] = []
        in_batch: dict[uuid.UUID, tuple[str | None, int]] = {}
        for key, reuse in items:
            self.counter += 1
            if reuse is not None and reuse[0] == "stored" and self.messages:
                stored = list(self.messages.values())[reuse[1] % len(self.messages)]
                mid, content = stored.message_id, stored.content if reuse[2] else (stored.key, self.counter)
            elif reuse is not None and reuse[0] == "batch" and requests:
                mid, previous = requests[-1]
                content = previous if reuse[2] else (previous[0], self.counter)
            else:
                mid, content = uuid.uuid4(), (key, self.counter)
            if mid in self.messages:
                status = "Duplicate" if self.messages[mid].content == content else "MessageIDConflict"
            elif mid in in_batch:
                status = "Duplicate" if in_batch[mid] == content else "MessageIDConflict"
            else:
                status = "Accepted"
                in_batch[mid] = content
            requests.append((mid, content))
            expected.append(status)
        conflict = "MessageIDConflict" in expected
        # An item that repeats a stored message whose MessageID an earlier item of the same call
        # conflicted on: the call is refused either way, and the transports label that item
        # MessageIDConflict (compared with the earlier item) or Rejected (compared with the store).
        either: set[int] = set()
        if conflict:
            expected = [s if s == "MessageIDConflict" else "Rejected" for s in expected]
            for i, (mid, _content) in enumerate(requests):
                if mid in self.messages and mid in [m for m, _ in requests[:i]]:
                    either.add(i)

        prepared = [
            prepare(PublishRequest(message_id=mid, partition_key=key, payload=payload_of(n),
                                   attributes={"n": str(n)}))
            for mid, (key, n) in requests
        ]
        results = self.run(self.transport.publish(self.topic, prepared))
        for i, result in enumerate(results):
            if i in either and result.status.value in ("MessageIDConflict", "Rejected"):
                expected[i] = result.status.value
        assert [r.status.value for r in results] == expected, (results, expected)
        for result, (mid, _content), status in zip(results, requests, expected, strict=True):
            if status == "Rejected":
                assert result.error is not None and result.error.code == "BatchAborted", result
            else:
                assert result.message_id == mid, result
        if conflict:
            return

        fresh: list[Message] = []
        for (mid, (key, n)), status in zip(requests, expected, strict=True):
            if status == "Accepted":
                self.seq += 1
                message = Message(mid, key, n, self.seq)
                self.messages[mid] = message
                fresh.append(message)
        if not fresh:
            return
        rows = self.run(self.store.snapshot(self.topic))
        by_message = {(row["sub"], row["message_id"]): int(row["id"]) for row in rows.values()}
        for role in ROLES:
            ids = []
            for message in fresh:
                delivery_id = by_message.get((self.subs[role], str(message.message_id)))
                assert delivery_id is not None, f"{role} got no delivery of accepted message {message.seq}"
                assert delivery_id not in self.deliveries
                self.deliveries[delivery_id] = Delivery(
                    role=role, message_id=message.message_id, key=message.key, seq=message.seq, id=delivery_id
                )
                ids.append(delivery_id)
            assert ids == sorted(ids), "deliveries are not created in publish order"

    # -- claim ---------------------------------------------------------------------------------

    @rule(index=st.integers(0, 2), limit=st.integers(1, 3))
    def claim_where_there_is_work(self, index: int, limit: int) -> None:
        """Claims on a subscription that has claimable work, when one has."""
        busy = [role for role in ROLES if any(self.claimable(role))]
        self.claim(busy[index % len(busy)] if busy else ROLES[index], limit)

    @rule(role=st.sampled_from(ROLES), limit=st.integers(1, 3))
    def claim(self, role: str, limit: int) -> None:
        unkeyed, keys = self.claimable(role)
        # How a claim shares its limit between keys and unkeyed deliveries (neither takes every slot).
        n_keys = min(limit, len(keys))
        share = limit if n_keys == 0 else max(limit - n_keys, limit // 2, 1 if limit == 1 else 0)
        n_unkeyed = min(share, len(unkeyed))
        rows = self.rows
        if n_keys and n_keys + n_unkeyed > limit:
            if limit == 1:
                # One of each: the first in claim order (the earliest due, then the lowest id) is taken.
                first_key = min(self.key_head(role, key, rows) for key in keys)
                first_unkeyed = min((rows[d.id]["visible_at"], d.id) for d in unkeyed)
                n_keys, n_unkeyed = (0, 1) if first_unkeyed < first_key else (1, 0)
            else:
                n_keys = limit - n_unkeyed

        claimed = self.run(self.transport.claim(self.subs[role], limit))
        got = [int(c.delivery_id) for c in claimed]
        assert len(got) == len(set(got))
        assert len(claimed) == n_keys + n_unkeyed, (
            f"{role}: claimed {len(claimed)} with limit {limit}; {len(keys)} keys and {len(unkeyed)} "
            f"unkeyed deliveries were claimable"
        )
        # Unkeyed deliveries go oldest visible first.
        oldest = sorted(unkeyed, key=lambda d: (rows[d.id]["visible_at"], d.id))[:n_unkeyed]
        assert sorted(d for d in got if not self.deliveries[d].keyed) == sorted(d.id for d in oldest)
        taken_keys: set[str] = set()
        for c in claimed:
            d = self.deliveries.get(int(c.delivery_id))
            assert d is not None, f"claimed a delivery of another topic or an unknown one: {c}"
            assert d.role == role and d.visible, f"claimed {d} that was not claimable"
            assert c.message_id == d.message_id and c.partition_key == d.key
            assert c.attempt == d.attempt + 1 and c.max_attempts == MAX_ATTEMPTS
            assert c.payload_json is not None and c.attributes == {"n": str(self.messages[d.message_id].n)}
            if d.keyed:
                assert d.key is not None and d.key in keys and d.key not in taken_keys, f"key {d.key!r} taken twice"
                taken_keys.add(d.key)
                ds = self.key_deliveries(role, d.key)
                if role == "excl":
                    pending = [x for x in ds if x.status == "Pending"]
                    first = min(pending, key=lambda x: (rows[x.id]["visible_at"], x.id))
                    assert d is first, f"Exclusive key {d.key!r}: claimed {d.seq}, the next was {first.seq}"
                else:
                    earlier = [x for x in ds if x.seq < d.seq]
                    assert all(x.status in ("Completed", "Discarded") for x in earlier), (
                        f"Ordered key {d.key!r}: claimed {d.seq} while an earlier delivery is live"
                    )
        for c in claimed:
            d = self.deliveries[int(c.delivery_id)]
            d.status, d.attempt, d.token, d.progress = "InFlight", c.attempt, c.lease_token, (None, None)

    # -- heartbeat -----------------------------------------------------------------------------

    @precondition(lambda self: bool(self.in_flight()))
    @rule(index=st.integers(0, 10**6), percent=st.one_of(st.none(), st.integers(0, 100)))
    def heartbeat_current(self, index: int, percent: int | None) -> None:
        d = self.pick([x for x in self.deliveries.values() if x.status == "InFlight"], index)
        if d is None:
            return
        assert d.token is not None
        before = self.rows[d.id]["lease_expires_at"]
        message = None if percent is None else f"at {percent}"
        [result] = self.run(self.transport.heartbeat([HeartbeatRequest(str(d.id), d.token, percent, message)]))
        assert result.alive is (not d.cancel) and result.cancel_requested is d.cancel, (result, d)
        assert result.lease_expires_at is not None
        # A cancel-requested lease is renewed too: its holder is alive and its handler winds down,
        # and the key stays busy until it returns (the heartbeat still answers cancelled).
        assert result.lease_expires_at.timestamp() >= before, "a heartbeat shortened the lease"
        d.progress = (
            percent if percent is not None else d.progress[0],
            message if message is not None else d.progress[1],
        )

    @precondition(lambda self: bool(self.stale_candidates()))
    @rule(index=st.integers(0, 10**6), which=st.integers(0, 10))
    def heartbeat_stale(self, index: int, which: int) -> None:
        d = self.pick(self.stale_candidates(), index)
        if d is None:
            return
        token = self.stale_token(d, which)
        [result] = self.run(self.transport.heartbeat([HeartbeatRequest(str(d.id), token, 50, "stale")]))
        assert not result.alive and not result.cancel_requested, result
        self.assert_unchanged("a heartbeat with a stale token")

    # -- settle --------------------------------------------------------------------------------

    @precondition(lambda self: bool(self.in_flight()))
    @rule(index=st.integers(0, 10**6), kind=st.sampled_from(KINDS), delay=st.sampled_from([None, 0.0, FAR]))
    def settle_current(self, index: int, kind: SettleKind, delay: float | None) -> None:
        d = self.pick([x for x in self.deliveries.values() if x.status == "InFlight"], index)
        if d is None:
            return
        assert d.token is not None
        transition = settle_transition(
            kind, attempt=d.attempt, max_attempts=MAX_ATTEMPTS, now=datetime.now(UTC), backoff=NO_BACKOFF,
            delay=delay, cancel_requested=d.cancel,
        )
        expected = transition.status
        settlement = Settlement(str(d.id), d.token, kind, delay_seconds=delay, reason=f"{kind} by the model",
                                error=None if kind == "Complete" else "model error")
        [result] = self.run(self.transport.settle([settlement]))
        assert result == expected, (result, expected, d)
        if expected == "Pending":
            d.attempt = transition.attempt
            d.far = delay == FAR
        self.after_lease_lost(d, expected)

    @precondition(lambda self: bool(self.in_flight()))
    @rule(index=st.integers(0, 10**6), kind=st.sampled_from(KINDS), delay=st.sampled_from([None, 0.0, FAR]))
    def settle_current_again(self, index: int, kind: SettleKind, delay: float | None) -> None:
        """Settles weigh twice as much as other steps."""
        self.settle_current(index, kind, delay)

    @precondition(lambda self: bool(self.stale_candidates()))
    @rule(index=st.integers(0, 10**6), which=st.integers(0, 10), kind=st.sampled_from(KINDS))
    def settle_stale(self, index: int, which: int, kind: SettleKind) -> None:
        d = self.pick(self.stale_candidates(), index)
        if d is None:
            return
        token = self.stale_token(d, which)
        [result] = self.run(self.transport.settle([Settlement(str(d.id), token, kind)]))
        assert result == "LeaseLost", result
        self.assert_unchanged("a settle with a stale token")

    # -- lease expiry and sweep ----------------------------------------------------------------

    def in_flight(self) -> list[Delivery]:
        return [d for d in self.deliveries.values() if d.status == "InFlight"]

    def let_leases_run_out(self, deliveries: list[Delivery]) -> None:
        """Their holders died a second ago: no real wait."""
        self.run(self.store.run_out([d.id for d in deliveries]))

    def sweep_and_check(self) -> None:
        """Sweeps; every lease that had run out before the sweep began expires, none that ran out
        after it ended does (those in between may go either way and are taken as they went)."""
        before = self.run(self.store.snapshot(self.topic))
        started = time.time()
        report = self.run(self.transport.sweep())
        ended = time.time()
        assert report.ran
        after = self.run(self.store.snapshot(self.topic))
        counts: Counter[str] = Counter()
        for d in self.in_flight():
            expires = before[d.id]["lease_expires_at"]
            row = after[d.id]
            if row["status"] == "InFlight":
                assert expires >= started - SLACK, f"a lease expired {started - expires:.3f} s ago survived a sweep"
                continue
            assert expires <= ended + SLACK, "a sweep expired a lease before its time"
            expected = expire_transition(attempt=d.attempt, max_attempts=MAX_ATTEMPTS, now=datetime.now(UTC),
                                         backoff=NO_BACKOFF, cancel_requested=d.cancel).status
            if expected == "Pending":
                d.far = False
            assert row["status"] == expected, (row, d)
            counts[expected] += 1
            self.after_lease_lost(d, expected)
        # The pass is the whole store's: what it took back of this run's subscriptions is compared.
        ours = Counter(t.result for t in report.taken_back if t.subscription in self.role_of)
        assert ours == counts, (report, counts)
        assert all(self.deliveries[int(t.delivery_id)].status == t.result
                   for t in report.taken_back if t.subscription in self.role_of), report
        assert report.expired == len(report.taken_back), report

    @precondition(lambda self: bool(self.in_flight()))
    @rule()
    def holders_die_and_leases_expire(self) -> None:
        """No holder renews: wait until every lease has run out, then sweep. All of them expire."""
        self.let_leases_run_out(self.in_flight())
        self.sweep_and_check()

    @precondition(lambda self: bool(self.in_flight()))
    @rule()
    def sweep(self) -> None:
        """A sweep while the holders live: every lease is renewed just before and none expires, but
        the cancel-requested ones, whose holders are let die here: their leases run out and lease
        expiry discards them (a live holder's heartbeat renews them; ``heartbeat_current`` checks)."""
        cancelled = [d for d in self.in_flight() if d.cancel]
        if cancelled:
            self.let_leases_run_out(cancelled)
        live = [d for d in self.in_flight() if not d.cancel]
        if live:
            renewed = self.run(self.transport.heartbeat(
                [HeartbeatRequest(str(d.id), d.token or "") for d in live]
            ))
            assert all(r.alive for r in renewed), renewed
        self.sweep_and_check()

    # -- operators -----------------------------------------------------------------------------

    @precondition(lambda self: bool(self.deliveries))
    @rule(
        index=st.integers(0, 10**6),
        state=st.sampled_from(["Pending", "InFlight", "DeadLettered", "any"]),
        elsewhere=st.booleans(),
    )
    def discard(self, index: int, state: str, elsewhere: bool) -> None:
        candidates = [d for d in self.deliveries.values() if state in ("any", d.status)]
        d = self.pick(candidates or list(self.deliveries.values()), index)
        if d is None:
            return
        other = ROLES[(ROLES.index(d.role) + 1) % len(ROLES)]
        sub = self.subs[other] if elsewhere and index % 4 == 0 else self.subs[d.role]
        result = self.run(self.transport.discard(sub, str(d.id), "model discard"))
        if sub != self.subs[d.role]:
            assert result.result == "NotFound", result
            return
        if d.status in ("Pending", "DeadLettered"):
            assert (result.result, result.status) == ("Discarded", "Discarded"), result
            d.status = "Discarded"
        elif d.status == "InFlight":
            assert (result.result, result.cancel_requested) == ("CancelRequested", True), result
            d.cancel = True
        else:
            assert (result.result, result.status) == ("AlreadyTerminal", d.status), result

    @precondition(lambda self: bool(self.deliveries))
    @rule(index=st.integers(0, 10**6), dead=st.booleans())
    def replay(self, index: int, dead: bool) -> None:
        candidates = [d for d in self.deliveries.values() if d.status == "DeadLettered"] if dead else []
        d = self.pick(candidates or list(self.deliveries.values()), index)
        if d is None:
            return
        result = self.run(self.transport.replay(self.subs[d.role], str(d.id), f"replayed {d.seq}"))
        if d.status == "DeadLettered":
            assert (result.result, result.status) == ("Replayed", "Pending"), result
            d.status, d.attempt, d.far, d.cancel, d.note = "Pending", 0, False, False, f"replayed {d.seq}"
        else:
            assert (result.result, result.status) == ("NotDeadLettered", d.status), result

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def the_store_matches_the_model(self) -> None:
        rows = self.run(self.store.snapshot(self.topic))
        now = time.time()
        assert set(rows) == set(self.deliveries), "deliveries appeared or were lost"
        for d in self.deliveries.values():
            row = rows[d.id]
            message = self.messages[d.message_id]
            assert row["has_message"], f"the message of delivery {d.id} is gone"
            assert row["sub"] == self.subs[d.role] and row["message_id"] == str(d.message_id)
            assert row["partition_key"] == d.key == row["message_key"]
            assert row["key_mode"] == (KEY_MODES[d.role] if d.key is not None else 0)
            assert row["payload"] == '{"n":' + str(message.n) + "}"
            actual = (row["status"], row["attempt"], row["max_attempts"], row["cancel_requested"], row["note"])
            assert actual == (d.status, d.attempt, MAX_ATTEMPTS, d.cancel, d.note), (row, d)
            assert row["lease_token"] == (d.token if d.status == "InFlight" else None), (row, d)
            if d.status == "InFlight":
                assert row["lease_expires_at"] is not None
                assert (row["progress_percent"], row["progress_message"]) == d.progress
            if d.status == "Pending":
                assert (row["visible_at"] > now + FAR / 2) is d.far, (row, d)
            if d.cancel:
                assert d.status in ("InFlight", "Discarded"), "a cancel-requested delivery must end Discarded"

        # Invariant 1: at most one InFlight delivery per key, in the rows and as operators see it.
        for role in ("excl", "ord"):
            keys = Counter(r["partition_key"] for r in rows.values()
                           if r["sub"] == self.subs[role] and r["status"] == "InFlight" and r["partition_key"])
            assert all(n == 1 for n in keys.values()), f"{role}: two InFlight deliveries of one key: {keys}"
            listed = self.run(self.transport.list_deliveries(self.subs[role], "InFlight", limit=1000))
            listed_keys = Counter(i.partition_key for i in listed if i.partition_key is not None)
            assert listed_keys == keys
            assert {int(i.delivery_id) for i in listed} == {
                d.id for d in self.of_role(role) if d.status == "InFlight"
            }

        for role in ROLES:
            [stats] = self.run(self.transport.stats(self.subs[role]))
            counts = Counter(d.status for d in self.of_role(role))
            unkeyed, free_keys = self.claimable(role)
            assert (stats.pending, stats.in_flight, stats.dead_lettered, stats.completed, stats.discarded) == (
                counts["Pending"], counts["InFlight"], counts["DeadLettered"], counts["Completed"], counts["Discarded"]
            ), (role, stats)
            assert stats.claimable == len(unkeyed) + len(free_keys), (role, stats, len(unkeyed), free_keys)
            if role != "none":
                self.check_partitions(role, rows)
        self.rows = rows

    def check_partitions(self, role: str, rows: dict[int, Row]) -> None:
        expected: dict[str, tuple[str, int, int]] = {}
        for key in KEYS:
            if key is None:
                continue
            ds = self.key_deliveries(role, key)
            pending = [d for d in ds if d.status == "Pending"]
            holder = next((d for d in ds if d.status == "InFlight"), None)
            if role == "excl":
                if holder is not None:
                    head = holder
                elif pending:
                    head = min(pending, key=lambda d: (rows[d.id]["visible_at"], d.id))
                else:
                    continue
                condition = "InFlight" if holder is not None else "Idle"
            else:
                live = [d for d in ds if d.status in LIVE]
                if not live:
                    continue
                head = live[0]
                if head.status == "InFlight":
                    condition = "InFlight"
                elif head.status == "DeadLettered" or (head.attempt > 0 and head.far):
                    condition = "Blocked"
                else:
                    condition = "Idle"
            waiting = sum(1 for d in pending if d is not head)
            expected[key] = (condition, head.id, waiting)
        partitions = self.run(self.transport.partitions(self.subs[role], limit=1000))
        actual = {p.partition_key: (p.condition, int(p.head_delivery_id or 0), p.waiting_items) for p in partitions}
        assert actual == expected, (role, actual, expected)

    def teardown(self) -> None:
        """Ends every lease the store holds for this run's topic (read from the store, not the model,
        which a failed step leaves behind it), so a later run's sweep finds none of them."""
        rows = self.run(self.store.snapshot(self.topic))
        settlements = [Settlement(str(i), row["lease_token"], "Complete") for i, row in rows.items()
                       if row["status"] == "InFlight" and row["lease_token"] is not None]
        if settlements:
            self.run(self.transport.settle(settlements))


@pytest.mark.parametrize("store_name", ["postgresql", "sqlite"])
def test_the_delivery_state_machine_matches_its_model(store_name: str, tmp_path: Path) -> None:
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        store = runner.run(open_store(store_name, tmp_path))
        class OnThisStore(DeliveryMachine):
            def __init__(self) -> None:
                super().__init__(runner, store)

        try:
            run_state_machine_as_test(
                OnThisStore,
                settings=settings(
                    max_examples=EXAMPLES,
                    stateful_step_count=STEPS,
                    deadline=None,
                    database=None,
                    # No explain phase: its tracer slows every step tenfold on Python < 3.12.
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                ),
            )
        finally:
            runner.run(store.cleanup())


@pytest.mark.parametrize("store_name", ["postgresql", "sqlite"])
def test_a_claim_of_one_takes_a_key_whose_due_delivery_is_older_than_a_retried_unkeyed_one(
    store_name: str, tmp_path: Path
) -> None:
    """A case the machine once found, replayed step by step: on an Exclusive subscription an unkeyed
    delivery and key ``a``'s first both run out their leases and come due again at the sweep, while
    key ``a``'s second, published with them, has been due since then. A claim of one takes key ``a``
    (its second delivery, due first), not the retried unkeyed one."""
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        store = runner.run(open_store(store_name, tmp_path))
        try:
            state = DeliveryMachine(runner, store)
            steps: list[Callable[[], None]] = [
                lambda: state.publish([(None, None), ("a", None), ("a", None)]),
                lambda: state.claim("excl", 2),
                state.holders_die_and_leases_expire,
                lambda: state.publish([(None, None)]),
                lambda: state.claim("excl", 1),
            ]
            for step in steps:
                step()
                state.the_store_matches_the_model()
            [held] = state.in_flight()
            assert (held.key, held.seq) == ("a", 3)  # the key's second message
            state.teardown()
        finally:
            runner.run(store.cleanup())
