"""An app for the stall test: ``workqueue work --app tests.apps.stall_app:queue --subscription S``.

One Exclusive subscription (names from ``STALL_APP_TOPIC`` and ``STALL_APP_SUBSCRIPTION``, lease
``STALL_APP_LEASE_SECONDS``) on the store named by ``WORKQUEUE_DATABASE_URL``. Its handler appends
a ``start`` and an ``end`` line (JSON, wall-clock times, the process id) to the file named by
``STALL_APP_RECORD`` and sleeps ``STALL_APP_HANDLER_SECONDS`` in between.

With ``STALL_APP_STOP_MARKER`` set, the process stops itself with SIGSTOP inside its first claim
that returns deliveries, once the store has committed that claim and before the runtime sees the
answer (the marker file says it is stopped); the test continues it with SIGCONT. That is a stall
of the claiming worker past its lease: a pause of the whole process, as a long garbage
collection, a frozen VM or a write lock held elsewhere would make it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from fastapi_workqueue import Subscription, Topic, WorkContext, WorkMessage, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.transport import ClaimedDelivery, Transport
from fastapi_workqueue.database import create_database_transport

TOPIC = os.environ.get("STALL_APP_TOPIC", "stall.topic")
SUBSCRIPTION = os.environ.get("STALL_APP_SUBSCRIPTION", "stall.sub")
LEASE_SECONDS = float(os.environ.get("STALL_APP_LEASE_SECONDS", "2"))
HANDLER_SECONDS = float(os.environ.get("STALL_APP_HANDLER_SECONDS", "3"))


def _stalling(transport: Transport, marker: str) -> Transport:
    """The real transport, whose first claim with deliveries stops the process before returning."""
    claim = transport.claim

    async def claim_then_stop(subscription: str, limit: int) -> list[ClaimedDelivery]:
        batch = await claim(subscription, limit)
        if batch:
            _stop_once(marker, batch)
        return batch

    transport.claim = claim_then_stop  # type: ignore[method-assign]  # replaced on purpose
    return transport


def _stop_once(marker: str, batch: list[ClaimedDelivery]) -> None:
    path = Path(marker)
    if not path.exists():
        path.write_text(json.dumps([d.delivery_id for d in batch]))
        os.kill(os.getpid(), signal.SIGSTOP)


def _transport() -> Transport:
    url = os.environ["WORKQUEUE_DATABASE_URL"]
    transport = create_database_transport(url, pool_max_size=4, listen=True)
    marker = os.environ.get("STALL_APP_STOP_MARKER")
    return _stalling(transport, marker) if marker else transport


queue = WorkQueue(
    WorkQueueSettings(
        subscriptions=[{"name": "*", "concurrency": 3}],
        idle_poll_min_ms=20,
        idle_poll_max_ms=100,
        sweeper_interval_ms=200,
        reconcile_interval_ms=1000,
        shutdown_drain_ms=5000,
        auto_migrate=True,
    ),
    topics=[Topic(name=TOPIC)],
    subscriptions=[
        Subscription(name=SUBSCRIPTION, topic=TOPIC, handler_key="stall.record", partition_mode="Exclusive",
                     lease_seconds=LEASE_SECONDS, max_attempts=10),
    ],
    transport=_transport(),
)


def _record(**fields: Any) -> None:
    with open(os.environ["STALL_APP_RECORD"], "a", encoding="utf-8") as out:
        out.write(json.dumps({**fields, "pid": os.getpid(), "at": time.time()}) + "\n")


@queue.handler("stall.record")
async def record(message: WorkMessage[Any], context: WorkContext) -> None:
    seen = {"delivery_id": message.delivery_id, "key": message.partition_key, "attempt": context.attempt}
    _record(event="start", **seen)
    try:
        await asyncio.sleep(HANDLER_SECONDS)
    finally:
        _record(event="end", reason=None if context.signal.reason is None else context.signal.reason.value, **seen)
