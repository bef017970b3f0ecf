"""Stored results (:mod:`fastapi_workqueue.core.message_state`): a completion keeps its result in
the transaction that completes the delivery, a settle that does not complete it keeps none, and the
retention purge removes it with its message."""

from __future__ import annotations

import uuid

from ...core.message_state import MessageState
from ...core.ports import Ports
from ...core.transport import ClaimedDelivery, Settlement
from .harness import Harness, cancel_refused, make_world, require


def state_of(harness: Harness) -> MessageState:
    require(harness, "message_state", "a stored result")
    state = Ports.of(harness.transport).state
    assert state is not None, f"{harness.name}: capability message_state without a MessageState port"
    return state


def completion(delivery: ClaimedDelivery, result: str, kind: str = "Complete") -> Settlement:
    return Settlement(delivery.delivery_id, delivery.lease_token, kind, result_json=result)  # type: ignore[arg-type]


async def test_a_completion_keeps_its_result(harness: Harness) -> None:
    state = state_of(harness)
    world = await make_world(harness.transport, [{"role": "a"}])
    with_result = await world.publish_one(payload="report")
    without = await world.publish_one(payload="plain")
    first, second = await world.claim("a", 2)
    assert await harness.transport.settle_with_follow_ups(completion(first, '{"value":{"rows":3}}')) == "Completed"
    assert await world.settle(second) == "Completed"
    assert await state.result_get(first.message_id) == '{"value":{"rows":3}}'
    assert await state.result_get(second.message_id) is None
    assert {with_result.message_id, without.message_id} == {first.message_id, second.message_id}
    assert await state.result_get(uuid.uuid4()) is None


async def test_a_settle_that_does_not_complete_keeps_no_result(harness: Harness) -> None:
    state = state_of(harness)
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 3}])
    await world.publish_one(payload="job")
    delivery = await world.claim_one("a")
    # A retry with a result (a transport must not keep it), then a completion with a stale token.
    assert await harness.transport.settle_with_follow_ups(completion(delivery, '"early"', "Retry")) == "Pending"
    assert await state.result_get(delivery.message_id) is None
    assert await harness.transport.settle_with_follow_ups(completion(delivery, '"stale"')) == "LeaseLost"
    assert await state.result_get(delivery.message_id) is None
    await harness.advance(delivery.delivery_id, 3600)
    again = await world.claim_one("a")
    if await cancel_refused(harness, world, "a", again, "stop"):
        return
    await harness.transport.discard(world["a"], again.delivery_id, "stop")
    assert await harness.transport.settle_with_follow_ups(completion(again, '"cancelled"')) == "Discarded"
    assert await state.result_get(again.message_id) is None


async def test_a_result_is_purged_with_its_message(harness: Harness) -> None:
    require(harness, "sweeps", "the retention purge")
    state = state_of(harness)
    world = await make_world(harness.transport, [{"role": "a", "retention_seconds": 0}])
    await world.publish_one(payload="job")
    delivery = await world.claim_one("a")
    assert await harness.transport.settle_with_follow_ups(completion(delivery, '"done"')) == "Completed"
    assert await state.result_get(delivery.message_id) == '"done"'
    for _ in range(50):  # a pass purges at most its limit; other tests' rows may be due too
        await harness.transport.sweep()
        if not await harness.transport.known_messages([delivery.message_id]):
            break
    assert await harness.transport.known_messages([delivery.message_id]) == set()
    assert await state.result_get(delivery.message_id) is None
