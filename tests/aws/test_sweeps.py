"""The host sweeps only the transports that sweep: SQS expires leases and retention itself
(``capabilities.sweeps`` False), so the aws transport's sweep is never called."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fastapi_workqueue import Subscription, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.reports import SweepReport
from fastapi_workqueue.core.routing import RoutingTransport

from ..conftest import unique
from .moto import REGION
from .world import aws_of, aws_queue

pytestmark = pytest.mark.timeout(120)


def count_sweeps(queue: WorkQueue, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records each call of the aws transport's sweep (it does nothing either way)."""
    aws = aws_of(queue)
    calls: list[int] = []
    original = aws.sweep

    async def sweep(limit: int = 1000) -> SweepReport:
        calls.append(limit)
        return await original(limit)

    monkeypatch.setattr(aws, "sweep", sweep)
    return calls


async def test_beside_a_database_only_the_database_is_swept(
    tmp_path: Path, moto_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = unique("t")
    topics = [Topic(name=name, transport="aws"), Topic(name=f"{name}-db")]
    subs = [Subscription(name=f"{name}.a", topic=name, handler_key="h"),
            Subscription(name=f"{name}.d", topic=f"{name}-db", handler_key="h")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        calls = count_sweeps(queue, monkeypatch)
        assert queue.transport.capabilities.sweeps
        report = await queue.transport.sweep()
        assert report.ran  # the database's pass
        host = queue.build_host()
        assert await host.sweep_once() == 0
        assert calls == []


async def test_without_a_database_the_host_runs_no_sweeper(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name = unique("t")
    queue = WorkQueue(
        WorkQueueSettings(database_url=None, aws_region=REGION, aws_endpoint_url=moto_url, aws_wait_time_seconds=0,
                          aws_relay=False, disable_host=True),
        topics=[Topic(name=name, transport="aws")],
        subscriptions=[Subscription(name=f"{name}.a", topic=name, handler_key="h")],
    )
    await queue.open()
    try:
        assert isinstance(queue.transport, RoutingTransport)
        calls = count_sweeps(queue, monkeypatch)
        assert not queue.transport.capabilities.sweeps
        assert not (await queue.transport.sweep()).ran
        host = queue.build_host()
        assert await host.sweep_once() == 0
        await host.start()
        try:
            assert "workqueue-sweeper" not in {task.get_name() for task in asyncio.all_tasks()}
        finally:
            await host.stop()
        assert calls == []
    finally:
        await queue.close()


async def test_the_queue_claims_no_capability_that_only_some_of_its_transports_have(
    tmp_path: Path, moto_url: str,
) -> None:
    """Beside a database, an aws topic takes cancel, exact backlogs and terminal counts away from
    the queue as a whole (each subscription still answers by its own transport)."""
    name = unique("t")
    topics = [Topic(name=name, transport="aws"), Topic(name=f"{name}-db")]
    subs = [Subscription(name=f"{name}.a", topic=name, handler_key="h"),
            Subscription(name=f"{name}.d", topic=f"{name}-db", handler_key="h")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        caps = queue.transport.capabilities
        assert (caps.cancel, caps.exact_backlog, caps.terminal_counts) == (False, False, False)
        assert caps.retry_keeps_key_busy
        assert aws_of(queue).capabilities.cancel is False
        routing = queue.transport
        assert isinstance(routing, RoutingTransport)
        database = routing.default
        assert database is not None and database.capabilities.cancel and database.capabilities.terminal_counts
