"""Finding deliveries by what an operator has at hand: a delivery id, a MessageID, a partition
key, a correlation ID or a job name. Every branch reads an index and a bounded number of rows (the
partial search indexes of the message table serve the last three). A transport that can search
implements :class:`DeliverySearch`; the database transports do."""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

from .reports import DeliveryInfo
from .wire import WireModel

SEARCH_LIMIT = 100
"""The most deliveries one search answers."""

Matched = Literal["delivery id", "MessageID", "partition key", "correlation ID", "job"]


class FoundDelivery(WireModel):
    """A delivery a search found, and what of it matched the query."""

    matched: Matched
    delivery: DeliveryInfo


@runtime_checkable
class DeliverySearch(Protocol):
    """A transport that finds deliveries."""

    async def search_deliveries(self, query: str, *, limit: int = 25) -> list[FoundDelivery]:
        """The deliveries whose id, MessageID, partition key, correlation ID or job name is
        ``query`` (exactly), newest first, at most ``limit`` (at most :data:`SEARCH_LIMIT`)."""
        ...
