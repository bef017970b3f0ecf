"""``GET /health/extensions``: the state of every subscription this process plans."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Response

from ..core.health import ExtensionHealth
from ..core.wire import WireModel

if TYPE_CHECKING:
    from ..core.kernel import Kernel


__all__ = ["UNHEALTHY", "ExtensionHealth", "HealthReport", "build_health_router"]

UNHEALTHY = frozenset({"HandlerNotRegistered", "Error"})
"""Subscription states that make ``GET /health/extensions`` answer 503."""


class HealthReport(WireModel):
    extensions: list[ExtensionHealth]


def build_health_router(kernel: Kernel) -> APIRouter:
    """``GET /health/extensions`` of the queue of ``kernel``."""
    router = APIRouter(tags=["health"])

    @router.get(
        "/health/extensions",
        response_model=HealthReport,
        summary="Work queue health",
        responses={503: {"model": HealthReport, "description": "A planned subscription is HandlerNotRegistered "
                         "or in Error; the body is the same report."}},
    )
    async def extensions_health(response: Response) -> HealthReport:
        """Each planned subscription: Running, Paused, HandlerNotRegistered, Unsupported or Error.

        503 when any of them is HandlerNotRegistered or Error (so a load balancer takes the
        instance out; each one the host would run is in Error while the app's lifespan has not
        started the queue), 200 otherwise. Anyone may ask, so an error's
        own text (a driver's, naming hosts and databases) is replaced by a generic reason; it is in
        the process's log."""
        report = kernel.health()
        if report.status == "Degraded" or any(s.state in UNHEALTHY for s in report.subscriptions):
            response.status_code = 503
        public = report.model_copy(update={"subscriptions": [s.public() for s in report.subscriptions]})
        return HealthReport(extensions=[public])

    return router
