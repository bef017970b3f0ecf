"""An app whose handler reads what the app's lifespan set: ``workqueue work --app tests.apps.lifespan_app:app``.

The lifespan sets ``app.state.greeting`` and records whether a host runs after ``queue.lifespan``
(it must not: the worker's host is the only one). The handler reads the greeting through
``request.app.state`` and a mailer that ``app.dependency_overrides`` replaces. Every event is a
JSON line in the file named by ``CLI_APP_RECORD``. ``{"sleep": s}`` sleeps before completing.
"""

# No ``from __future__ import annotations``: FastAPI reads the dependency signatures below.

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request

from fastapi_workqueue import Outcome, Subscription, Topic, WorkContext, WorkMessage, WorkOutcome, WorkQueue

SUBSCRIPTION = "cli.lifespan"

queue = WorkQueue(
    topics=[Topic(name=SUBSCRIPTION)],
    subscriptions=[Subscription(name=SUBSCRIPTION, topic=SUBSCRIPTION, handler_key="cli.lifespan", max_attempts=1)],
)


def record(**fields: Any) -> None:
    path = os.environ.get("CLI_APP_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"subscription": SUBSCRIPTION, **fields}) + "\n")


def greeting(request: Request) -> str:
    return str(request.app.state.greeting)


def mailer() -> str:
    return "the real mailer"


@queue.handler("cli.lifespan")
async def handle(
    message: WorkMessage[dict[str, Any]],
    context: WorkContext,
    said: str = Depends(greeting),
    sender: str = Depends(mailer),
) -> WorkOutcome:
    record(event="started", attempt=context.attempt)
    if message.payload.get("sleep"):
        await asyncio.sleep(float(message.payload["sleep"]))
    record(event="done", greeting=said, mailer=sender, message_id=str(message.message_id))
    context.log.info("handled with %s", sender)
    return Outcome.complete()


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
    app.state.greeting = "set by the lifespan"
    async with queue.lifespan(app) as state:
        record(event="startup", host_running=queue.host is not None)
        yield state
    record(event="shutdown")


app = FastAPI(lifespan=lifespan)
app.state.queue = queue
app.dependency_overrides[mailer] = lambda: "the overridden mailer"
