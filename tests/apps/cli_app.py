"""A small app for the CLI tests: ``workqueue work --app tests.apps.cli_app:queue --subscription …``.

Each subscription has a topic of its own, so a publish reaches one subscription only. The
database comes from ``WORKQUEUE_DATABASE_URL``. Handlers append one JSON line per attempt to the
file named by ``CLI_APP_RECORD`` (when set), so a test can see what ran, in which attempt and with
which abort reason. The payload says what to do:

- ``{"sleep": s}``: sleep ``s`` seconds, then complete (aborts are recorded).
- ``{"hang": true}``: wait until the runtime aborts the handler (a "hung" handler that honors its
  signal); ``{"hang": "first"}`` only on the first attempt.
- ``{"fail": true}``: dead-letter at once, unless the file named by ``CLI_APP_FIXED`` exists (the
  "deployed fix" of the runbooks); ``{"fail": "text"}`` dead-letters with that text as the error.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from fastapi_workqueue import (
    FatalWorkError,
    Outcome,
    Subscription,
    Topic,
    WorkContext,
    WorkMessage,
    WorkOutcome,
    WorkQueue,
    WorkQueueSettings,
)

BASIC = "cli.basic"
IDLE = "cli.idle"
PAUSED = "cli.paused"
ORPHAN = "cli.orphan"
ORDERED = "cli.ordered"
HANG = "cli.hang"
CRASH = "cli.crash"
SLOW = "cli.slow"
EXTERNAL = "cli.external"

NAMES = (BASIC, IDLE, PAUSED, ORPHAN, ORDERED, HANG, CRASH, SLOW, EXTERNAL)

_quick: dict[str, Any] = {"backoff_base_seconds": 0, "backoff_max_seconds": 0}

queue = WorkQueue(
    WorkQueueSettings(
        subscriptions=[{"name": "*", "concurrency": 2}],
        idle_poll_min_ms=20,
        idle_poll_max_ms=200,
        sweeper_interval_ms=200,
        reconcile_interval_ms=1000,
        shutdown_drain_ms=3000,
        pool_size=4,
    ),
    topics=[Topic(name=name) for name in NAMES],
    subscriptions=[
        Subscription(name=BASIC, topic=BASIC, handler_key="cli.record", max_attempts=1),
        Subscription(name=IDLE, topic=IDLE, handler_key="cli.record"),
        Subscription(name=PAUSED, topic=PAUSED, handler_key="cli.record"),
        Subscription(name=ORPHAN, topic=ORPHAN, handler_key="cli.not-registered-anywhere"),
        Subscription(name=ORDERED, topic=ORDERED, handler_key="cli.record", partition_mode="Ordered",
                     max_attempts=1),
        Subscription(name=HANG, topic=HANG, handler_key="cli.record", lease_seconds=1.5),
        Subscription(name=CRASH, topic=CRASH, handler_key="cli.record", lease_seconds=1, max_attempts=3, **_quick),
        Subscription(name=SLOW, topic=SLOW, handler_key="cli.record"),
        Subscription(name=EXTERNAL, topic=EXTERNAL, handler_key="cli.record", host_type="external"),
    ],
)


def record(**fields: Any) -> None:
    path = os.environ.get("CLI_APP_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(fields) + "\n")


def fix_deployed() -> bool:
    marker = os.environ.get("CLI_APP_FIXED")
    return marker is not None and os.path.exists(marker)


@queue.handler("cli.record")
async def run(message: WorkMessage[dict[str, Any]], context: WorkContext) -> WorkOutcome:
    payload = message.payload
    seen = {"subscription": message.subscription, "payload": payload, "attempt": context.attempt,
            "delivery_id": message.delivery_id, "message_id": str(message.message_id)}
    hang = payload.get("hang")
    if hang is True or (hang == "first" and context.attempt == 1):
        record(event="started", **seen)
        try:
            await asyncio.sleep(60)
        finally:
            record(event="aborted", reason=str(context.signal.reason), **seen)
    if payload.get("stubborn"):  # ignores every cancel for that many seconds
        record(event="started", **seen)
        end = time.monotonic() + float(payload["stubborn"])
        while time.monotonic() < end:
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                record(event="ignored", reason=str(context.signal.reason), **seen)
    if payload.get("sleep"):
        record(event="started", **seen)
        try:
            await asyncio.sleep(float(payload["sleep"]))
        except asyncio.CancelledError:
            record(event="aborted", reason=str(context.signal.reason), **seen)
            raise
    if payload.get("fail") and not fix_deployed():
        record(event="failed", **seen)
        if isinstance(payload["fail"], str):
            raise FatalWorkError(payload["fail"])
        raise FatalWorkError(f"cannot handle {payload!r} yet")
    record(event="done", **seen)
    return Outcome.complete()
