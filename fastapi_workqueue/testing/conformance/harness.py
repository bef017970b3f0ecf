"""What the conformance suite needs from a transport beyond the Transport contract.

Each transport under test provides a :class:`Harness`: the transport itself, a way to open a
caller's transaction (C08), a way to hold the sweep lock (C32) and a way to let time pass
(:meth:`Harness.advance`, :meth:`Harness.expire_lease`), so that a case about a lease or a delay
does not sleep until it passes. A database harness moves the clock its transport reads (every
delivery ages with it); a broker's moves one delivery's visibility. :class:`ClockHarness` is the
harness of any transport that reads a clock it is given (:func:`memory_harness` builds one for the
in-memory transport).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import pytest

from ...core.clock import ManualClock
from ...core.envelope import PublishRequest, PublishResult, prepare
from ...core.topology import Subscription, Topic
from ...core.transport import ClaimedDelivery, HeartbeatRequest, Settlement, SettleResult, Transport


class Harness(Protocol):
    """What the conformance cases drive a transport through: the transport, a caller's session
    and the sweep lock where it has them, and time made to pass. :class:`ClockHarness` is one for
    every transport that reads a :class:`~fastapi_workqueue.core.clock.ManualClock`."""

    name: str

    @property
    def transport(self) -> Transport:
        """The transport under test (read-only here, so a harness may hold a narrower type)."""
        ...

    def session(self) -> AbstractAsyncContextManager[Any]:
        """An AsyncSession on the transport's database with an open transaction."""
        ...

    def hold_sweep_lock(self) -> AbstractAsyncContextManager[None]:
        """Holds the sweep lock as another process's pass would."""
        ...

    async def advance(self, delivery_id: str, seconds: float) -> None:
        """Lets ``seconds`` pass, at least for this delivery: a database harness moves the clock
        its transport reads (claims, heartbeats, settles and sweeps run at its time, and every
        delivery ages with it, as in real time); a broker's harness moves the delivery's lease or
        visibility. Publishes keep the store's own time: a case that publishes with ``not_before``
        after time has passed counts from :func:`harness_now`."""
        ...

    async def expire_lease(self, delivery_id: str) -> None:
        """Lets the InFlight delivery's lease run out: :meth:`advance` one second past its deadline."""
        ...

    async def advance_deduplication(self, topic: str, key: str, seconds: float) -> None:
        """Lets ``seconds`` pass for one deduplication key of a topic: its stored expiry moves that
        far into the past, as waiting out its TTL would."""
        ...


def harness_now(harness: Harness) -> datetime:
    """The time the transport's rules run at: its clock's where it reads one, the real time else."""
    clock = getattr(harness.transport, "clock", None)
    return clock.now() if clock is not None else datetime.now(UTC)


async def age(harness: Harness, delivery_ids: Sequence[str], seconds: float) -> None:
    """Lets ``seconds`` pass for each of these deliveries: once where the harness moves a clock
    (``moves_clock``: every delivery ages with it), delivery by delivery otherwise."""
    for delivery_id in delivery_ids[:1] if getattr(harness, "moves_clock", False) else delivery_ids:
        await harness.advance(delivery_id, seconds)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@dataclass
class World:
    """A topic with its subscriptions, named so no other test sees them."""

    transport: Transport
    topic: str
    subs: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, role: str) -> str:
        return self.subs[role]

    async def publish(self, *requests: PublishRequest | dict[str, Any], session: Any = None) -> list[PublishResult]:
        items = [r if isinstance(r, PublishRequest) else PublishRequest(**r) for r in requests]
        return await self.transport.publish(self.topic, [prepare(r) for r in items], session=session)

    async def publish_one(self, **fields: Any) -> PublishResult:
        [result] = await self.publish(PublishRequest(**fields))
        assert result.status.value in ("Accepted", "Duplicate"), result
        return result

    async def claim(self, role: str, limit: int = 10) -> list[ClaimedDelivery]:
        return await self.transport.claim(self.subs[role], limit)

    async def claim_one(self, role: str) -> ClaimedDelivery:
        claimed = await self.claim(role, 1)
        assert len(claimed) == 1, f"expected one claimable delivery on {role}, got {len(claimed)}"
        return claimed[0]

    async def settle(self, delivery: ClaimedDelivery, kind: str = "Complete", **extra: Any) -> SettleResult:
        [result] = await self.transport.settle([Settlement(delivery.delivery_id, delivery.lease_token, kind, **extra)])  # type: ignore[arg-type]
        return result

    async def drain(self, role: str, *, kind: str = "Complete") -> list[ClaimedDelivery]:
        """Claims and settles one at a time until nothing is claimable; returns them in order."""
        done: list[ClaimedDelivery] = []
        while True:
            claimed = await self.claim(role, 1)
            if not claimed:
                return done
            await self.settle(claimed[0], kind)
            done.append(claimed[0])

    async def status(self, delivery_id: str) -> str:
        info = await self.transport.get_delivery(delivery_id)
        assert info is not None
        return info.status


