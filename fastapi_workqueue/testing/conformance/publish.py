"""Conformance C01–C08: publishing."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import text

from fastapi_workqueue.core.envelope import PublishRequest, PublishStatus
from fastapi_workqueue.core.filters import FilterError
from fastapi_workqueue.core.topology import Subscription

from ...core.ports import Ports
from .harness import Harness, make_world, require


async def test_c01_publish_accepted_reaches_every_matching_subscription_once(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}, {"role": "b"}])
    [result] = await world.publish(PublishRequest(payload={"n": 1}, attributes={"kind": "x"}))
    assert result.status is PublishStatus.ACCEPTED
    assert isinstance(result.message_id, uuid.UUID)
    for role in ("a", "b"):
        claimed = await world.claim(role, 10)
        assert [c.message_id for c in claimed] == [result.message_id]
        assert claimed[0].payload_json is not None and '"n":1' in claimed[0].payload_json.replace(" ", "")
        assert claimed[0].attributes == {"kind": "x"}
        await world.settle(claimed[0])
        assert await world.claim(role, 10) == []


async def test_c02_same_message_id_and_content_is_duplicate(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    mid = uuid.uuid4()
    [first] = await world.publish(PublishRequest(message_id=mid, payload={"v": 1}, partition_key="k"))
    [again] = await world.publish(PublishRequest(message_id=mid, payload={"v": 1}, partition_key="k"))
    assert first.status is PublishStatus.ACCEPTED
    assert again.status is PublishStatus.DUPLICATE
    assert again.message_id == mid
    assert len(await world.claim("a", 10)) == 1


async def test_c03_same_message_id_different_content_is_conflict(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    mid = uuid.uuid4()
    await world.publish(PublishRequest(message_id=mid, payload={"v": 1}))
    [conflict] = await world.publish(PublishRequest(message_id=mid, payload={"v": 2}))
    assert conflict.status is PublishStatus.MESSAGE_ID_CONFLICT
    assert conflict.error is not None and "MessageID" in conflict.error.message
    claimed = await world.claim("a", 10)
    assert len(claimed) == 1 and '"v":1' in (claimed[0].payload_json or "").replace(" ", "")


@pytest.mark.parametrize("shape", ["plain", "partition-key", "deduplication-key"])
async def test_c03_same_message_id_on_another_topic_is_conflict(harness: Harness, shape: str) -> None:
    """A MessageID is unique across topics: the same id and content published to a second topic is
    not a Duplicate (the second topic's subscriptions would never get it), but a conflict. Each
    shape takes another path of the stores' publish."""
    first = await make_world(harness.transport, [{"role": "a"}])
    second = await make_world(harness.transport, [{"role": "b"}])
    mid = uuid.uuid4()
    extra: dict[str, Any] = {
        "plain": {}, "partition-key": {"partition_key": "k"}, "deduplication-key": {"deduplication_key": "d"},
    }[shape]
    [accepted] = await first.publish(PublishRequest(message_id=mid, payload={"v": 1}, **extra))
    [elsewhere] = await second.publish(PublishRequest(message_id=mid, payload={"v": 1}, **extra))
    assert accepted.status is PublishStatus.ACCEPTED
    assert elsewhere.status is PublishStatus.MESSAGE_ID_CONFLICT, elsewhere
    assert elsewhere.error is not None and "or on another topic" in elsewhere.error.message
    # Within a call too: nothing of it is published.
    results = await second.publish(PublishRequest(payload=2), PublishRequest(message_id=mid, payload={"v": 1}, **extra))
    assert [r.status for r in results] == [PublishStatus.REJECTED, PublishStatus.MESSAGE_ID_CONFLICT]
    assert await second.claim("b", 10) == []
    [claimed] = await first.claim("a", 10)
    assert claimed.message_id == mid


@pytest.mark.parametrize("shape", ["plain", "partition-key", "deduplication-key", "batch"])
async def test_c03_retry_after_the_topic_retired_is_duplicate(harness: Harness, shape: str) -> None:
    """A producer's retry of a call the topic took before it retired answers Duplicate, as it did
    before: a refusal would read as if what it stored were lost. Anything new is TopicRetired."""
    lifecycle = Ports.of(harness.transport).lifecycle
    if lifecycle is None:
        pytest.skip(f"{harness.name}: topics cannot be retired (TopologyLifecycle)")
    world = await make_world(harness.transport, [{"role": "a"}])
    extra: dict[str, Any] = {
        "plain": {}, "partition-key": {"partition_key": "k"}, "deduplication-key": {"deduplication_key": "d"},
        "batch": {},
    }[shape]
    calls = 3 if shape == "batch" else 1
    requests = [PublishRequest(message_id=uuid.uuid4(), payload={"v": n}, **extra) for n in range(calls)]
    assert {r.status for r in await world.publish(*requests)} == {PublishStatus.ACCEPTED}
    assert (await lifecycle.set_topic_status(world.topic, "Retired")) is not None
    again = await world.publish(*requests)
    assert [(r.status, r.message_id) for r in again] == [
        (PublishStatus.DUPLICATE, r.message_id) for r in requests]
    new = [PublishRequest(message_id=r.message_id, payload={"v": "changed"}, **extra) for r in requests]
    refused = await world.publish(*new)
    assert {r.status for r in refused} == {PublishStatus.REJECTED}
    assert {r.error.code for r in refused if r.error is not None} == {"TopicRetired"}
    mixed = await world.publish(*requests, PublishRequest(payload={"v": "new"}, **extra))
    assert {r.error.code for r in mixed if r.error is not None} == {"TopicRetired"}
    assert len(await world.claim("a", 10)) == calls


async def test_c04_deduplication_key_within_ttl_is_duplicate_then_accepted_after(harness: Harness) -> None:
    # The TTL passes on the harness's clock: a real 0.6 s TTL raced the second publish on a loaded machine.
    world = await make_world(harness.transport, [{"role": "a"}])
    [first] = await world.publish(
        PublishRequest(payload={"click": 1}, deduplication_key="user-7", deduplication_ttl_seconds=30)
    )
    [second] = await world.publish(
        PublishRequest(payload={"click": 2}, deduplication_key="user-7", deduplication_ttl_seconds=30)
    )
    assert first.status is PublishStatus.ACCEPTED
    assert second.status is PublishStatus.DUPLICATE
    assert second.message_id == first.message_id
    await harness.advance_deduplication(world.topic, "user-7", 25)
    [within] = await world.publish(
        PublishRequest(payload={"click": 2}, deduplication_key="user-7", deduplication_ttl_seconds=30)
    )
    assert within.status is PublishStatus.DUPLICATE and within.message_id == first.message_id
    await harness.advance_deduplication(world.topic, "user-7", 6)
    [third] = await world.publish(
        PublishRequest(payload={"click": 3}, deduplication_key="user-7", deduplication_ttl_seconds=30)
    )
    assert third.status is PublishStatus.ACCEPTED
    assert third.message_id != first.message_id
    assert len(await world.claim("a", 10)) == 2


async def test_c04_deduplication_key_repeated_within_one_call(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    results = await world.publish(
        PublishRequest(payload=1, deduplication_key="d"), PublishRequest(payload=2, deduplication_key="d")
    )
    assert [r.status for r in results] == [PublishStatus.ACCEPTED, PublishStatus.DUPLICATE]
    assert results[1].message_id == results[0].message_id


async def test_c05_envelope_over_cap_is_rejected_with_size(harness: Harness) -> None:
    from fastapi_workqueue.core.envelope import MAX_ENVELOPE_BYTES, RequestRejected, prepare

    with pytest.raises(RequestRejected) as info:
        prepare(PublishRequest(payload="x" * MAX_ENVELOPE_BYTES))
    assert info.value.error.code == "EnvelopeTooLarge"
    # the payload is a JSON string (two quotes) and the attributes an empty object ("{}")
    assert str(MAX_ENVELOPE_BYTES + 4) in info.value.error.message

    # The topic's lower cap is enforced by the transport itself.
    world = await make_world(harness.transport, [{"role": "a"}], max_payload_bytes=100)
    [small, large] = await world.publish(PublishRequest(payload="ok"), PublishRequest(payload="y" * 200))
    assert large.status is PublishStatus.REJECTED
    assert large.error is not None and large.error.code == "EnvelopeTooLarge"
    assert "100" in large.error.message and "204" in large.error.message
    assert small.status is PublishStatus.REJECTED and small.error is not None
    assert small.error.code == "BatchAborted"
    assert await world.claim("a", 10) == []


async def test_c05_more_than_ten_attributes_is_rejected(harness: Harness) -> None:
    from fastapi_workqueue.core.envelope import RequestRejected, prepare

    with pytest.raises(RequestRejected) as info:
        prepare(PublishRequest(attributes={f"a{i}": "v" for i in range(11)}))
    assert info.value.error.code == "TooManyAttributes"
    assert "11" in info.value.error.message
    prepare(PublishRequest(attributes={f"a{i}": "v" for i in range(10)}))


async def test_c05_unknown_topic_is_rejected(harness: Harness) -> None:
    from fastapi_workqueue.core.envelope import prepare

    results = await harness.transport.publish("no-such-topic-here", [prepare(PublishRequest(payload=1))])
    assert results[0].status is PublishStatus.REJECTED
    assert results[0].error is not None and results[0].error.code == "UnknownTopic"
    assert "no-such-topic-here" in results[0].error.message


async def test_c06_batch_is_all_or_nothing_and_keeps_array_order(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}], max_payload_bytes=1000)
    results = await world.publish(*[PublishRequest(payload={"i": i}) for i in range(20)])
    assert all(r.status is PublishStatus.ACCEPTED for r in results)
    claimed = await world.claim("a", 50)
    assert [c.message_id for c in claimed] == [r.message_id for r in results]

    # One bad item: nothing of the call is published.
    bad = await world.publish(*[PublishRequest(payload={"i": i}) for i in range(3)], PublishRequest(payload="z" * 2000))
    assert [r.status for r in bad] == [PublishStatus.REJECTED] * 4
    assert [r.error.code if r.error else None for r in bad] == ["BatchAborted"] * 3 + ["EnvelopeTooLarge"]
    # The others name the refused item by its place in the call, counted from 0.
    assert all(r.error is not None and r.error.message.startswith(
        "not published: item 3 of this call was refused (EnvelopeTooLarge)") for r in bad[:3]), bad
    assert await world.claim("a", 50) == []


