"""The SNS/SQS message body: the library's own data beside the payload, not in attributes.

``{"message_id", "topic", "partition_key", "correlation_id", "published_at", "headers",
"payload"}``; the user's attributes (at most 10) are the SNS message attributes, which filter
policies read. A dead letter adds ``dead_letter`` (reason, error, attempts, subscription).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from ..core.envelope import PreparedMessage


def encode(topic: str, message: PreparedMessage, *, published_at: datetime | None = None) -> str:
    """The body the library publishes for ``message``."""
    body: dict[str, Any] = {
        "message_id": str(message.message_id),
        "topic": topic,
        "partition_key": message.partition_key,
        "correlation_id": message.correlation_id,
        "published_at": (published_at or datetime.now(UTC)).isoformat(),
        "payload": json.loads(message.payload_json),
    }
    if message.payload_ref is not None:
        body["payload_ref"] = message.payload_ref
    if message.headers:
        body["headers"] = message.headers
    if message.max_attempts is not None:
        body["max_attempts"] = message.max_attempts
    if message.backoff_seconds is not None:
        body["backoff_seconds"] = message.backoff_seconds
    return json.dumps(body, separators=(",", ":"))


def sns_attributes(attributes: dict[str, str]) -> dict[str, dict[str, str]]:
    """The user's attributes as SNS/SQS message attributes (strings)."""
    return {name: {"DataType": "String", "StringValue": value} for name, value in attributes.items()}


def decode(text: str, fallback_id: str) -> dict[str, Any]:
    """The body as the library wrote it, or the whole body as the payload of another producer."""
    try:
        data = json.loads(text)
    except ValueError:
        return {"message_id": fallback_id, "payload": text}
    if isinstance(data, dict) and "message_id" in data and "payload" in data:
        return data
    return {"message_id": fallback_id, "payload": data}
