"""An app for the flow-limit tests: ``workqueue work --app tests.apps.flow_app:queue --subscription S``.

Each subscription has a topic of its own and one flow limit: :data:`LIMITED` ``max_in_flight=5``,
:data:`KEYS` ``key_concurrency=2``, :data:`RATE` ``rate_limit="20/s"``. The database comes from
``WORKQUEUE_DATABASE_URL``. The handler appends a line to ``<FLOW_APP_RECORD>.<pid>`` (one file
per process) when it starts and when it ends, with the wall clock's time, then sleeps the
payload's ``sleep`` seconds in between.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from fastapi_workqueue import Subscription, Topic, WorkMessage, WorkQueue, WorkQueueSettings

LIMITED = "flow.limited"
KEYS = "flow.keys"
RATE = "flow.rate"
LEASE_SECONDS = 3.0

queue = WorkQueue(
    WorkQueueSettings(
        subscriptions=[{"name": "*", "concurrency": 4}],
        idle_poll_min_ms=20,
        idle_poll_max_ms=200,
        sweeper_interval_ms=500,
        reconcile_interval_ms=1000,
        shutdown_drain_ms=3000,
        pool_size=4,
    ),
    topics=[Topic(name=name) for name in (LIMITED, KEYS, RATE)],
    subscriptions=[
        Subscription(name=LIMITED, topic=LIMITED, handler_key="flow.record", max_in_flight=5,
                     lease_seconds=LEASE_SECONDS),
        Subscription(name=KEYS, topic=KEYS, handler_key="flow.record", key_concurrency=2,
                     lease_seconds=LEASE_SECONDS),
        Subscription(name=RATE, topic=RATE, handler_key="flow.record", rate_limit="20/s",
                     lease_seconds=LEASE_SECONDS),
    ],
)


def _record(event: str, message: WorkMessage[Any]) -> None:
    path = os.environ.get("FLOW_APP_RECORD")
    if not path:
        return
    line = {"event": event, "at": time.time(), "subscription": message.subscription,
            "key": message.partition_key, "message_id": str(message.message_id), "attempt": message.attempt,
            "pid": os.getpid()}
    with open(f"{path}.{os.getpid()}", "a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")
        file.flush()


@queue.handler("flow.record")
async def record(message: WorkMessage[dict[str, Any]]) -> None:
    _record("start", message)
    await asyncio.sleep(float(message.payload.get("sleep", 0.05)))
    _record("end", message)
