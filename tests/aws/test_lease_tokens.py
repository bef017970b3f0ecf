"""A token that is not the one this process holds (forged, or of an earlier receive) changes nothing
on the aws transport: its settle and heartbeat answer LeaseLost, the holder's still work."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkQueue
from fastapi_workqueue.core.transport import ClaimedDelivery, HeartbeatRequest, SettleKind, Settlement

from ..conftest import unique
from .world import aws_of, aws_queue

pytestmark = pytest.mark.timeout(120)


async def claim_one(queue: WorkQueue, subscription: str) -> ClaimedDelivery:
    for _ in range(5):
        found = await queue.transport.claim(subscription, 10)
        if found:
            [delivery] = found
            return delivery
    raise AssertionError(f"nothing to claim on {subscription}")


@pytest.mark.parametrize("kind", ["Complete", "Retry", "DeadLetter", "Release", "Discard"])
async def test_a_forged_token_changes_nothing_and_the_holder_still_settles(
    tmp_path: Path, moto_url: str, kind: SettleKind,
) -> None:
    name = unique("t")
    sub = f"{name}.s"
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, [Topic(name=name, transport="aws")],
                         [Subscription(name=sub, topic=name, handler_key="h", lease_seconds=30)]) as queue:
        await queue.publish(name, [PublishRequest(payload={})])
        delivery = await claim_one(queue, sub)
        transport = queue.transport
        forged = Settlement(delivery.delivery_id, "forged", kind)
        assert await transport.settle([forged]) == ["LeaseLost"]
        assert await transport.settle_with_follow_ups(forged) == "LeaseLost"
        [beat] = await transport.heartbeat([HeartbeatRequest(delivery.delivery_id, "forged", 50, "forged")])
        assert not beat.alive
        info = await queue.get_delivery(delivery.delivery_id)
        assert info is not None and info.status == "InFlight" and info.progress_percent is None
        assert delivery.delivery_id in aws_of(queue)._leases
        [beat] = await transport.heartbeat([HeartbeatRequest(delivery.delivery_id, delivery.lease_token)])
        assert beat.alive
        # In one batch with the holder's own settlement, the forged one still changes nothing.
        real = Settlement(delivery.delivery_id, delivery.lease_token, "Complete")
        assert await transport.settle([forged, real, forged]) == ["LeaseLost", "Completed", "LeaseLost"]
        done = await queue.get_delivery(delivery.delivery_id)
        assert done is not None and done.status == "Completed"


async def test_the_token_of_an_earlier_receive_is_refused(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    sub = f"{name}.s"
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, [Topic(name=name, transport="aws")],
                         [Subscription(name=sub, topic=name, handler_key="h", lease_seconds=30)]) as queue:
        await queue.publish(name, [PublishRequest(payload={})])
        first = await claim_one(queue, sub)
        release = Settlement(first.delivery_id, first.lease_token, "Release")
        assert await queue.transport.settle([release]) == ["Pending"]
        second = await claim_one(queue, sub)
        assert second.delivery_id == first.delivery_id and second.lease_token != first.lease_token
        stale = Settlement(first.delivery_id, first.lease_token, "Complete")
        assert await queue.transport.settle([stale]) == ["LeaseLost"]
        [beat] = await queue.transport.heartbeat([HeartbeatRequest(first.delivery_id, first.lease_token)])
        assert not beat.alive
        assert await queue.transport.settle([Settlement(second.delivery_id, second.lease_token, "Complete")]) == [
            "Completed"]
