"""LISTEN/NOTIFY wake-ups: a listener on a connection of its own, reconnecting by itself, and a
sender that notifies after the publishing transaction has committed.

A notification's payload names the subscriptions to wake: one id, or several joined by commas
(``"3,5"``); ``"*"`` wakes every consumer, and so does a payload that names none.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any

import asyncpg

from ..core.redaction import redacting_logger
from ..core.tasks import TaskScope

log = redacting_logger("fastapi_workqueue.listener")

WAKE_ALL = "*"

NOTIFY_STATEMENT = "SELECT set_config('synchronous_commit', 'off', true), pg_notify($1, $2)"
"""One NOTIFY in a transaction of its own that does not wait for its commit's flush."""

MAX_PAYLOAD_BYTES = 7999
"""A NOTIFY payload must be shorter than 8,000 bytes: longer lists of ids go in several."""


def parse_wakeup(payload: str) -> list[str]:
    """The subscription ids a notification names: ``"3,5"`` gives ``["3", "5"]``; ``"*"``, or a
    payload that is not a list of ids, gives ``["*"]`` (wake everyone: a wake-up is only a hint)."""
    parts = payload.split(",")
    if all(part.isascii() and part.isdigit() for part in parts):
        return parts
    return [WAKE_ALL]


def wakeup_payloads(subscription_ids: Iterable[int]) -> list[str]:
    """The payloads that name ``subscription_ids``: comma-joined, each within the NOTIFY limit."""
    payloads: list[str] = []
    current = ""
    for sid in subscription_ids:
        text = str(sid)
        if current and len(current) + 1 + len(text) > MAX_PAYLOAD_BYTES:
            payloads.append(current)
            current = ""
        current = f"{current},{text}" if current else text
    if current:
        payloads.append(current)
    return payloads


class NotificationListener:
    """Listens on ``channel`` and calls ``callback(payload)`` for every notification.

    After a reconnect it calls ``callback("*")``: notifications sent while it was away are lost,
    so every consumer should look for work once.
    """

    def __init__(
        self, dsn: str, channel: str, callback: Callable[[str], None], *, ping_interval: float = 30.0,
        parse: Callable[[str], list[str]] = parse_wakeup,
    ) -> None:
        """``parse`` splits a payload into what ``callback`` is called with (by default the
        subscription ids of a wake-up, :func:`parse_wakeup`)."""
        self._dsn = dsn
        self._channel = channel
        self._callback = callback
        self._parse = parse
        self._ping_interval = ping_interval
        self._conn: asyncpg.Connection | None = None
        self._tasks = TaskScope("workqueue-listener")
        self._lost = asyncio.Event()

    async def start(self) -> None:
        """Connects and listens. A connection refused now (the server's connection slots all taken,
        say) is no reason to stop the process: consumers poll, as without LISTEN, and the watch
        connects again in the background."""
        try:
            await self._connect()
        except Exception as exc:
            log.warning("LISTEN connection failed (%s); consumers poll until it is made (retrying in the "
                        "background)", exc)
        self._tasks.reopen()
        self._tasks.spawn(self._watch(), name="workqueue-listener")

    async def stop(self) -> None:
        await self._tasks.close()
        await self._drop()

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: object) -> None:
        for item in self._parse(str(payload)):
            self._callback(item)

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
            try:
                await asyncio.wait_for(conn.close(), timeout=1)
            except Exception:  # (a server that does not answer: the socket is dropped, a stop keeps to its bound)
                conn.terminate()

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


class NotificationSender:
    """Sends wake-ups with NOTIFY on ``channel``, each from a connection that ``acquire()`` lends,
    in a transaction that writes nothing.

    A transaction that notifies holds a lock of the whole database from its commit until that
    commit is flushed, so NOTIFY inside a publishing transaction makes concurrent publishers commit
    one at a time. The publish answers whom to wake instead, and the transport calls :meth:`send`
    once the transaction has committed. Ids sent while a NOTIFY is on its way go together in the
    next one, and under load one NOTIFY goes at most every :attr:`min_interval` seconds (the first
    after a quiet spell at once): a round trip per publish would cost the publishing process as
    much CPU as the lock cost it time. A NOTIFY that fails is logged and dropped: consumers find the
    work on their next poll.
    """

    def __init__(self, channel: str, acquire: Callable[[], AbstractAsyncContextManager[Any]]) -> None:
        self._channel = channel
        self._acquire = acquire
        self._pending: set[int] = set()
        self._tasks = TaskScope("workqueue-notify")
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        """NOTIFY statements sent so far (several publishes' wake-ups may share one)."""
        self.close_seconds = 2.0
        """How long :meth:`close` waits for the pending wake-ups to go out."""
        self.min_interval = 0.002
        """Seconds between the starts of two NOTIFYs: a wake-up waits at most this long."""
        self._last = float("-inf")
        self._closed = False

    def send(self, subscription_ids: Iterable[int]) -> None:
        """Wakes ``subscription_ids`` soon; not a coroutine (it runs inside a commit). Nothing
        once :meth:`close` has begun."""
        if self._closed:
            return
        self._pending.update(subscription_ids)
        if self._pending and self._task is None:
            self._task = self._tasks.spawn(self._flush(), name="workqueue-notify")

    async def _flush(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            while self._pending:
                wait = self._last + self.min_interval - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                ids, self._pending = sorted(self._pending), set()
                self._last = loop.time()
                try:
                    async with self._acquire() as conn:
                        for payload in wakeup_payloads(ids):
                            # It commits like any transaction that notifies, under the lock, but
                            # without waiting for its flush: a wake-up lost in a crash costs a poll.
                            await conn.execute(NOTIFY_STATEMENT, self._channel, payload)
                            self.sent += 1
                except Exception as exc:
                    log.warning("wake-up NOTIFY failed (%s); the consumers find the work on their next poll", exc)
        finally:
            self._task = None

    async def close(self) -> None:
        """Refuses further sends, sends what is pending (for at most :attr:`close_seconds`), then
        stops."""
        self._closed = True
        task = self._task
        if task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), self.close_seconds)
        await self._tasks.close()
        self._pending.clear()
