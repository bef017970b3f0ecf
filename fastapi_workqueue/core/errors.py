"""The library's exceptions. Driver exceptions are mapped to these at the transport boundary.

``WorkQueueError``
 ├── ``ConfigurationError``   bad settings, topology or handler registration: fix and restart
 └── ``TransportError``       the store failed; ``retryable`` says whether trying again may help
      └── ``TransportUnavailable``  the store cannot be reached (connection refused or lost)
"""

from __future__ import annotations


class WorkQueueError(Exception):
    """Base of every error this library raises on purpose."""


class ConfigurationError(WorkQueueError):
    """Settings, topology or handler registration that cannot work; the message says what to change."""


class TransportError(WorkQueueError):
    """The transport failed. ``retryable`` is True when the same call may succeed later."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class TransportUnavailable(TransportError):
    """The store cannot be reached right now; retry later (publishes keep their MessageIDs)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)
