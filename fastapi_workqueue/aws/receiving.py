"""How the aws transport receives: the long poll, the messages held here and the lease each
delivery starts with. :class:`Receiving` is a part of :class:`.transport.AwsTransport`.

- **One long poll per subscription**, run as a task of its own (:class:`Receive`) that outlives the
  claim that started it: a claim waits for it, for its key's head to become due, or for a settle
  that frees a key with held messages (``_wakes``), whichever comes first, and a later claim takes
  what the poll brought. Nothing a receive brings is lost to a claim that ends without it.
  :meth:`Receiving.interrupt_claims` ends a waiting claim at once (a consumer stops or pauses): the
  poll goes on, and what it brings is given back at :meth:`Receiving.close_receives`.
- **The long poll fits the lease**: it waits at most half the lease (``aws_wait_time_seconds``,
  20 s by default, is shortened to fit).
- **A lease counts from when the message was received**, not from when the receive was sent: a
  message handed over more than a moment after its claim started (the poll waited, or it was held)
  gets its visibility renewed to a full lease first, and the runtime counts the lease from that
  renewal (``ClaimedDelivery.lease_offset_seconds``).
- **Every received message is held here first** (:class:`.leases.Held`), in SQS's order, and
  handed over by :meth:`Receiving._hand_over`: at most what the claim asked for, and on an
  Exclusive subscription one delivery per key at a time, never one behind a key's earlier message
  that is still held or in flight (a retrying head stays held while later messages of its key are
  held, see :mod:`.settling`).
- **A give-back never spends an attempt in this process**: SQS counts every receive, so what this
  process gives back (``_let_go``, a release) is counted in ``_released`` and taken off the receive
  count of the next receive here. The redrive's ``maxReceiveCount`` leaves room for give-backs
  (:func:`.manifest.max_receive_count`), and the receive that reaches it is the delivery's last
  attempt: a failure then is the library's own dead letter, never SQS's redrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from ..core.redaction import redacting_logger
from ..core.tasks import TaskScope
from ..core.topology import Subscription, SubscriptionStatus
from ..core.transport import ClaimedDelivery, HeartbeatRequest, HeartbeatResult
from . import body as bodies
from .leases import MAX_LEASE_SECONDS, Held, Lease, change_visibilities, change_visibility
from .naming import BATCH, NAME

if TYPE_CHECKING:
    from .records import SettledRecords

log = redacting_logger("fastapi_workqueue.aws")

RENEW_AFTER_SECONDS = 1.0
"""A message handed over later than this after its claim started gets a full lease first."""
EXPIRED_LEASES_KEPT_SECONDS = 300.0
KeyState = Literal["busy", "lost", "free"]


@dataclass(eq=False)
class Receive:
    """A ReceiveMessage call in flight (or answered and not taken yet)."""

    queue_url: str
    sent: float
    """When it was sent (monotonic)."""
    sent_at: float
    """When it was sent (epoch seconds)."""
    ends: float = 0.0
    """By when SQS has answered it (monotonic): its wait, and a second's margin."""
    task: asyncio.Task[list[dict[str, Any]]] = field(init=False)


