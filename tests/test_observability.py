"""Traces, metrics and /metrics on a real queue: a request's trace continues into its handlers,
the headers that carry it stay out of the user's attributes, and the Prometheus text shows the
process's counters beside the database's gauges."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fastapi_workqueue import (
    Outcome,
    PublishRequest,
    UnknownTopic,
    WorkContext,
    WorkMessage,
    WorkOutcome,
    WorkQueue,
)
from fastapi_workqueue.core.keys import SCOPE_READ, create_key
from fastapi_workqueue.core.observe import HEADERS_KEY
from fastapi_workqueue.observability.otel import OpenTelemetryObserver
from fastapi_workqueue.observability.semconv import emit_legacy

from .conftest import unique
from .support import delivery_status, make_queue, wait_for

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]

EXPORTER = InMemorySpanExporter()
READER = InMemoryMetricReader()


@pytest.fixture(scope="module", autouse=True)
def providers() -> None:
    """The SDK with in-memory exporters as the global providers (set once per process)."""
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[READER]))


@pytest.fixture(autouse=True)
def fresh_spans() -> None:
    EXPORTER.clear()


@asynccontextmanager
async def opened(queue: WorkQueue) -> AsyncIterator[WorkQueue]:
    """The queue open without a host (nothing consumes)."""
    await queue.open()
    try:
        yield queue
    finally:
        await queue.close()


def client(app: FastAPI, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=headers)


def spans_named(prefix: str) -> list[ReadableSpan]:
    return [s for s in EXPORTER.get_finished_spans() if s.name.startswith(prefix)]


def traced_app(queue: WorkQueue, topic: str) -> FastAPI:
    app = FastAPI(lifespan=queue.lifespan)
    tracer = trace.get_tracer("the-app")

    @app.post("/orders")
    async def create_order() -> dict[str, str]:
        with tracer.start_as_current_span("create order"):
            [result] = await queue.publish(topic, [PublishRequest(payload={"n": 1}, correlation_id="order-1",
                                                                  attributes={"region": "eu"})])
        return {"id": str(result.message_id)}

    return app


@pytest.mark.parametrize("store", ["pg", "sqlite"])
async def test_a_requests_trace_continues_into_its_handler(store: str, pg_url: str, sqlite_url: str) -> None:
    queue, topic, subs = make_queue(pg_url if store == "pg" else sqlite_url, [{"role": "ship"}])
    seen: dict[str, Any] = {}

    @queue.handler("ship")
    async def ship(message: WorkMessage[Any]) -> WorkOutcome:
        seen["span"] = trace.get_current_span().get_span_context()
        seen["attributes"] = dict(message.attributes)
        return Outcome.complete()

    app = traced_app(queue, topic)
    async with queue.lifespan(app), client(app) as http:
        message_id = (await http.post("/orders")).json()["id"]
        await wait_for(lambda: spans_named("settle") and "span" in seen)
        info = await delivery_status(queue, subs["ship"], uuid.UUID(message_id))

    [request] = spans_named("create order")
    [send] = spans_named(f"send {topic}")
    [process] = spans_named(f"process {subs['ship']}")
    # The request's span is the parent of the publish; the process span is the child of the send
    # span's context (read back from the database) and links to it.
    assert send.parent is not None and send.parent.span_id == request.context.span_id
    assert send.kind == SpanKind.PRODUCER and process.kind == SpanKind.CONSUMER
    assert process.context.trace_id == request.context.trace_id
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    # What the handler starts belongs to the attempt.
    assert seen["span"].span_id == process.context.span_id
    assert dict(send.attributes or {}) == {
        "messaging.system": "fastapi_workqueue", "messaging.operation.name": "send",
        "messaging.operation.type": "send", "messaging.destination.name": topic,
        "messaging.message.id": message_id, "messaging.message.conversation_id": "order-1",
    }
    attributes = dict(process.attributes or {})
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.consumer.group.name"] == subs["ship"]
    assert attributes["messaging.destination.name"] == topic
    assert attributes["messaging.message.id"] == message_id
    assert attributes["messaging.message.conversation_id"] == "order-1"
    assert "error.type" not in attributes
    [settle] = spans_named("settle")
    assert settle.kind == SpanKind.CLIENT
    assert process.context.span_id in [link.context.span_id for link in settle.links]
    # The trace context never shows as one of the user's attributes.
    assert seen["attributes"] == {"region": "eu"}
    assert info.attributes == {"region": "eu"}


async def test_a_failing_attempt_records_its_error_type(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "boom", "max_attempts": 1}])

    @queue.handler("boom")
    async def boom(message: WorkMessage[Any]) -> WorkOutcome:
        raise LookupError("no such order")

    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload={})])
        await wait_for(lambda: spans_named(f"process {subs['boom']}"))
    [process] = spans_named(f"process {subs['boom']}")
    assert dict(process.attributes or {})["error.type"] == "LookupError"
    assert process.status.status_code == trace.StatusCode.ERROR
    assert [e.name for e in process.events] == ["exception"]
    # The settle span says how the attempt ends the delivery, as the process span does: its last
    # attempt failed, so it is dead-lettered.
    await wait_for(lambda: spans_named("settle"))
    [settle] = spans_named("settle")
    assert dict(process.attributes or {})["messaging.workqueue.outcome"] == "DeadLetter"
    assert dict(settle.attributes or {})["messaging.workqueue.outcome"] == "DeadLetter"


async def test_a_cancelled_attempts_settle_span_says_discard(pg_url: str) -> None:
    """An operator's cancel: the handler notices at its heartbeat and returns; the store discards the
    delivery, and both spans of the attempt say so (the settle span does not repeat the Fail the
    runtime writes for an aborted attempt)."""
    queue, topic, subs = make_queue(pg_url, [{"role": "slow", "lease_seconds": 6}])
    started = asyncio.Event()

    @queue.handler("slow")
    async def slow(message: WorkMessage[Any], context: WorkContext) -> WorkOutcome:
        started.set()
        for _ in range(200):
            if not await context.heartbeat():
                break
            await asyncio.sleep(0.05)
        return Outcome.complete()

    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload={})])
        await asyncio.wait_for(started.wait(), 10)
        [running] = await queue.deliveries(subs["slow"], "InFlight")
        await queue.discard(subs["slow"], running.delivery_id, "not needed")
        await wait_for(lambda: spans_named("settle"))
        [info] = await queue.deliveries(subs["slow"], "Discarded")
    assert info.delivery_id == running.delivery_id
    [process] = spans_named(f"process {subs['slow']}")
    [settle] = spans_named("settle")
    assert process.context.span_id in [link.context.span_id for link in settle.links]
    assert dict(process.attributes or {})["messaging.workqueue.outcome"] == "Discard"
    assert dict(settle.attributes or {})["messaging.workqueue.outcome"] == "Discard"


def _call_the_mail_api() -> None:
    raise ConnectionError("smtp://mailer:hunter2@mail.internal refused")


@pytest.mark.parametrize("store", ["pg", "sqlite"])
async def test_a_failing_attempts_span_carries_no_secret(store: str, pg_url: str, sqlite_url: str) -> None:
    queue, topic, subs = make_queue(pg_url if store == "pg" else sqlite_url, [{"role": "boom", "max_attempts": 1}])

    @queue.handler("boom")
    async def boom(message: WorkMessage[Any]) -> WorkOutcome:
        try:
            _call_the_mail_api()
        except ConnectionError as exc:
            raise RuntimeError("retry with Authorization: Bearer tok-secret-42") from exc
        return Outcome.complete()

    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload={})])
        await wait_for(lambda: spans_named(f"process {subs['boom']}"))
    [process] = spans_named(f"process {subs['boom']}")
    assert process.status.description == "retry with Authorization: Bearer ***"
    [event] = process.events
    attributes = dict(event.attributes or {})
    assert attributes["exception.type"] == "RuntimeError"
    assert attributes["exception.message"] == "retry with Authorization: Bearer ***"
    stacktrace = str(attributes["exception.stacktrace"])
    assert "in _call_the_mail_api" in stacktrace
    assert "ConnectionError: smtp://mailer:***@mail.internal refused" in stacktrace
    assert stacktrace.splitlines()[-1] == "RuntimeError: retry with Authorization: Bearer ***"
    for span in EXPORTER.get_finished_spans():
        text = repr((span.status.description, [dict(e.attributes or {}) for e in span.events]))
        assert "hunter2" not in text and "tok-secret-42" not in text


async def test_batches_count_their_messages_and_ten_user_attributes_still_fit(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "take"}])
    ten = {f"a{i}": str(i) for i in range(10)}
    async with opened(queue):
        results = await queue.publish(topic, [PublishRequest(payload=i, attributes=ten) for i in range(3)])
        assert {r.status.value for r in results} == {"Accepted"}
        [claimed] = await queue.transport.claim(subs["take"], 1)
    [send] = spans_named(f"send {topic}")
    assert dict(send.attributes or {})["messaging.batch.message_count"] == 3
    assert "messaging.message.id" not in dict(send.attributes or {})
    assert claimed.attributes == ten
    assert claimed.headers is not None and claimed.headers["traceparent"].startswith("00-")


async def test_the_reserved_header_name_is_refused_as_an_attribute(pg_url: str) -> None:
    queue, topic, _ = make_queue(pg_url, [{"role": "take"}])
    async with opened(queue):
        [result] = await queue.publish(topic, [PublishRequest(payload=1, attributes={HEADERS_KEY: "x"})])
    assert result.status.value == "Rejected"
    assert result.error is not None and "reserved" in result.error.message


async def test_a_retried_publish_with_another_trace_is_still_a_duplicate(pg_url: str) -> None:
    """The headers are not content: the same message sent again from another trace deduplicates."""
    queue, topic, _ = make_queue(pg_url, [{"role": "take"}])
    tracer = trace.get_tracer("the-app")
    message_id = uuid.uuid4()
    async with opened(queue):
        with tracer.start_as_current_span("first"):
            [first] = await queue.publish(topic, [PublishRequest(message_id=message_id, payload=1)])
        with tracer.start_as_current_span("second"):
            [second] = await queue.publish(topic, [PublishRequest(message_id=message_id, payload=1)])
    assert (first.status.value, second.status.value) == ("Accepted", "Duplicate")


async def test_otel_metrics_are_recorded(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "ok"}])

    @queue.handler("ok")
    async def ok(message: WorkMessage[Any]) -> WorkOutcome:
        return Outcome.complete()

    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload=1), PublishRequest(payload=2)])
        await wait_for(lambda: len(spans_named(f"process {subs['ok']}")) == 2)
        await wait_for(lambda: spans_named("settle"))
    data = READER.get_metrics_data()
    assert data is not None
    points: dict[str, list[Any]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points.setdefault(metric.name, []).extend(metric.data.data_points)

    def of(name: str, **attributes: str) -> list[Any]:
        return [p for p in points.get(name, []) if all(p.attributes.get(k) == v for k, v in attributes.items())]

    [sent] = of("messaging.client.sent.messages", **{"messaging.destination.name": topic})
    assert sent.value == 2
    [consumed] = of("messaging.client.consumed.messages", **{"messaging.consumer.group.name": subs["ok"]})
    assert consumed.value == 2
    [process] = of("messaging.process.duration", **{"messaging.consumer.group.name": subs["ok"]})
    assert process.count == 2
    assert of("messaging.client.operation.duration", **{"messaging.operation.name": "send",
                                                         "messaging.destination.name": topic})[0].count == 1
    assert of("messaging.client.operation.duration", **{"messaging.operation.name": "settle"})


def test_the_stability_opt_in_adds_the_old_names() -> None:
    assert emit_legacy({"OTEL_SEMCONV_STABILITY_OPT_IN": "http, messaging/dup"})
    assert not emit_legacy({"OTEL_SEMCONV_STABILITY_OPT_IN": "messaging"})
    assert not emit_legacy({})
    observer = OpenTelemetryObserver(legacy_names=True)
    scope = observer.publish_started("t", 1)
    assert scope is not None
    scope.end([], None)
    [send] = spans_named("send t")
    assert dict(send.attributes or {})["messaging.operation"] == "send"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


async def test_metrics_show_each_flow_limit_its_tokens_and_what_waits_on_it(pg_url: str) -> None:
    """Issue 31: the limits of a subscription that has any, how full its rate bucket is, and the
    claimable deliveries its limits hold back (read from the database at the scrape)."""
    queue, topic, subs = make_queue(pg_url, [{"role": "limited", "max_in_flight": 2, "rate_limit": "10/s",
                                              "status": "Paused"}, {"role": "plain", "status": "Paused"}],
                                    metrics_cache_seconds=0)
    registry = CollectorRegistry()
    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.create_metrics_router(registry=registry, public=True))
    async with queue.lifespan(app):
        await queue.publish(topic, [PublishRequest(payload=i) for i in range(5)])
        await queue.resume(subs["limited"])
        assert len(await queue.transport.claim(subs["limited"], 10)) == 2
        async with client(app) as http:
            response = await http.get("/metrics")
    found = samples(response.text)
    limited = subs["limited"]
    assert found[("workqueue_flow_limit", (("limit", "max_in_flight"), ("subscription", limited)))] == 2
    assert found[("workqueue_flow_limit", (("limit", "rate_limit"), ("subscription", limited)))] == 10
    assert 8 <= found[("workqueue_flow_tokens", (("subscription", limited),))] <= 10
    assert found[("workqueue_flow_waiting", (("subscription", limited),))] == 3  # full: the rest waits
    assert not [k for k in found if k[0].startswith("workqueue_flow") and ("subscription", subs["plain"]) in k[1]]

async def test_metrics_show_counters_and_the_databases_gauges(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "ok"}, {"role": "bad", "max_attempts": 1}],
                                    metrics_cache_seconds=0)
    registry = CollectorRegistry()

    @queue.handler("ok")
    async def ok(message: WorkMessage[Any]) -> WorkOutcome:
        return Outcome.complete()

    @queue.handler("bad")
    async def bad(message: WorkMessage[Any]) -> WorkOutcome:
        raise RuntimeError("down")

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.create_metrics_router(registry=registry))
    async with queue.lifespan(app):
        key = (await create_key(queue.transport, "scraper", [SCOPE_READ])).key
        await queue.publish(topic, [PublishRequest(payload=i) for i in range(3)])
        made_up = [unique("junk") for _ in range(3)]  # a caller's names: they must not add a series each
        for name in made_up:
            with pytest.raises(UnknownTopic):
                await queue.publish(name, [PublishRequest(payload=0)])
        await wait_for(lambda: _settled(queue, subs))
        async with client(app) as anonymous:
            assert (await anonymous.get("/metrics")).status_code == 401
            # (and its OpenAPI entry says so)
            declared = (await anonymous.get("/openapi.json")).json()["paths"]["/metrics"]["get"]["responses"]
            assert {"200", "401", "403"} <= set(declared), declared
        async with client(app, Authorization=f"Bearer {key}") as http:
            response = await http.get("/metrics")
        assert response.status_code == 200
        stats = {s.subscription: s for s in await queue.stats()}
    found = samples(response.text)
    assert found[("workqueue_published_total", (("status", "Accepted"), ("topic", topic)))] == 3
    assert found[("workqueue_published_total", (("status", "Rejected"), ("topic", "(unknown)")))] >= 3
    assert not [k for k in found if any(value in made_up for _, value in k[1])]
    assert found[("workqueue_processed_total", (("outcome", "completed"), ("subscription", subs["ok"])))] == 3
    # An attempt counts by how it ends the delivery: the last one of a failing handler dead-letters.
    assert found[("workqueue_processed_total", (("outcome", "dead_lettered"), ("subscription", subs["bad"])))] == 3
    assert ("workqueue_processed_total", (("outcome", "failed"), ("subscription", subs["bad"]))) not in found
    assert found[("workqueue_process_duration_seconds_count", (("subscription", subs["ok"]),))] == 3
    assert found[("workqueue_in_flight", (("subscription", subs["ok"]),))] == 0
    for name, role in (("ok", "ok"), ("bad", "bad")):
        sub = subs[role]
        assert found[("workqueue_deliveries", (("status", "Completed"), ("subscription", sub)))] == stats[sub].completed
        assert found[("workqueue_dead_letters", (("subscription", sub),))] == stats[sub].dead_lettered
        assert found[("workqueue_backlog", (("subscription", sub),))] == 0
        assert found[("workqueue_oldest_pending_age_seconds", (("subscription", sub),))] == 0
        assert name
    assert stats[subs["bad"]].dead_lettered == 3


async def _settled(queue: WorkQueue, subs: dict[str, str]) -> bool:
    counts = {s.subscription: s for s in await queue.stats()}
    return counts[subs["ok"]].completed == 3 and counts[subs["bad"]].dead_lettered == 3


async def test_public_metrics_need_no_key_and_show_a_waiting_backlog(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "idle"}], metrics_public=True, metrics_cache_seconds=0)
    app = FastAPI()
    app.include_router(queue.metrics_router)
    async with opened(queue):
        await queue.publish(topic, [PublishRequest(payload=i) for i in range(4)])
        async with client(app) as http:
            response = await http.get("/metrics")
    assert response.status_code == 200
    found = samples(response.text)
    assert found[("workqueue_backlog", (("subscription", subs["idle"]),))] == 4
    assert found[("workqueue_deliveries", (("status", "Pending"), ("subscription", subs["idle"])))] == 4
    assert found[("workqueue_oldest_pending_age_seconds", (("subscription", subs["idle"]),))] >= 0


async def test_the_oldest_pending_age_goes_by_the_databases_clock_not_the_processs(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process whose clock runs an hour ahead of PostgreSQL's read an age of 3,600 s for a
    delivery that had waited a second (and one an hour behind read 0, so the alert never fired):
    the age is the database's time of the read less the time it stamped."""
    from datetime import UTC, datetime, timedelta

    from fastapi_workqueue.core import clock
    from fastapi_workqueue.observability import prometheus

    class Ahead(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz or UTC) + timedelta(hours=1)

    queue, topic, subs = make_queue(pg_url, [{"role": "idle"}], metrics_public=True, metrics_cache_seconds=0)
    app = FastAPI()
    app.include_router(queue.metrics_router)
    async with opened(queue):
        await queue.publish(topic, [PublishRequest(payload=1)])
        monkeypatch.setattr(prometheus, "datetime", Ahead)
        monkeypatch.setattr(clock, "datetime", Ahead)
        async with client(app) as http:
            response = await http.get("/metrics")
    assert response.status_code == 200
    age = samples(response.text)[("workqueue_oldest_pending_age_seconds", (("subscription", subs["idle"]),))]
    assert 0 <= age < 600, age


