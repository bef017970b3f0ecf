"""What the aws transport keeps of the messages this process holds: a lease per received
delivery, and the later messages of a busy Exclusive key that a FIFO receive handed over."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

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


@dataclass
class Held:
    """A message SQS FIFO handed over with an earlier one of its key still in flight here: held
    (invisible, under this receipt) until the key is free, then leased out in order. Its visibility
    runs until ``visible_at`` (epoch seconds); each heartbeat of its key's lease renews it."""

    queue_url: str
    message: dict[str, Any]
    received: float
    group_id: str
    visible_at: float


