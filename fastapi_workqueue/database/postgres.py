"""The PostgreSQL transport: every operation is one call of a ``workqueue.*`` SQL function."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import asyncpg

from ..core.envelope import PreparedMessage, PublishError, PublishResult, PublishStatus
from ..core.errors import ConfigurationError
from ..core.keys import ApiKeyInfo, StoredKey
from ..core.reports import (
    ActionResult,
    Backlog,
    BindingIssue,
    BindingReport,
    DeliveryInfo,
    DeliveryStatus,
    PartitionCondition,
    PartitionInfo,
    SubscriptionStats,
    SweepReport,
)
from ..core.topology import Subscription, SubscriptionState, SubscriptionStatus, Topic
from ..core.transport import (
    Capabilities,
    ClaimedDelivery,
    HeartbeatRequest,
    HeartbeatResult,
    Settlement,
    SettleResult,
    WakeupListener,
)
from .errors import map_error, with_retries
from .listener import NotificationListener
from .migrations import apply_postgres_migrations
from .session import SessionExecutor
from .sql_files import migrations

log = logging.getLogger("fastapi_workqueue.postgres")

CHANNEL = "workqueue"

_PUBLISH = (
    "SELECT idx, status, message_id, error_code, error_message FROM workqueue.publish("
    "$1, $2::uuid[], $3::text[], $4::jsonb[], $5::text[], $6::text[], $7::text[], $8::text[], $9::text[], "
    "$10::float8[], $11::float8[], $12::timestamptz[], $13::int[], $14::text[], $15::int[])"
)
_CLAIM = "SELECT * FROM workqueue.claim($1, $2)"
_HEARTBEAT = "SELECT * FROM workqueue.heartbeat($1::bigint[], $2::uuid[], $3::int2[], $4::text[])"
_SETTLE = (
    "SELECT * FROM workqueue.settle($1::bigint[], $2::uuid[], $3::text[], $4::float8[], $5::text[], $6::text[])"
)


def to_asyncpg_dsn(url: str) -> str:
    """``postgresql+asyncpg://…`` (SQLAlchemy style) → ``postgresql://…`` (libpq style)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"database URL {url!r} has no scheme; use postgresql+asyncpg://user@host/db")
    base = scheme.split("+", 1)[0]
    if base not in ("postgresql", "postgres"):
        raise ValueError(f"database URL scheme {scheme!r} is not PostgreSQL")
    return f"postgresql://{rest}"


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb travels as text both ways: the library parses it itself, in both the pool and the
    # caller's-session paths.
    await conn.set_type_codec(
        "jsonb", encoder=lambda v: v, decoder=lambda v: v, schema="pg_catalog", format="text"
    )


async def _keep_session(conn: Any) -> None:
    """Pool reset: nothing to undo. The queue's statements leave no session state (no SET, LISTEN,
    cursors or session locks); an open transaction is still rolled back by the pool. The default
    reset would cost a round trip per use of a connection."""


_ACCEPTED = PublishStatus.ACCEPTED


def _publish_result(row: Mapping[str, Any], message: PreparedMessage) -> PublishResult:
    status = row["status"]
    if status == "Accepted":
        return PublishResult.model_construct(status=_ACCEPTED, message_id=message.message_id, error=None)
    error = None
    if row["error_code"] is not None:
        error = PublishError(code=row["error_code"], message=row["error_message"])
    mid = row["message_id"]
    return PublishResult(
        status=PublishStatus(status),
        message_id=None if mid is None else uuid.UUID(str(mid)),
        error=error,
    )


def _claimed(r: Mapping[str, Any]) -> ClaimedDelivery:
    return ClaimedDelivery(
        delivery_id=str(r["delivery_id"]),
        lease_token=str(r["lease_token"]),
        attempt=r["attempt"],
        max_attempts=r["max_attempts"],
        lease_expires_at=r["lease_expires_at"],
        message_id=r["message_id"],
        topic=r["topic"],
        partition_key=r["partition_key"],
        attributes=json.loads(r["attributes"]) if r["attributes"] else {},
        payload_json=r["payload"],
        payload_ref=r["payload_ref"],
        correlation_id=r["correlation_id"],
        published_at=r["published_at"],
    )


