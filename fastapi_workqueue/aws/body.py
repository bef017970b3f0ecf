"""The SNS/SQS message body: the library's own data beside the payload, not in attributes.

``{"message_id", "topic", "partition_key", "correlation_id", "published_at", "headers",
"payload"}``; the user's attributes (at most 10) are the SNS message attributes, which filter
policies read. A dead letter adds ``dead_letter`` (reason, error, attempts, subscription) and
``origin_id``, the SQS MessageId the delivery was first received with (:func:`dead_letter_body`).

The one decoder of received bodies, for the host transport and the Lambda adapter alike: a body
the library wrote is its envelope; any other JSON body is the payload of another producer; a body
that is not JSON is that producer's payload as a string (never a dead letter for being text: the
handler's payload model decides whether text is acceptable). Imports the core's envelope only, so
the Lambda adapter stays light.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from ..core.envelope import PreparedMessage

MAX_DEAD_LETTER_ERROR = 4000
"""The most characters of error text a dead letter carries."""


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
    """The body as the library wrote it, or the whole body as the payload of another producer
    (parsed when it is JSON, the text itself when it is not), with ``fallback_id`` (the SQS
    MessageId) as its ``message_id``."""
    try:
        data = json.loads(text)
    except ValueError:
        return {"message_id": fallback_id, "payload": text}
    if isinstance(data, dict) and "message_id" in data and "payload" in data:
        return data
    return {"message_id": fallback_id, "payload": data}


def message_uuid(envelope: dict[str, Any], origin_id: str) -> uuid.UUID:
    """The MessageID a handler, ``get_delivery`` and the Lambda adapter all show: the envelope's,
    or for one that is not a UUID (another producer's) the SQS MessageId the delivery was first
    received with (``origin_id``, a UUID), or a uuid5 of it."""
    try:
        return uuid.UUID(str(envelope["message_id"]))
    except (KeyError, ValueError):
        pass
    try:
        return uuid.UUID(origin_id)
    except ValueError:
        return uuid.uuid5(uuid.NAMESPACE_URL, origin_id)


def origin_of(envelope: dict[str, Any], sqs_id: str) -> str:
    """The SQS MessageId the delivery was first received with: a dead letter or a replay carries it
    as ``origin_id`` (SQS gives the copy a new MessageId), a first receive is its own ``sqs_id``."""
    return str(envelope.get("origin_id") or sqs_id)


def dead_letter_body(
    envelope: dict[str, Any],
    *,
    origin_id: str,
    subscription: str,
    reason: str,
    error: str | None,
    attempts: int,
    at: datetime | None = None,
) -> str:
    """The body of a dead letter, as the host transport and the Lambda adapter both write it: the
    envelope (same MessageID), ``origin_id`` (so the dead letter keeps its delivery id,
    ``aws:<subscription>:<origin_id>``) and a ``dead_letter`` section (reason, last error, attempts)."""
    body = {key: value for key, value in envelope.items() if key != "dead_letter"}
    body["origin_id"] = origin_id
    body["dead_letter"] = {
        "reason": reason,
        "error": None if error is None else error[:MAX_DEAD_LETTER_ERROR],
        "attempts": attempts,
        "subscription": subscription,
        "dead_lettered_at": (at or datetime.now(UTC)).isoformat(),
    }
    return json.dumps(body)
