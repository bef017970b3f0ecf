"""The Lambda adapter on synthetic SQS events built from real messages of a moto server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from pydantic import BaseModel

from fastapi_workqueue import ConfigurationError, FatalWorkError, Outcome, WorkContext, WorkMessage
from fastapi_workqueue.aws.lambda_handler import POLICY_ENV, SubscriptionPolicy, sqs_handler
from fastapi_workqueue.core.context import AbortReason

from .provision import clients


@pytest.fixture(scope="module")
def sqs(moto_url: str) -> Any:
    return clients(moto_url)[1]


def make_policy(sqs: Any, *, fifo: bool = False, max_attempts: int = 3, **extra: Any) -> SubscriptionPolicy:
    name = f"sub-{uuid.uuid4().hex[:8]}"
    suffix = ".fifo" if fifo else ""
    attrs = {"FifoQueue": "true", "ContentBasedDeduplication": "false"} if fifo else {}
    dlq = sqs.create_queue(QueueName=f"{name}-dlq{suffix}", Attributes=attrs)["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    queue = sqs.create_queue(QueueName=f"{name}{suffix}", Attributes={
        **attrs, "VisibilityTimeout": "60",
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": max_attempts}),
    })["QueueUrl"]
    return SubscriptionPolicy(name=name, topic="orders.created", handler_key="orders.handle", is_fifo=fifo,
                              partition_mode="Exclusive" if fifo else "None", max_attempts=max_attempts,
                              lease_seconds=60, queue_url=queue, dlq_url=dlq, **extra)


def send(sqs: Any, policy: SubscriptionPolicy, payload: Any, *, key: str | None = None,
         attributes: dict[str, str] | None = None) -> uuid.UUID:
    message_id = uuid.uuid4()
    body = {"message_id": str(message_id), "payload": payload, "correlation_id": "corr-1",
            "published_at": "2026-12-01T10:00:00+00:00"}
    kwargs: dict[str, Any] = {"QueueUrl": policy.queue_url, "MessageBody": json.dumps(body)}
    if attributes:
        kwargs["MessageAttributes"] = {k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()}
    if policy.is_fifo:
        kwargs["MessageGroupId"] = key or "k"
        kwargs["MessageDeduplicationId"] = str(message_id)
    sqs.send_message(**kwargs)
    return message_id


def receive(sqs: Any, url: str, n: int = 10) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = sqs.receive_message(
        QueueUrl=url, MaxNumberOfMessages=n, WaitTimeSeconds=0,
        AttributeNames=["All"], MessageAttributeNames=["All"],
    ).get("Messages", [])
    return got


def event_of(messages: list[dict[str, Any]], queue_arn: str = "arn:aws:sqs:us-east-1:123456789012:q") -> dict[str, Any]:
    """The event Lambda's SQS poller would send for ``messages`` (as ReceiveMessage answered them)."""
    return {"Records": [
        {
            "messageId": m["MessageId"],
            "receiptHandle": m["ReceiptHandle"],
            "body": m["Body"],
            "attributes": m.get("Attributes", {}),
            "messageAttributes": {
                k: {"stringValue": v.get("StringValue"), "stringListValues": [], "binaryListValues": [],
                    "dataType": v["DataType"]}
                for k, v in m.get("MessageAttributes", {}).items()
            },
            "md5OfBody": m["MD5OfBody"],
            "eventSource": "aws:sqs",
            "eventSourceARN": queue_arn,
            "awsRegion": "us-east-1",
        }
        for m in messages
    ]}


class FakeLambdaContext:
    """The Lambda context object's remaining-time call (a real function's is the runtime's)."""

    def __init__(self, remaining_ms: int) -> None:
        self.remaining_ms = remaining_ms

    def get_remaining_time_in_millis(self) -> int:
        return self.remaining_ms


class Order(BaseModel):
    order_id: int


