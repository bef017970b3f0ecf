"""The OpenTelemetry observer, made when the process first imports the OpenTelemetry API.

Until something imports the API (an SDK, an instrumentation, FastAPI itself), no provider can be
installed but one named in the environment, and :class:`~.otel.OpenTelemetryObserver` would record
and carry nothing (its hooks return at once while only the API's stand-ins are in place). So a
worker that never imports the API never loads it, nor this package's tracing (about 0.7 MB,
bench/README.md, memory). Until the API appears a hook costs one dictionary lookup; after, one
call more than the observer's own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.observe import Observer, ProcessScope, PublishScope, SettleScope

if TYPE_CHECKING:
    from ..core.transport import ClaimedDelivery, Settlement

API_MODULE = "opentelemetry.trace"
"""Imported by whatever installs a provider (the SDK imports the API) and by FastAPI."""
PROVIDER_VARIABLES = ("OTEL_PYTHON_TRACER_PROVIDER", "OTEL_PYTHON_METER_PROVIDER")
"""Variables that name a provider the API loads itself, on its first use: the observer is made at once."""


class DeferredOpenTelemetry(Observer):
    """:class:`~.otel.OpenTelemetryObserver` once the OpenTelemetry API is imported; nothing before."""

    def __init__(self) -> None:
        self._observer: Observer | None = None
        if any(os.environ.get(name) for name in PROVIDER_VARIABLES):
            self._load()

    def _loaded(self) -> Observer | None:
        observer = self._observer
        if observer is None and API_MODULE in sys.modules:
            observer = self._load()
        return observer

    def _load(self) -> Observer:
        from .otel import OpenTelemetryObserver

        observer = self._observer = OpenTelemetryObserver()
        return observer

    def publish_started(self, topic: str, count: int, *, message_id: str | None = None,
                        correlation_id: str | None = None) -> PublishScope | None:
        observer = self._loaded()
        if observer is None:
            return None
        return observer.publish_started(topic, count, message_id=message_id, correlation_id=correlation_id)

    def process_started(self, subscription: str, delivery: ClaimedDelivery) -> ProcessScope | None:
        observer = self._loaded()
        return None if observer is None else observer.process_started(subscription, delivery)

    def settle_started(self, settlements: Sequence[Settlement]) -> SettleScope | None:
        observer = self._loaded()
        return None if observer is None else observer.settle_started(settlements)
