"""What a store keeps about how a message's work ends, beside its deliveries.

A completion may keep a *result* (JSON text written in the transaction that completes the
delivery: :attr:`.transport.Settlement.result_json`), read back here. A *debounced* message is one
pending message per deduplication key whose payload and due time each later publish replaces. A
*group* holds a message back until each of its member messages has ended (fan-in). The
database transports and the memory transport implement :class:`MessageState`; a broker (SQS)
keeps nothing of the kind, and a queue on one answers that it cannot (the jobs layer's job status,
``wait``, groups and debounce live in the database). A store that can announce the end of a
delivery implements :class:`EndWatcher` too (PostgreSQL); a waiter elsewhere polls.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .envelope import PreparedMessage
    from .reports import DeliveryInfo

HELD_UNTIL = datetime(9999, 12, 31, tzinfo=UTC)
"""The ``not_before`` of a group's held message: never due until its group releases it."""


@dataclass(frozen=True, slots=True)
class GroupMember:
    """A member of a group: its MessageID, when its end was counted (None: not yet), its first
    delivery (None once the store no longer has it) and its stored result."""

    message_id: uuid.UUID
    ended_at: datetime | None
    delivery: DeliveryInfo | None
    result: str | None


@runtime_checkable
class MessageState(Protocol):
    """A store that keeps the results of completed work, debounces messages and holds a message for
    a group."""

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

    async def group_create(self, group_id: uuid.UUID, members: Sequence[uuid.UUID], then: uuid.UUID, *,
                           session: Any = None) -> int:
        """Makes ``members`` (MessageIDs, in order) a group whose end releases ``then``: published
        already (in ``session``'s transaction, with ``not_before`` :data:`HELD_UNTIL`), it becomes due
        in the transaction that ends the last member, once. A member that ended already, or has no
        delivery, counts as ended. Answers how many members have not ended."""
        ...

    async def group_members(self, group_id: uuid.UUID) -> list[GroupMember]:
        """The members of a group, in order (empty for an unknown group)."""
        ...


@runtime_checkable
class EndWatcher(Protocol):
    """A store that announces the end of a message's delivery (PostgreSQL's LISTEN/NOTIFY), so that
    a waiter need not poll."""

    def watching_end(self, message_id: uuid.UUID) -> AbstractAsyncContextManager[asyncio.Event | None]:
        """While entered, an event that is set when the message's delivery ends (Completed,
        DeadLettered, Discarded) or when notices may have been missed: the waiter reads the
        status again each time it is set (and now and then regardless). None when this store will
        announce nothing after all (its listening is turned off): the waiter polls."""
        ...


MESSAGE_STATE_NEEDED = (
    "job status, stored results, wait, groups and debounce need a store that keeps them: a database "
    "(PostgreSQL, SQLite, SQL Server) or the memory transport; jobs live in the queue's database, so set "
    "WORKQUEUE_DATABASE_URL (an SQS-only queue keeps no job state)"
)
"""What a queue whose store keeps no message state answers."""
