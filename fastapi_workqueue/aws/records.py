"""What one process of the AWS transport knows of the deliveries it settled or replayed.

SQS forgets a deleted message and cannot address a waiting one by id, so ``get_delivery`` of a
delivery that is neither leased here nor on the DLQ answers from this record: the last settlement
this process made of it (Completed, Discarded, or Pending after a retry, release or replay with the
visibility it set). The record is bounded (the newest :data:`RECORDS_KEPT` are kept), holds no
payloads (a settled message's payload is gone with it) and holds what this process did only;
another process's settlements are not in it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..core.reports import DeliveryInfo

RECORDS_KEPT = 10_000
"""How many settled deliveries one process remembers (the oldest are forgotten first)."""


@dataclass(frozen=True)
class Receipt:
    """The queue and the last receipt handle of a delivery this process settled: until the message
    is received again the handle still changes its visibility (and fails once it is deleted)."""

    queue_url: str
    receipt: str


class SettledRecords:
    """The newest settlements of this process, by delivery id."""

    def __init__(self, keep: int = RECORDS_KEPT) -> None:
        self.keep = keep
        self._infos: OrderedDict[str, DeliveryInfo] = OrderedDict()
        self._receipts: dict[str, Receipt] = {}

    def remember(self, info: DeliveryInfo, receipt: Receipt | None = None) -> None:
        """Records ``info`` and the last receipt of its message."""
        self._infos.pop(info.delivery_id, None)
        self._infos[info.delivery_id] = info
        self._receipts.pop(info.delivery_id, None)
        if receipt is not None:
            self._receipts[info.delivery_id] = receipt
        while len(self._infos) > self.keep:
            gone, _ = self._infos.popitem(last=False)
            self._receipts.pop(gone, None)

    def get(self, delivery_id: str) -> DeliveryInfo | None:
        return self._infos.get(delivery_id)

    def receipt(self, delivery_id: str) -> Receipt | None:
        return self._receipts.get(delivery_id)

    def update(self, delivery_id: str, **changes: Any) -> None:
        """Changes fields of a recorded delivery (its visibility moved)."""
        info = self._infos.get(delivery_id)
        if info is not None:
            self._infos[delivery_id] = info.model_copy(update=changes)

    def forget(self, delivery_id: str) -> None:
        """Drops the record (the delivery was received again or left this process's hands)."""
        self._infos.pop(delivery_id, None)
        self._receipts.pop(delivery_id, None)
