"""How PostgreSQL runs the hot functions, seen from their plans and row counts: a sweeper pass
reads no row still within retention, and a settle does the same work per item at any batch size,
and so does a heartbeat (joins the planner could run as nested loops would compare every item with
every other; docs/design/settles-and-heartbeats.md)."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.topology import PartitionMode
from fastapi_workqueue.core.transport import Settlement
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from .conftest import unique
from .support import explain_each_statement, rows_removed, wait_for
from .test_migrations import scratch_url  # noqa: F401  (a fixture: an empty database of its own)

pytestmark = pytest.mark.timeout(120)

FRESH = 3000


async def rows_read(conn: asyncpg.Connection[Any], table: str) -> int:
    """Rows this database's scans have read from ``workqueue.<table>`` so far."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    value = await conn.fetchval(
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables "
        "WHERE schemaname = 'workqueue' AND relname = $1", table)
    return int(value)


async def test_a_sweep_pass_reads_no_row_within_retention(scratch_url: str) -> None:  # noqa: F811
    transport = PostgresTransport(scratch_url, listen=False, pool_max_size=2)
    await transport.open()
    try:
        await transport.migrate()
        topic, sub = unique("fresh"), unique("week")
        await transport.sync_topology([Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="h")])
        for start in range(0, FRESH, 500):
            await transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(start, start + 500)])
        # Half of them settled: Completed deliveries within their week of retention.
        settled = 0
        while settled < FRESH // 2:
            claimed = await transport.claim(sub, 100)
            await transport.settle([Settlement(c.delivery_id, c.lease_token, "Complete") for c in claimed])
            settled += len(claimed)
    finally:
        await transport.close()

    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        await conn.execute("ANALYZE workqueue.message, workqueue.delivery")
        before = {t: await rows_read(conn, t) for t in ("message", "delivery")}
        for _ in range(7):  # past the point where PL/pgSQL may switch to a generic plan
            swept = await conn.fetchrow("SELECT ran, purged_deliveries, purged_messages FROM workqueue.sweep(1000)")
            assert swept is not None
            ran, purged_deliveries, purged_messages = swept
            assert (ran, purged_deliveries, purged_messages) == (True, 0, 0)
        after = {t: await rows_read(conn, t) for t in ("message", "delivery")}
    finally:
        await conn.close()
    # 7 passes over 3,000 messages and 1,500 settled deliveries: reading them would be thousands.
    assert after["message"] - before["message"] < 50, (before, after)
    assert after["delivery"] - before["delivery"] < 50, (before, after)


async def test_a_large_heartbeat_and_settle_find_each_row_by_its_key(scratch_url: str) -> None:  # noqa: F811
    """Statistics taken while nothing was InFlight (a fresh backlog) must not lead the planner into
    comparing every item with every other: no join or filter of the settle removes more rows than
    the batch has."""
    transport = PostgresTransport(scratch_url, listen=False, pool_max_size=2)
    await transport.open()
    try:
        await transport.migrate()
        topic, sub = unique("big"), unique("settle")
        await transport.sync_topology([Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="h")])
        await transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(1000)])
    finally:
        await transport.close()

    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        await conn.execute("ANALYZE workqueue.delivery, workqueue.message")  # nothing InFlight yet
        claimed = await conn.fetch("SELECT delivery_id, lease_token FROM workqueue.claim($1, 300)", sub)
        assert len(claimed) == 300
        plans = await explain_each_statement(conn)
        ids, tokens = [r["delivery_id"] for r in claimed], [r["lease_token"] for r in claimed]
        beats = await conn.fetch("SELECT alive FROM workqueue.heartbeat($1, $2, $3, $4)",
                                 ids, tokens, [50] * 300, ["half"] * 300)
        # Half retried (their backoff from the caller's draws), half completed.
        results = await conn.fetch(
            "SELECT result FROM workqueue.settle($1, $2, $3, $4, $5, $6, $7)",
            [r["delivery_id"] for r in claimed], [r["lease_token"] for r in claimed], ["Complete", "Fail"] * 150,
            [None] * 300, [None] * 300, [None] * 300, [0.5] * 300)
        await conn.execute("SET auto_explain.log_min_duration = -1")
    finally:
        await conn.close()
    assert [r["alive"] for r in beats] == [True] * 300
    assert [r["result"] for r in results] == ["Completed", "Pending"] * 150
    text = "\n".join(plans)
    assert "workqueue.delivery" in text or "delivery" in text, "auto_explain sent no plan"
    removed = rows_removed(text)
    assert all(n <= 300 for n in removed), removed


