"""The W3C trace context across AWS: a publish to an aws topic (straight to SNS, or through the
outbox and its relay) carries the producer's trace to the consumer, whose ``process`` span is the
child of the ``send`` span, and the context takes none of the user's 10 attributes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from fastapi_workqueue import Outcome, PublishRequest, Subscription, Topic, WorkMessage, WorkOutcome, WorkQueue
from fastapi_workqueue.aws.bindings import Bindings, store_bindings
from fastapi_workqueue.aws.manifest import build_manifest
from fastapi_workqueue.observability.otel import OpenTelemetryObserver

from ..conftest import unique
from ..support import wait_for
from .provision import provision
from .world import aws_queue

pytestmark = pytest.mark.timeout(60)

TEN = {f"a{i}": str(i) for i in range(10)}
"""As many attributes as a message may have."""


@asynccontextmanager
async def traced_host(tmp_path: Path, moto_url: str, exporter: InMemorySpanExporter,
                      seen: list[dict[str, Any]]) -> AsyncIterator[tuple[WorkQueue, str]]:
    """A running host consuming an aws topic, tracing into ``exporter`` through its own provider
    (the global one stays the other tests'); the bindings were imported before it starts."""
    name = unique("traced")
    topics = [Topic(name=name, transport="aws")]
    subs = [Subscription(name=f"{name}.s", topic=name, handler_key="traced")]
    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    async with aws_queue(url, moto_url, topics, subs, bind=False) as deploy:  # migrate, import-bindings
        manifest = build_manifest(topics, subs, deploy.settings)
        await store_bindings(deploy.kernel, Bindings.parse(provision(manifest, moto_url)))
    queue = WorkQueue(deploy.settings.model_copy(update={
        "disable_host": False, "otel": False, "prometheus": False, "aws_relay": True, "aws_relay_interval_ms": 20,
        "idle_poll_min_ms": 10, "idle_poll_max_ms": 50,
    }), topics=topics, subscriptions=subs)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    queue.add_observer(OpenTelemetryObserver(tracer_provider=provider))

    @queue.handler("traced")
    async def traced(message: WorkMessage[Any]) -> WorkOutcome:
        seen.append({"span": trace.get_current_span().get_span_context(), "attributes": dict(message.attributes)})
        return Outcome.complete()

    async with queue.lifespan(None):
        yield queue, name


def spans(exporter: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]


@pytest.mark.parametrize("path", ["sns", "outbox"])
async def test_the_trace_crosses_sns_and_sqs_and_takes_no_attribute(tmp_path: Path, moto_url: str, path: str) -> None:
    exporter = InMemorySpanExporter()
    seen: list[dict[str, Any]] = []
    async with traced_host(tmp_path, moto_url, exporter, seen) as (queue, topic):
        request = PublishRequest(payload={"n": 1}, attributes=TEN)
        if path == "sns":
            [result] = await queue.publish(topic, [request])
        else:
            async with queue.sessionmaker() as session, session.begin():
                [result] = await queue.publish(topic, [request], session=session)
        assert result.ok
        await wait_for(lambda: seen and spans(exporter, "process"), within=20)
    [send] = spans(exporter, f"send {topic}")
    [process] = spans(exporter, f"process {topic}.s")
    assert send.kind == SpanKind.PRODUCER and process.kind == SpanKind.CONSUMER
    assert process.context.trace_id == send.context.trace_id
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    assert dict(process.attributes or {})["messaging.message.id"] == str(result.message_id)
    [handled] = seen
    assert handled["span"].span_id == process.context.span_id
    # The context travels in the body: the user's 10 attributes are all there, and nothing else.
    assert handled["attributes"] == TEN
