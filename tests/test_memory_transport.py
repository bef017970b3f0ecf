"""An application's test on ``MemoryTransport`` (docs/testing.md): a WorkQueue whose host runs
the real consumer over the queue in memory, and the listings the host reconciles from."""

from __future__ import annotations

import asyncio
import re

import pytest
from pydantic import BaseModel

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkMessage, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.clock import ManualClock
from fastapi_workqueue.core.errors import ConfigurationError
from fastapi_workqueue.core.outcomes import Outcome, WorkOutcome
from fastapi_workqueue.testing import MemoryTransport


class Signup(BaseModel):
    email: str


def signup_queue(transport: MemoryTransport) -> WorkQueue:
    return WorkQueue(
        WorkQueueSettings(database_url=None),
        topics=[Topic(name="signups")],
        subscriptions=[Subscription(name="signups.welcome", topic="signups", handler_key="welcome",
                                    backoff_base_seconds=0, backoff_max_seconds=0)],
        transport=transport,
    )


async def test_a_queue_on_the_memory_transport_runs_its_handlers() -> None:
    queue = signup_queue(MemoryTransport())
    attempts: list[tuple[str, int]] = []
    done = asyncio.Event()

    @queue.handler("welcome")
    async def welcome(message: WorkMessage[Signup]) -> WorkOutcome:
        attempts.append((message.payload.email, message.attempt))
        if message.attempt == 1:
            return Outcome.retry("the mail server is down")
        done.set()
        return Outcome.complete()

    async with queue.lifespan():
        [result] = await queue.publish("signups", [PublishRequest(payload={"email": "a@example.com"})])
        assert result.ok
        await asyncio.wait_for(done.wait(), 10)
    assert attempts == [("a@example.com", 1), ("a@example.com", 2)]


async def test_the_store_lists_what_was_declared_and_refuses_a_callers_transaction() -> None:
    clock = ManualClock()
    transport = MemoryTransport(clock=clock)
    queue = signup_queue(transport)
    await transport.sync_topology(list(queue.topics.values()), list(queue.subscriptions.values()))
    [sub] = await transport.list_subscriptions()
    assert (sub.name, sub.topic, sub.status, sub.topic_status) == ("signups.welcome", "signups", "Active", "Active")
    assert [t.name for t in await transport.list_topics()] == ["signups"]
    with pytest.raises(ConfigurationError, match="caller's database transaction"):
        await transport.publish("signups", [], session=object())
    assert (await transport.validate_bindings()).ok


def test_transports_of_one_name_share_a_store_and_others_do_not() -> None:
    one, same, other = MemoryTransport("memory://shared"), MemoryTransport("memory://shared"), MemoryTransport()
    assert one._store is same._store and other._store is not one._store
    with pytest.raises(ConfigurationError, match="memory://"):
        MemoryTransport("sqlite:///x.db")


async def test_a_subscription_does_not_move_to_another_topic_and_a_refused_sync_writes_nothing() -> None:
    """As on the databases: a move is refused whether or not the subscription holds work, and
    nothing of the refused topology is written."""
    transport = MemoryTransport()
    await transport.open()
    try:
        await transport.sync_topology([Topic(name="orders.created")],
                                      [Subscription(name="orders.mail", topic="orders.created", handler_key="h")])
        with pytest.raises(ValueError, match=re.escape(
                "is on topic orders.created in the store, and the code puts it on topic orders.placed: a "
                "subscription does not move between topics")):
            await transport.sync_topology(
                [Topic(name="orders.created"), Topic(name="orders.placed")],
                [Subscription(name="orders.audit", topic="orders.placed", handler_key="h"),
                 Subscription(name="orders.mail", topic="orders.placed", handler_key="h")])
        assert {t.name for t in await transport.list_topics()} == {"orders.created"}
        assert {s.name: s.topic for s in await transport.list_subscriptions()} == {"orders.mail": "orders.created"}
    finally:
        await transport.close()
