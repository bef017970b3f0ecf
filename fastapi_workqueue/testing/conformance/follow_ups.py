"""settle_with_follow_ups: a completion and the messages it publishes (a chain's next job) are one
transaction. The follow-ups exist if and only if the completion was written."""

from __future__ import annotations

import json
import uuid

import pytest

from fastapi_workqueue.core.envelope import PreparedMessage, PublishRequest, prepare
from fastapi_workqueue.core.errors import TransportError
from fastapi_workqueue.core.outcomes import FollowUp
from fastapi_workqueue.core.transport import ClaimedDelivery, Settlement

from .harness import Harness, World, cancel_refused, make_world, unique


def messages(*payloads: object) -> list[PreparedMessage]:
    return [prepare(PublishRequest(message_id=uuid.uuid4(), payload=p)) for p in payloads]


def completion(delivery: ClaimedDelivery, *follow_ups: FollowUp) -> Settlement:
    return Settlement(delivery.delivery_id, delivery.lease_token, "Complete", follow_ups=follow_ups)


async def chain(harness: Harness) -> tuple[World, World, ClaimedDelivery]:
    """A delivery claimed on one topic, and a second topic its follow-ups go to."""
    first = await make_world(
        harness.transport, [{"role": "a", "lease_seconds": 30, "backoff_base_seconds": 0, "backoff_max_seconds": 0}]
    )
    then = await make_world(harness.transport, [{"role": "b"}])
    await first.publish_one(payload="step 1")
    return first, then, await first.claim_one("a")


async def test_a_completion_publishes_its_follow_ups(harness: Harness) -> None:
    first, then, delivery = await chain(harness)
    other = await make_world(harness.transport, [{"role": "c"}])
    to_b, to_c = messages("step 2", "step 2 again"), messages("audit")
    result = await harness.transport.settle_with_follow_ups(
        completion(delivery, FollowUp(then.topic, to_b), FollowUp(other.topic, to_c)))
    assert result == "Completed"
    assert await first.status(delivery.delivery_id) == "Completed"
    claimed = await then.claim("b", 10)
    assert [c.message_id for c in claimed] == [m.message_id for m in to_b]
    assert [c.payload_json for c in claimed] == ['"step 2"', '"step 2 again"']
    assert [c.message_id for c in await other.claim("c", 10)] == [to_c[0].message_id]


async def test_a_stale_token_publishes_nothing(harness: Harness) -> None:
    first, then, delivery = await chain(harness)
    await harness.expire_lease(delivery.delivery_id)
    await harness.transport.sweep()
    again = await first.claim_one("a")
    follow_ups = messages("step 2")
    result = await harness.transport.settle_with_follow_ups(completion(delivery, FollowUp(then.topic, follow_ups)))
    assert result == "LeaseLost"
    assert await harness.transport.known_messages([m.message_id for m in follow_ups]) == set()
    assert await then.claim("b") == []
    assert await first.status(again.delivery_id) == "InFlight"


async def test_a_cancelled_delivery_is_discarded_and_publishes_nothing(harness: Harness) -> None:
    first, then, delivery = await chain(harness)
    follow_ups = messages("step 2")
    if await cancel_refused(harness, first, "a", delivery, "stop"):
        # No cancel (SQS): the completion publishes its follow-ups as any other.
        result = await harness.transport.settle_with_follow_ups(completion(delivery, FollowUp(then.topic, follow_ups)))
        assert result == "Completed"
        assert [c.message_id for c in await then.claim("b", 10)] == [follow_ups[0].message_id]
        return
    assert (await harness.transport.discard(first["a"], delivery.delivery_id, "stop")).result == "CancelRequested"
    result = await harness.transport.settle_with_follow_ups(completion(delivery, FollowUp(then.topic, follow_ups)))
    assert result == "Discarded"
    assert await first.status(delivery.delivery_id) == "Discarded"
    assert await harness.transport.known_messages([m.message_id for m in follow_ups]) == set()


