"""An app's topic moves from the database transport to AWS by its ``transport`` field alone: the
same handler runs, publishes go through the outbox in the caller's transaction."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import BaseModel

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkMessage, WorkQueue, WorkQueueSettings
from fastapi_workqueue.aws.bindings import Bindings, store_bindings
from fastapi_workqueue.aws.manifest import build_manifest

from ..conftest import unique
from .moto import REGION
from .provision import provision
from .world import aws_of


class Order(BaseModel):
    number: int


def build(transport: str, database_url: str, moto_url: str, name: str) -> tuple[WorkQueue, list[int], asyncio.Event]:
    topics = [Topic(name=name, transport=transport, is_fifo=transport == "aws")]
    subs = [Subscription(name=f"{name}.email", topic=name, handler_key="orders.email", partition_mode="Exclusive",
                         max_attempts=3, lease_seconds=30)]
    queue = WorkQueue(
        WorkQueueSettings(database_url=database_url, auto_migrate=True, aws_region=REGION, aws_endpoint_url=moto_url,
                          aws_wait_time_seconds=1, aws_relay_interval_ms=50, idle_poll_min_ms=20,
                          idle_poll_max_ms=100),
        topics=topics, subscriptions=subs,
    )
    seen: list[int] = []
    done = asyncio.Event()

    @queue.handler("orders.email")
    async def email(message: WorkMessage[Order]) -> None:
        seen.append(message.payload.number)
        if len(seen) >= 3:
            done.set()

    return queue, seen, done


@pytest.mark.parametrize("transport", ["database", "aws"])
async def test_the_same_handler_runs_on_either_transport(transport: str, tmp_path: Path, moto_url: str) -> None:
    name = unique("orders")
    queue, seen, done = build(transport, f"sqlite+aiosqlite:///{tmp_path / 'app.db'}", moto_url, name)
    await queue.open()
    try:
        if transport == "aws":
            manifest = build_manifest(list(queue.topics.values()), list(queue.subscriptions.values()), queue.settings)
            await store_bindings(queue.kernel, Bindings.parse(provision(manifest, moto_url)))
            await aws_of(queue).reload_bindings()
        await queue._start_host()
        with pytest.raises(RuntimeError):
            async with queue.sessionmaker() as session, session.begin():
                await queue.publish(name, [PublishRequest(payload={"number": 0}, partition_key="c1")], session=session)
                raise RuntimeError("rolled back")
        async with queue.sessionmaker() as session, session.begin():
            await queue.publish(name, [PublishRequest(payload={"number": n}, partition_key="c1") for n in (1, 2)],
                                session=session)
        await queue.publish(name, [PublishRequest(payload={"number": 3}, partition_key="c1")])
        await asyncio.wait_for(done.wait(), 60)
        # The key's order holds among the outbox's rows; a publish without a session goes
        # straight to SNS and may arrive before rows the relay has not forwarded yet.
        assert sorted(seen) == [1, 2, 3] and seen.index(1) < seen.index(2)
    finally:
        await queue.close()
