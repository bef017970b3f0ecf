"""Promises of the aws transport checked end to end with the defaults a user gets: dead letters of a
FIFO key past ten, deduplication keys on FIFO, what SNS refuses (empty attributes, sizes, batch
sizes), filters on messages without attributes, a pause during a held retry, Exclusive on a
standard topic."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from fastapi_workqueue import (
    PublishRequest,
    Subscription,
    Topic,
    TransientWorkError,
    TransportError,
    TransportUnavailable,
    WorkContext,
    WorkMessage,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.core.transport import Settlement

from ..conftest import unique
from ..support import wait_for
from .deployed import deployed_queue, provision_queue, running
from .moto import CREDENTIALS, REGION, moto_server
from .world import aws_of, aws_queue

pytestmark = pytest.mark.timeout(300)


class Item(BaseModel):
    key: str
    n: int


async def test_every_dead_letter_of_a_fifo_key_is_listed_and_replayable(tmp_path: Path, moto_url: str) -> None:
    """A poison Exclusive key dead-letters each of its 12 messages; the operator lists them (limit
    100) and replays the last. A FIFO receive hands over at most 10 messages of one group and locks
    the group while they are in flight, so each dead letter is a group of its own."""
    name = unique("dlq")
    sub = f"{name}.work"
    topics = [Topic(name=name, transport="aws", is_fifo=True)]
    subs = [Subscription(name=sub, topic=name, handler_key="work", partition_mode="Exclusive")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        await queue.publish(name, [PublishRequest(payload={"key": "k", "n": n}, partition_key="k")
                                   for n in range(12)])
        aws = aws_of(queue)
        ids: list[str] = []
        for _ in range(40):
            got = await aws.claim(sub, 1)
            for d in got:
                assert await aws.settle([Settlement(d.delivery_id, d.lease_token, "DeadLetter",
                                                    reason="poison")]) == ["DeadLettered"]
                ids.append(d.delivery_id)
            if len(ids) == 12:
                break
        assert len(ids) == 12
        listed = await queue.dead_letters(sub, limit=100)
        replayed = await queue.replay(sub, ids[-1], note="fixed")
        assert (len(listed), replayed.result) == (12, "Replayed")
        assert sorted(d.delivery_id for d in listed) == sorted(ids)



async def _drain(queue: Any, sub: str, rounds: int = 6) -> list[Any]:
    aws = aws_of(queue)
    got = []
    for _ in range(rounds):
        batch = await aws.claim(sub, 10)
        for d in batch:
            got.append(d)
            assert await aws.settle([Settlement(d.delivery_id, d.lease_token, "Complete")]) == ["Completed"]
    return got



async def test_a_deduplication_key_on_a_fifo_topic_drops_the_repeat(tmp_path: Path, moto_url: str) -> None:
    """A FIFO aws topic takes a deduplication key (a standard one refuses it: "deduplication keys need
    is_fifo=True") as the SNS deduplication id: a second message with the same key within SNS's
    window is dropped."""
    name = unique("dedup")
    sub = f"{name}.work"
    topics = [Topic(name=name, transport="aws", is_fifo=True)]
    subs = [Subscription(name=sub, topic=name, handler_key="work")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        [a] = await queue.publish(name, [PublishRequest(payload={"n": 1}, partition_key="p",
                                                        deduplication_key="order-1")])
        [b] = await queue.publish(name, [PublishRequest(payload={"n": 2}, partition_key="p",
                                                        deduplication_key="order-1")])
        assert a.status == "Accepted"
        delivered = await _drain(queue, sub)
        assert [d.message_id for d in delivered] == [a.message_id], (b.status, len(delivered))



async def test_a_deduplication_key_through_the_outbox_drops_the_repeat(pg_url: str, moto_url: str) -> None:
    """The same through the outbox: the relay sends the key (kept beside the row's attributes, never
    as one of them) as the deduplication id, and the handler sees the first message only, with its
    own attributes."""
    name = unique("dedupo")
    sub = f"{name}.work"
    queue = deployed_queue(pg_url, moto_url, [Topic(name=name, transport="aws", is_fifo=True)],
                           [Subscription(name=sub, topic=name, handler_key="work")])
    seen: list[tuple[int, dict[str, str]]] = []

    @queue.handler("work")
    async def work(message: WorkMessage[Item], context: WorkContext) -> None:
        seen.append((message.payload.n, dict(message.attributes)))

    async with running(queue, provision_queue(queue, moto_url)):
        for n in (1, 2):
            async with queue.sessionmaker() as session, session.begin():
                [result] = await queue.publish(name, [PublishRequest(
                    payload={"key": "k", "n": n}, partition_key="k", deduplication_key="order-1",
                    attributes={"kind": "order"})], session=session)
                assert result.status == "Accepted"
        async with queue.sessionmaker() as session, session.begin():
            await queue.publish(name, [PublishRequest(payload={"key": "k", "n": 3}, partition_key="k")],
                                session=session)
        await wait_for(lambda: any(n == 3 for n, _ in seen), within=30)
    assert seen == [(1, {"kind": "order"}), (3, {})], seen


async def test_an_empty_attribute_value_is_rejected_not_accepted_and_stuck(pg_url: str, moto_url: str) -> None:
    """SNS refuses an attribute with an empty value (InvalidParameter). Through the outbox the publish
    answers Rejected at once (nothing written), instead of Accepted with a row the relay could never
    send, which would block every later message of its partition key."""
    name = unique("empty")
    sub = f"{name}.work"
    queue = deployed_queue(pg_url, moto_url, [Topic(name=name, transport="aws")],
                           [Subscription(name=sub, topic=name, handler_key="work")])
    seen: list[int] = []

    @queue.handler("work")
    async def work(message: WorkMessage[Item], context: WorkContext) -> None:
        seen.append(message.payload.n)

    async with running(queue, provision_queue(queue, moto_url)):
        async with queue.sessionmaker() as session, session.begin():
            results = await queue.publish(name, [
                PublishRequest(payload={"key": "c1", "n": 1}, partition_key="c1", attributes={"note": ""}),
                PublishRequest(payload={"key": "c1", "n": 2}, partition_key="c1"),
            ], session=session)
        async with queue.sessionmaker() as session, session.begin():  # other customers, a valid publish
            await queue.publish(name, [PublishRequest(payload={"key": f"c{n}", "n": n}, partition_key=f"c{n}")
                                       for n in range(3, 8)], session=session)
        statuses = [r.status for r in results]
        await asyncio.sleep(15)  # the relay runs every second
    assert sorted(seen)[-5:] == [3, 4, 5, 6, 7], (statuses, seen)  # unrelated keys get through
    assert statuses[0] == "Rejected" or sorted(seen) == [1, 2, 3, 4, 5, 6, 7], (statuses, seen)



async def test_an_empty_attribute_value_without_session_is_rejected(tmp_path: Path, moto_url: str) -> None:
    name = unique("empty")
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=f"{name}.s", topic=name, handler_key="work")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        [result] = await queue.publish(name, [PublishRequest(payload={}, attributes={"note": ""})])
        assert result.status == "Rejected" and result.error is not None



@pytest.mark.parametrize("key", ["k" * 129, "order 42", "kunde-müller", "tab\tkey"])
async def test_a_partition_key_sns_refuses_as_a_fifo_group_is_rejected_at_the_publish(
    tmp_path: Path, moto_url: str, key: str,
) -> None:
    """SNS takes 1 to 128 ASCII letters, digits and punctuation as a FIFO topic's MessageGroupId (the
    test server takes anything): another key is Rejected before anything is sent or stored."""
    name = unique("group")
    topics = [Topic(name=name, transport="aws", is_fifo=True)]
    subs = [Subscription(name=f"{name}.s", topic=name, handler_key="work", partition_mode="Exclusive")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        refused, fine = await queue.publish(name, [PublishRequest(payload={}, partition_key=key),
                                                   PublishRequest(payload={}, partition_key="k" * 128)])
        assert refused.status == "Rejected" and refused.error is not None
        assert (refused.error.code, refused.error.field) == ("InvalidPartitionKey", "partition_key")
        assert "1 to 128 ASCII letters, digits and punctuation" in refused.error.message
        assert fine.error is not None and fine.error.code == "BatchAborted"  # a call is all or nothing
        [alone] = await queue.publish(name, [PublishRequest(payload={}, partition_key="order-42/eu")])
        assert alone.status == "Accepted"


async def test_the_librarys_own_attribute_name_is_rejected_not_dropped(tmp_path: Path, moto_url: str) -> None:
    name = unique("reserved")
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=f"{name}.s", topic=name, handler_key="work")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        [result] = await queue.publish(name, [PublishRequest(payload={}, attributes={"workqueue.none": "yes"})])
        assert result.status == "Rejected" and result.error is not None and result.error.code == "InvalidAttribute"
        assert "reserved for the library" in result.error.message


async def test_a_publish_while_sns_cannot_be_reached_raises_transport_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not botocore's own error: the library's, retryable, as a database transport raises it (the
    REST API answers it 503 with Retry-After)."""
    for variable, value in CREDENTIALS.items():
        monkeypatch.setenv(variable, value)
    name = unique("away")
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=f"{name}.s", topic=name, handler_key="work")]
    server = moto_server()  # a server of this test's own, stopped under the open queue
    url = server.__enter__()
    try:
        async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", url, topics, subs) as queue:
            server.__exit__(None, None, None)
            with pytest.raises(TransportUnavailable, match="SNS/SQS cannot be reached") as raised:
                await queue.publish(name, [PublishRequest(payload={})])
            assert raised.value.retryable and "PublishBatch" in str(raised.value)
    finally:
        server.__exit__(None, None, None)


