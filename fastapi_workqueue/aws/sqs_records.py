"""SQS records of a Lambda event: read into a delivery, and written back to a dead-letter queue.

A Lambda SQS event names its fields in camelCase (``messageId``, ``receiptHandle``,
``messageAttributes`` with ``stringValue``); the body is the message the publisher sent to SNS
(raw delivery), decoded by :func:`.body.decode` as the host transport decodes it. Imports the core only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ..core.transport import ClaimedDelivery
from . import body as bodies
from .naming import NAME

if TYPE_CHECKING:
    from .lambda_handler import SubscriptionPolicy


@dataclass(frozen=True, slots=True)
class SqsRecord:
    """One record of an SQS event."""

    message_id: str
    receipt_handle: str
    body: str
    attempt: int
    group_id: str | None = None
    deduplication_id: str | None = None
    attributes: dict[str, str] = field(default_factory=dict)
    message_attributes: dict[str, dict[str, Any]] = field(default_factory=dict)
    sent_at: datetime | None = None
    decoded: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """The body decoded once (:func:`decode_record`), as :meth:`envelope` answers it."""

    def envelope(self) -> dict[str, Any]:
        """The body as the library wrote it (``message_id``, ``payload``, ...), or the whole body as the
        payload when another producer sent it (text when it is not JSON): :func:`.body.decode`. Read,
        never changed: each view of the record (its delivery, its id, its dead letter) shares it."""
        if self.decoded is not None:
            return self.decoded
        return bodies.decode(self.body, self.message_id)

    @property
    def origin_id(self) -> str:
        """The SQS MessageId the delivery was first received with (a replayed message carries it in
        its body): the last part of the id the host transport's operator views give it."""
        return bodies.origin_of(self.envelope(), self.message_id)

    def delivery_id(self, subscription: str) -> str:
        """``aws:<subscription>:<origin>``: the id a host consumer and the operator views give the
        delivery (the same across its receives, its dead letter and its replays)."""
        return f"{NAME}:{subscription}:{self.origin_id}"

    def backoff_schedule(self) -> list[float] | None:
        """The message's own backoff schedule (``backoff_seconds`` of its publish), or None."""
        steps = self.envelope().get("backoff_seconds")
        return [float(s) for s in steps] if isinstance(steps, list) and steps else None

    def claimed(self, subscription: str, topic: str, max_attempts: int) -> ClaimedDelivery:
        """The record as the delivery a host consumer of ``subscription`` would have claimed (a
        ``max_attempts`` the message was published with wins over the subscription's)."""
        env = self.envelope()
        message_id = bodies.message_uuid(env, self.origin_id)
        published = env.get("published_at")
        headers = env.get("headers")
        return ClaimedDelivery(
            delivery_id=self.delivery_id(subscription),
            lease_token=self.receipt_handle,
            attempt=self.attempt,
            max_attempts=int(env.get("max_attempts") or max_attempts),
            lease_expires_at=None,
            message_id=message_id,
            topic=str(env.get("topic") or topic),
            partition_key=env.get("partition_key") or self.group_id,
            attributes=dict(self.attributes),
            payload_json=json.dumps(env["payload"]),
            payload_ref=env.get("payload_ref"),
            correlation_id=env.get("correlation_id"),
            published_at=datetime.fromisoformat(published) if isinstance(published, str) else self.sent_at,
            headers=headers if isinstance(headers, dict) else None,
        )


def decode_record(record: Mapping[str, Any]) -> SqsRecord:
    """Reads one record of a Lambda SQS event; a record without its id, receipt handle or body is refused."""
    missing = [k for k in ("messageId", "receiptHandle", "body") if not isinstance(record.get(k), str)]
    if missing:
        raise ValueError(f"an SQS record lacks {', '.join(missing)}: the event is not an SQS event")
    attrs = record.get("attributes") or {}
    raw_attributes = record.get("messageAttributes") or {}
    strings = {
        name: str(value["stringValue"])
        for name, value in raw_attributes.items()
        if isinstance(value, Mapping) and value.get("stringValue") is not None and name != bodies.NO_ATTRIBUTES
    }
    sent = attrs.get("SentTimestamp")
    return SqsRecord(
        message_id=record["messageId"],
        receipt_handle=record["receiptHandle"],
        body=record["body"],
        attempt=max(int(attrs.get("ApproximateReceiveCount", 1)), 1),
        group_id=attrs.get("MessageGroupId"),
        deduplication_id=attrs.get("MessageDeduplicationId"),
        attributes=strings,
        message_attributes={k: dict(v) for k, v in raw_attributes.items() if isinstance(v, Mapping)},
        sent_at=datetime.fromtimestamp(int(sent) / 1000, UTC) if sent else None,
        decoded=bodies.decode(record["body"], record["messageId"]),
    )


def _send_attribute(value: Mapping[str, Any]) -> dict[str, Any]:
    """An event's message attribute (``stringValue``, ``dataType``) as SendMessage takes it."""
    out: dict[str, Any] = {"DataType": value.get("dataType", "String")}
    if value.get("stringValue") is not None:
        out["StringValue"] = value["stringValue"]
    if value.get("binaryValue") is not None:
        out["BinaryValue"] = value["binaryValue"]
    return out


def dead_letter_entry(record: SqsRecord, policy: SubscriptionPolicy, reason: str, error: str | None) -> dict[str, Any]:
    """The SendMessage arguments that put ``record`` in the subscription's dead-letter queue: its
    envelope (the same MessageID) with ``origin_id`` and a ``dead_letter`` section
    (:func:`.body.dead_letter_body`, as the host transport writes it), its attributes, and on FIFO
    its group and a deduplication id of this SQS message."""
    body = bodies.dead_letter_body(record.envelope(), origin_id=record.origin_id, subscription=policy.name,
                                   reason=reason, error=error, attempts=record.attempt,
                                   group_id=(record.group_id or policy.name) if policy.is_fifo else None)
    entry: dict[str, Any] = {"QueueUrl": policy.dlq_url, "MessageBody": body}
    if record.message_attributes:
        entry["MessageAttributes"] = {k: _send_attribute(v) for k, v in record.message_attributes.items()}
    if policy.is_fifo:
        entry["MessageGroupId"] = f"dl-{record.message_id}"  # (a group of its own: see settling.send_dead_letter)
        entry["MessageDeduplicationId"] = record.message_id
    return entry