def test_a_completed_message_is_not_listed_and_the_handler_sees_the_host_message(sqs: Any) -> None:
    policy = make_policy(sqs, fifo=True)
    seen: list[tuple[WorkMessage[Order], WorkContext]] = []

    async def handle(message: WorkMessage[Order], context: WorkContext) -> None:
        seen.append((message, context))

    mid = send(sqs, policy, {"order_id": 7}, key="customer-1", attributes={"region": "eu"})
    event = event_of(receive(sqs, policy.queue_url))
    answer = sqs_handler(handle, policy=policy, sqs_client=sqs)(event, FakeLambdaContext(60_000))
    assert answer == {"batchItemFailures": []}
    [(message, context)] = seen
    assert message.message_id == mid
    assert message.payload == Order(order_id=7)
    assert (message.topic, message.subscription, message.attempt) == ("orders.created", policy.name, 1)
    assert message.partition_key == "customer-1"
    assert message.attributes == {"region": "eu"}
    assert message.correlation_id == "corr-1"
    assert message.published_at is not None and message.published_at.year == 2026
    assert message.delivery_id == context.delivery_id == f"aws:{policy.name}:{event['Records'][0]['messageId']}"
    assert (context.attempt, context.max_attempts, context.subscription) == (1, 3, policy.name)


def test_a_retry_sets_the_visibility_to_the_backoff_delay_first(sqs: Any) -> None:
    policy = make_policy(sqs, backoff_base_seconds=0, backoff_max_seconds=0)

    async def handle(message: WorkMessage[Any]) -> Any:
        return Outcome.retry("not yet")

    send(sqs, policy, {"n": 1})
    event = event_of(receive(sqs, policy.queue_url))
    assert receive(sqs, policy.queue_url) == []  # leased for the queue's 60 s visibility timeout
    answer = sqs_handler(handle, policy=policy, sqs_client=sqs)(event)
    assert answer == {"batchItemFailures": [{"itemIdentifier": event["Records"][0]["messageId"]}]}
    # The backoff (0 s here) replaced the 60 s lease: the message is back at once, on its second receive.
    [again] = receive(sqs, policy.queue_url)
    assert again["MessageId"] == event["Records"][0]["messageId"]
    assert again["Attributes"]["ApproximateReceiveCount"] == "2"


def test_a_retry_with_a_delay_keeps_the_message_away(sqs: Any) -> None:
    policy = make_policy(sqs, backoff_base_seconds=100)
    draws: list[str] = []

    async def handle(message: WorkMessage[Any]) -> Any:
        raise RuntimeError("flaky")

    send(sqs, policy, {"n": 1})
    event = event_of(receive(sqs, policy.queue_url))
    # Visibility 0 first, so that only the handler's backoff can hide it again.
    sqs.change_message_visibility(QueueUrl=policy.queue_url, ReceiptHandle=event["Records"][0]["receiptHandle"],
                                  VisibilityTimeout=0)

    def rng() -> float:
        draws.append("drawn")
        return 1.0

    answer = sqs_handler(handle, policy=policy, sqs_client=sqs, rng=rng)(event)
    assert len(answer["batchItemFailures"]) == 1
    assert draws == ["drawn"]  # full jitter: rng() * min(300, 100 * 2**0) = 100 s
    assert receive(sqs, policy.queue_url) == []


def test_the_last_failed_attempt_is_dead_lettered_with_its_reason_and_error(sqs: Any) -> None:
    policy = make_policy(sqs, max_attempts=1)

    async def handle(message: WorkMessage[Any]) -> Any:
        raise RuntimeError("the printer is on fire")

    mid = send(sqs, policy, {"n": 1}, attributes={"region": "eu"})
    event = event_of(receive(sqs, policy.queue_url))
    answer = sqs_handler(handle, policy=policy, sqs_client=sqs)(event)
    assert answer == {"batchItemFailures": []}  # Lambda deletes it: the DLQ has it now
    [dead] = receive(sqs, policy.dlq_url)
    body = json.loads(dead["Body"])
    assert body["message_id"] == str(mid) and body["payload"] == {"n": 1}
    assert body["dead_letter"]["reason"] == "RuntimeError (attempt 1 of 1)"
    assert "the printer is on fire" in body["dead_letter"]["error"]
    assert dead["MessageAttributes"]["region"]["StringValue"] == "eu"