async def test_a_start_while_sqs_cannot_be_reached_waits_one_round_of_retries_not_one_per_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each bound queue's status tag and redrive policy are read at start; with SQS out of reach
    each read waits out botocore's retries (about 5 s here), so they are read side by side: six
    subscriptions once took a minute and a half to start."""
    for variable, value in CREDENTIALS.items():
        monkeypatch.setenv(variable, value)
    name = unique("start-away")
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=f"{name}.s{n}", topic=name, handler_key="work") for n in range(6)]
    database = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    with moto_server() as url:
        async with aws_queue(database, url, topics, subs):
            pass  # provisioned and bound: the bindings are stored
    queue = WorkQueue(WorkQueueSettings(database_url=database, aws_region=REGION, aws_endpoint_url=url,
                                        aws_wait_time_seconds=0, aws_relay=False, disable_host=True),
                      topics=topics, subscriptions=subs)
    started = time.monotonic()
    await queue.open()
    try:
        took = time.monotonic() - started
    finally:
        await queue.close()
    assert took < 25, f"the start took {took:.1f} s"


async def test_a_pause_during_a_held_heads_backoff_does_not_erase_its_failed_attempt(
    tmp_path: Path, moto_url: str,
) -> None:
    """Exclusive FIFO key k: message 0 always fails (TransientWorkError, 4 s delay) while message 1
    is held behind it, so the head waits out its delay held here as attempt 2. A pause during that
    delay gives everything held back; after the resume the head comes back as attempt 2 (its failed
    attempt stays counted) and dead-letters after max_attempts runs."""
    name = unique("pz")
    sub = f"{name}.work"
    queue = deployed_queue(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}", moto_url,
                           [Topic(name=name, transport="aws", is_fifo=True)],
                           [Subscription(name=sub, topic=name, handler_key="work", partition_mode="Exclusive",
                                         max_attempts=3)])
    runs: list[tuple[str, int, int]] = []
    failed_once = asyncio.Event()

    @queue.handler("work")
    async def work(message: WorkMessage[Item], context: WorkContext) -> None:
        runs.append((message.payload.key, message.payload.n, context.attempt))
        if message.payload.n == 0:
            failed_once.set()
            raise TransientWorkError("down", delay_seconds=4)

    async with running(queue, provision_queue(queue, moto_url)):
        await queue.publish(name, [PublishRequest(payload={"key": "k", "n": n}, partition_key="k") for n in (0, 1)])
        await asyncio.wait_for(failed_once.wait(), 30)
        await asyncio.sleep(0.5)
        assert await queue.set_status(sub, "Paused") is True
        await queue.publish(name, [PublishRequest(payload={"key": "other", "n": 9}, partition_key="other")])
        await asyncio.sleep(3)
        assert await queue.set_status(sub, "Active") is True
        await wait_for(lambda: queue.dead_letters(sub), within=60, interval=0.3)
        await wait_for(lambda: ("k", 1, 1) in runs, within=30)
    head = [a for k, n, a in runs if n == 0]
    assert head == [1, 2, 3], runs



async def test_a_payload_within_the_envelope_cap_is_published(tmp_path: Path, moto_url: str) -> None:
    """The core accepts an envelope (payload + attributes) of up to 256 KiB; the aws body adds the
    library's own fields around the payload, so SNS counts more: the publish answers Accepted (and
    the message arrives) or Rejected with the reason, never an error from SNS."""
    from fastapi_workqueue.core.envelope import MAX_ENVELOPE_BYTES

    name = unique("big")
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=f"{name}.s", topic=name, handler_key="work")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        payload = "x" * (MAX_ENVELOPE_BYTES - 100)
        [result] = await queue.publish(name, [PublishRequest(payload=payload)])
        assert result.status in ("Accepted", "Rejected")
        delivered = await _drain(queue, f"{name}.s", rounds=2)
        assert result.status == "Rejected" or len(delivered) == 1



async def test_a_non_ascii_payload_well_under_the_cap_is_published(tmp_path: Path, moto_url: str) -> None:
    """A 60,000-character text of 'é' is a ~120 KB envelope (UTF-8), half the cap: the aws body keeps
    it as UTF-8 (a ``\\u00e9`` escape would take six bytes a character, over SNS's limit)."""
    name = unique("utf")
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=f"{name}.s", topic=name, handler_key="work")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        [result] = await queue.publish(name, [PublishRequest(payload="é" * 60_000)])
        delivered = await _drain(queue, f"{name}.s", rounds=2)
        assert result.status == "Accepted" and len(delivered) == 1



