"""``GET /metrics``: the process's counters and the database's gauges in Prometheus's text format."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Security
from fastapi.responses import Response

try:
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
except ImportError as exc:
    from ..core.errors import missing_extra

    raise missing_extra("queue.metrics_router (/metrics)", "prometheus-client", "prometheus") from exc

from .prometheus import PrometheusObserver, StoreCollector, StoreSnapshot, metrics_for
from .tally import export_process_tally, multiprocess_mode

if TYPE_CHECKING:
    from ..core.kernel import Kernel
    from ..web.auth import Authorizer


_LIVE_FILE = re.compile(r"gauge_live\w*?_(\d+)\.db")


def forget_dead_processes(directory: str) -> list[int]:
    """Removes the live gauges (``workqueue_in_flight``: mode ``livesum``) of processes of this
    machine (this PID namespace: the folder must not be shared across containers) that no longer
    run, as ``mark_process_dead`` would in a server's child-exit hook (uvicorn has none): a worker
    killed and started again would be summed twice. Returns the pids."""
    gone = []
    for name in os.listdir(directory):
        match = _LIVE_FILE.fullmatch(name)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            gone.append(pid)
        except PermissionError:  # (alive, another user's)
            continue
    for pid in set(gone):
        try:
            mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
        except FileNotFoundError:  # (another worker's scrape removed it first)
            continue
    return sorted(set(gone))


def _process_part(registry: CollectorRegistry) -> bytes:
    if multiprocess_mode() and registry is REGISTRY:
        forget_dead_processes(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        merged = CollectorRegistry()
        MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
        return generate_latest(merged)
    return generate_latest(registry)


def build_metrics_router(kernel: Kernel, *, authorize: Authorizer, public: bool, path: str = "/metrics",
                         registry: CollectorRegistry | None = None) -> APIRouter:
    """The router behind ``queue.metrics_router`` (see :meth:`WorkQueue.create_metrics_router`)."""
    target = registry if registry is not None else REGISTRY
    if not multiprocess_mode():
        export_process_tally(target)
    elif target is not REGISTRY:
        kernel.add_observer(PrometheusObserver(metrics_for(target)))
    else:
        metrics_for(None)
    snapshot = StoreSnapshot(kernel, kernel.settings.metrics_cache_seconds)
    store = CollectorRegistry(auto_describe=False)
    store.register(StoreCollector(snapshot))
    router = APIRouter(tags=["metrics"])
    dependencies: list[Any] = [] if public else [Security(authorize, scopes=["workqueue:read"])]

    answers: dict[int | str, dict[str, Any]] = {} if public else {
        401: {"description": "No API key, or one that is unknown, expired or revoked."},
        403: {"description": "The credential lacks the scope `workqueue:read`."},
    }

    @router.get(path, summary="Prometheus metrics", dependencies=dependencies,
                response_class=Response, include_in_schema=True, responses=answers)
    async def metrics() -> Response:
        await snapshot.refresh()
        body = _process_part(target) + generate_latest(store)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return router
