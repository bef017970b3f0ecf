"""The Lambda adapter and the AWS transport agree: what the queue publishes a Lambda handles, and
what a Lambda dead-letters the queue's operator views list and replay."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, cast

from fastapi_workqueue import FatalWorkError, PublishRequest, Subscription, Topic, WorkContext, WorkMessage
from fastapi_workqueue.aws.bindings import load_bindings
from fastapi_workqueue.aws.lambda_handler import SubscriptionPolicy, sqs_handler
from fastapi_workqueue.core.transport import Settlement

from ..conftest import unique
from .provision import clients
from .test_lambda_handler import event_of, receive
from .world import aws_queue


async def test_a_lambda_dead_letter_is_listed_and_replayed_by_the_queue(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    sub = f"{name}.s"
    topics = [Topic(name=name, transport="aws", is_fifo=True)]
    subs = [Subscription(name=sub, topic=name, handler_key="h", partition_mode="Exclusive", max_attempts=3)]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        [published] = await queue.publish(name, [PublishRequest(payload={"n": 7}, partition_key="k1",
                                                                attributes={"region": "eu"})])
        bound = (await load_bindings(queue.kernel)).subscriptions[sub]
        policy = SubscriptionPolicy(name=sub, topic=name, handler_key="h", partition_mode="Exclusive", is_fifo=True,
                                    max_attempts=3, lease_seconds=60, queue_url=bound.queue_url,
                                    dlq_url=bound.dlq_url)
        sqs = clients(moto_url)[1]
        seen: list[WorkMessage[Any]] = []

        async def poison(message: WorkMessage[Any]) -> None:
            seen.append(message)
            raise FatalWorkError("cannot be printed")

        event = event_of(receive(sqs, bound.queue_url))
        assert await sqs_handler(poison, policy=policy, sqs_client=sqs).process(event) == {"batchItemFailures": []}
        [message] = seen
        assert (message.message_id, message.payload, message.partition_key) == (published.message_id, {"n": 7}, "k1")
        assert message.attributes == {"region": "eu"}
        # Lambda deletes a record it was not told about: the adapter's dead letter is all that is left.
        sqs.delete_message(QueueUrl=bound.queue_url, ReceiptHandle=event["Records"][0]["receiptHandle"])

        [dead] = await queue.dead_letters(sub, include_payload=True)
        assert dead.message_id == published.message_id and dead.payload == {"n": 7}
        assert "cannot be printed" in (dead.last_error or "")
        assert (await queue.replay(sub, dead.delivery_id)).result == "Replayed"

        done: list[WorkMessage[Any]] = []

        async def fixed(message: WorkMessage[Any]) -> None:
            done.append(message)

        again = event_of(receive(sqs, bound.queue_url))
        assert await sqs_handler(fixed, policy=policy, sqs_client=sqs).process(again) == {"batchItemFailures": []}
        assert [m.message_id for m in done] == [published.message_id]


async def test_a_lambda_dead_letter_keeps_its_delivery_id_through_replay_and_discard(
    tmp_path: Path, moto_url: str,
) -> None:
    name = unique("t")
    sub = f"{name}.s"
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=sub, topic=name, handler_key="h", max_attempts=3)]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        published = await queue.publish(name, [PublishRequest(payload={"n": n}) for n in range(2)])
        bound = (await load_bindings(queue.kernel)).subscriptions[sub]
        policy = SubscriptionPolicy(name=sub, topic=name, handler_key="h", max_attempts=3,
                                    queue_url=bound.queue_url, dlq_url=bound.dlq_url)
        sqs = clients(moto_url)[1]

        handed: list[tuple[str, str]] = []

        async def poison(message: WorkMessage[Any], context: WorkContext) -> None:
            handed.append((message.delivery_id, context.delivery_id))
            raise FatalWorkError("cannot be printed")

        received = receive(sqs, bound.queue_url)
        assert len(received) == 2
        await sqs_handler(poison, policy=policy, sqs_client=sqs).process(event_of(received))
        for message in received:  # Lambda deletes what the answer did not list
            sqs.delete_message(QueueUrl=bound.queue_url, ReceiptHandle=message["ReceiptHandle"])
        first_ids = {f"aws:{sub}:{m['MessageId']}" for m in received}
        # The handler sees the id the operator's commands take (it saw the bare SQS MessageId,
        # which `workqueue delivery` does not know and a replay changes).
        assert {m for m, _ in handed} == {c for _, c in handed} == first_ids

        dead = await queue.dead_letters(sub)
        assert {d.delivery_id for d in dead} == first_ids  # the first MessageId, as the host writes it
        assert {d.message_id for d in dead} == {p.message_id for p in published}
        by_message = {d.message_id: d.delivery_id for d in dead}
        first, second = published[0].message_id, published[1].message_id
        assert first is not None and second is not None
        replayed, discarded = by_message[first], by_message[second]
        info = await queue.get_delivery(discarded)
        assert info is not None and info.status == "DeadLettered"
        assert (await queue.discard(sub, discarded, "not needed")).result == "Discarded"
        assert (await queue.replay(sub, replayed, "fixed")).result == "Replayed"
        assert await queue.dead_letters(sub) == []

        # The replayed copy is a new SQS message; the host sees the delivery id it had.
        claimed = [d for _ in range(5) for d in await queue.transport.claim(sub, 10)]
        assert [(d.delivery_id, d.message_id) for d in claimed] == [(replayed, published[0].message_id)]


async def test_every_view_of_a_foreign_message_shows_the_same_message_id(tmp_path: Path, moto_url: str) -> None:
    """A body another producer sent (a non-UUID ``message_id``, or text): the handler on a host, the
    Lambda adapter and ``get_delivery`` show one MessageID, through a dead letter and its replay."""
    name = unique("t")
    sub = f"{name}.s"
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=sub, topic=name, handler_key="h", max_attempts=3)]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        bound = (await load_bindings(queue.kernel)).subscriptions[sub]
        policy = SubscriptionPolicy(name=sub, topic=name, handler_key="h", max_attempts=3,
                                    queue_url=bound.queue_url, dlq_url=bound.dlq_url)
        sqs = clients(moto_url)[1]
        sqs.send_message(QueueUrl=bound.queue_url, MessageBody='{"message_id": "order-17", "payload": {"n": 1}}')
        sqs.send_message(QueueUrl=bound.queue_url, MessageBody="plain text")
        received = receive(sqs, bound.queue_url)
        expected = {m["Body"]: uuid.UUID(m["MessageId"]) for m in received}
        seen: dict[Any, uuid.UUID] = {}

        async def record(message: WorkMessage[Any]) -> None:
            seen[json.dumps(message.payload)] = message.message_id

        await sqs_handler(record, policy=policy, sqs_client=sqs).process(event_of(received))
        assert seen == {'{"n": 1}': expected[received_body(received, "order")],
                        '"plain text"': expected["plain text"]}
        for message in received:  # back to the queue, for a host to claim
            sqs.change_message_visibility(QueueUrl=bound.queue_url, ReceiptHandle=message["ReceiptHandle"],
                                          VisibilityTimeout=0)

        claimed = [d for _ in range(5) for d in await queue.transport.claim(sub, 10)]
        assert sorted(d.message_id for d in claimed) == sorted(expected.values())
        for delivery in claimed:
            info = await queue.get_delivery(delivery.delivery_id)
            assert info is not None and info.message_id == delivery.message_id
            settled = await queue.transport.settle(
                [Settlement(delivery.delivery_id, delivery.lease_token, "DeadLetter", reason="poison")])
            assert settled == ["DeadLettered"]
        dead = await queue.dead_letters(sub)
        assert sorted((d.delivery_id, d.message_id) for d in dead) == sorted(
            (d.delivery_id, d.message_id) for d in claimed)
        for delivery in claimed:
            assert (await queue.replay(sub, delivery.delivery_id)).result == "Replayed"
        again = [d for _ in range(5) for d in await queue.transport.claim(sub, 10)]
        assert sorted((d.delivery_id, d.message_id) for d in again) == sorted(
            (d.delivery_id, d.message_id) for d in claimed)
        for delivery in again:
            info = await queue.get_delivery(delivery.delivery_id)
            assert info is not None and info.message_id == delivery.message_id


def received_body(received: list[dict[str, Any]], contains: str) -> str:
    [body] = [m["Body"] for m in received if contains in m["Body"]]
    return cast(str, body)  # an SQS message's body is text
