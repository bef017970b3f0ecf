"""The message envelope: what producers publish, what they get back, what handlers receive.

Canonical JSON comes from the public ``json.JSONEncoder`` and message IDs from a maintained uuid7
(the standard library's from Python 3.14, else the ``uuid-utils`` package). They replaced the C
encoder of ``json.encoder`` built once by hand, ``UUID`` objects built by writing their slots, and
a uuid7 of our own. Measured in turns on the 2-core machine while other work ran on it (the same
build with only this module swapped): ``prepare`` of a one-field payload costs 6.8 µs of CPU
instead of 5.8 µs (7 turns of 20,000, medians; the UUIDs cost the same, 2.3 against 2.4 µs). On
a quiet machine a batch publish takes about 15 µs a message (67,669/s, bench/README.md), so the
extra microsecond may be 5-7 % of it there; a one-message publish (about 270 µs) does not notice.
``bench/compare/workqueue_bench.py --only publish`` (9 turns of 20,000 messages, before and after
alternating) could not resolve it here: medians of 648 and 414 messages/s one at a time and 22,119
and 22,077 in batches of 500, per-turn ratios from 0.55 to 1.22 and 0.39 to 1.37. Whatever the
gain, the rule's second condition cannot hold: a private of ``json`` would have to be tested on the
lowest and the newest Python the package supports, and CI runs one (3.11).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticSerializationError

from .message_state import HELD_UNTIL
from .observe import HEADERS_KEY
from .wire import WireModel, to_wire_name

MAX_ENVELOPE_BYTES = 256 * 1024
"""Payload, attributes and backoff schedule, serialized, on every transport. A topic may lower it."""
MAX_ATTRIBUTES = 10
"""The most attributes a message may carry."""
MAX_KEY_LENGTH = 512
DEFAULT_DEDUPLICATION_TTL_SECONDS = 300.0
MAX_DELAY_SECONDS = 100 * 365 * 24 * 3600.0
"""The longest delay, backoff, TTL or lease (a hundred years): a time that far ahead still fits the
timestamps of every store; one beyond it would fail every later claim, settle or sweep that reads it."""
MAX_ATTEMPTS_LIMIT = 2**31 - 1
"""The most attempts a delivery may be given (the stores keep the count in a 32-bit integer)."""
DEFAULT_MAX_MESSAGE_ATTEMPTS = 100
"""The most attempts a published message may ask for (``MaxAttempts``) unless the queue's settings
allow more (``WORKQUEUE_MAX_MESSAGE_ATTEMPTS``): more, with a short backoff, is a message that
practically never dead-letters."""
MAX_BACKOFF_ENTRIES = 100
"""The longest ``BackoffSeconds`` list (its last entry repeats for later attempts)."""
MIN_PRIORITY, MAX_PRIORITY = 0, 9
"""A message's priority: 0 (the default) to 9; a subscription's deliveries run higher first."""
MAX_PAYLOAD_DEPTH = 200
"""How deeply arrays and objects may nest in a payload. JSON serializers stop at about 255 levels
(pydantic's, and so FastAPI's), so a deeper payload could be stored but never listed or returned."""

T = TypeVar("T")


class PublishRequest(WireModel):
    """One message to publish. Every field is optional except what the topic needs.

    Reuse ``message_id`` when retrying a publish: the same ID with the same content is answered
    ``Duplicate``. Set ``delay_seconds`` or ``not_before`` to hold the message back,
    ``max_attempts``/``backoff_seconds`` to give its deliveries their own retry policy, and
    ``priority`` (0 to 9, default 0) to have them claimed before those of lower priority.
    """

    message_id: uuid.UUID | None = None
    partition_key: str | None = None
    attributes: dict[str, Any] = Field(default_factory=dict)
    payload: Any = None
    payload_ref: str | None = None
    correlation_id: str | None = None
    deduplication_key: str | None = None
    # (numbers as numbers: a true or a "5" is a caller's mistake, refused, not read as 1 or 5)
    deduplication_ttl_seconds: float | None = Field(default=None, gt=0, le=MAX_DELAY_SECONDS, allow_inf_nan=False,
                                                    strict=True)
    delay_seconds: float | None = Field(default=None, ge=0, le=MAX_DELAY_SECONDS, allow_inf_nan=False, strict=True)
    not_before: datetime | None = None
    max_attempts: int | None = Field(default=None, ge=1, le=MAX_ATTEMPTS_LIMIT, strict=True)
    backoff_seconds: list[Annotated[float, Field(strict=True)]] | None = None
    priority: int = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY, strict=True)


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


@dataclass(slots=True)
class PreparedMessage:
    """A request checked and serialized for a transport (treat it as read-only: not frozen only
    because a frozen dataclass costs several times as much to build, once per published message)."""

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
    headers: dict[str, str] | None = None
    """What the library carries beside the user's attributes (the trace context), or None."""
    message_id_given: bool = False
    """True when the caller set ``message_id``; False when :func:`prepare` drew it."""
    priority: int = 0
    """0 to 9: a subscription claims its deliveries of higher priority first (not part of the content)."""


