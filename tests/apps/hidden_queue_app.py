"""Apps whose queue is not in sight before start-up, for ``workqueue work --app``.

``app``: the queue is built in a factory and only the state its lifespan yields (``{"workqueue":
queue}``) holds it. ``plain``: an app with no queue anywhere.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from fastapi_workqueue import Outcome, Subscription, Topic, WorkMessage, WorkOutcome, WorkQueue

SUBSCRIPTION = "cli.hidden"


def create_app() -> FastAPI:
    queue = WorkQueue(
        topics=[Topic(name=SUBSCRIPTION)],
        subscriptions=[Subscription(name=SUBSCRIPTION, topic=SUBSCRIPTION, handler_key="cli.hidden")],
    )

    @queue.handler("cli.hidden")
    async def handle(message: WorkMessage[Any]) -> WorkOutcome:
        return Outcome.complete()

    return FastAPI(lifespan=queue.lifespan)


app = create_app()
plain = FastAPI()