async def test_c06_conflict_in_a_batch_publishes_nothing(harness: Harness) -> None:
    world = await make_world(harness.transport, [{"role": "a"}])
    mid = uuid.uuid4()
    await world.publish(PublishRequest(message_id=mid, payload=1))
    await world.drain("a")
    results = await world.publish(PublishRequest(payload=2), PublishRequest(message_id=mid, payload=3))
    assert results[1].status is PublishStatus.MESSAGE_ID_CONFLICT
    assert results[0].status is PublishStatus.REJECTED
    assert results[0].error is not None and results[0].error.code == "BatchAborted"
    assert results[0].error.message.startswith("not published: item 1 of this call was refused (MessageIDConflict)")
    assert await world.claim("a", 10) == []


FILTER_CASES = [
    ({"field": "kind", "operator": "eq", "value": "signup"}, {"kind": "signup"}, True),
    ({"field": "kind", "operator": "eq", "value": "signup"}, {"kind": "Signup"}, False),
    ({"field": "kind", "operator": "eq", "value": "signup"}, {}, False),
    ({"field": "kind", "operator": "neq", "value": "signup"}, {"kind": "login"}, True),
    ({"field": "kind", "operator": "neq", "value": "signup"}, {"kind": "signup"}, False),
    ({"field": "kind", "operator": "startswith", "value": "sig"}, {"kind": "signup"}, True),
    ({"field": "kind", "operator": "startswith", "value": "Sig"}, {"kind": "signup"}, False),
    ({"field": "tenant", "operator": "isnull"}, {"kind": "a"}, True),
    ({"field": "tenant", "operator": "isnull"}, {"tenant": "t"}, False),
    ({"field": "tenant", "operator": "isnotnull"}, {"tenant": "t"}, True),
    ({"field": "tenant", "operator": "isnotnull"}, {}, False),
    (
        {"logic": "and", "filters": [{"field": "kind", "operator": "eq", "value": "a"},
                                     {"field": "tenant", "operator": "startswith", "value": "eu-"}]},
        {"kind": "a", "tenant": "eu-1"},
        True,
    ),
    (
        {"logic": "and", "filters": [{"field": "kind", "operator": "eq", "value": "a"},
                                     {"field": "tenant", "operator": "startswith", "value": "eu-"}]},
        {"kind": "a", "tenant": "us-1"},
        False,
    ),
    (
        {"logic": "or", "filters": [{"field": "kind", "operator": "eq", "value": "a"},
                                    {"field": "kind", "operator": "eq", "value": "b"}]},
        {"kind": "b"},
        True,
    ),
    (
        {"logic": "or", "filters": [{"field": "kind", "operator": "eq", "value": "a"},
                                    {"field": "kind", "operator": "eq", "value": "b"}]},
        {"kind": "c"},
        False,
    ),
]