@pytest.mark.parametrize("refusal", ["unknown topic", "too large", "conflict"])
async def test_a_refused_follow_up_rolls_the_completion_back(harness: Harness, refusal: str) -> None:
    first, then, delivery = await chain(harness)
    fine, refused = messages("step 2", "step 3")
    topic = then.topic
    named = refused.message_id  # the message the error names: the one refused, not one aborted with it
    if refusal == "unknown topic":
        topic, code, named = unique("no-such-topic"), "UnknownTopic", fine.message_id  # both refused: the first
    elif refusal == "too large":
        small = await make_world(harness.transport, [{"role": "s"}], max_payload_bytes=64)
        topic, code = small.topic, "EnvelopeTooLarge"
        refused = prepare(PublishRequest(message_id=refused.message_id, payload="x" * 200))
        fine = prepare(PublishRequest(message_id=fine.message_id, payload="small"))
    else:
        [stored] = await then.publish(PublishRequest(message_id=refused.message_id, payload="other content"))
        assert stored.status.value == "Accepted"
        then_claimed = await then.claim_one("b")
        await then.settle(then_claimed)
        code = "MessageIDConflict"
    with pytest.raises(TransportError) as raised:
        await harness.transport.settle_with_follow_ups(completion(delivery, FollowUp(topic, [fine, refused])))
    text = str(raised.value)
    assert str(named) in text and code in text and "not settled" in text, text
    assert not raised.value.retryable
    # Nothing of the transaction stays: the delivery is InFlight under the same lease, and the
    # follow-up accepted before the refused one was not published.
    assert await first.status(delivery.delivery_id) == "InFlight"
    assert fine.message_id not in await harness.transport.known_messages([fine.message_id])
    assert await then.claim("b") == []
    assert await first.settle(delivery) == "Completed"


async def test_a_follow_up_stored_already_with_the_same_content_is_a_duplicate_and_still_completes(
    harness: Harness,
) -> None:
    _, then, delivery = await chain(harness)
    [follow_up] = messages("step 2")
    [stored] = await harness.transport.publish(then.topic, [follow_up])
    assert stored.status.value == "Accepted"
    result = await harness.transport.settle_with_follow_ups(completion(delivery, FollowUp(then.topic, [follow_up])))
    assert result == "Completed"
    assert [c.message_id for c in await then.claim("b", 10)] == [follow_up.message_id]  # once, not twice


async def test_a_completion_without_follow_ups_is_a_plain_settle(harness: Harness) -> None:
    first, _, delivery = await chain(harness)
    assert await harness.transport.settle_with_follow_ups(completion(delivery)) == "Completed"
    retried = await first.publish_one(payload="again")
    again = await first.claim_one("a")
    assert again.message_id == retried.message_id
    retry = Settlement(again.delivery_id, again.lease_token, "Retry", reason="later", delay_seconds=30,
                       follow_ups=(FollowUp(first.topic, messages("never")),))
    assert await harness.transport.settle_with_follow_ups(retry) == "Pending"
    [pending] = await harness.transport.list_deliveries(first["a"], "Pending")
    assert pending.delivery_id == again.delivery_id and pending.reason == "later"


async def test_completions_settled_together_publish_what_each_would_alone(harness: Harness) -> None:
    first = await make_world(harness.transport, [{"role": "a", "max_attempts": 3}])
    then = await make_world(harness.transport, [{"role": "b"}])
    for step in ("one", "two", "three"):
        await first.publish_one(payload=step)
    one, two, three = await first.claim("a", 3)
    to_one, to_two, never = messages("1a", "1b"), messages("2a"), messages("not while retried")
    settlements = [completion(one, FollowUp(then.topic, to_one)), completion(two, FollowUp(then.topic, to_two)),
                   Settlement(three.delivery_id, three.lease_token, "Retry", delay_seconds=30,
                              follow_ups=(FollowUp(then.topic, never),))]
    answers = await harness.transport.settle_together(settlements)
    if answers is None:  # a store without such a transaction (a broker): nothing is written
        assert [await first.status(d.delivery_id) for d in (one, two, three)] == ["InFlight"] * 3
        assert await then.claim("b") == []
        return
    assert answers == ["Completed", "Completed", "Pending"]
    assert [await first.status(d.delivery_id) for d in (one, two, three)] == ["Completed", "Completed", "Pending"]
    # In the order the completions and their follow-ups were given; nothing from the retried one.
    assert [c.message_id for c in await then.claim("b", 10)] == [m.message_id for m in to_one + to_two]
    assert await harness.transport.known_messages([never[0].message_id]) == set()


