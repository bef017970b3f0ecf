"""PostgreSQL publishes one message through paths of its own (publish_one, and publish's path for
arrays of one): they must store exactly what the path of many stores, answer as it does, and wake
consumers only for what is visible at once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

import asyncpg
import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.database.listener import parse_wakeup
from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn
from fastapi_workqueue.database.routines import RoutineTransport

from .conftest import unique
from .support import wait_for

KIND_A = {"logic": "and", "filters": [{"field": "kind", "operator": "eq", "value": "a"}]}


def requests() -> list[PublishRequest]:
    soon = datetime.now(UTC) + timedelta(seconds=60)
    past = datetime.now(UTC) - timedelta(seconds=60)
    return [
        PublishRequest(payload={"n": 0}, attributes={"kind": "a"}),
        PublishRequest(payload={"n": 1}, attributes={"kind": "b"}, delay_seconds=30),
        PublishRequest(payload={"n": 2}, not_before=soon, max_attempts=7, backoff_seconds=[1, 2.5, 4]),
        PublishRequest(payload={"n": 3}, partition_key="k-1", correlation_id="c-1", attributes={"kind": "a"}),
        PublishRequest(payload={"n": 4}, not_before=past, max_attempts=2),
    ]


async def topology(transport: PostgresTransport) -> tuple[str, dict[str, str]]:
    topic = unique("paths")
    names = {"all": unique("all"), "a": unique("only-a"), "tight": unique("tight")}
    await transport.sync_topology([Topic(name=topic)], [
        Subscription(name=names["all"], topic=topic, handler_key="h"),
        Subscription(name=names["a"], topic=topic, handler_key="h", filter=KIND_A),
        Subscription(name=names["tight"], topic=topic, handler_key="h", max_attempts=3,
                     backoff_base_seconds=0.5, backoff_max_seconds=9),
    ])
    return topic, names


async def stored(transport: PostgresTransport, topic: str, names: dict[str, str]) -> list[tuple[Any, ...]]:
    """Every delivery of the topic as (payload, subscription role, what it was stored with)."""
    roles = {name: role for role, name in names.items()}

    async def read(conn: Any) -> list[Any]:
        return list(await conn.fetch(
            """SELECT m.payload, s.name, d.partition_key, d.key_mode, d.status, d.attempt, d.max_attempts,
                      d.backoff_base_seconds, d.backoff_max_seconds, d.backoff_schedule,
                      round(extract(epoch FROM d.visible_at - m.published_at)) AS delay,
                      m.partition_key AS message_key, m.correlation_id, m.attributes
               FROM workqueue.delivery d
               JOIN workqueue.message m ON m.id = d.message_id
               JOIN workqueue.subscription s ON s.id = d.subscription_id
               WHERE m.topic = $1""", topic))

    rows = await transport.run_in_connection(read)
    return sorted((r["payload"], roles[r["name"]], *tuple(r)[2:]) for r in rows)


async def test_one_at_a_time_stores_what_one_batch_stores(pg_transport: PostgresTransport) -> None:
    """Three ways in: publish_one (what the transport sends for one message), the publish routine
    with arrays of one (what it sends with a deduplication key, and the fallback of publish_one),
    and one batch."""
    single_topic, single_names = await topology(pg_transport)
    arrays_topic, arrays_names = await topology(pg_transport)
    batch_topic, batch_names = await topology(pg_transport)
    for request in requests():
        [result] = await pg_transport.publish(single_topic, [prepare(request)])
        assert result.status == "Accepted", result
        [result] = await RoutineTransport.publish(pg_transport, arrays_topic, [prepare(request)])
        assert result.status == "Accepted", result
    results = await pg_transport.publish(batch_topic, [prepare(r) for r in requests()])
    assert [r.status for r in results] == ["Accepted"] * 5

    single = await stored(pg_transport, single_topic, single_names)
    assert single == await stored(pg_transport, arrays_topic, arrays_names)
    assert single == await stored(pg_transport, batch_topic, batch_names)
    # What the rows must hold, not only that both paths agree: 5 + 2 (kind a) + 5 deliveries.
    assert len(single) == 12
    by_payload = {(row[0], row[1]): row for row in single}
    n2 = by_payload[('{"n":2}', "tight")]
    assert (n2[6], n2[9], n2[10]) == (7, [1.0, 2.5, 4.0], 60)  # the request's policy and schedule
    n4 = by_payload[('{"n":4}', "tight")]
    assert (n4[6], n4[7], n4[8], n4[10]) == (2, 0.5, 9.0, 0)  # a past not_before is visible now
    assert by_payload[('{"n":1}', "all")][10] == 30
    assert by_payload[('{"n":0}', "tight")][6] == 3  # the subscription's own max_attempts
    assert {role for payload, role, *_ in single if payload == '{"n":3}'} == {"all", "a", "tight"}


async def test_one_message_wakes_only_when_visible_now(pg_url: str, pg_transport: PostgresTransport) -> None:
    topic, names = await topology(pg_transport)
    ids = {s.name: cast(str, s.id) for s in await pg_transport.list_subscriptions()}  # as wake-ups name them
    conn = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    woken: list[str] = []
    payloads: list[str] = []

    def heard(*args: object) -> None:
        payloads.append(str(args[3]))
        woken.extend(parse_wakeup(str(args[3])))

    await conn.add_listener("workqueue", heard)
    try:
        later = PublishRequest(payload=1, attributes={"kind": "b"}, delay_seconds=30)
        await pg_transport.publish(topic, [prepare(later)])
        await pg_transport.publish(topic, [prepare(PublishRequest(payload=2, attributes={"kind": "b"}))])
        # One wake-up per subscription that got a delivery: the filter keeps "a" out. (Alone in the
        # process, the publish notifies in its commit, one NOTIFY per subscription.) Notifications
        # arrive in the order they were sent: once the visible message's have come, a wake-up for
        # the delayed one would be here already.
        wanted = sorted([ids[names["all"]], ids[names["tight"]]], key=int)
        await wait_for(lambda: all(w in payloads for w in wanted))
        assert sorted(w for w in woken if w in ids.values()) == sorted(wanted)
    finally:
        await conn.close()


async def test_one_message_answers_as_publish_does_when_it_is_not_plain(pg_transport: PostgresTransport) -> None:
    """publish_one hands what it does not write to publish: a repeat, a conflict, a message over
    the topic's cap, an unknown topic, a keyed topic."""
    topic, _ = await topology(pg_transport)
    first = prepare(PublishRequest(payload={"v": 1}))
    [accepted] = await pg_transport.publish(topic, [first])
    [again] = await pg_transport.publish(topic, [first])
    [conflict] = await pg_transport.publish(topic, [prepare(PublishRequest(message_id=first.message_id, payload=2))])
    [unknown] = await pg_transport.publish(unique("nowhere"), [prepare(PublishRequest(payload=1))])
    assert (accepted.status, again.status, conflict.status, unknown.status) == (
        "Accepted", "Duplicate", "MessageIDConflict", "Rejected")
    assert again.message_id == first.message_id and unknown.error is not None
    assert unknown.error.code == "UnknownTopic"

    capped, keyed = unique("capped"), unique("keyed")
    await pg_transport.sync_topology(
        [Topic(name=capped, max_payload_bytes=64), Topic(name=keyed)],
        [Subscription(name=unique("c"), topic=capped, handler_key="h"),
         Subscription(name=unique("k"), topic=keyed, handler_key="h", partition_mode="Ordered")])
    [too_big] = await pg_transport.publish(capped, [prepare(PublishRequest(payload="x" * 100))])
    assert too_big.status == "Rejected" and too_big.error is not None
    assert too_big.error.code == "EnvelopeTooLarge"
    [ordered] = await pg_transport.publish(keyed, [prepare(PublishRequest(payload=1, partition_key="k"))])
    assert ordered.status == "Accepted"
    [state] = [s for s in await pg_transport.list_subscriptions() if s.topic == keyed]
    [claimed] = await pg_transport.claim(state.name, 5)
    assert claimed.message_id == ordered.message_id and claimed.partition_key == "k"


