"""fastapi-workqueue: a durable work queue for FastAPI and Starlette apps.

Topics fan out to subscriptions; deliveries are leased, heartbeated and fenced; failures retry
with backoff and end in dead letters that operators replay or discard; keys run exclusively or
in strict order. The host runs with the app's lifespan.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core.context import AbortReason, AbortSignal, Progress, WorkAborted, WorkContext
    from .core.envelope import (
        MAX_ATTRIBUTES,
        MAX_ENVELOPE_BYTES,
        PublishError,
        PublishRequest,
        PublishResult,
        PublishStatus,
        WorkMessage,
    )
    from .core.errors import (
        ActionRefused,
        ConfigurationError,
        PublishFailed,
        SchemaMissing,
        TransactionAborted,
        TransportError,
        TransportUnavailable,
        UnknownTopic,
        WorkQueueError,
    )
    from .core.filters import FilterError
    from .core.host import SubscriptionHealth, SubscriptionPlan
    from .core.outcomes import FatalWorkError, Outcome, TransientWorkError, WorkOutcome
    from .core.published import PublishResults
    from .core.reports import ActionResult, Backlog, DeliveryInfo, PartitionInfo, SubscriptionStats, SweepReport
    from .core.topology import Subscription, Topic
    from .jobs.context import JobContext
    from .queue import WorkQueue
    from .settings import WorkQueueSettings
    from .web.current import current_context, current_message

__all__ = [
    "MAX_ATTRIBUTES",
    "MAX_ENVELOPE_BYTES",
    "AbortReason",
    "AbortSignal",
    "ActionRefused",
    "ActionResult",
    "Backlog",
    "ConfigurationError",
    "DeliveryInfo",
    "FatalWorkError",
    "FilterError",
    "JobContext",
    "Outcome",
    "PartitionInfo",
    "Progress",
    "PublishError",
    "PublishFailed",
    "PublishRequest",
    "PublishResult",
    "PublishResults",
    "PublishStatus",
    "SchemaMissing",
    "Subscription",
    "SubscriptionHealth",
    "SubscriptionPlan",
    "SubscriptionStats",
    "SweepReport",
    "Topic",
    "TransactionAborted",
    "TransientWorkError",
    "TransportError",
    "TransportUnavailable",
    "UnknownTopic",
    "WorkAborted",
    "WorkContext",
    "WorkMessage",
    "WorkOutcome",
    "WorkQueue",
    "WorkQueueError",
    "WorkQueueSettings",
    "current_context",
    "current_message",
]

__version__ = "0.1.0"

# Imported on first use (PEP 562), so that a module such as fastapi_workqueue.aws.lambda_handler
# does not pull in the web framework and the database layer with the package.
_ORIGINS: dict[str, str] = {
    "MAX_ATTRIBUTES": ".core.envelope",
    "MAX_ENVELOPE_BYTES": ".core.envelope",
    "AbortReason": ".core.context",
    "AbortSignal": ".core.context",
    "ActionRefused": ".core.errors",
    "ActionResult": ".core.reports",
    "Backlog": ".core.reports",
    "ConfigurationError": ".core.errors",
    "DeliveryInfo": ".core.reports",
    "FatalWorkError": ".core.outcomes",
    "FilterError": ".core.filters",
    "JobContext": ".jobs.context",
    "Outcome": ".core.outcomes",
    "PartitionInfo": ".core.reports",
    "Progress": ".core.context",
    "PublishError": ".core.envelope",
    "PublishFailed": ".core.errors",
    "PublishRequest": ".core.envelope",
    "PublishResult": ".core.envelope",
    "PublishResults": ".core.published",
    "PublishStatus": ".core.envelope",
    "Subscription": ".core.topology",
    "SubscriptionHealth": ".core.host",
    "SchemaMissing": ".core.errors",
    "SubscriptionPlan": ".core.host",
    "SubscriptionStats": ".core.reports",
    "SweepReport": ".core.reports",
    "Topic": ".core.topology",
    "TransactionAborted": ".core.errors",
    "TransientWorkError": ".core.outcomes",
    "TransportError": ".core.errors",
    "TransportUnavailable": ".core.errors",
    "UnknownTopic": ".core.errors",
    "WorkAborted": ".core.context",
    "WorkContext": ".core.context",
    "WorkMessage": ".core.envelope",
    "WorkOutcome": ".core.outcomes",
    "WorkQueue": ".queue",
    "WorkQueueError": ".core.errors",
    "WorkQueueSettings": ".settings",
    "current_context": ".web.current",
    "current_message": ".web.current",
}


def __getattr__(name: str) -> Any:
    module = _ORIGINS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
