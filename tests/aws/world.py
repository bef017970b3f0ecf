"""A queue with database and aws topics on a moto server, its resources provisioned from the
exported manifest and its bindings imported, as a deployment would."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi_workqueue import Subscription, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.aws.bindings import Bindings, store_bindings
from fastapi_workqueue.aws.manifest import build_manifest
from fastapi_workqueue.aws.transport import AwsTransport
from fastapi_workqueue.core.routing import RoutingTransport

from .moto import REGION
from .provision import provision


def aws_of(queue: WorkQueue) -> AwsTransport:
    transport = queue.transport
    assert isinstance(transport, RoutingTransport)
    aws = transport.others["aws"]
    assert isinstance(aws, AwsTransport)
    return aws


@asynccontextmanager
async def aws_queue(
    database_url: str, moto_url: str, topics: Sequence[Topic], subscriptions: Sequence[Subscription],
    *, bind: bool = True, **settings: Any,
) -> AsyncIterator[WorkQueue]:
    """An opened queue (no host) whose aws topics are provisioned on moto and bound."""
    values: dict[str, Any] = {
        "database_url": database_url, "auto_migrate": True, "aws_region": REGION, "aws_endpoint_url": moto_url,
        "aws_wait_time_seconds": 0, "aws_relay": False, "disable_host": True,
    }
    values.update(settings)
    queue = WorkQueue(WorkQueueSettings(**values), topics=topics, subscriptions=subscriptions)
    await queue.open()
    try:
        if bind:
            manifest = build_manifest(topics, subscriptions, queue.settings)
            await store_bindings(queue.kernel, Bindings.parse(provision(manifest, moto_url)))
            await aws_of(queue).reload_bindings()
        yield queue
    finally:
        await queue.close()