def _load_uuid7() -> uuid.UUID:
    """Binds ``_uuid7`` on the first ID drawn, so that a process that publishes nothing (a worker)
    never imports uuid_utils; later calls go straight to it."""
    global _uuid7
    if sys.version_info >= (3, 14):  # pragma: no cover - the tests run on 3.11
        _uuid7 = uuid.uuid7
    else:
        from uuid_utils.compat import uuid7 as loaded

        _uuid7 = loaded
    return _uuid7()


_uuid7: Callable[[], uuid.UUID] = _load_uuid7


def uuid7() -> uuid.UUID:
    """A time-ordered UUID (version 7, RFC 9562), increasing within the process.

    The standard library's ``uuid.uuid7`` from Python 3.14, else ``uuid_utils.compat.uuid7``: both
    count within a millisecond (RFC 9562's counter method), so the IDs of a batch are in order too:
    each goes after the last one in the indexes on MessageID, and claims of recent work read few
    index pages. Both draw fresh random bits in a forked child.
    """
    return _uuid7()


class RequestRejected(Exception):
    """A request that cannot be published as it is."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.error = PublishError(code=code, message=message, field=field)
        self.message_id: uuid.UUID | None = None
        """The MessageID the refused request gave, when its result should name it."""

    def result(self) -> PublishResult:
        """The request's answer: Rejected, with this error."""
        return PublishResult(status=PublishStatus.REJECTED, message_id=self.message_id, error=self.error)


def _text_field(name: str, value: str | None, limit: int = MAX_KEY_LENGTH) -> None:
    if value is None:
        return
    if "\x00" in value:
        raise RequestRejected("InvalidField", f"{to_wire_name(name)} contains a NUL character; remove it", name)
    if len(value) > limit:
        raise RequestRejected(
            "InvalidField", f"{to_wire_name(name)} is {len(value)} characters; at most {limit} are allowed", name
        )
    _utf8_len(value, name, "InvalidField")


def _attribute_text(name: str, text: str, part: str, limit: int) -> None:
    """An attribute's name or value, checked as :func:`_text_field` checks a field, with a
    refusal that says which attribute and which of its parts."""
    try:
        _text_field("attributes", text, limit)
    except RequestRejected as exc:
        shown = repr(name if len(name) <= 40 else name[:40] + "…")
        detail = exc.error.message.removeprefix("Attributes ")
        raise RequestRejected(exc.error.code, f"Attributes[{shown}]: its {part} {detail}", "attributes") from None


_encode: Callable[[Any], str] = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False, check_circular=False
).encode
"""Canonical JSON (keys sorted, no spaces, UTF-8 kept, no NaN) without the check for circular
references: a circular structure ends in a RecursionError, as a too deep one does (see :func:`prepare`)."""


_JSON_TYPES = frozenset({dict, list, str, int, float, bool, type(None)})
_NO_TEXT = (None, None, None)
_NO_REFERENCES = "[null,null,null]"


def _utf8_len(text: str, name: str, code: str) -> int:
    """The UTF-8 size of ``text``; refuses text that has none (a lone surrogate, from a ``\\ud800`` escape)."""
    if text.isascii():
        return len(text)
    try:
        return len(text.encode())
    except UnicodeEncodeError as exc:
        raise RequestRejected(
            code,
            f"{to_wire_name(name)} is not valid Unicode ({exc.reason} at character {exc.start}); "
            "send UTF-8 text (a \\ud800-\\udfff escape must be one half of a surrogate pair)",
            name,
        ) from exc


