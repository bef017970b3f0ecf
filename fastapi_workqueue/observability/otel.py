"""The queue seen through the OpenTelemetry API: spans and metrics, with the trace context carried
from the publisher to the handlers.

Only the API is used, with the global tracer and meter providers: the app installs the SDK and
its exporters (without them, the API's no-op providers record nothing).

* ``send {topic}`` (PRODUCER), one per publish call; it is the current span of the caller's trace
  (a request's span is its parent) and its context travels with every message.
* ``process {subscription}`` (CONSUMER), one per attempt: the child of the producer's context,
  with a link to it, so a request's trace continues into its handlers.
* ``settle`` (CLIENT), one per batch of settlements written, linked to the attempts it settles.

Only the API's public functions are read (``trace.get_tracer_provider()``,
``metrics.get_meter_provider()``), never its ``_internal`` globals. Reading the globals skipped the
API's environment lookups while no SDK is installed: the check of a publish or an attempt cost
0.5 µs that way and 6-7 µs through the getters, measured on the 2-core machine while other work ran
on it (about 1.5 µs on a quiet one, bench/README.md). Against an attempt of about 330 µs in the
same conditions (``bench/compare/workqueue_bench.py --only process``, about 3,000 deliveries/s) that
is some 2 %; the benchmark itself, 4 turns of 10,000 deliveries with before and after alternating,
gave medians of 3,208 and 2,773 deliveries/s at the defaults and 3,049 and 3,461 at concurrency
10, ratios within the machine's noise. No gain of 5 % shows, so the public getters stay.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics, propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
except ImportError as exc:
    from ..core.errors import missing_extra

    raise missing_extra("tracing through OpenTelemetry", "opentelemetry-api", "otel") from exc

from ..core.observe import Observer, ProcessScope, PublishScope, SettleScope, topic_label
from ..core.processes import package_version
from ..core.redaction import redact, redacted_traceback
from . import semconv as sc

if TYPE_CHECKING:
    from ..core.envelope import PublishResult
    from ..core.transport import ClaimedDelivery, Settlement

_SUCCESS = {"Accepted", "Duplicate"}
_FAILED_OUTCOMES = {"Fail", "DeadLetter"}
_LINKS_KEPT = 10_000
"""Attempts whose span context waits for the settle span to link to it (the oldest go first)."""



_API_PACKAGES = ("opentelemetry.trace", "opentelemetry.metrics")


def _unset(provider: Any) -> bool:
    """True for the API's stand-ins, before an app installs an SDK (they record nothing): the
    proxy and no-op providers are the only ones the API package itself defines."""
    return type(provider).__module__.startswith(_API_PACKAGES)


class OpenTelemetryObserver(Observer):
    """Spans and metrics through the global OpenTelemetry providers.

    Until the app installs an SDK (the API's stand-in providers are in place), every hook returns
    at once: an app that does not trace pays one check per publish and per attempt."""

    def __init__(self, tracer_provider: Any = None, meter_provider: Any = None,
                 legacy_names: bool | None = None) -> None:
        version = package_version()
        self.tracer = trace.get_tracer("fastapi_workqueue", version, tracer_provider=tracer_provider)
        meter = metrics.get_meter("fastapi_workqueue", version, meter_provider=meter_provider)
        self.legacy = sc.emit_legacy() if legacy_names is None else legacy_names
        self.operation_duration = meter.create_histogram(
            sc.CLIENT_OPERATION_DURATION, unit="s", description="Duration of publish and settle operations.",
            explicit_bucket_boundaries_advisory=list(sc.DURATION_BUCKETS),
        )
        self.process_duration = meter.create_histogram(
            sc.PROCESS_DURATION, unit="s", description="Duration of an attempt (the handler).",
            explicit_bucket_boundaries_advisory=list(sc.DURATION_BUCKETS),
        )
        self.sent = meter.create_counter(sc.SENT_MESSAGES, unit="{message}",
                                         description="Messages a publish call sent.")
        self.consumed = meter.create_counter(sc.CONSUMED_MESSAGES, unit="{message}",
                                             description="Deliveries handed to a handler.")
        self._attempts: OrderedDict[str, tuple[trace.SpanContext, str | None]] = OrderedDict()
        """Each ended attempt's span and outcome, by delivery id, for the settle that follows."""
        self._on = tracer_provider is not None or meter_provider is not None

    def _off(self) -> bool:
        """True while only the API's stand-ins are installed. Once a real provider is seen the
        observer stays on (a global provider is set once per process)."""
        if self._on:
            return False
        if _unset(trace.get_tracer_provider()) and _unset(metrics.get_meter_provider()):
            return True
        self._on = True
        return False

    def publish_started(self, topic: str, count: int, *, message_id: str | None = None,
                        correlation_id: str | None = None) -> PublishScope | None:
        if self._off():
            return None
        attributes: dict[str, Any] = sc.operation("send", "send", self.legacy)
        attributes[sc.DESTINATION_NAME] = topic
        if count != 1:
            attributes[sc.BATCH_COUNT] = count
        if message_id is not None:
            attributes[sc.MESSAGE_ID] = message_id
        if correlation_id is not None:
            attributes[sc.CONVERSATION_ID] = correlation_id
        span = self.tracer.start_span(f"send {topic}", kind=SpanKind.PRODUCER, attributes=attributes)
        return _Send(self, span, topic, count)

    def process_started(self, subscription: str, delivery: ClaimedDelivery) -> ProcessScope | None:
        if self._off():
            return None
        producer = propagate.extract(delivery.headers) if delivery.headers else None
        links: list[Link] = []
        if producer is not None:
            producer_span = trace.get_current_span(producer).get_span_context()
            if producer_span.is_valid:
                links.append(Link(producer_span))
            else:
                producer = None
        attributes: dict[str, Any] = sc.operation("process", "process", self.legacy)
        attributes.update({
            sc.DESTINATION_NAME: delivery.topic,
            sc.SUBSCRIPTION_NAME: subscription,
            sc.CONSUMER_GROUP: subscription,
            sc.MESSAGE_ID: str(delivery.message_id),
            sc.DELIVERY_ATTEMPT: delivery.attempt,
        })
        if delivery.correlation_id is not None:
            attributes[sc.CONVERSATION_ID] = delivery.correlation_id
        span = self.tracer.start_span(
            f"process {subscription}", context=producer if producer is not None else otel_context.Context(),
            kind=SpanKind.CONSUMER, attributes=attributes, links=links,
        )
        self.consumed.add(1, {sc.MESSAGING_SYSTEM: sc.SYSTEM, sc.OPERATION_NAME: "process",
                              sc.DESTINATION_NAME: delivery.topic, sc.CONSUMER_GROUP: subscription})
        return _Process(self, span, subscription, delivery)

    def settle_started(self, settlements: Sequence[Settlement]) -> SettleScope | None:
        if self._off():
            return None
        # (read, not taken: a write that fails is tried again, and its next span links them too)
        ended = [self._attempts.get(s.delivery_id) for s in settlements]
        links = [Link(e[0]) for e in ended if e is not None]
        attributes: dict[str, Any] = sc.operation("settle", "settle", self.legacy)
        if len(settlements) != 1:
            attributes[sc.BATCH_COUNT] = len(settlements)
        else:
            # how the attempt ends the delivery, as its process span says (a cancelled attempt's
            # Fail is Discarded by the store), or the settlement's kind
            outcome = ended[0][1] if ended[0] is not None else None
            attributes["messaging.workqueue.outcome"] = outcome or settlements[0].kind
        span = self.tracer.start_span("settle", context=otel_context.Context(), kind=SpanKind.CLIENT,
                                      attributes=attributes, links=links)
        return _Settle(self, span, [s.delivery_id for s in settlements])

    def _remember(self, delivery_id: str, span: trace.Span, outcome: str | None) -> None:
        span_context = span.get_span_context()
        if not span_context.is_valid:
            return
        self._attempts[delivery_id] = (span_context, outcome)
        while len(self._attempts) > _LINKS_KEPT:
            self._attempts.popitem(last=False)


def _fail(span: trace.Span, error_type: str, error: BaseException | None) -> None:
    """Marks the span failed. The exception event is the one ``record_exception`` writes, with its
    message and stack trace redacted as ``last_error`` and the logs are."""
    span.set_attribute(sc.ERROR_TYPE, error_type)
    if error is None:
        span.set_status(Status(StatusCode.ERROR, error_type))
        return
    message = redact(str(error))
    span.add_event("exception", {
        sc.EXCEPTION_TYPE: type(error).__name__,
        sc.EXCEPTION_MESSAGE: message,
        sc.EXCEPTION_STACKTRACE: redacted_traceback(error),
        sc.EXCEPTION_ESCAPED: "False",
    })
    span.set_status(Status(StatusCode.ERROR, message))


class _Send(PublishScope):
    def __init__(self, observer: OpenTelemetryObserver, span: trace.Span, topic: str, count: int) -> None:
        self.observer, self.span, self.topic, self.count = observer, span, topic, count
        self.started = time.perf_counter()

    def headers(self) -> dict[str, str]:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self.span))
        return carrier

    def end(self, results: Sequence[PublishResult] | None, error: BaseException | None) -> None:
        error_type: str | None = None
        if error is not None:
            error_type = type(error).__qualname__
        elif results is not None:
            error_type = next((str(r.status.value) for r in results if r.status.value not in _SUCCESS), None)
        if error_type is not None:
            _fail(self.span, error_type, error)
        self.span.end()
        attributes: dict[str, Any] = {sc.MESSAGING_SYSTEM: sc.SYSTEM, sc.OPERATION_NAME: "send",
                                      sc.DESTINATION_NAME: topic_label(self.topic, results, error)}
        if error_type is not None:
            attributes[sc.ERROR_TYPE] = error_type
        self.observer.operation_duration.record(time.perf_counter() - self.started, attributes)
        sent = self.count if results is None else sum(1 for r in results if r.status.value in _SUCCESS)
        if error is None and sent:
            self.observer.sent.add(sent, attributes)


