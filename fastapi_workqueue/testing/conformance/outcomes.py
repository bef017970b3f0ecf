"""Conformance C14–C18: outcomes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from fastapi_workqueue.core.envelope import PublishRequest
from fastapi_workqueue.core.transport import Settlement

from .harness import Harness, eventually, harness_now, make_world


async def test_c14_complete_is_never_delivered_again(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "lease_seconds": 30}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    assert await world.settle(delivery) == "Completed"
    await harness.advance(delivery.delivery_id, 60)  # past the lease it had and any retry delay
    await harness.transport.sweep()
    assert await world.claim("a") == []
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "Completed" and info.settled_at is not None


async def test_c15_retry_with_delay_is_invisible_until_the_delay_passes(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    assert await world.settle(delivery, "Retry", reason="rate limited", delay_seconds=30) == "Pending"
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "Pending" and info.attempt == 1 and info.reason == "rate limited"
    assert await world.claim("a") == []
    await harness.advance(delivery.delivery_id, 25)
    assert await world.claim("a") == []
    await harness.advance(delivery.delivery_id, 6)
    again = await world.claim_one("a")
    assert again.attempt == 2


class KnownDraws:
    """A jitter source whose draws the test chose (the transports take any ``random()``)."""

    def __init__(self, draws: list[float]) -> None:
        self.draws = list(draws)
        self.taken = 0

    def random(self) -> float:
        draw = self.draws[self.taken % len(self.draws)]
        self.taken += 1
        return draw


@contextlib.asynccontextmanager
async def transport_with_rng(harness: Harness, rng: KnownDraws) -> AsyncIterator[Any]:
    """Another transport on the harness's store, built as ``type(transport)(transport.url, rng=, clock=)``
    (a transport that cannot be built so skips the case that needs it)."""
    if not isinstance(getattr(harness.transport, "url", None), str):
        pytest.skip(f"{harness.name}: the case rebuilds the transport on the same store with a known random source, "
                    "as type(transport)(transport.url, rng=..., clock=...); this transport has no url")
    clock = getattr(harness.transport, "clock", None)  # the harness's clock, where it moves one
    build: Any = type(harness.transport)
    transport = build(harness.transport.url, rng=rng, clock=clock)  # type: ignore[attr-defined]
    await transport.open()
    try:
        yield transport
    finally:
        await transport.close()


async def test_c16_retry_without_delay_uses_full_jitter_backoff(harness: Harness) -> None:
    """The delay is u x min(max, base x 2^(attempt - 1)) with u drawn per settled item from the
    transport's random source: with known draws, the exact delays."""
    world = await make_world(
        harness.transport, [{"role": "a", "backoff_base_seconds": 10, "backoff_max_seconds": 25, "max_attempts": 10}]
    )
    await world.publish(*[PublishRequest(payload=i) for i in range(12)])
    draws = [0.5 + 0.04 * i for i in range(12)]  # none near 0: each delay is 5 s or more
    rng = KnownDraws(draws)
    async with transport_with_rng(harness, rng) as transport:
        claimed = await transport.claim(world["a"], 20)
        assert len(claimed) == 12
        for delivery, draw in zip(claimed, draws, strict=True):
            before = datetime.now(UTC)
            [result] = await transport.settle([Settlement(delivery.delivery_id, delivery.lease_token, "Fail",
                                                          error="boom")])
            after = datetime.now(UTC)
            assert result == "Pending"
            info = await transport.get_delivery(delivery.delivery_id)
            assert info is not None and info.visible_at is not None
            # attempt 1: u x min(25, 10 x 2^0) = 10 u, counted from the settle's time
            expected, visible = 10 * draw, info.visible_at.timestamp()
            assert before.timestamp() + expected - 0.05 <= visible <= after.timestamp() + expected + 0.05, (
                draw, info.visible_at, before, after)
        assert rng.taken == 12
        assert await transport.claim(world["a"], 20) == []


async def test_c16_full_jitter_is_spread_over_the_whole_range(harness: Harness) -> None:
    """With the default source (the system's), the draws differ and stay within the bound."""
    world = await make_world(
        harness.transport, [{"role": "a", "backoff_base_seconds": 10, "backoff_max_seconds": 25, "max_attempts": 10}]
    )
    await world.publish(*[PublishRequest(payload=i) for i in range(40)])
    claimed = await world.claim("a", 40)
    before = datetime.now(UTC)
    results = await harness.transport.settle(
        [Settlement(d.delivery_id, d.lease_token, "Fail", error="boom") for d in claimed])
    assert results == ["Pending"] * 40
    delays = []
    for delivery in claimed:
        info = await harness.transport.get_delivery(delivery.delivery_id)
        assert info is not None and info.visible_at is not None
        delays.append((info.visible_at - before).total_seconds())
    assert all(-0.5 <= d <= 10.5 for d in delays), delays
    # 40 draws of uniform(0, 10): all in one half has odds of 2^-39; fewer than 10 distinct
    # tenths of a second is as unlikely.
    assert min(delays) < 5 < max(delays), delays
    assert len({round(d, 1) for d in delays}) >= 10, delays


