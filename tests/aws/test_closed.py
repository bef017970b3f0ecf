"""A closed aws transport opens nothing again: its calls raise a clear error, and no client session
is left unclosed (an unclosed aiohttp session would warn with a ResourceWarning)."""

from __future__ import annotations

import gc
import warnings

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, TransportError, WorkQueue, WorkQueueSettings
from fastapi_workqueue.aws.bindings import Bindings
from fastapi_workqueue.aws.manifest import build_manifest
from fastapi_workqueue.aws.transport import AwsTransport
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.transport import HeartbeatRequest

from ..conftest import unique
from .moto import REGION
from .provision import provision

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
