"""A closed aws transport opens nothing again: its calls raise a clear error, and no client session
is left unclosed (an unclosed aiohttp session would warn with a ResourceWarning)."""

from __future__ import annotations

import asyncio
import gc
import json
import warnings
from typing import Any

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, TransportError, WorkQueue, WorkQueueSettings
from fastapi_workqueue.aws.bindings import Bindings
from fastapi_workqueue.aws.manifest import build_manifest
from fastapi_workqueue.aws.transport import AwsTransport
from fastapi_workqueue.core.envelope import PublishStatus, prepare
from fastapi_workqueue.core.transport import HeartbeatRequest

from ..conftest import unique
from ..support import wait_for
from .moto import REGION
from .provision import clients, provision

pytestmark = pytest.mark.timeout(120)


def a_queue(moto_url: str) -> tuple[WorkQueue, str]:
    name = unique("t")
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=f"{name}.a", topic=name, handler_key="h")]
    queue = WorkQueue(WorkQueueSettings(database_url=None, aws_region=REGION, aws_endpoint_url=moto_url,
                                        aws_wait_time_seconds=0, aws_relay=False), topics=topics, subscriptions=subs)
    return queue, name


def unclosed_sessions(caught: list[warnings.WarningMessage]) -> list[str]:
    gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


async def test_calls_after_close_raise_and_leave_no_session_open(moto_url: str) -> None:
    queue, name = a_queue(moto_url)
    bindings = Bindings.parse(provision(build_manifest(list(queue.topics.values()),
                                                       list(queue.subscriptions.values()), queue.settings), moto_url))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aws = AwsTransport(queue.kernel, bindings=bindings)
        await aws.open()
        await aws.publish(name, [prepare(PublishRequest(payload=1))])
        delivery_id = f"aws:{name}.a:00000000-0000-0000-0000-000000000000"
        assert await aws.get_delivery(delivery_id) is None
        await aws.close()
        for call in (
            aws.get_delivery(delivery_id),
            aws.claim(f"{name}.a", 1),
            aws.stats(),
            aws.list_deliveries(f"{name}.a", "DeadLettered"),
            aws.publish(name, [prepare(PublishRequest(payload=2))]),
            aws.set_subscription_status(f"{name}.a", "Paused"),
        ):
            with pytest.raises(TransportError, match="the aws transport is closed"):
                await call
        # What needs no SQS call still answers; nothing was leased.
        assert [r.alive for r in await aws.heartbeat([HeartbeatRequest(delivery_id, "t")])] == [False]
        await aws.close()  # a second close does nothing
        del aws
        assert unclosed_sessions(caught) == []


async def test_close_waits_for_a_publish_in_flight_which_reaches_sqs_once(moto_url: str) -> None:
    """The queue closes (an app shuts down) while a publish is under way: close waits for it,
    every PublishBatch of it (12 messages go in two), and each message reaches the subscription's
    queue once (clients closed under a call made the HTTP library send it again, on a connection
    left open, which could also hang; a publish cut between its calls would be sent again whole). A
    publish that comes while close waits is refused with what to do, and no session is left open."""
    queue, name = a_queue(moto_url)
    document = provision(build_manifest(list(queue.topics.values()), list(queue.subscriptions.values()),
                                        queue.settings), moto_url)
    queue_url = document["subscriptions"][f"{name}.a"]["queue_url"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for round_ in range(3):
            aws = AwsTransport(queue.kernel, bindings=Bindings.parse(document))
            await aws.open()
            requests = [prepare(PublishRequest(payload=[round_, i])) for i in range(12)]
            publish = asyncio.create_task(aws.publish(name, requests))
            # (the first PublishBatch is sent, its answer not yet read)
            calls = aws._calls
            await wait_for(lambda: calls.running > 1, within=5, interval=0.0005)  # noqa: B023
            closing = asyncio.create_task(aws.close())
            await asyncio.sleep(0)
            with pytest.raises(TransportError, match=r"the aws transport is closing \(the queue shuts down\): "
                               r"publish was not sent; call again once the queue is open"):
                await aws.publish(name, [prepare(PublishRequest(payload="late"))])
            await asyncio.wait_for(closing, 30)
            results = await asyncio.wait_for(publish, 5)
            assert [r.status for r in results] == [PublishStatus.ACCEPTED] * 12
            del aws
        assert unclosed_sessions(caught) == []
    _, sqs = clients(moto_url)
    bodies: list[Any] = []
    while answer := (await asyncio.to_thread(sqs.receive_message, QueueUrl=queue_url, MaxNumberOfMessages=10,
                                             VisibilityTimeout=60, WaitTimeSeconds=0)).get("Messages"):
        bodies.extend(published(m["Body"])["payload"] for m in answer)
    assert sorted(bodies) == [[r, i] for r in range(3) for i in range(12)]


def published(body: str) -> Any:
    """The library's body of an SQS message (inside SNS's envelope unless delivered raw)."""
    found = json.loads(body)
    return json.loads(found["Message"]) if "Message" in found else found


async def test_a_transport_never_opened_says_so(moto_url: str) -> None:
    queue, _ = a_queue(moto_url)
    aws = AwsTransport(queue.kernel, bindings=Bindings(region=REGION))
    with pytest.raises(TransportError, match="not open"):
        _ = aws.sqs
    await aws.close()


async def test_a_failed_open_closes_its_clients(moto_url: str) -> None:
    queue, _ = a_queue(moto_url)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aws = BrokenBindings(queue.kernel, bindings=Bindings(region=REGION))
        with pytest.raises(RuntimeError, match="bindings"):
            await aws.open()
        with pytest.raises(TransportError, match="not open"):
            _ = aws.sqs
        del aws
        assert unclosed_sessions(caught) == []


class BrokenBindings(AwsTransport):
    """A transport whose bindings read fails after its clients opened."""

    async def reload_bindings(self) -> Bindings:
        await self.sqs.list_queues()  # the clients are open and used
        raise RuntimeError("the bindings cannot be read")
