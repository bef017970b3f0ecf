"""The AWS transport on a moto server, routed beside the database transport."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkMessage, WorkQueue
from fastapi_workqueue.aws.bindings import Bindings, store_bindings
from fastapi_workqueue.aws.manifest import build_manifest
from fastapi_workqueue.core.envelope import PublishStatus
from fastapi_workqueue.core.transport import ClaimedDelivery, Settlement

from ..conftest import unique
from .provision import provision
from .world import aws_of, aws_queue


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"


async def claim_all(queue: WorkQueue, subscription: str, rounds: int = 5) -> list[ClaimedDelivery]:
    transport = queue.transport
    found: list[ClaimedDelivery] = []
    for _ in range(rounds):
        batch = await transport.claim(subscription, 10)
        if not batch and found:
            break
        found.extend(batch)
    return found


async def test_publish_claim_complete_beside_a_database_topic(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    topics = [Topic(name=name, transport="aws"), Topic(name=f"{name}-db")]
    subs = [Subscription(name=f"{name}.s", topic=name, handler_key="h"),
            Subscription(name=f"{name}.db", topic=f"{name}-db", handler_key="h")]
    async with aws_queue(sqlite_url(tmp_path), moto_url, topics, subs) as queue:
        [result] = await queue.publish(name, [PublishRequest(payload={"n": 1}, attributes={"a": "1"})])
        assert result.status == PublishStatus.ACCEPTED
        [db_result] = await queue.publish(f"{name}-db", [PublishRequest(payload={"n": 2})])
        assert db_result.ok
        claimed = await claim_all(queue, f"{name}.s")
        assert len(claimed) == 1
        delivery = claimed[0]
        assert delivery.message_id == result.message_id and delivery.attributes == {"a": "1"}
        assert delivery.delivery_id.startswith("aws:") and delivery.attempt == 1
        [db_delivery] = await queue.transport.claim(f"{name}.db", 10)
        assert db_delivery.message_id == db_result.message_id
        outcome = await queue.transport.settle([
            Settlement(delivery.delivery_id, delivery.lease_token, "Complete"),
            Settlement(db_delivery.delivery_id, db_delivery.lease_token, "Complete"),
        ])
        assert outcome == ["Completed", "Completed"]
        assert await queue.transport.claim(f"{name}.s", 10) == []
        stats = {s.subscription: s for s in await queue.stats()}
        assert stats[f"{name}.s"].pending == 0 and stats[f"{name}.s"].in_flight == 0
        assert f"{name}.db" in stats


async def test_an_unbound_topic_answers_topic_unbound(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    async with aws_queue(sqlite_url(tmp_path), moto_url, [Topic(name=name, transport="aws")], [], bind=False) as queue:
        [result] = await queue.publish(name, [PublishRequest(payload={})])
        assert result.status == PublishStatus.TOPIC_UNBOUND and result.error is not None
        assert "import-bindings" in result.error.message


async def test_filter_policies_reach_only_matching_queues(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    subs = [
        Subscription(name=f"{name}.eu", topic=name, handler_key="h",
                     filter={"field": "region", "operator": "eq", "value": "eu"}),
        Subscription(name=f"{name}.not-eu", topic=name, handler_key="h",
                     filter={"field": "region", "operator": "neq", "value": "eu"}),
        Subscription(name=f"{name}.a", topic=name, handler_key="h",
                     filter={"field": "sku", "operator": "startswith", "value": "A-"}),
    ]
    async with aws_queue(sqlite_url(tmp_path), moto_url, [Topic(name=name, transport="aws")], subs) as queue:
        await queue.publish(name, [PublishRequest(payload={"i": 1}, attributes={"region": "eu", "sku": "A-1"}),
                                   PublishRequest(payload={"i": 2}, attributes={"region": "us", "sku": "B-1"})])
        got = {s: sorted(d.attributes["region"] for d in await claim_all(queue, f"{name}.{s}"))
               for s in ("eu", "not-eu", "a")}
        assert got == {"eu": ["eu"], "not-eu": ["us"], "a": ["eu"]}


async def test_fifo_order_and_single_flight_per_key(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    sub = f"{name}.ex"
    async with aws_queue(sqlite_url(tmp_path), moto_url, [Topic(name=name, transport="aws", is_fifo=True)],
                         [Subscription(name=sub, topic=name, handler_key="h", partition_mode="Exclusive")]) as queue:
        await queue.publish(name, [PublishRequest(payload={"i": i}, partition_key=k)
                                   for i in range(3) for k in ("k1", "k2")])
        transport = queue.transport
        first = await transport.claim(sub, 10)
        keys = [d.partition_key or "" for d in first]
        assert sorted(set(keys)) == ["k1", "k2"]
        # Nothing more of a key while its head is in flight.
        assert await transport.claim(sub, 10) == []
        seen: dict[str, list[int]] = {"k1": [], "k2": []}
        pending = first
        while pending:
            for d in pending:
                assert d.payload_json is not None
                seen[d.partition_key or ""].append(int(d.payload_json.split(":")[1].rstrip("}")))
            await transport.settle([Settlement(d.delivery_id, d.lease_token, "Complete") for d in pending])
            pending = await transport.claim(sub, 10)
        assert seen == {"k1": [0, 1, 2], "k2": [0, 1, 2]}


async def test_redrive_after_max_attempts_then_replay_from_the_dlq(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    sub = f"{name}.s"
    async with aws_queue(sqlite_url(tmp_path), moto_url, [Topic(name=name, transport="aws")],
                         [Subscription(name=sub, topic=name, handler_key="h", max_attempts=2)]) as queue:
        [published] = await queue.publish(name, [PublishRequest(payload={"x": 1}, attributes={"a": "b"})])
        transport = queue.transport
        results = []
        for _ in range(2):
            [d] = await claim_all(queue, sub)
            results += await transport.settle([
                Settlement(d.delivery_id, d.lease_token, "Fail", delay_seconds=0, error="boom")
            ])
        assert results == ["Pending", "DeadLettered"]
        [dead] = await queue.dead_letters(sub, include_payload=True)
        assert dead.message_id == published.message_id and dead.status == "DeadLettered"
        assert dead.last_error == "boom" and dead.attempt == 2 and dead.attributes == {"a": "b"}
        assert dead.payload == {"x": 1}
        replayed = await queue.replay(sub, dead.delivery_id)
        assert replayed.result == "Replayed"
        assert await queue.dead_letters(sub) == []
        [again] = await claim_all(queue, sub)
        assert again.message_id == published.message_id and again.attempt == 1
        unsupported = await queue.discard(sub, again.delivery_id)
        assert unsupported.result == "Unsupported" and "cancel" in (unsupported.reason or "")


async def test_release_uses_no_attempt_in_this_process(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    sub = f"{name}.s"
    async with aws_queue(sqlite_url(tmp_path), moto_url, [Topic(name=name, transport="aws")],
                         [Subscription(name=sub, topic=name, handler_key="h")]) as queue:
        await queue.publish(name, [PublishRequest(payload={})])
        [d] = await claim_all(queue, sub)
        assert await queue.transport.settle([Settlement(d.delivery_id, d.lease_token, "Release")]) == ["Pending"]
        [again] = await claim_all(queue, sub)
        assert again.attempt == 1


async def test_ordered_on_an_aws_topic_is_unsupported_in_health(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    subs = [Subscription(name=f"{name}.o", topic=name, handler_key="h", partition_mode="Ordered"),
            Subscription(name=f"{name}.x", topic=name, handler_key="h", partition_mode="Exclusive")]
    topic = Topic(name=name, transport="aws", is_fifo=True)
    async with aws_queue(sqlite_url(tmp_path), moto_url, [topic], subs, bind=False) as queue:
        # The Exclusive one is bound (its consumer runs: an unbound one would be in Error); the
        # Ordered one cannot be exported, and is never consumed.
        manifest = build_manifest([topic], subs[1:], queue.settings)
        await store_bindings(queue.kernel, Bindings.parse(provision(manifest, moto_url)))
        await aws_of(queue).reload_bindings()
        queue.handler("h")(_noop)
        host = queue.build_host()
        await host.start()
        try:
            health = {h.subscription: h for h in host.health()}
        finally:
            await host.stop()
        assert health[f"{name}.o"].state == "Unsupported"
        assert "Ordered needs a database topic" in (health[f"{name}.o"].reason or "")
        assert "keeps its key busy" in (health[f"{name}.x"].reason or "")


async def _noop(message: WorkMessage[Any]) -> None:
    await asyncio.sleep(0)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKQUEUE_DATABASE_URL", raising=False)


async def test_heartbeats_extend_the_visibility_and_a_forged_token_is_dead(tmp_path: Path, moto_url: str) -> None:
    from fastapi_workqueue.core.transport import HeartbeatRequest

    name = unique("t")
    sub = f"{name}.s"
    async with aws_queue(sqlite_url(tmp_path), moto_url, [Topic(name=name, transport="aws")],
                         [Subscription(name=sub, topic=name, handler_key="h", lease_seconds=30)]) as queue:
        await queue.publish(name, [PublishRequest(payload={})])
        [d] = await claim_all(queue, sub)
        alive, forged = await queue.transport.heartbeat([
            HeartbeatRequest(d.delivery_id, d.lease_token),
            HeartbeatRequest(d.delivery_id, "forged"),
        ])
        assert alive.alive and alive.lease_expires_at is not None
        assert not forged.alive
        info = await queue.get_delivery(d.delivery_id)
        assert info is not None and info.status == "InFlight"
        assert await queue.transport.settle([Settlement(d.delivery_id, "forged", "Complete")]) == ["LeaseLost"]


async def test_a_delay_or_a_deduplication_key_on_a_standard_topic_is_refused(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    async with aws_queue(sqlite_url(tmp_path), moto_url, [Topic(name=name, transport="aws")],
                         [Subscription(name=f"{name}.s", topic=name, handler_key="h")]) as queue:
        delayed, other = await queue.publish(name, [PublishRequest(payload={}, delay_seconds=5),
                                                    PublishRequest(payload={})])
        assert delayed.status == PublishStatus.REJECTED and delayed.error is not None
        assert "cannot delay" in delayed.error.message
        assert other.status == PublishStatus.REJECTED and other.error is not None and other.error.code == "BatchAborted"
        [keyed] = await queue.publish(name, [PublishRequest(payload={}, deduplication_key="k")])
        assert keyed.status == PublishStatus.REJECTED and "is_fifo=True" in (keyed.error.message if keyed.error else "")