async def cancel_refused(harness: Harness, world: World, role: str, delivery: ClaimedDelivery, reason: str) -> bool:
    """Asks to discard an in-flight delivery. On a transport without cancel (``capabilities.cancel``
    False: SQS) checks the aws behaviour instead and answers True: the discard is refused as
    ``Unsupported`` with the reason, the delivery stays InFlight under its lease, and its next
    heartbeat is alive and not cancelled. False where the transport cancels (the case goes on)."""
    if harness.transport.capabilities.cancel:
        return False
    refused = await harness.transport.discard(world[role], delivery.delivery_id, reason)
    assert refused.result == "Unsupported" and not refused.cancel_requested and refused.reason, refused
    assert not refused.ok
    assert await world.status(delivery.delivery_id) == "InFlight"
    [beat] = await harness.transport.heartbeat([HeartbeatRequest(delivery.delivery_id, delivery.lease_token)])
    assert beat.alive and not beat.cancel_requested
    return True


def require(harness: Harness, capability: str, what: str) -> None:
    """Skips the case, saying why, when the transport lacks ``capability`` (a :class:`Capabilities` flag)."""
    if not getattr(harness.transport.capabilities, capability):
        pytest.skip(f"{harness.name}: {what} needs capability {capability}, which the transport does not have")


async def make_world(transport: Transport, subscriptions: Sequence[dict[str, Any]], **topic: Any) -> World:
    """Creates a topic and subscriptions; each dict has a ``role`` plus Subscription fields. A
    partition mode the transport's capabilities lack skips the case, saying why."""
    for spec in subscriptions:
        mode = spec.get("partition_mode", "None")
        if mode != "None" and not getattr(transport.capabilities, mode.lower()):
            pytest.skip(f"{transport.name}: partition mode {mode} needs capability {mode.lower()}, "
                        "which the transport does not have")
    world = World(transport=transport, topic=unique("topic"))
    subs = []
    for spec in subscriptions:
        spec = dict(spec)
        role = spec.pop("role")
        name = unique(role)
        world.subs[role] = name
        subs.append(Subscription(name=name, topic=world.topic, handler_key=spec.pop("handler_key", "test"), **spec))
    await transport.sync_topology([Topic(name=world.topic, **topic)], subs)
    return world


@dataclass
class ClockHarness:
    """The harness of a transport that reads the clock it was given (``clock=``): time passes by
    moving that clock, for every delivery and deduplication key at once. A transport without a
    caller's transaction (``transactional_publish`` False) or a sweep lock skips the cases that
    need them; a transport with ``hold_sweep_lock()`` lends it to C32."""

    transport: Transport
    clock: ManualClock
    name: str = "transport"
    moves_clock = True

    def session(self) -> AbstractAsyncContextManager[Any]:
        """Skips the case: this harness has no caller's database transaction."""
        return _skipping(f"{self.name}: no caller's database transaction (capability transactional_publish)")

    def hold_sweep_lock(self) -> AbstractAsyncContextManager[None]:
        """The transport's own ``hold_sweep_lock()``, or a skip of the case without one."""
        hold = getattr(self.transport, "hold_sweep_lock", None)
        if hold is None:
            return _skipping(f"{self.name}: the transport lends no sweep lock (hold_sweep_lock())")
        lock: AbstractAsyncContextManager[None] = hold()
        return lock

    async def advance(self, delivery_id: str, seconds: float) -> None:
        """Moves the clock ``seconds`` on (every delivery ages with it)."""
        assert await self.transport.get_delivery(delivery_id) is not None, f"no delivery {delivery_id}"
        self.clock.advance(seconds)

    async def expire_lease(self, delivery_id: str) -> None:
        """Moves the clock one second past the InFlight delivery's lease."""
        info = await self.transport.get_delivery(delivery_id)
        assert info is not None and info.status == "InFlight" and info.lease_expires_at is not None, info
        await self.advance(delivery_id, max((info.lease_expires_at - self.clock.now()).total_seconds(), 0.0) + 1.0)

    async def advance_deduplication(self, topic: str, key: str, seconds: float) -> None:
        """The clock moves every key on (the transport's publish reads the same clock)."""
        self.clock.advance(seconds)


@contextlib.asynccontextmanager
async def _skipping(reason: str) -> AsyncIterator[Any]:
    pytest.skip(reason)
    yield None  # pragma: no cover


@contextlib.asynccontextmanager
async def memory_harness() -> AsyncIterator[ClockHarness]:
    """A :class:`ClockHarness` on a fresh :class:`~fastapi_workqueue.testing.MemoryTransport`."""
    from ...core.memory import MemoryTransport

    clock = ManualClock()
    transport = MemoryTransport(f"memory://conformance-{uuid.uuid4().hex}", clock=clock)
    await transport.open()
    try:
        yield ClockHarness(transport, clock, "memory")
    finally:
        await transport.close()


async def eventually(check: Any, within: float = 5.0, interval: float = 0.02,
                     describe: Callable[[], Any] | None = None) -> Any:
    """Polls ``check()`` (sync or async) until it returns a truthy value; fails after ``within``
    seconds (saying what ``describe()`` returns then)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {within} s" + (f": {describe()}" if describe else ""))
        await asyncio.sleep(interval)
