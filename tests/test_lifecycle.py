"""The subscription and topic lifecycle on a real store (PostgreSQL and an SQLite file): retire
stops the fan-out and drains or discards, delete refuses while work remains, a subscription no
code declares is Undeclared (healthy), and a rename across a rolling deploy loses nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from fastapi_workqueue import (
    ConfigurationError,
    PublishRequest,
    Subscription,
    SubscriptionPlan,
    Topic,
    WorkContext,
    WorkMessage,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.core.keys import SCOPE_ADMIN, SCOPE_OPERATE, SCOPE_READ, create_key

from .conftest import unique
from .support import FAST, make_queue, wait_for

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[1]


async def stats_of(queue: WorkQueue, name: str) -> Any:
    [stats] = await queue.stats(name)
    return stats


async def test_retire_stops_the_fan_out_and_what_is_held_drains(database_url: str) -> None:
    queue, topic, subs = make_queue(database_url, [{"role": "old"}, {"role": "kept"}], auto_migrate=True)
    handled: list[tuple[str, int]] = []
    release = asyncio.Event()

    @queue.handler("old")
    async def old(message: WorkMessage[dict[str, int]]) -> None:
        await release.wait()
        handled.append(("old", message.payload["n"]))

    @queue.handler("kept")
    async def kept(message: WorkMessage[dict[str, int]]) -> None:
        handled.append(("kept", message.payload["n"]))

    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload={"n": n}) for n in range(3)])
        result = await queue.retire(subs["old"])
        assert (result.subscription, result.status, result.changed, result.discarded) == (subs["old"], "Retired",
                                                                                          True, 0)
        assert (await queue.retire(subs["old"])).changed is False
        await queue.publish(topic, [PublishRequest(payload={"n": n}) for n in range(3, 5)])
        release.set()
        await wait_for(lambda: sorted(handled) == [("kept", n) for n in range(5)] + [("old", n) for n in range(3)])

        async def settled() -> Any:  # a handler returns before the settler writes its outcome
            stats = await stats_of(queue, subs["old"])
            return stats if stats.completed == 3 else None

        old_stats = await wait_for(settled)
        # The retired subscription got none of the later messages; its counts stay readable.
        assert (old_stats.status, old_stats.pending, old_stats.completed) == ("Retired", 0, 3)
        [health] = [s for s in queue.health().subscriptions if s.subscription == subs["old"]]
        assert health.state == "Running" and "retired" in (health.reason or "")
        # resume takes it back: the fan-out starts again.
        assert await queue.resume(subs["old"]) is True
        await queue.publish(topic, [PublishRequest(payload={"n": 9})])
        await wait_for(lambda: ("old", 9) in handled)
        assert (await stats_of(queue, subs["old"])).status == "Active"


async def test_retire_discards_what_is_pending_and_delete_waits_for_what_is_left(database_url: str) -> None:
    queue, topic, subs = make_queue(database_url, [{"role": "gone", "max_attempts": 1}], auto_migrate=True,
                                    enabled=False)
    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload={"n": n}) for n in range(4)])
        refused = await queue.delete_subscription(subs["gone"])
        assert (refused.result, refused.remaining) == ("NotRetired", 0)
        # One is running when the subscription is retired: it drains; the other three are discarded.
        [running] = await queue.transport.claim(subs["gone"], 1)
        retired = await queue.retire(subs["gone"], discard_pending=True, reason="orders.mail moved to notifications")
        assert retired.discarded == 3
        discarded = await queue.deliveries(subs["gone"], "Discarded")
        assert len(discarded) == 3 and {d.reason for d in discarded} == {"orders.mail moved to notifications"}
        waiting = await queue.delete_subscription(subs["gone"])
        assert (waiting.result, waiting.remaining) == ("HasDeliveries", 1)
        from fastapi_workqueue.core.transport import Settlement

        await queue.transport.settle([Settlement(running.delivery_id, running.lease_token, "Complete")])
        deleted = await queue.delete_subscription(subs["gone"])
        assert deleted.ok and deleted.result == "Deleted"
        assert await queue.stats(subs["gone"]) == []
        assert (await queue.delete_subscription(subs["gone"])).result == "NotFound"
        with pytest.raises(ConfigurationError, match="does not exist"):
            await queue.retire(subs["gone"])


async def test_a_retired_topic_refuses_messages_and_is_deleted_once_empty(database_url: str) -> None:
    queue, topic, subs = make_queue(database_url, [{"role": "a"}], auto_migrate=True, enabled=False)
    async with queue.lifespan(None):
        change = await queue.set_topic_status(topic, "Retired")
        assert (change.status, change.changed) == ("Retired", True)
        [refused] = await queue.publish(topic, [PublishRequest(payload={"n": 1})])
        assert refused.status == "Rejected" and refused.error is not None
        assert refused.error.code == "TopicRetired" and f"workqueue topics resume {topic}" in refused.error.message
        # (it names no MessageID: the store's refusal carried one made for it, never stored; a
        # refused request names only the MessageID its caller gave)
        assert refused.message_id is None
        given = uuid.uuid4()
        [named] = await queue.publish(topic, [PublishRequest(message_id=given, payload={"n": 1})])
        assert (named.status, named.message_id) == ("Rejected", given)
        assert [getattr(t, "status", None) for t in await queue.transport.list_topics() if t.name == topic] == [
            "Retired"]
        assert (await queue.delete_topic(topic)).result == "HasSubscriptions"
        await queue.set_topic_status(topic, "Active")
        [accepted] = await queue.publish(topic, [PublishRequest(payload={"n": 2})])
        assert accepted.status == "Accepted"
        await queue.set_topic_status(topic, "Retired")
        await queue.retire(subs["a"], discard_pending=True)
        assert (await queue.delete_subscription(subs["a"])).ok
        assert (await queue.delete_topic(topic)).ok
        assert topic not in {t.name for t in await queue.transport.list_topics()}


async def test_a_stored_subscription_no_code_declares_is_undeclared_and_healthy(database_url: str) -> None:
    writer, _, subs = make_queue(database_url, [{"role": "orphan"}], auto_migrate=True, enabled=False)
    async with writer.lifespan(None):
        pass  # stores the topic and the subscription, as an earlier release did
    name = subs["orphan"]
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, subscriptions=[SubscriptionPlan(name=name)],
                                        **FAST))
    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.health_router)
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://t") as http:
        answer = await http.get("/health/extensions")
    assert answer.status_code == 200
    [entry] = answer.json()["Extensions"][0]["Subscriptions"]
    assert entry["State"] == "Undeclared"
    assert f"`workqueue subscriptions retire {name}`" in entry["Reason"]


async def test_deleting_a_subscription_the_plan_still_names_keeps_the_instance_healthy(database_url: str) -> None:
    """docs/runbooks.md ("A subscription was removed"): the last step deletes it. Every instance
    whose WORKQUEUE_SUBSCRIPTIONS still named it then answered 503 for good ("does not exist"),
    which takes them all out of their load balancer. Deleted while the process ran, it is
    Undeclared (healthy) with the plan to mend; a process that starts with that plan is not."""
    writer, _, subs = make_queue(database_url, [{"role": "orphan"}], auto_migrate=True, enabled=False)
    async with writer.lifespan(None):
        pass  # stores the topic and the subscription, as an earlier release did
    name = subs["orphan"]

    def planned() -> WorkQueue:
        return WorkQueue(WorkQueueSettings(database_url=database_url, subscriptions=[SubscriptionPlan(name=name)],
                                           **FAST))

    queue = planned()
    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.health_router)
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://t") as http:
        assert (await http.get("/health/extensions")).status_code == 200
        await queue.retire(name)
        assert (await queue.delete_subscription(name)).ok
        await wait_for(lambda: any(word in (queue.health().subscriptions[0].reason or "")
                                   for word in ("deleted", "does not exist")))  # (the next reconcile)
        answer = await http.get("/health/extensions")
        assert answer.status_code == 200, answer.text
        [entry] = answer.json()["Extensions"][0]["Subscriptions"]
        assert entry["State"] == "Undeclared"
        assert "deleted" in entry["Reason"] and "WORKQUEUE_SUBSCRIPTIONS" in entry["Reason"]
    fresh = planned()
    async with fresh.lifespan(None):
        [entry] = fresh.health().subscriptions
    assert entry.state == "Error" and "WORKQUEUE_SUBSCRIPTIONS" in (entry.reason or "")


async def test_the_rest_api_retires_and_deletes_with_the_scopes_it_needs(database_url: str) -> None:
    queue, topic, subs = make_queue(database_url, [{"role": "r"}], auto_migrate=True, enabled=False)
    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.router)
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://t") as http:
        await queue.publish(topic, [PublishRequest(payload={"n": 1})])
        operate = (await create_key(queue.transport, unique("ops"), [SCOPE_READ, SCOPE_OPERATE])).key
        admin = (await create_key(queue.transport, unique("adm"), [SCOPE_ADMIN])).key
        path = f"/work-queue/subscriptions/{subs['r']}"
        assert (await http.post(f"{path}/retire", headers={"X-API-Key": admin})).status_code == 403
        retired = await http.post(f"{path}/retire", headers={"X-API-Key": operate})
        assert retired.status_code == 200 and retired.json() == {"Subscription": subs["r"], "Status": "Retired",
                                                                  "Changed": True, "Discarded": 0}
        paused = await http.post(f"{path}/pause", headers={"X-API-Key": operate})
        assert paused.status_code == 409 and "is retired and cannot be paused" in paused.json()["detail"]
        assert (await http.delete(path, headers={"X-API-Key": operate})).status_code == 403
        busy = await http.delete(path, headers={"X-API-Key": admin})
        assert busy.status_code == 409 and busy.json() == {"Name": subs["r"], "Result": "HasDeliveries",
                                                           "Remaining": 1}
        discarded = await http.post(f"{path}/retire", headers={"X-API-Key": operate},
                                    json={"DiscardPending": True, "Reason": "moved"})
        assert discarded.json()["Discarded"] == 1
        assert (await http.delete(path, headers={"X-API-Key": admin})).status_code == 200
        assert (await http.post("/work-queue/subscriptions/nope/retire",
                                headers={"X-API-Key": operate})).status_code == 404


async def test_a_rename_across_a_rolling_deploy_loses_nothing(database_url: str, tmp_path: Path) -> None:
    """The previous release (another process) still declares and runs orders.mail; the new one
    declares its replacement. Both get every message until the old one is retired; after that only
    the new one does, the old drains, and once it is empty it is deleted. The new release's
    health is never 503 meanwhile."""
    topic, old, new = unique("rolling"), unique("rolling.mail"), unique("rolling.notify")
    record = tmp_path / "record.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env.update(PYTHONPATH=str(ROOT), WORKQUEUE_DATABASE_URL=database_url, ROLLING_TOPIC=topic, ROLLING_OLD=old,
               ROLLING_RECORD=str(record), WORKQUEUE_AUTO_MIGRATE="1")
    with (tmp_path / "previous.err").open("wb") as previous_log:  # a pipe nobody reads would fill
        previous = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fastapi_workqueue", "work", "--app", "tests.apps.rolling_app:queue",
            "--subscription", old, cwd=tmp_path, env=env, stderr=previous_log,
        )
    queue = WorkQueue(
        WorkQueueSettings(database_url=database_url, auto_migrate=True, **FAST,
                          subscriptions=[SubscriptionPlan(name="*")]),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=new, topic=topic, handler_key="notify")],
    )
    seen: list[int] = []

    @queue.handler("notify")
    async def notify(message: WorkMessage[dict[str, int]]) -> None:
        seen.append(message.payload["n"])

    def by_old() -> list[int]:
        if not record.exists():
            return []
        return sorted(json.loads(line)["n"] for line in record.read_text().splitlines() if line.strip())

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.health_router)
    codes: list[int] = []
    try:
        async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                          base_url="http://t") as http:
            async def health() -> dict[str, str]:
                answer = await http.get("/health/extensions")
                codes.append(answer.status_code)
                return {s["Subscription"]: s["State"] for s in answer.json()["Extensions"][0]["Subscriptions"]}

            await wait_for(lambda: _stored(queue, old), within=30)  # the previous release's worker is up
            await _reconcile(queue)
            states = await health()
            assert states[new] == "Running" and states[old] == "Undeclared"
            await queue.publish(topic, [PublishRequest(payload={"n": n}) for n in range(5)])
            await wait_for(lambda: by_old() == list(range(5)) and sorted(seen) == list(range(5)), within=30)
            await queue.retire(old)
            await health()
            await queue.publish(topic, [PublishRequest(payload={"n": n}) for n in range(5, 10)])
            await wait_for(lambda: sorted(seen) == list(range(10)), within=30)
            assert by_old() == list(range(5))  # the retired subscription got none of the later ones
            assert (await stats_of(queue, old)).pending == 0
            previous.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(previous.wait(), 30) == 0, (tmp_path / "previous.err").read_text()[-3000:]
            assert (await queue.delete_subscription(old)).ok
            await _reconcile(queue)
            assert old not in (await health())
    finally:
        if previous.returncode is None:
            previous.kill()
            await previous.wait()
    assert codes and set(codes) == {200}
    assert sorted(seen) == list(range(10))


async def test_a_rename_that_keeps_the_handler_runs_the_new_name_only(database_url: str) -> None:
    """The new release declares orders.notify-v2 with the handler orders.notify had: it runs the new
    subscription and reports the old one Undeclared (with the retire command), not both, which would
    run the handler twice for every message."""
    topic, old, new = unique("keep"), unique("keep.notify"), unique("keep.notify-v2")
    previous = _release(database_url, topic, [Subscription(name=old, topic=topic, handler_key="notify")],
                        enabled=False)
    async with previous.lifespan(None):
        pass  # the previous release stored its subscription
    queue = WorkQueue(
        WorkQueueSettings(database_url=database_url, auto_migrate=True, **FAST,
                          subscriptions=[SubscriptionPlan(name="*")]),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=new, topic=topic, handler_key="notify")],
    )
    calls: list[str] = []

    @queue.handler("notify")
    async def notify(message: WorkMessage[Any], context: WorkContext) -> None:
        calls.append(context.subscription)

    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload={"n": n}) for n in range(3)])
        await wait_for(lambda: len(calls) == 3, within=20)
        await _reconcile(queue)
        states = {s.subscription: s for s in queue.health().subscriptions}
        assert (await stats_of(queue, old)).pending == 3  # kept for the instances that still declare it
    assert calls == [new] * 3
    assert states[old].state == "Undeclared" and states[new].state == "Running"
    assert f"`workqueue subscriptions retire {old}`" in (states[old].reason or "")


async def _stored(queue: WorkQueue, name: str) -> bool:
    return name in {s.name for s in await queue.transport.list_subscriptions()}


async def _reconcile(queue: WorkQueue) -> None:
    host = queue.host
    assert host is not None
    await host.reconcile()


def _release(url: str, topic: str, subscriptions: list[Subscription], *, topics: list[str] | None = None,
             enabled: bool = True) -> WorkQueue:
    """One release of an app: its topics (``topic`` and ``topics``) and subscriptions, the host
    planning only these subscriptions."""
    return WorkQueue(
        WorkQueueSettings(database_url=url, auto_migrate=True, enabled=enabled, **FAST,
                          subscriptions=[SubscriptionPlan(name=s.name) for s in subscriptions]),
        topics=[Topic(name=name) for name in [topic, *(topics or [])]],
        subscriptions=subscriptions,
    )


async def test_a_release_that_renames_a_handler_key_leaves_the_older_instances_serving(database_url: str) -> None:
    topic, sub = unique("rename-key"), unique("rename-key-sub")
    older = _release(database_url, topic, [Subscription(name=sub, topic=topic, handler_key="mail.v1")])
    seen: list[int] = []

    @older.handler("mail.v1")
    async def mail(message: WorkMessage[dict[str, int]]) -> None:
        seen.append(message.payload["n"])

    app = FastAPI(lifespan=older.lifespan)
    app.include_router(older.health_router)
    newer = _release(database_url, topic, [Subscription(name=sub, topic=topic, handler_key="mail.v2")], enabled=False)
    async with older.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://t") as http, newer.lifespan(None):
            # the next release has synced its key (its host is off here)
            assert [s.handler_key for s in await older.transport.list_subscriptions() if s.name == sub] == ["mail.v2"]
            await _reconcile(older)
            answer = await http.get("/health/extensions")
            assert answer.status_code == 200, answer.text
            [entry] = answer.json()["Extensions"][0]["Subscriptions"]
            assert (entry["State"], entry["Reason"]) == ("Running", None)
            await newer.publish(topic, [PublishRequest(payload={"n": n}) for n in range(3)])
            await wait_for(lambda: sorted(seen) == [0, 1, 2], within=30)  # the older instance's own handler ran


async def test_a_subscription_does_not_move_to_another_topic_and_a_refused_sync_writes_nothing(
    database_url: str,
) -> None:
    created, placed, audit = unique("move-from"), unique("move-to"), unique("move-audit")
    sub = unique("move-sub")
    first = _release(database_url, created, [Subscription(name=sub, topic=created, handler_key="h")], enabled=False)
    async with first.lifespan(None):
        pass  # stored on its topic, no work left: a move would once have been applied in silence
    moved = _release(database_url, created, [Subscription(name=sub, topic=placed, handler_key="h"),
                                             Subscription(name=audit, topic=placed, handler_key="h")],
                     topics=[placed], enabled=False)
    with pytest.raises(ConfigurationError) as info:
        async with moved.lifespan(None):
            pass
    message = str(info.value)
    assert f"subscription {sub} is on topic {created} in the store, and the code puts it on topic {placed}" in message
    assert f"declare a new subscription on {placed} and retire {sub}" in message
    async with first.lifespan(None):
        stored = {s.name: s.topic for s in await first.transport.list_subscriptions()}
        assert stored[sub] == created and audit not in stored  # nothing of the refused release was written
        assert placed not in {t.name for t in await first.transport.list_topics()}
        [result] = await first.publish(created, [PublishRequest(payload={"n": 1})])
        assert result.ok
        assert (await stats_of(first, sub)).pending == 1  # the older release's publishes still reach it


async def test_a_served_subscription_deleted_by_an_operator_is_logged_where_it_ran(
    database_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    topic, sub = unique("deleted-live"), unique("deleted-live-sub")
    queue = _release(database_url, topic, [Subscription(name=sub, topic=topic, handler_key="h")])

    @queue.handler("h")
    async def handle(message: WorkMessage[dict[str, int]]) -> None:
        return None

    async with queue.lifespan(None):
        assert sub in (queue.host.consumers if queue.host is not None else {})
        await queue.retire(sub)
        assert (await queue.delete_subscription(sub)).ok
        with caplog.at_level("WARNING", logger="fastapi_workqueue.host"):
            await _reconcile(queue)
        assert sub not in (queue.host.consumers if queue.host is not None else {})
    [record] = [r for r in caplog.records if r.name == "fastapi_workqueue.host" and sub in r.getMessage()]
    assert "no longer in the store (deleted): this process stops serving it" in record.getMessage()
