"""The database roles (roles/): the runtime's, the operator's and the admin's, each with EXECUTE
on its own functions and no privilege on any table (the schema keeps every function from PUBLIC)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from fastapi_workqueue import ConfigurationError, PublishRequest, PublishStatus, Subscription, Topic, TransportError
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.transport import HeartbeatRequest, Settlement
from fastapi_workqueue.database import sql_files
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from .conftest import unique
from .support import wait_for

pytestmark = pytest.mark.timeout(60)

RUNTIME_ROLE = "workqueue_runtime"
ROLE_SCRIPTS = {"workqueue_runtime": "runtime_role.sql", "workqueue_operator": "operator_role.sql",
                "workqueue_admin": "admin_role.sql"}
RUNTIME_FUNCTIONS = {
    "publish", "publish_one", "claim", "heartbeat", "settle", "once_begin", "once_finish",
    "once_abort", "once_renew", "sweep",
    "sync_topic", "sync_subscription", "stats", "backlog", "list_deliveries", "get_delivery", "partitions",
    "list_subscriptions", "list_topics", "schema_versions", "api_key_verify", "api_key_touch", "api_key_session",
    "api_key_end_sessions",
    "claim_many", "known_messages", "message_deliveries", "delivery_attempts", "search_deliveries",
    "release_deduplication_key", "step_get", "step_put", "result_put", "result_get", "watch_message",
    "debounce", "group_create", "group_members",
    "record_stats_history", "stats_history", "live_counts", "blocked_keys", "flow_state",
    "process_beat", "process_stop", "list_processes",
}

# Every table privilege and every sequence privilege PostgreSQL knows of.
TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
SEQUENCE_PRIVILEGES = ("USAGE", "SELECT", "UPDATE")


def role_name(prefix: str) -> str:
    """A role name no other test uses, valid without quoting."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def url_as(url: str, role: str) -> str:
    """The same database URL, logging in as ``role`` (the server trusts local connections)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{role}@{rest.rsplit('@', 1)[-1]}"


async def role_exists(conn: asyncpg.Connection[Any], role: str) -> bool:
    return bool(await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = $1)", role))


async def drop_role(conn: asyncpg.Connection[Any], role: str) -> None:
    """Drops a role that owns nothing; DROP OWNED takes away the privileges granted to it here."""
    if await role_exists(conn, role):
        await conn.execute(f"DROP OWNED BY {role}")
        await conn.execute(f"DROP ROLE {role}")


@pytest.fixture
async def admin(pg_url: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    """A connection as the migrating superuser (the schema owner)."""
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        yield conn
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def scripted_role(admin: asyncpg.Connection[Any], role: str) -> AsyncIterator[str]:
    """A role set up by its script; dropped afterwards when this test created it."""
    existed = await role_exists(admin, role)
    await admin.execute(sql_files.read("postgresql", "roles", ROLE_SCRIPTS[role]))
    try:
        yield role
    finally:
        if not existed:
            # A role belongs to the whole cluster: another test run on another database of it (a
            # second checkout's suite) may have granted it there meanwhile. Its privileges here go;
            # the role stays for that run then.
            with contextlib.suppress(asyncpg.DependentObjectsStillExistError):
                await drop_role(admin, role)


@contextlib.asynccontextmanager
async def login_with(admin: asyncpg.Connection[Any], *roles: str) -> AsyncIterator[str]:
    """A login role whose only privileges are those of ``roles``."""
    login = role_name("wq_login")
    await admin.execute(f"CREATE ROLE {login} LOGIN")
    try:
        for role in roles:
            await admin.execute(f"GRANT {role} TO {login}")
        yield login
    finally:
        await drop_role(admin, login)


@pytest.fixture
async def runtime_role(admin: asyncpg.Connection[Any]) -> AsyncIterator[str]:
    """workqueue_runtime, set up by the role script; dropped afterwards when this test created it."""
    async with scripted_role(admin, RUNTIME_ROLE) as role:
        yield role


@pytest.fixture
async def app_login(admin: asyncpg.Connection[Any], runtime_role: str) -> AsyncIterator[str]:
    """A login role whose only privileges are those of workqueue_runtime."""
    login = role_name("wq_app")
    await admin.execute(f"CREATE ROLE {login} LOGIN")
    try:
        await admin.execute(f"GRANT {runtime_role} TO {login}")
        yield login
    finally:
        await drop_role(admin, login)


@pytest.fixture
async def outsider(admin: asyncpg.Connection[Any]) -> AsyncIterator[str]:
    """A login role that is not a member of workqueue_runtime."""
    login = role_name("wq_out")
    await admin.execute(f"CREATE ROLE {login} LOGIN")
    try:
        yield login
    finally:
        await drop_role(admin, login)


async def test_role_script_loads_and_is_plain_sql() -> None:
    sql = sql_files.read("postgresql", "roles", "runtime_role.sql")
    assert "CREATE ROLE workqueue_runtime NOLOGIN" in sql
    # Sent as one string through a driver: no psql meta-command may appear.
    assert not [line for line in sql.splitlines() if line.lstrip().startswith("\\")]


async def test_no_function_of_the_schema_is_executable_by_public(admin: asyncpg.Connection[Any]) -> None:
    rows = await admin.fetch(
        """
        SELECT p.proname,
               EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                       WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE') AS public_execute
        FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = 'workqueue'::regnamespace
        """
    )
    assert {r["proname"] for r in rows} >= {"publish", "claim", "heartbeat", "settle", "sweep", "refresh_partition"}
    assert [r["proname"] for r in rows if r["public_execute"]] == []


async def test_role_script_is_idempotent_and_grants_functions_only(
    admin: asyncpg.Connection[Any], runtime_role: str
) -> None:
    # A table privilege granted by mistake is taken away by the next run of the script.
    await admin.execute(f"GRANT SELECT, UPDATE ON workqueue.delivery TO {runtime_role}")
    await admin.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA workqueue TO {runtime_role}")
    await admin.execute(sql_files.read("postgresql", "roles", "runtime_role.sql"))
    await admin.execute(sql_files.read("postgresql", "roles", "runtime_role.sql"))

    role = await admin.fetchrow(
        "SELECT rolcanlogin, rolsuper, rolcreaterole, rolcreatedb FROM pg_catalog.pg_roles WHERE rolname = $1",
        runtime_role,
    )
    assert role is not None and not any(role.values())
    assert await admin.fetchval("SELECT has_schema_privilege($1, 'workqueue', 'USAGE')", runtime_role)
    assert not await admin.fetchval("SELECT has_schema_privilege($1, 'workqueue', 'CREATE')", runtime_role)

    # An earlier version of the script granted every function: running it again takes the rest away.
    await admin.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA workqueue TO {runtime_role}")
    await admin.execute(sql_files.read("postgresql", "roles", "runtime_role.sql"))
    functions = await admin.fetch(
        "SELECT p.proname, has_function_privilege($1, p.oid, 'EXECUTE') AS ok FROM pg_catalog.pg_proc p "
        "WHERE p.pronamespace = 'workqueue'::regnamespace",
        runtime_role,
    )
    assert {f["proname"] for f in functions if f["ok"]} == RUNTIME_FUNCTIONS

    granted = []
    relations = await admin.fetch(
        "SELECT c.oid, c.relname, c.relkind FROM pg_catalog.pg_class c "
        "WHERE c.relnamespace = 'workqueue'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')"
    )
    assert {r["relname"] for r in relations} >= {"delivery", "message", "partition", "schema_migration"}
    for rel in relations:
        if rel["relkind"] == "S":
            for privilege in SEQUENCE_PRIVILEGES:
                if await admin.fetchval("SELECT has_sequence_privilege($1, $2::oid, $3)", runtime_role, rel["oid"],
                                        privilege):
                    granted.append((rel["relname"], privilege))
        else:
            for privilege in TABLE_PRIVILEGES:
                if await admin.fetchval("SELECT has_table_privilege($1, $2::oid, $3)", runtime_role, rel["oid"],
                                        privilege):
                    granted.append((rel["relname"], privilege))
            if await admin.fetchval(
                "SELECT has_any_column_privilege($1, $2::oid, 'SELECT, INSERT, UPDATE, REFERENCES')",
                runtime_role, rel["oid"],
            ):
                granted.append((rel["relname"], "column"))
    assert granted == []


async def test_runtime_login_runs_the_queue_but_cannot_touch_tables(pg_url: str, app_login: str) -> None:
    url = url_as(pg_url, app_login)
    transport = PostgresTransport(url, listen=False, pool_max_size=2)
    engine = create_async_engine(url)
    await transport.open()
    raw: asyncpg.Connection[Any] | None = None
    try:
        raw = await asyncpg.connect(to_asyncpg_dsn(url))
        assert await transport.run_in_connection(lambda c: c.fetchval("SELECT current_user")) == app_login
        assert await raw.fetchval("SELECT current_user") == app_login

        # The runtime role may declare its own topology: sync_* are functions like the others.
        topic, sub = unique("topic"), unique("runtime")
        await transport.sync_topology(
            [Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="test", lease_seconds=30)]
        )
        assert sub in {s.name for s in await transport.list_subscriptions()}

        [published] = await transport.publish(topic, [prepare(PublishRequest(payload={"n": 1}))])
        assert published.status is PublishStatus.ACCEPTED, published
        # Publishing in the caller's own transaction works as the runtime role too.
        async with AsyncSession(engine) as session, session.begin():
            [in_tx] = await transport.publish(topic, [prepare(PublishRequest(payload={"n": 2}))], session=session)
        assert in_tx.status is PublishStatus.ACCEPTED, in_tx

        claimed = await transport.claim(sub, 1)
        assert len(claimed) == 1 and claimed[0].message_id == published.message_id
        delivery = claimed[0]
        [beat] = await transport.heartbeat([HeartbeatRequest(delivery.delivery_id, delivery.lease_token, 50, "half")])
        assert beat.alive and not beat.cancel_requested

        # The tables are out of reach: no write, no read, not even through a helper function that
        # is not SECURITY DEFINER (it runs with the caller's rights).
        denied = [
            ("UPDATE workqueue.delivery SET status = 'Completed' WHERE id = $1", (int(delivery.delivery_id),)),
            ("DELETE FROM workqueue.delivery WHERE id = $1", (int(delivery.delivery_id),)),
            (
                "INSERT INTO workqueue.delivery (subscription_id, message_id, max_attempts, backoff_base_seconds, "
                "backoff_max_seconds) VALUES (1, $1, 1, 0, 0)",
                (delivery.message_id,),
            ),
            ("SELECT * FROM workqueue.message", ()),
            ("SELECT * FROM workqueue.delivery", ()),
            ("UPDATE workqueue.partition SET holder_id = NULL", ()),
            ("SELECT * FROM workqueue.schema_migration", ()),
            ("SELECT nextval(pg_get_serial_sequence('workqueue.delivery', 'id'))", ()),
            ("SELECT workqueue.refresh_partition(1, 'k', 1::smallint)", ()),
            ("CREATE TABLE workqueue.intruder (id integer)", ()),
        ]
        for sql, args in denied:
            with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError):
                await raw.execute(sql, *args)

        info = await transport.get_delivery(delivery.delivery_id)
        assert info is not None and info.status == "InFlight" and info.progress_percent == 50

        assert await transport.settle([Settlement(delivery.delivery_id, delivery.lease_token, "Complete")]) == [
            "Completed"
        ]
        [second] = await transport.claim(sub, 10)
        assert second.message_id == in_tx.message_id
        assert await transport.settle([Settlement(second.delivery_id, second.lease_token, "Complete")]) == [
            "Completed"
        ]

        # Housekeeping and operator reads work as the runtime role too.
        assert (await transport.sweep()).ran in (True, False)
        [stats] = await transport.stats(sub)
        assert stats.completed == 2 and stats.pending == 0 and stats.in_flight == 0
        # So do the sweeper's stats history and the dashboard's read of it.
        assert await transport.record_stats_history() >= 0
        assert isinstance(await transport.stats_history(datetime.now(UTC) - timedelta(hours=1), sub), list)
    finally:
        await engine.dispose()
        if raw is not None:
            await raw.close()
        await transport.close()


async def test_runtime_login_receives_wakeups(pg_url: str, app_login: str) -> None:
    transport = PostgresTransport(url_as(pg_url, app_login), listen=True, pool_max_size=2)
    await transport.open()
    woken: list[str] = []
    await transport.add_wakeup_listener(woken.append)
    try:
        topic, sub = unique("topic"), unique("wakeup")
        await transport.sync_topology([Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="test")])
        [state] = [s for s in await transport.list_subscriptions() if s.name == sub]
        await transport.publish(topic, [prepare(PublishRequest(payload=1))])
        await wait_for(lambda: state.id in woken, within=5, describe=lambda: woken)
        [claimed] = await transport.claim(sub, 1)
        assert await transport.settle([Settlement(claimed.delivery_id, claimed.lease_token, "Complete")]) == [
            "Completed"
        ]
    finally:
        await transport.close()


async def test_role_without_runtime_membership_cannot_call_functions(
    pg_url: str, admin: asyncpg.Connection[Any], runtime_role: str, outsider: str
) -> None:
    url = url_as(pg_url, outsider)
    conn = await asyncpg.connect(to_asyncpg_dsn(url))
    try:
        # Without USAGE on the schema it cannot even name the function.
        with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError, match="schema workqueue"):
            await conn.fetch("SELECT * FROM workqueue.claim($1, $2)", "any", 1)

        # With USAGE, the function itself refuses: that is what the schema takes from PUBLIC.
        await admin.execute(f"GRANT USAGE ON SCHEMA workqueue TO {outsider}")
        for sql, args in [
            ("SELECT * FROM workqueue.claim($1, $2)", ("any", 1)),
            ("SELECT * FROM workqueue.sweep()", ()),
            ("SELECT workqueue.sync_topic($1, NULL, false)", ("intruder",)),
            ("SELECT * FROM workqueue.settle($1::bigint[], $2::uuid[], $3::text[], $4::float8[], $5::text[], "
             "$6::text[])", ([1], [uuid.uuid4()], ["Complete"], [None], [None], [None])),
        ]:
            with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError, match="permission denied for function"):
                await conn.fetch(sql, *args)
        assert not await conn.fetchval("SELECT pg_has_role($1, 'MEMBER')", runtime_role)
    finally:
        await conn.close()

    # Through the transport the refusal is a configuration error that names the role script.
    transport = PostgresTransport(url, listen=False, pool_max_size=1)
    await transport.open()
    try:
        with pytest.raises(ConfigurationError, match="permission denied") as raised:
            await transport.claim("any", 1)
        assert "runtime_role.sql" in str(raised.value)
    finally:
        await transport.close()
    assert await admin.fetchval("SELECT count(*) FROM workqueue.topic WHERE name = 'intruder'") == 0



# -- operator and admin --------------------------------------------------------------------------


async def expect_denied(conn: asyncpg.Connection[Any], sql: str, *args: Any) -> None:
    with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError, match="permission denied for function"):
        await conn.fetch(sql, *args)


CREATE_KEY = "SELECT workqueue.api_key_create($1, $2, $3, $4, $5, NULL)"


def key_args(name: str) -> tuple[Any, ...]:
    return (uuid.uuid4(), name, uuid.uuid4().hex[:12], "0" * 64, ["workqueue:admin"])


async def dead_letter(transport: PostgresTransport) -> tuple[str, str]:
    """A subscription with one dead-lettered delivery: (subscription, delivery id)."""
    topic, sub = unique("topic"), unique("ops")
    await transport.sync_topology([Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="h",
                                                                      max_attempts=1)])
    await transport.publish(topic, [prepare(PublishRequest(payload=1))])
    [claimed] = await transport.claim(sub, 1)
    assert await transport.settle([Settlement(claimed.delivery_id, claimed.lease_token, "DeadLetter")]) == [
        "DeadLettered"]
    return sub, claimed.delivery_id


async def test_the_runtime_role_cannot_mint_keys_prune_replay_or_pause(
    pg_url: str, admin: asyncpg.Connection[Any], pg_transport: PostgresTransport, app_login: str
) -> None:
    sub, delivery_id = await dead_letter(pg_transport)
    conn = await asyncpg.connect(to_asyncpg_dsn(url_as(pg_url, app_login)))
    try:
        await expect_denied(conn, CREATE_KEY, *key_args(unique("minted")))
        await expect_denied(conn, "SELECT * FROM workqueue.api_key_list()")
        await expect_denied(conn, "SELECT workqueue.api_key_revoke($1)", "anything")
        await expect_denied(conn, "SELECT workqueue.prune($1, $2)", 0.0, 10)
        await expect_denied(conn, "SELECT * FROM workqueue.replay($1, $2, $3)", sub, int(delivery_id), "note")
        await expect_denied(conn, "SELECT * FROM workqueue.discard($1, $2, $3)", sub, int(delivery_id), "x")
        await expect_denied(conn, "SELECT * FROM workqueue.set_subscription_status($1, $2)", sub, "Paused")
        # What it keeps: the key check (with the hash of a presented key, never answering one) and the reads.
        assert await conn.fetch("SELECT * FROM workqueue.api_key_verify($1, $2)", "nothing", "0" * 64) == []
        assert len(await conn.fetch("SELECT * FROM workqueue.list_deliveries($1, 'DeadLettered', 10)", sub)) == 1
    finally:
        await conn.close()
    assert await admin.fetchval("SELECT count(*) FROM workqueue.api_key WHERE name LIKE 'minted-%'") == 0


async def test_the_runtime_role_sweeps_by_the_servers_clock_only(
    pg_url: str, admin: asyncpg.Connection[Any], pg_transport: PostgresTransport, app_login: str
) -> None:
    """The sweeper runs under the runtime role, but a clock of the caller's (``p_now``, a test's)
    is the schema owner's: moved forward, it would take back a lease that has time left."""
    topic, sub = unique("topic"), unique("held")
    await pg_transport.sync_topology([Topic(name=topic)], [Subscription(name=sub, topic=topic, handler_key="h",
                                                                          lease_seconds=600)])
    await pg_transport.publish(topic, [prepare(PublishRequest(payload=1))])
    [claimed] = await pg_transport.claim(sub, 1)
    conn = await asyncpg.connect(to_asyncpg_dsn(url_as(pg_url, app_login)))
    try:
        refused = r"p_now \(a test.s clock\) is given only by the owner of schema workqueue"
        with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError, match=refused):
            await conn.fetch("SELECT * FROM workqueue.sweep(1000, now() + interval '1 hour')")
        [swept] = await conn.fetch("SELECT * FROM workqueue.sweep(1000)")
        assert swept["retried"] == 0
    finally:
        await conn.close()
    info = await pg_transport.get_delivery(claimed.delivery_id)
    assert info is not None and info.status == "InFlight" and info.attempt == 1
    # The owner (a test's clock) may.
    [owner] = await admin.fetch("SELECT * FROM workqueue.sweep(1000, now() + interval '1 hour')")
    assert (await pg_transport.get_delivery(claimed.delivery_id)).status == "Pending"  # type: ignore[union-attr]
    assert owner["ran"] is True


