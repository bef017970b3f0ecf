"""Notices that a watched message's delivery ended, over PostgreSQL's LISTEN/NOTIFY.

``wait`` asks the store to watch a message (``watch_message``: the delivery's ``watched`` flag);
the ``delivery_ended`` trigger sends its MessageID on the channel ``workqueue_ended`` when the
delivery becomes Completed, DeadLettered or Discarded, in the transaction that ends it. One
listening connection per transport, opened by the first watch, serves every waiter of the process;
after it reconnects every waiter looks again (notices sent meanwhile are lost).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from .listener import WAKE_ALL, NotificationListener

ENDED_CHANNEL = "workqueue_ended"


def _ids(payload: str) -> list[str]:
    return payload.split(",")


class EndNotices:
    """The waiters of one transport: events set when their message's delivery ends."""

    def __init__(self, dsn: str, *, listener: Callable[..., NotificationListener] = NotificationListener) -> None:
        self._dsn = dsn
        self._make_listener = listener
        self._listener: NotificationListener | None = None
        self._starting = asyncio.Lock()
        self._waiters: dict[str, set[asyncio.Event]] = {}

    async def add(self, message_id: uuid.UUID, event: asyncio.Event) -> None:
        """Sets ``event`` when a notice names ``message_id`` (the listener starts on first use)."""
        self._waiters.setdefault(str(message_id), set()).add(event)
        if self._listener is None:
            async with self._starting:
                if self._listener is None:
                    listener = self._make_listener(self._dsn, ENDED_CHANNEL, self._heard, parse=_ids)
                    await listener.start()
                    self._listener = listener

    def remove(self, message_id: uuid.UUID, event: asyncio.Event) -> None:
        key = str(message_id)
        events = self._waiters.get(key)
        if events is not None:
            events.discard(event)
            if not events:
                del self._waiters[key]

    def _heard(self, message_id: str) -> None:
        if message_id == WAKE_ALL:  # (the listener reconnected: look again)
            for events in self._waiters.values():
                for event in events:
                    event.set()
            return
        for event in self._waiters.get(message_id, ()):
            event.set()

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            await listener.stop()
        for events in self._waiters.values():
            for event in events:
                event.set()