async def test_metrics_answer_without_the_store_and_say_so(pg_url: str) -> None:
    """A scrape while the store cannot be read (the queue not open here; an outage in
    test_hostile.py) answers 200 with the process's counters and ``workqueue_store_up 0``, not 500."""
    queue, topic, subs = make_queue(pg_url, [{"role": "idle"}], metrics_public=True, metrics_cache_seconds=0)
    app = FastAPI()
    app.include_router(queue.metrics_router)
    async with client(app) as http:
        away = await http.get("/metrics")
        async with opened(queue):
            await queue.publish(topic, [PublishRequest(payload=1)])
            back = await http.get("/metrics")
    assert away.status_code == 200 and samples(away.text)[("workqueue_store_up", ())] == 0
    assert "workqueue_deliveries{" not in away.text
    found = samples(back.text)
    assert found[("workqueue_store_up", ())] == 1
    assert found[("workqueue_deliveries", (("status", "Pending"), ("subscription", subs["idle"])))] == 1


def test_switched_off_the_queue_loads_no_observer() -> None:
    """With ``otel`` and ``prometheus`` off, the queue has no observer and loads neither of ours
    (nor prometheus-client)."""
    code = textwrap.dedent("""
        import sys
        from fastapi_workqueue import WorkQueue, WorkQueueSettings
        from fastapi_workqueue.core.observe import NO_OBSERVER
        queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///x.db", otel=False, prometheus=False))
        assert queue.observer is NO_OBSERVER
        print(sorted(m for m in sys.modules
                     if m.startswith(("prometheus_client", "fastapi_workqueue.observability."))))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_opentelemetry_loads_when_the_process_imports_its_api(tmp_path: Path) -> None:
    """A process that has not imported the OpenTelemetry API does not load it for the queue; once
    the app installs an SDK (importing the API), the queue's next publish is traced."""
    code = textwrap.dedent("""
        import asyncio, sys
        from fastapi_workqueue import PublishRequest, Topic, WorkQueue, WorkQueueSettings
        queue = WorkQueue(WorkQueueSettings(database_url=sys.argv[1], auto_migrate=True, enabled=False,
                                            prometheus=False), topics=[Topic(name="orders.placed")])

        async def main() -> None:
            async with queue.lifespan(None):
                await queue.publish("orders.placed", [PublishRequest(payload=1)])
                print("opentelemetry.trace" in sys.modules)
                from opentelemetry import trace
                from opentelemetry.sdk.trace import TracerProvider
                from opentelemetry.sdk.trace.export import SimpleSpanProcessor
                from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
                exporter = InMemorySpanExporter()
                provider = TracerProvider()
                provider.add_span_processor(SimpleSpanProcessor(exporter))
                trace.set_tracer_provider(provider)
                await queue.publish("orders.placed", [PublishRequest(payload=2)])
                print([span.name for span in exporter.get_finished_spans()])

        asyncio.run(main())
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code, f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"],
                         capture_output=True, text=True, check=True, cwd=tmp_path, env=env)
    assert out.stdout.splitlines() == ["False", "['send orders.placed']"]


def test_prometheus_counts_without_importing_prometheus_client_until_the_process_does(tmp_path: Path) -> None:
    """A process counts for Prometheus whether or not it imported prometheus-client before its first
    publish, and never imports it itself: once the app imports it (to serve the default registry),
    the next hook exports every count since the start."""
    code = textwrap.dedent("""
        import asyncio, sys
        from fastapi_workqueue import PublishRequest, Topic, WorkQueue, WorkQueueSettings

        async def main():
            queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///x.db", otel=False, enabled=False),
                              topics=[Topic(name="orders.placed")])
            await queue.migrate()
            async with queue.lifespan(None):
                await queue.publish("orders.placed", [PublishRequest(payload=1), PublishRequest(payload=2)])
                print(type(queue.observer).__name__, "prometheus_client" in sys.modules)
                from prometheus_client import REGISTRY
                await queue.publish("orders.placed", [PublishRequest(payload=3)])
                print(REGISTRY.get_sample_value(
                    "workqueue_published_total", {"topic": "orders.placed", "status": "Accepted"}))

        asyncio.run(main())
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env=env)
    assert out.stdout.splitlines() == ["TallyObserver False", "3.0"]


