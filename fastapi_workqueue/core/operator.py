"""The operator calls of one queue, written once.

Counts, dead letters, deliveries, partitions, replay and discard, pause and resume, retiring and
deleting subscriptions and topics, the bindings check and a sweep. ``WorkQueue``'s operator
methods, the REST API, the dashboard and the metrics all call these; a change of status is
followed by a reconcile of this process's host, so it acts at once here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ConfigurationError
from .failures import storable
from .redaction import redact
from .reports import (
    ActionResult,
    Backlog,
    BindingReport,
    DeliveryInfo,
    DeliveryStatus,
    PartitionCondition,
    PartitionInfo,
    SubscriptionStats,
    SweepReport,
)
from .retirement import DISCARD_BATCH, DeleteResult, RetireResult, TopicStatus, TopicStatusChange, TopologyLifecycle
from .topology import SubscriptionStatus

if TYPE_CHECKING:
    from .kernel import Kernel
    from .ports import Ports



MAX_NOTE_LENGTH = 2000
"""The most characters of an operator's note or reason, however it is given (REST, CLI, dashboard,
Python): the dashboard's forms allow as many."""


def operator_text(text: str | None, what: str) -> str | None:
    """An operator's note or reason as the stores keep it (redacted, storable); ValueError naming
    ``what`` when it is longer than :data:`MAX_NOTE_LENGTH` characters."""
    if text is None:
        return None
    if len(text) > MAX_NOTE_LENGTH:
        raise ValueError(f"{what} is {len(text)} characters; at most {MAX_NOTE_LENGTH} are allowed")
    return storable(redact(text))