async def test_ten_mid_sized_messages_in_one_call_stay_within_sns_batch_limit(tmp_path: Path, moto_url: str) -> None:
    """Ten 40 KB messages, each far under the cap, in one publish: SNS's PublishBatch takes at most
    256 KiB in all (the sum of the entries' messages; AWS answers BatchRequestTooLong above it), so
    the call goes in several. moto does not enforce the aggregate limit: the test checks the calls."""
    name = unique("agg")
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=f"{name}.s", topic=name, handler_key="work")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        aws = aws_of(queue)
        sizes: list[int] = []
        real = aws.sns.publish_batch

        async def recording(**kwargs: Any) -> Any:
            sizes.append(sum(len(e["Message"].encode()) + sum(len(k) + len(v["StringValue"].encode())
                                                              for k, v in e.get("MessageAttributes", {}).items())
                             for e in kwargs["PublishBatchRequestEntries"]))
            return await real(**kwargs)

        aws._sns.publish_batch = recording
        results = await queue.publish(name, [PublishRequest(payload="x" * 40_000) for _ in range(10)])
        assert [r.status for r in results] == ["Accepted"] * 10
    assert max(sizes) <= 262_144, sizes



async def test_a_message_without_attributes_can_match_an_isnull_filter_on_sns(tmp_path: Path, moto_url: str) -> None:
    """``isnull`` renders as ``[{"exists": false}]``, and AWS documents that "exists": false "only
    matches if at least one attribute is present". A message published without attributes carries
    the library's marker attribute so that it matches on AWS too. moto matches it either way, so the
    test checks the request."""
    name = unique("isnull")
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=f"{name}.s", topic=name, handler_key="work",
                         filter={"field": "region", "operator": "isnull"})]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        aws = aws_of(queue)
        entries: list[dict[str, Any]] = []
        real = aws.sns.publish_batch

        async def recording(**kwargs: Any) -> Any:
            entries.extend(kwargs["PublishBatchRequestEntries"])
            return await real(**kwargs)

        aws._sns.publish_batch = recording
        [result] = await queue.publish(name, [PublishRequest(payload={"n": 1})])
        assert result.status == "Accepted"
    assert entries and entries[0].get("MessageAttributes"), entries