async def test_c16_backoff_grows_and_is_capped(harness: Harness) -> None:
    world = await make_world(
        harness.transport,
        [{"role": "a", "backoff_base_seconds": 0.01, "backoff_max_seconds": 0.02, "max_attempts": 20}],
    )
    await world.publish_one(payload=1)
    for _ in range(6):
        [delivery] = await eventually(lambda: world.claim("a", 1))
        before = harness_now(harness)
        await world.settle(delivery, "Fail", error="boom")
        info = await harness.transport.get_delivery(delivery.delivery_id)
        assert info is not None and info.visible_at is not None
        assert (info.visible_at - before).total_seconds() <= 0.02 + 0.5
        await harness.advance(delivery.delivery_id, 0.05)  # past the capped backoff


async def test_c17_failure_on_last_attempt_dead_letters_with_reason_and_error(harness: Harness) -> None:
    world = await make_world(
        harness.transport, [{"role": "a", "max_attempts": 2, "backoff_base_seconds": 0, "backoff_max_seconds": 0}]
    )
    await world.publish_one(payload=1)
    first = await world.claim_one("a")
    assert await world.settle(first, "Fail", reason="ValueError", error="ValueError: first") == "Pending"
    second = await world.claim_one("a")
    assert second.attempt == 2
    assert await world.settle(second, "Fail", reason="ValueError", error="ValueError: second") == "DeadLettered"
    info = await harness.transport.get_delivery(second.delivery_id)
    assert info is not None and info.status == "DeadLettered"
    assert info.last_error == "ValueError: second"
    assert "ValueError" in (info.reason or "")
    assert await world.claim("a") == []


async def test_c17_explicit_retry_on_last_attempt_dead_letters(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 1}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    assert await world.settle(delivery, "Retry", reason="upstream down", delay_seconds=0) == "DeadLettered"
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and "upstream down" in (info.reason or "")


async def test_c18_dead_letter_outcome_dead_letters_at_once(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 5}])
    await world.publish_one(payload=1)
    delivery = await world.claim_one("a")
    assert await world.settle(delivery, "DeadLetter", reason="poison input") == "DeadLettered"
    info = await harness.transport.get_delivery(delivery.delivery_id)
    assert info is not None and info.status == "DeadLettered" and info.attempt == 1
    assert info.reason == "poison input"


async def test_publish_policy_overrides_are_kept_on_the_delivery(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 5}])
    await world.publish(PublishRequest(payload=1, max_attempts=2, backoff_seconds=[30, 60]))
    first = await world.claim_one("a")
    assert first.max_attempts == 2
    before = datetime.now(UTC)
    assert await world.settle(first, "Fail", error="x") == "Pending"
    info = await harness.transport.get_delivery(first.delivery_id)
    assert info is not None and info.visible_at is not None
    # The first step of the published schedule, not the subscription's backoff (at most 1 s).
    assert 29.9 <= (info.visible_at - before).total_seconds() <= 45
    assert await world.claim("a") == []
    await harness.advance(first.delivery_id, 31)
    second = await world.claim_one("a")
    assert await world.settle(second, "Fail", error="x") == "DeadLettered"


async def test_publish_delay_and_not_before_hold_the_message_back(harness: Harness) -> None:
    from datetime import timedelta

    world = await make_world(harness.transport, [{"role": "a"}])
    # not_before: 30 s after the time the transport's rules run at (the first message moved it on).
    requests: list[Callable[[], PublishRequest]] = [
        lambda: PublishRequest(payload="later", delay_seconds=30),
        lambda: PublishRequest(payload="at", not_before=harness_now(harness) + timedelta(seconds=30)),
    ]
    for request in requests:
        await world.publish(request())
        assert await world.claim("a") == []
        [held] = await harness.transport.list_deliveries(world["a"], "Pending")
        await harness.advance(held.delivery_id, 25)
        assert await world.claim("a") == []
        await harness.advance(held.delivery_id, 6)
        [claimed] = await world.claim("a")
        assert claimed.delivery_id == held.delivery_id
        await world.settle(claimed)
