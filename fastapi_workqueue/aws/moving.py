"""Moving a topic from the database to AWS: what the database still holds of its subscriptions.

A topic moves by its ``transport`` field alone. Its deliveries that were Pending in the database at
the move (and those an old process still held, once they come back Pending) would wait there
forever, as no host claims an aws subscription from the database. :class:`MovedForwarder`, started
beside the outbox relay, forwards each to its subscription's SQS queue (the library's body; on a
FIFO queue its key as the message group and its MessageID as the deduplication id), then
discards it in the database with a reason naming the queue: the subscription's new consumer, a
host or a Lambda, runs it; its attempts start again from 1. A dead letter stays in the database,
where ``workqueue dead-letters``, ``replay`` and ``discard`` (with ``--app``) reach it; ``stats``
names what is left (:func:`fastapi_workqueue.core.routing.moved_reason`).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ..core.redaction import redacting_logger
from ..core.tasks import TaskScope
from ..core.transport import ClaimedDelivery, Settlement
from . import body as bodies
from .naming import BATCH

if TYPE_CHECKING:
    from ..core.transport import Transport
    from .transport import AwsTransport

log = redacting_logger("fastapi_workqueue.aws")

FORWARD_INTERVAL_SECONDS = 30.0
"""How often a process looks again for deliveries the database still holds of moved subscriptions."""


def sqs_entry(topic: str, delivery: ClaimedDelivery, index: int, *, fifo: bool) -> dict[str, Any]:
    """A SendMessageBatch entry carrying a database delivery as SNS would have delivered it."""
    body: dict[str, Any] = {
        "message_id": str(delivery.message_id),
        "topic": topic,
        "partition_key": delivery.partition_key,
        "correlation_id": delivery.correlation_id,
        "published_at": (delivery.published_at or datetime.now(UTC)).isoformat(),
        "payload": None if delivery.payload_json is None else json.loads(delivery.payload_json),
    }
    if delivery.payload_ref is not None:
        body["payload_ref"] = delivery.payload_ref
    if delivery.headers:
        body["headers"] = delivery.headers
    entry: dict[str, Any] = {"Id": str(index), "MessageBody": json.dumps(body, separators=(",", ":"))}
    if delivery.attributes:
        entry["MessageAttributes"] = bodies.sns_attributes(delivery.attributes)
    if fifo:
        entry["MessageGroupId"] = delivery.partition_key or str(delivery.message_id)
        entry["MessageDeduplicationId"] = str(delivery.message_id)
    return entry


class MovedForwarder:
    """Forwards the database's Pending deliveries of aws subscriptions to their SQS queues."""

    def __init__(self, transport: AwsTransport, *, interval_seconds: float = FORWARD_INTERVAL_SECONDS) -> None:
        self.transport = transport
        self.interval = interval_seconds
        self._tasks = TaskScope("workqueue-aws-moved-forwarder")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._tasks.reopen()
            self._task = self._tasks.spawn(self._run(), name="workqueue-aws-moved-forwarder")

    async def stop(self) -> None:
        self._task = None
        await self._tasks.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("aws: forwarding what the database holds of moved subscriptions failed (%s); "
                            "trying again in %.0f s", exc, self.interval)
            await asyncio.sleep(self.interval)

    def _database(self) -> Transport | None:
        from ..core.routing import RoutingTransport

        router = self.transport.kernel.transport
        return router.default if isinstance(router, RoutingTransport) else None

    async def run_once(self) -> int:
        """One pass over the bound aws subscriptions the database holds Pending deliveries of;
        answers how many it forwarded."""
        database = self._database()
        bindings = self.transport.bindings
        if database is None or bindings is None:
            return 0
        held = {row.subscription: row for row in await database.stats(None)}
        forwarded = 0
        for name, sub in list(self.transport._subscriptions.items()):
            row, bound = held.get(name), bindings.subscriptions.get(name)
            if row is None or bound is None or not row.pending:
                continue
            count = await self._forward(database, name, sub.topic, bound.queue_url)
            if count:
                log.info("aws: forwarded %d deliveries of %s that the database held from before topic %r moved "
                         "to aws to its SQS queue", count, name, sub.topic)
            forwarded += count
        return forwarded

    async def _forward(self, database: Transport, subscription: str, topic: str, queue_url: str) -> int:
        fifo = self.transport._fifo(subscription)
        reason = f"forwarded to the aws transport's queue {queue_url} (topic {topic!r} moved to aws)"
        count = 0
        while batch := await database.claim(subscription, BATCH):
            answer = await self.transport.sqs.send_message_batch(
                QueueUrl=queue_url, Entries=[sqs_entry(topic, d, i, fifo=fifo) for i, d in enumerate(batch)])
            failed = {int(f["Id"]) for f in answer.get("Failed", [])}
            sent = [d for i, d in enumerate(batch) if i not in failed]
            back = [d for i, d in enumerate(batch) if i in failed]
            settlements = [Settlement(d.delivery_id, d.lease_token, "Discard", reason=reason) for d in sent]
            settlements += [Settlement(d.delivery_id, d.lease_token, "Release", reason="SQS refused it; forwarded "
                                       "on a later pass") for d in back]
            await database.settle(settlements)
            count += len(sent)
            if back:
                break
        return count
