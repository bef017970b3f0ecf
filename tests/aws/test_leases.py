"""Leases on the aws transport beyond the conformance suite: progress, the later messages of a busy
Exclusive key that a FIFO receive hands over, and what a second process sees of them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest

from fastapi_workqueue import PublishRequest
from fastapi_workqueue.aws.leases import Held
from fastapi_workqueue.aws.transport import AwsTransport
from fastapi_workqueue.core.transport import HeartbeatRequest
from fastapi_workqueue.testing.conformance import make_world

from .harness import AwsHarness, aws_harness


@asynccontextmanager
async def another_process(harness: AwsHarness) -> AsyncIterator[AwsTransport]:
    """A second transport on the same resources and bindings, with nothing of the first's memory."""
    first = harness.transport
    other = AwsTransport(first.kernel, bindings=first.bindings)
    await other.open()
    await other.sync_topology(list(first._topics.values()), list(first._subscriptions.values()))
    try:
        yield other
    finally:
        await other.close()


async def test_a_heartbeat_keeps_the_progress_get_delivery_shows(moto_url: str) -> None:
    async with aws_harness(moto_url) as harness:
        world = await make_world(harness.transport, [{"role": "a", "lease_seconds": 30}])
        await world.publish_one(payload=1)
        delivery = await world.claim_one("a")
        [beat] = await harness.transport.heartbeat(
            [HeartbeatRequest(delivery.delivery_id, delivery.lease_token, 40, "half way")])
        assert beat.alive and beat.lease_expires_at is not None
        info = await harness.transport.get_delivery(delivery.delivery_id)
        assert info is not None and info.status == "InFlight"
        assert (info.progress_percent, info.progress_message) == (40, "half way")
        assert info.lease_expires_at == beat.lease_expires_at
        assert await world.settle(delivery) == "Completed"


async def test_a_held_message_of_a_busy_key_waits_and_goes_back_to_sqs_at_shutdown(moto_url: str) -> None:
    async with aws_harness(moto_url) as harness:
        world = await make_world(harness.transport, [{"role": "x", "partition_mode": "Exclusive"}])
        results = await world.publish(*[PublishRequest(partition_key="k", payload=i) for i in range(2)])
        [first] = await world.claim("x", 10)  # the receive handed over both; the second is held
        assert first.message_id == results[0].message_id
        assert await world.claim("x", 10) == []
        assert await world.settle(first) == "Completed"
        async with another_process(harness) as other:
            # Held (in flight) by the first process: nobody else receives it.
            assert await other.claim(world["x"], 10) == []
            await harness.transport.close()  # shutdown gives it back (visibility 0)
            [second] = await other.claim(world["x"], 10)
            assert second.message_id == results[1].message_id
            assert second.attempt == 2  # SQS counted the receive that held it
            info = await other.get_delivery(second.delivery_id)
            assert info is not None and info.status == "InFlight"


async def test_another_process_sees_dead_letters_but_not_this_ones_settlements(moto_url: str) -> None:
    async with aws_harness(moto_url) as harness:
        world = await make_world(harness.transport, [{"role": "a", "max_attempts": 3}])
        await world.publish(PublishRequest(payload=1), PublishRequest(payload=2))
        done, dead = await world.claim("a", 2)
        assert await world.settle(done) == "Completed"
        assert await world.settle(dead, "DeadLetter", reason="poison", error="ValueError: bad") == "DeadLettered"
        async with another_process(harness) as other:
            info = await other.get_delivery(dead.delivery_id)
            assert info is not None and info.status == "DeadLettered"
            assert (info.reason, info.last_error, info.attempt) == ("poison", "ValueError: bad", 1)
            # A deletion leaves nothing in SQS: only the process that completed it knows.
            assert await other.get_delivery(done.delivery_id) is None
            completed = await harness.transport.get_delivery(done.delivery_id)
            assert completed is not None and completed.status == "Completed"
            # The dead letter keeps its delivery id through a replay made elsewhere.
            assert (await other.replay(world["a"], dead.delivery_id, "fixed")).result == "Replayed"
            [again] = await world.claim("a", 10)
            assert again.delivery_id == dead.delivery_id and again.attempt == 1
            assert await world.settle(again) == "Completed"


async def test_a_heartbeat_of_a_key_keeps_its_held_messages_invisible_as_long(moto_url: str) -> None:
    async with aws_harness(moto_url) as harness:
        world = await make_world(harness.transport, [{"role": "x", "partition_mode": "Exclusive", "lease_seconds": 30}])
        await world.publish(*[PublishRequest(partition_key="k", payload=i) for i in range(3)])
        [head] = await world.claim("x", 10)
        [held_one, held_two] = harness.transport._held[world["x"]]
        before = (held_one.visible_at, held_two.visible_at)
        [beat] = await harness.transport.heartbeat([HeartbeatRequest(head.delivery_id, head.lease_token)])
        assert beat.alive
        after = [h.visible_at for h in harness.transport._held[world["x"]]]
        assert len(after) == 2 and after[0] >= before[0] and after[1] >= before[1]
        assert await world.settle(head) == "Completed"
        [second] = await world.claim("x", 10)
        assert second.attempt == 1  # held, never handed back: SQS charged one receive
        assert await world.settle(second) == "Completed"
        [third] = await world.claim("x", 10)
        assert third.attempt == 1 and await world.settle(third) == "Completed"
        assert await world.claim("x", 10) == []


async def test_a_retry_settled_while_a_claim_renews_other_keys_keeps_its_key_in_order(
    moto_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A settle runs while a claim waits on SQS (renewing another key's held message): the retry
    still sees its key's held messages and keeps the key's head ahead of them."""
    async with aws_harness(moto_url) as harness:
        transport = harness.transport
        world = await make_world(transport, [{"role": "x", "partition_mode": "Exclusive", "lease_seconds": 30,
                                              "backoff_base_seconds": 0, "backoff_max_seconds": 0}])
        g = await world.publish(*[PublishRequest(partition_key="g", payload=f"g{i}") for i in range(2)])
        h = await world.publish(*[PublishRequest(partition_key="h", payload=f"h{i}") for i in range(2)])
        g0, h0 = g[0].message_id, h[0].message_id
        assert g0 is not None and h0 is not None
        heads = {c.message_id: c for c in await world.claim("x", 10)}  # g0 and h0 go; g1 and h1 are held
        assert set(heads) == {g0, h0}
        assert await world.settle(heads[h0]) == "Completed"
        renew = transport._renew
        settled: list[str] = []

        async def renew_while_g_retries(changes: Sequence[tuple[Held, int]]) -> list[bool]:
            if not settled:  # the settle lands while the claim waits for SQS
                settled.append("settling")
                settled[0] = await world.settle(heads[g0], "Retry", delay_seconds=0)
            return await renew(changes)

        monkeypatch.setattr(transport, "_renew", renew_while_g_retries)
        [h1] = await world.claim("x", 1)  # held since the first receive: renewed before it goes
        monkeypatch.setattr(transport, "_renew", renew)
        assert settled == ["Pending"] and h1.message_id == h[1].message_id
        again = await world.claim_one("x")
        assert (again.message_id, again.attempt) == (g[0].message_id, 2)
        assert await world.settle(again) == "Completed"
        last = await world.claim_one("x")
        assert last.message_id == g[1].message_id
        assert await world.settle(last) == "Completed" and await world.settle(h1) == "Completed"