def test_fatal_errors_and_dead_letter_outcomes_dead_letter_at_once(sqs: Any) -> None:
    policy = make_policy(sqs, fifo=True, max_attempts=5)

    async def handle(message: WorkMessage[Any]) -> Any:
        if message.payload["n"] == 1:
            raise FatalWorkError("poison")
        return Outcome.dead_letter("unwanted")

    send(sqs, policy, {"n": 1}, key="a")
    send(sqs, policy, {"n": 2}, key="b")
    event = event_of(receive(sqs, policy.queue_url))
    assert len(event["Records"]) == 2
    assert sqs_handler(handle, policy=policy, sqs_client=sqs)(event) == {"batchItemFailures": []}
    dead = receive(sqs, policy.dlq_url)
    reasons = sorted(json.loads(d["Body"])["dead_letter"]["reason"] for d in dead)
    assert reasons == ["poison", "unwanted"]
    # Each dead letter is a group of its own in the dead-letter queue; the group it came from is kept.
    groups = [d["Attributes"]["MessageGroupId"] for d in dead]
    assert len(set(groups)) == 2 and all(g.startswith("dl-") for g in groups)
    assert sorted(json.loads(d["Body"])["dead_letter"]["group_id"] for d in dead) == ["a", "b"]


def test_a_payload_that_does_not_validate_is_dead_lettered(sqs: Any) -> None:
    policy = make_policy(sqs, max_attempts=5)
    calls: list[Any] = []

    async def handle(message: WorkMessage[Order]) -> None:
        calls.append(message)

    send(sqs, policy, {"order_id": "seven"})
    event = event_of(receive(sqs, policy.queue_url))
    assert sqs_handler(handle, policy=policy, sqs_client=sqs)(event) == {"batchItemFailures": []}
    assert calls == []
    [dead] = receive(sqs, policy.dlq_url)
    assert "does not validate against Order" in json.loads(dead["Body"])["dead_letter"]["reason"]


def test_on_fifo_a_failure_sends_back_the_rest_of_its_group_unrun(sqs: Any) -> None:
    policy = make_policy(sqs, fifo=True, max_attempts=5, backoff_base_seconds=0, backoff_max_seconds=0)
    ran: list[int] = []

    async def handle(message: WorkMessage[Any]) -> Any:
        ran.append(message.payload["n"])
        return Outcome.retry("later") if message.payload["n"] == 1 else None

    for n in (1, 2):
        send(sqs, policy, {"n": n}, key="same-key")
    send(sqs, policy, {"n": 3}, key="other-key")
    messages = receive(sqs, policy.queue_url)
    assert len(messages) == 3
    event = event_of(messages)
    answer = sqs_handler(handle, policy=policy, sqs_client=sqs)(event)
    ids = {json.loads(r["body"])["payload"]["n"]: r["messageId"] for r in event["Records"]}
    assert sorted(f["itemIdentifier"] for f in answer["batchItemFailures"]) == sorted([ids[1], ids[2]])
    assert sorted(ran) == [1, 3]


