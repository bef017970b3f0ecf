"""Flow limits (issue 31): their declaration, validation, rates and round trip through the stores.

How the limits hold at claim time is the conformance suite's (C37-C40, every transport) and
``tests/test_flow_processes.py``'s (three worker processes).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from pydantic import ValidationError

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.flow import Rate, parse_rate, refill, take_limited, tokens_due_in
from fastapi_workqueue.database import create_database_transport
from fastapi_workqueue.database.postgres import to_asyncpg_dsn
from fastapi_workqueue.database.routines import RoutineTransport
from fastapi_workqueue.testing import MemoryTransport

from .conftest import unique

LIMITS: dict[str, Any] = {"max_in_flight": 20, "key_concurrency": 3, "rate_limit": "50/s", "key_rate_limit": "10/m"}


def sub(**fields: Any) -> Subscription:
    return Subscription(name="s", topic="t", handler_key="h", **fields)


@pytest.mark.parametrize(("text", "count", "period"), [("50/s", 50, 1.0), ("10/m", 10, 60.0), ("3/h", 3, 3600.0),
                                                        (" 7 / s ", 7, 1.0)])
def test_rates_are_n_per_second_minute_or_hour(text: str, count: int, period: float) -> None:
    rate = parse_rate(text)
    assert (rate.count, rate.period) == (count, period)
    assert str(rate) == text.replace(" ", "")


@pytest.mark.parametrize("text", ["50", "50/d", "0/s", "-1/s", "1.5/s", "fifty/s", "50 per second", ""])
def test_anything_else_is_not_a_rate_and_says_what_to_write(text: str) -> None:
    with pytest.raises(ValueError, match=r"write N/s, N/m or N/h .*'50/s'"):
        parse_rate(text)


def test_a_bucket_holds_one_second_of_tokens_at_least_one() -> None:
    assert Rate(50, 1).burst == 50 and Rate(10, 60).burst == 1 and Rate(600, 60).burst == 10
    fifty = Rate(50, 1)
    assert refill(None, None, 100.0, fifty) == 50  # a new bucket is full
    assert refill(0.0, 100.0, 100.1, fifty) == pytest.approx(5.0)
    assert refill(0.0, 100.0, 200.0, fifty) == 50  # never above the burst
    assert tokens_due_in(0.5, fifty) == pytest.approx(0.01) and tokens_due_in(2, fifty) == 0


def test_take_limited_keeps_claim_order_the_room_and_each_keys_room() -> None:
    candidates = [("a", 1), ("a", 2), ("b", 3), ("a", 4), (None, 5), ("b", 6)]
    rooms = {"a": 2.0, "b": 0.7}
    taken = take_limited(candidates, 10, lambda c: c[0], lambda key: rooms[key])
    assert taken == [("a", 1), ("a", 2), (None, 5)]
    assert take_limited(candidates, 2, lambda c: c[0], lambda key: math.inf) == candidates[:2]


def test_subscriptions_take_the_limits_and_write_rates_canonically() -> None:
    s = sub(**{**LIMITS, "rate_limit": " 50 / s "})
    assert s.rate_limit == "50/s" and s.flow_limited
    assert s.flow_limits() == LIMITS
    assert sub().flow_limits() == {} and not sub().flow_limited
    wire = s.model_dump(by_alias=True)
    assert (wire["MaxInFlight"], wire["KeyConcurrency"], wire["RateLimit"], wire["KeyRateLimit"]) == (
        20, 3, "50/s", "10/m")


@pytest.mark.parametrize(("fields", "says"), [
    ({"max_in_flight": 0}, "max_in_flight"),
    ({"key_concurrency": 0}, "key_concurrency"),
    ({"rate_limit": "fast"}, "rate_limit 'fast' is not a rate"),
    ({"key_rate_limit": "10/d"}, "key_rate_limit '10/d' is not a rate"),
    ({"partition_mode": "Exclusive", "key_concurrency": 2}, "run one delivery at a time already"),
    ({"partition_mode": "Ordered", "key_concurrency": 3}, "use partition_mode 'None'"),
])
def test_bad_limits_are_refused_with_what_to_change(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        sub(**fields)


def test_key_concurrency_one_fits_every_mode_and_adds_nothing_to_exclusive_or_ordered() -> None:
    assert sub(key_concurrency=1).flow_limited
    assert not sub(partition_mode="Exclusive", key_concurrency=1).flow_limited
    assert not sub(partition_mode="Ordered", key_concurrency=1).flow_limited


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[RoutineTransport]:
    transport = create_database_transport(database_url)
    await transport.open()
    await transport.migrate()
    yield transport
    await transport.close()


async def test_the_limits_round_trip_through_the_memory_transport() -> None:
    await test_the_limits_round_trip_through_the_store(MemoryTransport())


async def test_the_limits_round_trip_through_the_store(store: Any) -> None:
    topic, name = unique("t"), unique("s")
    declared = Subscription(name=name, topic=topic, handler_key="h", **LIMITS)
    await store.sync_topology([Topic(name=topic)], [declared])
    [stored] = [s for s in await store.list_subscriptions() if s.name == name]
    assert stored.flow_limits() == LIMITS
    # A changed definition changes the limits; removing one removes it.
    await store.sync_topology([Topic(name=topic)], [declared.model_copy(update={"rate_limit": None,
                                                                                "max_in_flight": 7})])
    [stored] = [s for s in await store.list_subscriptions() if s.name == name]
    assert stored.flow_limits() == {"max_in_flight": 7, "key_concurrency": 3, "key_rate_limit": "10/m"}


async def test_a_limited_claim_counts_time_from_when_it_holds_the_lock(pg_url: str) -> None:
    """A claim that waited for the limited claim's lock reads the time once it holds it: read at
    the start of its transaction, it set the bucket's time back behind the claim before it, and
    the next claim refilled that second twice (20 claimed at once under a burst of 10)."""
    store = create_database_transport(pg_url)
    await store.open()
    late = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    try:
        topic, name = unique("t"), unique("s")
        await store.sync_topology([Topic(name=topic)], [Subscription(name=name, topic=topic, handler_key="h",
                                                                     rate_limit="10/s")])
        await store.publish(topic, [prepare(PublishRequest(payload=i)) for i in range(40)])
        async with late.transaction():  # its now() is this moment: a claim that waits a second for the lock
            await late.execute("SELECT now()")
            await asyncio.sleep(1.0)
            first = await store.claim(name, 5)  # the bucket's full burst of 10, less 5, at T + 1 s
            waited = await late.fetch("SELECT delivery_id FROM workqueue.claim($1, 5) WHERE delivery_id IS NOT NULL",
                                      name)
        after = await store.claim(name, 10)  # at once: the bucket refilled only the moments since
        assert (len(first), len(waited)) == (5, 5)
        assert len(after) < 5, f"{len(after)} claimed at once after the bucket was spent"
    finally:
        await late.close()
        await store.close()