KEYS = 500


async def keyed_subscription(url: str, mode: PartitionMode, keys: int, per_key: int) -> str:
    """A topic with one subscription of ``mode`` and ``per_key`` messages on each of keys ``k0``..
    (``keys`` of them), in a migrated database; returns the subscription's name."""
    transport = PostgresTransport(url, listen=False, pool_max_size=2)
    await transport.open()
    try:
        await transport.migrate()
        topic, sub = unique("keys"), unique(mode.lower())
        await transport.sync_topology([Topic(name=topic)], [
            Subscription(name=sub, topic=topic, handler_key="h", partition_mode=mode)])
        for _ in range(per_key):
            await transport.publish(topic, [prepare(PublishRequest(payload=i, partition_key=f"k{i}"))
                                            for i in range(keys)])
    finally:
        await transport.close()
    return sub


async def test_a_keyed_claim_and_settle_touch_only_the_keys_they_take(scratch_url: str) -> None:  # noqa: F811
    """Claims of 8 and 92 among 500 keys update only their keys' rows, each found by its key, and
    the settle of the 100 hands those keys over item by item: no scan or join of either removes
    more rows than the batch has. The tables have no statistics yet, as in a new database before
    autovacuum's first pass: the claim once read every key of the subscription then, and the
    hand-over compared every settled key with every other at any time."""
    sub = await keyed_subscription(scratch_url, "Exclusive", KEYS, 2)  # each settle hands its key on
    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        plans = await explain_each_statement(conn)
        claimed = []
        for limit in (8, 92):  # a claim of a few keys among many, and a larger one
            claimed += await conn.fetch(
                "SELECT delivery_id, lease_token, partition_key FROM workqueue.claim($1, $2)", sub, limit)
        results = await conn.fetch(
            "SELECT result FROM workqueue.settle($1, $2, $3, $4, $5, $6)",
            [r["delivery_id"] for r in claimed], [r["lease_token"] for r in claimed], ["Complete"] * 100,
            [None] * 100, [None] * 100, [None] * 100)
        await conn.execute("SET auto_explain.log_min_duration = -1")
        again = await conn.fetch("SELECT partition_key FROM workqueue.claim($1, $2)", sub, 2 * KEYS)
    finally:
        await conn.close()
    assert len({r["partition_key"] for r in claimed}) == 100
    assert [r["result"] for r in results] == ["Completed"] * 100
    # Every key has work again: the 100 settled keys their second message, the others their first.
    assert sorted(r["partition_key"] for r in again) == sorted(f"k{i}" for i in range(KEYS))
    text = "\n".join(plans)
    assert "workqueue.partition" in text, "auto_explain sent no plan"
    removed = rows_removed(text)
    assert all(n <= 100 for n in removed), removed


async def index_entries(conn: asyncpg.Connection[Any], index: str) -> int:
    """Entries on the leaf pages of ``workqueue.<index>`` (a B-tree), dead ones included."""
    return int(await conn.fetchval(
        "SELECT coalesce(sum(s.live_items + s.dead_items), 0) "
        "FROM generate_series(1, pg_relation_size($1::text::regclass) / current_setting('block_size')::int - 1) b, "
        "LATERAL bt_page_stats($1::text, b) s WHERE s.type = 'l'", f"workqueue.{index}"))


