"""What SNS and SQS cannot honour of issue 31's flow control is refused, never ignored: a priority
at publish (SQS hands messages out in its own order), and a subscription's concurrency and rate
limits as soon as the host plans it (``Unsupported`` in health, with the limit named), as Ordered
is; ``export-topology`` refuses them too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkMessage
from fastapi_workqueue.aws.manifest import build_manifest
from fastapi_workqueue.core.envelope import PublishStatus, prepare
from fastapi_workqueue.core.errors import ConfigurationError

from ..conftest import unique
from .world import aws_queue


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"


async def _noop(message: WorkMessage[Any]) -> None:
    return None


async def test_a_priority_on_an_aws_topic_is_refused_at_publish(tmp_path: Path, moto_url: str) -> None:
    name = unique("t")
    async with aws_queue(sqlite_url(tmp_path), moto_url, [Topic(name=name, transport="aws")],
                         [Subscription(name=f"{name}.s", topic=name, handler_key="h")]) as queue:
        [refused] = await queue.transport.publish(name, [prepare(PublishRequest(payload={}, priority=9))])
        assert refused.status == PublishStatus.REJECTED and refused.error is not None
        assert refused.error.code == "Unsupported" and refused.error.field == "priority"
        assert "no priorities" in refused.error.message
        [plain] = await queue.transport.publish(name, [prepare(PublishRequest(payload={}))])
        assert plain.status == PublishStatus.ACCEPTED


async def test_a_not_before_already_past_is_due_now_on_an_aws_topic_and_one_ahead_is_refused(
    tmp_path: Path, moto_url: str
) -> None:
    """A NotBefore in the past asks for no delay (due at once, as on every transport): it was
    refused as "cannot delay a publish"."""
    from datetime import UTC, datetime, timedelta

    name = unique("t")
    async with aws_queue(sqlite_url(tmp_path), moto_url, [Topic(name=name, transport="aws")],
                         [Subscription(name=f"{name}.s", topic=name, handler_key="h")]) as queue:
        past = datetime(2000, 1, 1, tzinfo=UTC)
        [taken] = await queue.transport.publish(name, [prepare(PublishRequest(payload={}, not_before=past))])
        assert taken.status == PublishStatus.ACCEPTED, taken
        ahead = datetime.now(UTC) + timedelta(minutes=5)
        [refused] = await queue.transport.publish(name, [prepare(PublishRequest(payload={}, not_before=ahead))])
        assert refused.status == PublishStatus.REJECTED and refused.error is not None
        assert (refused.error.code, refused.error.field) == ("Unsupported", "not_before")
        assert refused.message_id is None  # (a refusal carries no MessageID, on every store: nothing was stored)
        assert "cannot delay a publish" in refused.error.message


@pytest.mark.parametrize(("limits", "named", "why"), [
    ({"max_in_flight": 5}, "max_in_flight=5", "cannot count"),
    ({"key_concurrency": 2}, "key_concurrency=2", "cannot count"),
    ({"rate_limit": "50/s"}, "rate_limit='50/s'", "cannot meter"),
    ({"key_rate_limit": "10/m"}, "key_rate_limit='10/m'", "cannot meter"),
])
async def test_flow_limits_on_an_aws_topic_are_unsupported_at_declaration(
    tmp_path: Path, moto_url: str, limits: dict[str, Any], named: str, why: str
) -> None:
    name = unique("t")
    topic = Topic(name=name, transport="aws")
    sub = Subscription(name=f"{name}.s", topic=name, handler_key="h", **limits)
    async with aws_queue(sqlite_url(tmp_path), moto_url, [topic], [sub], bind=False) as queue:
        queue.handler("h")(_noop)
        host = queue.build_host()
        await host.start()
        try:
            [health] = [h for h in host.health() if h.subscription == sub.name]
        finally:
            await host.stop()
        assert health.state == "Unsupported"
        assert named in (health.reason or "") and why in (health.reason or "")
        with pytest.raises(ConfigurationError, match="needs a database topic"):
            build_manifest([topic], [sub], queue.settings)