async def test_the_operator_role_replays_but_cannot_mint_keys_or_publish(
    pg_url: str, admin: asyncpg.Connection[Any], pg_transport: PostgresTransport
) -> None:
    sub, delivery_id = await dead_letter(pg_transport)
    async with scripted_role(admin, "workqueue_operator") as role, login_with(admin, role) as login:
        transport = PostgresTransport(url_as(pg_url, login), listen=False, pool_max_size=1)
        await transport.open()
        try:
            result = await transport.replay(sub, delivery_id, "operator")
            assert result.result == "Replayed"
            assert (await transport.discard(sub, delivery_id, "no longer needed")).result == "Discarded"
            assert await transport.set_subscription_status(sub, "Paused") is True
            assert await transport.prune(3600) >= 0
            [stats] = await transport.stats(sub)
            assert stats.discarded == 1
            with pytest.raises(ConfigurationError, match="permission denied"):
                await transport.api_key_create(uuid.uuid4(), unique("minted"), uuid.uuid4().hex[:12], "0" * 64,
                                               ["workqueue:admin"], None)
            with pytest.raises(ConfigurationError, match="permission denied"):
                await transport.claim(sub, 1)
            with pytest.raises(ConfigurationError, match="permission denied"):
                await transport.api_key_verify("anything", "0" * 64)
        finally:
            await transport.close()


