"""Traces and metrics of the queue: OpenTelemetry (the ``otel`` extra) and Prometheus (the
``prometheus`` extra), built on the core's observer hooks (``fastapi_workqueue.core.observe``).

Nothing here is imported unless the queue asks for an observer or a metrics router; without the
extras installed the queue records nothing and costs nothing. OpenTelemetry is loaded once the
process imports its API (:mod:`.otel_deferred`: before that no SDK can be installed).
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
    """The observers the settings ask for whose libraries are installed (OpenTelemetry's from when
    its API is imported)."""
    found: list[Observer] = []
    if settings.otel and _installed("opentelemetry.trace"):
        from .otel_deferred import DeferredOpenTelemetry

        found.append(DeferredOpenTelemetry())
    if settings.prometheus and _installed("prometheus_client"):
        from .tally import TallyObserver, multiprocess_mode

        if multiprocess_mode():
            from .prometheus import PrometheusObserver

            found.append(PrometheusObserver.default())
        else:
            found.append(TallyObserver.process())
    return found
