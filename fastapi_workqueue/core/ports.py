"""The ports of a wired queue: the transport's required roles and its optional parts, resolved once.

Every transport has the roles of :class:`.transport.Transport` (publishing, consuming,
housekeeping, operator reads and actions, the topology store, message markers). What only some
transports have is a port of its own, found when the queue is wired instead of being probed with
``hasattr`` at each use: the process registry, live work, stats history, attempt history, search,
the topology lifecycle (retire and delete), the API key store, the message state (stored
results), ending claims that wait for work (an SQS long poll), and routing by topic. A part of the
library asks :class:`Ports` for what it needs and gets ``None`` when the transport has no such
part, so its answer ("this transport stores no API keys") is decided in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .attempts import AttemptHistoryReader
from .clock import StoreClock
from .history import StatsHistoryReader
from .keys import ApiKeyStore
from .live_work import FlowStateReader, LiveWorkReader
from .message_state import EndWatcher, MessageState
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
    def ports_for_topic(self, topic: str) -> Ports: ...
    def ports_for_subscription(self, subscription: str) -> Ports: ...
    def ports_for_delivery(self, delivery_id: str) -> Ports: ...


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
    state: MessageState | None = None
    """Stored results (the jobs layer's status and ``wait``): behind a router, the database's."""
    ends: EndWatcher | None = None
    """Announces the end of a watched delivery (``wait`` without polling): behind a router, the database's."""
    flow: FlowStateReader | None = None
    """How full the flow limits are (behind a router: the database's, where the limits hold)."""
    clock: StoreClock | None = None
    """The store's time (behind a router: the database's, whose stamps the reports carry)."""

    @classmethod
    def of(cls, transport: Transport) -> Ports:
        """Resolves the optional parts of ``transport`` (once, when the queue is wired)."""
        router = transport if isinstance(transport, TopicRouter) else None
        database = database_of(transport)
        return cls(
            transport=transport,
            processes=transport if isinstance(transport, ProcessRegistry) else None,
            live_work=transport if isinstance(transport, LiveWorkReader) else None,
            history=transport if isinstance(transport, StatsHistoryReader) else None,
            attempts=transport if isinstance(transport, AttemptHistoryReader) else None,
            # Behind a router, the router's: the database's search, and a delivery on a broker by its id.
            search=_searcher(transport, router, database),
            lifecycle=transport if isinstance(transport, TopologyLifecycle) else None,
            api_keys=api_key_store_of(transport),
            interrupter=interrupter_of(transport),
            router=router,
            state=database if isinstance(database, MessageState) else None,
            ends=database if isinstance(database, EndWatcher) else None,
            flow=database if isinstance(database, FlowStateReader) else None,
            clock=database if isinstance(database, StoreClock) else None,
        )

    def for_topic(self, topic: str) -> Transport:
        """The transport that stores ``topic``."""
        return self.transport if self.router is None else self.router.transport_for_topic(topic)

    def for_subscription(self, subscription: str) -> Transport:
        """The transport that serves ``subscription``."""
        return self.transport if self.router is None else self.router.transport_for_subscription(subscription)

    def ports_for_topic(self, topic: str) -> Ports:
        """The ports of the transport that stores ``topic`` (resolved once, by the router)."""
        return self if self.router is None else self.router.ports_for_topic(topic)

    def ports_for_subscription(self, subscription: str) -> Ports:
        """The ports of the transport that serves ``subscription`` (resolved once, by the router)."""
        return self if self.router is None else self.router.ports_for_subscription(subscription)

    def ports_for_delivery(self, delivery_id: str) -> Ports:
        """The ports of the transport that holds ``delivery_id`` (its attempts: ``.attempts``)."""
        return self if self.router is None else self.router.ports_for_delivery(delivery_id)


def database_of(store: object) -> object:
    """``store`` itself, or behind a router its database (where keys, results and limits live)."""
    return store.default if isinstance(store, TopicRouter) else store


def api_key_store_of(store: object) -> ApiKeyStore | None:
    """Where the API keys of ``store`` live: ``store`` itself when it keeps them, behind a router
    its database; None when neither keeps keys."""
    keys_from = database_of(store)
    return keys_from if isinstance(keys_from, ApiKeyStore) else None


@runtime_checkable
class StoredAtUrl(Protocol):
    """A transport that stores in the database its ``url`` names (the database transports)."""

    url: str


def _searcher(transport: Transport, router: object, database: object) -> DeliverySearch | None:
    """What searches deliveries: the transport; behind a router, the router when its database
    searches (the database's search, and a delivery on a broker found by its id)."""
    if router is None:
        return transport if isinstance(transport, DeliverySearch) else None
    return router if isinstance(router, DeliverySearch) and isinstance(database, DeliverySearch) else None


def database_url_of(transport: object) -> str | None:
    """The URL of the database ``transport`` stores in (behind a router, its database's), or None."""
    store = database_of(transport)
    return store.url if isinstance(store, StoredAtUrl) and isinstance(store.url, str) else None


def interrupter_of(transport: Transport) -> ClaimInterrupter | None:
    """The part of ``transport`` that ends waiting claims, if it has one."""
    return transport if isinstance(transport, ClaimInterrupter) else None