async def test_the_admin_role_manages_keys_and_nothing_else(
    pg_url: str, admin: asyncpg.Connection[Any], pg_transport: PostgresTransport
) -> None:
    from fastapi_workqueue.core.keys import create_key

    async with scripted_role(admin, "workqueue_admin") as role, login_with(admin, role) as login:
        transport = PostgresTransport(url_as(pg_url, login), listen=False, pool_max_size=1)
        await transport.open()
        try:
            name = unique("ci-publisher")
            created = await create_key(transport, name, ["workqueue:publish"])
            assert name in {k.name for k in await transport.api_key_list()}
            assert await transport.api_key_revoke(created.prefix) == 1
            with pytest.raises(ConfigurationError, match="permission denied"):
                await transport.stats()
            with pytest.raises(ConfigurationError, match="permission denied"):
                await transport.api_key_session(created.prefix)
        finally:
            await transport.close()


async def test_every_role_script_is_idempotent(admin: asyncpg.Connection[Any]) -> None:
    for role, script in ROLE_SCRIPTS.items():
        async with scripted_role(admin, role):
            await admin.execute(sql_files.read("postgresql", "roles", script))
            assert not await admin.fetchval("SELECT has_schema_privilege($1, 'workqueue', 'CREATE')", role)
            assert not await admin.fetchval(
                "SELECT bool_or(has_table_privilege($1, c.oid, 'SELECT')) FROM pg_catalog.pg_class c "
                "WHERE c.relnamespace = 'workqueue'::regnamespace AND c.relkind = 'r'", role)


