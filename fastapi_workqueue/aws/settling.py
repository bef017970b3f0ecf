"""How the aws transport settles what this process holds: complete and discard delete (in
batches of up to 10), a retry sets the visibility to the backoff delay, a dead letter is sent to
the DLQ (:func:`.body.dead_letter_body`) and then deleted, a release sets the visibility to its
delay (0 at shutdown) and is not charged an attempt in this process. On an Exclusive subscription
whose key has later messages held here, a retry or release keeps the key's head here too, ahead
of them, until its delay has passed (:meth:`Settling._hold_head`): the key keeps its order. A
token that is not the lease this process holds changes nothing (``LeaseLost``). :class:`Settling`
is a part of :class:`.transport.AwsTransport`."""

from __future__ import annotations

import contextlib
import math
import random
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from ..core.lifecycle import BackoffPolicy, clamp_delay, settle_transition
from ..core.reports import DeliveryInfo, DeliveryStatus
from ..core.runtime import SHUTDOWN_RELEASE_REASON
from ..core.transport import FREES_KEYS, Settlement, SettleResult
from . import body as bodies
from .leases import MAX_LEASE_SECONDS, Held, Lease, change_visibility
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
        _held: dict[str, list[Held]]
        _released: dict[str, int]
        _random: random.Random

        @property
        def sqs(self) -> Any: ...

        def _sub(self, subscription: str) -> Subscription: ...

        def _urls(self, subscription: str) -> tuple[str, str]: ...

        def _fifo(self, subscription: str) -> bool: ...

        def _lease(self, delivery_id: str, token: str) -> Lease | None: ...

        def _lease_seconds(self, sub: Subscription) -> int: ...

        def open_poll_seconds(self, queue_url: str) -> int: ...

        def _wake(self, subscription: str) -> None: ...

        async def renew_held(self, subscription: str, group: str, seconds: int) -> None: ...

        async def _let_go(self, subscription: str, item: Held) -> None: ...

        def _info(
            self, delivery_id: str, subscription: str, body: str, status: DeliveryStatus, attempt: int,
            attributes: dict[str, str], include_payload: bool, **extra: Any,
        ) -> DeliveryInfo: ...

    def _backoff(self, sub: Subscription, lease: Lease) -> BackoffPolicy:
        """The lease's backoff: its message's own schedule, else its subscription's."""
        steps = bodies.decode(lease.body, str(lease.message_id)).get("backoff_seconds")
        return BackoffPolicy(sub.backoff_base_seconds, sub.backoff_max_seconds,
                             steps if isinstance(steps, list) and steps else None)

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
            if self._leases.get(settlement.delivery_id) is lease:
                # (only this settle's lease: a retry due at once may have been received again while
                # the batch settled, and the new attempt's lease is under the same delivery id)
                del self._leases[settlement.delivery_id]
            receipt = Receipt(lease.queue_url, lease.receipt)
            if results[index] == "Completed":
                self._remember(settlement.delivery_id, lease, "Completed", receipt, reason=settlement.reason)
            elif results[index] == "Discarded":
                self._remember(settlement.delivery_id, lease, "Discarded", receipt, reason=settlement.reason)
            if results[index] != "Pending":
                self._released.pop(settlement.delivery_id, None)
        for subscription in {lease.subscription for _, _, lease in settled}:
            if self._held.get(subscription):
                self._wake(subscription)  # a key may be free (or a head due later): a waiting claim looks again
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
            delay = max(0, min(MAX_LEASE_SECONDS, math.ceil(settlement.delay_seconds or 0)))
            if settlement.reason == SHUTDOWN_RELEASE_REASON:
                # Visible once this process's receives have surely ended: one that its stop
                # cancels runs on in SQS, and would take the message where nobody handles it (a
                # lease's stall, an attempt spent), not from the worker that should.
                delay = max(delay, self.open_poll_seconds(lease.queue_url))
            held_here = self._keeps_key(lease)
            result = await (self._hold_head(lease, delay, lease.attempt) if held_here else
                            self._visibility(lease, delay))
            if result == "Pending":
                if not held_here:
                    self._released[settlement.delivery_id] = self._released.get(settlement.delivery_id, 0) + 1
                self._remember(settlement.delivery_id, lease, "Pending", Receipt(lease.queue_url, lease.receipt),
                               attempt=lease.attempt - 1, reason=settlement.reason,
                               visible_at=datetime.now(UTC) + timedelta(seconds=delay))
            return result
        env = bodies.decode(lease.body, str(lease.message_id))
        max_attempts = lease.max_attempts or int(env.get("max_attempts") or sub.max_attempts)
        t = settle_transition(
            kind, attempt=lease.attempt, max_attempts=max_attempts, now=datetime.now(UTC),
            backoff=self._backoff(sub, lease), draw=self._random.random, delay=settlement.delay_seconds,
            reason=settlement.reason, error=settlement.error,
        )
        if t.status == "DeadLettered":
            reason = t.reason or "DeadLettered"
            await self.send_dead_letter(settlement.delivery_id, lease, reason, settlement.error)
            deletes.append((index, lease))
            return "DeadLettered"
        assert t.wait_seconds is not None
        delay = round(clamp_delay(t.wait_seconds, MAX_LEASE_SECONDS))
        if self._keeps_key(lease):
            result = await self._hold_head(lease, delay, lease.attempt + 1)
        else:
            result = await self._visibility(lease, delay)
        if result == "Pending":
            self._remember(settlement.delivery_id, lease, "Pending", Receipt(lease.queue_url, lease.receipt),
                           reason=settlement.reason, last_error=settlement.error,
                           visible_at=datetime.now(UTC) + timedelta(seconds=delay))
        return result

    def _keeps_key(self, lease: Lease) -> bool:
        """True when later messages of the lease's key are held here: its retry then waits here too
        (SQS would not hand it over again while they are in flight, and handing them over first
        would break the key's order)."""
        if lease.group_id is None or self._sub(lease.subscription).partition_mode != "Exclusive":
            return False
        return any(item.group_id == lease.group_id for item in self._held.get(lease.subscription, []))

    async def _hold_head(self, lease: Lease, delay: int, attempt: int) -> SettleResult:
        """Keeps a key's head here while it waits out ``delay``, ahead of the key's held messages:
        it and they stay invisible for the delay and a lease, then it is handed over again as
        ``attempt`` (SQS counts no receive for it). A delay that would pass SQS's 12 h cap gives
        the key back to SQS instead, the head with its delay."""
        sub = self._sub(lease.subscription)
        seconds = delay + self._lease_seconds(sub)
        group = lease.group_id
        assert group is not None
        if time.time() - lease.first_received + seconds > MAX_LEASE_SECONDS:
            for item in [i for i in self._held.get(sub.name, []) if i.group_id == group]:
                self._held[sub.name].remove(item)
                await self._let_go(sub.name, item)
            return await self._visibility(lease, delay)
        if not await change_visibility(self.sqs, lease.queue_url, lease.receipt, seconds):
            return "LeaseLost"
        await self.renew_held(sub.name, group, seconds)
        now = time.time()
        head = Held(lease.queue_url, lease.message, lease.first_received, group, now + seconds,
                    due=now + delay, attempt=attempt)
        held = self._held.setdefault(sub.name, [])
        first = next((i for i, item in enumerate(held) if item.group_id == group), len(held))
        held.insert(first, head)
        return "Pending"

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
            group_id=lease.group_id or lease.partition_key or lease.subscription if self._fifo(lease.subscription)
            else None,
        )
        entry: dict[str, Any] = {"QueueUrl": dlq_url, "MessageBody": body}
        if lease.message_attributes:
            entry["MessageAttributes"] = {
                k: {"DataType": v.get("DataType", "String"), "StringValue": v["StringValue"]}
                for k, v in lease.message_attributes.items()
                if v.get("StringValue") is not None
            }
        if self._fifo(lease.subscription):
            # A group of its own: a FIFO receive hands out at most 10 of one group and locks the group
            # while they are in flight, so a key's dead letters past ten could not be read.
            dead_id = uuid.uuid4().hex[:8]
            entry["MessageGroupId"] = f"dl-{dead_id}-{lease.message_id}"
            entry["MessageDeduplicationId"] = f"{lease.message_id}:dl:{dead_id}"
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

    async def settle_together(self, settlements: Sequence[Settlement]) -> list[SettleResult] | None:
        """None: SQS has no transaction across deliveries; each goes through :meth:`settle_with_follow_ups`."""
        return None

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
            return await self._freeing(settlement, result)
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
        return await self._freeing(settlement, result)

    async def _freeing(self, settlement: Settlement, result: SettleResult) -> SettleResult:
        """Frees the deduplication keys the settlement names once it ended the delivery's work
        (after the delete: a key freed before it could let a second job in while this one may run
        again)."""
        if result in FREES_KEYS:
            for topic, key, message_id in settlement.frees:
                with contextlib.suppress(Exception):  # at worst the key expires with its TTL
                    await cast("AwsTransport", self).release_deduplication_key(topic, key, message_id)
        return result
