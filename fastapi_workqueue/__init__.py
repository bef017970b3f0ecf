"""fastapi-workqueue: a durable work queue for FastAPI and Starlette apps.

Topics fan out to subscriptions; deliveries are leased, heartbeated and fenced; failures retry
with backoff and end in dead letters that operators replay or discard; keys run exclusively or
in strict order. The host runs with the app's lifespan.
"""

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
from .core.errors import ConfigurationError, TransportError, TransportUnavailable, WorkQueueError
from .core.filters import FilterError
from .core.host import SubscriptionHealth, SubscriptionPlan
from .core.outcomes import FatalWorkError, Outcome, TransientWorkError, WorkOutcome
from .core.reports import ActionResult, Backlog, DeliveryInfo, PartitionInfo, SubscriptionStats, SweepReport
from .core.topology import Subscription, Topic
from .jobs.context import JobContext
from .queue import WorkQueue
from .settings import WorkQueueSettings
from .web.di import current_context, current_message

__all__ = [
    "MAX_ATTRIBUTES",
    "MAX_ENVELOPE_BYTES",
    "AbortReason",
    "AbortSignal",
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
    "PublishRequest",
    "PublishResult",
    "PublishStatus",
    "Subscription",
    "SubscriptionHealth",
    "SubscriptionPlan",
    "SubscriptionStats",
    "SweepReport",
    "Topic",
    "TransientWorkError",
    "TransportError",
    "TransportUnavailable",
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