# -- API keys: touched after the match, one live key per name -------------------------------------


async def test_no_function_the_runtime_role_may_call_answers_a_key_hash(
    admin: asyncpg.Connection[Any], runtime_role: str
) -> None:
    """A runtime login (or anyone holding its password) cannot read the keys' hashes: the key check
    takes the hash of the presented key and answers only the key's id, name, scopes and topics."""
    rows = await admin.fetch(
        "SELECT p.proname, p.proargnames, p.proargmodes::text[] AS modes FROM pg_catalog.pg_proc p "
        "WHERE p.pronamespace = 'workqueue'::regnamespace AND has_function_privilege($1, p.oid, 'EXECUTE')",
        runtime_role,
    )
    assert {"api_key_verify", "api_key_session", "api_key_touch"} <= {r["proname"] for r in rows}
    answering = [
        r["proname"] for r in rows
        if any(name == "key_hash" and mode in ("o", "b", "t")
               for name, mode in zip(r["proargnames"] or [], r["modes"] or [], strict=False))
    ]
    assert answering == []


async def test_the_runtime_role_checks_keys_and_ends_sessions(
    pg_url: str, pg_transport: PostgresTransport, app_login: str
) -> None:
    from fastapi_workqueue.core.keys import check_key, create_key

    created = await create_key(pg_transport, unique("runtime-check"), ["workqueue:read"], topics=["orders"])
    transport = PostgresTransport(url_as(pg_url, app_login), listen=False, pool_max_size=1)
    await transport.open()
    try:
        record = await check_key(transport, created.key)
        assert record is not None and record.name == created.name and record.topics == ("orders",)
        assert await check_key(transport, f"wq_{created.prefix}_{'x' * 40}") is None
        session = await transport.api_key_session(created.prefix)
        assert session == record
        await transport.api_key_end_sessions(record.id, record.session_generation)
        after = await transport.api_key_session(created.prefix)
        assert after is not None and after.session_generation == record.session_generation + 1
    finally:
        await transport.close()


