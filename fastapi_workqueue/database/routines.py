"""The database transport, dialect-neutral: every queue operation is one call of a named routine.

A routine is a PostgreSQL function, a SQL Server stored procedure, or (SQLite) a Python function
running the dialect's named statements in one transaction: same name, same parameters, same
result columns everywhere. :class:`RoutineTransport` maps the transport contract onto those
calls; a dialect subclass supplies :meth:`RoutineTransport.call`, the connection handling and
migrations.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar, cast

from ..core.attempts import AttemptInfo
from ..core.clock import SYSTEM_CLOCK, Clock, time_to_pass
from ..core.envelope import (
    MAX_ENVELOPE_BYTES,
    PreparedMessage,
    PublishError,
    PublishResult,
    PublishStatus,
)
from ..core.errors import ActionRefused, ConfigurationError, TransportError, WorkQueueError
from ..core.failures import storable
from ..core.history import StatsPoint
from ..core.keys import ApiKeyInfo, KeyRecord
from ..core.leases import counted_lease
from ..core.lifecycle import follow_up_refused, settle_delay
from ..core.live_work import LIVE_COUNT_CAP, BlockedKey, FlowState, LiveCounts
from ..core.message_state import GroupMember
from ..core.observe import HEADERS_KEY, split_headers, trace_id_of
from ..core.processes import Holder, ProcessBeat, ProcessInfo, current_process, package_version
from ..core.redaction import redacting_logger
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
    TakenBack,
)
from ..core.retirement import DeleteResult, RetireResult, TopicStatus, TopicStatusChange, retired_not_paused
from ..core.search import SEARCH_LIMIT, FoundDelivery
from ..core.topology import Subscription, SubscriptionState, SubscriptionStatus, Topic, TopicState
from ..core.transport import (
    CLAIM_MANY_REFUSAL,
    FREES_KEYS,
    Capabilities,
    Claimed,
    ClaimedDelivery,
    HeartbeatRequest,
    HeartbeatResult,
    HeldBack,
    Settlement,
    SettleResult,
    WakeupListener,
)
from .migration_plan import pre_release_chain
from .sql_files import migrations

Row = Mapping[str, Any]
T = TypeVar("T")

log = redacting_logger("fastapi_workqueue.database")

HISTORY_KEEP_SECONDS = 86400.0
"""How long the stats history is kept (the dashboard charts its last hour)."""


class RandomSource(Protocol):
    """Where a transport draws the jitter of retries from: ``random.Random`` and
    ``random.SystemRandom`` fit, and so does a test's own source of known draws."""

    def random(self) -> float:
        """A fraction in [0, 1)."""
        ...


SYSTEM_RANDOM: RandomSource = random.Random()
"""The jitter source of a transport given none: seeded from the system's entropy at import (the
jitter spreads retries out; it guards no secret, so it need not read the OS for every draw)."""


def distinct_rounds(ids: Sequence[str]) -> list[list[int]]:
    """The indexes of ``ids`` in rounds that each name an id at most once, in the order given: the
    first mention of every id, then the second, and so on (one round when all differ)."""
    seen: dict[str, int] = {}
    rounds: list[list[int]] = []
    for index, key in enumerate(ids):
        n = seen.get(key, 0)
        seen[key] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(index)
    return rounds


