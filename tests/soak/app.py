"""The app of the soak run: one topic, a None, an Exclusive and an Ordered subscription, one handler.

Started by ``tests/soak/run.py`` twice over: under uvicorn (``tests.soak.app:app``, the host on,
the REST API under ``/work-queue`` for the producers and the operator calls) and as
``workqueue work --app tests.soak.app:queue --subscription …`` processes. Everything comes from
the environment, so every process builds the same queue:

- ``WORKQUEUE_DATABASE_URL`` (PostgreSQL) and the other ``WORKQUEUE_*`` settings; the soak's
  own defaults (:data:`SETTINGS_DEFAULTS`: a sweeper pass every second, short polls) apply
  where the environment says nothing.
- ``SOAK_LEASE_SECONDS`` (5: a killed worker's deliveries come back quickly),
  ``SOAK_MAX_ATTEMPTS`` (25: 2 % transient failures never exhaust it),
  ``SOAK_BACKOFF_BASE_SECONDS`` / ``SOAK_BACKOFF_MAX_SECONDS`` (0.5 / 5),
  ``SOAK_MIN_SLEEP_MS`` / ``SOAK_MAX_SLEEP_MS`` (0 / 200: how long a handler works),
  ``SOAK_FAIL_RATE`` (0.02: the share of runs that raise ``TransientWorkError``),
  ``SOAK_LOG_POOL_SIZE`` (4: connections of the run log, per process), ``SOAK_LOG_LEVEL`` (unset:
  the library's logs at that level to stderr).

The handler records every run in ``public.soak_run`` (:data:`RUN_LOG_DDL`, created by the
runner) on the same database: a row when it starts (delivery, message, key, seq, attempt, pid,
``clock_timestamp()``) and its end and outcome when it stops: ``ok`` (written before the handler
returns, so a Completed delivery always has one; if that write fails the attempt fails and is
retried), ``transient``, ``error`` or ``aborted:<reason>`` (best effort). A run of a killed
process has no end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import sys
from collections.abc import AsyncIterator
from typing import Any, TextIO

import asyncpg
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from fastapi_workqueue import (
    Outcome,
    Subscription,
    Topic,
    TransientWorkError,
    WorkContext,
    WorkMessage,
    WorkOutcome,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.database.postgres import to_asyncpg_dsn

TOPIC = "soak.events"
NONE = "soak.none"
EXCLUSIVE = "soak.exclusive"
ORDERED = "soak.ordered"
SUBSCRIPTIONS = (NONE, EXCLUSIVE, ORDERED)
HANDLER = "soak.handle"

SETTINGS_DEFAULTS: dict[str, Any] = {
    "sweeper_interval_ms": 1000,
    "idle_poll_min_ms": 50,
    "idle_poll_max_ms": 1000,
    "reconcile_interval_ms": 5000,
    "shutdown_drain_ms": 3000,
}
"""Settings of every soak process, unless a ``WORKQUEUE_*`` variable says otherwise."""

RUN_LOG_DDL = """
CREATE TABLE IF NOT EXISTS public.soak_run (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    delivery_id   bigint NOT NULL,
    message_id    uuid NOT NULL,
    subscription  text NOT NULL,
    partition_key text,
    seq           integer NOT NULL,
    attempt       integer NOT NULL,
    pid           integer NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at   timestamptz,
    outcome       text
);
CREATE INDEX IF NOT EXISTS soak_run_unfinished ON public.soak_run (pid) WHERE finished_at IS NULL;
"""


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value in (None, "") else float(value)


LEASE_SECONDS = env_float("SOAK_LEASE_SECONDS", 5.0)
MAX_ATTEMPTS = int(env_float("SOAK_MAX_ATTEMPTS", 25))
BACKOFF_BASE_SECONDS = env_float("SOAK_BACKOFF_BASE_SECONDS", 0.5)
BACKOFF_MAX_SECONDS = env_float("SOAK_BACKOFF_MAX_SECONDS", 5.0)
MIN_SLEEP = env_float("SOAK_MIN_SLEEP_MS", 0) / 1000
MAX_SLEEP = env_float("SOAK_MAX_SLEEP_MS", 200) / 1000
FAIL_RATE = env_float("SOAK_FAIL_RATE", 0.02)
LOG_POOL_SIZE = int(env_float("SOAK_LOG_POOL_SIZE", 4))
FINISH_TIMEOUT = 2.0
"""How long a best-effort end record (of a failed or aborted run) may take."""
HOLD_SECONDS = 300.0
"""How long a held handler waits when nobody cancels it."""


class SoakEvent(BaseModel):
    """The payload: the producer's key and the message's place in that key's sequence. ``hold``
    names the subscription on which the handler runs until it is aborted (the runner's cancels)."""

    key: str
    seq: int
    hold: str | None = None


def build_settings() -> WorkQueueSettings:
    overrides = {k: v for k, v in SETTINGS_DEFAULTS.items() if f"WORKQUEUE_{k.upper()}" not in os.environ}
    return WorkQueueSettings(**overrides)


def build_topology() -> tuple[Topic, list[Subscription]]:
    policy: dict[str, Any] = {
        "handler_key": HANDLER,
        "lease_seconds": LEASE_SECONDS,
        "max_attempts": MAX_ATTEMPTS,
        "backoff_base_seconds": BACKOFF_BASE_SECONDS,
        "backoff_max_seconds": BACKOFF_MAX_SECONDS,
    }
    return Topic(name=TOPIC), [
        Subscription(name=NONE, topic=TOPIC, partition_mode="None", **policy),
        Subscription(name=EXCLUSIVE, topic=TOPIC, partition_mode="Exclusive", **policy),
        Subscription(name=ORDERED, topic=TOPIC, partition_mode="Ordered", **policy),
    ]


class RunLog:
    """``public.soak_run`` through a small asyncpg pool of this process, opened on first use."""

    def __init__(self) -> None:
        self._pool: asyncpg.Pool | None = None
        self._lock: asyncio.Lock | None = None

    async def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                if self._pool is None:
                    url = os.environ["WORKQUEUE_DATABASE_URL"]
                    pool = await asyncpg.create_pool(to_asyncpg_dsn(url), min_size=1, max_size=LOG_POOL_SIZE)
                    assert pool is not None
                    self._pool = pool
        return self._pool

    async def started(self, message: WorkMessage[SoakEvent]) -> int:
        pool = await self.pool()
        run_id = await pool.fetchval(
            "INSERT INTO public.soak_run (delivery_id, message_id, subscription, partition_key, seq, attempt, pid) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id",
            int(message.delivery_id), message.message_id, message.subscription, message.partition_key,
            message.payload.seq, message.attempt, os.getpid(),
        )
        return int(run_id)

    async def finished(self, run_id: int, outcome: str) -> None:
        """Records the end of a run once (a later call changes nothing)."""
        pool = await self.pool()
        await pool.execute(
            "UPDATE public.soak_run SET finished_at = clock_timestamp(), outcome = $2 "
            "WHERE id = $1 AND outcome IS NULL",
            run_id, outcome,
        )

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pool.close(), 5)