def _settle_args(settlements: Sequence[Settlement]) -> tuple[list[Any], ...]:
    return (
        [int(s.delivery_id) for s in settlements],
        [s.lease_token for s in settlements],
        [s.kind for s in settlements],
        [s.delay_seconds for s in settlements],
        [s.reason for s in settlements],
        [s.error for s in settlements],
    )


def _json_or_none(value: Any) -> Any:
    if value is None or not isinstance(value, str):
        return value
    return json.loads(value)


def _sid(value: Any) -> str | None:
    return None if value is None else str(value)


class PostgresTransport:
    """The database transport on PostgreSQL through an asyncpg pool."""

    name = "postgresql"
    capabilities = Capabilities(
        ordered=True,
        exclusive=True,
        transactional_publish=True,
        wakeups=True,
        runtime_roles=True,
    )

    def __init__(
        self,
        url: str,
        *,
        pool_min_size: int = 1,
        pool_max_size: int = 10,
        listen: bool = True,
        connect_timeout: float = 10.0,
    ) -> None:
        self.url = url
        self._dsn = to_asyncpg_dsn(url)
        self._pool_min_size = pool_min_size
        self._pool_max_size = pool_max_size
        self._connect_timeout = connect_timeout
        self._pool: asyncpg.Pool | None = None
        self._listen = listen
        self._listener: NotificationListener | None = None
        self._wakeup_listeners: list[WakeupListener] = []

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Creates the pool (and the LISTEN connection). Fails fast with a clear error."""
        if self._pool is not None:
            return
        try:
            self._pool = await asyncpg.create_pool(
                self._dsn,
                min_size=self._pool_min_size,
                max_size=self._pool_max_size,
                init=_init_connection,
                reset=_keep_session,
                timeout=self._connect_timeout,
            )
        except Exception as exc:
            raise map_error(exc, f"connecting to {self._safe_url()}") from exc
        if self._listen:
            self._listener = NotificationListener(self._dsn, CHANNEL, self._dispatch_wakeup)
            await self._listener.start()

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    def _safe_url(self) -> str:
        scheme, _, rest = self.url.partition("://")
        host = rest.rsplit("@", 1)[-1]
        return f"{scheme}://{host}"

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("the transport is not open; use it inside the WorkQueue's lifespan")
        return self._pool

    def add_wakeup_listener(self, listener: WakeupListener) -> None:
        self._wakeup_listeners.append(listener)

    def _dispatch_wakeup(self, subscription_id: str) -> None:
        for listener in self._wakeup_listeners:
            listener(subscription_id)

    async def _fetch(self, operation: str, sql: str, *args: Any, retry: bool = True) -> list[Any]:
        async def call() -> list[Any]:
            async with self.pool.acquire() as conn:
                return list(await conn.fetch(sql, *args))

        if retry:
            return await with_retries(operation, call)
        try:
            return await call()
        except Exception as exc:
            raise map_error(exc, operation) from exc

    async def migrate(self) -> list[str]:
        """Applies the pending migrations; returns the names applied now."""

        async def call() -> list[str]:
            async with self.pool.acquire() as conn:
                return await apply_postgres_migrations(conn)

        return await with_retries("migrate", call)

    # -- topology ----------------------------------------------------------------------------

    async def sync_topology(self, topics: Sequence[Topic], subscriptions: Sequence[Subscription]) -> None:
        async def call() -> None:
            async with self.pool.acquire() as conn, conn.transaction():
                for topic in topics:
                    await conn.execute(
                        "SELECT workqueue.sync_topic($1, $2, $3, $4)",
                        topic.name, topic.max_payload_bytes, topic.is_fifo, topic.transport,
                    )
                for sub in subscriptions:
                    await conn.execute(
                        "SELECT workqueue.sync_subscription($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, "
                        "$11::jsonb, $12, $13, $14)",
                        sub.name, sub.topic, sub.handler_key, sub.partition_mode, sub.lease_seconds,
                        sub.max_attempts, sub.backoff_base_seconds, sub.backoff_max_seconds,
                        sub.max_processing_seconds, sub.heartbeat_mode,
                        None if sub.filter is None else json.dumps(sub.filter),
                        sub.host_type, sub.retention_seconds, sub.status,
                    )

        await with_retries("sync topology", call)

    async def list_subscriptions(self) -> list[SubscriptionState]:
        rows = await self._fetch("list subscriptions", "SELECT * FROM workqueue.list_subscriptions()")
        return [
            SubscriptionState(
                id=str(r["id"]),
                name=r["name"],
                topic=r["topic"],
                handler_key=r["handler_key"],
                partition_mode=r["partition_mode"],
                lease_seconds=r["lease_seconds"],
                max_attempts=r["max_attempts"],
                backoff_base_seconds=r["backoff_base_seconds"],
                backoff_max_seconds=r["backoff_max_seconds"],
                max_processing_seconds=r["max_processing_seconds"],
                heartbeat_mode=r["heartbeat_mode"],
                filter=_json_or_none(r["filter"]),
                status=r["status"],
                host_type=r["host_type"],
                retention_seconds=r["retention_seconds"],
                topic_status=r["topic_status"],
                transport_name=r["transport"],
                is_fifo=r["is_fifo"],
            )
            for r in rows
        ]

    async def list_topics(self) -> list[Topic]:
        rows = await self._fetch("list topics", "SELECT * FROM workqueue.list_topics()")
        return [
            Topic(name=r["name"], transport=r["transport"], max_payload_bytes=r["max_payload_bytes"],
                  is_fifo=r["is_fifo"])
            for r in rows
        ]

    async def set_subscription_status(self, subscription: str, status: SubscriptionStatus) -> bool | None:
        rows = await self._fetch(
            "set subscription status", "SELECT * FROM workqueue.set_subscription_status($1, $2)",
            subscription, status,
        )
        return None if not rows else bool(rows[0]["changed"])

    # -- publish -----------------------------------------------------------------------------

    async def publish(
        self, topic: str, messages: Sequence[PreparedMessage], *, session: Any = None
    ) -> list[PublishResult]:
        if not messages:
            return []
        args = (
            topic,
            [m.message_id for m in messages],
            [m.partition_key for m in messages],
            [m.attributes_json for m in messages],
            [m.payload_json for m in messages],
            [m.payload_ref for m in messages],
            [m.correlation_id for m in messages],
            [m.content_hash for m in messages],
            [m.deduplication_key for m in messages],
            [m.deduplication_ttl_seconds for m in messages],
            [m.delay_seconds for m in messages],
            [m.not_before for m in messages],
            [m.max_attempts for m in messages],
            [None if m.backoff_seconds is None else json.dumps(m.backoff_seconds) for m in messages],
            [m.envelope_bytes for m in messages],
        )
        if session is not None:
            try:
                rows = await SessionExecutor(session).fetch(_PUBLISH, args)
            except Exception as exc:
                raise map_error(exc, f"publish to {topic}") from exc
        else:
            rows = await self._fetch(f"publish to {topic}", _PUBLISH, *args)
        rows.sort(key=lambda r: r["idx"])
        return [_publish_result(r, m) for r, m in zip(rows, messages, strict=True)]

    # -- consume -----------------------------------------------------------------------------

    async def claim(self, subscription: str, limit: int) -> list[ClaimedDelivery]:
        rows = await self._fetch(f"claim from {subscription}", _CLAIM, subscription, limit, retry=False)
        return [_claimed(r) for r in rows]

    async def heartbeat(self, requests: Sequence[HeartbeatRequest]) -> list[HeartbeatResult]:
        if not requests:
            return []
        rows = await self._fetch(
            "heartbeat",
            _HEARTBEAT,
            [int(r.delivery_id) for r in requests],
            [r.lease_token for r in requests],
            [r.percent for r in requests],
            [r.message for r in requests],
        )
        by_id = {str(r["delivery_id"]): r for r in rows}
        results = []
        for request in requests:
            row = by_id.get(request.delivery_id)
            results.append(
                HeartbeatResult(
                    delivery_id=request.delivery_id,
                    alive=bool(row and row["alive"]),
                    cancel_requested=bool(row and row["cancel_requested"]),
                    lease_expires_at=row["lease_expires_at"] if row else None,
                )
            )
        return results

    async def settle(self, settlements: Sequence[Settlement]) -> list[SettleResult]:
        if not settlements:
            return []
        rows = await self._fetch("settle", _SETTLE, *_settle_args(settlements))
        by_id: dict[str, SettleResult] = {str(r["delivery_id"]): r["result"] for r in rows}
        return [by_id.get(s.delivery_id, "LeaseLost") for s in settlements]

    # -- once markers ------------------------------------------------------------------------

    async def once_begin(self, key: str, running_seconds: float) -> tuple[str, str | None]:
        rows = await self._fetch("once", "SELECT * FROM workqueue.once_begin($1, $2)", key, running_seconds)
        return rows[0]["state"], _sid(rows[0]["token"])

    async def once_finish(self, key: str, token: str, ttl_seconds: float) -> bool:
        rows = await self._fetch("once", "SELECT workqueue.once_finish($1, $2, $3) AS ok", key, token, ttl_seconds)
        return bool(rows[0]["ok"])

    async def once_abort(self, key: str, token: str) -> bool:
        rows = await self._fetch("once", "SELECT workqueue.once_abort($1, $2) AS ok", key, token)
        return bool(rows[0]["ok"])

    # -- housekeeping ------------------------------------------------------------------------

    async def sweep(self, limit: int = 1000) -> SweepReport:
        rows = await self._fetch("sweep", "SELECT * FROM workqueue.sweep($1)", limit)
        return SweepReport.model_validate(dict(rows[0]))

    # -- operate -----------------------------------------------------------------------------

    async def stats(self, subscription: str | None = None) -> list[SubscriptionStats]:
        rows = await self._fetch("stats", "SELECT * FROM workqueue.stats($1)", subscription)
        return [
            SubscriptionStats(
                subscription=r["subscription"], topic=r["topic"], status=r["subscription_status"],
                partition_mode=r["partition_mode"], pending=r["pending"], claimable=r["claimable"],
                in_flight=r["in_flight"], dead_lettered=r["dead_lettered"], completed=r["completed"],
                discarded=r["discarded"], oldest_pending_at=r["oldest_pending_at"],
            )
            for r in rows
        ]

    async def backlog(self, subscription: str) -> Backlog | None:
        rows = await self._fetch("backlog", "SELECT * FROM workqueue.backlog($1)", subscription)
        return Backlog.model_validate(dict(rows[0])) if rows else None

    async def get_delivery(self, delivery_id: str, *, include_payload: bool = False) -> DeliveryInfo | None:
        try:
            numeric = int(delivery_id)
        except ValueError:
            return None
        rows = await self._fetch("get delivery", "SELECT * FROM workqueue.get_delivery($1)", numeric)
        return self._delivery_info(rows[0], None, include_payload) if rows else None

    async def list_deliveries(
        self,
        subscription: str,
        status: DeliveryStatus,
        *,
        limit: int = 100,
        after: str | None = None,
        include_payload: bool = False,
    ) -> list[DeliveryInfo]:
        rows = await self._fetch(
            "list deliveries",
            "SELECT * FROM workqueue.list_deliveries($1, $2, $3, $4)",
            subscription, status, limit, int(after) if after else 0,
        )
        return [self._delivery_info(r, subscription, include_payload) for r in rows]

    @staticmethod
    def _delivery_info(row: Mapping[str, Any], subscription: str | None, include_payload: bool) -> DeliveryInfo:
        keys = set(row.keys())
        return DeliveryInfo(
            delivery_id=str(row["delivery_id"]),
            subscription=subscription or row["subscription"],
            message_id=row["message_id"],
            topic=row["topic"] if "topic" in keys else None,
            partition_key=row["partition_key"],
            status=row["status"],
            attempt=row["attempt"],
            max_attempts=row["max_attempts"],
            reason=row["reason"],
            last_error=row["last_error"],
            note=row["note"],
            cancel_requested=row["cancel_requested"] if "cancel_requested" in keys else False,
            progress_percent=row["progress_percent"] if "progress_percent" in keys else None,
            progress_message=row["progress_message"] if "progress_message" in keys else None,
            visible_at=row["visible_at"] if "visible_at" in keys else None,
            lease_expires_at=row["lease_expires_at"] if "lease_expires_at" in keys else None,
            created_at=row["created_at"],
            claimed_at=row["claimed_at"] if "claimed_at" in keys else None,
            settled_at=row["settled_at"],
            attributes=_json_or_none(row["attributes"]),
            correlation_id=row["correlation_id"],
            payload=_json_or_none(row["payload"]) if include_payload else None,
        )

    async def partitions(
        self, subscription: str, condition: PartitionCondition | None = None, *, limit: int = 100
    ) -> list[PartitionInfo]:
        rows = await self._fetch(
            "partitions", "SELECT * FROM workqueue.partitions($1, $2, $3)", subscription, condition, limit
        )
        return [
            PartitionInfo(
                partition_key=r["partition_key"], condition=r["condition"],
                head_delivery_id=_sid(r["head_delivery_id"]), head_status=r["head_status"],
                head_attempt=r["head_attempt"], head_visible_at=r["head_visible_at"],
                waiting_items=r["waiting_items"],
            )
            for r in rows
        ]

    async def replay(self, subscription: str, delivery_id: str, note: str | None = None) -> ActionResult:
        return await self._action(
            "replay", "SELECT * FROM workqueue.replay($1, $2, $3)", subscription, delivery_id, note
        )

    async def discard(self, subscription: str, delivery_id: str, reason: str | None = None) -> ActionResult:
        return await self._action(
            "discard", "SELECT * FROM workqueue.discard($1, $2, $3)", subscription, delivery_id, reason
        )

    async def _action(
        self, operation: str, sql: str, subscription: str, delivery_id: str, text: str | None
    ) -> ActionResult:
        try:
            numeric = int(delivery_id)
        except ValueError:
            return ActionResult(result="NotFound", delivery_id=delivery_id, subscription=subscription)
        rows = await self._fetch(operation, sql, subscription, numeric, text)
        row = rows[0]
        return ActionResult(
            result=row["result"],
            delivery_id=delivery_id,
            subscription=subscription,
            cancel_requested=bool(row.get("cancel_requested", False)),
            status=row["delivery_status"],
        )

    async def prune(self, older_than_seconds: float, *, batch: int = 5000) -> int:
        """Removes Completed and Discarded deliveries settled more than ``older_than_seconds`` ago."""
        total = 0
        while True:
            rows = await self._fetch("prune", "SELECT workqueue.prune($1, $2) AS n", older_than_seconds, batch)
            removed = int(rows[0]["n"])
            total += removed
            if removed < batch:
                return total

    async def validate_bindings(self) -> BindingReport:
        """Checks the schema version and what this transport offers."""
        issues: list[BindingIssue] = []
        try:
            rows = await self._fetch("validate bindings", "SELECT * FROM workqueue.schema_versions()")
        except ConfigurationError as exc:
            issues.append(BindingIssue(severity="Error", subject="schema", message=str(exc)))
            rows = []
        applied = {r["version"]: r["checksum"] for r in rows}
        for migration in migrations("postgresql"):
            label = f"{migration.version:04d}_{migration.name}"
            if migration.version not in applied:
                issues.append(BindingIssue(
                    severity="Error", subject=f"migration {label}",
                    message="not applied to this database; run `workqueue migrate` as the schema owner",
                ))
            elif applied[migration.version] != migration.checksum:
                issues.append(BindingIssue(
                    severity="Error", subject=f"migration {label}",
                    message="applied with different content than this release ships; restore the file",
                ))
        ok = not any(i.severity == "Error" for i in issues)
        return BindingReport(transport=self.name, ok=ok, issues=issues)

    # -- API keys ----------------------------------------------------------------------------

    async def api_key_create(
        self, key_id: uuid.UUID, name: str, prefix: str, key_hash: str, scopes: list[str], expires_at: datetime | None
    ) -> None:
        await self._fetch(
            "create API key", "SELECT workqueue.api_key_create($1, $2, $3, $4, $5, $6)",
            key_id, name, prefix, key_hash, scopes, expires_at,
        )

    async def api_key_lookup(self, prefix: str) -> StoredKey | None:
        rows = await self._fetch("check API key", "SELECT * FROM workqueue.api_key_lookup($1)", prefix)
        if not rows:
            return None
        r = rows[0]
        return StoredKey(id=str(r["id"]), name=r["name"], key_hash=r["key_hash"], scopes=tuple(r["scopes"]))

    async def api_key_list(self) -> list[ApiKeyInfo]:
        rows = await self._fetch("list API keys", "SELECT * FROM workqueue.api_key_list()")
        return [ApiKeyInfo.model_validate(dict(r)) for r in rows]

    async def api_key_revoke(self, key: str) -> int:
        rows = await self._fetch("revoke API key", "SELECT workqueue.api_key_revoke($1) AS n", key)
        return int(rows[0]["n"])

    # -- helpers for tests and tools ---------------------------------------------------------

    async def run_in_connection(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        """Runs ``fn`` with a pooled connection (for tooling; not part of the transport contract)."""
        async with self.pool.acquire() as conn:
            return await fn(conn)
