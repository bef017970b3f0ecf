"""Leases with the defaults a user gets: a 20 s long poll against a 10 s (or 5 s) lease. A message
runs, in order, on its first attempt, however late in a long poll it arrives; a give-back never
spends an attempt, and SQS's redrive never comes before the library's own dead letter."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path

import pytest
from pydantic import BaseModel

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkContext, WorkMessage, WorkQueue

from ..conftest import unique
from ..support import wait_for
from .deployed import dead_letter_bodies, deployed_queue, provision_queue, running, sqs_client

pytestmark = pytest.mark.timeout(180)


class Item(BaseModel):
    key: str
    n: int


async def test_messages_arriving_late_in_a_long_poll_run_in_order_on_their_first_attempt(
    tmp_path: Path, moto_url: str,
) -> None:
    name = unique("lease")
    queue = deployed_queue(
        f"sqlite+aiosqlite:///{tmp_path / 'app.db'}", moto_url, [Topic(name=name, transport="aws", is_fifo=True)],
        [Subscription(name=f"{name}.work", topic=name, handler_key="work", partition_mode="Exclusive",
                      lease_seconds=10)],
    )
    seen: list[tuple[str, int, int]] = []
    counted = asyncio.Condition()

    @queue.handler("work")
    async def work(message: WorkMessage[Item], context: WorkContext) -> None:
        seen.append((message.payload.key, message.payload.n, context.attempt))
        async with counted:
            counted.notify_all()

    async def published(rounds: int) -> None:
        async with counted:
            await asyncio.wait_for(counted.wait_for(lambda: len(seen) >= rounds * 6), 60)

    document = provision_queue(queue, moto_url)
    async with running(queue, document):
        for round_ in range(3):
            # An idle host is in a long poll; each round arrives later in it (up to 9 s, most of the
            # 10 s lease, had the poll been sent 20 s long and the lease counted from its send).
            await asyncio.sleep(round_ * 4.5)
            await queue.publish(name, [PublishRequest(payload={"key": key, "n": round_ * 3 + n}, partition_key=key)
                                       for key in ("k0", "k1") for n in range(3)])
            await published(round_ + 1)
    by_key: dict[str, list[int]] = defaultdict(list)
    for key, n, _ in seen:
        by_key[key].append(n)
    assert dict(by_key) == {"k0": list(range(9)), "k1": list(range(9))}
    assert {attempt for _, _, attempt in seen} == {1}
    assert dead_letter_bodies(moto_url, document["subscriptions"][f"{name}.work"]["dlq_url"]) == []


async def test_a_short_lease_keeps_every_attempt_and_the_librarys_dead_letter_comes_first(
    tmp_path: Path, moto_url: str,
) -> None:
    name = unique("short")
    sub = f"{name}.work"
    queue = deployed_queue(
        f"sqlite+aiosqlite:///{tmp_path / 'app.db'}", moto_url, [Topic(name=name, transport="aws")],
        [Subscription(name=sub, topic=name, handler_key="work", lease_seconds=5, max_attempts=3)],
    )
    attempts: list[int] = []

    @queue.handler("work")
    async def work(message: WorkMessage[int], context: WorkContext) -> None:
        attempts.append(context.attempt)
        raise RuntimeError(f"always fails (attempt {context.attempt})")

    document = provision_queue(queue, moto_url)
    async with running(queue, document):
        await asyncio.sleep(4)  # the idle host's long poll has waited most of the lease
        await queue.publish(name, [PublishRequest(payload=1)])

        [letter] = await wait_for(lambda: queue.dead_letters(sub), within=60, interval=0.2)
    assert attempts == [1, 2, 3]
    assert letter.reason is not None and letter.reason.startswith("max attempts reached")
    assert letter.last_error is not None and "always fails (attempt 3)" in letter.last_error
    [body] = dead_letter_bodies(moto_url, document["subscriptions"][sub]["dlq_url"])
    assert body["dead_letter"]["attempts"] == 3


async def test_give_backs_at_shutdown_never_send_a_message_to_the_dlq_unrun(tmp_path: Path, moto_url: str) -> None:
    name = unique("back")
    sub = f"{name}.work"
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    topics = [Topic(name=name, transport="aws")]
    subscriptions = [Subscription(name=sub, topic=name, handler_key="work", max_attempts=2)]
    started = asyncio.Event()
    runs: list[int] = []

    def process(block: bool) -> WorkQueue:
        """A new process: nothing of the last one's memory."""
        queue = deployed_queue(url, moto_url, topics, subscriptions, shutdown_drain_ms=50)

        @queue.handler("work")
        async def work(message: WorkMessage[int], context: WorkContext) -> None:
            runs.append(context.attempt)
            started.set()
            if block:
                await asyncio.Event().wait()  # until the shutdown aborts it: released, no attempt spent

        return queue

    first = process(block=True)
    document = provision_queue(first, moto_url)
    async with running(first, document):
        await first.publish(name, [PublishRequest(payload=1)])
        await asyncio.wait_for(started.wait(), 60)
    for block in (True, True, False):
        started.clear()
        async with running(process(block)):
            await asyncio.wait_for(started.wait(), 60)
    assert len(runs) == 4 and runs[-1] <= 2  # the attempt is never above max_attempts
    assert dead_letter_bodies(moto_url, document["subscriptions"][sub]["dlq_url"]) == []
    assert dead_letter_bodies(moto_url, document["subscriptions"][sub]["queue_url"]) == []  # completed, deleted


async def test_the_receive_at_the_redrives_count_is_the_last_attempt(tmp_path: Path, moto_url: str) -> None:
    """A queue whose redrive allows no give-back (``maxReceiveCount`` = ``max_attempts``, as the
    module set it before ``max_receive_count``): after a give-back, the receive that reaches the
    count fails into the library's own dead letter, not into SQS's redrive without a reason."""
    name = unique("redrive")
    sub = f"{name}.work"
    queue = deployed_queue(
        f"sqlite+aiosqlite:///{tmp_path / 'app.db'}", moto_url, [Topic(name=name, transport="aws")],
        [Subscription(name=sub, topic=name, handler_key="work", max_attempts=3, lease_seconds=30)],
        aws_wait_time_seconds=1,
    )
    document = provision_queue(queue, moto_url)
    bound = document["subscriptions"][sub]
    sqs_client(moto_url).set_queue_attributes(QueueUrl=bound["queue_url"], Attributes={
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": bound["dlq_arn"], "maxReceiveCount": 3})})
    attempts: list[int] = []
    gave_back = asyncio.Event()

    @queue.handler("work")
    async def work(message: WorkMessage[int], context: WorkContext) -> None:
        attempts.append(context.attempt)
        if len(attempts) == 1:
            gave_back.set()
            await asyncio.Event().wait()  # paused below while it runs: given back at the pause's drain
        raise RuntimeError(f"fails (attempt {context.attempt})")

    async with running(queue, document):
        await queue.publish(name, [PublishRequest(payload=1)])
        await asyncio.wait_for(gave_back.wait(), 60)
        host = queue.host
        assert host is not None
        await host.consumers[sub].stop(0)  # the shutdown of this consumer: a give-back, no attempt spent
        host.consumers.pop(sub)
        await host.reconcile()  # a new consumer in the same process
        [letter] = await wait_for(lambda: queue.dead_letters(sub), within=60, interval=0.2)
    assert attempts == [1, 1, 2]
    assert letter.reason is not None and letter.reason.startswith("max attempts reached")
    assert letter.last_error is not None and "fails (attempt 2)" in letter.last_error
