"""The operator dashboard: server-rendered pages mounted in the app that runs the queue.

``app.mount("/work-queue/ui", queue.dashboard())`` (or ``queue.dashboard(authorize=your_dep)``)
shows the topics and subscriptions with their state, health and counts, throughput and depth over
the last hour, in-flight deliveries, dead letters with their tracebacks, blocked Ordered keys and
any delivery whole; operators replay, discard, cancel, pause, resume and replay a subscription's
dead letters in bulk. Needs the ``dashboard`` extra (jinja2); the page's script and style sheet
ship in the package: no build step, no CDN.
"""

from __future__ import annotations

try:
    import jinja2  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    from ..core.errors import missing_extra

    raise missing_extra("the dashboard", "jinja2", "dashboard") from exc

from .app import create_dashboard

__all__ = ["create_dashboard"]