def test_on_fifo_a_failed_head_comes_back_after_its_delay_and_its_group_follows_in_order(sqs: Any) -> None:
    """docs/aws.md: before it lists a retry, the adapter sets the visibility to the backoff delay,
    "so the retry waits as it would on a host". The records behind a failed head stayed in flight
    for the queue's whole visibility timeout (60 s here), and SQS hands out nothing of a FIFO group
    while one of its messages is in flight: the head came back after a minute, not its 1 s."""
    policy = make_policy(sqs, fifo=True, max_attempts=5)
    ran: list[tuple[int, int]] = []

    async def handle(message: WorkMessage[Any]) -> Any:
        ran.append((message.payload["n"], message.attempt))
        return Outcome.retry("later", delay_seconds=1) if ran == [(0, 1)] else None

    for n in range(3):
        send(sqs, policy, {"n": n}, key="same-key")
    messages = receive(sqs, policy.queue_url)
    assert len(messages) == 3
    handler = sqs_handler(handle, policy=policy, sqs_client=sqs)
    answer = handler(event_of(messages))
    assert len(answer["batchItemFailures"]) == 3 and ran == [(0, 1)]
    again: list[dict[str, Any]] = []
    deadline = time.monotonic() + 15
    while not again and time.monotonic() < deadline:
        again = sqs.receive_message(QueueUrl=policy.queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                                    AttributeNames=["All"], MessageAttributeNames=["All"]).get("Messages", [])
    assert [json.loads(m["Body"])["payload"]["n"] for m in again] == [0, 1, 2], again
    assert handler(event_of(again)) == {"batchItemFailures": []}
    assert [n for n, _ in ran] == [0, 0, 1, 2] and ran[1] == (0, 2)


def test_the_signal_aborts_before_the_functions_deadline(sqs: Any) -> None:
    policy = make_policy(sqs)
    reasons: list[AbortReason | None] = []

    async def handle(message: WorkMessage[Any], context: WorkContext) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            reasons.append(context.signal.reason)

    send(sqs, policy, {"n": 1})
    event = event_of(receive(sqs, policy.queue_url))
    # 2.05 s left with a 2 s margin: the signal aborts 50 ms in.
    answer = sqs_handler(handle, policy=policy, sqs_client=sqs)(event, FakeLambdaContext(2050))
    assert reasons == [AbortReason.MAX_PROCESSING_SECONDS]
    assert [f["itemIdentifier"] for f in answer["batchItemFailures"]] == [event["Records"][0]["messageId"]]


def test_a_heartbeat_renews_the_visibility(sqs: Any) -> None:
    policy = make_policy(sqs)
    beats: list[bool] = []

    async def handle(message: WorkMessage[Any], context: WorkContext) -> None:
        beats.append(await context.heartbeat({"Percent": 50}))

    send(sqs, policy, {"n": 1})
    event = event_of(receive(sqs, policy.queue_url))
    assert sqs_handler(handle, policy=policy, sqs_client=sqs)(event) == {"batchItemFailures": []}
    assert beats == [True]