async def test_two_workers_count_their_attempts_and_the_app_serves_the_databases_gauges(
    pg_url: str, tmp_path: Path,
) -> None:
    """Two ``workqueue work --metrics-port`` processes each serve their own counters, which add up
    to the work the database shows done; the app's ``/metrics`` agrees with ``stats()``."""
    from tests.apps.cli_app import BASIC
    from tests.apps.cli_app import queue as cli_queue
    from tests.private_cluster import free_port

    ops = WorkQueue(cli_queue.settings.model_copy(update={"database_url": pg_url, "metrics_public": True,
                                                         "metrics_cache_seconds": 0}),
                    topics=cli_queue.topics.values(), subscriptions=cli_queue.subscriptions.values())
    app = FastAPI()
    app.include_router(ops.metrics_router)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKQUEUE_", "PROMETHEUS_"))}
    env.update(PYTHONPATH=str(ROOT), WORKQUEUE_DATABASE_URL=pg_url)
    ports = [free_port(), free_port()]
    async with opened(ops):
        before = {s.subscription: s for s in await ops.stats()}[BASIC].completed
        workers = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fastapi_workqueue", "work", "--app", "tests.apps.cli_app:queue",
                "--subscription", BASIC, "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                cwd=tmp_path, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            for port in ports
        ]
        try:
            await ops.publish(BASIC, [PublishRequest(payload={"sleep": 0.01}) for _ in range(40)])

            async def done() -> bool:
                return {s.subscription: s for s in await ops.stats()}[BASIC].completed - before >= 40

            await wait_for(done, within=60)
            async with httpx.AsyncClient() as scraper:

                async def processed(port: int) -> float:
                    text = (await scraper.get(f"http://127.0.0.1:{port}/metrics")).text
                    return samples(text).get(
                        ("workqueue_processed_total", (("outcome", "completed"), ("subscription", BASIC))), 0.0)

                async def counted() -> bool:
                    return sum([await processed(p) for p in ports]) >= 40

                await wait_for(counted, within=30)
                per_worker = [await processed(p) for p in ports]
            async with client(app) as http:
                found = samples((await http.get("/metrics")).text)
            stats = {s.subscription: s for s in await ops.stats()}[BASIC]
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                await asyncio.wait_for(worker.wait(), 30)
    assert sum(per_worker) == stats.completed - before == 40
    assert found[("workqueue_deliveries", (("status", "Completed"), ("subscription", BASIC)))] == stats.completed
    assert found[("workqueue_dead_letters", (("subscription", BASIC),))] == stats.dead_lettered
    assert found[("workqueue_backlog", (("subscription", BASIC),))] == stats.claimable + stats.in_flight


