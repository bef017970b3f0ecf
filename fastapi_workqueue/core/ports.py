"""The ports of a wired queue: the transport's required roles and its optional parts, resolved once.

Every transport has the roles of :class:`.transport.Transport` (publishing, consuming,
housekeeping, operator reads and actions, the topology store, message markers). What only some
transports have is a port of its own, found when the queue is wired instead of being probed with
``hasattr`` at each use: the process registry, live work, stats history, attempt history, search,
the topology lifecycle
(retire and delete), the API key store, ending claims that wait for work (an SQS long poll), and
routing by topic. A part of the library asks :class:`Ports` for what it needs and gets ``None``
when the transport has no such part, so its answer ("this transport stores no API keys") is
decided in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .attempts import AttemptHistoryReader
from .history import StatsHistoryReader
from .keys import ApiKeyStore
from .live_work import FlowStateReader, LiveWorkReader
from .processes import ProcessRegistry
from .retirement import TopologyLifecycle
from .search import DeliverySearch
from .transport import Transport


@runtime_checkable
class ClaimInterrupter(Protocol):
    """A transport whose claims wait for work (an SQS long poll): ends those claims with what they
    have, so a consumer that stops or pauses does not wait them out."""

    def interrupt_claims(self, subscriptions: Sequence[str]) -> None: ...


@runtime_checkable
class TopicRouter(Protocol):
    """A transport made of others (a database and AWS): which one serves a topic or a subscription,
    and which is the database (None when the queue has none)."""

    default: Transport | None

    def transport_for_topic(self, topic: str) -> Transport: ...
    def transport_for_subscription(self, subscription: str) -> Transport: ...


@dataclass(frozen=True, slots=True)
class Ports:
    """The transport and its optional parts (``None``: this transport has no such part)."""

    transport: Transport
    processes: ProcessRegistry | None
    live_work: LiveWorkReader | None
    history: StatsHistoryReader | None
    attempts: AttemptHistoryReader | None
    search: DeliverySearch | None
    lifecycle: TopologyLifecycle | None
    api_keys: ApiKeyStore | None
    """Keys are the app's, not a topic's: behind a router they are the database's."""
    interrupter: ClaimInterrupter | None
    router: TopicRouter | None
    flow: FlowStateReader | None = None
    """How full the flow limits are (behind a router: the database's, where the limits hold)."""

    @classmethod
    def of(cls, transport: Transport) -> Ports:
        """Resolves the optional parts of ``transport`` (once, when the queue is wired)."""
        router = transport if isinstance(transport, TopicRouter) else None
        keys_from: object = router.default if router is not None else transport
        return cls(
            transport=transport,
            processes=transport if isinstance(transport, ProcessRegistry) else None,
            live_work=transport if isinstance(transport, LiveWorkReader) else None,
            history=transport if isinstance(transport, StatsHistoryReader) else None,
            attempts=transport if isinstance(transport, AttemptHistoryReader) else None,
            search=transport if isinstance(transport, DeliverySearch) else None,
            lifecycle=transport if isinstance(transport, TopologyLifecycle) else None,
            api_keys=keys_from if isinstance(keys_from, ApiKeyStore) else None,
            interrupter=interrupter_of(transport),
            router=router,
            flow=keys_from if isinstance(keys_from, FlowStateReader) else None,
        )

    def for_topic(self, topic: str) -> Transport:
        """The transport that stores ``topic``."""
        return self.transport if self.router is None else self.router.transport_for_topic(topic)

    def for_subscription(self, subscription: str) -> Transport:
        """The transport that serves ``subscription``."""
        return self.transport if self.router is None else self.router.transport_for_subscription(subscription)


def interrupter_of(transport: Transport) -> ClaimInterrupter | None:
    """The part of ``transport`` that ends waiting claims, if it has one."""
    return transport if isinstance(transport, ClaimInterrupter) else None
