"""Which PostgreSQL writes wait for the disk: a claim that took deliveries of a
subscription without keys commits with ``synchronous_commit`` off; a claim on an Exclusive or
Ordered subscription, a claim that found nothing, a publish and a settle keep waiting. Each call
runs inside an open transaction of the test's own connection, so the setting the function left for
its transaction can be read before that transaction commits."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from .conftest import unique

pytestmark = pytest.mark.timeout(120)


async def commit_mode_after(conn: asyncpg.Connection[Any], sql: str, *args: Any) -> tuple[str, list[Any]]:
    """Runs ``sql`` in a transaction and returns the transaction's synchronous_commit before it
    commits, and the rows."""
    async with conn.transaction():
        rows = await conn.fetch(sql, *args)
        return str(await conn.fetchval("SHOW synchronous_commit")), list(rows)


async def test_only_a_claim_without_keys_skips_the_wait_for_the_disk(
    pg_url: str, pg_transport: PostgresTransport
) -> None:
    plain, keyed = unique("plain"), unique("keyed")
    subs = {mode: unique(mode.lower()) for mode in ("None", "Exclusive", "Ordered")}
    await pg_transport.sync_topology(
        [Topic(name=plain), Topic(name=keyed)],
        [Subscription(name=subs["None"], topic=plain, handler_key="h"),
         Subscription(name=subs["Exclusive"], topic=keyed, handler_key="h", partition_mode="Exclusive"),
         Subscription(name=subs["Ordered"], topic=keyed, handler_key="h", partition_mode="Ordered")])

    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        assert await conn.fetchval("SHOW synchronous_commit") == "on"
        publish_one = ("SELECT * FROM workqueue.publish_one(p_topic => $1, p_message_id => gen_random_uuid(), "
                       "p_partition_key => $2, p_attributes => NULL, p_payload => '1', p_payload_ref => NULL, "
                       "p_correlation_id => NULL, p_content_hash => 'h', p_delay => NULL, p_not_before => NULL, "
                       "p_max_attempts => NULL, p_backoff_schedule => NULL, p_envelope_bytes => 1)")
        for topic, key in ((plain, None), (keyed, "k1"), (keyed, "k2")):
            mode, rows = await commit_mode_after(conn, publish_one, topic, key)
            # Accepted (no row from publish_one's own path, a row from publish's for a keyed
            # topic), and durable before the call returns.
            assert mode == "on" and [r["status"] for r in rows] in ([], ["Accepted"]), rows
        claim = "SELECT * FROM workqueue.claim($1, 10)"

        mode, rows = await commit_mode_after(conn, claim, subs["None"])
        assert (mode, len(rows)) == ("off", 1)
        assert await conn.fetchval("SHOW synchronous_commit") == "on"  # only for that transaction
        mode, rows = await commit_mode_after(conn, claim, subs["None"])
        assert (mode, rows) == ("on", [])  # nothing claimed: nothing changed the setting
        for name in (subs["Exclusive"], subs["Ordered"]):
            mode, rows = await commit_mode_after(conn, claim, name)
            assert (mode, len(rows)) == ("on", 2), name

        [claimed] = [r for r in await conn.fetch(
            "SELECT d.id, d.lease_token FROM workqueue.delivery d JOIN workqueue.subscription s "
            "ON s.id = d.subscription_id WHERE s.name = $1", subs["None"])]
        mode, rows = await commit_mode_after(
            conn, "SELECT * FROM workqueue.settle($1, $2, $3, $4, $5, $6)",
            [claimed["id"]], [claimed["lease_token"]], ["Complete"], [None], [None], [None])
        assert mode == "on" and [r["result"] for r in rows] == ["Completed"]
    finally:
        await conn.close()


async def test_a_claim_lost_with_its_transaction_leaves_its_deliveries_pending(
    pg_url: str, pg_transport: PostgresTransport
) -> None:
    """What a claim lost in a crash comes to: as if it never ran. The deliveries are Pending with
    their attempts as before, and the lost lease token settles nothing."""
    topic, sub = unique("lost"), unique("claim")
    await pg_transport.sync_topology([Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="h")])
    await pg_transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(3)])

    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        tx = conn.transaction()
        await tx.start()
        lost = await conn.fetch("SELECT * FROM workqueue.claim($1, 10)", sub)
        assert len(lost) == 3
        await tx.rollback()  # the transaction never reached the disk
        states = await conn.fetch(
            "SELECT d.status, d.attempt, d.lease_token FROM workqueue.delivery d "
            "JOIN workqueue.subscription s ON s.id = d.subscription_id WHERE s.name = $1", sub)
        assert [(r["status"], r["attempt"], r["lease_token"]) for r in states] == [("Pending", 0, None)] * 3
        rows = await conn.fetch(
            "SELECT * FROM workqueue.settle($1, $2, $3, $4, $5, $6)",
            [r["delivery_id"] for r in lost], [r["lease_token"] for r in lost], ["Complete"] * 3,
            [None] * 3, [None] * 3, [None] * 3)
        assert {r["result"] for r in rows} <= {"LeaseLost"}
        again = await conn.fetch("SELECT * FROM workqueue.claim($1, 10)", sub)
        assert sorted(r["delivery_id"] for r in again) == sorted(r["delivery_id"] for r in lost)
        assert {r["attempt"] for r in again} == {1}
    finally:
        await conn.close()
