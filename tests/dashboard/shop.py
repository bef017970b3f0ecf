"""The app the dashboard tests drive: a queue with an order topic and three subscriptions (one of
them Ordered), the dashboard mounted at ``/work-queue/ui``, and handlers whose outcome a test
chooses through the payload."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from fastapi_workqueue import (
    FatalWorkError,
    Subscription,
    SubscriptionPlan,
    Topic,
    WorkContext,
    WorkMessage,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.core.context import Progress

from ..conftest import unique

SECRET = "the-shop-dashboard-secret-of-the-tests"
"""WORKQUEUE_DASHBOARD_SECRET of the app: it signs the session cookies."""


class Shop:
    """The app, its queue and the names of its topic and subscriptions."""

    def __init__(self, database_url: str, *, authorize: Any = None, poll_seconds: float = 0.5,
                 trace_url: str | None = None, stuck_after_seconds: float = 600.0) -> None:
        self.topic = unique("orders")
        self.mail = unique("orders.mail")
        self.ledger = unique("orders.ledger")
        self.idle = unique("orders.idle")
        self.failed_once: set[str] = set()
        self.release = asyncio.Event()
        self.queue = WorkQueue(
            WorkQueueSettings(
                database_url=database_url,
                subscriptions=[SubscriptionPlan(name=n, concurrency=2) for n in (self.mail, self.ledger)],
                # The process beats once a reconcile interval and counts as live for three: at
                # 200 ms, a page built while the CI machine stalled for 0.6 s showed it gone.
                idle_poll_min_ms=20, idle_poll_max_ms=100, sweeper_interval_ms=200,
                reconcile_interval_ms=1000, shutdown_drain_ms=300, trace_url=trace_url, dashboard_secret=SECRET,
                dashboard_stuck_after_seconds=stuck_after_seconds,
            ),
            topics=[Topic(name=self.topic)],
            subscriptions=[
                Subscription(name=self.mail, topic=self.topic, handler_key="mail", max_attempts=3,
                             backoff_base_seconds=0.05, backoff_max_seconds=0.1),
                Subscription(name=self.ledger, topic=self.topic, handler_key="ledger", partition_mode="Ordered",
                             backoff_base_seconds=0.05, backoff_max_seconds=0.1),
                Subscription(name=self.idle, topic=self.topic, handler_key="idle", status="Paused"),
            ],
        )
        self.queue.handler("mail")(self._mail)
        self.queue.handler("ledger")(self._ledger)
        self.app = FastAPI(lifespan=self.queue.lifespan)
        self.app.mount("/work-queue/ui", self.queue.dashboard(authorize=authorize, poll_seconds=poll_seconds))

    async def _mail(self, message: WorkMessage[dict[str, Any]], context: WorkContext) -> None:
        """``{"fail": "once"}`` dead-letters on its first run and completes when replayed;
        ``{"hold": true}`` reports progress and waits for :attr:`release`."""
        payload = message.payload
        if payload.get("fail") == "once" and str(message.message_id) not in self.failed_once:
            self.failed_once.add(str(message.message_id))
            raise FatalWorkError(f"the mail server refused {payload.get('to', 'the address')}")
        if payload.get("hold"):
            await context.heartbeat(Progress(percent=40, message="rendering the invoice"))
            await self.release.wait()

    async def _ledger(self, message: WorkMessage[dict[str, Any]], context: WorkContext) -> None:
        if message.payload.get("fail"):
            raise FatalWorkError("the ledger refused the entry")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def wait_until(check: Callable[[], Any], within: float = 15.0) -> Any:
    from ..support import wait_for

    return await wait_for(check, within=within, interval=0.05)
