"""The previous release of an app, for the rolling-deploy test of the subscription lifecycle:
``workqueue work --app tests.apps.rolling_app:queue --subscription $ROLLING_OLD``.

It declares topic ``$ROLLING_TOPIC`` with subscription ``$ROLLING_OLD`` (the name the new release
renames) and handles it by appending ``{"by": "old", "n": ...}`` to the file ``$ROLLING_RECORD``.
The database comes from ``WORKQUEUE_DATABASE_URL``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fastapi_workqueue import Subscription, Topic, WorkMessage, WorkQueue, WorkQueueSettings

TOPIC = os.environ.get("ROLLING_TOPIC", "rolling.orders")
OLD = os.environ.get("ROLLING_OLD", "rolling.orders.mail")

queue = WorkQueue(
    WorkQueueSettings(idle_poll_min_ms=20, idle_poll_max_ms=100, sweeper_interval_ms=500, reconcile_interval_ms=300,
                      shutdown_drain_ms=2000),
    topics=[Topic(name=TOPIC)],
    subscriptions=[Subscription(name=OLD, topic=TOPIC, handler_key="rolling.mail")],
)


@queue.handler("rolling.mail")
async def mail(message: WorkMessage[dict[str, Any]]) -> None:
    with open(os.environ["ROLLING_RECORD"], "a", encoding="utf-8") as out:  # noqa: ASYNC230 - one short line
        out.write(json.dumps({"by": "old", "n": message.payload["n"]}) + "\n")