async def test_an_exclusive_subscription_on_a_standard_aws_topic_is_unsupported(
    tmp_path: Path, moto_url: str,
) -> None:
    """Exclusive needs a FIFO topic (the key is the message group): on a standard queue SQS would
    hand one key's messages to several consumers at once. The host refuses to run it and health
    says why, instead of running the key's deliveries in parallel."""
    from fastapi_workqueue.aws.manifest import build_manifest

    from .provision import provision

    name = unique("std")
    sub = f"{name}.work"
    topics = [Topic(name=name, transport="aws")]
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    plain = deployed_queue(url, moto_url, topics, [Subscription(name=sub, topic=name, handler_key="work")])
    document = provision(build_manifest(topics, list(plain.subscriptions.values()), plain.settings), moto_url)
    queue = deployed_queue(url, moto_url, topics,
                           [Subscription(name=sub, topic=name, handler_key="work", partition_mode="Exclusive")])
    done: list[int] = []

    @queue.handler("work")
    async def work(message: WorkMessage[Item], context: WorkContext) -> None:
        done.append(message.payload.n)

    async with running(queue, document):
        await queue.publish(name, [PublishRequest(payload={"key": "k", "n": n}, partition_key="k") for n in range(4)])
        state = await wait_for(lambda: next((s for s in queue.health().subscriptions if s.subscription == sub
                                             and s.state == "Unsupported"), None), within=30)
        await asyncio.sleep(1.0)
    assert "FIFO" in (state.reason or ""), state
    assert done == []