async def test_an_ordered_claim_and_settle_write_no_entry_in_the_ordered_head_index(
    scratch_url: str,  # noqa: F811
) -> None:
    """The next delivery of an Ordered key is found in ``delivery_ordered_head``, which holds its
    Pending and DeadLettered deliveries. The InFlight one is the key's holder, which the key's row
    names, so the index leaves it out: a claim (Pending to InFlight) and a settle (InFlight to
    Completed) add no entry to it. It once held InFlight too, and every claim added one."""
    keys = 40  # two messages a key: 80 entries, one leaf page
    sub = await keyed_subscription(scratch_url, "Ordered", keys, 2)
    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
        before = await index_entries(conn, "delivery_ordered_head")
        claimed = await conn.fetch("SELECT delivery_id, lease_token, partition_key FROM workqueue.claim($1, $2)",
                                   sub, 2 * keys)
        after_claim = await index_entries(conn, "delivery_ordered_head")
        results = await conn.fetch(
            "SELECT result FROM workqueue.settle($1, $2, $3, $4, $5, $6)",
            [r["delivery_id"] for r in claimed], [r["lease_token"] for r in claimed], ["Complete"] * keys,
            [None] * keys, [None] * keys, [None] * keys)
        after_settle = await index_entries(conn, "delivery_ordered_head")
        second = await conn.fetch("SELECT partition_key FROM workqueue.claim($1, $2)", sub, 2 * keys)
    finally:
        await conn.close()
    assert sorted(r["partition_key"] for r in claimed) == sorted(f"k{i}" for i in range(keys))  # heads only
    assert [r["result"] for r in results] == ["Completed"] * keys
    assert sorted(r["partition_key"] for r in second) == sorted(f"k{i}" for i in range(keys))
    assert (before, after_claim, after_settle) == (2 * keys, 2 * keys, 2 * keys)


async def test_an_ordered_key_whose_row_was_lost_is_rederived_with_its_in_flight_holder(
    scratch_url: str,  # noqa: F811
) -> None:
    """``refresh_partition`` re-derives a key from its deliveries. An Ordered key's InFlight
    delivery is not in ``delivery_ordered_head``: when the key's row is gone, it is found among the
    subscription's InFlight deliveries and named the holder, so the key's next delivery is not
    claimable until it settles."""
    sub = await keyed_subscription(scratch_url, "Ordered", 3, 2)
    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        sid = await conn.fetchval("SELECT id FROM workqueue.subscription WHERE name = $1", sub)
        held = await conn.fetchrow("SELECT delivery_id, lease_token FROM workqueue.claim($1, 1)", sub)
        assert held is not None
        key = await conn.fetchval("SELECT partition_key FROM workqueue.delivery WHERE id = $1", held["delivery_id"])
        await conn.execute("DELETE FROM workqueue.partition WHERE subscription_id = $1 AND partition_key = $2",
                           sid, key)
        claimable = await conn.fetchval("SELECT workqueue.refresh_partition($1, $2, 2::smallint)", sid, key)
        row = await conn.fetchrow("SELECT holder_id, next_id FROM workqueue.partition "
                                  "WHERE subscription_id = $1 AND partition_key = $2", sid, key)
        others = await conn.fetch("SELECT partition_key FROM workqueue.claim($1, 10)", sub)
        await conn.fetch("SELECT result FROM workqueue.settle($1, $2, $3, $4, $5, $6)",
                         [held["delivery_id"]], [held["lease_token"]], ["Complete"], [None], [None], [None])
        after = await conn.fetch("SELECT partition_key FROM workqueue.claim($1, 10)", sub)
    finally:
        await conn.close()
    assert claimable is False
    assert row is not None and (row["holder_id"], row["next_id"]) == (held["delivery_id"], None)
    assert key not in {r["partition_key"] for r in others}
    assert [r["partition_key"] for r in after] == [key]


