"""A publish never fails in silence: a topic nobody knows raises UnknownTopic (and takes the
request's transaction down with it), every other refusal is logged at WARNING with its topic and
code, and ``raise_for_errors()`` turns refusals into an exception."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue import (
    ConfigurationError,
    PublishFailed,
    PublishRequest,
    PublishResults,
    Topic,
    UnknownTopic,
    WorkQueue,
    WorkQueueSettings,
)

from .conftest import unique
from .support import make_queue

pytestmark = pytest.mark.timeout(60)


async def test_publishing_to_a_topic_nobody_knows_raises(database_url: str) -> None:
    queue, topic, subs = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True)
    typo = topic + "s"
    async with queue.lifespan(None):
        with pytest.raises(UnknownTopic) as raised:
            await queue.publish(typo, [PublishRequest(payload={"n": 1})])
        assert raised.value.topic == typo
        assert str(raised.value) == (f"cannot publish to topic {typo!r}: neither the code declares it "
                                     f"(Topic(name={typo!r})) nor the store holds it; check the name")
        [stats] = await queue.stats(subs["a"])
        assert stats.pending == 0


async def test_an_endpoint_that_publishes_to_an_unknown_topic_commits_nothing(database_url: str) -> None:
    queue, _, _ = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True)
    table = unique("orders").replace("-", "_")
    app = FastAPI(lifespan=queue.lifespan)

    @app.post("/orders")
    async def create(session: AsyncSession = queue.session) -> dict[str, str]:
        await session.execute(text(f"INSERT INTO {table} (id) VALUES (:id)"), {"id": str(uuid.uuid4())})
        await queue.publish("order.created.typo", [PublishRequest(payload={"n": 1})], session=session)
        return {"ok": "yes"}

    async with queue.lifespan(app):
        async with queue.sessionmaker() as setup:
            await setup.execute(text(f"CREATE TABLE {table} (id VARCHAR(36) PRIMARY KEY)"))
            await setup.commit()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            answer = await http.post("/orders")
        assert answer.status_code == 500
        async with queue.sessionmaker() as check:
            assert (await check.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one() == 0


async def test_refusals_are_logged_and_raise_for_errors_raises(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue, topic, _ = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True)
    caplog.set_level(logging.WARNING, logger="fastapi_workqueue")
    first = PublishRequest(message_id=uuid.uuid4(), payload={"n": 1})
    async with queue.lifespan(None):
        accepted = await queue.publish(topic, [first])
        assert isinstance(accepted, PublishResults) and accepted.ok
        assert accepted.raise_for_errors() is accepted
        assert not caplog.records
        conflict = await queue.publish(topic, [PublishRequest(message_id=first.message_id, payload={"n": 2})])
        refused = await queue.publish(topic, [PublishRequest(payload={"n": 3}),
                                              PublishRequest(payload={"n": 4}, attributes={"x": 1})])
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines[0] == (logging.WARNING, f"publish to {topic}: item 0 was MessageIDConflict (MessageIDConflict): "
                                         "a message with this MessageID and different content, or on another "
                                         "topic, was already published; use a new MessageID for new content")
    assert len(lines) == 2 and lines[1][0] == logging.WARNING
    assert lines[1][1].startswith(f"publish to {topic}: item 1 was Rejected (")  # the item refused, not BatchAborted
    with pytest.raises(PublishFailed) as raised:
        refused.raise_for_errors()
    assert [index for index, _ in raised.value.failures] == [0, 1]
    assert str(raised.value).startswith("2 of 2 requests were not published: item 0: Rejected BatchAborted:")
    with pytest.raises(PublishFailed, match="item 0: MessageIDConflict MessageIDConflict: a message with this"):
        conflict.raise_for_errors()


async def test_a_topic_declared_in_code_of_a_queue_never_opened_says_what_to_run(database_url: str) -> None:
    """The queue's lifespan never ran (a mounted sub-app's, say), yet an endpoint's request session
    works and a publish joins it: the queue's topics are not in the store, and the error says so
    rather than that the code does not declare the topic."""
    async with WorkQueue(WorkQueueSettings(database_url=database_url, enabled=False, auto_migrate=True)).lifespan(None):
        pass  # (the store is migrated; nothing wrote this queue's topics to it)
    topic = unique("unopened")
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, enabled=False), topics=[Topic(name=topic)])
    try:
        with pytest.raises(UnknownTopic) as raised:
            async with queue.sessionmaker() as session, session.begin():
                await queue.publish(topic, [PublishRequest(payload=1)], session=session)
    finally:
        await queue.close()
        await queue.engine.dispose()
    assert str(raised.value).startswith(f"cannot publish to topic {topic!r}: the code declares it, but the queue "
                                        "was never opened")
    assert "lifespan=queue.lifespan" in str(raised.value) and "await queue.open()" in str(raised.value)


async def test_a_fresh_store_of_a_queue_never_opened_says_to_open_it_not_to_set_auto_migrate(tmp_path: Path) -> None:
    """A test without the app's lifespan (an ASGITransport runs none) on a fresh database: the
    schema is missing because nothing opened the queue, which would have migrated it; the error
    says that, not only to turn on the setting that is already on."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}"
    queue = WorkQueue(WorkQueueSettings(database_url=url, enabled=False, auto_migrate=True),
                      topics=[Topic(name="fresh.t")])
    try:
        with pytest.raises(ConfigurationError) as raised:
            async with queue.sessionmaker() as session, session.begin():  # (an endpoint's request session)
                await queue.publish("fresh.t", [PublishRequest(payload=1)], session=session)
    finally:
        await queue.close()
        await queue.engine.dispose()
    assert "the work queue schema is missing" in str(raised.value)
    assert "The queue was never opened: run the app with lifespan=queue.lifespan" in str(raised.value)
    # Opened, it migrates and publishes.
    async with queue.lifespan(None):
        [result] = await queue.publish("fresh.t", [PublishRequest(payload=1)])
    assert result.status == "Accepted"


def test_a_deduplication_ttl_without_a_key_is_refused() -> None:
    """A TTL with no key deduplicates nothing: accepted in silence, its sender believed it did."""
    from fastapi_workqueue.core.envelope import RequestRejected, prepare

    for request in (PublishRequest(payload=1, deduplication_ttl_seconds=600),
                    PublishRequest(payload=1, deduplication_ttl_seconds=600, partition_key="k")):
        with pytest.raises(RequestRejected) as refused:
            prepare(request)
        assert (refused.value.error.code, refused.value.error.field) == ("InvalidField", "deduplication_ttl_seconds")
        assert "without a DeduplicationKey" in refused.value.error.message
    assert prepare(PublishRequest(payload=1, deduplication_ttl_seconds=600, deduplication_key="k")).deduplication_key