def _nesting_problem(value: Any) -> str | None:
    """``"circular"`` when a list or dict in ``value`` contains itself, ``"deep"`` when they nest
    more than MAX_PAYLOAD_DEPTH levels, else None. Walked without recursion: the value may be deep."""
    stack: list[tuple[Any, frozenset[int]]] = [(value, frozenset())]
    while stack:
        item, ancestors = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if id(item) in ancestors:
            return "circular"
        if len(ancestors) >= MAX_PAYLOAD_DEPTH:
            return "deep"
        inner = ancestors | {id(item)}
        stack.extend((child, inner) for child in children)
    return None


def _too_deep() -> RequestRejected:
    return RequestRejected(
        "InvalidPayload",
        f"the Payload nests arrays and objects more than {MAX_PAYLOAD_DEPTH} levels deep; flatten it",
        "payload",
    )


def _check_attributes(attributes: dict[str, Any]) -> None:
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
        _attribute_text(name, name, "name", 256)
        _attribute_text(name, value, "value", 1024)
        if name == HEADERS_KEY:
            raise RequestRejected(
                "InvalidAttribute",
                f"the attribute name {HEADERS_KEY!r} is reserved for the library's own headers; rename it",
                "attributes",
            )


@functools.lru_cache(maxsize=1024)
def _checked_attributes(items: tuple[tuple[str, Any], ...]) -> tuple[str, int]:
    """The stored JSON of checked attributes and its size in bytes, kept for the sets a process
    publishes again and again (a job's name, a tenant): checking and encoding them once."""
    attributes = dict(items)
    _check_attributes(attributes)
    attributes_json = _encode(attributes)
    return attributes_json, _utf8_len(attributes_json, "attributes", "InvalidField")


def _attributes_part(attributes: dict[str, Any]) -> tuple[str, int]:
    """The envelope's attributes JSON and its size in bytes (``{}`` when there are none), checked."""
    if not attributes:
        return "{}", 2
    try:
        return _checked_attributes(tuple(attributes.items()))
    except TypeError:  # a value that cannot be hashed is no string: the check says so
        _check_attributes(attributes)
        raise


def _check_schedule(request: PublishRequest) -> int:
    """Checks the request's times and backoff; answers the size the backoff adds to the envelope."""
    if request.delay_seconds is not None and request.not_before is not None:
        raise RequestRejected(
            "InvalidField", "set DelaySeconds or NotBefore, not both", "delay_seconds"
        )
    if request.not_before is not None and request.not_before.tzinfo is None:
        raise RequestRejected(
            "InvalidField", "NotBefore needs a time zone (for example 2026-01-01T00:00:00Z)", "not_before"
        )
    if request.not_before is not None:
        try:
            request.not_before.astimezone(UTC)
        except OverflowError:  # (9999-12-31T23:59:59-05:00 is in the year 10000 in UTC, 0001-01-01T00:00+05:00 in 0)
            if request.not_before.year == 1:
                raise RequestRejected(
                    "InvalidField", "NotBefore is before 0001-01-01T00:00:00Z, the first time the stores can hold; "
                    "give a later time (a time already past is due at once)", "not_before"
                ) from None
            raise RequestRejected(
                "InvalidField", "NotBefore is past 9999-12-31T23:59:59Z, the last time the stores can hold; give an "
                "earlier time", "not_before"
            ) from None
        ahead = (request.not_before - datetime.now(UTC)).total_seconds()
        # (as DelaySeconds: 2206-01-01 for 2026-01-01 is a typo, not a plan; a group's held message
        # waits until its group releases it, at 9999-12-31)
        if ahead > MAX_DELAY_SECONDS and request.not_before != HELD_UNTIL:
            raise RequestRejected(
                "InvalidField", f"NotBefore {request.not_before.isoformat()} is more than 100 years ahead; a message "
                "is held back at most 100 years (as DelaySeconds): check the year", "not_before"
            )
    if request.backoff_seconds is not None:
        return _check_backoff(request.backoff_seconds)
    return 0


def _check_backoff(backoff: list[float]) -> int:
    """Refuses a schedule the stores cannot use; answers the size it adds to the envelope."""
    if len(backoff) > MAX_BACKOFF_ENTRIES:
        raise RequestRejected(
            "InvalidField",
            f"BackoffSeconds has {len(backoff)} entries; at most {MAX_BACKOFF_ENTRIES} are allowed (the last one "
            "repeats for every later attempt)",
            "backoff_seconds",
        )
    if not backoff or any(not math.isfinite(b) or b < 0 or b > MAX_DELAY_SECONDS for b in backoff):
        raise RequestRejected(
            "InvalidField",
            f"BackoffSeconds must be a non-empty list of seconds >= 0 and <= {MAX_DELAY_SECONDS:.0f}",
            "backoff_seconds",
        )
    return len(_encode(backoff))