async def table_updates(conn: asyncpg.Connection[Any], table: str) -> tuple[int, int]:
    """(updates, HOT updates) of ``workqueue.<table>`` so far, this session's own included."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    row = await conn.fetchrow(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE schemaname = 'workqueue' AND relname = $1",
        table)
    assert row is not None
    return int(row["n_tup_upd"]), int(row["n_tup_hot_upd"])


async def test_heartbeats_are_hot_updates_and_the_sweeper_reads_only_the_in_flight_set(
    scratch_url: str,  # noqa: F811
) -> None:
    """A heartbeat changes lease_expires_at and the progress columns only: when no index of delivery
    names them (in its columns or its predicate), PostgreSQL updates the row in place on its page
    (a HOT update) and writes no index entry. 3,000 heartbeats gave 0 HOT updates while the
    sweeper's index was on lease_expires_at."""
    transport = PostgresTransport(scratch_url, listen=False, pool_max_size=2)
    await transport.open()
    try:
        await transport.migrate()
        # Autovacuum's ANALYZE of any freshly filled table of this database (delivery, message ...)
        # holds a snapshot, and so back the horizon that page pruning needs, while it runs; its start
        # is a matter of timing (later on a busy machine): keep it off every table of the schema.
        async with transport.pool.acquire() as admin:
            for (table,) in await admin.fetch(
                    "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables WHERE schemaname = 'workqueue'"):
                await admin.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        topic, sub = unique("beat"), unique("beating")
        await transport.sync_topology([Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="h")])
        await transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(1000)])
    finally:
        await transport.close()

    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        claimed = await conn.fetch("SELECT delivery_id, lease_token FROM workqueue.claim($1, 100)", sub)
        ids, tokens = [r["delivery_id"] for r in claimed], [r["lease_token"] for r in claimed]
        # The claim wrote new versions of the claimed rows (it changes status, which indexes name);
        # a vacuum frees the old ones, as autovacuum would, so that the count below depends only on
        # whether a heartbeat touches an indexed column, not on how full the claim left the pages.
        # The whole database, its catalogs too (the migration filled them): what autovacuum would
        # otherwise find to ANALYZE in the middle of the count is done now.
        await conn.execute("VACUUM ANALYZE")
        # A worker that started before this may still run here: wait it out.
        async def no_autovacuum() -> bool:
            return not await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker' "
                "AND datname = current_database()")

        await wait_for(no_autovacuum, within=30, interval=0.05)
        # No index of delivery names a column a heartbeat writes, in its key or its predicate: the
        # catalog says so whatever else runs on the server.
        heartbeat_columns = {"lease_expires_at", "progress_percent", "progress_message"}
        for name, definition in await conn.fetch(
                "SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index "
                "WHERE indrelid = 'workqueue.delivery'::regclass"):
            named = {column for column in heartbeat_columns if column in definition}
            assert not named, f"index {name} names {sorted(named)}: {definition}"
        # And the server does update in place. An update is HOT only where the page could be pruned
        # first, which takes a cleanup lock on it: a checkpoint or the background writer pinning the
        # page (the shared cluster checkpoints whenever another test drops a database) makes that
        # update move the row instead, so on a busy server a share of the 3,000 updates is not HOT
        # (20 to 35 % HOT was seen with several suites on the server). An index on a heartbeat column
        # makes every count 0: at least 10 % HOT in one of up to three counts tells the two apart.
        counts = []
        for _ in range(3):
            updates, hot = await table_updates(conn, "delivery")
            for beat in range(30):
                alive = await conn.fetch("SELECT alive FROM workqueue.heartbeat($1, $2, $3, $4)",
                                         ids, tokens, [beat] * 100, [f"step {beat}"] * 100)
                assert [r["alive"] for r in alive] == [True] * 100
            after_updates, after_hot = await table_updates(conn, "delivery")
            assert after_updates - updates == 3000
            counts.append(after_hot - hot)
            if counts[-1] >= 0.9 * 3000:
                break
        assert max(counts) >= 0.1 * 3000, counts

        # The sweeper finds expired leases among the InFlight rows, whatever else the table holds.
        before = await rows_read(conn, "delivery")
        for _ in range(7):
            swept = await conn.fetchrow("SELECT ran, retried FROM workqueue.sweep(1000)")
            assert swept is not None and swept["retried"] == 0
        assert await rows_read(conn, "delivery") - before <= 7 * 100 + 50
    finally:
        await conn.close()


