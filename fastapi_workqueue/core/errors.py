"""The library's exceptions. Driver exceptions are mapped to these at the transport boundary.

``WorkQueueError``
 ├── ``ConfigurationError``   bad settings, topology or handler registration: fix and restart
 │    ├── ``SchemaMissing``   the store has no work queue schema, or an older one: migrate
 │    └── ``UnknownTopic``    a publish named a topic that neither the code nor the store knows
 ├── ``PublishFailed``        ``results.raise_for_errors()``: some requests were not accepted
 └── ``TransportError``       the store failed; ``retryable`` says whether trying again may help
      └── ``TransportUnavailable``  the store cannot be reached (connection refused or lost)
"""

from __future__ import annotations


class WorkQueueError(Exception):
    """Base of every error this library raises on purpose."""


class ConfigurationError(WorkQueueError):
    """Settings, topology or handler registration that cannot work; the message says what to change."""

    fields: tuple[str, ...] = ()
    """The settings whose values cannot work, when the error is about settings."""


class SchemaMissing(ConfigurationError):
    """The store has no work queue schema (or an older one): run the migrations."""


class UnknownTopic(ConfigurationError):
    """A publish named a topic that neither the code declares nor the store holds: a programming
    error, like a wrong table name. Nothing was published."""

    def __init__(self, topic: str, message: str) -> None:
        super().__init__(message)
        self.topic = topic


class ActionRefused(WorkQueueError):
    """The store refused an operator action in the state it found the subscription or topic in
    (a pause of a retired subscription); nothing changed, and the message says what to do instead."""


class PublishFailed(WorkQueueError):
    """Raised by ``raise_for_errors()`` of a publish's results: ``failures`` are the results (with
    their index in the call) that were not Accepted or Duplicate."""

    def __init__(self, message: str, failures: list[tuple[int, object]]) -> None:
        super().__init__(message)
        self.failures = failures


class TransactionAborted(WorkQueueError):
    """The commit of a transaction a publish joined was refused: a statement in that transaction
    had failed (and was caught), so the database would have rolled the whole transaction back at
    its commit, the publish with it (PostgreSQL does so without an error). Nothing was committed or
    published; run the work again in a new transaction. A statement that may fail goes inside a
    savepoint (``async with session.begin_nested():``), whose rollback leaves the transaction whole."""


def missing_extra(feature: str, package: str, extra: str) -> ConfigurationError:
    """The error for a feature whose optional dependency is not installed: names the extra."""
    return ConfigurationError(
        f"{feature} needs {package}: install the {extra} extra, pip install 'fastapi-workqueue[{extra}]'"
    )


class TransportError(WorkQueueError):
    """The transport failed. ``retryable`` is True when the same call may succeed later."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class TransportCannot(TransportError):
    """The transport cannot do this at all (a broker's limit, such as per-key counts on SQS): not
    retryable; the REST API answers 501, as for other things a transport does not keep."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class TransportNotReady(TransportError):
    """The transport is not set up for this yet (an aws subscription whose resources are not
    bound): retryable once it is. Its text says what to do and names no host or secret, so health
    shows it to anyone, where a driver's error is replaced."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class TransportUnavailable(TransportError):
    """The store cannot be reached right now; retry later (publishes keep their MessageIDs)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class SessionPoolExhausted(WorkQueueError):
    """A handler's attempt waited in vain for a connection of the process's session pool (every one
    held by the process's other requests and handlers): the runtime gives the delivery back without
    spending a try, and says which setting to raise."""
