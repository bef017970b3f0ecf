"""An app as a user deploys it on AWS: the settings' defaults (a 20 s long poll, the outbox relay,
the host's timings), its aws topics provisioned on moto from the exported manifest and the
bindings imported, and its host started by the lifespan. Only the database, the region and the
endpoint are set."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import boto3

from fastapi_workqueue import Subscription, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.aws.bindings import Bindings, store_bindings
from fastapi_workqueue.aws.manifest import build_manifest

from .moto import CREDENTIALS, REGION
from .provision import provision
from .world import aws_of


def deployed_queue(
    database_url: str, moto_url: str, topics: Sequence[Topic], subscriptions: Sequence[Subscription], **settings: Any
) -> WorkQueue:
    """A queue with the settings' defaults but for the database, the region and the endpoint."""
    values: dict[str, Any] = {"database_url": database_url, "aws_region": REGION, "aws_endpoint_url": moto_url}
    values.update(settings)
    return WorkQueue(WorkQueueSettings(**values), topics=topics, subscriptions=subscriptions)


def provision_queue(queue: WorkQueue, moto_url: str) -> dict[str, Any]:
    """Creates the queue's aws resources from its manifest (as the Terraform module would); returns
    the bindings document (``binding_import``)."""
    manifest = build_manifest(list(queue.topics.values()), list(queue.subscriptions.values()), queue.settings)
    return provision(manifest, moto_url)


async def bind(queue: WorkQueue, document: dict[str, Any]) -> None:
    """``workqueue import-bindings``: stores the bindings where the queue reads them."""
    await store_bindings(queue.kernel, Bindings.parse(document))
    await aws_of(queue).reload_bindings()


@asynccontextmanager
async def running(queue: WorkQueue, document: dict[str, Any] | None = None) -> AsyncIterator[WorkQueue]:
    """The queue inside its lifespan (host started), bound to ``document`` first when given."""
    if document is not None:
        await queue.open()
        try:
            await bind(queue, document)
        finally:
            await queue.close()
    async with queue.lifespan():
        yield queue


def sqs_client(moto_url: str) -> Any:
    keys = {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "aws_session_token": CREDENTIALS["AWS_SESSION_TOKEN"],
    }
    return boto3.client("sqs", region_name=REGION, endpoint_url=moto_url, **keys)


def dead_letter_bodies(moto_url: str, dlq_url: str) -> list[dict[str, Any]]:
    """The bodies of the messages in a DLQ (received with a visibility of 0: they stay)."""
    sqs = sqs_client(moto_url)
    found: dict[str, dict[str, Any]] = {}
    for _ in range(5):
        answer = sqs.receive_message(QueueUrl=dlq_url, MaxNumberOfMessages=10, VisibilityTimeout=0,
                                     AttributeNames=["All"])
        for message in answer.get("Messages", []):
            body = json.loads(message["Body"])
            body["_receive_count"] = int(message["Attributes"]["ApproximateReceiveCount"])
            found[message["MessageId"]] = body
    return list(found.values())
