"""Flow control decided at claim time, written once in Python: rates, token buckets, and which
claimable deliveries a claim under a subscription's limits may take (docs/design/flow-control.md).

- :func:`parse_rate`: ``"50/s"``, ``"10/m"``, ``"3/h"`` as a :class:`Rate` (checked, with a clear error);
- :func:`refill`: a token bucket's tokens at a moment (it holds one second of tokens, at least one);
- :func:`take_limited`: the claim under ``max_in_flight``, ``key_concurrency`` and the key buckets.

The SQLite routines and the in-memory transport call these; PostgreSQL and SQL Server keep their
own copies in their claim routines, and the conformance suite holds every transport to the same
results. Pure functions: time is an argument, never read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

__all__ = [
    "RATE_UNITS",
    "HeldBackLimit",
    "Rate",
    "key_rooms",
    "parse_rate",
    "refill",
    "take_limited",
    "tokens_due_in",
]

HeldBackLimit = Literal["MaxInFlight", "KeyConcurrency", "RateLimit", "KeyRateLimit"]
"""The limit that kept claimable work back: which of the subscription's flow limits."""

RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
"""The periods a rate may be given per: a second, a minute, an hour."""

_RATE = re.compile(r"^([1-9][0-9]{0,8})/([smh])$")
MAX_RATE_COUNT = 999_999_999
"""The largest N of a rate (nine digits, as the store's CHECK allows)."""

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Rate:
    """``count`` per ``period`` seconds: a token bucket refilled at ``per_second`` that holds at
    most ``burst`` tokens (one second of them, at least one)."""

    count: int
    period: float

    @property
    def per_second(self) -> float:
        return self.count / self.period

    @property
    def burst(self) -> float:
        """The most tokens the bucket holds: what may start at once after a quiet spell."""
        return max(1.0, self.per_second)

    def __str__(self) -> str:
        unit = next(u for u, seconds in RATE_UNITS.items() if seconds == self.period)
        return f"{self.count}/{unit}"


def parse_rate(text: str, field: str = "rate_limit") -> Rate:
    """``"N/s"``, ``"N/m"`` or ``"N/h"`` with a whole N from 1 (spaces around the parts are
    ignored); raises ValueError naming ``field`` and saying what to write otherwise."""
    cleaned = re.sub(r"\s+", "", text) if isinstance(text, str) else text
    match = _RATE.match(cleaned) if isinstance(cleaned, str) else None
    if match is None:
        raise ValueError(
            f"{field} {text!r} is not a rate: write N/s, N/m or N/h with a whole number N from 1 to "
            f"{MAX_RATE_COUNT:,}, e.g. '50/s' (50 a second) or '10/m' (10 a minute)"
        )
    return Rate(int(match.group(1)), RATE_UNITS[match.group(2)])


def refill(tokens: float | None, updated_at: float | None, now: float, rate: Rate) -> float:
    """A bucket's tokens at ``now`` (seconds): what it held at ``updated_at`` plus what the rate
    added since, at most :attr:`Rate.burst`. A bucket never written (None) is full."""
    if tokens is None or updated_at is None:
        return rate.burst
    return min(rate.burst, tokens + max(0.0, now - updated_at) * rate.per_second)


def tokens_due_in(tokens: float, rate: Rate) -> float:
    """Seconds until a bucket holding ``tokens`` has a whole one (0 when it has one now)."""
    return max(0.0, (1.0 - tokens) / rate.per_second)


def take_limited(
    candidates: Sequence[T],
    room: int,
    key_of: Callable[[T], K | None],
    key_room: Callable[[K], float],
) -> list[T]:
    """The claim under limits: ``candidates`` in claim order (the highest priority first, then the
    earliest due), up to ``room`` of them, at most ``floor(key_room(key))`` of each partition key
    (its ``key_concurrency`` less what it has in flight, and the whole tokens of its bucket). A
    delivery without a key is limited by ``room`` only."""
    taken: list[T] = []
    per_key: dict[K, int] = {}
    rooms: dict[K, float] = {}
    for candidate in candidates:
        if len(taken) >= room:
            break
        key = key_of(candidate)
        if key is not None:
            if key not in rooms:
                spare = key_room(key)
                rooms[key] = spare if math.isinf(spare) else max(0, math.floor(spare))
            if per_key.get(key, 0) >= rooms[key]:
                continue
            per_key[key] = per_key.get(key, 0) + 1
        taken.append(candidate)
    return taken


def key_rooms(
    concurrency: int | None, in_flight: Mapping[K, int]
) -> Callable[[K], float]:
    """A key's room under ``key_concurrency`` (unlimited when None) with ``in_flight`` of each key
    running now."""
    if concurrency is None:
        return lambda key: math.inf
    return lambda key: concurrency - in_flight.get(key, 0)