async def test_a_key_is_marked_used_only_once_its_hash_matched(pg_transport: PostgresTransport,
                                                               admin: asyncpg.Connection[Any]) -> None:
    from fastapi_workqueue.core.keys import create_key, verify_key

    created = await create_key(pg_transport, unique("touch"), ["workqueue:read"])
    last_used = "SELECT last_used_at FROM workqueue.api_key WHERE id = $1"
    forged = f"wq_{created.prefix}_{'x' * 40}"  # the real (public) prefix, a made-up secret
    assert await verify_key(pg_transport, forged) is None
    assert await admin.fetchval(last_used, created.id) is None
    principal = await verify_key(pg_transport, created.key)
    assert principal is not None and principal.name == created.name
    assert await admin.fetchval(last_used, created.id) is not None


async def test_a_name_a_live_key_has_is_refused_until_it_is_revoked(pg_transport: PostgresTransport) -> None:
    from fastapi_workqueue.core.keys import create_key

    name = unique("deploy-bot")
    first = await create_key(pg_transport, name, ["workqueue:publish"])
    with pytest.raises(TransportError) as refused:
        await create_key(pg_transport, name, ["workqueue:read"])
    text = str(refused.value)
    assert f"an API key named '{name}' exists already" in text and "revoke" in text and "another name" in text
    assert await pg_transport.api_key_revoke(first.prefix) == 1
    again = await create_key(pg_transport, name, ["workqueue:read"])
    assert again.name == name


