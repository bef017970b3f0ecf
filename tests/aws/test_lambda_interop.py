"""The Lambda adapter and the AWS transport agree: what the queue publishes a Lambda handles, and
what a Lambda dead-letters the queue's operator views list and replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi_workqueue import FatalWorkError, PublishRequest, Subscription, Topic, WorkMessage
from fastapi_workqueue.aws.bindings import load_bindings
from fastapi_workqueue.aws.lambda_handler import SubscriptionPolicy, sqs_handler

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
        bound = (await load_bindings(queue)).subscriptions[sub]
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
