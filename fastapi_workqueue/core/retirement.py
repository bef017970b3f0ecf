"""Retiring, deleting and renaming subscriptions and topics: the store's side of their lifecycle.

A subscription removed from the code is not removed from the store by itself: deploys roll, and an
instance that still declares it keeps running it. An operator retires it once no code needs it:

* **retire** (``queue.retire(name)``, ``workqueue subscriptions retire``): publish gives it no new
  delivery from then on; what it holds still drains (a process with its handler keeps claiming),
  or is discarded at once with ``discard_pending=True``. Its counts stay readable; listings show
  it ``Retired``; ``resume`` takes it back. A paused subscription that is retired is paused no
  more (it drains), and a retired one cannot be paused (:class:`~.errors.ActionRefused`).
* **delete** (``workqueue subscriptions delete``, admin): removes a retired subscription once
  nothing is Pending, InFlight or DeadLettered, and refuses with the count otherwise.

Topics alike: a retired topic refuses new messages (``TopicRetired``) while its subscriptions
drain, and is deleted once no subscription names it.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

from .wire import WireModel

TopicStatus = Literal["Active", "Paused", "Retired"]
DeleteOutcome = Literal["Deleted", "NotFound", "NotRetired", "HasDeliveries", "HasSubscriptions"]
DISCARD_BATCH = 1000
"""Pending deliveries discarded per transaction when a retire discards them."""


def retired_not_paused(subscription: str) -> str:
    """Why a retired subscription is not paused (the store refuses it)."""
    return (
        f"subscription {subscription!r} is retired and cannot be paused: it takes no new deliveries and drains what "
        "it holds, and as Paused it would seem to accrue them; to stop the drain, discard what it holds "
        f"(`workqueue subscriptions retire {subscription} --discard-pending`), or take it back first "
        f"(`workqueue resume --subscription {subscription}`) and then pause it"
    )


class RetireResult(WireModel):
    """The answer to a retire: ``changed`` is False when it was retired already; ``discarded``
    counts the Pending deliveries discarded with it (``discard_pending=True``)."""

    subscription: str
    status: Literal["Retired"] = "Retired"
    changed: bool
    discarded: int = 0


class TopicStatusChange(WireModel):
    """The answer to retiring, pausing or taking back a topic."""

    topic: str
    status: TopicStatus
    changed: bool


class DeleteResult(WireModel):
    """The answer to a delete: ``Deleted``, or why not (``remaining``: what is still left)."""

    name: str
    result: DeleteOutcome
    remaining: int = 0

    @property
    def ok(self) -> bool:
        """True when it was deleted."""
        return self.result == "Deleted"


@runtime_checkable
class TopologyLifecycle(Protocol):
    """A store whose subscriptions and topics can be retired and deleted (database transports)."""

    async def retire_subscription(self, name: str) -> RetireResult | None:
        """Retires ``name`` (None when it does not exist)."""
        ...

    async def discard_pending(self, name: str, reason: str | None, limit: int) -> int:
        """Discards up to ``limit`` Pending deliveries of ``name`` with ``reason``; how many."""
        ...

    async def delete_subscription(self, name: str) -> DeleteResult:
        """Deletes ``name`` when it is retired and holds nothing live."""
        ...

    async def set_topic_status(self, name: str, status: TopicStatus) -> TopicStatusChange | None:
        """Retires, pauses or takes back topic ``name`` (None when it does not exist)."""
        ...

    async def delete_topic(self, name: str) -> DeleteResult:
        """Deletes topic ``name`` when it is retired and no subscription names it."""
        ...
