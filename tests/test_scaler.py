"""The scaler query and its SELECT-only role (sql/postgresql/roles/scaler_*.sql, docs/scaling.md).

The documented query runs as a login that only holds workqueue_scaler and must count what
``backlog`` counts, on subscriptions of every partition mode in every state that matters.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.transport import ClaimedDelivery, SettleKind, Settlement
from fastapi_workqueue.database import sql_files
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from .conftest import unique

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
SCALER_ROLE = "workqueue_scaler"
QUERY = sql_files.read("postgresql", "roles", "scaler_query.sql")


def url_as(url: str, role: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{role}@{rest.rsplit('@', 1)[-1]}"


@pytest.fixture
async def admin(pg_url: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def scaler(pg_url: str, admin: asyncpg.Connection[Any]) -> AsyncIterator[asyncpg.Connection[Any]]:
    """A connection as a login whose only privileges are those of workqueue_scaler."""
    existed = await admin.fetchval("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)", SCALER_ROLE)
    script = sql_files.read("postgresql", "roles", "scaler_role.sql")
    await admin.execute(script)
    await admin.execute(script)  # idempotent
    login = f"wq_scaler_{uuid.uuid4().hex[:10]}"
    await admin.execute(f"CREATE ROLE {login} LOGIN")
    await admin.execute(f"GRANT {SCALER_ROLE} TO {login}")
    conn = await asyncpg.connect(to_asyncpg_dsn(url_as(pg_url, login)))
    try:
        yield conn
    finally:
        await conn.close()
        await admin.execute(f"DROP OWNED BY {login}")
        await admin.execute(f"DROP ROLE {login}")
        if not existed:
            await admin.execute(f"DROP OWNED BY {SCALER_ROLE}")
            # Another database of this server may have granted it something too: then it stays.
            with contextlib.suppress(asyncpg.DependentObjectsStillExistError):
                await admin.execute(f"DROP ROLE {SCALER_ROLE}")


@dataclass
class Subs:
    transport: PostgresTransport
    names: dict[str, str]
    topics: dict[str, str]
    held: dict[str, ClaimedDelivery] = field(default_factory=dict)
    """What the test claimed and has not settled (given back at its end: the session's database
    is every later test's, and their sweeps would find these leases)."""

    async def publish(self, role: str, *requests: PublishRequest) -> None:
        results = await self.transport.publish(self.topics[role], [prepare(r) for r in requests])
        assert all(r.ok for r in results)

    async def claim(self, role: str, limit: int = 1) -> list[ClaimedDelivery]:
        claimed = await self.transport.claim(self.names[role], limit)
        self.held.update((d.delivery_id, d) for d in claimed)
        assert len(claimed) == limit
        return claimed

    async def settle(self, delivery: ClaimedDelivery, kind: SettleKind, **extra: Any) -> None:
        self.held.pop(delivery.delivery_id, None)
        await self.transport.settle([Settlement(delivery.delivery_id, delivery.lease_token, kind, **extra)])

    async def give_back(self) -> None:
        """Releases every delivery the test still holds."""
        held, self.held = list(self.held.values()), {}
        if held:
            await self.transport.settle([Settlement(d.delivery_id, d.lease_token, "Release") for d in held])


def keyed(key: str | None, n: int = 1, **fields: Any) -> list[PublishRequest]:
    return [PublishRequest(partition_key=key, payload=i, **fields) for i in range(n)]


LATER = {"delay_seconds": 3600}


async def make_data(transport: PostgresTransport, admin: asyncpg.Connection[Any]) -> tuple[Subs, dict[str, int]]:
    """Subscriptions in the states a scaler must tell apart; returns them and the expected backlog."""
    modes = {"none": "None", "excl": "Exclusive", "ord": "Ordered", "paused": "None", "topic_paused": "None",
             "empty": "Exclusive", "big": "None"}
    subs = Subs(transport, {r: unique(f"scale-{r}") for r in modes}, {r: unique(f"scale-t-{r}") for r in modes})
    await transport.sync_topology(
        [Topic(name=t) for t in subs.topics.values()],
        [Subscription(name=subs.names[r], topic=subs.topics[r], handler_key="h", partition_mode=m)
         for r, m in modes.items()],
    )
    # None: 3 ready, 1 held back, 1 in flight.
    await subs.publish("none", *keyed(None, 4), *keyed(None, **LATER))
    await subs.claim("none")

    # Exclusive: a holds a delivery in flight; d's first delivery waits in backoff, which does not
    # hold the key, so d's second is claimable; b is ready (once); c is held back; one has no key.
    await subs.publish("excl", *keyed("a", 3))
    await subs.claim("excl")
    await subs.publish("excl", *keyed("d", 2))
    [d1] = await subs.claim("excl")
    await subs.settle(d1, "Retry", delay_seconds=3600)
    await subs.publish("excl", *keyed("b", 2), *keyed("c", **LATER), *keyed(None))

    # Ordered: a's head is dead-lettered (blocked); b's head waits in backoff (blocked); e's head runs;
    # c is ready (once); one has no key.
    await subs.publish("ord", *keyed("a", 3))
    [a1] = await subs.claim("ord")
    await subs.settle(a1, "DeadLetter", reason="poison")
    await subs.publish("ord", *keyed("b", 2))
    [b1] = await subs.claim("ord")
    await subs.settle(b1, "Retry", delay_seconds=3600)
    await subs.publish("ord", *keyed("e", 2))
    await subs.claim("ord")
    await subs.publish("ord", *keyed("c", 2), *keyed(None))

    # Paused subscription, paused topic: only InFlight counts.
    await subs.publish("paused", *keyed(None, 3))
    await subs.claim("paused")
    assert await transport.set_subscription_status(subs.names["paused"], "Paused")
    await subs.publish("topic_paused", *keyed(None, 2))
    await admin.execute("UPDATE workqueue.topic SET status = 'Paused' WHERE name = $1", subs.topics["topic_paused"])

    # More than the caps: 1200 claimable, 1100 in flight.
    await subs.publish("big", *keyed(None, 2300))
    await subs.claim("big", 1100)

    expected = {"none": 4, "excl": 4, "ord": 3, "paused": 1, "topic_paused": 0, "empty": 0, "big": 2000}
    return subs, expected


async def test_the_documented_query_counts_what_backlog_counts(
    pg_transport: PostgresTransport, admin: asyncpg.Connection[Any], scaler: asyncpg.Connection[Any]
) -> None:
    subs, expected = await make_data(pg_transport, admin)
    try:
        got: dict[str, int] = {}
        for role, name in subs.names.items():
            value = await scaler.fetchval(QUERY, name)
            backlog = await pg_transport.backlog(name)
            assert backlog is not None
            assert value == min(backlog.claimable, 1000) + min(backlog.in_flight, 1000), role
            got[role] = value
        assert got == expected
        big = await pg_transport.backlog(subs.names["big"])
        assert big is not None and (big.claimable, big.in_flight) == (1200, 1100)  # backlog itself is exact
        assert await scaler.fetchrow(QUERY, unique("no-such-subscription")) is None
    finally:
        await subs.give_back()


async def test_the_scaler_role_can_read_only_what_the_query_needs(
    pg_url: str, admin: asyncpg.Connection[Any], scaler: asyncpg.Connection[Any]
) -> None:
    refused = [
        "UPDATE workqueue.delivery SET status = 'Pending'",
        "DELETE FROM workqueue.partition",
        "INSERT INTO workqueue.topic (name) VALUES ('scaler-was-here')",
        "SELECT * FROM workqueue.claim('any', 1)",
        "SELECT * FROM workqueue.backlog('any')",
        "SELECT * FROM workqueue.discard('any', 1, 'no')",
        "SELECT payload FROM workqueue.message",
        "SELECT reason, last_error FROM workqueue.delivery",
        "SELECT * FROM workqueue.delivery",
        "SELECT key_hash FROM workqueue.api_key",
        "SELECT filter FROM workqueue.subscription",
        "CREATE TABLE workqueue.scaler_table (i int)",
    ]
    for statement in refused:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await scaler.execute(statement)
    rows = await admin.fetch(
        """
        SELECT c.relname, p.privilege
        FROM pg_class c
        CROSS JOIN unnest(ARRAY['INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES', 'TRIGGER']) p(privilege)
        WHERE c.relnamespace = 'workqueue'::regnamespace AND c.relkind = 'r'
          AND has_table_privilege($1, c.oid, p.privilege)
        """,
        SCALER_ROLE,
    )
    assert rows == []
    assert not await admin.fetchval("SELECT rolcanlogin FROM pg_roles WHERE rolname = $1", SCALER_ROLE)


def test_the_scaling_guide_shows_the_shipped_query_and_role_script() -> None:
    guide = (ROOT / "docs" / "scaling.md").read_text(encoding="utf-8")
    assert QUERY.strip() in guide
    assert "roles/scaler_role.sql" in guide
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/scaling.md" in readme