async def test_the_attempts_of_an_aws_delivery_are_unsupported_not_none(tmp_path: Path, moto_url: str) -> None:
    """docs/rest-api.md: ``GET /deliveries/{id}/attempts`` answers 501 on a transport that keeps no
    attempt history. On a queue with a database and an aws topic it answered ``200 []`` for an aws
    dead letter that had failed twice, as if none of its attempts had failed; a database delivery of
    the same queue still lists its attempts, and the search still reaches the database."""
    import httpx
    from fastapi import FastAPI

    from fastapi_workqueue.core.keys import SCOPE_READ, create_key

    from .test_transport import claim_all, sqlite_url

    name, local = unique("t"), unique("local")
    topics = [Topic(name=name, transport="aws"), Topic(name=local)]
    subs = [Subscription(name=f"{name}.s", topic=name, handler_key="h", max_attempts=2),
            Subscription(name=f"{local}.s", topic=local, handler_key="h", max_attempts=1)]
    async with aws_queue(sqlite_url(tmp_path), moto_url, topics, subs) as queue:
        await queue.publish(name, [PublishRequest(payload={"x": 1})])
        for _ in range(2):
            [d] = await claim_all(queue, f"{name}.s")
            await queue.transport.settle([Settlement(d.delivery_id, d.lease_token, "Fail", delay_seconds=0,
                                                     error="boom")])
        [dead] = await queue.dead_letters(f"{name}.s")
        assert dead.status == "DeadLettered" and dead.attempt == 2
        await queue.publish(local, [PublishRequest(payload={"x": 2}, correlation_id=f"req-{local}")])
        [here] = await queue.transport.claim(f"{local}.s", 1)
        await queue.transport.settle([Settlement(here.delivery_id, here.lease_token, "Fail", error="boom")])
        assert queue.ports.api_keys is not None
        key = await create_key(queue.ports.api_keys, "reader", [SCOPE_READ])
        app = FastAPI()
        app.include_router(queue.router)
        headers = {"Authorization": f"Bearer {key.key}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            remote = await http.get(f"/work-queue/deliveries/{dead.delivery_id}/attempts", headers=headers)
            kept = await http.get(f"/work-queue/deliveries/{here.delivery_id}/attempts", headers=headers)
            found = await http.get("/work-queue/search", params={"q": f"req-{local}"}, headers=headers)
    assert remote.status_code == 501 and "keeps no attempt history" in remote.json()["detail"], remote.text
    assert [a["Outcome"] for a in kept.json()] == ["DeadLettered"], kept.text
    assert [f["Delivery"]["DeliveryID"] for f in found.json()] == [here.delivery_id], found.text


async def _dead_lettered(queue: WorkQueue, sub: str, count: int) -> list[str]:
    """Claims and dead-letters ``count`` deliveries of ``sub``; their ids."""
    aws = aws_of(queue)
    ids: list[str] = []
    for _ in range(40):
        for d in await aws.claim(sub, 10):
            assert await aws.settle([Settlement(d.delivery_id, d.lease_token, "DeadLetter",
                                                reason="poison")]) == ["DeadLettered"]
            ids.append(d.delivery_id)
        if len(ids) == count:
            return ids
    raise AssertionError(f"dead-lettered {len(ids)} of {count}")


async def test_operator_reads_at_once_do_not_hide_dead_letters_from_each_other(tmp_path: Path, moto_url: str) -> None:
    """docs/rest-api.md: dead letters are "each listed once across the pages" and ``GET
    /deliveries/{id}`` is 404 only "when unknown". SQS has no peek: a read receives the DLQ's
    messages, which hides them from any other read until it gives them back. Two listings and a
    lookup at once came back empty or partial, and the lookup of an existing dead letter None.
    Now reads of one process share one read, and a read of another process (a second queue on the
    same resources) waits for what the first holds."""
    name = unique("dlqr")
    sub = f"{name}.work"
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=sub, topic=name, handler_key="work")]
    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    async with aws_queue(url, moto_url, topics, subs) as queue:
        await queue.publish(name, [PublishRequest(payload={"n": n}) for n in range(6)])
        ids = await _dead_lettered(queue, sub, 6)
        for _ in range(3):
            first, second, one = await asyncio.gather(queue.dead_letters(sub), queue.dead_letters(sub),
                                                      queue.get_delivery(ids[0]))
            assert sorted(d.delivery_id for d in first) == sorted(ids)
            assert sorted(d.delivery_id for d in second) == sorted(ids)
            assert one is not None and one.status == "DeadLettered"
        async with aws_queue(url, moto_url, topics, subs, bind=False) as other:
            for _ in range(3):
                here, there = await asyncio.gather(queue.dead_letters(sub), other.dead_letters(sub))
                assert (len(here), len(there)) == (6, 6)