def test_without_an_sdk_the_observer_steps_aside() -> None:
    """Before an app installs an SDK, the API's stand-in providers record nothing: the observer
    starts no span and carries no headers (one check per call), and starts once one is set."""
    code = textwrap.dedent("""
        import uuid
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from fastapi_workqueue.core.transport import ClaimedDelivery
        from fastapi_workqueue.observability.otel import OpenTelemetryObserver
        observer = OpenTelemetryObserver()
        delivery = ClaimedDelivery("1", "t", 1, 3, None, uuid.uuid4(), "topic", None, {}, "{}")
        before = (observer.publish_started("topic", 1), observer.process_started("s", delivery))
        trace.set_tracer_provider(TracerProvider())
        after = observer.publish_started("topic", 1)
        print(before == (None, None), after is not None and after.headers()["traceparent"].startswith("00-"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


def test_a_meter_provider_alone_turns_the_observer_on() -> None:
    """The check reads both global providers through the API's public getters: an app that only
    meters (no tracer provider) gets its metrics."""
    code = textwrap.dedent("""
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from fastapi_workqueue.observability.otel import OpenTelemetryObserver
        observer = OpenTelemetryObserver()
        before = observer.publish_started("topic", 1)
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        after = observer.publish_started("topic", 1)
        print(before is None, after is not None)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
            for s in family.samples if not s.name.endswith("_created")}