class Operator:
    """What an operator reads and does, on the kernel's transport (see the module's docstring)."""

    def __init__(self, kernel: Kernel) -> None:
        self._kernel = kernel

    async def _reconcile(self) -> None:
        """Lets this process's host see a change of status now instead of at its next reconcile."""
        host = self._kernel.host
        if host is not None:
            await host.reconcile()

    # -- reads ----------------------------------------------------------------------------------

    async def stats(self, subscription: str | None = None) -> list[SubscriptionStats]:
        """Counts by state of every subscription, or of ``subscription``."""
        return await self._kernel.transport.stats(subscription)

    async def backlog(self, subscription: str) -> Backlog | None:
        """Claimable Pending plus InFlight as a scaler sees it; None when it does not exist."""
        return await self._kernel.transport.backlog(subscription)

    async def dead_letters(
        self, subscription: str, *, limit: int = 100, after: str | None = None, include_payload: bool = False
    ) -> list[DeliveryInfo]:
        """The dead letters of ``subscription``, ``limit`` at a time after the delivery id ``after``."""
        return await self._kernel.transport.list_deliveries(
            subscription, "DeadLettered", limit=limit, after=after, include_payload=include_payload
        )

    async def deliveries(
        self, subscription: str, status: DeliveryStatus, *, limit: int = 100, after: str | None = None,
        include_payload: bool = False,
    ) -> list[DeliveryInfo]:
        """The deliveries of ``subscription`` in ``status``, paged as :meth:`dead_letters`."""
        return await self._kernel.transport.list_deliveries(
            subscription, status, limit=limit, after=after, include_payload=include_payload
        )

    async def get_delivery(self, delivery_id: str, *, include_payload: bool = False) -> DeliveryInfo | None:
        """One delivery whole, or None."""
        return await self._kernel.transport.get_delivery(delivery_id, include_payload=include_payload)

    async def partitions(
        self, subscription: str, condition: PartitionCondition | None = None, *, limit: int = 100
    ) -> list[PartitionInfo]:
        """The partition keys of ``subscription`` with live work (``condition`` keeps some)."""
        return await self._kernel.transport.partitions(subscription, condition, limit=limit)

    async def validate_bindings(self) -> BindingReport:
        """Checks the store: schema version, capabilities, what the transport leaves out."""
        return await self._kernel.transport.validate_bindings()

    # -- actions --------------------------------------------------------------------------------

    async def sweep(self, limit: int = 1000) -> SweepReport:
        """One sweeper pass now (lease expiry and retention); the leases it took back are told to
        the kernel's listeners, as a host's pass tells them."""
        report = await self._kernel.transport.sweep(limit)
        self._kernel.leases_taken_back(report.taken_back)
        return report

    async def replay(self, subscription: str, delivery_id: str, note: str | None = None) -> ActionResult:
        """DeadLettered → Pending, same MessageID and Ordered position, attempts reset."""
        return await self._kernel.transport.replay(subscription, delivery_id, operator_text(note, "the note"))

    async def discard(self, subscription: str, delivery_id: str, reason: str | None = None) -> ActionResult:
        """Pending/DeadLettered → Discarded; InFlight → cancel requested."""
        return await self._kernel.transport.discard(subscription, delivery_id, operator_text(reason, "the reason"))

    async def set_status(self, subscription: str, status: SubscriptionStatus) -> bool | None:
        """Pauses or resumes a subscription (None when it does not exist)."""
        changed = await self._kernel.transport.set_subscription_status(subscription, status)
        if changed:
            await self._reconcile()
        return changed

    async def pause(self, subscription: str) -> bool | None:
        """Stops claiming on ``subscription``; True when it changed, None when it does not exist."""
        return await self.set_status(subscription, "Paused")

    async def resume(self, subscription: str) -> bool | None:
        """Claims on ``subscription`` again (after a pause or a retire); answers as :meth:`pause`."""
        return await self.set_status(subscription, "Active")

    async def retire(self, subscription: str, *, discard_pending: bool = False,
                     reason: str | None = None) -> RetireResult:
        """Retires a subscription (``WorkQueue.retire``); ConfigurationError when it does not exist."""
        operator_text(reason, "the reason")
        store = _lifecycle_of(self._kernel.ports.ports_for_subscription(subscription), f"subscription {subscription!r}")
        result = await store.retire_subscription(subscription)
        if result is None:
            raise ConfigurationError(f"subscription {subscription!r} does not exist; `workqueue subscriptions list` "
                                     "shows the stored ones")
        if discard_pending:
            why = operator_text(reason, "the reason") or "discarded when the subscription was retired"
            discarded = 0
            while True:
                count = await store.discard_pending(subscription, why, DISCARD_BATCH)
                discarded += count
                if count < DISCARD_BATCH:
                    break
            result = result.model_copy(update={"discarded": discarded})
        await self._reconcile()
        return result

    async def delete_subscription(self, subscription: str) -> DeleteResult:
        """Deletes a retired subscription that holds nothing live; otherwise answers why not."""
        store = _lifecycle_of(self._kernel.ports.ports_for_subscription(subscription), f"subscription {subscription!r}")
        return await store.delete_subscription(subscription)

    async def set_topic_status(self, topic: str, status: TopicStatus) -> TopicStatusChange:
        """Retires, pauses or takes back a topic; ConfigurationError when it does not exist."""
        store = _lifecycle_of(self._kernel.ports.ports_for_topic(topic), f"topic {topic!r}")
        change = await store.set_topic_status(topic, status)
        if change is None:
            raise ConfigurationError(f"topic {topic!r} does not exist; `workqueue topics list` shows the stored ones")
        await self._reconcile()
        return change

    async def delete_topic(self, topic: str) -> DeleteResult:
        """Deletes a retired topic that no subscription names any more; otherwise answers why not."""
        store = _lifecycle_of(self._kernel.ports.ports_for_topic(topic), f"topic {topic!r}")
        return await store.delete_topic(topic)


def _lifecycle_of(ports: Ports, what: str) -> TopologyLifecycle:
    """The store that retires and deletes ``what`` (database transports do)."""
    if ports.lifecycle is not None:
        return ports.lifecycle
    raise ConfigurationError(
        f"{what} lives on the {ports.transport.name} transport, which cannot retire or delete it here; remove it "
        "from the exported manifest and the infrastructure instead"
    )