async def test_stats_read_the_live_work_and_no_history(scratch_url: str) -> None:  # noqa: F811
    """Completed and Discarded deliveries within retention are history: stats counts them from
    settled_count and reads only the Pending, InFlight and DeadLettered rows."""
    transport = PostgresTransport(scratch_url, listen=False, pool_max_size=2)
    await transport.open()
    try:
        await transport.migrate()
        topic, sub = unique("history"), unique("counted")
        await transport.sync_topology([Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="h")])
        for start in range(0, FRESH, 500):
            await transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(start, start + 500)])
        settled = 0
        while settled < FRESH - 20:
            claimed = await transport.claim(sub, min(100, FRESH - 20 - settled))
            await transport.settle([Settlement(c.delivery_id, c.lease_token, "Complete") for c in claimed])
            settled += len(claimed)
        await transport.claim(sub, 5)  # 5 InFlight, 15 Pending
        [stats] = await transport.stats(sub)
        assert (stats.completed, stats.in_flight, stats.pending) == (FRESH - 20, 5, 15)
    finally:
        await transport.close()

    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        await conn.execute("ANALYZE workqueue.delivery, workqueue.settled_count")
        before = await rows_read(conn, "delivery")
        for _ in range(7):  # past the point where a plan may turn generic
            row = await conn.fetchrow("SELECT completed, pending FROM workqueue.stats($1)", sub)
            assert row is not None and (row["completed"], row["pending"]) == (FRESH - 20, 15)
        read = await rows_read(conn, "delivery") - before
    finally:
        await conn.close()
    # 7 calls over 20 live rows (Pending counted twice: the count and the claimable part).
    assert read <= 7 * 60, read


HOT_PATH = ("publish", "publish_one", "claim", "claim_many", "heartbeat", "settle", "refresh_partition",
            "release_keys", "rederive_stale")


async def test_the_functions_of_an_orders_path_plan_once_on_their_indexes(scratch_url: str) -> None:  # noqa: F811
    """A later CREATE OR REPLACE of one of them must repeat the two settings (it resets them)."""
    transport = PostgresTransport(scratch_url, listen=False, pool_max_size=2)
    await transport.open()
    try:
        await transport.migrate()
    finally:
        await transport.close()
    conn = await asyncpg.connect(to_asyncpg_dsn(scratch_url))
    try:
        rows = await conn.fetch(
            "SELECT p.proname, p.proconfig FROM pg_proc p WHERE p.pronamespace = 'workqueue'::regnamespace "
            "AND p.proname = ANY ($1::text[])", list(HOT_PATH))
    finally:
        await conn.close()
    assert sorted(r["proname"] for r in rows) == sorted(HOT_PATH)
    for r in rows:
        assert {"plan_cache_mode=force_generic_plan", "enable_seqscan=off"} <= set(r["proconfig"]), r["proname"]


async def test_one_message_to_keyed_subscriptions_is_published_in_one_call(
    pg_url: str, pg_transport: PostgresTransport
) -> None:
    """publish_one writes a message for Exclusive and Ordered subscriptions itself: publish
    is not called, and each key points at its delivery, claimable at once."""
    topic, exclusive, ordered = unique("keyed-one"), unique("excl"), unique("ord")
    await pg_transport.sync_topology([Topic(name=topic)], [
        Subscription(name=exclusive, topic=topic, handler_key="h", partition_mode="Exclusive"),
        Subscription(name=ordered, topic=topic, handler_key="h", partition_mode="Ordered"),
    ])
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        async with conn.transaction():
            await conn.execute("SET LOCAL track_functions = 'pl'")
            for n in range(3):
                result = await pg_transport.call(
                    "publish_one", connection=conn, p_topic=topic, p_message_id=prepare(
                        PublishRequest(payload=n)).message_id, p_partition_key="k", p_attributes=None,
                    p_payload=str(n), p_payload_ref=None, p_correlation_id=None, p_content_hash=str(n),
                    p_delay=None, p_not_before=None, p_max_attempts=None, p_backoff_schedule=None,
                    p_envelope_bytes=10)
                assert list(result) == []  # no rows: Accepted
            calls = await conn.fetchrow(
                "SELECT pg_stat_get_xact_function_calls('workqueue.publish_one'::regproc), "
                "pg_stat_get_xact_function_calls(p.oid) FROM pg_proc p "
                "WHERE p.proname = 'publish' AND p.pronamespace = 'workqueue'::regnamespace")
            assert calls is not None
            one, publish = calls
            assert (one, publish or 0) == (3, 0)
    finally:
        await conn.close()
    for name in (exclusive, ordered):
        [first] = await pg_transport.claim(name, 10)  # one delivery per key at a time
        assert first.payload_json == "0"
