"""The runtime's local lease: counted from when the claim was sent, never started too late."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import weakref
from typing import Any

import asyncpg
import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, TransientWorkError, WorkContext, WorkMessage
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.handlers import HandlerRegistry, call_plain
from fastapi_workqueue.core.leases import LocalLease, start_margin
from fastapi_workqueue.core.runtime import Consumer
from fastapi_workqueue.core.settler import Settler
from fastapi_workqueue.core.transport import ClaimedDelivery
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

from .conftest import unique
from .support import wait_for

pytestmark = pytest.mark.timeout(60)


def test_the_margin_is_a_fifth_of_the_lease_up_to_thirty_seconds() -> None:
    assert start_margin(2.0) == pytest.approx(0.4)
    assert start_margin(60.0) == pytest.approx(12.0)
    assert start_margin(3600.0) == 30.0
    assert start_margin(0.2) == pytest.approx(0.04)


def test_a_lease_counts_from_the_send_and_a_renewal_never_moves_it_back() -> None:
    lease = LocalLease.claimed(sent_at=100.0, lease_seconds=2.0)
    assert lease.deadline == 102.0
    assert lease.can_start(now=101.0)  # the answer came after 1 s: 1 s left, the margin is 0.4 s
    assert not lease.can_start(now=101.7)  # 0.3 s left
    assert not lease.can_start(now=103.0)  # stalled past the lease
    lease.renew(sent_at=101.5)
    assert lease.deadline == 103.5
    lease.renew(sent_at=101.0)  # an older heartbeat's answer arriving late
    assert lease.deadline == 103.5
    lease.renew(sent_at=102.0, lease_seconds=10.0)  # the subscription's lease was changed
    assert lease.deadline == 112.0 and lease.remaining(now=111.0) == 1.0


class SteppingClock:
    """A monotonic clock that a test moves forward, as a stalled process would see it."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class StallAfterClaim(PostgresTransport):
    """The real store; this process "stalls" for ``stall`` seconds once a claim's answer arrived."""

    def __init__(self, url: str, clock: SteppingClock, stall: float) -> None:
        super().__init__(url, listen=False, pool_max_size=2)
        self.monotonic = clock
        self.stall = stall

    async def claim(self, subscription: str, limit: int) -> list[ClaimedDelivery]:
        batch = await super().claim(subscription, limit)
        if batch:
            self.monotonic.offset += self.stall
            self.stall = 0.0
        return batch


@pytest.mark.parametrize(("stall", "runs"), [(3.0, False), (0.5, True)])
async def test_a_delivery_claimed_before_a_stall_longer_than_its_lease_is_given_back_not_run(
    pg_url: str, stall: float, runs: bool
) -> None:
    clock = SteppingClock()
    transport = StallAfterClaim(pg_url, clock, stall)
    topic, name = unique("topic"), unique("sub")
    ran: list[int] = []
    registry = HandlerRegistry()

    async def handle(message: WorkMessage[Any]) -> None:
        ran.append(message.attempt)

    registry.add("h", handle)
    await transport.open()
    try:
        await transport.sync_topology(
            [Topic(name=topic)], [Subscription(name=name, topic=topic, handler_key="h", lease_seconds=2)]
        )
        [state] = [s for s in await transport.list_subscriptions() if s.name == name]
        [result] = await transport.publish(topic, [prepare(PublishRequest(payload=1))])
        settler = Settler(transport)
        consumer = Consumer(transport, settler, state, registry.get, call_plain, max_deliveries=1, clock=clock)
        consumer.start()
        await asyncio.wait_for(consumer.wait_finished(), 10)
        await consumer.stop(0)
        await settler.close()
        [info] = await transport.list_deliveries(name, "Completed" if runs else "Pending")
        assert info.message_id == result.message_id
        if runs:
            assert ran == [1]
        else:
            # Never started, and given back without spending the attempt: the next claim is attempt 1.
            assert ran == [] and info.attempt == 0
    finally:
        await transport.close()


