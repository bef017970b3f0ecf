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

import hashlib
import json
import re
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

from ..core.envelope import PreparedMessage

MAX_DEAD_LETTER_ERROR = 4000
"""The most characters of error text a dead letter carries."""
NO_ATTRIBUTES = "workqueue.none"
"""The attribute a message without attributes carries to SNS (value ``"1"``): SNS matches a filter's
``{"exists": false}`` only when the message has some attribute. Receivers leave it out."""
_SQS_REFUSES = re.compile("[\ud800-\udfff\ufffe\uffff]")
"""What SQS refuses in a message body as it is (written as ``\\u`` escapes instead)."""


def dumps(body: Any) -> str:
    """``body`` as the JSON the library sends: UTF-8 text as it is (a ``\\u00e9`` escape would
    take six bytes of SNS's 256 KiB for a two-byte character), escaped only where SQS refuses a
    character."""
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    if not text.isascii() and _SQS_REFUSES.search(text):
        return json.dumps(body, separators=(",", ":"))
    return text


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
    return dumps(body)


def deduplication_id(message: PreparedMessage) -> str:
    """The MessageDeduplicationId of ``message`` on a FIFO topic: its deduplication key, hashed (SNS
    takes at most 128 characters of a narrow alphabet), or its MessageID when it has none."""
    if message.deduplication_key is None:
        return str(message.message_id)
    return "key-" + hashlib.sha256(message.deduplication_key.encode()).hexdigest()


DEDUPLICATION_ATTRIBUTE = "$workqueue.deduplication_id"
"""Where an outbox row keeps the deduplication id of its message (beside its attributes; not sent as
one: SNS attribute names have no ``$``)."""


def outbox_attributes(message: PreparedMessage) -> dict[str, str]:
    """What an outbox row keeps as the attributes of ``message``: its own, and its deduplication id
    when it has a deduplication key (the relay sends it as the MessageDeduplicationId)."""
    if message.deduplication_key is None:
        return message.attributes
    return {**message.attributes, DEDUPLICATION_ATTRIBUTE: deduplication_id(message)}


def sns_attributes(attributes: dict[str, str]) -> dict[str, dict[str, str]]:
    """The user's attributes as SNS/SQS message attributes (strings); none become the
    :data:`NO_ATTRIBUTES` marker."""
    if not attributes:
        return {NO_ATTRIBUTES: {"DataType": "String", "StringValue": "1"}}
    return {name: {"DataType": "String", "StringValue": value} for name, value in attributes.items()}


SNS_MAX_BYTES = 262_144
"""What SNS takes at most: one message (its body and attributes), and one PublishBatch call in all."""
_ATTRIBUTE_NAME = re.compile(r"(?!\.)(?!.*\.\.)(?!.*\.$)(?!(?i:aws|amazon)\.)[A-Za-z0-9_.\-]{1,256}")


_GROUP_ID = re.compile(r"[\x21-\x7e]{1,128}")
"""What SNS takes as a FIFO topic's MessageGroupId: 1 to 128 ASCII letters, digits and punctuation."""


def group_id_problem(partition_key: str) -> str | None:
    """Why SNS would refuse ``partition_key`` as a FIFO MessageGroupId, or None."""
    if _GROUP_ID.fullmatch(partition_key):
        return None
    return (f"partition key {partition_key[:40]!r}{'…' if len(partition_key) > 40 else ''} is not one a FIFO topic "
            "takes as its message group: 1 to 128 ASCII letters, digits and punctuation, no spaces or other "
            "characters; map it (an id, or a hash of it) to such a key")


def attribute_problem(name: str, value: str) -> str | None:
    """Why SNS would refuse attribute ``name`` with ``value`` (or the library would drop it), or None."""
    if name == NO_ATTRIBUTES:
        return f"attribute name {name!r} is reserved for the library (it marks a message without attributes); rename it"
    if not _ATTRIBUTE_NAME.fullmatch(name):
        return (f"attribute name {name!r} is not one SNS takes: 1 to 256 letters, digits, '_', '-' and '.', not "
                "starting or ending with '.', no '..', not starting with 'AWS.' or 'Amazon.'")
    if value == "":
        return f"attribute {name!r} is empty; SNS refuses an empty attribute value: leave the attribute out"
    return None


def entry_size(entry: dict[str, Any]) -> int:
    """What one PublishBatch entry counts toward SNS's limit: its message and its attributes, UTF-8."""
    attributes = entry.get("MessageAttributes") or {}
    return len(entry["Message"].encode()) + sum(
        len(name.encode()) + len(a["DataType"]) + len(a["StringValue"].encode()) for name, a in attributes.items())


def batches(entries: Sequence[dict[str, Any]], most: int) -> Iterator[list[dict[str, Any]]]:
    """``entries`` in calls of at most ``most`` entries and :data:`SNS_MAX_BYTES` in all."""
    chunk: list[dict[str, Any]] = []
    size = 0
    for entry in entries:
        grows = entry_size(entry)
        if chunk and (len(chunk) == most or size + grows > SNS_MAX_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(entry)
        size += grows
    if chunk:
        yield chunk


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
    group_id: str | None = None,
) -> str:
    """The body of a dead letter, as the host transport and the Lambda adapter both write it: the
    envelope (same MessageID), ``origin_id`` (so the dead letter keeps its delivery id,
    ``aws:<subscription>:<origin_id>``) and a ``dead_letter`` section (reason, last error, attempts;
    on FIFO the message group it came from, which a replay sends it back to: in the dead-letter
    queue each dead letter is a group of its own, so that a key's dead letters are read past ten)."""
    body = {key: value for key, value in envelope.items() if key != "dead_letter"}
    body["origin_id"] = origin_id
    body["dead_letter"] = {
        "reason": reason,
        "error": None if error is None else error[:MAX_DEAD_LETTER_ERROR],
        "attempts": attempts,
        "subscription": subscription,
        "dead_lettered_at": (at or datetime.now(UTC)).isoformat(),
    }
    if group_id is not None:
        body["dead_letter"]["group_id"] = group_id
    return dumps(body)