class Receiving:
    """The receive side of the aws transport: claims, heartbeats and what is held here."""

    if TYPE_CHECKING:  # kept by AwsTransport
        records: SettledRecords
        wait_seconds: int
        _subscriptions: dict[str, Subscription]
        _leases: dict[str, Lease]
        _held: dict[str, list[Held]]
        _released: dict[str, int]
        _receiving: dict[str, Receive]
        _polls: list[Receive]
        _wakes: dict[str, asyncio.Event]
        _interrupted: set[str]
        _redrive_counts: dict[str, int]
        _aws_tasks: TaskScope

        @property
        def sqs(self) -> Any: ...

        def _sub(self, subscription: str) -> Subscription: ...

        def _urls(self, subscription: str) -> tuple[str, str]: ...

        def subscription_status(self, subscription: str) -> SubscriptionStatus: ...

    # -- timings ---------------------------------------------------------------------------------

    def _lease_seconds(self, sub: Subscription) -> int:
        return min(MAX_LEASE_SECONDS, max(1, round(sub.lease_seconds)))

    def long_poll_seconds(self, sub: Subscription) -> int:
        """How long a receive of ``sub`` waits for a message: ``aws_wait_time_seconds``, at most
        half the lease (whole seconds, as SQS takes them)."""
        return max(0, min(self.wait_seconds, self._lease_seconds(sub) // 2))

    def _renew_after(self, sub: Subscription) -> float:
        return min(RENEW_AFTER_SECONDS, self._lease_seconds(sub) / 10)

    # -- waking a claim --------------------------------------------------------------------------

    def interrupt_claims(self, subscriptions: Sequence[str]) -> None:
        """Ends the waiting claims of these subscriptions with what they have (a consumer stops or
        pauses); their long polls go on, and what they bring is held here."""
        for name in subscriptions:
            self._interrupted.add(name)
            self._wake(name)

    def _wake(self, subscription: str) -> None:
        event = self._wakes.get(subscription)
        if event is not None:
            event.set()

    # -- claim -----------------------------------------------------------------------------------

    async def claim(self, subscription: str, limit: int) -> list[ClaimedDelivery]:
        """Up to ``limit`` deliveries: what is held here and may be handed over, else what the
        subscription's long poll brings (10 per ReceiveMessage). Paused and unknown subscriptions
        give nothing (a paused one gives back what it holds). On an Exclusive subscription one
        delivery per key is in flight: later messages of a busy key stay held, still invisible,
        until the key's delivery settles, then go out in order with a full lease."""
        sub = self._subscriptions.get(subscription)
        if sub is None or limit < 1:
            return []
        if self.subscription_status(subscription) != "Active":
            await self.give_back_held(subscription)
            return []
        queue_url, _ = self._urls(subscription)
        self._forget_expired()
        started = time.monotonic()
        wake = self._wakes.setdefault(subscription, asyncio.Event())
        claimed: list[ClaimedDelivery] = []
        while True:
            wake.clear()
            interrupted = subscription in self._interrupted
            self._interrupted.discard(subscription)
            brought = -1
            receive = self._receiving.get(subscription)
            if receive is not None and receive.task.done():
                del self._receiving[subscription]
                brought = self._keep(sub, receive)
                receive = None
            claimed += await self._hand_over(sub, limit - len(claimed), started)
            if len(claimed) < limit and brought == BATCH and not interrupted:
                more = self._receive(sub, queue_url, limit - len(claimed), wait=0)  # more may wait: ask at once
                await asyncio.wait({more.task})
                continue
            if claimed or interrupted or brought == 0:
                return claimed
            if receive is None:
                receive = self._receive(sub, queue_url, limit)
            waiter = self._aws_tasks.spawn(wake.wait(), name=f"workqueue-aws-wake:{sub.name}", watch=False)
            try:
                await asyncio.wait({receive.task, waiter}, timeout=self._next_due(subscription),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()

    def _receive(self, sub: Subscription, queue_url: str, limit: int, *, wait: int | None = None) -> Receive:
        """Starts the subscription's long poll (kept in ``_receiving`` until a claim takes it)."""
        receive = Receive(queue_url, time.monotonic(), time.time())
        lease = self._lease_seconds(sub)
        wait = self.long_poll_seconds(sub) if wait is None else wait
        receive.ends = receive.sent + wait + 1.0
        now = receive.sent
        self._polls = [r for r in self._polls if r.ends > now] + [receive]

        async def call() -> list[dict[str, Any]]:
            answer = await self.sqs.receive_message(
                QueueUrl=queue_url, MaxNumberOfMessages=min(limit, BATCH), WaitTimeSeconds=wait,
                VisibilityTimeout=lease, MessageSystemAttributeNames=["All"], MessageAttributeNames=["All"],
            )
            messages: list[dict[str, Any]] = answer.get("Messages", [])
            return messages

        receive.task = self._aws_tasks.spawn(call(), name=f"workqueue-aws-receive:{sub.name}", watch=False)
        receive.task.add_done_callback(functools.partial(self._received, sub.name))
        self._receiving[sub.name] = receive
        return receive

    def open_poll_seconds(self, queue_url: str, *, cancelled_only: bool = False) -> int:
        """Seconds until no receive this process sent to ``queue_url`` can still take a message:
        one in flight (unless ``cancelled_only``), or one cancelled here that SQS still runs (a
        cancelled ReceiveMessage is not cancelled on the server; what it takes there is lost to
        everyone until its lease runs out)."""
        now = time.monotonic()
        return max((math.ceil(r.ends - now) for r in self._polls
                    if r.queue_url == queue_url and r.ends > now
                    and (r.task.cancelled() or (not cancelled_only and not r.task.done()))),
                   default=0)

    def _received(self, subscription: str, task: asyncio.Task[list[dict[str, Any]]]) -> None:
        """A long poll answered while its subscription was paused: what it brought goes back."""
        if task.cancelled() or task.exception() is not None or not task.result():
            return
        with contextlib.suppress(Exception):
            if self.subscription_status(subscription) != "Active":
                self._aws_tasks.spawn(self.give_back_held(subscription), name=f"workqueue-aws-give-back:{subscription}")

    def _keep(self, sub: Subscription, receive: Receive) -> int:
        """Holds what an answered receive brought, in SQS's order (its error is raised here);
        answers how many messages it brought."""
        messages = receive.task.result()
        lease = self._lease_seconds(sub)
        held = self._held.setdefault(sub.name, [])
        for message in messages:
            group = message.get("Attributes", {}).get("MessageGroupId")
            held.append(Held(receive.queue_url, message, receive.sent_at, group, receive.sent_at + lease,
                             sent=receive.sent))
        if not held:
            del self._held[sub.name]
        return len(messages)

    def _next_due(self, subscription: str) -> float | None:
        """Seconds until the first held head that waits out its retry here is due, or None."""
        dues = [item.due for item in self._held.get(subscription, []) if item.due]
        return None if not dues else max(0.0, min(dues) - time.time())

    # -- handing over ----------------------------------------------------------------------------

    def _key_state(self, subscription: str, group: str) -> KeyState:
        """busy: a delivery of the key is leased here; lost: its lease ran out unsettled (SQS made
        it visible again); free otherwise."""
        now = datetime.now(UTC)
        state: KeyState = "free"
        for lease in self._leases.values():
            if lease.subscription == subscription and lease.group_id == group:
                if lease.lease_expires_at > now:
                    return "busy"
                state = "lost"
        return state

    async def _hand_over(self, sub: Subscription, limit: int, started: float) -> list[ClaimedDelivery]:
        """Hands held messages over, in order: at most ``limit``, on an Exclusive subscription one
        per key and none behind a key's earlier message still held or in flight. A message handed
        over late (a poll that waited, a held one) gets a full lease first; one whose visibility
        ran out (or whose key's lease did) goes back to SQS with the rest of its key.

        The held list is changed in place and only between awaits, so a settle that runs during
        one (a retry that holds its key's head here, :mod:`.settling`) sees every held message."""
        held = self._held.get(sub.name)
        if not held:
            return []
        exclusive = sub.partition_mode == "Exclusive"
        now = time.time()
        blocked: set[str] = set()
        dropped: set[str] = set()
        chosen: list[Held] = []
        gone: list[Held] = []
        for item in list(held):
            group = item.group_id if exclusive else None
            if (group is not None and group not in blocked and group not in dropped
                    and self._key_state(sub.name, group) == "lost"):
                self._forget_lost(sub.name, group)
                dropped.add(group)
            if group is not None and group in dropped:
                held.remove(item)
                gone.append(item)
                continue
            if len(chosen) >= limit or item.due > now or (group is not None and (
                    group in blocked or self._key_state(sub.name, group) == "busy")):
                if group is not None:
                    blocked.add(group)
                continue
            held.remove(item)
            chosen.append(item)
            if group is not None:
                blocked.add(group)
        lease = self._lease_seconds(sub)
        fresh = time.monotonic() - started <= self._renew_after(sub)
        renew = [item for item in chosen if not (fresh and item.sent >= started)]
        offsets: dict[int, float] = {id(item): 0.0 for item in chosen if item not in renew}
        if renew:
            margin = min(1.0, lease / 4)
            usable = [item for item in renew if time.time() < item.visible_at - margin]
            renewed_at = time.monotonic()
            taken = await self._renew([(item, lease) for item in usable]) if usable else []
            renewed = {id(item) for item, ok in zip(usable, taken, strict=True) if ok}
            for item in renew:
                if id(item) in renewed:
                    item.visible_at = time.time() + lease
                    offsets[id(item)] = renewed_at - started
                else:  # its visibility ran out: it goes back to SQS, with the rest of its key
                    gone.append(item)
                    if exclusive and item.group_id is not None:
                        rest = [i for i in self._held.get(sub.name, []) if i.group_id == item.group_id]
                        for other in rest:
                            self._held[sub.name].remove(other)
                        gone.extend(rest)
        if not self._held.get(sub.name):
            self._held.pop(sub.name, None)
        claimed = [self._claimed(sub, item, offsets[id(item)]) for item in chosen if id(item) in offsets]
        for item in gone:
            await self._let_go(sub.name, item)
        return claimed

    async def _renew(self, changes: Sequence[tuple[Held, int]]) -> list[bool]:
        """Sets the visibility of held messages (batched per queue); whether SQS took each."""
        taken = [False] * len(changes)
        by_queue: dict[str, list[int]] = {}
        for index, (item, _) in enumerate(changes):
            by_queue.setdefault(item.queue_url, []).append(index)
        for url, indexes in by_queue.items():
            answers = await change_visibilities(
                self.sqs, url, [(changes[i][0].message["ReceiptHandle"], changes[i][1]) for i in indexes])
            for i, ok in zip(indexes, answers, strict=True):
                taken[i] = ok
        return taken

    def _forget_lost(self, subscription: str, group: str) -> None:
        """Forgets the ran-out leases of a key once its held messages go back to SQS with it."""
        now = datetime.now(UTC)
        for delivery_id in [d for d, lease in self._leases.items() if lease.subscription == subscription
                            and lease.group_id == group and lease.lease_expires_at <= now]:
            del self._leases[delivery_id]

    def _forget_expired(self) -> None:
        """Drops leases that ran out long ago (SQS handed the message on; another process may hold it)."""
        horizon = datetime.now(UTC) - timedelta(seconds=EXPIRED_LEASES_KEPT_SECONDS)
        for delivery_id in [d for d, lease in self._leases.items() if lease.lease_expires_at < horizon]:
            del self._leases[delivery_id]

    def delivery_id_of(self, subscription: str, message: dict[str, Any]) -> str:
        """``aws:<subscription>:<origin>`` of a received message."""
        env = bodies.decode(message["Body"], message["MessageId"])
        return f"{NAME}:{subscription}:{bodies.origin_of(env, message['MessageId'])}"

    def _attempt(self, sub: Subscription, delivery_id: str, item: Held) -> tuple[int, bool]:
        """The attempt a held message's lease is, and whether it is the last receive SQS allows
        before its redrive (then the attempt is the last one)."""
        received = int(item.message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
        redrive = self._redrive_counts.get(sub.name)
        last_receive = redrive is not None and received >= redrive
        if item.attempt is not None:
            return item.attempt, last_receive
        return max(1, received - self._released.get(delivery_id, 0)), last_receive

    def _max_attempts(self, sub: Subscription, env: dict[str, Any]) -> int:
        return int(env.get("max_attempts") or sub.max_attempts)

    def _claimed(self, sub: Subscription, item: Held, offset: float) -> ClaimedDelivery:
        message = item.message
        sqs_id = message["MessageId"]
        system = message.get("Attributes", {})
        env = bodies.decode(message["Body"], sqs_id)
        origin = bodies.origin_of(env, sqs_id)
        delivery_id = f"{NAME}:{sub.name}:{origin}"
        attempt, last_receive = self._attempt(sub, delivery_id, item)
        max_attempts = self._max_attempts(sub, env)
        # A receive count above max_attempts comes from give-backs this process cannot know of
        # (another process's shutdown): the library dead-letters at max_attempts, so it is the last.
        attempt = min(attempt, max_attempts)
        if last_receive and attempt < max_attempts:
            log.warning("%s: delivery %s is at the redrive's maxReceiveCount (%s receives) on attempt %d: it is "
                        "the last attempt, so a failure is the library's dead letter, not SQS's redrive",
                        sub.name, delivery_id, system.get("ApproximateReceiveCount"), attempt)
            max_attempts = attempt
        attributes = {
            k: str(v.get("StringValue"))
            for k, v in message.get("MessageAttributes", {}).items()
            if v.get("StringValue") is not None and k != bodies.NO_ATTRIBUTES
        }
        message_id = bodies.message_uuid(env, origin)
        claimed_at = datetime.now(UTC)
        expires = claimed_at + timedelta(seconds=self._lease_seconds(sub))
        self.records.forget(delivery_id)
        lease = Lease(
            subscription=sub.name,
            queue_url=item.queue_url,
            receipt=message["ReceiptHandle"],
            first_received=item.received,
            attempt=attempt,
            message_id=message_id,
            partition_key=env.get("partition_key") or system.get("MessageGroupId"),
            attributes=attributes,
            body=message["Body"],
            message_attributes=message.get("MessageAttributes", {}),
            group_id=system.get("MessageGroupId"),
            lease_expires_at=expires,
            claimed_at=claimed_at,
            message=message,
            max_attempts=max_attempts,
        )
        self._leases[delivery_id] = lease
        published = env.get("published_at")
        headers = env.get("headers")
        return ClaimedDelivery(
            delivery_id=delivery_id,
            lease_token=message["ReceiptHandle"],
            attempt=attempt,
            max_attempts=max_attempts,
            lease_expires_at=expires,
            message_id=message_id,
            topic=str(env.get("topic") or sub.topic),
            partition_key=lease.partition_key,
            attributes=attributes,
            payload_json=json.dumps(env.get("payload")),
            payload_ref=env.get("payload_ref"),
            correlation_id=env.get("correlation_id"),
            published_at=datetime.fromisoformat(published) if isinstance(published, str) else None,
            headers=headers if isinstance(headers, dict) else None,
            lease_offset_seconds=offset,
        )

    async def claim_many(self, subscriptions: Sequence[str], limit: int) -> list[tuple[str, ClaimedDelivery]]:
        """Claims each None-mode subscription in turn until ``limit`` (SQS has no order across
        queues); paused and unknown ones give nothing, an Exclusive one is refused."""
        if isinstance(subscriptions, str):
            raise TypeError(
                f"claim_many takes a sequence of subscription names, got the string {subscriptions!r}; "
                "claim one subscription with claim"
            )
        names = list(dict.fromkeys(subscriptions))
        for name in names:
            sub = self._subscriptions.get(name)
            if sub is not None and sub.partition_mode != "None":
                raise ValueError(
                    f"claim_many takes None-mode subscriptions only ({name} is {sub.partition_mode}); "
                    "claim an Exclusive or Ordered subscription with claim"
                )
        found: list[tuple[str, ClaimedDelivery]] = []
        for name in names:
            if len(found) >= limit:
                break
            found.extend((name, d) for d in await self.claim(name, limit - len(found)))
        return found

    # -- heartbeats ------------------------------------------------------------------------------

    def _lease(self, delivery_id: str, token: str) -> Lease | None:
        """The live lease of ``token``: a token of an earlier receive, or of a lease that ran out
        (SQS made the message visible again), is refused here before SQS is asked."""
        lease = self._leases.get(delivery_id)
        if lease is None or lease.receipt != token or lease.lease_expires_at <= datetime.now(UTC):
            return None
        return lease

    async def heartbeat(self, requests: Sequence[HeartbeatRequest]) -> list[HeartbeatResult]:
        """Renews each live lease to a full lease (at most 12 h after its first receive), and the
        held messages of its key as long."""
        results: list[HeartbeatResult] = []
        now = time.time()
        for request in requests:
            lease = self._lease(request.delivery_id, request.lease_token)
            if lease is None:
                results.append(HeartbeatResult(delivery_id=request.delivery_id, alive=False, cancel_requested=False))
                continue
            sub = self._sub(lease.subscription)
            left = MAX_LEASE_SECONDS - (now - lease.first_received)
            seconds = min(self._lease_seconds(sub), int(left))
            if seconds <= 0 or not await change_visibility(self.sqs, lease.queue_url, lease.receipt, seconds):
                results.append(HeartbeatResult(delivery_id=request.delivery_id, alive=False, cancel_requested=False))
                continue
            lease.lease_expires_at = datetime.now(UTC) + timedelta(seconds=seconds)
            if lease.group_id is not None:
                await self.renew_held(lease.subscription, lease.group_id, seconds)
            if request.percent is not None:
                lease.progress_percent = request.percent
            if request.message is not None:
                lease.progress_message = request.message
            results.append(HeartbeatResult(delivery_id=request.delivery_id, alive=True, cancel_requested=False,
                                           lease_expires_at=lease.lease_expires_at))
        return results

    async def renew_held(self, subscription: str, group: str, seconds: int) -> None:
        """Keeps the held messages of a key invisible for ``seconds`` more (never less than they
        are): without it they would run out, go back to SQS and be charged one more receive."""
        now = time.time()
        items = [item for item in self._held.get(subscription, [])
                 if item.group_id == group and item.visible_at < now + seconds]
        if not items:
            return
        taken = await self._renew([(item, seconds) for item in items])
        held = self._held.get(subscription, [])
        for item, ok in zip(items, taken, strict=True):
            if ok:
                item.visible_at = now + seconds
            elif item in held:  # its receipt is gone: SQS hands it over again
                held.remove(item)

    # -- giving back -----------------------------------------------------------------------------

    async def _let_go(self, subscription: str, item: Held) -> None:
        """Makes a held message visible again (a head waiting out its retry: when it is due), not
        charging this process an attempt for the receive SQS counts. A head waiting out its retry
        comes back as the attempt it waits for: its failed attempts stay counted."""
        seconds = max(0, math.ceil(item.due - time.time())) if item.due else 0
        # (after a stop cancelled the receives: visible once they have surely ended in SQS)
        seconds = max(seconds, self.open_poll_seconds(item.queue_url, cancelled_only=True))
        with contextlib.suppress(Exception):
            await self.sqs.change_message_visibility(
                QueueUrl=item.queue_url, ReceiptHandle=item.message["ReceiptHandle"], VisibilityTimeout=seconds
            )
            delivery_id = self.delivery_id_of(subscription, item.message)
            if item.attempt is not None:  # its next receive (one more than SQS counted) is that attempt
                received = int(item.message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
                self._released[delivery_id] = received + 1 - item.attempt
            else:
                self._released[delivery_id] = self._released.get(delivery_id, 0) + 1

    async def give_back_held(self, subscription: str) -> None:
        """Gives back what this process holds of ``subscription`` and has not handed over (a pause,
        a shutdown): held messages, and what an answered long poll brought."""
        receive = self._receiving.get(subscription)
        if receive is not None and receive.task.done():
            del self._receiving[subscription]
            with contextlib.suppress(Exception):
                self._keep(self._sub(subscription), receive)
        for item in self._held.pop(subscription, []):
            await self._let_go(subscription, item)

    async def close_receives(self) -> None:
        """At close: stops the long polls in flight and gives back everything held here."""
        receiving, self._receiving = self._receiving, {}
        for receive in receiving.values():
            if not receive.task.done():
                receive.task.cancel()
        for name, receive in receiving.items():
            with contextlib.suppress(BaseException):
                await receive.task
            if name in self._subscriptions and not receive.task.cancelled() and receive.task.exception() is None:
                self._keep(self._subscriptions[name], receive)
        for name in list(self._held):
            await self.give_back_held(name)
        await self._aws_tasks.close(finish_within=5.0)
        self._aws_tasks.reopen()  # the transport may open again
