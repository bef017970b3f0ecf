"""Message state (:mod:`fastapi_workqueue.core.message_state`): a completion keeps its result in
the transaction that completes the delivery, a settle that does not complete it keeps none, and the
retention purge removes it with its message; a debounce replaces the payload of the message that
holds a key while it waits out its window, and frees the key of one that no longer waits; a group
releases its held message once, when the last of its members ended (completed, dead-lettered by a
settle or a lease expiry, or discarded), and a member counts once."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta

from ...core.envelope import PreparedMessage, PublishRequest, prepare
from ...core.message_state import HELD_UNTIL, MessageState
from ...core.ports import Ports
from ...core.transport import ClaimedDelivery, Settlement
from .harness import Harness, cancel_refused, harness_now, make_world, require


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


# -- debounce --------------------------------------------------------------------------------------


def debounced(payload: object, key: str, due: datetime) -> PreparedMessage:
    return prepare(PublishRequest(payload=payload, deduplication_key=key, deduplication_ttl_seconds=60,
                                  not_before=due))


async def test_debounce_replaces_the_payload_of_a_waiting_message_and_pushes_it(harness: Harness) -> None:
    state = state_of(harness)
    world = await make_world(harness.transport, [{"role": "a"}])
    first = debounced({"n": 1}, "user:7", harness_now(harness) + timedelta(seconds=60))
    [accepted] = await harness.transport.publish(world.topic, [first])
    assert accepted.status.value == "Accepted"
    assert await state.debounce(world.topic, "user:8", debounced({"n": 0}, "user:8", harness_now(harness)), 60) is None
    [before] = await harness.transport.message_deliveries(first.message_id)
    await harness.advance(before.delivery_id, 20)
    later = debounced({"n": 2}, "user:7", harness_now(harness))
    assert await state.debounce(world.topic, "user:7", later, 60) == first.message_id
    [after] = await harness.transport.message_deliveries(first.message_id, include_payload=True)
    assert after.payload == {"n": 2} and after.status == "Pending"
    assert after.visible_at is not None and abs((after.visible_at - harness_now(harness)).total_seconds() - 60) < 5
    # Still one message and one delivery; not claimable before its new time, claimable after it.
    await harness.advance(before.delivery_id, 45)
    assert await world.claim("a") == []
    await harness.advance(before.delivery_id, 20)
    [claimed] = await world.claim("a")
    assert claimed.message_id == first.message_id and json.loads(claimed.payload_json or "null") == {"n": 2}


async def test_debounce_frees_the_key_of_a_message_that_no_longer_waits(harness: Harness) -> None:
    state = state_of(harness)
    world = await make_world(harness.transport, [{"role": "a"}])
    first = debounced("first", "k", harness_now(harness) + timedelta(seconds=30))
    await harness.transport.publish(world.topic, [first])
    [info] = await harness.transport.message_deliveries(first.message_id)
    await harness.advance(info.delivery_id, 31)  # its window passed: it is due
    second = debounced("second", "k", harness_now(harness) + timedelta(seconds=30))
    assert await state.debounce(world.topic, "k", second, 30) is None
    [fresh] = await harness.transport.publish(world.topic, [second])  # the key is free for a new message
    assert fresh.status.value == "Accepted"
    # A claimed (running) message is not replaced either: the key is freed for the next one.
    [running] = await world.claim("a")
    assert running.message_id == first.message_id
    other = await make_world(harness.transport, [{"role": "b"}])
    third = debounced("third", "t", harness_now(harness) + timedelta(seconds=30))
    await harness.transport.publish(other.topic, [third])
    await harness.advance(running.delivery_id, 31)
    [taken] = await other.claim("b")
    assert taken.message_id == third.message_id
    fourth = debounced("fourth", "t", harness_now(harness) + timedelta(seconds=30))
    assert await state.debounce(other.topic, "t", fourth, 30) is None
    [after] = await harness.transport.publish(other.topic, [fourth])
    assert after.status.value == "Accepted"
    [still] = await harness.transport.message_deliveries(third.message_id, include_payload=True)
    assert still.payload == "third" and still.status == "InFlight"


# -- groups ----------------------------------------------------------------------------------------


async def test_a_group_releases_its_held_message_once_every_member_ended(harness: Harness) -> None:
    state = state_of(harness)
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 1}])
    members = [prepare(PublishRequest(payload=f"member {i}")) for i in range(4)]
    then = prepare(PublishRequest(payload="then", not_before=HELD_UNTIL))
    await harness.transport.publish(world.topic, [*members, then])
    group = uuid.uuid4()
    assert await state.group_create(group, [m.message_id for m in members], then.message_id) == 4
    claimed = {c.message_id: c for c in await world.claim("a", 10)}
    assert set(claimed) == {m.message_id for m in members}  # the held message is not claimable
    first, second, third, fourth = (claimed[m.message_id] for m in members)
    assert await world.settle(first) == "Completed"
    assert await world.settle(second, "DeadLetter", reason="poison") == "DeadLettered"
    if not await cancel_refused(harness, world, "a", third, "not wanted"):
        discarded = await harness.transport.discard(world["a"], third.delivery_id, "not wanted")
        assert discarded.cancel_requested
        assert await world.settle(third) == "Discarded"  # cancel requested: it ends Discarded
    assert await world.claim("a") == []
    # The last member's lease runs out on its only attempt: the sweep dead-letters it and that end,
    # too, counts.
    await harness.expire_lease(fourth.delivery_id)
    await harness.transport.sweep()
    assert await world.status(fourth.delivery_id) == "DeadLettered"
    [released] = await world.claim("a")
    assert released.message_id == then.message_id
    assert await world.claim("a") == []
    listed = await state.group_members(group)
    assert [m.message_id for m in listed] == [m.message_id for m in members]
    assert [m.delivery.status if m.delivery else None for m in listed] == [
        "Completed", "DeadLettered", "Discarded", "DeadLettered"]
    assert all(m.ended_at is not None for m in listed)
    assert await state.group_members(uuid.uuid4()) == []


async def test_a_group_of_members_that_ended_already_releases_at_once(harness: Harness) -> None:
    state = state_of(harness)
    world = await make_world(harness.transport, [{"role": "a"}])
    done = await world.publish_one(payload="done already")
    [finished] = await world.drain("a")
    then = prepare(PublishRequest(payload="then", not_before=HELD_UNTIL))
    await harness.transport.publish(world.topic, [then])
    assert done.message_id is not None
    unknown = uuid.uuid4()  # no delivery: counts as ended
    assert await state.group_create(uuid.uuid4(), [done.message_id, unknown], then.message_id) == 0
    [released] = await world.claim("a")
    assert released.message_id == then.message_id and finished.message_id == done.message_id


async def test_a_member_counts_once_and_a_retry_does_not_end_it(harness: Harness) -> None:
    state = state_of(harness)
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 3}])
    members = [prepare(PublishRequest(payload=f"m{i}")) for i in range(2)]
    then = prepare(PublishRequest(payload="then", not_before=HELD_UNTIL))
    await harness.transport.publish(world.topic, [*members, then])
    group = uuid.uuid4()
    await state.group_create(group, [m.message_id for m in members], then.message_id)
    one, two = await world.claim("a", 2)
    assert await world.settle(one, "Retry", delay_seconds=0) == "Pending"  # not an end
    assert await world.settle(two) == "Completed"
    again = await world.claim_one("a")
    assert again.message_id == one.message_id  # the held message is still held
    assert await world.settle(again, "DeadLetter", reason="gave up") == "DeadLettered"
    await harness.transport.replay(world["a"], again.delivery_id, "try once more")
    replayed = await world.claim_one("a")
    assert replayed.message_id in (one.message_id, then.message_id)
    # The then message was released by the first end; the replayed member does not count twice.
    rest = await world.claim("a", 10)
    got = {replayed.message_id, *(c.message_id for c in rest)}
    assert got == {one.message_id, then.message_id}


async def test_completions_settled_together_keep_their_results(harness: Harness) -> None:
    state = state_of(harness)
    world = await make_world(harness.transport, [{"role": "a"}])
    for payload in ("report", "count", "plain"):
        await world.publish_one(payload=payload)
    report, counted, plain = await world.claim("a", 3)
    answers = await harness.transport.settle_together([
        completion(report, '{"value":{"rows":3}}'), completion(counted, '{"value":7}'),
        Settlement(plain.delivery_id, plain.lease_token, "Complete"),
    ])
    if answers is None:  # a store without such a transaction: nothing is written
        assert await state.result_get(report.message_id) is None
        assert await world.status(report.delivery_id) == "InFlight"
        return
    assert answers == ["Completed", "Completed", "Completed"]
    assert await state.result_get(report.message_id) == '{"value":{"rows":3}}'
    assert await state.result_get(counted.message_id) == '{"value":7}'
    assert await state.result_get(plain.message_id) is None
