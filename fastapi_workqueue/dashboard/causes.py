"""Dead letters grouped by cause: the same failure on many messages is one row to act on.

A cause is the subscription's dead letters whose error fingerprints alike: the exception's type
and last line (or the reason, without an error), with what varies from message to message taken
out (numbers, UUIDs, long hexadecimal ids). The groups come from a bounded read of the dead
letters, oldest first, through their index (the same rows as the page's first page of dead
letters): a subscription with more shows the causes of the oldest :data:`SCAN` and says so; acting
on a cause takes those, and the next oldest group up on the next view.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from ..core.reports import DeliveryInfo
from ..web.operator_view import shown_all

if TYPE_CHECKING:
    from ..core.kernel import Kernel

SCAN = 200
"""Dead letters read to group them, oldest first: the subscription page's first page of them."""

_UUID = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
_HEX = re.compile(r"\b(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*[0-9])[0-9a-fA-F]{8,}\b")
_NUMBER = re.compile(r"\b\d+(?:\.\d+)?\b")


def last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def fingerprint(info: DeliveryInfo) -> str:
    """What a dead letter failed with, without what varies between messages."""
    line = last_line(info.last_error) or (info.reason or "no reason recorded")
    line = _UUID.sub("<uuid>", line)
    line = _HEX.sub("<id>", line)
    return _NUMBER.sub("<n>", line)


def cause_key(cause: str) -> str:
    """A short, URL-safe name of a cause (for the forms that act on its group)."""
    return hashlib.sha256(cause.encode()).hexdigest()[:16]


@dataclass
class Cause:
    """The dead letters of one subscription that failed alike."""

    key: str
    cause: str
    sample: DeliveryInfo
    count: int = 0
    first_seen: datetime | None = None
    last_seen: datetime | None = None
    delivery_ids: list[str] = field(default_factory=list)

    def add(self, info: DeliveryInfo) -> None:
        self.count += 1
        self.delivery_ids.append(info.delivery_id)
        seen = info.settled_at
        if seen is not None:
            self.first_seen = seen if self.first_seen is None else min(self.first_seen, seen)
            self.last_seen = seen if self.last_seen is None else max(self.last_seen, seen)


@dataclass
class Causes:
    groups: list[Cause]
    scanned: int
    complete: bool
    """False when the subscription holds more dead letters than were read."""


def group_causes(dead_letters: list[DeliveryInfo], *, complete: bool) -> Causes:
    """Dead letters (already redacted) grouped by cause, the largest group first."""
    groups: dict[str, Cause] = {}
    for info in dead_letters:
        cause = fingerprint(info)
        group = groups.get(cause)
        if group is None:
            group = groups[cause] = Cause(key=cause_key(cause), cause=cause, sample=info)
        group.add(info)
    return Causes(groups=sorted(groups.values(), key=lambda g: (-g.count, g.cause)), scanned=len(dead_letters),
                  complete=complete)


async def dead_letter_causes(kernel: Kernel, subscription: str, *, scan: int = SCAN) -> Causes:
    """The subscription's oldest ``scan`` dead letters grouped by cause, the largest group first."""
    batch = shown_all(await kernel.operator.dead_letters(subscription, limit=scan + 1))  # redacted
    return group_causes(batch[:scan], complete=len(batch) <= scan)
