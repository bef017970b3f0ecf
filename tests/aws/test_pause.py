"""A pause on the aws transport holds for every process: it is the queue's ``workqueue:status``
tag, which each process reads on its bindings refresh."""

from __future__ import annotations

from pathlib import Path

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.aws.transport import STATUS_TAG

from ..conftest import unique
from .provision import clients
from .world import aws_of, aws_queue


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"


async def test_a_pause_made_in_one_process_stops_claims_in_another(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    sub = f"{name}.s"
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=sub, topic=name, handler_key="h")]
    url = sqlite_url(tmp_path)
    async with aws_queue(url, moto_url, topics, subs) as first, \
            aws_queue(url, moto_url, topics, subs, bind=False) as second:
        here, there = aws_of(first), aws_of(second)
        await there.reload_bindings()  # the bindings the first process imported
        await first.publish(name, [PublishRequest(payload=i) for i in range(2)])

        assert await first.pause(sub) is True
        _, sqs = clients(moto_url)
        assert here.bindings is not None
        queue_url = here.bindings.subscriptions[sub].queue_url
        assert sqs.list_queue_tags(QueueUrl=queue_url)["Tags"][STATUS_TAG] == "Paused"
        # The other process learns it on its next bindings refresh (every BINDINGS_REFRESH_SECONDS).
        assert there.subscription_status(sub) == "Active"
        await there.reload_bindings()
        assert await second.transport.claim(sub, 10) == []
        [state] = [s for s in await second.transport.list_subscriptions() if s.name == sub]
        assert state.status == "Paused"
        [stats] = await second.stats(sub)
        assert stats.status == "Paused" and stats.claimable == 0
        assert await second.pause(sub) is False  # already paused, whoever paused it

        assert await second.resume(sub) is True
        await here.reload_bindings()
        assert len(await first.transport.claim(sub, 10)) == 2


async def test_a_subscription_declared_paused_stays_paused_until_resumed(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    sub = f"{name}.s"
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=sub, topic=name, handler_key="h", status="Paused")]
    async with aws_queue(sqlite_url(tmp_path), moto_url, topics, subs) as queue:
        await queue.publish(name, [PublishRequest(payload=1)])
        assert await queue.transport.claim(sub, 10) == []
        assert await queue.resume(sub) is True
        await aws_of(queue).reload_bindings()  # the tag now says Active
        assert len(await queue.transport.claim(sub, 10)) == 1
