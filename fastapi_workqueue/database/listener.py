"""LISTEN/NOTIFY wake-ups on a connection of its own, reconnecting by itself."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import asyncpg

log = logging.getLogger("fastapi_workqueue.listener")

WAKE_ALL = "*"


class NotificationListener:
    """Listens on ``channel`` and calls ``callback(payload)`` for every notification.

    After a reconnect it calls ``callback("*")``: notifications sent while it was away are lost,
    so every consumer should look for work once.
    """

    def __init__(
        self, dsn: str, channel: str, callback: Callable[[str], None], *, ping_interval: float = 30.0
    ) -> None:
        self._dsn = dsn
        self._channel = channel
        self._callback = callback
        self._ping_interval = ping_interval
        self._conn: asyncpg.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._lost = asyncio.Event()

    async def start(self) -> None:
        await self._connect()
        self._task = asyncio.create_task(self._watch(), name="workqueue-listener")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._drop()

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: object) -> None:
        self._callback(str(payload))

    def _on_terminate(self, _conn: Any) -> None:
        self._lost.set()

    async def _connect(self) -> None:
        conn = await asyncpg.connect(self._dsn, timeout=10)
        conn.add_termination_listener(self._on_terminate)
        await conn.add_listener(self._channel, self._on_notify)
        self._conn = conn
        self._lost.clear()

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), timeout=2)

    async def _watch(self) -> None:
        delay = 0.5
        while True:
            if self._conn is None or self._conn.is_closed():
                try:
                    await self._connect()
                except Exception as exc:
                    log.warning("LISTEN connection failed (%s); retrying in %.1f s", exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)
                    continue
                log.info("LISTEN connection re-established")
                delay = 0.5
                self._callback(WAKE_ALL)
            try:
                await asyncio.wait_for(self._lost.wait(), timeout=self._ping_interval)
            except TimeoutError:
                try:
                    assert self._conn is not None
                    await asyncio.wait_for(self._conn.execute("SELECT 1"), timeout=5)
                    continue
                except Exception as exc:
                    log.warning("LISTEN connection did not answer (%s); reconnecting", exc)
            await self._drop()