def test_an_attempts_metrics_are_what_the_public_calls_would_count() -> None:
    from fastapi_workqueue.observability.prometheus import WorkQueueMetrics
    from fastapi_workqueue.observability.semconv import DURATION_BUCKETS
    from fastapi_workqueue.observability.tally import OUTCOMES

    fast, public = WorkQueueMetrics(CollectorRegistry()), WorkQueueMetrics(CollectorRegistry())
    children = fast.of("orders.audit")
    amounts = [0.0, *DURATION_BUCKETS, *(b * 0.999 for b in DURATION_BUCKETS), *(b * 1.001 for b in DURATION_BUCKETS),
               99.0]
    for amount in amounts:
        children.observe(amount)
        public.duration.labels("orders.audit").observe(amount)
    for outcome in ["Complete", "Complete", "Retry", "DeadLetter", None]:
        children.running(1)
        public.in_flight.labels("orders.audit").inc()
        children.processed(outcome)(1)
        public.processed.labels("orders.audit", OUTCOMES[outcome]).inc()
    children.running(-1)
    public.in_flight.labels("orders.audit").dec()
    counted = _samples(fast.registry)
    assert counted == _samples(public.registry)
    assert counted[("workqueue_in_flight", (("subscription", "orders.audit"),))] == 4
    edge = ("workqueue_process_duration_seconds_bucket", (("le", "0.005"), ("subscription", "orders.audit")))
    assert counted[edge] == 3  # 0, 0.005 * 0.999 and 0.005 itself


