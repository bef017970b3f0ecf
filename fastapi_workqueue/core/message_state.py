"""What a store keeps about how a message's work ends, beside its deliveries.

A completion may keep a *result* (JSON text written in the transaction that completes the
delivery: :attr:`.transport.Settlement.result_json`), read back here. The database transports and
the memory transport implement :class:`MessageState`; a broker (SQS) keeps nothing of the kind,
and a queue on one answers that it cannot (the jobs layer's job status, ``wait``, groups and
debounce live in the database).
"""

from __future__ import annotations

import uuid
from typing import Protocol, runtime_checkable


@runtime_checkable
class MessageState(Protocol):
    """A store that keeps the results of completed work."""

    async def result_get(self, message_id: uuid.UUID) -> str | None:
        """The JSON text kept when the message's delivery completed with a result, or None."""
        ...


MESSAGE_STATE_NEEDED = (
    "job status, stored results, wait, groups and debounce need a store that keeps them: a database "
    "(PostgreSQL, SQLite, SQL Server) or the memory transport; jobs live in the queue's database, so set "
    "WORKQUEUE_DATABASE_URL (an SQS-only queue keeps no job state)"
)
"""What a queue whose store keeps no message state answers."""
