"""The store operations the jobs layer needs beyond claim and settle, on every transport: freeing a
unique job's deduplication key, durable step results, which messages the store has, a message's
deliveries, pruning dead letters, and rewriting a payload."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from fastapi_workqueue.core.envelope import PublishRequest, prepare
from fastapi_workqueue.core.errors import TransportError

from .harness import Harness, age, harness_now, make_world

# -- deduplication keys ----------------------------------------------------------------------------


async def test_the_holder_frees_its_deduplication_key_and_no_one_else_can(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    held = await world.publish_one(payload=1, deduplication_key="invoice-7", deduplication_ttl_seconds=600)
    [duplicate] = await world.publish(PublishRequest(payload=2, deduplication_key="invoice-7"))
    assert duplicate.status.value == "Duplicate" and duplicate.message_id == held.message_id
    assert held.message_id is not None

    # Another message's id (a later job's) does not free it; neither does another topic's name.
    other = await make_world(harness.transport, [{"role": "b"}])
    assert await harness.transport.release_deduplication_key(world.topic, "invoice-7", uuid.uuid4()) is False
    assert await harness.transport.release_deduplication_key(other.topic, "invoice-7", held.message_id) is False
    [still] = await world.publish(PublishRequest(payload=3, deduplication_key="invoice-7"))
    assert still.status.value == "Duplicate"

    assert await harness.transport.release_deduplication_key(world.topic, "invoice-7", held.message_id) is True
    assert await harness.transport.release_deduplication_key(world.topic, "invoice-7", held.message_id) is False
    [fresh] = await world.publish(PublishRequest(payload=4, deduplication_key="invoice-7"))
    assert fresh.status.value == "Accepted" and fresh.message_id != held.message_id


async def test_an_expired_deduplication_key_was_not_held(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    held = await world.publish_one(payload=1, deduplication_key="k", deduplication_ttl_seconds=60)
    assert held.message_id is not None
    await harness.advance_deduplication(world.topic, "k", 61)
    assert await harness.transport.release_deduplication_key(world.topic, "k", held.message_id) is False


# -- step results ----------------------------------------------------------------------------------


async def test_a_step_result_is_stored_once_and_read_back(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    job = await world.publish_one(payload="job")
    assert job.message_id is not None
    assert await harness.transport.step_get(job.message_id, "charge") == (False, None)
    await harness.transport.step_put(job.message_id, "charge", '{"charge_id": "ch_1"}')
    assert await harness.transport.step_get(job.message_id, "charge") == (True, '{"charge_id": "ch_1"}')
    # The first write wins: a second attempt that ran the step again keeps the first result.
    await harness.transport.step_put(job.message_id, "charge", '{"charge_id": "ch_2"}')
    assert await harness.transport.step_get(job.message_id, "charge") == (True, '{"charge_id": "ch_1"}')
    # Steps are per message and name; JSON null is a stored value.
    await harness.transport.step_put(job.message_id, "email", "null")
    assert await harness.transport.step_get(job.message_id, "email") == (True, "null")
    other = await world.publish_one(payload="another job")
    assert other.message_id is not None
    assert await harness.transport.step_get(other.message_id, "charge") == (False, None)


async def test_a_step_of_a_message_the_store_does_not_have_is_refused(harness: Harness) -> None:
    missing = uuid.uuid4()
    with pytest.raises(TransportError, match=f"message {missing} is not stored"):
        await harness.transport.step_put(missing, "charge", "1")
    with pytest.raises(TypeError, match="JSON text"):
        await harness.transport.step_put(missing, "charge", {"not": "text"})  # type: ignore[arg-type]


async def test_the_purge_of_a_message_removes_its_steps(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "retention_seconds": 0}])
    job = await world.publish_one(payload="job")
    assert job.message_id is not None
    await harness.transport.step_put(job.message_id, "charge", '"done"')
    [delivery] = await world.drain("a")
    for _ in range(50):  # a pass purges at most its limit; other tests' rows may be due too
        await harness.transport.sweep()
        if not await harness.transport.known_messages([job.message_id]):
            break
    assert await harness.transport.get_delivery(delivery.delivery_id) is None
    assert await harness.transport.known_messages([job.message_id]) == set()
    assert await harness.transport.step_get(job.message_id, "charge") == (False, None)
    # The MessageID is free again, and the new message has no steps.
    again = await world.publish_one(message_id=job.message_id, payload="job")
    assert again.status.value == "Accepted"
    assert await harness.transport.step_get(job.message_id, "charge") == (False, None)


# -- messages and their deliveries -----------------------------------------------------------------


async def test_known_messages_answers_which_ids_are_stored(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    stored = [r.message_id for r in await world.publish(*[PublishRequest(payload=i) for i in range(3)])
              if r.message_id is not None]
    unknown = [uuid.uuid4() for _ in range(2)]
    assert await harness.transport.known_messages([unknown[0], *stored, unknown[1], stored[0]]) == set(stored)
    assert await harness.transport.known_messages(unknown) == set()
    assert await harness.transport.known_messages([]) == set()


async def test_message_deliveries_lists_each_subscriptions_delivery(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}, {"role": "b", "max_attempts": 1}])
    job = await world.publish_one(payload={"n": 1}, correlation_id="c-1")
    assert job.message_id is not None
    b = await world.claim_one("b")
    await world.settle(b, "DeadLetter", reason="poison")
    deliveries = await harness.transport.message_deliveries(job.message_id)
    assert [(d.subscription, d.status) for d in deliveries] == [(world["a"], "Pending"), (world["b"], "DeadLettered")]
    for info in deliveries:
        assert info == await harness.transport.get_delivery(info.delivery_id)
        assert info.payload is None and info.correlation_id == "c-1" and info.topic == world.topic
    with_payload = await harness.transport.message_deliveries(job.message_id, include_payload=True)
    assert [d.payload for d in with_payload] == [{"n": 1}, {"n": 1}]
    assert await harness.transport.message_deliveries(uuid.uuid4()) == []


# -- pruning dead letters --------------------------------------------------------------------------


async def test_discard_dead_letters_prunes_those_settled_before_the_time(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 1}, {"role": "b", "max_attempts": 1}])
    await world.publish(*[PublishRequest(payload=i) for i in range(4)])
    dead = []
    for _ in range(3):
        delivery = await world.claim_one("a")
        assert await world.settle(delivery, "DeadLetter", reason="poison") == "DeadLettered"
        dead.append(delivery)
    other = await world.claim_one("b")
    await world.settle(other, "DeadLetter", reason="poison")
    await age(harness, [*(old.delivery_id for old in dead), other.delivery_id], 7200)  # settled two hours ago
    delivery = await world.claim_one("a")
    assert await world.settle(delivery, "DeadLetter", reason="poison") == "DeadLettered"
    dead.append(delivery)

    cutoff = harness_now(harness) - timedelta(hours=1)
    # Batches of one: three transactions, then one that finds nothing.
    assert await harness.transport.discard_dead_letters(world["a"], cutoff, limit=1) == 3
    for old in dead[:3]:
        info = await harness.transport.get_delivery(old.delivery_id)
        assert info is not None and info.status == "Discarded" and info.reason == "pruned"
    assert await world.status(dead[3].delivery_id) == "DeadLettered"
    assert await world.status(other.delivery_id) == "DeadLettered"  # another subscription's
    [stats] = await harness.transport.stats(world["a"])
    assert (stats.dead_lettered, stats.discarded) == (1, 3)
    assert await harness.transport.discard_dead_letters(world["a"], cutoff) == 0
    assert await harness.transport.discard_dead_letters("no-such-subscription", cutoff) == 0


async def test_discard_dead_letters_unblocks_an_ordered_key(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "o", "partition_mode": "Ordered", "max_attempts": 1}])
    results = await world.publish(*[PublishRequest(partition_key="k", payload=i) for i in range(2)])
    head = await world.claim_one("o")
    await world.settle(head, "DeadLetter", reason="poison")
    assert await world.claim("o") == []
    [blocked] = await harness.transport.partitions(world["o"])
    assert blocked.condition == "Blocked"
    assert await harness.transport.discard_dead_letters(world["o"], datetime.now(UTC) + timedelta(seconds=5)) == 1
    nxt = await world.claim_one("o")
    assert nxt.message_id == results[1].message_id


async def test_discard_dead_letters_says_what_to_change_for_bad_input(harness: Harness) -> None:
    with pytest.raises(ValueError, match="aware datetime"):
        await harness.transport.discard_dead_letters("any", datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="limit must be at least 1"):
        await harness.transport.discard_dead_letters("any", datetime.now(UTC), limit=0)


# -- rewriting a payload -------------------------------------------------------------------------------


async def test_rewrite_payload_replaces_a_payload_no_delivery_has_finished_with(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a", "max_attempts": 1}, {"role": "b"}])
    job = await world.publish_one(payload={"secret": "old key"})
    assert job.message_id is not None
    dead = await world.claim_one("a")
    await world.settle(dead, "DeadLetter", reason="poison")
    new = prepare(PublishRequest(message_id=job.message_id, payload={"secret": "new key"}))
    # One delivery Pending, one DeadLettered: both will run the new payload.
    assert await harness.transport.rewrite_payload(job.message_id, new.payload_json, new.content_hash,
                                                   new.envelope_bytes) is True
    claimed = await world.claim_one("b")
    assert claimed.payload_json == new.payload_json
    # The stored content is the new one: republishing it is a Duplicate.
    [again] = await harness.transport.publish(world.topic, [new])
    assert again.status.value == "Duplicate"
    # InFlight now: refused, and nothing changes.
    newer = prepare(PublishRequest(message_id=job.message_id, payload={"secret": "newer key"}))
    assert await harness.transport.rewrite_payload(job.message_id, newer.payload_json, newer.content_hash,
                                                   newer.envelope_bytes) is False
    await world.settle(claimed)
    # Completed: still refused.
    assert await harness.transport.rewrite_payload(job.message_id, newer.payload_json, newer.content_hash,
                                                   newer.envelope_bytes) is False
    [info] = [d for d in await harness.transport.message_deliveries(job.message_id, include_payload=True)
              if d.subscription == world["a"]]
    assert info.payload == {"secret": "new key"}
    assert await harness.transport.rewrite_payload(uuid.uuid4(), '"x"', "h", 3) is False


async def test_rewrite_payload_refuses_a_discarded_delivery_and_an_envelope_over_the_cap(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}], max_payload_bytes=100)
    job = await world.publish_one(payload="small")
    assert job.message_id is not None
    with pytest.raises(TransportError, match="accepts at most 100 bytes"):
        await harness.transport.rewrite_payload(job.message_id, '"' + "x" * 150 + '"', "h", 152)
    with pytest.raises(ValueError, match="MAX_ENVELOPE_BYTES"):
        await harness.transport.rewrite_payload(job.message_id, '"x"', "h", 300 * 1024)
    [pending] = await harness.transport.list_deliveries(world["a"], "Pending")
    assert (await harness.transport.discard(world["a"], pending.delivery_id, "not wanted")).result == "Discarded"
    assert await harness.transport.rewrite_payload(job.message_id, '"x"', "h", 3) is False