def test_the_tally_exports_what_prometheus_clients_own_metrics_would_count() -> None:
    """The counts kept in plain Python read at scrape exactly as prometheus-client's own counter,
    histogram (bucket edges included) and gauge would show the same calls."""
    from fastapi_workqueue.core.envelope import PublishResult, PublishStatus
    from fastapi_workqueue.observability.prometheus import WorkQueueMetrics, register_tally
    from fastapi_workqueue.observability.semconv import DURATION_BUCKETS
    from fastapi_workqueue.observability.tally import OUTCOMES, Durations, ProcessTally, TallyObserver

    tally, public = ProcessTally(), WorkQueueMetrics(CollectorRegistry())
    observer, exported = TallyObserver(tally), CollectorRegistry()
    register_tally(tally, exported)
    register_tally(tally, exported)  # once per registry
    durations = tally.durations["orders.audit"] = Durations()
    for amount in [0.0, *DURATION_BUCKETS, *(b * 0.999 for b in DURATION_BUCKETS),
                   *(b * 1.001 for b in DURATION_BUCKETS), 99.0]:
        durations.observe(amount)
        public.duration.labels("orders.audit").observe(amount)
    scopes = []
    for outcome in ["Complete", "Complete", "Retry", "DeadLetter", None]:
        scope = observer.process_started("orders.audit", None)  # type: ignore[arg-type]
        assert scope is not None
        scopes.append((scope, outcome))
        public.in_flight.labels("orders.audit").inc()
    for scope, outcome in scopes[:-1]:
        scope.end(outcome, None)
        public.in_flight.labels("orders.audit").dec()
        public.processed.labels("orders.audit", OUTCOMES[outcome]).inc()
        public.duration.labels("orders.audit").observe(0.0)
    accepted, duplicate = PublishResult(status=PublishStatus.ACCEPTED), PublishResult(status=PublishStatus.DUPLICATE)
    for results in ([accepted], [accepted, duplicate, accepted], None):
        call = observer.publish_started("orders.placed", 3)
        assert call is not None
        call.end(results, None if results else RuntimeError("down"))
    public.published.labels("orders.placed", "Accepted").inc(3)
    public.published.labels("orders.placed", "Duplicate").inc()
    public.published.labels("orders.placed", "Error").inc(3)
    counted, expected = _samples(exported), _samples(public.registry)
    # The four attempts ended in well under 5 ms each: the buckets of four observations of 0, and a
    # sum a little above the public one's.
    total = ("workqueue_process_duration_seconds_sum", (("subscription", "orders.audit"),))
    assert 0 < counted.pop(total) - expected.pop(total) < 0.005 * 4
    assert counted == expected
    assert counted[("workqueue_in_flight", (("subscription", "orders.audit"),))] == 1
    edge = ("workqueue_process_duration_seconds_bucket", (("le", "0.005"), ("subscription", "orders.audit")))
    assert counted[edge] == 3 + 4  # 0, 0.005 * 0.999, 0.005 itself, and the four attempts


