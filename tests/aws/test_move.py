"""Moving a topic from the database to AWS is a change of its ``transport`` field alone: the
database still holds the old topology rows and the deliveries Pending at the move. Hosts run each
subscription once, on its new transport, never a Lambda-served one; what the database still
holds is forwarded to the subscription's SQS queue or reported, never left Pending unseen."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkMessage, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.routing import RoutingTransport
from fastapi_workqueue.core.transport import Settlement

from ..conftest import unique
from ..support import wait_for
from .deployed import deployed_queue, provision_queue, running, sqs_client
from .test_cli_aws import ROOT, workqueue

pytestmark = pytest.mark.timeout(120)


def topology(name: str, transport: str) -> tuple[list[Topic], list[Subscription]]:
    topics = [Topic(name=name, transport=transport)]
    subs = [Subscription(name=f"{name}.work", topic=name, handler_key="work"),
            Subscription(name=f"{name}.archive", topic=name, handler_key="archive", max_attempts=1)]
    return topics, subs


async def before_the_move(database_url: str, name: str) -> int:
    """The app on the database: three messages Pending on each subscription, one dead letter on
    .archive (settled by a host of that version); answers the dead letter's delivery id."""
    topics, subs = topology(name, "database")
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, disable_host=True),
                      topics=topics, subscriptions=subs)
    async with queue.lifespan():
        await queue.publish(name, [PublishRequest(payload={"n": n}) for n in range(4)])
        [dead] = await queue.transport.claim(f"{name}.archive", 1)
        assert await queue.transport.settle([Settlement(dead.delivery_id, dead.lease_token, "DeadLetter",
                                                        reason="poison")]) == ["DeadLettered"]
        [done] = await queue.transport.claim(f"{name}.work", 1)
        assert await queue.transport.settle([Settlement(done.delivery_id, done.lease_token, "Complete")]) == [
            "Completed"]
    return int(dead.delivery_id)


async def test_a_topic_moved_to_aws_runs_each_subscription_once_and_forwards_what_the_database_held(
    database_url: str, moto_url: str,
) -> None:
    name = unique("moved")
    dead_id = await before_the_move(database_url, name)
    topics, subs = topology(name, "aws")
    queue = deployed_queue(database_url, moto_url, topics, subs, aws_lambda_subscriptions=[f"{name}.archive"])
    ran: dict[str, list[int]] = {"work": [], "archive": []}

    @queue.handler("work")
    async def work(message: WorkMessage[dict[str, Any]]) -> None:
        ran["work"].append(message.payload["n"])

    @queue.handler("archive")  # registered here too: still Lambda's, never this host's
    async def archive(message: WorkMessage[dict[str, Any]]) -> None:
        ran["archive"].append(message.payload["n"])

    document = provision_queue(queue, moto_url)
    async with running(queue, document):
        routing = queue.transport
        assert isinstance(routing, RoutingTransport)
        database = routing.database
        await queue.publish(name, [PublishRequest(payload={"n": 9})])
        await wait_for(lambda: sorted(ran["work"]) == [1, 2, 3, 9], within=60,
                       describe=lambda: ran)  # the three left Pending at the move, and the new one

        async def forwarded() -> bool:  # the forwarder's pass has settled what it sent, for both
            rows = await database.stats()
            return all(r.pending == r.in_flight == 0 for r in rows if r.subscription.startswith(name))

        await wait_for(forwarded, within=60)

        health = {s.subscription: s for s in queue.health().subscriptions}
        assert f"{name}.work" in health and health[f"{name}.work"].state == "Running"
        assert f"{name}.archive" not in health or health[f"{name}.archive"].state != "Running"

        stats = await queue.stats()
        names = [s.subscription for s in stats]
        assert len(names) == len(set(names))
        mine = {s.subscription: s for s in stats if s.subscription.startswith(name)}
        assert set(mine) == {f"{name}.work", f"{name}.archive"}
        reason = mine[f"{name}.archive"].reason
        assert reason is not None and "1 dead letter" in reason and "database" in reason and "--app" in reason
        assert mine[f"{name}.work"].reason is None

        # Lambda's queue got what the database held for it; this host ran none of it.
        archive_queue = document["subscriptions"][f"{name}.archive"]["queue_url"]
        attributes = sqs_client(moto_url).get_queue_attributes(
            QueueUrl=archive_queue, AttributeNames=["ApproximateNumberOfMessages"])["Attributes"]
        assert int(attributes["ApproximateNumberOfMessages"]) == 4  # three left at the move, the new one
        assert queue.host is not None and f"{name}.archive" not in queue.host.consumers  # none claims from it
        assert ran["archive"] == []

        # The database's leftovers were handed over, not left Pending; its dead letter stays there,
        # reachable by its id.
        for sub in (f"{name}.work", f"{name}.archive"):
            assert await database.list_deliveries(sub, "Pending") == []
        handed_over = await database.list_deliveries(f"{name}.archive", "Discarded")
        assert len(handed_over) == 3 and all("forwarded to" in (d.reason or "") for d in handed_over)
        letters = await queue.dead_letters(f"{name}.archive")
        assert str(dead_id) in {d.delivery_id for d in letters}
        replayed = await queue.replay(f"{name}.archive", str(dead_id), "after the move")
        assert replayed.result == "Replayed"

    # The database records the move: the CLI on the database alone refuses the moved subscription.
    refused = await asyncio.to_thread(workqueue, "dead-letters", "--subscription", f"{name}.archive",
                                      env={"WORKQUEUE_DATABASE_URL": database_url}, cwd=ROOT)
    assert refused.returncode == 1 and "is on the aws transport" in refused.stderr, refused.stderr
