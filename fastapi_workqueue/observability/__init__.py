"""Traces and metrics of the queue: OpenTelemetry (the ``otel`` extra) and Prometheus (the
``prometheus`` extra), built on the core's observer hooks (``fastapi_workqueue.core.observe``).

Nothing here is imported unless the queue asks for an observer or a metrics router; without the
extras installed the queue records nothing and costs nothing. OpenTelemetry is loaded once the
process imports its API (:mod:`.otel_deferred`: before that no SDK can be installed), and Prometheus
counts only in a process that can hand the counts to a scraper (:func:`prometheus_exported`): a
worker that does neither never loads them (about 2.8 MB, bench/README.md, memory).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import TYPE_CHECKING

from ..core.observe import Observer

if TYPE_CHECKING:
    from ..core.settings import WorkQueueSettings

__all__ = ["default_observers", "prometheus_exported"]

MULTIPROCESS_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
"""Where prometheus-client's multiprocess mode keeps each process's values (the second, its older
spelling, is still read by it)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def prometheus_exported() -> bool:
    """True when this process's counts can reach a scraper: prometheus-client is imported already
    (by ``queue.metrics_router``, ``workqueue work --metrics-port`` or the app's own exporter), or its
    multiprocess mode is on (another process serves the sum). Asked when the queue first needs its
    observers (its first publish or the start of its host)."""
    if "prometheus_client" in sys.modules:
        return True
    return any(os.environ.get(name) for name in MULTIPROCESS_VARIABLES) and _installed("prometheus_client")


def default_observers(settings: WorkQueueSettings) -> list[Observer]:
    """The observers the settings ask for whose libraries are installed (OpenTelemetry's from when
    its API is imported, Prometheus's where its counts can be served: :func:`prometheus_exported`)."""
    found: list[Observer] = []
    if settings.otel and _installed("opentelemetry.trace"):
        from .otel_deferred import DeferredOpenTelemetry

        found.append(DeferredOpenTelemetry())
    if settings.prometheus and prometheus_exported():
        from .prometheus import PrometheusObserver

        found.append(PrometheusObserver.default())
    return found
