"""An app for the dashboard's browser test: ``workqueue work --app tests.apps.held_app:queue``.

One topic and one subscription (names from ``HELD_APP_TOPIC`` and ``HELD_APP_SUBSCRIPTION``) on
the store named by ``WORKQUEUE_DATABASE_URL``. Until the file named by ``HELD_APP_GATE`` exists,
a message ``{"hold": true}`` keeps its handler waiting (the delivery stays InFlight, held by this
process) and a message ``{"fail": true}`` fails; once it exists both complete.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from fastapi_workqueue import Subscription, Topic, WorkContext, WorkMessage, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.host import SubscriptionPlan

TOPIC = os.environ.get("HELD_APP_TOPIC", "held.topic")
SUBSCRIPTION = os.environ.get("HELD_APP_SUBSCRIPTION", "held.sub")
GATE = Path(os.environ.get("HELD_APP_GATE", "/nonexistent/held-app-gate"))


def make_queue(database_url: str | None = None, *, host: bool = True) -> WorkQueue:
    """The app's queue; ``host=False`` for a process that only publishes and serves the dashboard."""
    settings: dict[str, Any] = {"subscriptions": [SubscriptionPlan(name=SUBSCRIPTION, concurrency=4)],
                                "idle_poll_min_ms": 20, "idle_poll_max_ms": 100}
    if database_url is not None:
        settings["database_url"] = database_url
    if not host:
        settings["enabled"] = False
    queue = WorkQueue(
        WorkQueueSettings(**settings),
        topics=[Topic(name=TOPIC)],
        subscriptions=[Subscription(name=SUBSCRIPTION, topic=TOPIC, handler_key="held", max_attempts=2,
                                    backoff_base_seconds=0.05, backoff_max_seconds=0.1)],
    )

    @queue.handler("held")
    async def held(message: WorkMessage[dict[str, Any]], context: WorkContext) -> None:
        if message.payload.get("hold"):
            while not GATE.exists():
                await asyncio.sleep(0.05)
        if message.payload.get("fail") and not GATE.exists():
            raise RuntimeError(f"the warehouse API answered 503 on attempt {context.attempt}")

    return queue


queue = make_queue()
