"""How many deliveries a worker may still claim (``workqueue work --once`` and ``--max``), shared by
every consumer of its host: the budget bounds the deliveries the worker receives, not each
subscription's."""

from __future__ import annotations

import asyncio


class DeliveryBudget:
    """``total`` deliveries to claim, among consumers that claim at once.

    A consumer reserves what it asks a claim for and settles the reservation with what the claim
    brought, so that consumers claiming at the same time never take more than the budget
    together, and what one claim did not use is there for the others.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.claimed = 0
        self._reserved = 0
        self._wakes: list[asyncio.Event] = []
        self._waiting: list[asyncio.Event] = []

    @property
    def remaining(self) -> int:
        """Deliveries still to claim; 0: the budget is spent."""
        return self.total - self.claimed

    @property
    def available(self) -> int:
        """What a claim may ask for now (the remaining less what claims under way reserved)."""
        return self.total - self.claimed - self._reserved

    def watch(self, wake: asyncio.Event) -> None:
        """Sets ``wake`` (a consumer's) when the budget is spent, so an idle consumer ends at once."""
        self._wakes.append(wake)

    def wake_when_settled(self, wake: asyncio.Event) -> None:
        """Sets ``wake`` when the next claim under way settles (its unused reservation may be room)."""
        self._waiting.append(wake)

    def reserve(self, wanted: int) -> int:
        """Reserves up to ``wanted`` for a claim; answers how many."""
        taken = max(0, min(wanted, self.available))
        self._reserved += taken
        return taken

    def settle(self, reserved: int, got: int) -> None:
        """A claim that reserved ``reserved`` brought ``got`` deliveries."""
        self._reserved -= reserved
        self.claimed += got
        waiting, self._waiting = self._waiting, []
        for wake in (self._wakes if self.remaining <= 0 else waiting):
            wake.set()