class _Process(ProcessScope):
    def __init__(self, observer: OpenTelemetryObserver, span: trace.Span, subscription: str,
                 delivery: ClaimedDelivery) -> None:
        self.observer, self.span, self.subscription, self.delivery = observer, span, subscription, delivery
        self.started = time.perf_counter()

    def active(self) -> AbstractContextManager[None]:
        return self._active()

    @contextmanager
    def _active(self) -> Iterator[None]:
        with trace.use_span(self.span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield

    def end(self, outcome: str | None, error: BaseException | None) -> None:
        error_type: str | None = None
        if error is not None:
            error_type = type(error).__qualname__
        elif outcome in _FAILED_OUTCOMES:
            error_type = outcome
        elif outcome is None:
            error_type = "abandoned"  # its lease ran out under it, or nothing was left to settle
        if outcome is not None:
            self.span.set_attribute("messaging.workqueue.outcome", outcome)
        if error_type is not None:
            _fail(self.span, error_type, error)
        self.span.end()
        self.observer._remember(self.delivery.delivery_id, self.span, outcome)  # the settle that follows links to it
        attributes: dict[str, Any] = {sc.MESSAGING_SYSTEM: sc.SYSTEM, sc.OPERATION_NAME: "process",
                                      sc.DESTINATION_NAME: self.delivery.topic, sc.CONSUMER_GROUP: self.subscription}
        if error_type is not None:
            attributes[sc.ERROR_TYPE] = error_type
        self.observer.process_duration.record(time.perf_counter() - self.started, attributes)


class _Settle(SettleScope):
    def __init__(self, observer: OpenTelemetryObserver, span: trace.Span, delivery_ids: list[str]) -> None:
        self.observer, self.span, self.delivery_ids = observer, span, delivery_ids
        self.started = time.perf_counter()

    def end(self, error: BaseException | None) -> None:
        attributes: dict[str, Any] = {sc.MESSAGING_SYSTEM: sc.SYSTEM, sc.OPERATION_NAME: "settle"}
        if error is not None:
            _fail(self.span, type(error).__qualname__, error)
            attributes[sc.ERROR_TYPE] = type(error).__qualname__
        else:  # written: the attempts are settled, their links are done with
            for delivery_id in self.delivery_ids:
                self.observer._attempts.pop(delivery_id, None)
        self.span.end()
        self.observer.operation_duration.record(time.perf_counter() - self.started, attributes)