async def test_the_end_of_an_attempt_leaves_the_next_attempt_of_the_same_delivery_alone(pg_url: str) -> None:
    """Attempt 1 lost its lease and is still winding down when this consumer claims the delivery
    again: attempt 1 ending must not take attempt 2's lease off the heartbeat list."""
    transport = PostgresTransport(pg_url, listen=False, pool_max_size=3)
    topic, name = unique("topic"), unique("sub")
    first_started, second_started = asyncio.Event(), asyncio.Event()
    outcomes: dict[int, str] = {}
    registry = HandlerRegistry()

    async def handle(message: WorkMessage[Any], context: WorkContext) -> None:
        if context.attempt == 1:
            first_started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                assert context.signal.reason is not None
                outcomes[1] = f"aborted {context.signal.reason.value}"
                await asyncio.wait_for(second_started.wait(), 10)  # winds down slowly
            return
        second_started.set()
        try:
            await asyncio.sleep(3.0)  # longer than the lease: lives on heartbeats
        except asyncio.CancelledError:
            assert context.signal.reason is not None
            outcomes[2] = f"aborted {context.signal.reason.value}"
            raise
        outcomes[2] = "done"

    registry.add("h", handle)
    await transport.open()
    try:
        await transport.sync_topology(
            [Topic(name=topic)],
            [Subscription(name=name, topic=topic, handler_key="h", lease_seconds=1.2, max_attempts=5)],
        )
        [state] = [s for s in await transport.list_subscriptions() if s.name == name]
        await transport.publish(topic, [prepare(PublishRequest(payload=1))])
        settler = Settler(transport)
        consumer = Consumer(transport, settler, state, registry.get, call_plain, concurrency=2, idle_poll_max=0.2)
        consumer.start()
        try:
            await asyncio.wait_for(first_started.wait(), 10)
            # The store takes the lease back (as after a stall of the holder) and requeues it.
            await transport.run_in_connection(lambda conn: conn.execute(
                "UPDATE workqueue.delivery SET lease_expires_at = now() - interval '1 second' "
                "WHERE subscription_id = (SELECT id FROM workqueue.subscription WHERE name = $1)", name))
            assert (await transport.sweep()).expired >= 1  # ours, and any other test's leftovers
            consumer.wake()
            await asyncio.wait_for(second_started.wait(), 10)
            await wait_for(lambda: 2 in outcomes, describe=lambda: outcomes)
        finally:
            await consumer.stop(1)
            await settler.close()
        assert outcomes == {1: "aborted LeaseLost", 2: "done"}
        [info] = await transport.list_deliveries(name, "Completed")
        assert info.attempt == 2
    finally:
        await transport.close()


