"""What a store keeps about how a message's work ends, beside its deliveries.

A completion may keep a *result* (JSON text written in the transaction that completes the
delivery: :attr:`.transport.Settlement.result_json`), read back here. A *debounced* message is one
pending message per deduplication key whose payload and due time each later publish replaces. The
database transports and the memory transport implement :class:`MessageState`; a broker (SQS)
keeps nothing of the kind, and a queue on one answers that it cannot (the jobs layer's job status,
``wait``, groups and debounce live in the database). A store that can announce the end of a
delivery implements :class:`EndWatcher` too (PostgreSQL); a waiter elsewhere polls.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .envelope import PreparedMessage


@runtime_checkable
class MessageState(Protocol):
    """A store that keeps the results of completed work and debounces messages."""

    async def result_get(self, message_id: uuid.UUID) -> str | None:
        """The JSON text kept when the message's delivery completed with a result, or None."""
        ...

    async def debounce(self, topic: str, key: str, message: PreparedMessage, seconds: float, *,
                       session: Any = None) -> uuid.UUID | None:
        """The message holding ``topic``'s deduplication ``key`` takes ``message``'s payload and
        comes due ``seconds`` from now (the key lives as long), while it still waits out its
        window: every delivery Pending, unkeyed, never claimed and not yet due. Answers its
        MessageID; otherwise frees the key and answers None (publish ``message`` with the key)."""
        ...


@runtime_checkable
class EndWatcher(Protocol):
    """A store that announces the end of a message's delivery (PostgreSQL's LISTEN/NOTIFY), so that
    a waiter need not poll."""

    def watching_end(self, message_id: uuid.UUID) -> AbstractAsyncContextManager[asyncio.Event]:
        """While entered, an event that is set when the message's delivery ends (Completed,
        DeadLettered, Discarded) or when notices may have been missed: the waiter reads the
        status again each time it is set (and now and then regardless)."""
        ...


MESSAGE_STATE_NEEDED = (
    "job status, stored results, wait, groups and debounce need a store that keeps them: a database "
    "(PostgreSQL, SQLite, SQL Server) or the memory transport; jobs live in the queue's database, so set "
    "WORKQUEUE_DATABASE_URL (an SQS-only queue keeps no job state)"
)
"""What a queue whose store keeps no message state answers."""
