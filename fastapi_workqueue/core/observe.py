"""Hooks the queue calls around publishing, processing and settling, for traces and metrics.

The core knows only this small interface; ``fastapi_workqueue.observability`` implements it with
OpenTelemetry and Prometheus. Every hook of the base :class:`Observer` does nothing, so a queue
without an observer pays one attribute lookup per call.

A publish carries the headers an observer returns (the W3C trace context) with each message,
stored beside the user's attributes under :data:`HEADERS_KEY`: they never count toward the
attribute limit, never reach a filter, and are handed back as ``ClaimedDelivery.headers``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .envelope import PreparedMessage, PublishResult
    from .transport import ClaimedDelivery, Settlement

_NOTHING: AbstractContextManager[None] = nullcontext()

HEADERS_KEY = "$workqueue"
"""The reserved name, in a message's stored attributes, of the headers the library carries."""


UNKNOWN_TOPIC_LABEL = "(unknown)"
"""The topic a publish to a topic the store does not hold is counted under (see :func:`topic_label`)."""


def topic_label(topic: str, results: Sequence[PublishResult] | None, error: BaseException | None) -> str:
    """The topic a publish is counted under in per-topic metrics: its name, or
    :data:`UNKNOWN_TOPIC_LABEL` when no such topic exists. A name comes from the caller (a REST
    publish key among them), so made-up names must not add a series each."""
    if results:
        first = results[0].error
        return UNKNOWN_TOPIC_LABEL if first is not None and first.code == "UnknownTopic" else topic
    from .errors import UnknownTopic

    return UNKNOWN_TOPIC_LABEL if isinstance(error, UnknownTopic) else topic


class PublishScope:
    """One publish call, from before the transport writes until its results are known."""

    def headers(self) -> dict[str, str]:
        """Headers to carry with every message of the call (empty: none)."""
        return {}

    def end(self, results: Sequence[PublishResult] | None, error: BaseException | None) -> None:
        """The call finished with ``results``, or raised ``error``."""


class ProcessScope:
    """One attempt of one delivery, around the handler."""

    def active(self) -> AbstractContextManager[None]:
        """Entered around the handler: what it starts (spans, publishes) belongs to this attempt."""
        return _NOTHING

    def end(self, outcome: str | None, error: BaseException | None) -> None:
        """The attempt ended with the settlement kind ``outcome`` (None: nothing to settle)."""


class SettleScope:
    """One batch of settlements written to the transport."""

    def end(self, error: BaseException | None) -> None:
        """The batch was written, or failed with ``error``."""


class Observer:
    """Sees what the queue does; the base class sees nothing. Hooks must not raise."""

    def publish_started(self, topic: str, count: int, *, message_id: str | None = None,
                        correlation_id: str | None = None) -> PublishScope | None:
        """A publish of ``count`` messages to ``topic`` starts (the ids when there is one message)."""
        return None

    def process_started(self, subscription: str, delivery: ClaimedDelivery) -> ProcessScope | None:
        """An attempt of ``delivery`` starts in ``subscription``."""
        return None

    def settle_started(self, settlements: Sequence[Settlement]) -> SettleScope | None:
        """A batch of settlements is about to be written."""
        return None


NO_OBSERVER = Observer()


class Observers(Observer):
    """Several observers seen as one."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = list(observers)

    def publish_started(self, topic: str, count: int, *, message_id: str | None = None,
                        correlation_id: str | None = None) -> PublishScope | None:
        scopes = [s for o in self.observers
                  if (s := o.publish_started(topic, count, message_id=message_id, correlation_id=correlation_id))]
        if len(scopes) < 2:
            return scopes[0] if scopes else None
        return _PublishScopes(scopes)

    def process_started(self, subscription: str, delivery: ClaimedDelivery) -> ProcessScope | None:
        # (once per attempt: the usual answer is one scope, kept without building a list)
        first: ProcessScope | None = None
        scopes: list[ProcessScope] | None = None
        for observer in self.observers:
            scope = observer.process_started(subscription, delivery)
            if scope is None:
                continue
            if first is None:
                first = scope
            elif scopes is None:
                scopes = [first, scope]
            else:
                scopes.append(scope)
        return first if scopes is None else _ProcessScopes(scopes)

    def settle_started(self, settlements: Sequence[Settlement]) -> SettleScope | None:
        scopes = [s for o in self.observers if (s := o.settle_started(settlements))]
        if len(scopes) < 2:
            return scopes[0] if scopes else None
        return _SettleScopes(scopes)


class _PublishScopes(PublishScope):
    def __init__(self, scopes: list[PublishScope]) -> None:
        self.scopes = scopes

    def headers(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for scope in self.scopes:
            merged.update(scope.headers())
        return merged

    def end(self, results: Sequence[PublishResult] | None, error: BaseException | None) -> None:
        for scope in reversed(self.scopes):
            scope.end(results, error)


class _ProcessScopes(ProcessScope):
    def __init__(self, scopes: list[ProcessScope]) -> None:
        self.scopes = scopes

    def active(self) -> AbstractContextManager[None]:
        return self._active()

    @contextmanager
    def _active(self) -> Iterator[None]:
        with ExitStack() as stack:
            for scope in self.scopes:
                stack.enter_context(scope.active())
            yield

    def end(self, outcome: str | None, error: BaseException | None) -> None:
        for scope in reversed(self.scopes):
            scope.end(outcome, error)


class _SettleScopes(SettleScope):
    def __init__(self, scopes: list[SettleScope]) -> None:
        self.scopes = scopes

    def end(self, error: BaseException | None) -> None:
        for scope in reversed(self.scopes):
            scope.end(error)


# -- headers stored with a message ------------------------------------------------------------

def attributes_with_headers(attributes: Mapping[str, str], headers: Mapping[str, str]) -> str:
    """The stored attributes JSON of a message that carries ``headers``."""
    stored: dict[str, Any] = dict(attributes)
    stored[HEADERS_KEY] = dict(headers)
    return json.dumps(stored, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def split_headers(stored: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str] | None]:
    """A message's stored attributes as the user's attributes and the library's headers."""
    if HEADERS_KEY not in stored:
        return dict(stored), None
    attributes = dict(stored)
    raw = attributes.pop(HEADERS_KEY)
    headers = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, Mapping) else None
    return attributes, headers


def trace_id_of(headers: Mapping[str, str] | None) -> str | None:
    """The trace id a message carries (W3C ``traceparent``: ``00-<trace id>-<span id>-<flags>``),
    or None when it carries none."""
    parent = (headers or {}).get("traceparent", "")
    parts = parent.split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and parts[1] != "0" * 32 and all(
            c in "0123456789abcdef" for c in parts[1]):
        return parts[1]
    return None


def carry_headers(message: PreparedMessage, headers: Mapping[str, str]) -> None:
    """Makes ``message`` carry ``headers`` (its content hash, and so deduplication, stays the same)."""
    message.headers = dict(headers)
    message.attributes_json = attributes_with_headers(message.attributes, headers)