async def test_c07_filters_match_case_sensitively(harness: Harness) -> None:
    subs = [{"role": f"f{i}", "filter": spec} for i, (spec, _, _) in enumerate(FILTER_CASES)]
    world = await make_world(harness.transport, subs)
    for i, (_, attributes, expected) in enumerate(FILTER_CASES):
        [result] = await world.publish(PublishRequest(payload=i, attributes=attributes))
        for role in world.subs:
            claimed = await world.claim(role, 10)
            got = [c.message_id for c in claimed]
            if role == f"f{i}":
                assert (got == [result.message_id]) is expected, (FILTER_CASES[i], got)
            for c in claimed:
                await world.settle(c)


@pytest.mark.parametrize(
    "spec",
    [
        {"field": "kind", "operator": "contains", "value": "x"},
        {"field": "n", "operator": "gt", "value": "1"},
        {"logic": "or", "filters": [{"field": "a", "operator": "eq", "value": "1"},
                                    {"field": "b", "operator": "eq", "value": "2"}]},
        {"logic": "or", "filters": [{"field": "a", "operator": "neq", "value": "1"}]},
        {"field": "kind", "operator": "eq", "value": "x", "ignoreCase": True},
        {"logic": "not", "filters": [{"field": "a", "operator": "eq", "value": "1"}]},
    ],
)
async def test_c07_richer_filter_is_refused_at_save(spec: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="allowed") as info:
        Subscription(name="s", topic="t", handler_key="h", filter=spec)
    assert "eq, neq, startswith" in str(info.value)
    with pytest.raises(FilterError):
        from fastapi_workqueue.core.filters import validate_filter

        validate_filter(spec)


