"""The AWS transport: SNS topics for publishing, one SQS queue (and its DLQ) per subscription.

The lease is the visibility timeout and the receipt handle the lease token. Auto heartbeats
change the visibility back to the lease (the runtime calls every min(lease / 3, 30 s)), at most
12 hours after the first receive; complete deletes (in batches of up to 10); a retry sets the
visibility to the backoff delay; a dead letter is sent to the DLQ (same MessageID, attributes, the
reason and last error in the body) and then deleted; a shutdown release sets the visibility to 0.
How messages are received, held and leased (the long poll, the lease counted from the receive,
give-backs that spend no attempt) is :mod:`.receiving`.

Exclusive needs a FIFO topic: the partition key is the MessageGroupId and the MessageID the
deduplication id; a retrying message keeps its key busy (SQS FIFO holds the group until its head
is deleted); later messages of a busy key that a receive hands over are held here until it
settles. Ordered, cancel of an in-flight message and exact per-key backlog are not available
(:attr:`AwsTransport.capabilities`); the operator views (:mod:`.operator_views`) read queue
attributes and the DLQ, and what this process settled (:mod:`.records`); the settle calls are
:mod:`.settling`, the leases and held messages :mod:`.leases`. A pause is the queue's
``workqueue:status`` tag, which every process reads on its bindings refresh.

A publish with a session writes the transactional outbox (:mod:`.outbox`), which a relay forwards
to SNS; one without a session goes straight to SNS (PublishBatch, 10 per call).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn

from ..core.envelope import PreparedMessage, PublishError, PublishResult, PublishStatus
from ..core.errors import ConfigurationError, TransportError, TransportNotReady, missing_extra
from ..core.redaction import redacting_logger
from ..core.reports import (
    SweepReport,
)
from ..core.tasks import TaskScope
from ..core.topology import Subscription, SubscriptionState, SubscriptionStatus, Topic
from ..core.transport import (
    Capabilities,
    WakeupListener,
)
from . import body as bodies
from .bindings import Bindings, load_bindings
from .client_calls import ClientCalls, sns_refusal
from .dead_letter_reads import DeadLetterReads
from .leases import MAX_LEASE_SECONDS, Held, Lease
from .naming import BATCH, NAME
from .operator_views import (
    BACKLOG_UNSUPPORTED,
    CANCEL_UNSUPPORTED,
    WAITING_UNSUPPORTED,
    OperatorViews,
    split_delivery_id,
)
from .receiving import Receive, Receiving
from .records import SettledRecords
from .settling import Settling

if TYPE_CHECKING:
    from ..core.kernel import Kernel

__all__ = [
    "BACKLOG_UNSUPPORTED",
    "BATCH",
    "CANCEL_UNSUPPORTED",
    "CAPABILITIES",
    "MAX_LEASE_SECONDS",
    "NAME",
    "STATUS_TAG",
    "WAITING_UNSUPPORTED",
    "AwsTransport",
    "TopicUnboundError",
    "create_transport",
    "sleep_backoff",
    "split_delivery_id",
]

log = redacting_logger("fastapi_workqueue.aws")

BINDINGS_REFRESH_SECONDS = 30.0
STATUS_TAG = "workqueue:status"
"""The SQS queue tag that holds a subscription's Active/Paused status for every process."""

CAPABILITIES = Capabilities(
    ordered=False,
    exclusive=True,
    transactional_publish=True,
    wakeups=False,
    runtime_roles=False,
    cancel=False,
    exact_backlog=False,
    retry_keeps_key_busy=True,
    exclusive_needs_fifo=True,
    message_state=False,
    terminal_counts=False,
    sweeps=False,
    priority=False,
    concurrency_limits=False,
    rate_limits=False,
    claims_wait=True,
    notes=(
        "Ordered needs a database topic",
        "job status, stored results, wait, groups and debounce need the database (jobs live there)",
        "priorities, concurrency limits and rate limits need a database topic",
        "cancel of an in-flight message is not available on SQS",
        "a retrying Exclusive message keeps its key busy (SQS FIFO message group)",
        "a pause is the queue's workqueue:status tag: other processes stop claiming on their next bindings "
        "refresh (within 30 s)",
        "publishes with a session go through the transactional outbox (at-least-once; FIFO deduplicates "
        "a resend within 5 minutes)",
    ),
)