async def test_a_name_that_reads_as_another_keys_prefix_or_id_is_refused(pg_transport: PostgresTransport) -> None:
    """`api-keys revoke X` takes a prefix, an id or a name: a key named as another key's prefix made
    one revoke of that name revoke both."""
    from fastapi_workqueue.core.keys import create_key

    other = await create_key(pg_transport, unique("other"), ["workqueue:read"])
    for name in (other.prefix, other.prefix.upper(), str(other.id), other.id.hex):
        with pytest.raises(ValueError, match="cannot read as a key's prefix or id"):
            await create_key(pg_transport, name, ["workqueue:read"])
    assert await pg_transport.api_key_revoke(other.prefix) == 1
    kept = await create_key(pg_transport, unique("deploy-bot-1a2b3c4d5e6f"), ["workqueue:read"])  # (a name with one)
    assert await pg_transport.api_key_revoke(kept.prefix) == 1


# -- the AWS layer's functions ------------------------------------------------------------------


async def test_the_aws_role_runs_the_outbox_through_its_functions_and_touches_no_table(
    admin: asyncpg.Connection[Any], pg_url: str, runtime_role: str,
) -> None:
    """workqueue_runtime holds nothing of the AWS layer; an app whose topics are on AWS adds
    workqueue_aws (roles/aws_role.sql): with it the outbox store writes rows, a relay pass takes,
    marks and defers them, and the bindings are read, all through the functions; no table of the
    schema can be read or written directly, and importing bindings stays the schema owner's."""
    from fastapi_workqueue.aws.outbox_store import OutboxRow, PostgresOutboxStore

    role = "workqueue_aws"
    existed = await role_exists(admin, role)
    script = sql_files.read("postgresql", "roles", "aws_role.sql")
    await admin.execute(script)
    await admin.execute(script)  # idempotent
    topic = unique("aws-role")
    store = PostgresOutboxStore()
    try:
        async with login_with(admin, runtime_role, role) as login:
            engine = create_async_engine(url_as(pg_url, login))
            try:
                messages = [prepare(PublishRequest(payload={"n": n})) for n in range(2)]
                async with engine.begin() as session:
                    await store.write(session, topic, [(m, f"body {n}") for n, m in enumerate(messages)])
                taken: list[OutboxRow] = []

                async def send(rows: list[OutboxRow]) -> tuple[list[int], list[tuple[int, str]], bool]:
                    mine = [r for r in rows if r.topic == topic]  # rows of other tests stay as they are
                    taken.extend(mine)
                    return [mine[0].id], [(mine[1].id, "Throttling: slow down")], True

                report = await store.relay_pass(engine, 1000, send, lambda attempts: 60.0, lambda: 0.0)
                assert (report.sent, report.deferred, report.throttled) == (1, 1, True)
                assert [r.message_id for r in taken] == [str(m.message_id) for m in messages]
                await store.list_bindings(engine)
            finally:
                await engine.dispose()
            conn = await asyncpg.connect(to_asyncpg_dsn(pg_url), user=login)
            try:
                for refused in ("SELECT 1 FROM workqueue.aws_outbox LIMIT 1",
                                "INSERT INTO workqueue.aws_outbox (topic, message_id, body, attributes) "
                                "VALUES ('t', gen_random_uuid(), '{}', '{}')",
                                "UPDATE workqueue.aws_outbox SET sent_at = now()",
                                "DELETE FROM workqueue.aws_outbox",
                                "SELECT 1 FROM workqueue.aws_binding LIMIT 1",
                                "DELETE FROM workqueue.aws_binding",
                                "SELECT 1 FROM workqueue.delivery LIMIT 1",
                                "SELECT workqueue.aws_binding_replace('r', ARRAY[]::text[], ARRAY[]::text[], "
                                "ARRAY[]::jsonb[])"):
                    with pytest.raises(asyncpg.InsufficientPrivilegeError):
                        await conn.execute(refused)
            finally:
                await conn.close()
        rows = await admin.fetch(
            "SELECT sent_at IS NOT NULL AS sent, attempts, last_error, next_attempt_at > now() + interval '50 seconds' "
            "AS put_off FROM workqueue.aws_outbox WHERE topic = $1 ORDER BY id", topic)
        assert [tuple(r) for r in rows] == [(True, 1, None, False), (False, 1, "Throttling: slow down", True)]
    finally:
        await admin.execute("DELETE FROM workqueue.aws_outbox WHERE topic = $1", topic)
        if not existed:
            await drop_role(admin, role)


async def test_role_scripts_run_at_once_by_several_deploy_jobs_all_succeed(
    pg_url: str, admin: asyncpg.Connection[Any]
) -> None:
    """Deploy jobs that run the role scripts at the same moment (each as one transaction, as
    ``psql -1`` or one string sends them) take turns instead of failing with ``tuple concurrently
    updated`` on the catalog rows their grants rewrite."""
    script = "\n".join(sql_files.read("postgresql", "roles", name) for name in ROLE_SCRIPTS.values())
    async with contextlib.AsyncExitStack() as stack:
        for role in ROLE_SCRIPTS:
            await stack.enter_async_context(scripted_role(admin, role))
        connections = [await asyncpg.connect(to_asyncpg_dsn(pg_url)) for _ in range(3)]
        try:
            for _ in range(4):
                await asyncio.gather(*(conn.execute(script) for conn in connections))
        finally:
            for conn in connections:
                await conn.close()