async def test_two_replays_of_one_dead_letter_at_once_replay_it_once(tmp_path: Path, moto_url: str) -> None:
    """A replay reads the DLQ afresh under the subscription's read lock: two at once in one process
    (and a listing beside them) move the dead letter back once, and the other answers that it is
    no longer dead-lettered."""
    name = unique("dlq2")
    sub = f"{name}.work"
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=sub, topic=name, handler_key="work")]
    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        await queue.publish(name, [PublishRequest(payload={"n": 1})])
        [dead] = await _dead_lettered(queue, sub, 1)
        a, b, _ = await asyncio.gather(queue.replay(sub, dead), queue.replay(sub, dead), queue.dead_letters(sub))
        assert sorted([a.result, b.result]) == ["NotDeadLettered", "Replayed"], (a, b)
        again = await _drain(queue, sub)
        assert len(again) == 1 and await queue.dead_letters(sub) == []


async def test_health_of_an_unbound_aws_subscription_says_to_bind_it(tmp_path: Path, moto_url: str) -> None:
    """docs/aws.md lets an app deploy before its aws resources exist. Its consumer's claims then
    fail with "not bound: apply the Terraform module, then run `workqueue import-bindings`", and
    health (which answers anyone) said "the queue's store is unavailable or refused a call", as for
    a driver's error that may name hosts. That text names none, so health shows it."""
    import httpx
    from fastapi import FastAPI

    name = unique("unbound")
    sub = f"{name}.work"
    queue = deployed_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, [Topic(name=name, transport="aws")],
                           [Subscription(name=sub, topic=name, handler_key="work")])

    @queue.handler("work")
    async def work(message: WorkMessage[Item]) -> None:
        pass

    app = FastAPI()
    app.include_router(queue.health_router)
    async with running(queue), httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        async def unbound() -> Any:
            answer = await http.get("/health/extensions")
            [entry] = [s for e in answer.json()["Extensions"] for s in e["Subscriptions"] if s["Subscription"] == sub]
            return (answer, entry) if entry["State"] == "Error" else None

        answer, entry = await wait_for(unbound, within=30, interval=0.2)
    assert answer.status_code == 503
    assert "is not bound: apply the Terraform module" in entry["Reason"], entry
    assert "workqueue import-bindings" in entry["Reason"], entry
    # Its counts (`workqueue stats --subscription`, GET /stats?subscription=) say so too: they were
    # an empty answer, which the command read as "does not exist".
    async with running(queue):
        with pytest.raises(TransportError, match="is not bound: apply the Terraform module"):
            await queue.stats(sub)
        assert sub not in {row.subscription for row in await queue.stats()}


