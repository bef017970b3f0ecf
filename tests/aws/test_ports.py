"""The ports of a queue with database and aws topics: resolved once, routed by topic, and the API
keys (the app's, not a topic's) found in the database behind the router."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import httpx
from fastapi import FastAPI

from fastapi_workqueue import Subscription, Topic
from fastapi_workqueue.aws.transport import AwsTransport
from fastapi_workqueue.core.keys import SCOPE_READ, create_key, verify_key
from fastapi_workqueue.core.routing import RoutingTransport

from ..conftest import unique
from .world import aws_queue


async def test_a_mixed_queue_routes_by_topic_and_keeps_its_keys_in_the_database(
    tmp_path: Path, moto_url: str,
) -> None:
    cloud, local = unique("cloud"), unique("local")
    topics = [Topic(name=cloud, transport="aws"), Topic(name=local)]
    subs = [Subscription(name=f"{cloud}.a", topic=cloud, handler_key="h"),
            Subscription(name=f"{local}.a", topic=local, handler_key="h")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        routing = queue.transport
        assert isinstance(routing, RoutingTransport)
        ports = queue.ports
        assert ports is queue.ports  # resolved once
        assert ports.router is routing
        assert isinstance(ports.for_topic(cloud), AwsTransport)
        assert ports.for_subscription(f"{local}.a") is routing.database
        assert ports.api_keys is not None and ports.api_keys is cast(object, routing.database)
        assert ports.interrupter is routing  # it passes the interrupt on to the aws part
        assert ports.processes is routing

        key = await create_key(ports.api_keys, "reader", [SCOPE_READ])
        app = FastAPI()
        app.include_router(queue.router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            answer = await client.get("/work-queue/stats",
                                      headers={"Authorization": f"Bearer {key.key}"})
            refused = await client.get("/work-queue/stats", headers={"Authorization": "Bearer wq_nope"})
            # What SQS cannot tell (a backlog per key) is 501 with the reason, as attempts and search are.
            partitions = await client.get(f"/work-queue/subscriptions/{cloud}.a/partitions",
                                          headers={"Authorization": f"Bearer {key.key}"})
        assert partitions.status_code == 501 and "not a backlog per partition key" in partitions.text
        assert answer.status_code == 200, answer.text
        assert {s["Subscription"] for s in answer.json()} >= {f"{cloud}.a", f"{local}.a"}
        assert refused.status_code == 401

        # create_key(queue.transport, ...), as documented: behind the router the database keeps the key.
        routed = await create_key(routing, "routed", [SCOPE_READ])
        assert await verify_key(ports.api_keys, routed.key) is not None
