"""The message envelope: what producers publish, what they get back, what handlers receive."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from .wire import WireModel, to_wire_name

MAX_ENVELOPE_BYTES = 256 * 1024
"""Payload plus attributes, serialized, on every transport. A topic may lower it."""
MAX_ATTRIBUTES = 10
MAX_KEY_LENGTH = 512
DEFAULT_DEDUPLICATION_TTL_SECONDS = 300.0

T = TypeVar("T")


class PublishRequest(WireModel):
    """One message to publish. Every field is optional except what the topic needs.

    Reuse ``message_id`` when retrying a publish: the same ID with the same content is answered
    ``Duplicate``. Set ``delay_seconds`` or ``not_before`` to hold the message back, and
    ``max_attempts``/``backoff_seconds`` to give its deliveries their own retry policy.
    """

    message_id: uuid.UUID | None = None
    partition_key: str | None = None
    attributes: dict[str, Any] = Field(default_factory=dict)
    payload: Any = None
    payload_ref: str | None = None
    correlation_id: str | None = None
    deduplication_key: str | None = None
    deduplication_ttl_seconds: float | None = Field(default=None, gt=0)
    delay_seconds: float | None = Field(default=None, ge=0)
    not_before: datetime | None = None
    max_attempts: int | None = Field(default=None, ge=1)
    backoff_seconds: list[float] | None = None


class PublishStatus(StrEnum):
    """What happened to one published request."""

    ACCEPTED = "Accepted"
    DUPLICATE = "Duplicate"
    MESSAGE_ID_CONFLICT = "MessageIDConflict"
    REJECTED = "Rejected"
    TOPIC_UNBOUND = "TopicUnbound"


class PublishError(WireModel):
    """Why a request was not accepted: a stable ``code``, a message that says what to change."""

    code: str
    message: str
    field: str | None = None


class PublishResult(WireModel):
    """The answer for one request, in the order of the call."""

    status: PublishStatus
    message_id: uuid.UUID | None = None
    error: PublishError | None = None

    @property
    def ok(self) -> bool:
        """True when the message is stored (Accepted or Duplicate)."""
        return self.status in (PublishStatus.ACCEPTED, PublishStatus.DUPLICATE)


class WorkMessage(BaseModel, Generic[T]):
    """A delivery as the handler sees it. ``payload`` is validated against ``T``."""

    model_config = ConfigDict(frozen=True, alias_generator=to_wire_name, validate_by_name=True,
                              serialize_by_alias=True)

    message_id: uuid.UUID
    topic: str
    subscription: str
    delivery_id: str
    attempt: int
    partition_key: str | None = None
    attributes: dict[str, str] = Field(default_factory=dict)
    payload: T
    payload_ref: str | None = None
    correlation_id: str | None = None
    published_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class PreparedMessage:
    """A request checked and serialized for a transport."""

    message_id: uuid.UUID
    partition_key: str | None
    attributes: dict[str, str]
    attributes_json: str
    payload_json: str
    payload_ref: str | None
    correlation_id: str | None
    content_hash: str
    deduplication_key: str | None
    deduplication_ttl_seconds: float
    delay_seconds: float | None
    not_before: datetime | None
    max_attempts: int | None
    backoff_seconds: list[float] | None
    envelope_bytes: int


def uuid7() -> uuid.UUID:
    """A time-ordered UUID (version 7, RFC 9562): IDs assigned one after another sit side by side in
    the message table's index, so claiming recent work reads few index pages."""
    milliseconds = time.time_ns() // 1_000_000
    random_bits = int.from_bytes(os.urandom(10), "big")
    value = (
        (milliseconds & (2**48 - 1)) << 80
        | 0x7 << 76
        | ((random_bits >> 62) & 0xFFF) << 64
        | 0b10 << 62
        | (random_bits & (2**62 - 1))
    )
    return uuid.UUID(int=value)