class RoutineTransport:
    """The Transport contract on top of the queue routines of one database."""

    name = "database"
    dialect = ""
    capabilities = Capabilities()
    #: What publish sends as the attributes of a message without any: the stored form, or None
    #: where the routine reads a missing value as ``{}`` (it then need not parse one per item).
    empty_attributes: str | None = "{}"
    #: True where publish reads attributes or max attempts given once (an array of one) as every
    #: item's: a call whose items all carry the same ones sends them once instead of once per item.
    shares_repeated_values = False

    def __init__(self, *, rng: RandomSource | None = None, clock: Clock | None = None) -> None:
        """``rng`` draws the full-jitter fraction of each retry's backoff (one per settled item):
        a retry without a delay of its own waits u x min(max, base x 2^(attempt - 1)).

        ``clock`` is the time claims, heartbeats, settles, sweeps and prunes run at: by default the
        database's own; a test's :class:`~fastapi_workqueue.core.clock.ManualClock` moves it."""
        if rng is not None and not callable(getattr(rng, "random", None)):
            raise TypeError(f"rng must have a random() method, like random.Random; got {type(rng).__name__}")
        if clock is not None and not isinstance(clock, Clock):
            raise TypeError(
                f"clock must have a now() method returning an aware datetime, like "
                f"fastapi_workqueue.core.clock.ManualClock; got {type(clock).__name__}"
            )
        self.rng: RandomSource = SYSTEM_RANDOM if rng is None else rng
        self.clock: Clock = SYSTEM_CLOCK if clock is None else clock
        self._wakeup_listeners: list[WakeupListener] = []
        self._history_minute: int | None = None  # the minute this process last recorded the history
        self._history_failing = False

    # -- what a dialect provides -------------------------------------------------------------

    @abstractmethod
    async def call(
        self, routine: str, *, retry: bool = True, session: Any = None, connection: Any = None, **params: Any
    ) -> Sequence[Row]:
        """Runs routine ``routine`` with named ``params`` in a transaction of its own (or in
        ``session``'s, or in the transaction ``connection`` of :meth:`_in_transaction`) and returns
        its result rows. Lists are arrays; the dialect encodes them."""

    @abstractmethod
    async def _in_transaction(self, operation: str, work: Callable[[Any], Awaitable[T]]) -> T:
        """Runs ``work(connection)`` in one transaction of the store: every ``call(…,
        connection=connection)`` it makes joins that transaction, which commits when ``work``
        returns and rolls back when it raises. Tried again as a whole where a plain call would be
        (a deadlock, a busy file)."""

    @abstractmethod
    async def open(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def migrate(self) -> list[str]: ...

    # -- wake-ups ----------------------------------------------------------------------------

    async def add_wakeup_listener(self, listener: WakeupListener) -> None:
        self._wakeup_listeners.append(listener)
        await self._start_wakeups()

    async def _start_wakeups(self) -> None:
        """Opens what delivers wake-ups from other processes, where the dialect has it."""

    def _dispatch_wakeup(self, subscription_id: str) -> None:
        for listener in self._wakeup_listeners:
            listener(subscription_id)

    async def _scalar(self, routine: str, **params: Any) -> Any:
        rows = await self.call(routine, **params)
        return next(iter(rows[0].values())) if rows else None

    # -- topology ----------------------------------------------------------------------------

    async def sync_topology(self, topics: Sequence[Topic], subscriptions: Sequence[Subscription]) -> None:
        """Writes the declared topics and subscriptions in one transaction: a change the store
        refuses (a subscription moved to another topic, a partition mode changed under live work)
        leaves the whole topology as it was, not half of it written."""

        async def write(connection: Any) -> None:
            for topic in topics:
                await self.call(
                    "sync_topic", connection=connection, p_name=topic.name,
                    p_max_payload_bytes=topic.max_payload_bytes, p_is_fifo=topic.is_fifo, p_transport=topic.transport,
                )
            for sub in subscriptions:
                await self.call(
                    "sync_subscription", connection=connection,
                    p_name=sub.name, p_topic=sub.topic, p_handler_key=sub.handler_key,
                    p_partition_mode=sub.partition_mode, p_lease_seconds=sub.lease_seconds,
                    p_max_attempts=sub.max_attempts, p_backoff_base_seconds=sub.backoff_base_seconds,
                    p_backoff_max_seconds=sub.backoff_max_seconds,
                    p_max_processing_seconds=sub.max_processing_seconds, p_heartbeat_mode=sub.heartbeat_mode,
                    p_filter=None if sub.filter is None else json.dumps(sub.filter), p_host_type=sub.host_type,
                    p_retention_seconds=sub.retention_seconds, p_status=sub.status,
                    p_max_in_flight=sub.max_in_flight, p_key_concurrency=sub.key_concurrency,
                    p_rate_limit=sub.rate_limit, p_key_rate_limit=sub.key_rate_limit,
                )

        await self._in_transaction("sync topology", write)

    async def list_subscriptions(self) -> list[SubscriptionState]:
        rows = await self.call("list_subscriptions")
        return [
            SubscriptionState(
                id=str(r["id"]), name=r["name"], topic=r["topic"], handler_key=r["handler_key"],
                partition_mode=r["partition_mode"], lease_seconds=r["lease_seconds"],
                max_attempts=r["max_attempts"], backoff_base_seconds=r["backoff_base_seconds"],
                backoff_max_seconds=r["backoff_max_seconds"], max_processing_seconds=r["max_processing_seconds"],
                heartbeat_mode=r["heartbeat_mode"], filter=json_value(r["filter"]), status=r["status"],
                host_type=r["host_type"], retention_seconds=r["retention_seconds"], topic_status=r["topic_status"],
                transport_name=r["transport"], is_fifo=bool(r["is_fifo"]),
                max_in_flight=r["max_in_flight"], key_concurrency=r["key_concurrency"], rate_limit=r["rate_limit"],
                key_rate_limit=r["key_rate_limit"],
            )
            for r in rows
        ]

    async def list_topics(self) -> list[Topic]:
        rows = await self.call("list_topics")
        return [
            TopicState(name=r["name"], transport=r["transport"], max_payload_bytes=r["max_payload_bytes"],
                       is_fifo=bool(r["is_fifo"]), status=r["status"])
            for r in rows
        ]

    async def set_subscription_status(self, subscription: str, status: SubscriptionStatus) -> bool | None:
        rows = await self.call("set_subscription_status", p_name=subscription, p_status=status)
        if rows and status == "Paused" and rows[0]["status"] == "Retired":
            raise ActionRefused(retired_not_paused(subscription))
        return None if not rows else bool(rows[0]["changed"])

    # -- publish -----------------------------------------------------------------------------

    async def publish(
        self, topic: str, messages: Sequence[PreparedMessage], *, session: Any = None
    ) -> list[PublishResult]:
        return await self._publish_via(topic, messages, session=session, retry=session is None)

    async def _publish_via(self, topic: str, messages: Sequence[PreparedMessage], **via: Any) -> list[PublishResult]:
        """publish, with ``via`` passed on to :meth:`call` (``session=`` and ``retry=``, or the
        ``connection=`` of a transaction)."""
        if not messages:
            return []
        # One pass over the messages, then one list per column (the routine takes arrays).
        empty = self.empty_attributes
        (ids, keys, attributes, payloads, refs, correlations, hashes, dedup_keys, dedup_ttls, delays,
         not_befores, max_attempts, backoffs, sizes, priorities) = map(list, zip(*[
            (m.message_id, m.partition_key, m.attributes_json if m.attributes or m.headers else empty, m.payload_json,
             m.payload_ref, m.correlation_id,
             m.content_hash, m.deduplication_key,
             m.deduplication_ttl_seconds if m.deduplication_key is not None else None,
             m.delay_seconds, m.not_before, m.max_attempts,
             backoff_schedule_json(m), m.envelope_bytes, m.priority or None)
            for m in messages
        ], strict=True))
        if self.shares_repeated_values:  # (a bulk of one job: its name and its tries)
            attributes, max_attempts = sent_once(attributes), sent_once(max_attempts)
        rows = list(await self.call(
            "publish",
            **via,
            p_topic=topic,
            p_message_ids=ids,
            p_partition_keys=keys,
            p_attributes=attributes,
            p_payloads=payloads,
            p_payload_refs=refs,
            p_correlation_ids=correlations,
            p_content_hashes=hashes,
            p_deduplication_keys=dedup_keys,
            p_deduplication_ttls=dedup_ttls,
            p_delays=delays,
            p_not_befores=not_befores,
            p_max_attempts=max_attempts,
            p_backoff_schedules=backoffs,
            p_envelope_bytes=sizes,
            p_priorities=priorities,
        ))
        if not rows:  # the routine's shorthand: every item was Accepted
            return [accepted(m) for m in messages]
        rows.sort(key=lambda r: r["idx"])
        return [publish_result(r, m) for r, m in zip(rows, messages, strict=True)]

    # -- consume -----------------------------------------------------------------------------

    async def claim(self, subscription: str, limit: int) -> list[ClaimedDelivery]:
        rows = await self.call("claim", retry=False, p_subscription=subscription, p_limit=limit,
                               p_holder=current_process().id, p_now=self._now(),
                               p_lease_seconds=counted_lease(subscription))
        if rows and rows[-1]["delivery_id"] is None:  # a flow limit kept work back: said in a last row
            last = rows[-1]
            return Claimed([claimed(r) for r in rows[:-1]], HeldBack(last["held_back"], last["retry_after"]))
        return [claimed(r) for r in rows]

    async def claim_many(self, subscriptions: Sequence[str], limit: int) -> list[tuple[str, ClaimedDelivery]]:
        """One claim across several None-mode subscriptions: up to ``limit`` deliveries, the oldest
        due first whatever their subscription, each leased with its own subscription's lease and
        answered with its name. Paused ones give nothing; an Exclusive or Ordered one is refused."""
        if isinstance(subscriptions, str):
            raise TypeError(
                f"claim_many takes a sequence of subscription names, got the string {subscriptions!r}; "
                "claim one subscription with claim"
            )
        names = list(dict.fromkeys(subscriptions))
        if not names or limit < 1:
            return []
        try:
            rows = await self.call("claim_many", retry=False, p_subscriptions=names, p_limit=limit,
                                   p_holder=current_process().id, p_now=self._now(),
                                   p_lease_seconds=[counted_lease(name) for name in names])
        except WorkQueueError as exc:
            text = str(exc)
            if CLAIM_MANY_REFUSAL in text:
                raise ValueError(text[text.index(CLAIM_MANY_REFUSAL):]) from exc
            raise
        return [(r["subscription"], claimed(r)) for r in rows]

    async def heartbeat(self, requests: Sequence[HeartbeatRequest]) -> list[HeartbeatResult]:
        if not requests:
            return []
        results: list[HeartbeatResult | None] = [None] * len(requests)
        # (a delivery named twice, by a stale attempt and the current one, goes in two calls: the
        # routine answers by delivery id, and each token must be weighed on its own)
        for indexes in distinct_rounds([r.delivery_id for r in requests]):
            sent = requests if len(indexes) == len(requests) else [requests[i] for i in indexes]
            rows = await self.call(
                "heartbeat",
                p_ids=[int(r.delivery_id) for r in sent],
                p_tokens=[r.lease_token for r in sent],
                p_percents=[r.percent for r in sent],
                p_messages=[r.message for r in sent],
                p_now=self._now(),
                p_lease_seconds=[r.lease_seconds for r in sent],
            )
            by_id = {str(r["delivery_id"]): r for r in rows}
            for i in indexes:
                row = by_id.get(requests[i].delivery_id)
                results[i] = HeartbeatResult(
                    delivery_id=requests[i].delivery_id,
                    alive=bool(row and row["alive"]),
                    cancel_requested=bool(row and row["cancel_requested"]),
                    lease_expires_at=row["lease_expires_at"] if row else None,
                )
        return cast(list[HeartbeatResult], results)  # (every index is answered in its round)

    async def settle(self, settlements: Sequence[Settlement]) -> list[SettleResult]:
        if not settlements:
            return []
        return await self._settle_call(settlements, [self._draw() for _ in settlements])

    async def _settle_call(self, settlements: Sequence[Settlement], draws: list[float], **via: Any
                           ) -> list[SettleResult]:
        """The ``settle`` routine for ``settlements`` (``via`` as :meth:`call` takes it): a result
        each, LeaseLost for one the routine did not answer. A delivery named twice (a settle held
        back past its lease, and the next attempt's) goes in two calls, in the order given, so
        that each token is weighed on its own: only the current one settles."""
        results: list[SettleResult] = ["LeaseLost"] * len(settlements)
        for indexes in distinct_rounds([s.delivery_id for s in settlements]):
            sent = settlements if len(indexes) == len(settlements) else [settlements[i] for i in indexes]
            rows = await self.call(
                "settle",
                **via,
                p_ids=[int(s.delivery_id) for s in sent],
                p_tokens=[s.lease_token for s in sent],
                p_outcomes=[s.kind for s in sent],
                p_delays=[settle_delay(s.delay_seconds) for s in sent],
                p_reasons=[s.reason for s in sent],
                p_errors=[s.error for s in sent],
                p_draws=draws if len(indexes) == len(draws) else [draws[i] for i in indexes],
                p_now=self._now(),
            )
            by_id: dict[str, SettleResult] = {str(r["delivery_id"]): r["result"] for r in rows}
            for i in indexes:
                results[i] = by_id.get(settlements[i].delivery_id, "LeaseLost")
        return results

    async def settle_with_follow_ups(self, settlement: Settlement) -> SettleResult:
        """Settles one delivery and, only when that completes it, keeps its result
        (``settlement.result_json``) and publishes each of its follow-ups (``settlement.follow_ups``)
        to its topic, all in one transaction: the result and the follow-ups exist if and only if
        the completion was written. A lost lease, or a delivery an operator cancelled
        (Discarded), publishes nothing. A follow-up message the publish refuses rolls the whole
        transaction back (the delivery stays InFlight) and raises a :class:`TransportError` that
        names it; a Duplicate (the same MessageID and content stored already) is no refusal."""
        draws = [self._draw()]
        [result] = await self._in_transaction(
            "settle with follow-ups", lambda connection: self._settle_in(connection, [settlement], draws)
        )
        return result

    async def settle_together(self, settlements: Sequence[Settlement]) -> list[SettleResult] | None:
        """:meth:`settle_with_follow_ups` of several settlements in one transaction (one commit
        for all); None, with nothing written, when one of them was refused (a follow-up the publish
        refuses: the caller then writes each on its own, which says which). Raises a retryable
        :class:`TransportError` when the store is out of reach."""
        draws = [self._draw() for _ in settlements]
        try:
            return await self._in_transaction(
                "settle together", lambda connection: self._settle_in(connection, settlements, draws)
            )
        except Exception as exc:
            if isinstance(exc, TransportError) and exc.retryable:
                raise
            log.debug("settling %d deliveries together failed (%s); settling each on its own", len(settlements), exc)
            return None

    async def _settle_in(self, connection: Any, settlements: Sequence[Settlement], draws: list[float]
                         ) -> list[SettleResult]:
        """Settles ``settlements`` in ``connection``'s transaction, then keeps the result and
        publishes the follow-ups of each one the settle completed (raises :class:`TransportError`
        for a follow-up the publish refuses)."""
        results = await self._settle_call(settlements, draws, connection=connection)
        completed = [s for s, result in zip(settlements, results, strict=True) if result == "Completed"]
        await self._call_each(connection, "result_put", [
            {"p_delivery_id": int(s.delivery_id), "p_value": s.result_json}
            for s in completed if s.result_json is not None])
        await self._call_each(connection, "release_deduplication_key", [
            {"p_topic": topic, "p_key": key, "p_message_id": message_id}
            for s, result in zip(settlements, results, strict=True) if result in FREES_KEYS
            for topic, key, message_id in s.frees])
        # One publish per topic for the follow-ups of every completion, in the order they were given.
        by_topic: dict[str, list[tuple[str, PreparedMessage]]] = {}
        for s in completed:
            for follow_up in s.follow_ups:
                by_topic.setdefault(follow_up.topic, []).extend((s.delivery_id, m) for m in follow_up.messages)
        for topic, items in by_topic.items():
            published = await self._publish_via(topic, [m for _, m in items], connection=connection)
            refused = [(item, a) for item, a in zip(items, published, strict=True)
                       if a.status not in (PublishStatus.ACCEPTED, PublishStatus.DUPLICATE)]
            if refused:
                # The message that was refused, not one the publish aborted because of it.
                (delivery_id, message), answer = next(
                    ((item, a) for item, a in refused if a.error is None or a.error.code != "BatchAborted"), refused[0])
                raise TransportError(follow_up_refused(delivery_id, topic, message, answer))
        return results

    async def _call_each(self, connection: Any, routine: str, calls: list[dict[str, Any]]) -> None:
        """:meth:`call` of ``routine`` once for each of ``calls`` (its arguments by name, the same names
        in each), in ``connection``'s transaction; the answers are not read."""
        for params in calls:
            await self.call(routine, connection=connection, **params)

    async def store_now(self) -> datetime:
        """The time by the store's clock (:func:`..core.clock.store_now`): the transport's clock
        when it was given one; else the process's, which is an SQLite store's clock (PostgreSQL
        reads its own)."""
        return self._now() or datetime.now(UTC)

    def _now(self) -> datetime | None:
        """``p_now`` of a claim, heartbeat, settle or sweep: None (the database's clock) unless the
        transport was given a clock of its own."""
        return time_to_pass(self.clock)

    def _draw(self) -> float:
        draw = self.rng.random()
        if not 0.0 <= draw < 1.0:
            raise ValueError(f"rng.random() must return a fraction in [0, 1); it returned {draw!r}")
        return draw

    # -- once markers ------------------------------------------------------------------------

    async def once_begin(self, key: str, running_seconds: float) -> tuple[str, str | None]:
        rows = await self.call("once_begin", p_key=key, p_running_seconds=running_seconds)
        return rows[0]["state"], sid(rows[0]["token"])

    async def once_finish(self, key: str, token: str, ttl_seconds: float) -> bool:
        return bool(await self._scalar("once_finish", p_key=key, p_token=token, p_ttl_seconds=ttl_seconds))

    async def once_abort(self, key: str, token: str) -> bool:
        return bool(await self._scalar("once_abort", p_key=key, p_token=token))

    async def once_renew(self, key: str, token: str, running_seconds: float) -> bool:
        return bool(await self._scalar("once_renew", p_key=key, p_token=token, p_running_seconds=running_seconds))

    # -- deduplication keys and step results ---------------------------------------------------

    async def release_deduplication_key(self, topic: str, key: str, message_id: uuid.UUID, *,
                                        session: Any = None) -> bool:
        """Frees ``key`` of ``topic`` if ``message_id`` holds it; True when it held it (live)."""
        return bool(await self._scalar(
            "release_deduplication_key", session=session, p_topic=topic, p_key=key, p_message_id=message_id,
        ))

    async def step_get(self, message_id: uuid.UUID, name: str) -> tuple[bool, str | None]:
        """(True, the stored JSON) of step ``name`` of the message's work, or (False, None)."""
        rows = await self.call("step_get", p_message_id=message_id, p_name=name)
        return (True, rows[0]["value"]) if rows else (False, None)

    async def step_put(self, message_id: uuid.UUID, name: str, value_json: str) -> None:
        """Stores a step's JSON result unless one is stored already (the first write wins); it is
        removed with the message."""
        if not isinstance(value_json, str):
            raise TypeError(f"step_put stores JSON text; serialize the value first, got {type(value_json).__name__}")
        await self.call("step_put", p_message_id=message_id, p_name=name, p_value=value_json)

    # -- results -----------------------------------------------------------------------------

    async def result_get(self, message_id: uuid.UUID) -> str | None:
        """The JSON text kept when the message's delivery completed with a result, or None."""
        rows = await self.call("result_get", p_message_id=message_id)
        return str(rows[0]["value"]) if rows else None

    async def debounce(self, topic: str, key: str, message: PreparedMessage, seconds: float, *,
                       session: Any = None) -> uuid.UUID | None:
        """The pending message holding ``topic``'s ``key`` takes ``message``'s payload and comes due
        ``seconds`` from now while it still waits out its window (its MessageID); else the key is
        freed and None answered (see :class:`~fastapi_workqueue.core.message_state.MessageState`)."""
        rows = await self.call(
            "debounce", session=session, retry=session is None, p_topic=topic, p_key=key,
            p_payload=message.payload_json, p_content_hash=message.content_hash,
            p_envelope_bytes=message.envelope_bytes, p_seconds=seconds, p_now=self._now(),
        )
        return uuid.UUID(str(rows[0]["message_id"])) if rows else None

    async def group_create(self, group_id: uuid.UUID, members: Sequence[uuid.UUID], then: uuid.UUID, *,
                           session: Any = None) -> int:
        """Makes ``members`` a group whose end releases the held message ``then`` (see
        :class:`~fastapi_workqueue.core.message_state.MessageState`); answers the members not ended."""
        rows = await self.call("group_create", session=session, retry=session is None, p_group=group_id,
                               p_members=list(members), p_then=then)
        return int(rows[0]["remaining"]) if rows else 0

    async def group_members(self, group_id: uuid.UUID) -> list[GroupMember]:
        """The members of a group, in order, each with its first delivery and stored result."""
        rows = await self.call("group_members", p_group=group_id)
        return [GroupMember(message_id=as_uuid(r["message_id"]), ended_at=r["ended_at"],
                            delivery=None if r["delivery_id"] is None else member_delivery(r), result=r["result"])
                for r in rows]

    # -- housekeeping ------------------------------------------------------------------------

    async def sweep(self, limit: int = 1000) -> SweepReport:
        """One sweeper pass; a pass that ran also records the minute's stats history."""
        rows = await self.call("sweep", p_limit=limit, p_now=self._now())
        values = as_dict(rows[0])
        values["taken_back"] = [taken_back(item) for item in json_value(values.get("taken_back")) or ()]
        report = SweepReport.model_validate(values)
        if report.ran:
            await self._record_history_after_sweep()
        return report

    async def _record_history_after_sweep(self) -> None:
        """Records the stats history once a minute at most from this process (the routine itself
        writes a minute once across all of them). The history serves the dashboard only: when it
        cannot be written (a database not migrated to it, a role without EXECUTE on it) the pass
        stands and the reason is logged, as a warning the first time."""
        minute = int(time.time() // 60)
        if self._history_minute == minute:
            return
        try:
            await self.record_stats_history()
        except (TransportError, ConfigurationError) as exc:
            level = logging.DEBUG if self._history_failing else logging.WARNING
            log.log(level, "the stats history was not recorded (the dashboard's chart lacks this minute): %s", exc)
            self._history_failing = True
            return
        self._history_minute = minute
        self._history_failing = False

    async def record_stats_history(
        self, *, keep_seconds: float = HISTORY_KEEP_SECONDS, now: datetime | None = None
    ) -> int:
        """Writes this minute's stats history point of every subscription, unless some process
        wrote this minute already, and deletes the points older than ``keep_seconds``; returns how
        many points it wrote. ``now`` stands in for the clock."""
        return int(await self._scalar("record_stats_history", p_keep_seconds=keep_seconds, p_now=now) or 0)

    async def stats_history(self, since: datetime, subscription: str | None = None) -> list[StatsPoint]:
        """The stats history recorded since ``since`` (at most a day back), oldest first."""
        rows = await self.call("stats_history", p_since=since, p_subscription=subscription)
        return [StatsPoint.model_validate(as_dict(r)) for r in rows]

    async def flow_state(self, subscription: str, *, cap: int = LIVE_COUNT_CAP) -> FlowState | None:
        """How full ``subscription``'s flow limits are now (:class:`FlowState`); None when unknown."""
        rows = await self.call("flow_state", p_subscription=subscription, p_cap=cap, p_now=self._now())
        if not rows:
            return None
        r = rows[0]
        return FlowState(subscription=subscription, in_flight=r["in_flight"], tokens=r["tokens"],
                         keys_at_limit=r["keys_at_limit"], waiting=r["waiting"], cap=cap)

    async def live_counts(
        self, subscription: str | None = None, *, cap: int = LIVE_COUNT_CAP, stuck_before: datetime | None = None
    ) -> list[LiveCounts]:
        """Each subscription's (or one's) Pending, InFlight and DeadLettered counts, each stopping
        at ``cap``: bounded, where stats counts every live delivery; the oldest claimable
        delivery's wait, and the InFlight ones claimed before ``stuck_before``."""
        rows = await self.call("live_counts", p_subscription=subscription, p_cap=cap, p_stuck_before=stuck_before)
        return [LiveCounts.model_validate({**as_dict(r), "cap": cap}) for r in rows]

    async def blocked_keys(
        self, subscription: str, *, limit: int = 50, cap: int = LIVE_COUNT_CAP
    ) -> list[BlockedKey]:
        """The keys of an Ordered subscription whose head blocks them (dead-lettered, or waiting to
        be retried), oldest head first, at most ``limit``, with the deliveries waiting behind each
        counted up to ``cap``."""
        rows = await self.call("blocked_keys", p_subscription=subscription, p_limit=limit, p_cap=cap)
        return [BlockedKey.model_validate({**as_dict(r), "head_delivery_id": str(r["head_delivery_id"])})
                for r in rows]

    async def prune(self, older_than_seconds: float, *, batch: int = 5000) -> int:
        """Removes Completed and Discarded deliveries settled more than ``older_than_seconds`` ago."""
        total = 0
        while True:
            removed = int(await self._scalar("prune", p_older_than_seconds=older_than_seconds, p_limit=batch,
                                             p_now=self._now()))
            total += removed
            if removed < batch:
                return total

    # -- operate -----------------------------------------------------------------------------

    async def stats(self, subscription: str | None = None) -> list[SubscriptionStats]:
        rows = await self.call("stats", p_subscription=subscription)
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
        rows = await self.call("backlog", p_subscription=subscription)
        return Backlog.model_validate(as_dict(rows[0])) if rows else None

    async def get_delivery(self, delivery_id: str, *, include_payload: bool = False) -> DeliveryInfo | None:
        numeric = delivery_number(delivery_id)
        if numeric is None:
            return None
        rows = await self.call("get_delivery", p_delivery_id=numeric)
        return delivery_info(rows[0], None, include_payload) if rows else None

    async def delivery_attempts(self, delivery_id: str) -> list[AttemptInfo]:
        """The kept attempts of one delivery (off the happy path), oldest first."""
        numeric = delivery_number(delivery_id)
        if numeric is None:
            return []
        rows = await self.call("delivery_attempts", p_delivery_id=numeric)
        return [
            AttemptInfo(attempt=r["attempt"], started_at=r["started_at"], ended_at=r["ended_at"],
                        outcome=r["outcome"], reason=r["reason"], error=r["error"], holder=holder(r))
            for r in rows
        ]

    async def search_deliveries(self, query: str, *, limit: int = 25) -> list[FoundDelivery]:
        """The deliveries whose id, MessageID, partition key, correlation ID or job name is
        ``query``, newest first, at most ``limit`` (payloads left out)."""
        query = query.strip()
        if not query or len(query) > 512 or storable(query) != query:
            return []  # no id or name is stored with a NUL or a lone surrogate
        rows = await self.call("search_deliveries", p_query=query, p_limit=max(1, min(limit, SEARCH_LIMIT)))
        return [FoundDelivery(matched=r["matched"], delivery=delivery_info(r, None, False)) for r in rows]

    async def known_messages(self, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """Which of these MessageIDs the store has."""
        wanted = list(dict.fromkeys(ids))
        if not wanted:
            return set()
        rows = await self.call("known_messages", p_ids=wanted)
        return {as_uuid(r["message_id"]) for r in rows}

    async def message_deliveries(self, message_id: uuid.UUID, *, include_payload: bool = False) -> list[DeliveryInfo]:
        """Every delivery of one message, each with its subscription, as get_delivery answers."""
        rows = await self.call("message_deliveries", p_message_id=message_id)
        return [delivery_info(r, None, include_payload) for r in rows]

    async def list_deliveries(
        self,
        subscription: str,
        status: DeliveryStatus,
        *,
        limit: int = 100,
        after: str | None = None,
        include_payload: bool = False,
    ) -> list[DeliveryInfo]:
        if after and not (after.isascii() and after.isdigit()):
            return []  # (another transport's id, aws:...: this subscription gave none such)
        after_id = max(int(after), 0) if after else 0
        if after_id > MAX_DELIVERY_ID:
            return []  # nothing comes after the largest id there can be
        rows = await self.call(
            "list_deliveries", p_subscription=subscription, p_status=status, p_limit=limit, p_after_id=after_id,
        )
        return [delivery_info(r, subscription, include_payload) for r in rows]

    # -- retiring and deleting subscriptions and topics -------------------------------------

    async def retire_subscription(self, name: str) -> RetireResult | None:
        rows = await self.call("retire_subscription", p_name=name)
        return RetireResult(subscription=name, changed=bool(rows[0]["changed"])) if rows else None

    async def discard_pending(self, name: str, reason: str | None, limit: int) -> int:
        return int(await self._scalar("discard_pending", p_subscription=name, p_reason=reason, p_limit=limit))

    async def delete_subscription(self, name: str) -> DeleteResult:
        [row] = await self.call("delete_subscription", p_name=name)
        return DeleteResult(name=name, result=row["result"], remaining=row["remaining"])

    async def set_topic_status(self, name: str, status: TopicStatus) -> TopicStatusChange | None:
        rows = await self.call("set_topic_status", p_name=name, p_status=status)
        return TopicStatusChange(topic=name, status=status, changed=bool(rows[0]["changed"])) if rows else None

    async def delete_topic(self, name: str) -> DeleteResult:
        [row] = await self.call("delete_topic", p_name=name)
        return DeleteResult(name=name, result=row["result"], remaining=row["remaining"])

    # -- the process registry ----------------------------------------------------------------

    async def process_beat(self, beat: ProcessBeat) -> None:
        me = beat.identity
        await self.call(
            "process_beat", p_id=me.id, p_hostname=me.hostname, p_pid=me.pid, p_started_at=me.started_at,
            p_version=package_version(), p_subscriptions=json.dumps(list(beat.subscriptions)),
            p_slots=beat.slots, p_busy=beat.busy, p_beat_interval_seconds=beat.interval_seconds,
        )

    async def process_stop(self, process_id: uuid.UUID) -> None:
        await self.call("process_stop", p_id=process_id)

    async def list_processes(self) -> list[ProcessInfo]:
        rows = await self.call("list_processes")
        return [
            ProcessInfo(
                process_id=r["process_id"], hostname=r["hostname"], pid=r["pid"], started_at=r["started_at"],
                version=r["version"], subscriptions=json_value(r["subscriptions"]), slots=r["slots"],
                busy=r["busy"], last_seen_at=r["last_seen_at"], stopped_at=r["stopped_at"], state=r["state"],
                in_flight=r["in_flight"],
            )
            for r in rows
        ]

    async def partitions(
        self, subscription: str, condition: PartitionCondition | None = None, *, limit: int = 100
    ) -> list[PartitionInfo]:
        rows = await self.call("partitions", p_subscription=subscription, p_condition=condition, p_limit=limit)
        return [
            PartitionInfo(
                partition_key=r["partition_key"], condition=r["condition"],
                head_delivery_id=sid(r["head_delivery_id"]), head_status=r["head_status"],
                head_attempt=r["head_attempt"], head_visible_at=r["head_visible_at"],
                waiting_items=r["waiting_items"],
            )
            for r in rows
        ]

    async def replay(self, subscription: str, delivery_id: str, note: str | None = None) -> ActionResult:
        return await self._action("replay", subscription, delivery_id, p_note=note)

    async def discard(self, subscription: str, delivery_id: str, reason: str | None = None) -> ActionResult:
        return await self._action("discard", subscription, delivery_id, p_reason=reason)

    async def discard_dead_letters(self, subscription: str, settled_before: datetime, limit: int = 1000) -> int:
        """Discards the subscription's DeadLettered deliveries settled before ``settled_before``
        (reason ``pruned``), at most ``limit`` per transaction, until none is left; returns how many
        it discarded. A dead letter another transaction holds (a replay) is left for the next call."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if settled_before.tzinfo is None:
            raise ValueError(
                "settled_before must be an aware datetime, e.g. datetime.now(UTC) - timedelta(days=7); "
                f"got {settled_before!r} without a time zone"
            )
        total = 0
        while True:
            discarded = int(await self._scalar(
                "discard_dead_letters", p_subscription=subscription, p_settled_before=settled_before, p_limit=limit,
            ))
            total += discarded
            if discarded < limit:
                return total

    async def rewrite_payload(
        self, message_id: uuid.UUID, payload_json: str, content_hash: str, envelope_bytes: int
    ) -> bool:
        """Replaces a stored message's payload and content hash (re-encryption with a new key) while
        none of its deliveries is InFlight or ended Completed or Discarded; True when it rewrote,
        False when the message is not stored or a delivery forbids it. An envelope over the cap
        (256 KiB, or the topic's lower ``max_payload_bytes``) is refused."""
        if envelope_bytes > MAX_ENVELOPE_BYTES:
            raise ValueError(
                f"the rewritten envelope is {envelope_bytes} bytes; a message holds at most {MAX_ENVELOPE_BYTES} "
                "(MAX_ENVELOPE_BYTES)"
            )
        return bool(await self._scalar(
            "rewrite_payload", p_message_id=message_id, p_payload=payload_json, p_content_hash=content_hash,
            p_envelope_bytes=envelope_bytes,
        ))

    async def _action(self, routine: str, subscription: str, delivery_id: str, **text: Any) -> ActionResult:
        numeric = delivery_number(delivery_id)
        if numeric is None:
            return ActionResult(result="NotFound", delivery_id=delivery_id, subscription=subscription)
        rows = await self.call(routine, p_subscription=subscription, p_delivery_id=numeric, **text)
        row = rows[0]
        cancel_requested = bool(row.get("cancel_requested", False))
        if row["result"] == "NotDeadLettered" and row["delivery_status"] == "InFlight" and not cancel_requested:
            # (the refusal names the delivery's state; whether a cancel waits on it is read here)
            info = await self.get_delivery(delivery_id)
            cancel_requested = info is not None and info.cancel_requested
        return ActionResult(
            result=row["result"],
            delivery_id=delivery_id,
            subscription=subscription,
            cancel_requested=cancel_requested,
            status=row["delivery_status"],
        )

    async def validate_bindings(self) -> BindingReport:
        """Checks that every migration this release ships is applied, unchanged."""
        issues: list[BindingIssue] = []
        try:
            rows = await self.call("schema_versions")
        except ConfigurationError as exc:
            issues.append(BindingIssue(severity="Error", subject="schema", message=str(exc)))
            rows = []
        applied = {r["version"]: r["checksum"] for r in rows}
        refusal = pre_release_chain(self.dialect, applied)
        if refusal is not None:
            issues.append(BindingIssue(severity="Error", subject="schema", message=refusal))
        for migration in migrations(self.dialect) if refusal is None else ():
            if migration.version not in applied:
                issues.append(BindingIssue(
                    severity="Error", subject=f"migration {migration.label}",
                    message="not applied to this database; run `workqueue migrate` as the schema owner",
                ))
            elif applied[migration.version] != migration.checksum:
                issues.append(BindingIssue(
                    severity="Error", subject=f"migration {migration.label}",
                    message="applied with different content than this release ships; restore the file",
                ))
        issues.extend(await self.dialect_issues())
        ok = not any(i.severity == "Error" for i in issues)
        return BindingReport(transport=self.name, ok=ok, issues=issues)

    async def dialect_issues(self) -> list[BindingIssue]:
        """What a dialect adds to validate-bindings (settings to change, features it lacks)."""
        return []

    # -- API keys ----------------------------------------------------------------------------

    async def api_key_create(
        self, key_id: uuid.UUID, name: str, prefix: str, key_hash: str, scopes: list[str],
        expires_at: datetime | None, topics: list[str] | None = None,
    ) -> None:
        await self.call(
            "api_key_create", p_id=key_id, p_name=name, p_prefix=prefix, p_key_hash=key_hash, p_scopes=scopes,
            p_expires_at=expires_at, p_topics=topics,
        )

    async def api_key_verify(self, prefix: str, key_hash: str) -> KeyRecord | None:
        """The usable key behind ``prefix`` when ``key_hash`` is its hash (the store compares)."""
        return _key_record(await self.call("api_key_verify", p_prefix=prefix, p_key_hash=key_hash))

    async def api_key_session(self, prefix: str) -> KeyRecord | None:
        """The usable key behind ``prefix``, for a dashboard session the app signed itself."""
        return _key_record(await self.call("api_key_session", p_prefix=prefix))

    async def api_key_end_sessions(self, key_id: str, session_generation: int) -> None:
        """Ends the dashboard sessions of a key made at ``session_generation`` (a sign-out)."""
        await self.call("api_key_end_sessions", p_id=uuid.UUID(key_id), p_session_generation=session_generation)

    async def api_key_touch(self, key_id: str) -> None:
        """Marks a key used (the store writes at most once a minute); only once its hash matched."""
        await self.call("api_key_touch", p_id=uuid.UUID(key_id))

    async def api_key_list(self) -> list[ApiKeyInfo]:
        rows = await self.call("api_key_list")
        return [ApiKeyInfo.model_validate({**as_dict(r), "scopes": json_list(r["scopes"]),
                                           "topics": None if r["topics"] is None else json_list(r["topics"])})
                for r in rows]

    async def api_key_revoke(self, key: str) -> int:
        return int(await self._scalar("api_key_revoke", p_key=key))


# -- rows → models -------------------------------------------------------------------------------


def _key_record(rows: Sequence[Row]) -> KeyRecord | None:
    if not rows:
        return None
    r = rows[0]
    topics = r["topics"]
    return KeyRecord(id=str(r["id"]), name=r["name"], scopes=tuple(json_list(r["scopes"])),
                     topics=None if topics is None else tuple(json_list(topics)),
                     session_generation=int(r["session_generation"]))


def as_dict(row: Row) -> dict[str, Any]:
    """A driver row as a plain dict."""
    return dict(row.items())


def user_attributes(stored: Any) -> Any:
    """A message's stored attributes without the library's headers."""
    if isinstance(stored, Mapping) and HEADERS_KEY in stored:
        return split_headers(stored)[0]
    return stored


def json_value(value: Any) -> Any:
    """A JSON column as Python: drivers hand over text or already-parsed values."""
    if value is None or not isinstance(value, str):
        return value
    return json.loads(value)


def json_list(value: Any) -> list[str]:
    """An array column (a native array, or JSON text where the database has no arrays)."""
    if isinstance(value, str):
        return list(json.loads(value))
    return list(value or [])


def sid(value: Any) -> str | None:
    return None if value is None else str(value)


def as_uuid(value: Any) -> uuid.UUID:
    """A uuid column as a UUID (drivers hand over UUIDs or their text)."""
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))




MAX_DELIVERY_ID = 2**63 - 1
"""Delivery ids are 64-bit integers in every store."""


def delivery_number(delivery_id: str) -> int | None:
    """A delivery id as the stores keep it, or None when no delivery can have it: not written as
    the listings write ids (ASCII digits, no sign, no leading zero or blank: ``0012`` is not
    delivery 12), or outside the 64-bit range the driver would refuse to send."""
    if not (delivery_id.isascii() and delivery_id.isdigit()) or delivery_id.startswith("0") or len(delivery_id) > 19:
        return None
    numeric = int(delivery_id)
    return numeric if numeric <= MAX_DELIVERY_ID else None


_ACCEPTED = PublishStatus.ACCEPTED


_ACCEPTED_FIELDS = frozenset({"status", "message_id", "error"})


def accepted(message: PreparedMessage) -> PublishResult:
    """An Accepted result, built without re-validating what the transport wrote (it is in the hot
    path of batch publishes): the same state ``model_construct`` would give, written into
    pydantic's instance fields (kept for its speed and tested on the lowest and newest pydantic,
    see ``core.handlers._construct_message``)."""
    result = PublishResult.__new__(PublishResult)
    object.__setattr__(result, "__dict__", {"status": _ACCEPTED, "message_id": message.message_id, "error": None})
    object.__setattr__(result, "__pydantic_fields_set__", set(_ACCEPTED_FIELDS))
    object.__setattr__(result, "__pydantic_extra__", None)
    object.__setattr__(result, "__pydantic_private__", None)
    return result


def sent_once(column: list[Any]) -> list[Any]:
    """``column`` as an array of one when every item holds the same value (not None), else as it is."""
    if len(column) > 1 and column[0] is not None and column.count(column[0]) == len(column):
        return column[:1]
    return column


def backoff_schedule_json(message: PreparedMessage) -> str | None:
    """The message's own backoff schedule as the routines take it (JSON text), or None."""
    return None if message.backoff_seconds is None else json.dumps(message.backoff_seconds)


def publish_result(row: Row, message: PreparedMessage) -> PublishResult:
    status = row["status"]
    if status == "Accepted":
        return accepted(message)
    error = None
    if row["error_code"] is not None:
        error = PublishError(code=row["error_code"], message=row["error_message"])
    mid = row["message_id"]
    return PublishResult(
        status=PublishStatus(status),
        message_id=None if mid is None else uuid.UUID(str(mid)),
        error=error,
    )


_PARSED_ATTRIBUTES: dict[str, dict[str, Any]] = {}
"""Stored attributes texts parsed before (a job's ``{"job": ...}``, ``{}``): most deliveries repeat one."""
_PARSED_KEPT = 256
_PARSED_LONGEST = 256


def stored_attributes(raw: Any) -> Any:
    """A claimed delivery's stored attributes as Python, each short text parsed once per process
    (read only: :func:`split_headers` copies them for the delivery)."""
    if not isinstance(raw, str):
        return raw or {}
    found = _PARSED_ATTRIBUTES.get(raw)
    if found is None:
        found = json.loads(raw)
        if len(raw) <= _PARSED_LONGEST and type(found) is dict and HEADERS_KEY not in found:
            if len(_PARSED_ATTRIBUTES) >= _PARSED_KEPT:
                _PARSED_ATTRIBUTES.clear()
            _PARSED_ATTRIBUTES[raw] = found
    return found


def claimed(r: Row) -> ClaimedDelivery:
    attributes, headers = split_headers(stored_attributes(r["attributes"]))
    return ClaimedDelivery(
        delivery_id=str(r["delivery_id"]),
        lease_token=str(r["lease_token"]),
        attempt=r["attempt"],
        max_attempts=r["max_attempts"],
        lease_expires_at=r["lease_expires_at"],
        message_id=r["message_id"] if isinstance(r["message_id"], uuid.UUID) else uuid.UUID(str(r["message_id"])),
        topic=r["topic"],
        partition_key=r["partition_key"],
        attributes=attributes,
        payload_json=r["payload"],
        payload_ref=r["payload_ref"],
        correlation_id=r["correlation_id"],
        published_at=r["published_at"],
        headers=headers,
    )


def delivery_info(row: Row, subscription: str | None, include_payload: bool) -> DeliveryInfo:
    keys = set(row.keys())

    def get(name: str, default: Any = None) -> Any:
        return row[name] if name in keys else default

    stored = json_value(row["attributes"])
    return DeliveryInfo(
        delivery_id=str(row["delivery_id"]),
        subscription=subscription or row["subscription"],
        message_id=row["message_id"],
        topic=get("topic"),
        partition_key=row["partition_key"],
        status=row["status"],
        attempt=row["attempt"],
        max_attempts=row["max_attempts"],
        reason=row["reason"],
        last_error=row["last_error"],
        note=row["note"],
        cancel_requested=bool(get("cancel_requested", False)),
        progress_percent=get("progress_percent"),
        progress_message=get("progress_message"),
        visible_at=get("visible_at"),
        lease_expires_at=get("lease_expires_at"),
        created_at=row["created_at"],
        claimed_at=get("claimed_at"),
        settled_at=row["settled_at"],
        attributes=user_attributes(stored),
        correlation_id=row["correlation_id"],
        payload=json_value(row["payload"]) if include_payload else None,
        holder=holder(row),
        trace_id=trace_id_of(split_headers(stored)[1]) if isinstance(stored, Mapping) else None,
    )


def member_delivery(row: Row) -> DeliveryInfo:
    """A group member's delivery as ``group_members`` answers it."""
    return DeliveryInfo(
        delivery_id=str(row["delivery_id"]), subscription=row["subscription"], message_id=as_uuid(row["message_id"]),
        status=row["status"], attempt=row["attempt"], max_attempts=row["max_attempts"], reason=row["reason"],
        last_error=row["last_error"], visible_at=row["visible_at"], created_at=row["created_at"],
        claimed_at=row["claimed_at"], settled_at=row["settled_at"],
        attributes=user_attributes(json_value(row["attributes"])),
    )


def taken_back(item: Mapping[str, Any]) -> TakenBack:
    """One lease a sweeper pass took back, from the pass's JSON."""
    return TakenBack(delivery_id=str(item["delivery_id"]), subscription=item["subscription"], result=item["result"],
                     attempt=item["attempt"], holder=holder(item))


def holder(row: Row) -> Holder | None:
    """The holder columns of a delivery listing, or None when no process ever claimed it."""
    process_id = row.get("holder_id")
    if process_id is None:
        return None
    return Holder(process_id=process_id, hostname=row.get("holder_host"), pid=row.get("holder_pid"),
                  started_at=row.get("holder_started_at"))