async def test_a_renewal_answered_after_its_handler_returned_aborts_nothing(
    pg_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A heartbeat held up (here by a row lock) until its handler has returned: its answer belongs
    to an attempt that ended, so it neither re-arms that attempt's lease timer (which then "lost"
    a lease it no longer held) nor aborts its signal."""
    transport = PostgresTransport(pg_url, listen=False, pool_max_size=4)
    topic, name = unique("topic"), unique("sub")
    started, release = asyncio.Event(), asyncio.Event()
    signals: list[str] = []
    registry = HandlerRegistry()

    async def handle(message: WorkMessage[Any], context: WorkContext) -> None:
        context.signal.add_listener(lambda reason: signals.append(reason.value))
        started.set()
        await release.wait()

    registry.add("h", handle)
    await transport.open()
    locker = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        await transport.sync_topology(
            [Topic(name=topic)], [Subscription(name=name, topic=topic, handler_key="h", lease_seconds=1.2)])
        [state] = [s for s in await transport.list_subscriptions() if s.name == name]
        await transport.publish(topic, [prepare(PublishRequest(payload=1))])
        settler = Settler(transport)
        consumer = Consumer(transport, settler, state, registry.get, call_plain, concurrency=1, idle_poll_max=0.2)
        consumer.start()
        try:
            await asyncio.wait_for(started.wait(), 10)
            lock = locker.transaction()
            await lock.start()
            await locker.execute("SELECT 1 FROM workqueue.delivery WHERE subscription_id = "
                                 "(SELECT id FROM workqueue.subscription WHERE name = $1) FOR UPDATE", name)

            async def renewal_waits() -> bool:  # (asked outside the lock's transaction, which sees one snapshot)
                return bool(await transport.run_in_connection(lambda conn: conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE '%workqueue.heartbeat%'")))

            await wait_for(renewal_waits, within=10)
            release.set()  # the handler returns while its renewal waits for the row
            await asyncio.sleep(0.2)
            with caplog.at_level(logging.INFO, logger="fastapi_workqueue"):
                await lock.commit()
                [done] = await wait_for(lambda: transport.list_deliveries(name, "Completed"), within=10)
                await asyncio.sleep(2.0)  # past the lease the old answer would have armed again
        finally:
            await consumer.stop(1)
            await settler.close()
        assert done.attempt == 1 and signals == []
        assert not [r.getMessage() for r in caplog.records if "LeaseLost" in r.getMessage()]
    finally:
        await locker.close()
        await transport.close()


class BusyBeforeTheHandlers(PostgresTransport):
    """The real store; the event loop is "busy" for ``busy`` seconds between a claim's handlers'
    tasks being made and their first step (a loaded process, many handlers ready at once)."""

    def __init__(self, url: str, clock: SteppingClock, busy: float) -> None:
        super().__init__(url, listen=False, pool_max_size=2)
        self.monotonic = clock
        self.busy = busy

    async def claim(self, subscription: str, limit: int) -> list[ClaimedDelivery]:
        batch = await super().claim(subscription, limit)
        if batch:
            asyncio.get_running_loop().call_soon(self._stall)  # runs before the handlers' tasks do
        return batch

    def _stall(self) -> None:
        self.monotonic.offset += self.busy
        self.busy = 0.0


async def test_a_handlers_wait_for_the_event_loop_is_not_counted_as_its_duration(pg_url: str) -> None:
    clock = SteppingClock()
    transport = BusyBeforeTheHandlers(pg_url, clock, 5.0)
    topic, name = unique("topic"), unique("sub")
    ran: list[int] = []
    registry = HandlerRegistry()

    async def handle(message: WorkMessage[Any]) -> None:
        ran.append(message.payload)

    registry.add("h", handle)
    await transport.open()
    try:
        await transport.sync_topology([Topic(name=topic)], [Subscription(name=name, topic=topic, handler_key="h")])
        [state] = [s for s in await transport.list_subscriptions() if s.name == name]
        await transport.publish(topic, [prepare(PublishRequest(payload=1))])
        settler = Settler(transport)
        consumer = Consumer(transport, settler, state, registry.get, call_plain, max_deliveries=1, clock=clock)
        consumer.start()
        try:
            await asyncio.wait_for(consumer.wait_finished(), 10)
        finally:
            await consumer.stop(1)
            await settler.close()
        assert ran == [1] and transport.busy == 0.0
        # What decides whether deliveries are claimed ahead: the handler's own time, not the 5 s wait.
        assert consumer._handler_seconds is not None and consumer._handler_seconds < 1.0
    finally:
        await transport.close()


class _Probe:
    def __call__(self, reason: Any) -> None:
        pass


@pytest.mark.parametrize("fails", [False, True])
async def test_an_attempts_objects_are_freed_without_the_cycle_collector(pg_url: str, fails: bool) -> None:
    transport = PostgresTransport(pg_url, listen=False, pool_max_size=2)
    topic, name = unique("topic"), unique("sub")
    probes: list[weakref.ref[_Probe]] = []
    registry = HandlerRegistry()

    async def handle(message: WorkMessage[Any], context: WorkContext) -> None:
        probe = _Probe()  # kept by the attempt's signal, so alive as long as the attempt's objects are
        context.signal.add_listener(probe)
        probes.append(weakref.ref(probe))
        if fails:  # (its traceback holds the runtime's frames)
            raise TransientWorkError("the mail server is busy", delay_seconds=60)

    registry.add("h", handle)
    await transport.open()
    gc.disable()  # what an attempt leaves in reference cycles waits for the collector (a cost on every attempt)
    logging.disable(logging.WARNING)  # (the captured records of the failures would keep their tracebacks)
    try:
        await transport.sync_topology([Topic(name=topic)], [Subscription(name=name, topic=topic, handler_key="h")])
        [state] = [s for s in await transport.list_subscriptions() if s.name == name]
        await transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(3)])
        settler = Settler(transport)
        consumer = Consumer(transport, settler, state, registry.get, call_plain, max_deliveries=3)
        consumer.start()
        try:
            await asyncio.wait_for(consumer.wait_finished(), 10)
        finally:
            await consumer.stop(1)
            await settler.close()
        assert len(probes) == 3
        assert [ref() for ref in probes] == [None, None, None]
    finally:
        logging.disable(logging.NOTSET)
        gc.enable()
        await transport.close()


async def test_a_consumer_claims_ahead_again_before_what_it_claimed_ahead_runs_out(pg_url: str) -> None:
    """With deliveries claimed ahead (prefetch), the next claim goes out once half of them have
    started, so that its round trip overlaps the rest; the consumer never holds more than
    concurrency + prefetch."""
    topic, name = unique("ahead"), unique("ahead-sub")
    transport = PostgresTransport(pg_url)
    registry = HandlerRegistry()
    gate = asyncio.Semaphore(0)
    finished = 0

    async def handle(message: WorkMessage[Any]) -> None:
        nonlocal finished
        await gate.acquire()
        finished += 1

    registry.add("h", handle)
    await transport.open()
    try:
        await transport.sync_topology([Topic(name=topic)], [Subscription(name=name, topic=topic, handler_key="h")])
        [state] = [s for s in await transport.list_subscriptions() if s.name == name]
        await transport.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(40)])
        settler = Settler(transport)
        consumer = Consumer(transport, settler, state, registry.get, call_plain, concurrency=2, prefetch=8)
        most = 0

        def sample(value: Any) -> Any:
            nonlocal most
            most = max(most, consumer.held)
            return value

        consumer.start()
        try:
            await wait_for(lambda: sample(consumer.claimed_total == 10), interval=0.005)
            gate.release()
            gate.release()
            gate.release()  # three started from the buffer: seven held, more than 2 + 8 // 2
            await wait_for(lambda: sample(finished == 3), interval=0.005)
            await asyncio.sleep(0.2)
            assert sample(consumer.claimed_total) == 10  # no claim yet: half of the prefetch is still held
            gate.release()  # the fourth: six held, and the claim ahead goes out
            await wait_for(lambda: sample(consumer.claimed_total > 10), interval=0.005,
                           describe=lambda: (consumer.claimed_total, consumer.held))
            for _ in range(40):
                gate.release()
            await wait_for(lambda: sample(finished == 40), interval=0.005)
        finally:
            await consumer.stop(1)
            await settler.close()
        assert most <= 2 + 8  # never more than concurrency + prefetch held
        assert consumer.claimed_total == 40
    finally:
        await transport.close()
