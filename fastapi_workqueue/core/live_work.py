"""Reads of the live work that stay bounded whatever the tables hold, for pages that poll.

``stats`` counts every Pending, InFlight and DeadLettered delivery, and ``partitions`` reads every
key of a subscription: exact, and as costly as the backlog is large. :class:`LiveCounts` stops
each count at a cap, and :class:`BlockedKey` lists only the heads that block an Ordered key, found
through the indexes of dead letters and of keys waiting to be retried. A transport that offers
them implements :class:`LiveWorkReader`; the database transports do.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol, runtime_checkable

from .wire import WireModel

LIVE_COUNT_CAP = 1000
"""Where the bounded counts stop: a count equal to the cap means "this many or more"."""


class LiveCounts(WireModel):
    """A subscription's live deliveries, each count stopping at ``cap``."""

    subscription: str
    pending: int
    in_flight: int
    dead_lettered: int
    cap: int = LIVE_COUNT_CAP
    oldest_pending_at: datetime | None = None
    """Since when the longest-waiting claimable delivery waits (a time still to come: none waits
    yet; a delivery waiting out its retry backoff is not waiting to be claimed)."""
    stuck: int = 0
    """InFlight deliveries claimed before the ``stuck_before`` asked for (among the first ``cap``)."""


class BlockedKey(WireModel):
    """A key of an Ordered subscription whose head blocks it: dead-lettered, or waiting to be retried.

    ``waiting_items`` counts the deliveries behind the head, up to the cap."""

    partition_key: str
    head_delivery_id: str
    head_status: str
    head_attempt: int
    head_visible_at: datetime | None = None
    head_reason: str | None = None
    waiting_items: int


class FlowState(WireModel):
    """How full a subscription's flow limits are now, and what waits on them (docs/design/flow-control.md);
    each count stops at ``cap``."""

    subscription: str
    in_flight: int
    """InFlight deliveries whose lease runs: what ``max_in_flight`` counts."""
    tokens: float | None = None
    """The tokens of its ``rate_limit`` bucket now (None without a rate limit); below 1: nothing starts."""
    keys_at_limit: int = 0
    """Keys that may start nothing now (their ``key_concurrency`` reached, or their key bucket empty)."""
    waiting: int = 0
    """Claimable deliveries a limit holds back now: all of them while the subscription is full, else
    those of the keys at their limit."""
    cap: int = LIVE_COUNT_CAP


@runtime_checkable
class FlowStateReader(Protocol):
    """A transport that reads how full a subscription's flow limits are (the database ones, and memory)."""

    async def flow_state(self, subscription: str, *, cap: int = LIVE_COUNT_CAP) -> FlowState | None:
        """The subscription's :class:`FlowState` (None when there is no such subscription)."""
        ...


@runtime_checkable
class LiveWorkReader(Protocol):
    """A transport with the bounded reads."""

    async def live_counts(
        self, subscription: str | None = None, *, cap: int = LIVE_COUNT_CAP, stuck_before: datetime | None = None
    ) -> list[LiveCounts]:
        """Each subscription's (or one's) live counts, each stopping at ``cap``, with the oldest
        claimable delivery's wait and (given ``stuck_before``) the InFlight ones claimed before it."""
        ...

    async def blocked_keys(
        self, subscription: str, *, limit: int = 50, cap: int = LIVE_COUNT_CAP
    ) -> list[BlockedKey]:
        """The blocked keys of an Ordered subscription, oldest head first, at most ``limit``."""
        ...
