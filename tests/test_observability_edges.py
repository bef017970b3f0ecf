"""Observability at its edges: the settle span of a completion that writes more than the delivery,
the trace headers kept from filters, and a settle span's links through a retried write."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from fastapi_workqueue import Outcome, PublishRequest, WorkContext, WorkMessage, WorkOutcome
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.outcomes import FollowUp

from .support import make_queue, wait_for
from .test_observability import EXPORTER, client, fresh_spans, samples, spans_named  # noqa: F401

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def tracer_provider() -> None:
    """The SDK with the in-memory exporter of test_observability as the global tracer provider
    (set once per process: when that module ran first, its provider already exports there)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)


@pytest.mark.parametrize("kind", ["result", "follow_up"])
async def test_a_completion_that_keeps_a_result_gets_its_settle_span(kind: str, pg_url: str) -> None:
    """docs/observability.md: "`settle` | CLIENT | one per batch of settlements written, linked to
    the attempts it settles". A completion with a result (or follow-ups, or unique-job keys to free:
    every job that returns a value or chains) is written through settle_with_follow_ups, in a
    settle span of its own like any other."""
    queue, topic, subs = make_queue(pg_url, [{"role": "keep"}])
    other = topic  # the follow-up goes to the same topic (payload {"next": 1}: a plain completion)

    @queue.handler("keep")
    async def keep(message: WorkMessage[Any]) -> WorkOutcome:
        if message.payload.get("next"):
            return Outcome.complete()
        if kind == "result":
            return Outcome.complete(result='{"total": 42}')
        return Outcome.complete(then=[FollowUp(other, [prepare(PublishRequest(payload={"next": 1}))])])

    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload={})])

        async def completed() -> bool:
            [stats] = await queue.stats(subs["keep"])
            return stats.completed == (1 if kind == "result" else 2)

        await wait_for(completed)
        await asyncio.sleep(0.3)  # the settle span ends right after the write
    first = next(s for s in spans_named(f"process {subs['keep']}")
                 if s.attributes and s.attributes.get("messaging.workqueue.attempt") == 1
                 and s.parent is not None and s.parent.span_id == spans_named(f"send {topic}")[0].context.span_id)
    linked = [s for s in spans_named("settle") if first.context.span_id in [link.context.span_id for link in s.links]]
    assert [s.kind for s in linked] == [SpanKind.CLIENT], "no settle span for the completion"


@pytest.mark.parametrize("store", ["pg", "sqlite"])
async def test_the_trace_headers_never_reach_a_filter(store: str, pg_url: str, sqlite_url: str) -> None:
    """docs/observability.md: the send span's context "is stored with each message, beside its
    attributes under the reserved name `$workqueue`: it never counts toward the 10 attributes,
    never reaches a filter". Were a subscription filter on the field `$workqueue` accepted, the
    fan-out would match it against the stored headers (whether a message is delivered would depend
    on whether its publisher traced): such a filter is refused when saved, or never matches them."""
    from fastapi_workqueue.core.errors import ConfigurationError
    from fastapi_workqueue.core.filters import FilterError

    from .test_observability import opened

    try:
        queue, topic, subs = make_queue(pg_url if store == "pg" else sqlite_url, [
            {"role": "absent", "filter": {"field": "$workqueue", "operator": "isnull"}},
            {"role": "present", "filter": {"field": "$workqueue", "operator": "isnotnull"}},
        ])
        async with opened(queue):
            [result] = await queue.publish(topic, [PublishRequest(payload=1)])
            assert result.status.value == "Accepted"
            counts = {role: (await queue.stats(subs[role]))[0].pending for role in ("absent", "present")}
    except (FilterError, ConfigurationError, ValueError):
        return  # refused when saved: what the docs allow
    assert spans_named(f"send {topic}"), "the publish was traced"
    assert counts == {"absent": 1, "present": 0}, "the fan-out read the trace headers as an attribute"


