"""Job status, results, wait, debounce and groups beside aws topics: they live in the queue's
database (jobs are database topics), and a queue without a database says so."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from pathlib import Path
from typing import cast

import pytest

from fastapi_workqueue import ConfigurationError, Subscription, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.aws.transport import CAPABILITIES
from fastapi_workqueue.core.routing import RoutingTransport

from ..conftest import unique
from .moto import REGION
from .world import aws_queue


async def test_job_state_lives_in_the_database_behind_the_router(tmp_path: Path, moto_url: str) -> None:
    cloud = unique("cloud")
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, [Topic(name=cloud, transport="aws")],
                         [Subscription(name=f"{cloud}.a", topic=cloud, handler_key="h")]) as queue:
        routing = queue.transport
        assert isinstance(routing, RoutingTransport)
        assert queue.ports.state is cast(object, routing.database) and routing.capabilities.message_state

        @queue.job(f"report-{cloud}", store_result=True)
        async def report(payload: dict[str, int]) -> int:
            return payload["n"]

        job_id = await queue.dispatch(report, {"n": 1})
        status = await queue.job_status(job_id)
        assert status is not None and status.state == "Pending"
        debounced = await queue.dispatch(report, {"n": 2}, debounce=timedelta(seconds=30), debounce_key="k")
        assert debounced == await queue.dispatch(report, {"n": 3}, debounce=timedelta(seconds=30), debounce_key="k")
        group = await queue.group([(report, {"n": 4})], then=(report, {"n": 5}))
        held = await queue.job_status(group.then_id)
        assert held is not None and held.state == "Pending" and held.run_at is None
    assert not CAPABILITIES.message_state
    assert any("job status" in note for note in CAPABILITIES.notes)


async def test_a_queue_without_a_database_refuses_job_state_saying_what_to_set() -> None:
    queue = WorkQueue(WorkQueueSettings(database_url=None, aws_region=REGION, aws_endpoint_url="http://127.0.0.1:9"),
                      topics=[Topic(name=unique("cloud"), transport="aws")])
    assert queue.ports.state is None and not queue.transport.capabilities.message_state
    with pytest.raises(ConfigurationError, match="set WORKQUEUE_DATABASE_URL"):
        await queue.job_status(uuid.uuid4())
    with pytest.raises(ConfigurationError, match="need a store that keeps them"):
        await queue.wait(uuid.uuid4(), timeout=1)


async def test_concurrent_unique_dispatches_on_sqlite_behind_a_router_queue_one(tmp_path: Path, moto_url: str) -> None:
    """SQLite's single writer serializes dispatchers, so a unique dispatch in a caller's transaction
    is not retried in a savepoint there, whether or not the queue routes other topics elsewhere."""
    cloud = unique("cloud")
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, [Topic(name=cloud, transport="aws")],
                         [Subscription(name=f"{cloud}.a", topic=cloud, handler_key="h")]) as queue:
        assert isinstance(queue.transport, RoutingTransport)
        assert not queue.transport.capabilities.savepoint_retry

        @queue.job(f"remind-{cloud}")
        async def remind(payload: dict[str, int]) -> None:
            return None

        async def dispatch_in_a_transaction() -> uuid.UUID | None:
            async with queue.sessionmaker() as session, session.begin():
                return await queue.dispatch(remind, {"user_id": 1}, unique="members", session=session)

        results = await asyncio.gather(*(dispatch_in_a_transaction() for _ in range(8)))
        assert len([r for r in results if r is not None]) == 1