RUN_LOG = RunLog()


def build_queue() -> WorkQueue:
    topic, subscriptions = build_topology()
    queue = WorkQueue(build_settings(), topics=[topic], subscriptions=subscriptions)

    @queue.handler(HANDLER)
    async def handle(message: WorkMessage[SoakEvent], context: WorkContext) -> WorkOutcome:
        """Works 0–200 ms; 2 % of the runs fail with TransientWorkError. Every run is recorded. A
        message that holds this subscription waits until the runtime aborts the handler."""
        run_id = await RUN_LOG.started(message)
        outcome: str | None = "error"
        try:
            if message.payload.hold == message.subscription:
                outcome = "held"  # until the runtime aborts the wait (a cancel, a shutdown, a lost lease)
                await asyncio.sleep(HOLD_SECONDS)
            await asyncio.sleep(random.uniform(MIN_SLEEP, MAX_SLEEP))
            if random.random() < FAIL_RATE:
                outcome = "transient"
                raise TransientWorkError("soak: a simulated transient failure")
            await RUN_LOG.finished(run_id, "ok")  # the work's effect: if it fails, the attempt fails
            outcome = None
            return Outcome.complete()
        except asyncio.CancelledError:
            reason = context.signal.reason
            outcome = f"aborted:{reason.value if reason is not None else 'cancelled'}"
            raise
        finally:
            if outcome is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(RUN_LOG.finished(run_id, outcome), FINISH_TIMEOUT)

    return queue


queue = build_queue()


class _SoakLog(logging.StreamHandler[TextIO]):
    """The soak's stderr handler (added once however often the app is imported)."""


def configure_logging() -> None:
    """With ``SOAK_LOG_LEVEL`` set (the runner sets INFO), the library's logs go to stderr: the runner
    reads ``running (concurrency …)`` as readiness and ``LISTEN connection re-established``."""
    level = os.environ.get("SOAK_LOG_LEVEL", "").upper()
    if not level:
        return
    root = logging.getLogger()
    if not any(isinstance(h, _SoakLog) for h in root.handlers):
        handler = _SoakLog(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(asctime)s [{os.getpid()}] %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    logging.getLogger("fastapi_workqueue").setLevel(level)


configure_logging()


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
    try:
        async with queue.lifespan(app) as state:
            yield state
    finally:
        await RUN_LOG.close()


app = FastAPI(title="fastapi-workqueue soak", lifespan=lifespan)
app.include_router(queue.router)
app.include_router(queue.health_router)


@app.get("/soak/ready")
async def ready() -> JSONResponse:
    """200 once this process's host runs all three subscriptions, else 503."""
    health = queue.health()
    running = {s.subscription for s in health.subscriptions if s.state == "Running"}
    ok = health.status == "Running" and running >= set(SUBSCRIPTIONS)
    return JSONResponse(
        status_code=200 if ok else 503,
        content={"pid": os.getpid(), "health": health.model_dump(mode="json", by_alias=True)},
    )