async def test_a_batch_whose_items_share_their_attributes_stores_them_on_every_item(
    pg_transport: PostgresTransport, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call whose items all carry the same attributes (a job's name), or the same max attempts
    (a job's tries), sends them once (an array of one); each item is stored, filtered and answered
    as when they go one per item, on the plain path and on the path with deduplication keys."""
    sent: list[tuple[int, int, int]] = []  # (messages, attributes, max attempts) of each call of publish
    call = pg_transport.call

    async def recording(routine: str, **params: Any) -> Any:
        if routine == "publish":
            sent.append((len(params["p_message_ids"]), len(params["p_attributes"] or ()),
                         len(params["p_max_attempts"] or ())))
        return await call(routine, **params)

    monkeypatch.setattr(pg_transport, "call", recording)

    def batches(kind: str) -> list[list[PublishRequest]]:
        attributes = {"kind": kind}
        return [
            [PublishRequest(payload={"n": 0, "k": kind}, attributes=attributes),
             PublishRequest(payload={"n": 1, "k": kind}, attributes=attributes, delay_seconds=30),
             PublishRequest(payload={"n": 2, "k": kind}, attributes=attributes, max_attempts=7)],
            [PublishRequest(payload={"n": 3, "k": kind}, attributes=attributes, deduplication_key=f"d-{kind}"),
             PublishRequest(payload={"n": 4, "k": kind}, attributes=attributes, correlation_id="c-1")],
            [PublishRequest(payload={"n": n, "k": kind}, attributes=attributes, max_attempts=4) for n in (5, 6, 7, 8)],
        ]

    shared_topic, shared_names = await topology(pg_transport)
    single_topic, single_names = await topology(pg_transport)
    for kind in ("a", "b"):
        for batch in batches(kind):
            results = await pg_transport.publish(shared_topic, [prepare(r) for r in batch])
            assert [r.status for r in results] == ["Accepted"] * len(batch)
            for request in batch:
                [result] = await RoutineTransport.publish(pg_transport, single_topic, [prepare(request)])
                assert result.status == "Accepted", result

    assert sorted({pair for pair in sent if pair[0] > 1}) == [(2, 1, 2), (3, 1, 3), (4, 1, 1)]
    shared = await stored(pg_transport, shared_topic, shared_names)
    assert shared == await stored(pg_transport, single_topic, single_names)
    assert len(shared) == 18 + 9 + 18  # "all" and "tight" get every item, "only-a" those of kind a
    assert {row[-1] for row in shared if row[1] == "a"} == {'{"kind": "a"}'}
    assert {row[-1] for row in shared} == {'{"kind": "a"}', '{"kind": "b"}'}
    # Given once, a max attempts is every item's (the subscription's own, 3 for "tight", gives way).
    assert {row[6] for row in shared if row[0] in ('{"k":"a","n":5}', '{"k":"b","n":8}')} == {4}