async def test_c08_publish_in_rolled_back_transaction_delivers_nothing(harness: Harness) -> None:
    require(harness, "transactional_publish", "publishing in a caller's database transaction")
    world = await make_world(harness.transport, [{"role": "a"}])
    async with harness.session() as session:
        [result] = await world.publish(PublishRequest(payload="rolled back"), session=session)
        assert result.status is PublishStatus.ACCEPTED
        # Not visible outside the transaction while uncommitted. (A read: on SQLite, the single
        # writer, a claim would wait for this transaction to end.)
        [stats] = await harness.transport.stats(world["a"])
        assert stats.pending == 0
        await session.rollback()
    assert await world.claim("a", 10) == []

    async with harness.session() as session:
        [committed] = await world.publish(PublishRequest(payload="committed"), session=session)
        await session.execute(text("SELECT 1"))
        [stats] = await harness.transport.stats(world["a"])
        assert stats.pending == 0
    claimed = await world.claim("a", 10)
    assert [c.message_id for c in claimed] == [committed.message_id]


@pytest.mark.parametrize("mode", ["None", "Exclusive"])
async def test_c02_batch_repeating_stored_and_own_items_answers_duplicate_for_them(harness: Harness, mode: str) -> None:
    """Each message gets one delivery per subscription, however often the call names it."""
    world = await make_world(harness.transport, [{"role": "a", "partition_mode": mode}])
    stored = await world.publish_one(payload={"v": "stored"}, partition_key="k")
    own = uuid.uuid4()
    results = await world.publish(
        PublishRequest(message_id=own, payload={"v": "own"}, partition_key="k"),
        PublishRequest(message_id=stored.message_id, payload={"v": "stored"}, partition_key="k"),
        PublishRequest(payload={"v": "new"}, partition_key="k2"),
        PublishRequest(message_id=own, payload={"v": "own"}, partition_key="k"),
    )
    assert [r.status for r in results] == [PublishStatus.ACCEPTED, PublishStatus.DUPLICATE,
                                           PublishStatus.ACCEPTED, PublishStatus.DUPLICATE]
    assert results[1].message_id == stored.message_id and results[3].message_id == own
    seen = [c.message_id for c in await world.drain("a")]
    assert sorted(map(str, seen)) == sorted(map(str, (stored.message_id, own, results[2].message_id)))


async def test_c08_batch_with_duplicates_in_caller_transaction_keeps_the_transaction_usable(harness: Harness) -> None:
    require(harness, "transactional_publish", "publishing in a caller's database transaction")
    world = await make_world(harness.transport, [{"role": "a"}])
    stored = await world.publish_one(payload={"v": "stored"})
    async with harness.session() as session:
        results = await world.publish(
            PublishRequest(message_id=stored.message_id, payload={"v": "stored"}),
            PublishRequest(payload={"v": "new"}),
            session=session,
        )
        assert [r.status for r in results] == [PublishStatus.DUPLICATE, PublishStatus.ACCEPTED]
        [later] = await world.publish(PublishRequest(payload={"v": "later"}), session=session)
        await session.execute(text("SELECT 1"))
        await session.commit()
    claimed = await world.claim("a", 10)
    assert sorted(str(c.message_id) for c in claimed) == sorted(
        str(m) for m in (stored.message_id, results[1].message_id, later.message_id))
