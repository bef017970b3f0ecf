"""Exclusive on a FIFO topic keeps each key's order through a retry, with the defaults a user gets
(a 20 s long poll, the default lease, several messages of one group in one receive): a retrying
message keeps its group blocked, and the later messages of its key wait for it here without
spending an attempt."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

from pydantic import BaseModel

from fastapi_workqueue import (
    PublishRequest,
    Subscription,
    Topic,
    TransientWorkError,
    WorkContext,
    WorkMessage,
    WorkQueue,
)

from ..conftest import unique
from .deployed import deployed_queue, provision_queue, running


class Item(BaseModel):
    key: str
    n: int


def fifo_app(database_url: str, moto_url: str, name: str, seen: list[tuple[str, int, int]],
             done: asyncio.Event, expected: int, failed: set[tuple[str, int]]) -> WorkQueue:
    """A FIFO topic with an Exclusive subscription whose handler fails each item of ``failed`` once
    with ``TransientWorkError(delay_seconds=1)`` and records (key, n, attempt) of each completion."""
    queue = deployed_queue(
        database_url, moto_url, [Topic(name=name, transport="aws", is_fifo=True)],
        [Subscription(name=f"{name}.work", topic=name, handler_key="work", partition_mode="Exclusive")],
    )

    @queue.handler("work")
    async def work(message: WorkMessage[Item], context: WorkContext) -> None:
        item = message.payload
        if (item.key, item.n) in failed and context.attempt == 1:
            raise TransientWorkError("not yet", delay_seconds=1)
        seen.append((item.key, item.n, context.attempt))
        if len(seen) >= expected:
            done.set()

    return queue


async def test_a_retrying_head_keeps_its_key_in_order(tmp_path: Path, moto_url: str) -> None:
    name = unique("fifo")
    seen: list[tuple[str, int, int]] = []
    done = asyncio.Event()
    queue = fifo_app(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}", moto_url, name, seen, done, 4, {("k", 0)})
    async with running(queue, provision_queue(queue, moto_url)):
        await queue.publish(name, [PublishRequest(payload={"key": "k", "n": n}, partition_key="k") for n in range(4)])
        await asyncio.wait_for(done.wait(), 60)
    assert [n for _, n, _ in seen] == [0, 1, 2, 3]
    assert [attempt for _, _, attempt in seen] == [2, 1, 1, 1]


async def test_two_workers_keep_each_keys_order_through_retries(tmp_path: Path, moto_url: str) -> None:
    name = unique("fifo")
    seen: list[tuple[str, int, int]] = []
    done = asyncio.Event()
    keys = [f"k{i}" for i in range(4)]
    failed = {(key, 0) for key in keys} | {("k1", 2), ("k3", 4)}
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    # Published while both workers poll: the groups split between their receives as the messages
    # arrive. The tests' moto server keeps SQS's rule that no receive gets a group's messages while
    # others of it are in flight (plain moto breaks it when receives overlap: tests/aws/serve_moto.py).
    first = fifo_app(url, moto_url, name, seen, done, 24, failed)
    second = fifo_app(url, moto_url, name, seen, done, 24, failed)
    async with running(first, provision_queue(first, moto_url)), running(second):
        await first.publish(name, [PublishRequest(payload={"key": key, "n": n}, partition_key=key)
                                   for key in keys for n in range(6)])
        await asyncio.wait_for(done.wait(), 90)
    by_key: dict[str, list[int]] = defaultdict(list)
    for key, n, _ in seen:
        by_key[key].append(n)
    assert dict(by_key) == {key: list(range(6)) for key in keys}
    assert all(attempt == (2 if (key, n) in failed else 1) for key, n, attempt in seen)
