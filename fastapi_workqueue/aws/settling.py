"""How the aws transport settles what this process holds: complete and discard delete (in
batches of up to 10), a retry sets the visibility to the backoff delay, a dead letter is sent to
the DLQ (:func:`.body.dead_letter_body`) and then deleted, a release sets the visibility to 0 and
is not charged an attempt in this process. A token that is not the lease this process holds
changes nothing (``LeaseLost``). :class:`Settling` is a part of :class:`.transport.AwsTransport`."""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from ..core.reports import DeliveryInfo, DeliveryStatus
from ..core.transport import Settlement, SettleResult
from . import body as bodies
from .leases import MAX_LEASE_SECONDS, Lease, change_visibility
from .naming import BATCH
from .records import Receipt, SettledRecords

if TYPE_CHECKING:
    from ..core.topology import Subscription
    from .transport import AwsTransport


class Settling:
    """The settle calls of the aws transport."""

    if TYPE_CHECKING:  # kept by AwsTransport
        records: SettledRecords
        _leases: dict[str, Lease]
        _released: dict[str, int]
        _random: random.Random

        @property
        def sqs(self) -> Any: ...

        def _sub(self, subscription: str) -> Subscription: ...

        def _urls(self, subscription: str) -> tuple[str, str]: ...

        def _fifo(self, subscription: str) -> bool: ...

        def _lease(self, delivery_id: str, token: str) -> Lease | None: ...

        def _info(
            self, delivery_id: str, subscription: str, body: str, status: DeliveryStatus, attempt: int,
            attributes: dict[str, str], include_payload: bool, **extra: Any,
        ) -> DeliveryInfo: ...

    def _backoff(self, sub: Subscription, lease: Lease, settlement: Settlement) -> float:
        if settlement.delay_seconds is not None:
            return settlement.delay_seconds
        env = bodies.decode(lease.body, str(lease.message_id))
        steps = env.get("backoff_seconds")
        if isinstance(steps, list) and steps:
            return float(steps[min(lease.attempt, len(steps)) - 1])
        ceiling = min(sub.backoff_max_seconds, sub.backoff_base_seconds * 2 ** max(lease.attempt - 1, 0))
        return self._random.uniform(0, ceiling)

    async def settle(self, settlements: Sequence[Settlement]) -> list[SettleResult]:
        results: list[SettleResult] = []
        deletes: list[tuple[int, Lease]] = []
        settled: list[tuple[int, Settlement, Lease]] = []
        for settlement in settlements:
            lease = self._lease(settlement.delivery_id, settlement.lease_token)
            if lease is None:
                results.append("LeaseLost")
                continue
            settled.append((len(results), settlement, lease))
            results.append(await self._settle_one(settlement, lease, deletes, len(results)))
        lost = await self._delete(deletes)
        for index in lost:
            results[index] = "LeaseLost"
        for index, settlement, lease in settled:
            self._leases.pop(settlement.delivery_id, None)
            receipt = Receipt(lease.queue_url, lease.receipt)
            if results[index] == "Completed":
                self._remember(settlement.delivery_id, lease, "Completed", receipt, reason=settlement.reason)
            elif results[index] == "Discarded":
                self._remember(settlement.delivery_id, lease, "Discarded", receipt, reason=settlement.reason)
            if results[index] != "Pending":
                self._released.pop(settlement.delivery_id, None)
        return results

    def _remember(
        self, delivery_id: str, lease: Lease, status: DeliveryStatus, receipt: Receipt | None = None, **fields: Any
    ) -> None:
        """Records what this process made of a delivery it held (see :mod:`.records`)."""
        info = self._info(delivery_id, lease.subscription, lease.body, status, lease.attempt, lease.attributes, False)
        now = datetime.now(UTC)
        extra: dict[str, Any] = {"claimed_at": lease.claimed_at}
        if status in ("Completed", "Discarded"):
            extra["settled_at"] = now
        self.records.remember(info.model_copy(update={**extra, **fields}), receipt)

    async def _settle_one(
        self, settlement: Settlement, lease: Lease, deletes: list[tuple[int, Lease]], index: int
    ) -> SettleResult:
        sub = self._sub(lease.subscription)
        kind = settlement.kind
        if kind in ("Complete", "Discard"):
            deletes.append((index, lease))
            return "Completed" if kind == "Complete" else "Discarded"
        if kind == "Release":
            result = await self._visibility(lease, 0)
            if result == "Pending":
                self._released[settlement.delivery_id] = self._released.get(settlement.delivery_id, 0) + 1
                self._remember(settlement.delivery_id, lease, "Pending", Receipt(lease.queue_url, lease.receipt),
                               attempt=lease.attempt - 1, reason=settlement.reason, visible_at=datetime.now(UTC))
            return result
        env = bodies.decode(lease.body, str(lease.message_id))
        max_attempts = int(env.get("max_attempts") or sub.max_attempts)
        if kind == "DeadLetter" or lease.attempt >= max_attempts:
            if kind == "DeadLetter":
                reason = settlement.reason or "DeadLettered"
            else:
                cause = settlement.reason if settlement.reason is not None else settlement.error
                reason = "max attempts reached" if cause is None else f"max attempts reached: {cause}"
            await self.send_dead_letter(settlement.delivery_id, lease, reason, settlement.error)
            deletes.append((index, lease))
            return "DeadLettered"
        delay = max(0, min(MAX_LEASE_SECONDS, round(self._backoff(sub, lease, settlement))))
        result = await self._visibility(lease, delay)
        if result == "Pending":
            self._remember(settlement.delivery_id, lease, "Pending", Receipt(lease.queue_url, lease.receipt),
                           reason=settlement.reason, last_error=settlement.error,
                           visible_at=datetime.now(UTC) + timedelta(seconds=delay))
        return result

    async def _visibility(self, lease: Lease, seconds: int) -> SettleResult:
        if not await change_visibility(self.sqs, lease.queue_url, lease.receipt, seconds):
            return "LeaseLost"
        return "Pending"

    async def send_dead_letter(self, delivery_id: str, lease: Lease, reason: str, error: str | None) -> None:
        """Sends the leased message to its DLQ: same body (MessageID), ``origin_id`` and
        ``dead_letter`` (:func:`.body.dead_letter_body`, as the Lambda adapter writes it), same attributes."""
        _, dlq_url = self._urls(lease.subscription)
        body = bodies.dead_letter_body(
            bodies.decode(lease.body, str(lease.message_id)), origin_id=delivery_id.rsplit(":", 1)[-1],
            subscription=lease.subscription, reason=reason, error=error, attempts=lease.attempt,
        )
        entry: dict[str, Any] = {"QueueUrl": dlq_url, "MessageBody": body}
        if lease.message_attributes:
            entry["MessageAttributes"] = {
                k: {"DataType": v.get("DataType", "String"), "StringValue": v["StringValue"]}
                for k, v in lease.message_attributes.items()
                if v.get("StringValue") is not None
            }
        if self._fifo(lease.subscription):
            entry["MessageGroupId"] = lease.group_id or lease.partition_key or lease.subscription
            entry["MessageDeduplicationId"] = f"{lease.message_id}:dl:{uuid.uuid4().hex[:8]}"
        await self.sqs.send_message(**entry)

    async def _delete(self, deletes: list[tuple[int, Lease]]) -> list[int]:
        """DeleteMessageBatch per queue, 10 at a time; answers the indexes whose receipt was refused."""
        lost: list[int] = []
        by_queue: dict[str, list[tuple[int, Lease]]] = {}
        for index, lease in deletes:
            by_queue.setdefault(lease.queue_url, []).append((index, lease))
        for url, items in by_queue.items():
            for start in range(0, len(items), BATCH):
                chunk = items[start : start + BATCH]
                answer = await self.sqs.delete_message_batch(
                    QueueUrl=url,
                    Entries=[{"Id": str(i), "ReceiptHandle": lease.receipt} for i, (_, lease) in enumerate(chunk)],
                )
                lost.extend(chunk[int(f["Id"])][0] for f in answer.get("Failed", []))
        return lost

    async def settle_with_follow_ups(self, settlement: Settlement) -> SettleResult:
        """Publishes the follow-ups of a completion first, then deletes the message (at-least-once,
        :mod:`.follow_ups`): with a database in one committed transaction (aws topics through the
        outbox, database topics beside them), else straight to SNS. A follow-up without a MessageID
        of its own gets one derived from the delivery's MessageID and its position, so a redelivery
        publishes the same follow-ups again under the same ids. A lease this process no longer
        holds publishes nothing (``LeaseLost``); a delete SQS refuses after the publish answers
        ``LeaseLost`` with the follow-ups kept: the message comes back and its next attempt's
        follow-ups repeat theirs."""
        lease = self._lease(settlement.delivery_id, settlement.lease_token)
        if settlement.kind != "Complete" or not settlement.follow_ups or lease is None:
            [result] = await self.settle([settlement])
            return result
        from .follow_ups import publish_follow_ups, with_derived_ids

        follow_ups = with_derived_ids(lease.message_id, settlement.follow_ups)
        derived = {
            m.message_id
            for given, mine in zip(settlement.follow_ups, follow_ups, strict=True)
            for before, m in zip(given.messages, mine.messages, strict=True)
            if not before.message_id_given
        }
        await publish_follow_ups(cast("AwsTransport", self), settlement.delivery_id, follow_ups, derived)
        [result] = await self.settle([settlement])
        return result