class RequestRejected(Exception):
    """A request that cannot be published as it is."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.error = PublishError(code=code, message=message, field=field)


def _text_field(name: str, value: str | None, limit: int = MAX_KEY_LENGTH) -> None:
    if value is None:
        return
    if "\x00" in value:
        raise RequestRejected("InvalidField", f"{to_wire_name(name)} contains a NUL character; remove it", name)
    if len(value) > limit:
        raise RequestRejected(
            "InvalidField", f"{to_wire_name(name)} is {len(value)} characters; at most {limit} are allowed", name
        )


_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False).encode


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


def prepare(request: PublishRequest, *, max_envelope_bytes: int = MAX_ENVELOPE_BYTES) -> PreparedMessage:
    """Checks a request against the envelope rules and serializes it.

    Raises :class:`RequestRejected` with a clear error when it breaks one.
    """
    attributes = request.attributes
    if len(attributes) > MAX_ATTRIBUTES:
        raise RequestRejected(
            "TooManyAttributes",
            f"{len(attributes)} attributes were sent; at most {MAX_ATTRIBUTES} are allowed "
            "(put the rest in the Payload)",
            "attributes",
        )
    for name, value in attributes.items():
        if not isinstance(value, str):
            raise RequestRejected(
                "InvalidAttribute",
                f"attribute {name!r} is a {type(value).__name__}; attribute values must be strings "
                "(filters compare strings)",
                "attributes",
            )
        _text_field("attributes", name, 256)
        _text_field("attributes", value, 1024)
    _text_field("partition_key", request.partition_key)
    _text_field("deduplication_key", request.deduplication_key)
    _text_field("correlation_id", request.correlation_id)
    _text_field("payload_ref", request.payload_ref, 2048)
    if request.delay_seconds is not None and request.not_before is not None:
        raise RequestRejected(
            "InvalidField", "set DelaySeconds or NotBefore, not both", "delay_seconds"
        )
    if request.not_before is not None and request.not_before.tzinfo is None:
        raise RequestRejected(
            "InvalidField", "NotBefore needs a time zone (for example 2026-01-01T00:00:00Z)", "not_before"
        )
    backoff = request.backoff_seconds
    if backoff is not None and (not backoff or any(not math.isfinite(b) or b < 0 for b in backoff)):
        raise RequestRejected(
            "InvalidField", "BackoffSeconds must be a non-empty list of seconds >= 0", "backoff_seconds"
        )
    payload = request.payload
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json")
    try:
        # Keys sorted: the stored form is canonical, so equal content hashes equally.
        payload_json = _encode(payload)
    except (TypeError, ValueError) as exc:
        raise RequestRejected(
            "InvalidPayload", f"the Payload is not JSON: {exc}; send JSON values only", "payload"
        ) from exc
    attributes_json = _encode(attributes) if attributes else "{}"
    content = "\n".join(
        (_encode([request.partition_key, request.payload_ref, request.correlation_id]), attributes_json, payload_json)
    )
    size = _utf8_len(payload_json) + _utf8_len(attributes_json)
    if size > max_envelope_bytes:
        raise RequestRejected(
            "EnvelopeTooLarge",
            f"the envelope (payload and attributes) is {size} bytes; at most {max_envelope_bytes} are "
            "allowed; store the data elsewhere and send a PayloadRef to it",
            "payload",
        )
    return PreparedMessage(
        message_id=request.message_id or uuid7(),
        partition_key=request.partition_key,
        attributes=attributes,
        attributes_json=attributes_json,
        payload_json=payload_json,
        payload_ref=request.payload_ref,
        correlation_id=request.correlation_id,
        content_hash=hashlib.sha256(content.encode()).hexdigest(),
        deduplication_key=request.deduplication_key,
        deduplication_ttl_seconds=request.deduplication_ttl_seconds or DEFAULT_DEDUPLICATION_TTL_SECONDS,
        delay_seconds=request.delay_seconds,
        not_before=request.not_before,
        max_attempts=request.max_attempts,
        backoff_seconds=backoff,
        envelope_bytes=size,
    )


def aborted_results(
    count: int, failures: dict[int, PublishResult]
) -> list[PublishResult]:
    """All-or-nothing: when any item is refused, every other item reports BatchAborted."""
    first = min(failures)
    first_error = failures[first].error
    code = first_error.code if first_error else failures[first].status.value
    results: list[PublishResult] = []
    for index in range(count):
        if index in failures:
            results.append(failures[index])
            continue
        results.append(
            PublishResult(
                status=PublishStatus.REJECTED,
                error=PublishError(
                    code="BatchAborted",
                    message=f"not published: item {first} of this call was refused ({code}) and a publish "
                    "call is all-or-nothing",
                ),
            )
        )
    return results