def test_a_dead_processs_in_flight_gauge_leaves_the_multiprocess_sum(tmp_path: Path) -> None:
    """Multiprocess mode: a worker killed mid-work (and started again by its server) left its
    ``workqueue_in_flight`` file behind, summed for ever. A scrape forgets the live gauges of
    processes that no longer run; counters (a dead process's work was done) stay."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    worker = textwrap.dedent("""
        import os, sys
        from fastapi_workqueue.observability.prometheus import metrics_for
        metrics = metrics_for(None)
        metrics.in_flight.labels(subscription="s").inc(int(sys.argv[1]))
        metrics.processed.labels(subscription="s", outcome="completed").inc(5)
        print(os.getpid())
        if sys.argv[2] == "stay":
            sys.stdout.flush()
            sys.stdin.read()
    """)
    dead = subprocess.run([sys.executable, "-c", worker, "2", "exit"], env=env, capture_output=True, text=True,
                          check=True, timeout=60)
    alive = subprocess.Popen([sys.executable, "-c", worker, "3", "stay"], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert alive.stdout is not None
        alive_pid = int(alive.stdout.readline())
        scrape = textwrap.dedent("""
            import os
            from prometheus_client import CollectorRegistry, generate_latest
            from prometheus_client.multiprocess import MultiProcessCollector
            from fastapi_workqueue.observability.metrics_router import forget_dead_processes
            print(forget_dead_processes(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            print(generate_latest(registry).decode())
        """)
        ran = subprocess.run([sys.executable, "-c", scrape], env=env, capture_output=True, text=True, check=True,
                             timeout=60)
    finally:
        alive.communicate("", timeout=30)
    forgotten, text = ran.stdout.split("\n", 1)
    assert forgotten == f"[{int(dead.stdout)}]" and alive_pid != int(dead.stdout)
    found = samples(text)
    assert found[("workqueue_in_flight", (("subscription", "s"),))] == 3  # the live process's only
    assert found[("workqueue_processed_total", (("outcome", "completed"), ("subscription", "s")))] == 10