def test_the_policy_comes_from_the_environment(sqs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = make_policy(sqs)

    async def handle(message: WorkMessage[Any]) -> None:
        return None

    monkeypatch.setenv(POLICY_ENV, policy.model_dump_json())
    assert sqs_handler(handle, sqs_client=sqs).policy == policy

    monkeypatch.delenv(POLICY_ENV)
    with pytest.raises(ConfigurationError, match=f"^{POLICY_ENV} is not set: the Terraform module sets it"):
        sqs_handler(handle)
    monkeypatch.setenv(POLICY_ENV, "{not json")
    with pytest.raises(ConfigurationError, match=f"^{POLICY_ENV} is not JSON"):
        sqs_handler(handle)
    monkeypatch.setenv(POLICY_ENV, json.dumps({"name": "x", "topic": "t", "handler_key": "h", "queue_url": "u"}))
    with pytest.raises(ConfigurationError, match=f"^{POLICY_ENV} is not a subscription policy: dlq_url: Field"):
        sqs_handler(handle)


def test_the_terraform_policy_json_parses() -> None:
    """The JSON lambda.tf puts in WORKQUEUE_SUBSCRIPTION_POLICY, with the fields it writes."""
    text = json.dumps({
        "version": 1, "name": "documents.archive", "topic": "documents.created", "handler_key": "documents.archive",
        "partition_mode": "None", "is_fifo": False, "max_attempts": 5, "lease_seconds": 60,
        "backoff_base_seconds": 1, "backoff_max_seconds": 300, "max_processing_seconds": None,
        "queue_url": "https://sqs.us-east-1.amazonaws.com/1/documents-archive",
        "dlq_url": "https://sqs.us-east-1.amazonaws.com/1/documents-archive-dlq",
    })
    policy = SubscriptionPolicy.from_env({POLICY_ENV: text})
    assert (policy.name, policy.max_attempts, policy.lease_seconds) == ("documents.archive", 5, 60)


def test_handlers_with_dependencies_are_refused(sqs: Any) -> None:
    from fastapi import Depends

    def db() -> str:
        return "db"

    async def handle(message: WorkMessage[Any], conn: str = Depends(db)) -> None:
        return None

    with pytest.raises(ConfigurationError, match="parameter 'conn' is a dependency"):
        sqs_handler(handle, policy=make_policy(sqs), sqs_client=sqs)


def test_a_non_sqs_event_is_refused(sqs: Any) -> None:
    async def handle(message: WorkMessage[Any]) -> None:
        return None

    handler = sqs_handler(handle, policy=make_policy(sqs), sqs_client=sqs)
    with pytest.raises(ValueError, match="has no 'Records' list"):
        handler({"detail-type": "Scheduled Event"})
    with pytest.raises(ValueError, match="an SQS record lacks receiptHandle, body"):
        handler({"Records": [{"messageId": "m"}]})


def test_importing_the_adapter_pulls_in_no_web_framework_orm_or_driver() -> None:
    code = (
        "import sys\n"
        "import fastapi_workqueue.aws.lambda_handler\n"
        "from fastapi_workqueue import FatalWorkError, Outcome, TransientWorkError, WorkContext, WorkMessage\n"
        "from fastapi_workqueue import WorkOutcome\n"
        "banned = ('fastapi', 'starlette', 'sqlalchemy', 'asyncpg', 'aiosqlite', 'sqlite3', 'aioodbc', 'pyodbc',\n"
        "          'psycopg', 'psycopg2', 'boto3', 'botocore', 'aioboto3', 'aiobotocore', 'jinja2', 'httpx')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(banned)))\n"
        "print(sorted(m for m in sys.modules if m.startswith('fastapi_workqueue')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded_banned, ours = run.stdout.splitlines()
    assert loaded_banned == "[]", loaded_banned
    assert "fastapi_workqueue.queue" not in ours and "fastapi_workqueue.database" not in ours


def test_a_message_published_with_its_own_attempts_and_backoff_keeps_them(sqs: Any) -> None:
    policy = make_policy(sqs, max_attempts=5)

    async def handle(message: WorkMessage[Any], context: WorkContext) -> Any:
        assert context.max_attempts == 2
        return Outcome.retry("again")

    body = {"message_id": str(uuid.uuid4()), "payload": {}, "max_attempts": 2, "backoff_seconds": [0, 600]}
    sqs.send_message(QueueUrl=policy.queue_url, MessageBody=json.dumps(body))
    handler = sqs_handler(handle, policy=policy, sqs_client=sqs, rng=lambda: 1.0)
    first = event_of(receive(sqs, policy.queue_url))
    assert len(handler(first)["batchItemFailures"]) == 1
    # The schedule's first step (0 s) applied, not the subscription's backoff: back at once.
    second = event_of(receive(sqs, policy.queue_url))
    assert second["Records"][0]["attributes"]["ApproximateReceiveCount"] == "2"
    # Attempt 2 of the message's 2 is the last: dead-lettered although the subscription allows 5.
    assert handler(second) == {"batchItemFailures": []}
    [dead] = receive(sqs, policy.dlq_url)
    assert json.loads(dead["Body"])["dead_letter"]["reason"] == "again (attempt 2 of 2)"


def test_the_docs_list_what_only_real_aws_checks() -> None:
    from pathlib import Path

    from .harness import MOTO_CANNOT_EMULATE

    page = (Path(__file__).resolve().parents[2] / "docs" / "aws.md").read_text(encoding="utf-8")
    section = page[page.index("## Checked only against real AWS"):]
    for behaviour in MOTO_CANNOT_EMULATE:
        assert f"**{behaviour}**" in section, behaviour