async def test_a_refused_follow_up_writes_none_of_the_settlements_together(harness: Harness) -> None:
    first = await make_world(harness.transport, [{"role": "a"}])
    then = await make_world(harness.transport, [{"role": "b"}])
    for step in ("one", "two"):
        await first.publish_one(payload=step)
    one, two = await first.claim("a", 2)
    fine, lost = messages("fine"), messages("to no topic")
    answers = await harness.transport.settle_together(
        [completion(one, FollowUp(then.topic, fine)), completion(two, FollowUp(unique("no-such-topic"), lost))])
    assert answers is None
    assert [await first.status(d.delivery_id) for d in (one, two)] == ["InFlight", "InFlight"]
    assert await harness.transport.known_messages([fine[0].message_id]) == set()
    # Each on its own: the first completes with its follow-up, the second is refused as before.
    assert await harness.transport.settle_with_follow_ups(completion(one, FollowUp(then.topic, fine))) == "Completed"
    assert [c.message_id for c in await then.claim("b", 10)] == [fine[0].message_id]
    with pytest.raises(TransportError):
        await harness.transport.settle_with_follow_ups(completion(two, FollowUp(unique("no-such-topic"), lost)))
    assert await first.status(two.delivery_id) == "InFlight"


async def test_a_completion_frees_the_deduplication_keys_it_names_and_nothing_else_does(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 3}])
    key = unique("unique-job")

    async def second_dispatch() -> str:
        [answer] = await world.publish(PublishRequest(payload="again", deduplication_key=key,
                                                      deduplication_ttl_seconds=3600))
        return answer.status.value

    await world.publish_one(payload="first", deduplication_key=key, deduplication_ttl_seconds=3600)
    delivery = await world.claim_one("a")
    frees = ((world.topic, key, delivery.message_id),)
    retry = Settlement(delivery.delivery_id, delivery.lease_token, "Retry", delay_seconds=0, frees=frees)
    assert await harness.transport.settle_with_follow_ups(retry) == "Pending"
    assert await second_dispatch() == "Duplicate"  # a retry ends nothing: the key stays held
    again = await world.claim_one("a")
    stale = Settlement(delivery.delivery_id, delivery.lease_token, "Complete", frees=frees)
    assert await harness.transport.settle_with_follow_ups(stale) == "LeaseLost"
    assert await second_dispatch() == "Duplicate"  # nor does a completion whose lease was lost
    done = Settlement(again.delivery_id, again.lease_token, "Complete", frees=frees)
    assert await harness.transport.settle_with_follow_ups(done) == "Completed"
    assert await second_dispatch() == "Accepted"


async def test_completions_settled_together_free_their_keys(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    keys = [unique("unique-job") for _ in range(2)]
    for key in keys:
        await world.publish_one(payload=key, deduplication_key=key, deduplication_ttl_seconds=3600)
    claimed = {json.loads(d.payload_json or "null"): d for d in await world.claim("a", 2)}
    answers = await harness.transport.settle_together([
        Settlement(claimed[key].delivery_id, claimed[key].lease_token, "Complete",
                   frees=((world.topic, key, claimed[key].message_id),)) for key in keys])
    again = await world.publish(*[PublishRequest(payload="again", deduplication_key=key,
                                                 deduplication_ttl_seconds=3600) for key in keys])
    if answers is None:  # a store without such a transaction: nothing is written, the keys stay held
        assert [a.status.value for a in again] == ["Duplicate", "Duplicate"]
        return
    assert answers == ["Completed", "Completed"]
    assert [a.status.value for a in again] == ["Accepted", "Accepted"]
