"""What a handler returns or raises, and what becomes of the delivery."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    import uuid

    from .envelope import PreparedMessage


@dataclass(frozen=True, slots=True)
class FollowUp:
    """Messages to publish to ``topic`` in the same transaction that completes the delivery: they
    exist if and only if the completion is written (a settle that finds its lease lost publishes
    nothing)."""

    topic: str
    messages: Sequence[PreparedMessage]


@dataclass(frozen=True, slots=True)
class Complete:
    """The work is done: the delivery becomes Completed (and ``then`` is published with it).
    ``result`` is JSON text the store keeps with the message in the same transaction (a job
    declared ``store_result=True``), read back by ``job_status`` and ``wait``."""

    then: tuple[FollowUp, ...] = ()
    result: str | None = None
    frees: tuple[tuple[str, str, uuid.UUID], ...] = ()
    """Deduplication keys, as (topic, key, the message that holds it), freed in the same transaction
    when it completes or discards the delivery (a unique job's key)."""
    kind: ClassVar[Literal["Complete"]] = "Complete"


@dataclass(frozen=True, slots=True)
class Retry:
    """Try again later: after ``delay_seconds``, or after full-jitter backoff when it is None."""

    reason: str
    delay_seconds: float | None = None
    kind: ClassVar[Literal["Retry"]] = "Retry"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """The work can never succeed: dead-letter it now, whatever attempts remain."""

    reason: str
    kind: ClassVar[Literal["DeadLetter"]] = "DeadLetter"


@dataclass(frozen=True, slots=True)
class Discard:
    """The work is no longer wanted: the delivery becomes Discarded, neither retried nor failed."""

    reason: str
    kind: ClassVar[Literal["Discard"]] = "Discard"


WorkOutcome = Complete | Retry | DeadLetter | Discard
"""The return type of a handler."""


class Outcome:
    """Builders for handler outcomes: ``return Outcome.complete()``."""

    @staticmethod
    def complete(then: Iterable[FollowUp] = (), result: str | None = None,
                 frees: tuple[tuple[str, str, uuid.UUID], ...] = ()) -> Complete:
        """The delivery is done; ``then`` is published, ``result`` (JSON text) stored and the
        deduplication keys ``frees`` names freed, in the same transaction as the completion."""
        follow_ups = tuple(then)
        return Complete(follow_ups, result, frees) if follow_ups or result is not None or frees else _COMPLETE

    @staticmethod
    def retry(reason: str, delay_seconds: float | None = None) -> Retry:
        """Retry after ``delay_seconds``, or after full-jitter backoff; dead-letters when attempts are spent."""
        return Retry(reason=reason, delay_seconds=checked_delay(delay_seconds))

    @staticmethod
    def dead_letter(reason: str) -> DeadLetter:
        """Dead-letter the delivery now."""
        return DeadLetter(reason=reason)

    @staticmethod
    def discard(reason: str) -> Discard:
        """Discard the delivery now: it ends without being retried or dead-lettered."""
        return Discard(reason=reason)


_COMPLETE = Complete()

MAX_RETRY_DELAY_SECONDS = 100 * 365 * 24 * 3600.0
"""The longest retry delay a handler may ask for (100 years, as for a publish's delay)."""


def checked_delay(delay_seconds: float | None) -> float | None:
    """A retry delay a handler asked for: None (the backoff decides), or a number of seconds from
    0 to 100 years; anything else is a ValueError that says so (NaN and infinity included)."""
    if delay_seconds is None:
        return None
    if isinstance(delay_seconds, bool) or not isinstance(delay_seconds, int | float):
        raise TypeError(f"delay_seconds must be a number of seconds or None, got {type(delay_seconds).__name__}")
    if not 0 <= delay_seconds <= MAX_RETRY_DELAY_SECONDS:  # (False for NaN)
        raise ValueError(
            f"delay_seconds must be a number of seconds from 0 to {MAX_RETRY_DELAY_SECONDS:.0f} (100 years), "
            f"got {delay_seconds}; pass None to let the backoff decide"
        )
    return float(delay_seconds)


class TransientWorkError(Exception):
    """Raise for a temporary problem (rate limit, outage): the delivery is retried with backoff."""

    def __init__(self, reason: str, delay_seconds: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.delay_seconds = checked_delay(delay_seconds)


class FatalWorkError(Exception):
    """Raise for poison input that will never succeed: the delivery is dead-lettered at once."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
