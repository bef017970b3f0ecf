"""The app that ``worker_memory.py`` runs with ``workqueue work --app worker_memory_app:queue``: the
topic and subscription of the benchmark's ``none`` case and a handler that does nothing, declared as
an app declares them, with the settings read from the environment (``WORKQUEUE_DATABASE_URL``)."""

from __future__ import annotations

from pydantic import BaseModel

from fastapi_workqueue import Subscription, Topic, WorkMessage, WorkQueue


class Item(BaseModel):
    """The payload of every benchmark message."""

    i: int
    t: float | None = None


queue = WorkQueue(
    topics=[Topic(name="bench.none")],
    subscriptions=[Subscription(name="bench-none", topic="bench.none", handler_key="bench.none")],
)


@queue.handler("bench.none")
async def noop(message: WorkMessage[Item]) -> None:
    """Does nothing: the memory measured is the library's."""
