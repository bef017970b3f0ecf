"""Traces and metrics of the queue: OpenTelemetry (the ``otel`` extra) and Prometheus (the
``prometheus`` extra), built on the core's observer hooks (``fastapi_workqueue.core.observe``).

Nothing here is imported unless the queue asks for an observer or a metrics router; without the
extras installed the queue records nothing and costs nothing.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from ..core.observe import Observer

if TYPE_CHECKING:
    from ..core.settings import WorkQueueSettings

__all__ = ["default_observers"]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def default_observers(settings: WorkQueueSettings) -> list[Observer]:
    """The observers the settings ask for whose libraries are installed."""
    found: list[Observer] = []
    if settings.otel and _installed("opentelemetry.trace"):
        from .otel import OpenTelemetryObserver

        found.append(OpenTelemetryObserver())
    if settings.prometheus and _installed("prometheus_client"):
        from .prometheus import PrometheusObserver

        found.append(PrometheusObserver.default())
    return found
