"""An app for the dashboard's browser test: ``workqueue work --app tests.apps.held_app:queue``.

One topic and one subscription (names from ``HELD_APP_TOPIC`` and ``HELD_APP_SUBSCRIPTION``) on
the store named by ``WORKQUEUE_DATABASE_URL``. Until the file named by ``HELD_APP_GATE`` exists,
a message ``{"hold": true}`` keeps its handler waiting (the delivery stays InFlight, held by this
process) and a message ``{"fail": true}`` fails; once it exists both complete.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi_workqueue import Subscription, Topic, WorkContext, WorkMessage, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.host import SubscriptionPlan

TOPIC = os.environ.get("HELD_APP_TOPIC", "held.topic")
SUBSCRIPTION = os.environ.get("HELD_APP_SUBSCRIPTION", "held.sub")
GATE = os.environ.get("HELD_APP_GATE", "/nonexistent/held-app-gate")


def _gate_open() -> bool:
    return os.path.exists(GATE)


async def _gate_opens() -> None:
    """Returns once the gate file exists (polled: another process creates it)."""
    while not _gate_open():  # noqa: ASYNC110 - the signal is a file another process writes
        await asyncio.sleep(0.05)


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
            await _gate_opens()
        if message.payload.get("fail") and not _gate_open():
            raise RuntimeError(f"the warehouse API answered 503 on attempt {context.attempt}")

    return queue


queue = make_queue()
