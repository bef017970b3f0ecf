"""One decoder of SQS bodies (aws/body.py) for the host transport and the Lambda adapter: a body
another producer sent is its payload, parsed when it is JSON and the text itself when it is not;
the handler's payload model decides whether that is acceptable."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from fastapi_workqueue import Subscription, Topic, WorkMessage
from fastapi_workqueue.aws import body as bodies
from fastapi_workqueue.aws.lambda_handler import sqs_handler
from fastapi_workqueue.aws.sqs_records import decode_record

from ..conftest import unique
from .provision import clients
from .test_lambda_handler import event_of, make_policy, receive
from .world import aws_of, aws_queue

FOREIGN = ["plain text, not JSON", '{"order": 7}', "[1, 2]", "{not json"]
"""Bodies other producers send straight to a subscription's queue."""


def expected_payload(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@pytest.mark.parametrize("text", FOREIGN)
def test_the_decoder_reads_a_foreign_body_as_its_payload(text: str) -> None:
    sqs_id = str(uuid.uuid4())
    env = bodies.decode(text, sqs_id)
    assert env == {"message_id": sqs_id, "payload": expected_payload(text)}
    assert bodies.message_uuid(env, sqs_id) == uuid.UUID(sqs_id)


def test_a_message_id_that_is_not_a_uuid_falls_back_to_the_sqs_message_id() -> None:
    sqs_id = str(uuid.uuid4())
    env = bodies.decode(json.dumps({"message_id": "order-7", "payload": 1}), sqs_id)
    assert bodies.message_uuid(env, sqs_id) == uuid.UUID(sqs_id)
    assert bodies.message_uuid(env, "short") == uuid.uuid5(uuid.NAMESPACE_URL, "short")


async def test_the_host_transport_delivers_a_foreign_body_as_its_payload(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    sub = f"{name}.s"
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, [Topic(name=name, transport="aws")],
                         [Subscription(name=sub, topic=name, handler_key="h")]) as queue:
        aws = aws_of(queue)
        queue_url, _ = aws._urls(sub)
        sent = {}
        for text in FOREIGN:
            answer = await aws.sqs.send_message(QueueUrl=queue_url, MessageBody=text)
            sent[answer["MessageId"]] = text
        got = [d for _ in range(5) for d in await queue.transport.claim(sub, 10)]
        assert len(got) == len(FOREIGN)
        for delivery in got:
            text = sent[str(delivery.message_id)]  # the SQS MessageId stands in for the MessageID
            assert json.loads(delivery.payload_json or "null") == expected_payload(text)


class Order(BaseModel):
    order: int


def test_the_lambda_adapter_delivers_a_foreign_body_as_its_payload(moto_url: str) -> None:
    sqs = clients(moto_url)[1]
    policy = make_policy(sqs, max_attempts=5)
    seen: list[Any] = []

    async def handle(message: WorkMessage[Any]) -> None:
        seen.append((message.message_id, message.payload))

    sent = {sqs.send_message(QueueUrl=policy.queue_url, MessageBody=t)["MessageId"]: t for t in FOREIGN}
    event = event_of(receive(sqs, policy.queue_url))
    assert sqs_handler(handle, policy=policy, sqs_client=sqs)(event) == {"batchItemFailures": []}
    assert sorted(seen, key=str) == sorted(((uuid.UUID(i), expected_payload(t)) for i, t in sent.items()), key=str)
    assert receive(sqs, policy.dlq_url) == []
    record = decode_record(event["Records"][0])
    assert record.envelope() == bodies.decode(record.body, record.message_id)


def test_on_lambda_a_text_body_a_model_refuses_is_dead_lettered_by_validation(moto_url: str) -> None:
    sqs = clients(moto_url)[1]
    policy = make_policy(sqs, max_attempts=5)

    async def handle(message: WorkMessage[Order]) -> None:
        raise AssertionError("not called")

    sqs.send_message(QueueUrl=policy.queue_url, MessageBody="plain text")
    event = event_of(receive(sqs, policy.queue_url))
    assert sqs_handler(handle, policy=policy, sqs_client=sqs)(event) == {"batchItemFailures": []}
    [dead] = receive(sqs, policy.dlq_url)
    body = json.loads(dead["Body"])
    assert body["payload"] == "plain text" and "does not validate against Order" in body["dead_letter"]["reason"]