def test_a_throttle_is_retryable_and_keeps_the_aws_error_code_its_readers_look_for() -> None:
    """The outbox relay backs off on a throttled PublishBatch and validate-bindings names the code:
    both read the AWS error code from the error, which the library's mapped error keeps."""
    from botocore.exceptions import ClientError

    from fastapi_workqueue.aws.client_calls import library_error
    from fastapi_workqueue.aws.leases import client_error_code
    from fastapi_workqueue.aws.outbox import THROTTLED, _code

    throttled = ClientError({"Error": {"Code": "Throttling", "Message": "Rate exceeded"},
                             "ResponseMetadata": {"HTTPStatusCode": 400}}, "PublishBatch")
    mapped = library_error(throttled, "publish_batch")
    assert isinstance(mapped, TransportError) and mapped.retryable and "aws PublishBatch" in str(mapped)
    assert _code(mapped) == client_error_code(mapped) == "Throttling" and "Throttling" in THROTTLED
    refused = ClientError({"Error": {"Code": "InvalidParameter", "Message": "no"},
                           "ResponseMetadata": {"HTTPStatusCode": 400}}, "PublishBatch")
    assert library_error(refused, "publish_batch") is None  # read by its callers as botocore raised it


async def test_an_idle_sqs_long_poll_is_not_a_stalled_store(
    tmp_path: Path, moto_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """An idle consumer's receive long-polls SQS for 20 s (the default): far past a stall limit of
    1 s, it waits for work, not for a stalled store. Health stays Running and nothing is logged,
    while the database subscription's claims are still watched (core/stalls.py)."""
    import logging

    caplog.set_level(logging.INFO, logger="fastapi_workqueue")
    name = unique("idle")
    sub = f"{name}.work"
    topics = [Topic(name=name, transport="aws")]
    subscriptions = [Subscription(name=sub, topic=name, handler_key="work")]
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    queue = deployed_queue(url, moto_url, topics, subscriptions, stalled_store_call_ms=1000)
    done: list[int] = []

    @queue.handler("work")
    async def work(message: WorkMessage[Item]) -> None:
        done.append(message.payload.n)

    async with running(queue, provision_queue(queue, moto_url)):
        consumer = await wait_for(lambda: queue.host and queue.host.consumers.get(sub), within=30)
        # (a receive under way for over 1 s: the long poll)
        await wait_for(lambda: (consumer.claim_watch.waited() or 0) > 2.5, within=30, interval=0.1)
        [entry] = [s for s in queue.health().subscriptions if s.subscription == sub]
        assert entry.state == "Running", entry
        await queue.publish(name, [PublishRequest(payload={"key": "k", "n": 1})])
        await wait_for(lambda: done == [1], within=30)
    said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert not said, said


async def test_listings_page_on_aws_and_another_subscriptions_cursor_ends_them(tmp_path: Path, moto_url: str) -> None:
    """docs/rest-api.md: a listing pages with ``after`` (the last id of the page before), each
    delivery listed once across the pages. Paging with limit 2 lists five dead letters, and five
    InFlight deliveries, once each (InFlight ignored ``after`` and gave the first page again, so a
    client's paging loop never ended); after another subscription's id nothing comes."""
    name = unique("dlqp")
    sub = f"{name}.work"
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=sub, topic=name, handler_key="work")]

    async def paged(status: Any) -> list[str]:
        seen: list[str] = []
        after: str | None = None
        for _ in range(10):
            page = await queue.deliveries(sub, status, limit=2, after=after)
            if not page:
                break
            seen += [d.delivery_id for d in page]
            after = page[-1].delivery_id
        return seen

    async with aws_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", moto_url, topics, subs) as queue:
        await queue.publish(name, [PublishRequest(payload={"n": n}) for n in range(5)])
        ids = await _dead_lettered(queue, sub, 5)
        seen = await paged("DeadLettered")
        assert sorted(seen) == sorted(ids) and len(seen) == 5
        await queue.publish(name, [PublishRequest(payload={"n": n}) for n in range(5)])
        held: list[str] = []
        for _ in range(20):
            held += [d.delivery_id for d in await aws_of(queue).claim(sub, 10)]
            if len(held) == 5:
                break
        seen = await paged("InFlight")
        assert sorted(seen) == sorted(held) and len(seen) == 5
        other = f"aws:{name}.other:abc"
        assert await queue.dead_letters(sub, after=other) == []
        assert await queue.deliveries(sub, "InFlight", after=other) == []
