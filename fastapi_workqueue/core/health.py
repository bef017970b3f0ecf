"""The queue's part of an app's health report: the host's state and each subscription it plans."""

from __future__ import annotations

from typing import Literal

from .host import SubscriptionHealth
from .wire import WireModel


class ExtensionHealth(WireModel):
    """The work queue's part of the health report."""

    name: Literal["WorkQueue"] = "WorkQueue"
    status: Literal["Running", "Disabled", "Stopped", "Degraded"]
    reason: str | None = None
    subscriptions: list[SubscriptionHealth] = []
