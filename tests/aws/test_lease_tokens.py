"""A token that is not the one this process holds (forged, or of an earlier receive) changes nothing
on the aws transport: its settle and heartbeat answer LeaseLost, the holder's still work."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkQueue
from fastapi_workqueue.core.runtime import SHUTDOWN_RELEASE_REASON
from fastapi_workqueue.core.transport import ClaimedDelivery, HeartbeatRequest, SettleKind, Settlement

from ..conftest import unique
from .world import aws_of, aws_queue

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def one_subscription(tmp_path: Path, moto_url: str) -> AsyncIterator[tuple[WorkQueue, str, str]]:
    """An opened queue with one aws topic and its subscription (lease 30 s): the queue, topic, subscription."""
    name = unique("t")
    sub = f"{name}.s"
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, [Topic(name=name, transport="aws")],
                         [Subscription(name=sub, topic=name, handler_key="h", lease_seconds=30)]) as queue:
        yield queue, name, sub


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
    async with one_subscription(tmp_path, moto_url) as (queue, name, sub):
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
    async with one_subscription(tmp_path, moto_url) as (queue, name, sub):
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


async def test_a_retry_received_again_while_its_settle_ends_keeps_the_new_lease(
    tmp_path: Path, moto_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retry due at once (its backoff drew 0 s) is visible as soon as the settle has changed its
    visibility, and an open long poll may receive it before the settle ends: the settle must then
    leave the new attempt's lease alone (it has the same delivery id), or that attempt's outcome is
    refused and the message runs a third time a lease later."""
    async with one_subscription(tmp_path, moto_url) as (queue, name, sub):
        await queue.publish(name, [PublishRequest(payload={})])
        first = await claim_one(queue, sub)
        transport = aws_of(queue)
        visibility = transport._visibility
        again: list[ClaimedDelivery] = []

        async def received_meanwhile(*args: object, **kwargs: object) -> object:
            result = await visibility(*args, **kwargs)  # type: ignore[arg-type]
            again.append(await claim_one(queue, sub))  # the open poll takes it before the settle ends
            return result

        monkeypatch.setattr(transport, "_visibility", received_meanwhile)
        assert await queue.transport.settle([Settlement(first.delivery_id, first.lease_token, "Retry",
                                                        delay_seconds=0)]) == ["Pending"]
        monkeypatch.setattr(transport, "_visibility", visibility)
        [second] = again
        assert second.delivery_id == first.delivery_id and second.lease_token != first.lease_token
        assert second.attempt == 2
        assert await queue.transport.settle([Settlement(second.delivery_id, second.lease_token, "Complete")]) == [
            "Completed"]
        done = await queue.get_delivery(second.delivery_id)
        assert done is not None and done.status == "Completed"


async def test_the_backlog_counts_what_runs_as_an_autoscaler_needs(tmp_path: Path, moto_url: str) -> None:
    """Backlog = claimable + InFlight (SPEC 7): work that runs keeps its workers."""
    async with one_subscription(tmp_path, moto_url) as (queue, name, sub):
        await queue.publish(name, [PublishRequest(payload={"n": n}) for n in range(3)])
        running: list[ClaimedDelivery] = []
        for _ in range(5):
            running += await queue.transport.claim(sub, 1)
            if running:
                break
        assert len(running) == 1
        backlog = await queue.backlog(sub)
        assert backlog is not None
        assert (backlog.claimable, backlog.in_flight, backlog.backlog) == (2, 1, 3)
        await queue.transport.settle([Settlement(running[0].delivery_id, running[0].lease_token, "Complete")])


async def test_a_shutdown_release_waits_out_the_receives_the_stop_cancels(tmp_path: Path, moto_url: str) -> None:
    """A stop cancels the open long poll here, but SQS runs it to its end: a delivery released at
    shutdown becomes visible only after it, so that the orphaned poll cannot take it (where nobody
    would handle it: a lease's stall and an attempt spent). The next worker gets it at once after,
    as attempt 2: SQS counts the receives, and the give-back is uncounted only in the process that
    made it (docs/aws.md); an orphaned receive would make it 3, a lease later."""
    name = unique("t")
    sub = f"{name}.s"
    db = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    topics, subs = [Topic(name=name, transport="aws")], [Subscription(name=sub, topic=name, handler_key="h",
                                                                       lease_seconds=30)]
    async with aws_queue(db, moto_url, topics, subs, aws_wait_time_seconds=3) as stopping:
        await stopping.publish(name, [PublishRequest(payload={})])
        [running] = await stopping.transport.claim(sub, 1)
        polling = asyncio.create_task(stopping.transport.claim(sub, 1))  # the worker's next long poll
        await asyncio.sleep(0.3)
        assert await stopping.transport.settle([Settlement(running.delivery_id, running.lease_token, "Release",
                                                           reason=SHUTDOWN_RELEASE_REASON)]) == ["Pending"]
        polling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await polling
    # The queue closed (its receive cancelled, still open in SQS for up to 3 s more).
    async with aws_queue(db, moto_url, topics, subs, bind=False) as next_worker:
        await aws_of(next_worker).reload_bindings()
        found: list[ClaimedDelivery] = []
        for _ in range(40):
            found = await next_worker.transport.claim(sub, 1)
            if found:
                break
            await asyncio.sleep(0.25)
        assert [(d.message_id, d.attempt) for d in found] == [(running.message_id, 2)]
        await next_worker.transport.settle([Settlement(found[0].delivery_id, found[0].lease_token, "Complete")])
