"""Follow-ups of a completion on an aws subscription: published first, then the message is deleted
(at-least-once); a redelivery publishes them again under the same derived MessageIDs."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, TransportError, WorkQueue, WorkQueueSettings
from fastapi_workqueue.aws.bindings import Bindings
from fastapi_workqueue.aws.follow_ups import follow_up_id
from fastapi_workqueue.aws.manifest import build_manifest
from fastapi_workqueue.aws.outbox import OutboxRelay
from fastapi_workqueue.aws.transport import AwsTransport
from fastapi_workqueue.core.envelope import PreparedMessage, prepare
from fastapi_workqueue.core.errors import ConfigurationError
from fastapi_workqueue.core.outcomes import FollowUp
from fastapi_workqueue.core.transport import ClaimedDelivery, Settlement

from ..conftest import unique
from .moto import REGION
from .provision import provision
from .world import aws_of, aws_queue

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


def handler_output(*payloads: str) -> list[PreparedMessage]:
    """What a handler returns each time it runs: the same payloads, MessageIDs drawn afresh."""
    return [prepare(PublishRequest(payload=p, partition_key="k")) for p in payloads]


async def drain(transport: Any, subscription: str) -> list[ClaimedDelivery]:
    """Every delivery now in the queue, completed as read."""
    found: list[ClaimedDelivery] = []
    for _ in range(20):
        batch = await transport.claim(subscription, 10)
        if not batch:
            break
        found.extend(batch)
        await transport.settle([Settlement(d.delivery_id, d.lease_token, "Complete") for d in batch])
    return found


def chain(name: str) -> tuple[list[Topic], list[Subscription]]:
    """A first aws topic, an aws FIFO topic and a database topic its completions follow up on."""
    topics = [Topic(name=name, transport="aws"), Topic(name=f"{name}-next", transport="aws", is_fifo=True),
              Topic(name=f"{name}-db")]
    subs = [Subscription(name=f"{name}.a", topic=name, handler_key="h", lease_seconds=30),
            Subscription(name=f"{name}.b", topic=f"{name}-next", handler_key="h", partition_mode="Exclusive"),
            Subscription(name=f"{name}.c", topic=f"{name}-db", handler_key="h")]
    return topics, subs


async def claim_first(queue: WorkQueue, name: str) -> ClaimedDelivery:
    await queue.publish(name, [PublishRequest(payload="step 1")])
    [delivery] = await drain_one(queue, f"{name}.a")
    return delivery


async def drain_one(queue: WorkQueue, subscription: str) -> list[ClaimedDelivery]:
    for _ in range(5):
        found = await queue.transport.claim(subscription, 10)
        if found:
            return found
    return []


def completion(delivery: ClaimedDelivery, name: str, token: str | None = None) -> Settlement:
    return Settlement(delivery.delivery_id, token or delivery.lease_token, "Complete", follow_ups=(
        FollowUp(f"{name}-next", handler_output("step 2", "step 3")),
        FollowUp(f"{name}-db", handler_output("audit")),
    ))


async def test_a_completion_publishes_its_follow_ups_then_deletes(database_url: str, moto_url: str) -> None:
    name = unique("f")
    topics, subs = chain(name)
    async with aws_queue(database_url, moto_url, topics, subs) as queue:
        delivery = await claim_first(queue, name)
        given = prepare(PublishRequest(message_id=uuid.uuid4(), payload="mine", partition_key="k"))
        settlement = completion(delivery, name)
        settlement = Settlement(delivery.delivery_id, delivery.lease_token, "Complete",
                                follow_ups=(*settlement.follow_ups, FollowUp(f"{name}-next", [given])))
        assert await queue.transport.settle_with_follow_ups(settlement) == "Completed"
        assert await drain(queue.transport, f"{name}.a") == []  # deleted
        assert (await OutboxRelay(aws_of(queue)).run_once()).sent == 3
        derived = [follow_up_id(delivery.message_id, 0, i) for i in range(2)]
        got = await drain(queue.transport, f"{name}.b")
        assert [d.message_id for d in got] == [*derived, given.message_id]  # a caller's MessageID is kept
        assert [d.payload_json for d in got] == ['"step 2"', '"step 3"', '"mine"']
        [audit] = await drain(queue.transport, f"{name}.c")
        assert audit.message_id == follow_up_id(delivery.message_id, 1, 0)


async def test_a_crash_before_the_delete_publishes_each_follow_up_once_per_message_id(
    database_url: str, moto_url: str,
) -> None:
    name = unique("f")
    topics, subs = chain(name)
    async with aws_queue(database_url, moto_url, topics, subs) as queue:
        aws = aws_of(queue)
        delivery = await claim_first(queue, name)
        # The delete fails after the follow-ups are committed: SQS refuses the receipt, as it would
        # a crashed process's that never sent the delete.
        aws._leases[delivery.delivery_id].receipt = "not-a-receipt"
        assert await queue.transport.settle_with_follow_ups(completion(delivery, name, "not-a-receipt")) == "LeaseLost"
        relay = OutboxRelay(aws)
        assert (await relay.run_once()).sent == 2
        # The message comes back (here at once); its next attempt returns the same follow-ups.
        await aws.sqs.change_message_visibility(QueueUrl=aws._urls(f"{name}.a")[0],
                                                ReceiptHandle=delivery.lease_token, VisibilityTimeout=0)
        [again] = await drain_one(queue, f"{name}.a")
        assert again.message_id == delivery.message_id and again.attempt == 2
        assert await queue.transport.settle_with_follow_ups(completion(again, name)) == "Completed"
        assert (await relay.run_once()).sent == 2  # sent again, same MessageIDs: FIFO deduplicates them
        derived = [follow_up_id(delivery.message_id, 0, i) for i in range(2)]
        got = Counter(d.message_id for d in await drain(queue.transport, f"{name}.b"))
        assert got == Counter(derived)
        [audit] = await drain(queue.transport, f"{name}.c")  # the database topic answered Duplicate
        assert audit.message_id == follow_up_id(delivery.message_id, 1, 0)
        assert await drain(queue.transport, f"{name}.a") == []


async def test_a_refused_follow_up_keeps_nothing_and_leaves_the_delivery_leased(
    database_url: str, moto_url: str,
) -> None:
    name = unique("f")
    topics, subs = chain(name)
    topics.append(Topic(name=f"{name}-unbound", transport="aws"))
    async with aws_queue(database_url, moto_url, topics, subs) as queue:
        delivery = await claim_first(queue, name)
        aws = aws_of(queue)
        assert aws.bindings is not None
        aws.bindings.topics.pop(f"{name}-unbound", None)
        settlement = completion(delivery, name)
        refused = Settlement(delivery.delivery_id, delivery.lease_token, "Complete", follow_ups=(
            *settlement.follow_ups, FollowUp(f"{name}-unbound", handler_output("lost"))))
        with pytest.raises(TransportError) as raised:
            await queue.transport.settle_with_follow_ups(refused)
        assert "TopicUnbound" in str(raised.value) and "not settled" in str(raised.value)
        assert raised.value.retryable
        assert (await OutboxRelay(aws).run_once()).sent == 0  # the outbox rows rolled back
        assert await drain(queue.transport, f"{name}.c") == []  # and the database topic's
        assert await queue.transport.settle_with_follow_ups(settlement) == "Completed"  # still leased


async def test_without_a_database_follow_ups_go_straight_to_sns(moto_url: str) -> None:
    name = unique("f")
    topics = [Topic(name=name, transport="aws"), Topic(name=f"{name}-next", transport="aws", is_fifo=True)]
    subs = [Subscription(name=f"{name}.a", topic=name, handler_key="h"),
            Subscription(name=f"{name}.b", topic=f"{name}-next", handler_key="h", partition_mode="Exclusive")]
    queue = WorkQueue(WorkQueueSettings(database_url=None, aws_region=REGION, aws_endpoint_url=moto_url,
                                        aws_wait_time_seconds=0, aws_relay=False),
                      topics=[*topics, Topic(name="a-database-topic")], subscriptions=subs)
    bindings = Bindings.parse(provision(build_manifest(topics, subs, queue.settings), moto_url))
    aws = AwsTransport(queue.kernel, bindings=bindings)
    await aws.open()
    try:
        await aws.publish(name, [prepare(PublishRequest(payload="step 1"))])
        [delivery] = [d for _ in range(5) for d in await aws.claim(f"{name}.a", 10)][:1]
        follow_up = FollowUp(f"{name}-next", handler_output("step 2"))
        settled = await aws.settle_with_follow_ups(
            Settlement(delivery.delivery_id, delivery.lease_token, "Complete", follow_ups=(follow_up,)))
        assert settled == "Completed"
        got = await drain(aws, f"{name}.b")
        assert [d.message_id for d in got] == [follow_up_id(delivery.message_id, 0, 0)]
        await aws.publish(name, [prepare(PublishRequest(payload="again"))])
        [other] = [d for _ in range(5) for d in await aws.claim(f"{name}.a", 10)][:1]
        to_database = Settlement(other.delivery_id, other.lease_token, "Complete",
                                 follow_ups=(FollowUp("a-database-topic", handler_output("x")),))
        with pytest.raises(ConfigurationError, match="needs a database"):
            await aws.settle_with_follow_ups(to_database)
        # A topic the queue does not declare at all is refused as a publish refuses it.
        to_nowhere = Settlement(other.delivery_id, other.lease_token, "Complete",
                                follow_ups=(FollowUp("no-such-topic", handler_output("x")),))
        with pytest.raises(TransportError, match="UnknownTopic") as unknown:
            await aws.settle_with_follow_ups(to_nowhere)
        assert "is not settled" in str(unknown.value) and not unknown.value.retryable
        assert await aws.settle([to_database]) == ["Completed"]  # the refused completions left it leased
    finally:
        await aws.close()


async def test_a_lease_this_process_does_not_hold_publishes_nothing(database_url: str, moto_url: str) -> None:
    name = unique("f")
    topics, subs = chain(name)
    async with aws_queue(database_url, moto_url, topics, subs) as queue:
        delivery = await claim_first(queue, name)
        assert await queue.transport.settle_with_follow_ups(completion(delivery, name, "forged")) == "LeaseLost"
        relay = OutboxRelay(aws_of(queue))
        assert (await relay.run_once()).sent == 0
        assert await drain(queue.transport, f"{name}.c") == []
        # The forged settlement changed nothing: the holder's completion publishes and deletes.
        assert await queue.transport.settle_with_follow_ups(completion(delivery, name)) == "Completed"
        assert (await relay.run_once()).sent == 2
        assert len(await drain(queue.transport, f"{name}.c")) == 1
        assert await drain(queue.transport, f"{name}.a") == []
