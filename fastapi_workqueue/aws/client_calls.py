"""The SNS and SQS clients as the transport hands them out: every call is counted while it runs,
so that closing the transport waits for the calls in flight before it closes the clients.

A client closed under a call does not end the call: the HTTP library retries it on a new
connection of its own (a second ``PublishBatch``, so the messages reach SQS twice) and that
connection may never answer or be closed. So :meth:`ClientCalls.drain` refuses new calls and
waits for those under way, within a bound, before the clients close.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from typing import Any

from ..core.errors import ConfigurationError, TransportError, TransportUnavailable, WorkQueueError
from ..core.redaction import redacting_logger
from ..core.words import count

log = redacting_logger("fastapi_workqueue.aws")

_IN_OPERATION: ContextVar[bool] = ContextVar("workqueue_aws_operation", default=False)
"""True inside :meth:`ClientCalls.operation`: its calls go on while the transport closes."""

DRAIN_SECONDS = 30.0
"""How long closing waits for the client calls in flight (a call that takes longer is cut off)."""


class ClientCalls:
    """The calls in flight on a transport's clients, and whether new ones are still taken."""

    def __init__(self) -> None:
        self.running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False

    def wrap(self, client: Any) -> CountedClient:
        """``client`` with each of its calls counted here."""
        return CountedClient(client, self)

    async def drain(self, within: float = DRAIN_SECONDS) -> None:
        """Refuses new calls and waits up to ``within`` seconds for those under way."""
        self.draining = True
        if self.running:
            try:
                await asyncio.wait_for(self._idle.wait(), within)
            except TimeoutError:
                log.warning("aws: closing with %s still under way after %g s; they are cut off",
                            count(self.running, "client call"), within)

    @contextlib.asynccontextmanager
    async def operation(self, name: str) -> AsyncIterator[None]:
        """Several calls that make one operation (a publish sent 10 messages a call): closing waits
        for all of them, and refuses the operation only before its first."""
        self.enter(name)
        token = _IN_OPERATION.set(True)
        try:
            yield
        finally:
            _IN_OPERATION.reset(token)
            self.leave()

    def enter(self, name: str) -> None:
        if self.draining and not _IN_OPERATION.get():
            raise TransportError(
                f"the aws transport is closing (the queue shuts down): {name} was not sent; call again once the "
                "queue is open", retryable=False,
            )
        self.running += 1
        self._idle.clear()

    def leave(self) -> None:
        self.running -= 1
        if not self.running:
            self._idle.set()


class CountedClient:
    """An aiobotocore client whose API operations (``publish_batch``, ``receive_message``: the
    names of ``client.meta.method_to_api_mapping``) are counted by :class:`ClientCalls`; every
    other attribute (``exceptions``, ``meta``, ``get_paginator``) is the client's own."""

    __slots__ = ("_calls", "_client", "_operations")

    def __init__(self, client: Any, calls: ClientCalls) -> None:
        self._client = client
        self._calls = calls
        self._operations = frozenset(client.meta.method_to_api_mapping)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if name not in self._operations:
            return method
        return _counted(method, name, self._calls)

    def __setattr__(self, name: str, value: Any) -> None:
        """The wrapper's own three slots here; anything else on the client (a method replaced to
        watch its calls, as a test does: it is counted all the same)."""
        if name in CountedClient.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self._client, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._client, name)


def _counted(method: Callable[..., Any], name: str, calls: ClientCalls) -> Callable[..., Any]:
    async def call(*args: Any, **kwargs: Any) -> Any:
        calls.enter(name)
        try:
            return await method(*args, **kwargs)
        except Exception as exc:
            mapped = library_error(exc, name)
            if mapped is None:
                raise
            raise mapped from exc
        finally:
            calls.leave()

    return call


class AwsServiceBusy(TransportError):
    """SNS or SQS answered "not now" (throttling, a server error): retryable. ``response`` is
    botocore's error response, as on the ``ClientError`` it stands for, so code that reads the
    AWS error code (``response["Error"]["Code"]``) reads it here too."""

    def __init__(self, message: str, response: dict[str, Any]) -> None:
        super().__init__(message, retryable=True)
        self.response = response


_BUSY_CODES = frozenset({"Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
                         "TooManyRequestsException", "ServiceUnavailable", "InternalError", "InternalFailure",
                         "RequestLimitExceeded", "KMSThrottlingException"})
"""Error codes of SNS and SQS that say "not now" rather than "never"."""


def library_error(exc: BaseException, operation: str) -> WorkQueueError | None:
    """The library's error for a call SNS or SQS could not take now (no connection, a timeout,
    throttling, a server error): :class:`TransportUnavailable` or a retryable
    :class:`TransportError`, as a database transport raises them; :class:`ConfigurationError` when
    no credentials are found. None for any other error (a missing queue, a refused parameter),
    which its caller reads as botocore raised it."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, NoCredentialsError

    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    api = "".join(part.capitalize() for part in operation.split("_"))
    if isinstance(exc, NoCredentialsError):
        return ConfigurationError(
            f"aws {api}: {text}; give the process AWS credentials (a role, AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY)")
    if isinstance(exc, ConnectionError | HTTPClientError):
        return TransportUnavailable(f"aws {api}: SNS/SQS cannot be reached ({text}); retry later")
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if error.get("Code") in _BUSY_CODES or int(status) >= 500:
            return AwsServiceBusy(f"aws {api}: {text}; retry later", exc.response)
    return None


def sns_refusal(exc: BaseException, topic: str) -> TransportError | None:
    """The library's error for a publish SNS refused outright (the topic gone, a permission or a
    key it lacks): a :class:`TransportError` naming the topic, SNS's code and what to check, not
    botocore's exception. None for an error that is not SNS's answer."""
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return None
    error = exc.response.get("Error", {})
    code, message = error.get("Code", "?"), error.get("Message", "")
    return TransportError(
        f"SNS refused the publish to topic {topic!r} ({code}: {message}); check the topic's AWS resources and "
        "this process's permissions (`workqueue validate-bindings --transport aws`), then publish the messages "
        "again with the same MessageIDs (those SNS took are answered Duplicate downstream only on FIFO topics)",
        retryable=False,
    )
