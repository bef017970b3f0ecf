"""What the aws transport keeps of the messages this process holds: a lease per delivery handed to
the runtime, and the received messages not handed over yet (:class:`Held`): the later messages of
a busy Exclusive key that a FIFO receive handed over, a key's head waiting out its retry here while
later messages of its key are held, and what a receive brought beyond what the claim asked for."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .naming import BATCH

MAX_LEASE_SECONDS = 12 * 3600
"""SQS's cap on a message's visibility (12 hours after its receive)."""


def client_error_code(exc: BaseException) -> str:
    """The AWS error code of ``exc`` (e.g. SQS refusing a receipt handle), or "" for another error."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


async def change_visibility(sqs: Any, queue_url: str, receipt: str, seconds: int) -> bool:
    """Sets a received message's visibility timeout; False when SQS refuses its receipt handle
    (the message was deleted, or received again elsewhere). Other errors are raised."""
    try:
        await sqs.change_message_visibility(QueueUrl=queue_url, ReceiptHandle=receipt, VisibilityTimeout=seconds)
    except Exception as exc:
        if not client_error_code(exc):
            raise
        return False
    return True


async def change_visibilities(sqs: Any, queue_url: str, changes: Sequence[tuple[str, int]]) -> list[bool]:
    """ChangeMessageVisibilityBatch, 10 at a time: sets each (receipt, seconds); answers, in order,
    whether SQS took each receipt handle."""
    taken: list[bool] = []
    for start in range(0, len(changes), BATCH):
        chunk = changes[start : start + BATCH]
        answer = await sqs.change_message_visibility_batch(
            QueueUrl=queue_url,
            Entries=[{"Id": str(i), "ReceiptHandle": receipt, "VisibilityTimeout": seconds}
                     for i, (receipt, seconds) in enumerate(chunk)],
        )
        failed = {int(f["Id"]) for f in answer.get("Failed", [])}
        taken.extend(i not in failed for i in range(len(chunk)))
    return taken


@dataclass
class Lease:
    """A delivery received by this process: its receipt handle is the lease token."""

    subscription: str
    queue_url: str
    receipt: str
    first_received: float
    attempt: int
    message_id: uuid.UUID
    partition_key: str | None
    attributes: dict[str, str]
    body: str
    message_attributes: dict[str, Any]
    group_id: str | None
    lease_expires_at: datetime
    claimed_at: datetime
    progress_percent: int | None = None
    progress_message: str | None = None
    max_attempts: int = 0
    """The attempts the delivery has (0: the envelope's or the subscription's); the attempt at the
    redrive's maxReceiveCount is the last."""
    message: dict[str, Any] = field(default_factory=dict)
    """The SQS message as received (kept to hold it here again: a retry while its key's later
    messages are held)."""


@dataclass(eq=False)
class Held:
    """A received message not handed to the runtime yet, in the order SQS gave it. Its visibility
    runs until ``visible_at`` (epoch seconds; each heartbeat of its key's lease renews it)."""

    queue_url: str
    message: dict[str, Any]
    received: float
    """When this process first received it (epoch seconds; SQS caps a visibility 12 h after it)."""
    group_id: str | None
    visible_at: float
    sent: float = 0.0
    """When the receive that brought it was sent (monotonic): its lease started after that."""
    due: float = 0.0
    """Not handed over before this time (epoch seconds): a head waiting out its retry here."""
    attempt: int | None = None
    """The attempt its next lease is (a head retried here); None: from SQS's receive count."""