def _check_attempts(max_attempts: int | None, limit: int) -> None:
    if max_attempts is not None and max_attempts > limit:
        raise RequestRejected(
            "InvalidField",
            f"MaxAttempts is {max_attempts}; a message may ask for at most {limit} attempts (the queue's "
            "WORKQUEUE_MAX_MESSAGE_ATTEMPTS); leave it out to use the subscription's max_attempts",
            "max_attempts",
        )


def serialization_problem(exc: Exception) -> str:
    """What pydantic's serializer refused, in words that say what to change (without the value)."""
    text = str(exc)
    unknown = re.search(r"Unable to serialize unknown type: <class '([^']+)'>", text)
    if unknown is not None:
        return (f"a value of type {unknown[1]} cannot be stored as JSON; pass JSON values (str, int, float, bool, "
                "None, lists and dicts) or types pydantic writes as JSON (datetime, UUID, Decimal, models)")
    return text.splitlines()[-1].strip() or text


def canonical_json(payload: Any) -> tuple[str, int]:
    """The canonical JSON of a payload (keys sorted, no spaces) and its UTF-8 size, as a publish
    stores it; raises :class:`RequestRejected` for what is not JSON or nests too deep."""
    try:
        if type(payload) not in _JSON_TYPES and isinstance(payload, BaseModel):  # (isinstance of a model is slow)
            payload = payload.model_dump(mode="json")
        # Keys sorted: the stored form is canonical, so equal content hashes equally.
        payload_json = _encode(payload)
    except PydanticSerializationError as exc:
        raise RequestRejected(
            "InvalidPayload", f"the Payload is not JSON: {serialization_problem(exc)}", "payload"
        ) from exc
    except (TypeError, ValueError) as exc:
        if "int_max_str_digits" in str(exc) or "Exceeds the limit" in str(exc):
            # (raising the process's limit would let it through, to a worker that cannot read it)
            raise RequestRejected(
                "InvalidPayload", "the Payload holds an integer of more than 4,300 digits, which a worker cannot "
                "read back; send it as a string", "payload"
            ) from exc
        raise RequestRejected(
            "InvalidPayload", f"the Payload is not JSON: {exc}; send JSON values only", "payload"
        ) from exc
    except RecursionError as exc:
        if _nesting_problem(payload) == "circular":
            raise RequestRejected(
                "InvalidPayload", "the Payload is not JSON: it contains itself (a circular reference); "
                "send JSON values only", "payload"
            ) from exc
        raise _too_deep() from exc
    # Only a payload with more brackets than the limit can nest deeper than it.
    if (len(payload_json) > MAX_PAYLOAD_DEPTH
            and payload_json.count("[") + payload_json.count("{") > MAX_PAYLOAD_DEPTH and _nesting_problem(payload)):
        raise _too_deep()
    size = len(payload_json) if payload_json.isascii() else _utf8_len(payload_json, "payload", "InvalidPayload")
    return payload_json, size


def prepare(
    request: PublishRequest, *, max_envelope_bytes: int = MAX_ENVELOPE_BYTES,
    max_attempts: int = MAX_ATTEMPTS_LIMIT,
) -> PreparedMessage:
    """Checks a request against the envelope rules and serializes it.

    The envelope's size counts the payload, the attributes and the ``backoff_seconds`` list;
    ``max_attempts`` bounds the request's own ``max_attempts`` (the queue passes its setting).
    Raises :class:`RequestRejected` with a clear error when it breaks one.
    """
    attributes = request.attributes
    attributes_json, attributes_size = _attributes_part(attributes)
    references = (request.partition_key, request.payload_ref, request.correlation_id)
    if references != _NO_TEXT or request.deduplication_key is not None:
        _text_field("partition_key", request.partition_key)
        _text_field("deduplication_key", request.deduplication_key)
        _text_field("correlation_id", request.correlation_id)
        _text_field("payload_ref", request.payload_ref, 2048)
        if request.deduplication_key is None and request.deduplication_ttl_seconds is not None:
            raise _ttl_without_key()
    elif request.deduplication_ttl_seconds is not None:
        raise _ttl_without_key()
    backoff = request.backoff_seconds
    schedule_size = _check_schedule(request) if request.not_before is not None or backoff is not None else 0
    if request.max_attempts is not None:
        _check_attempts(request.max_attempts, max_attempts)
    payload_json, size = canonical_json(request.payload)
    size += attributes_size + schedule_size
    head = _NO_REFERENCES if references == _NO_TEXT else _encode(references)
    content = f"{head}\n{attributes_json}\n{payload_json}"
    if size > max_envelope_bytes:
        raise _too_large(size, max_envelope_bytes)
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
        message_id_given=request.message_id is not None,
        priority=request.priority,
    )


