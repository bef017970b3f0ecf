"""An app whose orders topic runs on AWS while its audit topic stays on the database.

Settings come from the environment (WORKQUEUE_AWS_REGION, WORKQUEUE_DATABASE_URL, ...), as a
deployed app's do. ``ordered_queue`` has an Ordered subscription on an aws topic, which AWS refuses;
``same_queue`` and ``queue_is_a_dlq`` have names that map to one SQS queue.
"""

from __future__ import annotations

from typing import Any

from fastapi_workqueue import Subscription, Topic, WorkMessage, WorkQueue, WorkQueueSettings

queue = WorkQueue(
    WorkQueueSettings(),
    topics=[
        Topic(name="orders.created", transport="aws", is_fifo=True),
        Topic(name="audit.events"),
    ],
    subscriptions=[
        Subscription(name="orders.email", topic="orders.created", handler_key="orders.email",
                     partition_mode="Exclusive", max_attempts=4, lease_seconds=45,
                     filter={"field": "region", "operator": "eq", "value": "eu"}),
        Subscription(name="orders.archive", topic="orders.created", handler_key="orders.archive"),
        Subscription(name="audit.store", topic="audit.events", handler_key="audit.store"),
    ],
)

ordered_queue = WorkQueue(
    WorkQueueSettings(),
    topics=[Topic(name="ledger.entries", transport="aws", is_fifo=True)],
    subscriptions=[Subscription(name="ledger.post", topic="ledger.entries", handler_key="ledger.post",
                                partition_mode="Ordered")],
)


@queue.handler("orders.email")
@queue.handler("orders.archive")
@queue.handler("audit.store")
async def record(message: WorkMessage[dict[str, Any]]) -> None:
    """Takes every message (the worker tests need a handler to run the subscriptions)."""


def _named(*names: str) -> WorkQueue:
    return WorkQueue(
        WorkQueueSettings(),
        topics=[Topic(name="orders.created", transport="aws")],
        subscriptions=[Subscription(name=name, topic="orders.created", handler_key="h") for name in names],
    )


same_queue = _named("orders.email", "orders-email")
"""Two subscriptions whose names map to one SQS queue."""
queue_is_a_dlq = _named("orders.email", "orders.email.dlq")
"""A subscription whose queue is another's dead-letter queue."""
