"""The delivery lifecycle's rules, written once in Python (SPEC §4): pure functions, no I/O.

- :func:`backoff_seconds`: the delay before attempt ``n``'s retry (full jitter, or the schedule a
  message was published with);
- :func:`settle_transition` and :func:`expire_transition`: what a settle or a lease expiry makes of
  an InFlight delivery (status, attempt, reason, error, when it is visible again);
- :func:`settlement_for`: what a handler's outcome or exception settles as;
- :func:`next_claimable`: which delivery of a key a claim may take, per partition mode;
- :func:`unkeyed_share` and :func:`split_claim`: how a claim on a keyed subscription shares its
  room between the keys and the deliveries without a key;
- :func:`matches` (re-exported from :mod:`.filters`): a subscription filter against attributes;
- :func:`classify_batch` and :func:`batch_refusals`: a publish call's items, all or nothing.

The SQLite routines, the aws transport and its Lambda adapter, the runtime and the in-memory
transport call these; PostgreSQL and SQL Server keep their own copies in their stored routines, and
the conformance suite holds every transport to the same results. Time is an argument, never read.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from .envelope import MAX_DELAY_SECONDS
from .failures import error_text, stored_reason
from .filters import matches
from .outcomes import Complete, DeadLetter, Discard, FatalWorkError, Retry, TransientWorkError
from .topology import PartitionMode
from .transport import SettleKind, Settlement

if TYPE_CHECKING:
    from .envelope import PreparedMessage, PublishResult

__all__ = [
    "LEASE_EXPIRED_ERROR",
    "MESSAGE_ID_CONFLICT_TEXT",
    "BackoffPolicy",
    "BatchItem",
    "ItemRefusal",
    "Keyed",
    "PartitionMode",
    "PublishVerdict",
    "SettledStatus",
    "Transition",
    "backoff_seconds",
    "batch_refusals",
    "clamp_delay",
    "classify_batch",
    "dead_letters",
    "expire_transition",
    "is_final_attempt",
    "matches",
    "next_claimable",
    "settle_transition",
    "settlement_for",
    "split_claim",
    "topic_refusal",
    "unkeyed_share",
]

SettledStatus = Literal["Pending", "Completed", "DeadLettered", "Discarded"]

LEASE_EXPIRED_ERROR = "lease expired: the holder stopped renewing it"
INVALID_OUTCOME = (
    "the handler returned {outcome!r}; return Outcome.complete(), Outcome.retry(...), "
    "Outcome.dead_letter(...) or Outcome.discard(...)"
)


# -- backoff -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """How a delivery backs off: its subscription's base and ceiling, or the fixed schedule its
    message was published with (``BackoffSeconds``; empty or None: the subscription's)."""

    base: float = 1.0
    maximum: float = 300.0
    schedule: Sequence[float] | None = None


def backoff_seconds(attempt: int, policy: BackoffPolicy, draw: float) -> float:
    """The delay before the retry of ``attempt`` (from 1; 0 counts as 1): the schedule's step for
    that attempt (its last step once the attempts outrun it), else full jitter,
    ``draw · min(maximum, base · 2^(attempt − 1))`` with ``draw`` in [0, 1); the exponent stops at
    64 (past it a float overflows, and any maximum is reached long before)."""
    n = max(attempt, 1)
    if policy.schedule:
        return float(policy.schedule[min(n, len(policy.schedule)) - 1])
    return draw * min(policy.maximum, policy.base * 2.0 ** min(n - 1, 64))


def granted_lease(asked: float | None, subscription: float) -> float:
    """The lease a claim or heartbeat grants: the one the process asks for, the subscription's as
    that process last read it (a positive, finite number of seconds), else the subscription's.
    A newer deploy may have shortened the subscription's lease since: the lease in the store must
    not run out before the one the process counts."""
    if asked is not None and 0 < asked < 1e9:
        return float(asked)
    return subscription


def clamp_delay(seconds: float, ceiling: float) -> float:
    """A delay a broker can hold: at least 0, at most ``ceiling`` (SQS: 12 hours)."""
    return min(max(seconds, 0.0), ceiling)


def settle_delay(delay: float | None) -> float | None:
    """A handler's retry delay as the stores can add it to a timestamp: at most MAX_DELAY_SECONDS
    (a longer one would fail this settle and every sweep after it); NaN means none."""
    if delay is None or math.isnan(delay):
        return None
    return min(max(delay, 0.0), MAX_DELAY_SECONDS)


# -- the settle transition -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Transition:
    """What a settle or a lease expiry makes of an InFlight delivery."""

    status: SettledStatus
    attempt: int
    reason: str | None
    last_error: str | None
    wait_seconds: float | None = None
    """Pending: how long until it is visible again; None otherwise."""
    visible_at: datetime | None = None
    """Pending: ``now + wait_seconds``; None otherwise (the delivery keeps its old value)."""

    @property
    def terminal(self) -> bool:
        """Completed, DeadLettered or Discarded: the delivery is settled (``settled_at`` is now)."""
        return self.status != "Pending"


def is_final_attempt(attempt: int, max_attempts: int) -> bool:
    """True when a failure of attempt ``attempt`` dead-letters the delivery (its tries are spent)."""
    return attempt >= max_attempts


def dead_letters(kind: SettleKind, attempt: int, max_attempts: int) -> bool:
    """True when a settle of ``kind`` dead-letters the delivery (cancel aside): a DeadLetter, or a
    Retry or Fail of its last attempt."""
    return kind == "DeadLetter" or (kind in ("Retry", "Fail") and is_final_attempt(attempt, max_attempts))


def settle_transition(
    kind: SettleKind,
    *,
    attempt: int,
    max_attempts: int,
    now: datetime,
    backoff: BackoffPolicy | Callable[[], float],
    draw: Callable[[], float] | float | None = None,
    delay: float | None = None,
    reason: str | None = None,
    error: str | None = None,
    cancel_requested: bool = False,
    current_reason: str | None = None,
    current_error: str | None = None,
) -> Transition:
    """The settle of an InFlight delivery with its current token (SPEC §4).

    A cancel-requested delivery becomes Discarded whatever the outcome, its reason kept. Complete →
    Completed; Discard → Discarded; Release → Pending after ``delay`` (0), the attempt not spent;
    DeadLetter → DeadLettered; Retry and Fail → Pending after ``delay`` or the backoff, or
    DeadLettered (``max attempts reached: <reason>``) once ``attempt`` reaches ``max_attempts``.
    ``backoff`` is the policy (``draw`` its jitter fraction, or a function giving one, drawn only
    when needed) or a function giving the delay itself."""
    if cancel_requested:
        status: SettledStatus = "Discarded"
    elif kind == "Complete":
        status = "Completed"
    elif kind == "Discard":
        status = "Discarded"
    elif kind == "Release":
        status = "Pending"
    elif dead_letters(kind, attempt, max_attempts):
        status = "DeadLettered"
    else:
        status = "Pending"
    if cancel_requested:
        new_reason = current_reason
    elif kind == "Complete":
        new_reason = None
    elif status == "DeadLettered" and kind != "DeadLetter":
        cause = reason if reason is not None else error
        new_reason = "max attempts reached" if cause is None else f"max attempts reached: {cause}"
    else:
        new_reason = reason if reason is not None else current_reason
    last_error = error if error is not None else current_error
    if status != "Pending":
        return Transition(status, attempt, new_reason, last_error)
    if kind == "Release":
        return _pending(max(attempt - 1, 0), new_reason, last_error, delay or 0.0, now)
    wait = delay if delay is not None else _backoff(attempt, backoff, draw)
    return _pending(attempt, new_reason, last_error, wait, now)


def expire_transition(
    *,
    attempt: int,
    max_attempts: int,
    now: datetime,
    backoff: BackoffPolicy,
    draw: Callable[[], float] | float | None = None,
    cancel_requested: bool = False,
    current_reason: str | None = None,
    current_error: str | None = None,
) -> Transition:
    """A lease that ran out (the sweep): a cancel-requested delivery is Discarded (its reason
    kept), the final attempt DeadLettered, any other Pending again after the backoff."""
    if cancel_requested:
        return Transition("Discarded", attempt, current_reason, current_error)
    if is_final_attempt(attempt, max_attempts):
        return Transition("DeadLettered", attempt, "lease expired on the final attempt", LEASE_EXPIRED_ERROR)
    return _pending(attempt, "lease expired", LEASE_EXPIRED_ERROR, _backoff(attempt, backoff, draw), now)


def _backoff(attempt: int, backoff: BackoffPolicy | Callable[[], float], draw: Callable[[], float] | float | None
             ) -> float:
    if not isinstance(backoff, BackoffPolicy):
        return backoff()
    if backoff.schedule:
        return backoff_seconds(attempt, backoff, 0.0)
    if draw is None:
        draw = random.random
    fraction = draw() if callable(draw) else draw
    return backoff_seconds(attempt, backoff, fraction)


def _pending(attempt: int, reason: str | None, error: str | None, wait: float, now: datetime) -> Transition:
    return Transition("Pending", attempt, reason, error, wait, now + timedelta(seconds=wait))


# -- outcome or exception → settlement -----------------------------------------------------------


INVALID_OUTCOME_REASON = "invalid outcome"
"""The reason of a Fail for a handler that returned what is no outcome."""


def settlement_for(delivery_id: str, lease_token: str, result: object) -> Settlement:
    """What a handler's answer settles as: None or ``Complete`` (its follow-ups) → Complete;
    ``Retry``, ``DeadLetter``, ``Discard`` → their kind with the reason (and delay); a
    ``FatalWorkError`` → DeadLetter, a ``TransientWorkError`` → Retry (its delay), any other
    exception → Fail (reason: its type's name), each with the error text; anything else → Fail
    (``invalid outcome``)."""
    base = (delivery_id, lease_token)
    if result is None:
        return Settlement(*base, "Complete")
    if isinstance(result, Complete):
        return Settlement(*base, "Complete", follow_ups=result.then, result_json=result.result, frees=result.frees)
    if isinstance(result, Retry):
        return Settlement(*base, "Retry", delay_seconds=result.delay_seconds, reason=stored_reason(result.reason))
    if isinstance(result, DeadLetter):
        return Settlement(*base, "DeadLetter", reason=stored_reason(result.reason))
    if isinstance(result, Discard):
        return Settlement(*base, "Discard", reason=stored_reason(result.reason))
    if isinstance(result, FatalWorkError):
        return Settlement(*base, "DeadLetter", reason=stored_reason(result.reason), error=error_text(result))
    if isinstance(result, TransientWorkError):
        return Settlement(*base, "Retry", delay_seconds=result.delay_seconds, reason=stored_reason(result.reason),
                          error=error_text(result))
    if isinstance(result, BaseException):
        return Settlement(*base, "Fail", reason=type(result).__name__, error=error_text(result))
    return Settlement(*base, "Fail", reason=INVALID_OUTCOME_REASON, error=INVALID_OUTCOME.format(outcome=result))


# -- claimability --------------------------------------------------------------------------------


K = TypeVar("K", bound="Keyed")


class Keyed(Protocol):
    """What the claim rule reads of one delivery of a key."""

    @property
    def status(self) -> str: ...

    @property
    def visible_at(self) -> datetime: ...


def next_claimable(mode: PartitionMode, deliveries: Sequence[K], now: datetime) -> K | None:
    """The delivery of one key a claim may take at ``now``; ``deliveries`` are the key's, in
    publish order (their ids'). None mode: the first visible Pending one (each is claimable on its
    own). Exclusive: none while one is InFlight, else the earliest visible Pending one (a delivery
    waiting out its backoff does not hold the key). Ordered: the head (the first Pending, InFlight
    or DeadLettered one), when it is Pending and visible; a retrying or dead-lettered head blocks
    the key."""
    if mode == "Ordered":
        for d in deliveries:
            if d.status in ("Pending", "InFlight", "DeadLettered"):
                return d if d.status == "Pending" and d.visible_at <= now else None
        return None
    if mode == "Exclusive" and any(d.status == "InFlight" for d in deliveries):
        return None
    best: K | None = None
    for d in deliveries:
        if d.status == "Pending" and d.visible_at <= now and (best is None or d.visible_at < best.visible_at):
            best = d
    return best


D = TypeVar("D")
E = TypeVar("E")


def unkeyed_share(room: int, keys: int) -> int:
    """How many deliveries without a key lock a claim of ``room`` looks for beside ``keys`` keys
    that can run (their number capped at ``room``): on a keyed subscription neither side takes
    every slot, the others keep at least half; a claim of one looks for one of each and keeps the
    first in claim order (:func:`split_claim`)."""
    return room if not keys else max(room - keys, room // 2, 1 if room == 1 else 0)


def split_claim(
    room: int, keyed: list[D], unkeyed: list[E], first_key: Callable[[D], Any], first_unkeyed: Callable[[E], Any]
) -> tuple[list[D], list[E]]:
    """The keys and the deliveries without a key that a claim of ``room`` takes, each side in claim
    order and the unkeyed side already cut to :func:`unkeyed_share`: the keys give way to it. At a
    room of one the first in claim order wins, by ``first_key`` and ``first_unkeyed`` (each side's
    ``(-priority, due time, id)``)."""
    if not keyed or len(keyed) + len(unkeyed) <= room:
        return keyed, unkeyed
    if room == 1:
        return ([], unkeyed) if first_key(keyed[0]) > first_unkeyed(unkeyed[0]) else (keyed, [])
    return keyed[: room - len(unkeyed)], unkeyed


# -- publish: every item classified before anything is written, all or nothing -------------------

PublishVerdict = Literal["Accepted", "Duplicate", "Rejected", "MessageIDConflict"]

MESSAGE_ID_CONFLICT_TEXT = (
    "a message with this MessageID and different content, or on another topic, was already published; use a new "
    "MessageID for new content"
)


@dataclass(frozen=True, slots=True)
class BatchItem:
    """What the classification of one published message reads."""

    message_id: str
    content_hash: str
    deduplication_key: str | None
    envelope_bytes: int


@dataclass(frozen=True, slots=True)
class ItemRefusal:
    """How a refused call answers one item: its status (``Rejected`` or ``MessageIDConflict``),
    error code and text."""

    status: Literal["Rejected", "MessageIDConflict"]
    code: str
    text: str


def topic_refusal(topic: str, *, exists: bool) -> tuple[str, str]:
    """The code and text of a publish to a topic that does not exist (``exists=False``) or is retired."""
    if not exists:
        return "UnknownTopic", f"topic '{topic}' does not exist; declare it in the WorkQueue topics or create it first"
    return "TopicRetired", (f"topic '{topic}' is retired and takes no new messages; publish to the topic that "
                            f"replaced it, or take it back with `workqueue topics resume {topic}`")


def repeats_stored_call(items: Sequence[BatchItem], *, topic: str,
                        stored: Callable[[str], tuple[str, str] | None]) -> bool:
    """Whether every item repeats a message stored on ``topic`` with the same content: a producer's
    retry of a call the topic took before it retired, which answers ``Duplicate`` (what it stored
    stands) instead of ``TopicRetired``."""
    return bool(items) and all(stored(item.message_id) == (topic, item.content_hash) for item in items)


def follow_up_refused(delivery_id: str, topic: str, message: PreparedMessage, answer: PublishResult) -> str:
    """Why settle_with_follow_ups rolled back: which follow-up message, and what the publish said."""
    why = answer.status.value
    if answer.error is not None:
        why += f" ({answer.error.code}: {answer.error.message})"
    return (
        f"settle with follow-ups: follow-up message {message.message_id} to topic {topic!r} was refused: {why}; "
        f"nothing was published and delivery {delivery_id} was not settled (it stays InFlight under its lease)"
    )


def classify_batch(
    items: Sequence[BatchItem], cap: int | None, *, topic: str,
    stored: Callable[[str], tuple[str, str] | None],
    live_holder: Callable[[str], str | None],
) -> list[tuple[PublishVerdict, str]]:
    """Each item's verdict and the MessageID it answers with, in order, before anything is written.

    An envelope over ``cap`` is Rejected; a MessageID seen earlier in the call or stored on
    ``topic`` with the same content is a Duplicate of it, with other content or on another topic
    a MessageIDConflict; a deduplication key held by a live message (``live_holder``), or by an
    earlier item of the call, makes a Duplicate of the holder. ``stored`` answers a stored
    message's topic and content hash (None: not stored).
    """
    verdicts: list[tuple[PublishVerdict, str]] = []
    first_by_id: dict[str, str] = {}
    first_by_key: dict[str, str] = {}
    for item in items:
        mid, key = item.message_id, item.deduplication_key
        if cap is not None and item.envelope_bytes > cap:
            verdicts.append(("Rejected", mid))
            continue
        if mid in first_by_id:
            verdicts.append(("Duplicate" if first_by_id[mid] == item.content_hash else "MessageIDConflict", mid))
            continue
        first_by_id[mid] = item.content_hash
        found = stored(mid)
        if found is not None:
            verdicts.append(("Duplicate" if found == (topic, item.content_hash) else "MessageIDConflict", mid))
            continue
        if key is not None:
            holder = live_holder(key)
            if holder is None:
                holder = first_by_key.get(key)
            if holder is not None:
                verdicts.append(("Duplicate", holder))
                continue
            first_by_key[key] = mid
        verdicts.append(("Accepted", mid))
    return verdicts


def batch_refusals(
    verdicts: Sequence[tuple[PublishVerdict, str]], items: Sequence[BatchItem], *, topic: str, cap: int | None,
) -> list[ItemRefusal] | None:
    """None when the call may be written; else how it answers every item: the refused ones with
    their own error, every other one ``BatchAborted`` naming the first refused item (from 0), as a
    publish call is all-or-nothing."""
    failed = next((i for i, (v, _) in enumerate(verdicts) if v in ("Rejected", "MessageIDConflict")), None)
    if failed is None:
        return None
    code = "EnvelopeTooLarge" if verdicts[failed][0] == "Rejected" else "MessageIDConflict"
    answers: list[ItemRefusal] = []
    for (verdict, _), item in zip(verdicts, items, strict=True):
        if verdict == "Rejected":
            answers.append(ItemRefusal("Rejected", "EnvelopeTooLarge", (
                f"the envelope is {item.envelope_bytes} bytes; topic '{topic}' accepts at most {cap} bytes "
                "(max_payload_bytes); send a PayloadRef to the data instead")))
        elif verdict == "MessageIDConflict":
            answers.append(ItemRefusal("MessageIDConflict", "MessageIDConflict", MESSAGE_ID_CONFLICT_TEXT))
        else:
            answers.append(ItemRefusal("Rejected", "BatchAborted", (
                f"not published: item {failed} of this call was refused ({code}) and a publish call is "
                "all-or-nothing")))
    return answers