def create_transport(kernel: Kernel) -> AwsTransport:
    """The entry point the core's routing transport calls for ``Topic(transport="aws")``."""
    return AwsTransport(kernel)


class TopicUnboundError(TransportError):
    """The aws topic has no imported bindings yet."""

class AwsTransport(Receiving, Settling, OperatorViews):
    """SNS + SQS; the topology comes from the queue, the ARNs and URLs from its bindings."""

    name = NAME
    capabilities = CAPABILITIES

    def __init__(self, kernel: Kernel, *, bindings: Bindings | None = None) -> None:
        self.kernel = kernel
        self.settings = kernel.settings
        self.bindings = bindings
        self._given_bindings = bindings is not None
        self.wait_seconds = self.settings.aws_wait_time_seconds
        self._topics: dict[str, Topic] = {}
        self._subscriptions: dict[str, Subscription] = {}
        self._status: dict[str, SubscriptionStatus] = {}
        self._leases: dict[str, Lease] = {}
        self._dead_letter_reads = DeadLetterReads(lambda: self.sqs, lambda name: self._urls(name)[1])
        self._held: dict[str, list[Held]] = {}
        self._released: dict[str, int] = {}
        self._receiving: dict[str, Receive] = {}
        self._polls: list[Receive] = []
        """The receives sent lately, until SQS has surely answered each (see open_poll_seconds)."""
        self._wakes: dict[str, asyncio.Event] = {}
        self._interrupted: set[str] = set()
        self._redrive_counts: dict[str, int] = {}
        self._aws_tasks = TaskScope("workqueue-aws")
        """Long polls, their wake-up waits and give-backs of this transport: ended at close."""
        self.records = SettledRecords()
        self._stack: contextlib.AsyncExitStack | None = None
        self._sns: Any = None
        self._sqs: Any = None
        self._closed = False
        self._calls = ClientCalls()
        self.relay: Any = None
        self.forwarder: Any = None
        self._random = random.Random()
        self._bindings_read = 0.0
        self._bindings_failed = False

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def sns(self) -> Any:
        """The SNS client while the transport is open (else a clear TransportError, never a new session)."""
        return self._sns if self._sns is not None else self._not_open()

    @property
    def sqs(self) -> Any:
        """The SQS client while the transport is open (else a clear TransportError, never a new session)."""
        return self._sqs if self._sqs is not None else self._not_open()

    def _not_open(self) -> NoReturn:
        if self._closed:
            raise TransportError(
                "the aws transport is closed (its SNS and SQS clients too): open the queue again before using it",
                retryable=False,
            )
        raise TransportError("the aws transport is not open: open the queue (WorkQueue.open) first", retryable=False)

    async def open(self) -> None:
        """Opens the SNS and SQS clients and reads the bindings; what it opened is closed again when
        a step fails. Opening an open transport does nothing."""
        if self._stack is not None:
            return
        try:
            import aioboto3
        except ImportError as exc:  # pragma: no cover - the aws extra is missing
            raise missing_extra("the aws transport", "aioboto3", "aws") from exc
        if not self.settings.aws_region:
            raise ConfigurationError(
                "aws topics need a region: set WORKQUEUE_AWS_REGION (WorkQueueSettings.aws_region)"
            )
        stack = contextlib.AsyncExitStack()
        session = aioboto3.Session()
        options = {"region_name": self.settings.aws_region, "endpoint_url": self.settings.aws_endpoint_url}
        calls = self._calls = ClientCalls()
        try:
            self._sns = calls.wrap(await stack.enter_async_context(session.client("sns", **options)))
            self._sqs = calls.wrap(await stack.enter_async_context(session.client("sqs", **options)))
            self._stack = stack
            self._closed = False
            for topic in self.kernel.topics.values():
                if topic.transport == NAME:
                    self._topics[topic.name] = topic
            for sub in self.kernel.subscriptions.values():
                if sub.topic in self._topics:
                    self._subscriptions[sub.name] = sub
            await self.reload_bindings()
        except BaseException:
            self._stack = self._sns = self._sqs = None
            await stack.aclose()
            raise

    def start_relay(self) -> None:
        """Starts the outbox relay once the schema is there (after the topology sync), when the
        queue has a database and ``aws_relay`` is on, and beside it the forwarder of what the
        database still holds of subscriptions whose topic moved to aws (:mod:`.moving`)."""
        if self.relay is None and self.settings.database_url and self.settings.aws_relay:
            from .moving import MovedForwarder
            from .outbox import OutboxRelay

            self.relay = OutboxRelay(self)
            self.relay.start()
            self.forwarder = MovedForwarder(self)
            self.forwarder.start()

    async def reload_bindings(self) -> Bindings:
        """Reads the stored bindings again (``import-bindings`` ran); the reconcile loop calls it
        through :meth:`list_subscriptions` every ``BINDINGS_REFRESH_SECONDS``."""
        self._bindings_read = time.monotonic()
        if not self._given_bindings:
            try:
                self.bindings = await load_bindings(self.kernel)
                self._bindings_failed = False
            except Exception as exc:  # the table is missing before the first migration
                log.debug("aws bindings could not be read (%s); aws topics answer TopicUnbound", exc)
                self.bindings = Bindings(region=self.settings.aws_region or "")
                self._bindings_failed = True
        assert self.bindings is not None
        # (side by side: while SQS cannot be reached each read waits out botocore's retries, and a
        # start that read them one after another waited that long for every subscription)
        await asyncio.gather(self.refresh_statuses(), self.read_redrive_counts())
        return self.bindings

    async def read_redrive_counts(self) -> None:
        """Reads each bound queue's redrive ``maxReceiveCount``: the receive that reaches it is the
        delivery's last attempt (:mod:`.receiving`). A queue whose policy cannot be read keeps the
        count last read."""
        assert self.bindings is not None
        bindings = self.bindings

        async def read(name: str) -> None:
            bound = bindings.subscriptions.get(name)
            if bound is None:
                self._redrive_counts.pop(name, None)
                return
            try:
                answer = await self.sqs.get_queue_attributes(QueueUrl=bound.queue_url,
                                                             AttributeNames=["RedrivePolicy"])
                policy = answer.get("Attributes", {}).get("RedrivePolicy")
                count = int(json.loads(policy)["maxReceiveCount"]) if policy else None
            except Exception as exc:
                log.warning("aws: the redrive policy of %s could not be read (%s)", name, exc)
                return
            if count is None:
                self._redrive_counts.pop(name, None)
            else:
                self._redrive_counts[name] = count

        await asyncio.gather(*(read(name) for name in list(self._subscriptions)))

    async def close(self) -> None:
        """Stops the long polls in flight and gives back what is held here (visibility 0, or what
        is left of a retry's delay; SQS counts that receive, so another process's next attempt
        number is one higher), stops the relay, waits for the client calls under way (a publish,
        say: the clients closed under it would send it again), then closes the SNS and SQS
        clients: a later call raises TransportError instead of opening new ones."""
        if self._stack is None:
            return
        try:
            await self.close_receives()
            if self.forwarder is not None:
                forwarder, self.forwarder = self.forwarder, None
                await forwarder.stop()
            if self.relay is not None:
                relay, self.relay = self.relay, None
                await relay.stop()
            await self._calls.drain()
        finally:
            stack, self._stack = self._stack, None
            self._sns = self._sqs = None
            self._closed = True
            self._calls = ClientCalls()  # (closed, not closing: a later call says so)
            await stack.aclose()

    async def migrate(self) -> list[str]:
        return []

    # -- topology --------------------------------------------------------------------------------

    async def sync_topology(self, topics: Sequence[Topic], subscriptions: Sequence[Subscription]) -> None:
        if self._bindings_failed:
            await self.reload_bindings()
        self.start_relay()
        for topic in topics:
            self._topics[topic.name] = topic
        for sub in subscriptions:
            self._subscriptions[sub.name] = sub

    def _state(self, sub: Subscription) -> SubscriptionState:
        topic = self._topics[sub.topic]
        data = sub.model_dump(by_alias=False)
        data["status"] = self.subscription_status(sub.name)
        return SubscriptionState(**data, id=f"{NAME}:{sub.name}", transport_name=NAME, is_fifo=topic.is_fifo)

    async def list_subscriptions(self) -> list[SubscriptionState]:
        if self._bindings_failed or time.monotonic() - self._bindings_read > BINDINGS_REFRESH_SECONDS:
            await self.reload_bindings()
        self.start_relay()
        return [
            self._state(s)
            for s in self._subscriptions.values()
            if s.host_type == "worker" and s.name not in self.settings.aws_lambda_subscriptions
        ]

    def subscription_status(self, subscription: str) -> SubscriptionStatus:
        """Active or Paused: the queue's ``workqueue:status`` tag as last read (every
        ``BINDINGS_REFRESH_SECONDS``, and at once after this process set it), else the declared status."""
        return self._status.get(subscription, self._sub(subscription).status)

    async def refresh_statuses(self) -> None:
        """Reads the ``workqueue:status`` tag of each bound subscription's queue: a pause made by
        any process (``workqueue pause``, the REST API, another host) reaches this one here."""
        assert self.bindings is not None
        bindings = self.bindings

        async def read(name: str) -> None:
            bound = bindings.subscriptions.get(name)
            if bound is None:
                return
            try:
                answer = await self.sqs.list_queue_tags(QueueUrl=bound.queue_url)
            except Exception as exc:  # a status read that fails keeps the last one (never stops the host)
                log.warning("aws: the status tag of %s could not be read (%s); keeping %s",
                            name, exc, self.subscription_status(name))
                return
            value = answer.get("Tags", {}).get(STATUS_TAG)
            if value in ("Active", "Paused"):
                self._status[name] = value
            else:
                self._status.pop(name, None)

        await asyncio.gather(*(read(name) for name in list(self._subscriptions)))

    async def list_topics(self) -> list[Topic]:
        return list(self._topics.values())

    async def set_subscription_status(self, subscription: str, status: SubscriptionStatus) -> bool | None:
        """Pauses or resumes for every process: tags the subscription's queue ``workqueue:status``
        (TagQueue); consumers read it on their bindings refresh. None for an unknown subscription."""
        if subscription not in self._subscriptions:
            return None
        queue_url, _ = self._urls(subscription)
        answer = await self.sqs.list_queue_tags(QueueUrl=queue_url)
        current = answer.get("Tags", {}).get(STATUS_TAG) or self._sub(subscription).status
        await self.sqs.tag_queue(QueueUrl=queue_url, Tags={STATUS_TAG: status})
        self._status[subscription] = status
        return bool(current != status)

    # -- bindings --------------------------------------------------------------------------------

    def _sub(self, subscription: str) -> Subscription:
        sub = self._subscriptions.get(subscription)
        if sub is None:
            raise ConfigurationError(f"subscription {subscription!r} is not a subscription of an aws topic")
        return sub

    def _urls(self, subscription: str) -> tuple[str, str]:
        assert self.bindings is not None
        bound = self.bindings.subscriptions.get(subscription)
        if bound is None:
            raise TransportNotReady(
                f"subscription {subscription!r} is not bound: apply the Terraform module, then run "
                "`workqueue import-bindings bindings.json`"
            )
        return bound.queue_url, bound.dlq_url

    def _fifo(self, subscription: str) -> bool:
        return self._topics[self._sub(subscription).topic].is_fifo

    # -- publish ---------------------------------------------------------------------------------

    def topic_arn(self, topic: str) -> str | None:
        assert self.bindings is not None
        bound = self.bindings.topics.get(topic)
        return None if bound is None else bound.arn

    def publish_entry(self, topic: str, message: PreparedMessage, index: int, body: str) -> dict[str, Any]:
        """One PublishBatch entry of ``message``, whose body (:func:`.body.encode`) is ``body``."""
        entry: dict[str, Any] = {"Id": str(index), "Message": body,
                                 "MessageAttributes": bodies.sns_attributes(message.attributes)}
        if self._topics[topic].is_fifo:
            entry["MessageGroupId"] = message.partition_key or str(message.message_id)
            entry["MessageDeduplicationId"] = bodies.deduplication_id(message)
        return entry

    def _refusal(self, topic: str, message: PreparedMessage, entry: dict[str, Any]) -> PublishError | None:
        cap = self._topics[topic].max_payload_bytes
        if cap is not None and message.envelope_bytes > cap:
            return PublishError(
                code="EnvelopeTooLarge",
                field="payload",
                message=f"the envelope is {message.envelope_bytes} bytes; topic {topic!r} accepts at most {cap} "
                "bytes (max_payload_bytes); send a PayloadRef to the data instead",
            )
        held_until = message.not_before
        if message.delay_seconds or (held_until is not None and held_until > datetime.now(UTC)):
            # (a NotBefore already past holds nothing back: due now, as on every transport)
            return PublishError(
                code="Unsupported",
                field="delay_seconds" if message.delay_seconds else "not_before",
                message=f"topic {topic!r} is on the aws transport, which cannot delay a publish "
                "(SNS has no per-message delay); publish without a delay",
            )
        if message.priority:
            return PublishError(
                code="Unsupported",
                field="priority",
                message=f"topic {topic!r} is on the aws transport, which has no priorities (SQS hands messages out "
                "in its own order); publish with priority 0, or keep the topic on 'database'",
            )
        if message.deduplication_key is not None and not self._topics[topic].is_fifo:
            return PublishError(
                code="Unsupported",
                field="deduplication_key",
                message=f"topic {topic!r} is a standard SNS topic: deduplication keys need is_fifo=True",
            )
        for name, value in message.attributes.items():
            if (problem := bodies.attribute_problem(name, value)) is not None:
                return PublishError(code="InvalidAttribute", field="attributes",
                                    message=f"topic {topic!r} is on the aws transport: {problem}")
        if message.partition_key is not None and self._topics[topic].is_fifo and (
                problem := bodies.group_id_problem(message.partition_key)) is not None:
            return PublishError(code="InvalidPartitionKey", field="partition_key",
                                message=f"topic {topic!r} is a FIFO topic on the aws transport: {problem}")
        size = bodies.entry_size(entry)
        if size > bodies.SNS_MAX_BYTES:
            return PublishError(
                code="EnvelopeTooLarge",
                field="payload",
                message=f"the message is {size} bytes as SNS counts it (the payload, the attributes and the "
                f"library's fields of its body); SNS takes at most {bodies.SNS_MAX_BYTES}: send a PayloadRef to "
                "the data instead",
            )
        return None

    async def publish(
        self, topic: str, messages: Sequence[PreparedMessage], *, session: Any = None
    ) -> list[PublishResult]:
        if topic not in self._topics:
            error = PublishError(
                code="UnknownTopic",
                message=f"topic {topic!r} is not an aws topic of this queue; declare it in the WorkQueue topics "
                'with transport="aws"',
            )
            rejected = PublishStatus.REJECTED
            return [PublishResult(status=rejected, message_id=None, error=error) for _ in messages]
        arn = self.topic_arn(topic)
        if arn is None:
            error = PublishError(
                code="TopicUnbound",
                message=(
                    f"topic {topic!r} has no bindings yet: apply the Terraform module, then run "
                    "`workqueue import-bindings bindings.json` (retry later)"
                ),
            )
            return [
                PublishResult(status=PublishStatus.TOPIC_UNBOUND, message_id=m.message_id, error=error)
                for m in messages
            ]
        encoded = [bodies.encode(topic, m) for m in messages]
        entries = [self.publish_entry(topic, m, i, encoded[i]) for i, m in enumerate(messages)]
        refusals = {i: e for i, m in enumerate(messages) if (e := self._refusal(topic, m, entries[i])) is not None}
        if refusals:
            from ..core.envelope import aborted_results

            return aborted_results(
                len(messages),
                {
                    i: PublishResult(status=PublishStatus.REJECTED, message_id=None, error=e)  # (as every store)
                    for i, e in refusals.items()
                },
            )
        if session is not None:
            from .outbox import write_outbox

            await write_outbox(session, topic, list(zip(messages, encoded, strict=True)))
            return [PublishResult(status=PublishStatus.ACCEPTED, message_id=m.message_id) for m in messages]
        async with self._calls.operation("publish"):  # (closing waits for every call of it, or refuses it whole)
            try:
                failed = await self.publish_batches(arn, entries)
            except TransportError:
                raise
            except Exception as exc:
                refused = sns_refusal(exc, topic)
                if refused is None:
                    raise
                raise refused from exc
        if failed:
            raise TransportError(
                f"SNS refused {len(failed)} of {len(entries)} messages of topic {topic!r} "
                f"({failed[0]}); publish them again (same MessageIDs)",
                retryable=True,
            )
        return [PublishResult(status=PublishStatus.ACCEPTED, message_id=m.message_id) for m in messages]

    async def publish_batches(self, arn: str, entries: Sequence[dict[str, Any]]) -> list[str]:
        """PublishBatch 10 at a time and at most SNS's 256 KiB a call; answers the failures
        (``"<Id>: <Code> <Message>"``)."""
        failed: list[str] = []
        for chunk in bodies.batches(entries, BATCH):
            answer = await self.sns.publish_batch(TopicArn=arn, PublishBatchRequestEntries=chunk)
            failed.extend(
                f"{f['Id']}: {f.get('Code', '')} {f.get('Message', '')}".strip() for f in answer.get("Failed", [])
            )
        return failed

    async def add_wakeup_listener(self, listener: WakeupListener) -> None:
        return None

    # -- what the database keeps -------------------------------------------------------------------

    def _needs_database(self, what: str) -> ConfigurationError:
        return ConfigurationError(f"{what} needs a database: set WORKQUEUE_DATABASE_URL beside the aws topics")

    async def once_begin(self, key: str, running_seconds: float) -> tuple[str, str | None]:
        raise self._needs_database("context.once")

    async def once_finish(self, key: str, token: str, ttl_seconds: float) -> bool:
        raise self._needs_database("context.once")

    async def once_abort(self, key: str, token: str) -> bool:
        raise self._needs_database("context.once")

    async def once_renew(self, key: str, token: str, running_seconds: float) -> bool:
        raise self._needs_database("context.once")

    async def release_deduplication_key(self, topic: str, key: str, message_id: uuid.UUID, *,
                                        session: Any = None) -> bool:
        return False

    async def step_get(self, message_id: uuid.UUID, name: str) -> tuple[bool, str | None]:
        raise self._needs_database("durable steps")

    async def step_put(self, message_id: uuid.UUID, name: str, value_json: str) -> None:
        raise self._needs_database("durable steps")

    async def sweep(self, limit: int = 1000) -> SweepReport:
        """SQS expires leases and retention itself; the outbox relay runs on its own."""
        return SweepReport(ran=False)


async def sleep_backoff(attempt: int, base: float = 0.2, ceiling: float = 30.0) -> None:
    """Waits out a throttled call (full jitter)."""
    await asyncio.sleep(random.uniform(0, min(ceiling, base * 2**attempt)))
