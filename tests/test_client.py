"""WorkQueueApiPublisher against a real HTTP server (uvicorn on a free port) on the test database."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from fastapi_workqueue import PublishRequest, PublishStatus, Subscription, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.client import PublishApiError, WorkQueueApiPublisher
from fastapi_workqueue.core.keys import SCOPE_PUBLISH, SCOPE_READ, create_key

from .conftest import unique
from .support import wait_for

pytestmark = pytest.mark.timeout(60)


class _Server(uvicorn.Server):
    """uvicorn in the test's event loop, leaving the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class Served:
    base_url: str
    queue: WorkQueue
    topic: str
    subscription: str
    publish_key: str
    read_key: str


@pytest.fixture(scope="module")
async def served(pg_url: str) -> AsyncIterator[Served]:
    topic, subscription = unique("client-t"), unique("client-s")
    queue = WorkQueue(
        WorkQueueSettings(database_url=pg_url, enabled=False),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=subscription, topic=topic, handler_key="client")],
    )
    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.router)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = _Server(uvicorn.Config(app, lifespan="on", log_config=None, access_log=False, ws="none", http="h11"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await wait_for(lambda: server.started or task.done(), within=5, interval=0.01)
        assert server.started, "uvicorn did not start"
        store: Any = queue.transport
        publish_key = (await create_key(store, "producer", [SCOPE_PUBLISH])).key
        read_key = (await create_key(store, "reader", [SCOPE_READ])).key
        yield Served(f"http://127.0.0.1:{port}", queue, topic, subscription, publish_key, read_key)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


class LoseFirstResponse(httpx.AsyncBaseTransport):
    """Forwards every request to the server, but drops the first answer after the server sent it."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[Any] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(await request.aread()))
        response = await self.inner.handle_async_request(request)
        if len(self.bodies) == 1:
            await response.aread()
            await response.aclose()
            raise httpx.ReadError("connection reset after the server answered", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class Unreachable(httpx.AsyncBaseTransport):
    def __init__(self) -> None:
        self.bodies: list[Any] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(await request.aread()))
        raise httpx.ConnectError("connection refused", request=request)


class Counting(httpx.AsyncBaseTransport):
    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def stored_ids(served: Served) -> set[uuid.UUID]:
    return {i.message_id for i in await served.queue.deliveries(served.subscription, "Pending", limit=1000)}


async def test_publish_through_the_api(served: Served) -> None:
    async with WorkQueueApiPublisher(served.base_url, served.publish_key) as publisher:
        results = await publisher.publish(
            served.topic, [{"Payload": {"n": 1}, "PartitionKey": "a"}, PublishRequest(payload={"n": 2})]
        )
    assert [r.status for r in results] == [PublishStatus.ACCEPTED] * 2
    assert {r.message_id for r in results} <= await stored_ids(served)


async def test_ids_are_assigned_before_the_first_attempt_and_a_retry_after_a_lost_response_is_duplicate(
    served: Served,
) -> None:
    own_id = uuid.uuid4()
    flaky = LoseFirstResponse()
    before = await stored_ids(served)
    async with httpx.AsyncClient(transport=flaky, base_url=served.base_url) as http:
        publisher = WorkQueueApiPublisher(served.base_url, served.publish_key, client=http, backoff_seconds=0.01)
        results = await publisher.publish(
            served.topic, [{"payload": "first"}, PublishRequest(message_id=own_id, payload="second")]
        )
    # The first attempt reached the server and published; its answer was lost.
    assert len(flaky.bodies) == 2
    first_ids = [item["MessageID"] for item in flaky.bodies[0]]
    assert all(first_ids) and first_ids[1] == str(own_id)
    assert [item["MessageID"] for item in flaky.bodies[1]] == first_ids
    assert [r.status for r in results] == [PublishStatus.DUPLICATE] * 2
    assert [str(r.message_id) for r in results] == first_ids
    published = await stored_ids(served) - before
    assert {str(m) for m in published} == set(first_ids)  # once each, not twice


async def test_refusals_raise_publish_api_error_with_the_results_and_are_not_retried(served: Served) -> None:
    counting = Counting()
    async with httpx.AsyncClient(transport=counting, base_url=served.base_url) as http:
        publisher = WorkQueueApiPublisher(served.base_url, served.publish_key, client=http, backoff_seconds=0.01)

        with pytest.raises(PublishApiError) as refused:
            await publisher.publish(served.topic, [{"Payload": 1}, {"Payload": 2, "Attributes": {"n": 5}}])
        assert refused.value.status_code == 422
        assert [r.status for r in refused.value.results] == [PublishStatus.REJECTED] * 2
        assert [r.error.code for r in refused.value.results if r.error] == ["BatchAborted", "InvalidAttribute"]
        assert refused.value.detail[0]["Index"] == 1 and refused.value.detail[0]["Field"] == "attributes"

        reused = uuid.uuid4()
        [accepted] = await publisher.publish(served.topic, [{"MessageID": reused, "Payload": "original"}])
        assert accepted.status == PublishStatus.ACCEPTED
        with pytest.raises(PublishApiError) as conflict:
            await publisher.publish(served.topic, [{"Payload": "new"}, {"MessageID": reused, "Payload": "changed"}])
        assert conflict.value.status_code == 409
        assert [r.status for r in conflict.value.results] == [PublishStatus.REJECTED, PublishStatus.MESSAGE_ID_CONFLICT]

        with pytest.raises(PublishApiError) as unknown:
            await publisher.publish(unique("no-topic"), [{"Payload": 1}])
        assert unknown.value.status_code == 404 and unknown.value.results == []

        wrong_scope = WorkQueueApiPublisher(served.base_url, served.read_key, client=http)
        with pytest.raises(PublishApiError) as forbidden:
            await wrong_scope.publish(served.topic, [{"Payload": 1}])
        assert forbidden.value.status_code == 403

        bad_key = WorkQueueApiPublisher(served.base_url, "wq_000000000000_not-a-key", client=http)
        with pytest.raises(PublishApiError) as unauthorized:
            await bad_key.publish(served.topic, [{"Payload": 1}])
        assert unauthorized.value.status_code == 401
    assert counting.requests == 6  # one request per call: refusals are final


async def test_an_unreachable_api_is_retried_with_the_same_ids_then_raises() -> None:
    unreachable = Unreachable()
    async with httpx.AsyncClient(transport=unreachable, base_url="http://nowhere.invalid") as http:
        publisher = WorkQueueApiPublisher("http://nowhere.invalid", "wq_x_y", client=http, retries=2,
                                          backoff_seconds=0.001)
        with pytest.raises(PublishApiError) as failed:
            await publisher.publish("any", [{"Payload": 1}, {"Payload": 2}])
    assert failed.value.status_code == 0 and "could not be reached" in str(failed.value)
    assert len(unreachable.bodies) == 3
    ids = [[item["MessageID"] for item in body] for body in unreachable.bodies]
    assert ids[0] == ids[1] == ids[2] and all(ids[0])
