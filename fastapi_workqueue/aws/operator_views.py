"""The aws transport's operator views: stats from the queue attributes, a delivery as SQS and this
process know it, dead letters read from the DLQ, replay (back to the source queue, keeping the
MessageID and the delivery id) and discard (deleted from the DLQ). What SQS cannot do (cancel of an
in-flight message, exact per-key backlog, addressing a waiting message) answers Unsupported with
the reason. :class:`OperatorViews` is a part of :class:`.transport.AwsTransport`."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ..core.errors import TransportCannot, TransportError
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
)
from . import body as bodies
from .leases import Lease
from .naming import NAME

if TYPE_CHECKING:
    from ..core.topology import Subscription, SubscriptionStatus, Topic
    from ..core.transport import Capabilities
    from .bindings import Bindings
    from .dead_letter_reads import DeadLetterReads
    from .records import SettledRecords

CANCEL_UNSUPPORTED = "SQS cannot cancel an in-flight message; wait for it to settle, or discard it once dead-lettered"
WAITING_UNSUPPORTED = (
    "it is not among the dead letters (on the DLQ), the only messages SQS can address by id: it waits, runs in "
    "another process (which alone can tell), or has ended; let it run, or dead-letter it from its handler"
)
BACKLOG_UNSUPPORTED = "SQS reports approximate queue counts only, not a backlog per partition key"


def split_delivery_id(delivery_id: str) -> tuple[str, str] | None:
    """``aws:<subscription>:<origin>`` (or the older ``aws:<subscription>:dlq:<id>``) as
    (subscription, origin), where the origin is the SQS MessageId the delivery was first received
    with; None for another transport's id."""
    prefix = f"{NAME}:"
    if not delivery_id.startswith(prefix):
        return None
    rest = delivery_id[len(prefix):]
    if ":dlq:" in rest:
        subscription, origin = rest.split(":dlq:", 1)
    elif ":" in rest:
        subscription, origin = rest.rsplit(":", 1)
    else:
        return None
    return (subscription, origin) if subscription and origin else None