async def test_a_settle_written_on_the_second_try_still_links_to_its_attempt(pg_url: str) -> None:
    """docs/observability.md: "`settle` | CLIENT | one per batch of settlements written, linked to
    the attempts it settles". When the store is briefly out of reach the settler writes the batch
    again: the span of the write that succeeded links to the attempt too (the attempts' contexts are
    let go only once their settle is written)."""
    from fastapi_workqueue.core.errors import TransportUnavailable

    queue, topic, subs = make_queue(pg_url, [{"role": "ok"}])

    @queue.handler("ok")
    async def ok(message: WorkMessage[Any]) -> WorkOutcome:
        return Outcome.complete()

    async with queue.lifespan(None):
        transport = queue.transport
        real_settle = transport.settle
        failures = [TransportUnavailable("the database restarts")]

        async def settle_once_unreachable(settlements: Any, *args: Any, **kwargs: Any) -> Any:
            if failures:
                raise failures.pop()
            return await real_settle(settlements, *args, **kwargs)

        transport.settle = settle_once_unreachable  # type: ignore[method-assign]
        await queue.publish(topic, [PublishRequest(payload={})])

        async def completed() -> bool:
            [stats] = await queue.stats(subs["ok"])
            return stats.completed == 1

        await wait_for(completed)
        await asyncio.sleep(0.3)
    assert not failures, "the first settle failed"
    [process] = spans_named(f"process {subs['ok']}")
    settles = spans_named("settle")
    written = [s for s in settles if s.status.is_ok]
    assert len(settles) == 2 and len(written) == 1, [(s.name, s.status.status_code) for s in settles]
    assert [link.context.span_id for link in written[0].links] == [process.context.span_id]


async def test_a_cancelled_attempt_counts_as_discarded_and_a_lost_lease_as_abandoned(pg_url: str) -> None:
    """``workqueue_processed_total``'s outcome says what became of the attempt, as docs/observability.md
    lists them: an operator's cancel discards the delivery (it counted ``failed``), a lease that ran
    out under the handler abandons the attempt (it counted ``failed`` too)."""
    # (a lease of 6 s: its heartbeats, every 2 s, hold it through a loaded machine's delays, so the
    # attempt ends by the cancel and not by a lost lease)
    queue, topic, subs = make_queue(pg_url, [{"role": "cancel", "lease_seconds": 6},
                                             {"role": "lost", "lease_seconds": 1, "heartbeat_mode": "Manual"}],
                                    metrics_cache_seconds=0)
    started: list[str] = []

    @queue.handler("cancel")
    async def cancel(message: WorkMessage[Any], context: WorkContext) -> WorkOutcome:
        started.append("cancel")
        await asyncio.sleep(30)
        return Outcome.complete()

    @queue.handler("lost")
    async def lost(message: WorkMessage[Any], context: WorkContext) -> WorkOutcome:
        started.append("lost")
        if context.attempt == 1:
            await asyncio.sleep(30)  # no heartbeat: the lease runs out under it
        return Outcome.complete()

    registry = CollectorRegistry()
    app = FastAPI()
    app.include_router(queue.create_metrics_router(registry=registry, public=True))
    async with queue.lifespan(app):
        await queue.publish(topic, [PublishRequest(payload=1)])
        await wait_for(lambda: started.count("cancel") == 1)
        [running] = await queue.deliveries(subs["cancel"], "InFlight")
        await queue.discard(subs["cancel"], running.delivery_id, "not needed")

        async def counted() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
            async with client(app) as http:
                found = samples((await http.get("/metrics")).text)
            mine = {k: v for k, v in found.items() if k[0] == "workqueue_processed_total"}
            done = mine.get(("workqueue_processed_total", (("outcome", "completed"), ("subscription", subs["lost"]))))
            cancelled = [k for k in mine if ("subscription", subs["cancel"]) in k[1]]
            return mine if done == 1 and cancelled else None

        found = await wait_for(counted, within=20)
    by_outcome = {(dict(labels)["subscription"], dict(labels)["outcome"]): value
                  for (_, labels), value in found.items()}
    assert by_outcome.get((subs["cancel"], "discarded")) == 1
    assert by_outcome.get((subs["lost"], "abandoned")) == 1
    assert (subs["cancel"], "failed") not in by_outcome and (subs["lost"], "failed") not in by_outcome