def _ttl_without_key() -> RequestRejected:
    """A TTL with no key to live for: refused, or its sender would think it deduplicates."""
    return RequestRejected(
        "InvalidField", "DeduplicationTTLSeconds is given without a DeduplicationKey, and does nothing alone: "
        "give the DeduplicationKey it is the time to live of, or leave the TTL out", "deduplication_ttl_seconds")


def _too_large(size: int, max_envelope_bytes: int) -> RequestRejected:
    return RequestRejected(
        "EnvelopeTooLarge",
        f"the envelope (payload and attributes) is {size} bytes; at most {max_envelope_bytes} are "
        "allowed; store the data elsewhere and send a PayloadRef to it",
        "payload",
    )


def prepare_parts(
    payload: Any,
    attributes: dict[str, Any],
    *,
    message_id: uuid.UUID | None = None,
    deduplication_key: str | None = None,
    deduplication_ttl_seconds: float | None = None,
    delay_seconds: float | None = None,
    max_attempts: int | None = None,
    backoff_seconds: list[float] | None = None,
    max_envelope_bytes: int = MAX_ENVELOPE_BYTES,
    encoded: tuple[str, int] | None = None,
    priority: int = 0,
) -> PreparedMessage:
    """What ``prepare(PublishRequest(...))`` of these fields gives, without building the request.

    For callers whose values already meet :class:`PublishRequest`'s field constraints (a float
    ``delay_seconds`` and ``deduplication_ttl_seconds`` in range, ``max_attempts`` in range, a list
    of floats for ``backoff_seconds``): the jobs layer, once per job. The envelope rules are
    checked as :func:`prepare` checks them; raises :class:`RequestRejected`. ``encoded`` is the
    payload's canonical JSON and size when the caller has them (built from
    :func:`canonical_json`'s), and then ``payload`` is not read. ``priority`` must be 0 to 9.
    """
    attributes_json, attributes_size = _attributes_part(attributes)
    if deduplication_key is not None:
        _text_field("deduplication_key", deduplication_key)
    schedule_size = _check_backoff(backoff_seconds) if backoff_seconds is not None else 0
    payload_json, size = canonical_json(payload) if encoded is None else encoded
    size += attributes_size + schedule_size
    if size > max_envelope_bytes:
        raise _too_large(size, max_envelope_bytes)
    return PreparedMessage(
        message_id=message_id or uuid7(),
        partition_key=None,
        attributes=attributes,
        attributes_json=attributes_json,
        payload_json=payload_json,
        payload_ref=None,
        correlation_id=None,
        content_hash=hashlib.sha256(f"{_NO_REFERENCES}\n{attributes_json}\n{payload_json}".encode()).hexdigest(),
        deduplication_key=deduplication_key,
        deduplication_ttl_seconds=deduplication_ttl_seconds or DEFAULT_DEDUPLICATION_TTL_SECONDS,
        delay_seconds=delay_seconds,
        not_before=None,
        max_attempts=max_attempts,
        backoff_seconds=backoff_seconds,
        envelope_bytes=size,
        message_id_given=message_id is not None,
        priority=priority,
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


def named_as_given(results: list[PublishResult], prepared: Sequence[PreparedMessage]) -> list[PublishResult]:
    """``results`` (a store's answers to ``prepared``) with each refused one naming the MessageID its
    caller gave, and no other: one the library made for the request was never stored, and a caller
    must not keep it."""
    for index, result in enumerate(results):
        if result.status is PublishStatus.REJECTED and result.message_id is not None:
            message = prepared[index]
            results[index] = result.model_copy(
                update={"message_id": message.message_id if message.message_id_given else None})
    return results