class OperatorViews:
    """The operator calls of the aws transport (stats, deliveries, dead letters, replay, discard)."""

    if TYPE_CHECKING:  # kept by AwsTransport
        bindings: Bindings | None
        records: SettledRecords
        capabilities: Capabilities
        _topics: dict[str, Topic]
        _subscriptions: dict[str, Subscription]
        _leases: dict[str, Lease]
        _dead_letter_reads: DeadLetterReads

        @property
        def sqs(self) -> Any: ...

        def _sub(self, subscription: str) -> Subscription: ...

        def _urls(self, subscription: str) -> tuple[str, str]: ...

        def _fifo(self, subscription: str) -> bool: ...

        def subscription_status(self, subscription: str) -> SubscriptionStatus: ...


    async def _attributes(self, url: str) -> dict[str, str]:
        answer = await self.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])
        attributes: dict[str, str] = answer.get("Attributes", {})
        return attributes

    async def stats(self, subscription: str | None = None) -> list[SubscriptionStats]:
        """From the queue attributes (approximate, as SQS reports them); unbound subscriptions are
        left out of the whole list, and ``subscription`` unbound raises TransportNotReady (which
        says to bind it), not an empty answer that reads as "does not exist"."""
        names = [subscription] if subscription is not None else sorted(self._subscriptions)
        found: list[SubscriptionStats] = []
        assert self.bindings is not None
        for name in names:
            sub = self._sub(name)
            if name not in self.bindings.subscriptions and subscription is None:
                continue
            queue_url, dlq_url = self._urls(name)
            queue, dlq = await self._attributes(queue_url), await self._attributes(dlq_url)
            visible = int(queue.get("ApproximateNumberOfMessages", 0))
            delayed = int(queue.get("ApproximateNumberOfMessagesDelayed", 0))
            status = self.subscription_status(name)
            found.append(
                SubscriptionStats(
                    subscription=name,
                    topic=sub.topic,
                    status=status,
                    partition_mode=sub.partition_mode,
                    pending=visible + delayed,
                    claimable=visible if status == "Active" else 0,
                    in_flight=int(queue.get("ApproximateNumberOfMessagesNotVisible", 0)),
                    dead_lettered=int(dlq.get("ApproximateNumberOfMessages", 0)),
                    completed=0,
                    discarded=0,
                )
            )
        return found

    async def backlog(self, subscription: str) -> Backlog | None:
        found = await self.stats(subscription)
        if not found:
            return None
        stats = found[0]
        return Backlog(  # (SQS's in-flight count holds the retries waiting out their backoff, too)
            subscription=subscription, claimable=stats.claimable, in_flight=stats.in_flight,
            backlog=stats.claimable + stats.in_flight,
        )

    async def get_delivery(self, delivery_id: str, *, include_payload: bool = False) -> DeliveryInfo | None:
        """What SQS and this process can tell: a lease held here (InFlight), a completion or discard
        made here, a dead letter on the DLQ, a retry, release or replay made here (Pending, with
        the visibility set); None for a delivery this process never saw that is not on the DLQ."""
        lease = self._leases.get(delivery_id)
        if lease is not None and lease.lease_expires_at > datetime.now(UTC):
            return self._lease_info(delivery_id, lease, include_payload)
        if lease is not None:
            # SQS made it visible again when the lease ran out; SQS counts the next receive.
            return self._info(delivery_id, lease.subscription, lease.body, "Pending", lease.attempt,
                              lease.attributes, include_payload, reason="lease expired",
                              visible_at=lease.lease_expires_at, claimed_at=lease.claimed_at)
        recorded = self.records.get(delivery_id)
        if recorded is not None and recorded.status in ("Completed", "Discarded"):
            return recorded
        parts = split_delivery_id(delivery_id)
        if parts is None or parts[0] not in self._subscriptions or parts[0] not in self._bound():
            return None
        found = await self._find_dead_letter(*parts)
        if found is not None:
            return self._dead_info(parts[0], found, include_payload)
        return recorded

    def _bound(self) -> dict[str, Any]:
        assert self.bindings is not None
        return dict(self.bindings.subscriptions)

    def _lease_info(self, delivery_id: str, lease: Lease, include_payload: bool) -> DeliveryInfo:
        return self._info(
            delivery_id,
            lease.subscription,
            lease.body,
            "InFlight",
            lease.attempt,
            lease.attributes,
            include_payload,
            lease_expires_at=lease.lease_expires_at,
            claimed_at=lease.claimed_at,
            progress_percent=lease.progress_percent,
            progress_message=lease.progress_message,
        )

    def _info(
        self,
        delivery_id: str,
        subscription: str,
        body: str,
        status: DeliveryStatus,
        attempt: int,
        attributes: dict[str, str],
        include_payload: bool,
        **extra: Any,
    ) -> DeliveryInfo:
        sub = self._sub(subscription)
        origin = delivery_id.rsplit(":", 1)[-1]
        env = bodies.decode(body, origin)
        dead = env.get("dead_letter") or {}
        message_id = bodies.message_uuid(env, origin)
        published = env.get("published_at")
        fields: dict[str, Any] = {
            "reason": dead.get("reason"),
            "last_error": dead.get("error"),
            "note": env.get("replay_note"),
            "created_at": datetime.fromisoformat(published) if isinstance(published, str) else None,
            **extra,
        }
        return DeliveryInfo(
            delivery_id=delivery_id,
            subscription=subscription,
            message_id=message_id,
            topic=sub.topic,
            partition_key=env.get("partition_key"),
            status=status,
            attempt=int(dead.get("attempts", attempt)),
            max_attempts=int(env.get("max_attempts") or sub.max_attempts),
            attributes=attributes,
            correlation_id=env.get("correlation_id"),
            payload=env.get("payload") if include_payload else None,
            **fields,
        )

    @staticmethod
    def _origin(message: dict[str, Any]) -> str:
        """The SQS MessageId the delivery was first received with (a redrive keeps the MessageId;
        the transport's own dead letters and replays carry it as ``origin_id``)."""
        return bodies.origin_of(bodies.decode(message["Body"], message["MessageId"]), message["MessageId"])

    def _dead_info(self, subscription: str, message: dict[str, Any], include_payload: bool) -> DeliveryInfo:
        attributes = {
            k: str(v.get("StringValue"))
            for k, v in message.get("MessageAttributes", {}).items()
            if v.get("StringValue") is not None and k != bodies.NO_ATTRIBUTES
        }
        system = message.get("Attributes", {})
        env = bodies.decode(message["Body"], message["MessageId"])
        dead = env.get("dead_letter") or {}
        settled = dead.get("dead_lettered_at")
        info = self._info(
            f"{NAME}:{subscription}:{self._origin(message)}",
            subscription,
            message["Body"],
            "DeadLettered",
            int(system.get("ApproximateReceiveCount", "1")),
            attributes,
            include_payload,
            settled_at=datetime.fromisoformat(settled) if isinstance(settled, str) else None,
        )
        if info.reason is None:
            info = info.model_copy(update={"reason": "MaxReceiveCountExceeded"})
        return info

    async def _read_dead_letters(self, subscription: str, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` DLQ messages, for a listing or a lookup (:mod:`.dead_letter_reads`)."""
        return (await self._dead_letter_reads.listed(subscription))[:limit]

    async def _find_dead_letter(self, subscription: str, origin: str, *, fresh: bool = False) -> dict[str, Any] | None:
        """The DLQ message of the delivery ``origin`` (or whose own MessageId it is); ``fresh``:
        read now, for a replay or discard that holds the subscription's read lock."""
        messages = (await self._dead_letter_reads.read(subscription, 1000) if fresh
                    else await self._read_dead_letters(subscription, 1000))
        for message in messages:
            if origin in (self._origin(message), message["MessageId"]):
                return message
        return None

    async def known_messages(self, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        return set()

    async def message_deliveries(self, message_id: uuid.UUID, *, include_payload: bool = False) -> list[DeliveryInfo]:
        return []

    async def list_deliveries(
        self,
        subscription: str,
        status: DeliveryStatus,
        *,
        limit: int = 100,
        after: str | None = None,
        include_payload: bool = False,
    ) -> list[DeliveryInfo]:
        # After an id this subscription never gave (a database id, another subscription's) nothing
        # comes, as on the database transports; never the first page again, which would turn a
        # client's paging loop into an endless one.
        foreign = after is not None and not after.startswith(f"{NAME}:{subscription}:")
        if status == "InFlight":
            if foreign:
                return []
            held = sorted(
                (self._lease_info(d, lease, include_payload)
                 for d, lease in self._leases.items()
                 if lease.subscription == subscription and lease.lease_expires_at > datetime.now(UTC)),
                key=lambda i: i.delivery_id,
            )
            return [i for i in held if after is None or i.delivery_id > after][:limit]
        if status != "DeadLettered":
            raise TransportError(
                f"the aws transport lists DeadLettered deliveries (from the DLQ) and this "
                f"process's InFlight ones, not {status}: SQS cannot list a queue",
                retryable=False,
            )
        if foreign:
            return []
        infos = [
            self._dead_info(subscription, m, include_payload) for m in await self._read_dead_letters(subscription, 1000)
        ]
        infos.sort(key=lambda i: i.delivery_id)
        if after is not None:
            infos = [i for i in infos if i.delivery_id > after]
        return infos[:limit]

    async def partitions(
        self, subscription: str, condition: PartitionCondition | None = None, *, limit: int = 100
    ) -> list[PartitionInfo]:
        raise TransportCannot(f"Unsupported: {BACKLOG_UNSUPPORTED}")

    def _terminal_answer(self, subscription: str, delivery_id: str) -> ActionResult | None:
        """AlreadyTerminal for a delivery this process completed or discarded, else None."""
        recorded = self.records.get(delivery_id)
        if recorded is not None and recorded.status in ("Completed", "Discarded"):
            return ActionResult(result="AlreadyTerminal", delivery_id=delivery_id, subscription=subscription,
                                status=recorded.status)
        return None

    async def replay(self, subscription: str, delivery_id: str, note: str | None = None) -> ActionResult:
        """Moves a dead letter back to its queue: same body (MessageID) and delivery id, the
        operator's note, attempts start again (a new SQS message, received for the first time)."""
        async with self._dead_letter_reads.lock(subscription):  # (two replays of one must not both find it)
            return await self._replay(subscription, delivery_id, note)

    async def _replay(self, subscription: str, delivery_id: str, note: str | None) -> ActionResult:
        parts = split_delivery_id(delivery_id)
        message = None
        if parts is not None and parts[0] == subscription and subscription in self._bound():
            message = await self._find_dead_letter(subscription, parts[1], fresh=True)
        if message is None:
            known = delivery_id in self._leases or self.records.get(delivery_id) is not None
            result = "NotDeadLettered" if known else "NotFound"
            return ActionResult(result=result, delivery_id=delivery_id, subscription=subscription)
        queue_url, dlq_url = self._urls(subscription)
        origin = self._origin(message)
        env = bodies.decode(message["Body"], message["MessageId"])
        dead = env.pop("dead_letter", None)
        came_from = dead.get("group_id") if isinstance(dead, dict) else None
        env["origin_id"] = origin
        if note is not None:
            env["replay_note"] = note
        else:
            env.pop("replay_note", None)
        entry: dict[str, Any] = {"QueueUrl": queue_url, "MessageBody": bodies.dumps(env)}
        attributes = {
            k: {"DataType": v.get("DataType", "String"), "StringValue": v["StringValue"]}
            for k, v in message.get("MessageAttributes", {}).items()
            if v.get("StringValue") is not None
        }
        if attributes:
            entry["MessageAttributes"] = attributes
        if self._fifo(subscription):
            system = message.get("Attributes", {})
            # (a dead letter written before each had a group of its own sits in the group it came from)
            entry["MessageGroupId"] = (came_from or system.get("MessageGroupId") or env.get("partition_key")
                                       or subscription)
            entry["MessageDeduplicationId"] = f"{env.get('message_id')}:replay:{uuid.uuid4().hex[:8]}"
        await self.sqs.send_message(**entry)
        await self.sqs.delete_message(QueueUrl=dlq_url, ReceiptHandle=message["ReceiptHandle"])
        replayed_id = f"{NAME}:{subscription}:{origin}"
        info = self._info(replayed_id, subscription, json.dumps(env), "Pending", 0,
                          {k: v["StringValue"] for k, v in attributes.items() if k != bodies.NO_ATTRIBUTES}, False)
        self.records.remember(info.model_copy(update={"visible_at": datetime.now(UTC)}))
        return ActionResult(result="Replayed", delivery_id=delivery_id, subscription=subscription, status="Pending")

    async def validate_bindings(self) -> BindingReport:
        """The capabilities' notes; ``workqueue validate-bindings --transport aws`` checks the resources."""
        issues = [BindingIssue(severity="Info", subject=NAME, message=note) for note in self.capabilities.notes]
        assert self.bindings is not None
        for name in sorted(self._topics):
            if name not in self.bindings.topics:
                issues.append(
                    BindingIssue(
                        severity="Error",
                        subject=f"topic {name}",
                        message=(
                            "not bound: apply the Terraform module, then run `workqueue import-bindings bindings.json`"
                        ),
                    )
                )
        return BindingReport(transport=NAME, ok=not any(i.severity == "Error" for i in issues), issues=issues)

    async def prune(self, older_than_seconds: float) -> int:
        return 0

    async def discard(self, subscription: str, delivery_id: str, reason: str | None = None) -> ActionResult:
        """Deletes a dead letter from the DLQ; an in-flight or waiting delivery answers Unsupported
        (no cancel on SQS, and SQS cannot address a waiting message)."""
        if delivery_id in self._leases:
            return ActionResult(
                result="Unsupported", delivery_id=delivery_id, subscription=subscription, reason=CANCEL_UNSUPPORTED
            )
        terminal = self._terminal_answer(subscription, delivery_id)
        if terminal is not None:
            return terminal
        parts = split_delivery_id(delivery_id)
        if parts is None or parts[0] != subscription or subscription not in self._bound():
            return ActionResult(result="NotFound", delivery_id=delivery_id, subscription=subscription)
        async with self._dead_letter_reads.lock(subscription):
            message = await self._find_dead_letter(subscription, parts[1], fresh=True)
            if message is None:
                return ActionResult(
                    result="Unsupported", delivery_id=delivery_id, subscription=subscription,
                    reason=WAITING_UNSUPPORTED,
                )
            await self._discard_dead_letter(subscription, message, reason)
        return ActionResult(result="Discarded", delivery_id=delivery_id, subscription=subscription, status="Discarded")

    async def _discard_dead_letter(self, subscription: str, message: dict[str, Any], reason: str | None) -> None:
        _, dlq_url = self._urls(subscription)
        await self.sqs.delete_message(QueueUrl=dlq_url, ReceiptHandle=message["ReceiptHandle"])
        info = self._dead_info(subscription, message, False)
        self.records.remember(info.model_copy(update={"status": "Discarded", "reason": reason,
                                                      "settled_at": datetime.now(UTC)}))

    async def discard_dead_letters(self, subscription: str, settled_before: datetime, limit: int = 1000) -> int:
        """Deletes the subscription's dead letters sent to the DLQ before ``settled_before``
        (reason ``pruned``), ``limit`` per round until none is left; returns how many."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if settled_before.tzinfo is None:
            raise ValueError(
                "settled_before must be an aware datetime, e.g. datetime.now(UTC) - timedelta(days=7); "
                f"got {settled_before!r} without a time zone"
            )
        if subscription not in self._subscriptions or subscription not in self._bound():
            return 0
        cutoff = settled_before.timestamp() * 1000
        gone = 0
        while True:
            async with self._dead_letter_reads.lock(subscription):
                old = [
                    m for m in await self._dead_letter_reads.read(subscription, 1000)
                    if int(m.get("Attributes", {}).get("SentTimestamp", "0")) < cutoff
                ][:limit]
                for message in old:
                    await self._discard_dead_letter(subscription, message, "pruned")
            gone += len(old)
            if len(old) < limit:
                return gone

    async def rewrite_payload(
        self, message_id: uuid.UUID, payload_json: str, content_hash: str, envelope_bytes: int
    ) -> bool:
        return False
