"""An app whose orders topic runs on AWS while its audit topic stays on the database.

Settings come from the environment (WORKQUEUE_AWS_REGION, WORKQUEUE_DATABASE_URL, ...), as a
deployed app's do. ``ordered_queue`` has an Ordered subscription on an aws topic, which AWS refuses.
"""

from __future__ import annotations

from fastapi_workqueue import Subscription, Topic, WorkQueue, WorkQueueSettings

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
