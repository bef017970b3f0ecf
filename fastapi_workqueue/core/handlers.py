"""Handler registration: what a handler takes, and how a claimed delivery becomes its message."""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import from_json

from .context import WorkContext
from .envelope import WorkMessage
from .errors import ConfigurationError
from .outcomes import FatalWorkError, WorkOutcome
from .transport import ClaimedDelivery

HandlerFunc = Callable[..., Awaitable[WorkOutcome | None]]


class PayloadInvalid(FatalWorkError):
    """The payload does not validate against the handler's type: the delivery dead-letters at once."""


@dataclass(slots=True)
class HandlerSpec:
    """A registered handler and what its signature asks for."""

    key: str
    func: HandlerFunc
    payload_type: Any = Any
    message_param: str | None = None
    context_param: str | None = None
    other_params: list[str] = field(default_factory=list)
    _adapter: TypeAdapter[Any] | None = None
    _message_model: type[WorkMessage[Any]] | None = None

    @property
    def adapter(self) -> TypeAdapter[Any]:
        if self._adapter is None:
            self._adapter = TypeAdapter(self.payload_type)
        return self._adapter

    def build_message(self, delivery: ClaimedDelivery, subscription: str) -> WorkMessage[Any]:
        """Parses and validates the payload; raises :class:`PayloadInvalid` when it does not fit.

        The payload is validated from its JSON text (pydantic's JSON mode: what a JSON value may
        become, so a strict model takes an ISO date string for a ``datetime``), which costs about
        0.7 µs against 1.9 µs for ``json.loads`` and then validating the objects. Text that
        pydantic's parser refuses but ``json`` reads (a lone surrogate escape) takes that path."""
        text = delivery.payload_json
        try:
            if self.payload_type is Any:
                payload = None if text is None else _parse_json(text)
            else:
                payload = self.adapter.validate_python(None, by_alias=True, by_name=True) if text is None \
                    else self._validate_text(text)
        except ValidationError as exc:
            raise PayloadInvalid(
                f"payload does not validate against {_type_name(self.payload_type)}: "
                f"{exc.error_count()} error(s): {_short_errors(exc)}"
            ) from None  # pydantic's own text quotes the payload, which only admins may read
        except (ValueError, RecursionError) as exc:  # (JSON this process cannot read: an integer over
            # its int_max_str_digits, a nesting deeper than its recursion limit; failed at once, not left
            # to crash the attempt's task and lose its lease on every try)
            raise PayloadInvalid(f"payload cannot be read as JSON in this process: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:300]}") from None
        return _construct_message({
            "message_id": delivery.message_id,
            "topic": delivery.topic,
            "subscription": subscription,
            "delivery_id": delivery.delivery_id,
            "attempt": delivery.attempt,
            "partition_key": delivery.partition_key,
            "attributes": delivery.attributes,
            "payload": payload,
            "payload_ref": delivery.payload_ref,
            "correlation_id": delivery.correlation_id,
            "published_at": delivery.published_at,
        })

    def _validate_text(self, text: str) -> Any:
        """``text`` validated as JSON, or (a lone surrogate escape, which pydantic's parser refuses)
        as the objects ``json.loads`` reads. A model's fields are read by their names (as
        ``queue.publish`` writes a model) and by their aliases (as another producer may)."""
        try:
            return self.adapter.validate_json(text, by_alias=True, by_name=True)
        except ValidationError as exc:
            if any(error["type"] == "json_invalid" for error in exc.errors(include_url=False)):
                return self.adapter.validate_python(json.loads(text), by_alias=True, by_name=True)
            raise


def _parse_json(text: str) -> Any:
    """The JSON value of ``text``: pydantic's parser (about 0.15 µs for a small object against
    ``json.loads``'s 1.1), or ``json.loads`` for what that parser refuses (a lone surrogate escape)."""
    try:
        return from_json(text)
    except ValueError:
        return json.loads(text)


_ANY_MESSAGE = WorkMessage[Any]
_MESSAGE_FIELDS = frozenset(_ANY_MESSAGE.model_fields)


def _construct_message(values: dict[str, Any]) -> WorkMessage[Any]:
    """What ``WorkMessage[Any].model_construct(**values)`` builds, for ``values`` that name every
    field (no validation: the store's values are trusted): the class is subscripted once, and no
    field is looked up by alias. Once per attempt.

    It writes pydantic's instance fields (``__dict__``, ``__pydantic_fields_set__``,
    ``__pydantic_extra__``, ``__pydantic_private__``) as ``model_construct`` does, and is kept for
    what it saves: 4.8 µs against ``model_construct``'s 27 µs a message (and :func:`accepted` of
    the database transports 3.8 µs against 12 µs a published message), measured on the 2-core
    machine while other work ran on it. An attempt takes about 83 µs on a quiet machine
    (12,000 deliveries/s) and a message of a batch publish about 15 µs (bench/README.md), so either
    is far beyond 5 % end to end. tests/test_message_construct.py checks both against
    ``model_construct`` on the lowest pydantic pyproject.toml allows and on the newest
    (``scripts/test``)."""
    if values.keys() != _MESSAGE_FIELDS:
        return _ANY_MESSAGE.model_construct(**values)
    message = _ANY_MESSAGE.__new__(_ANY_MESSAGE)
    object.__setattr__(message, "__dict__", values)
    object.__setattr__(message, "__pydantic_fields_set__", set(_MESSAGE_FIELDS))
    object.__setattr__(message, "__pydantic_extra__", None)
    object.__setattr__(message, "__pydantic_private__", None)
    return message


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or repr(tp)


def _short_errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "payload"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def inspect_handler(key: str, func: HandlerFunc) -> HandlerSpec:
    """Reads a handler's signature: the ``WorkMessage[T]`` parameter, the ``WorkContext`` one, the rest.

    The message parameter is the one annotated ``WorkMessage[...]`` (or named ``message``), the
    context the one annotated ``WorkContext`` (or named ``context``). Every other parameter must
    have a default (FastAPI ``Depends(...)`` for dependencies).
    """
    if not inspect.iscoroutinefunction(func):
        raise ConfigurationError(f"handler {key!r} must be an async function (async def)")
    try:
        hints = typing.get_type_hints(func, include_extras=True)
    except Exception as exc:
        raise ConfigurationError(f"handler {key!r}: cannot resolve its type hints ({exc})") from exc
    spec = HandlerSpec(key=key, func=func)
    for name, param in inspect.signature(func).parameters.items():
        annotation = hints.get(name, param.annotation)
        declared_dependency = _has_dependency_metadata(annotation)
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        origin = typing.get_origin(annotation) or annotation
        if _is_work_message(origin) or (spec.message_param is None and name == "message" and annotation is param.empty):
            spec.message_param = name
            spec.payload_type = _payload_type(annotation)
        elif annotation is WorkContext or (name == "context" and annotation is param.empty):
            spec.context_param = name
        else:
            if (
                param.default is param.empty
                and not declared_dependency
                and param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL)
            ):
                if spec.message_param is None and name in ("message", "payload", "msg", "data"):
                    shown = "Any" if annotation is param.empty else (
                        inspect.formatannotation(annotation).replace("typing.", ""))
                    raise ConfigurationError(
                        f"handler {key!r}: parameter {name!r} is annotated as the payload; a handler takes the "
                        f"message, which carries it: write message: WorkMessage[{shown}] and read message.payload"
                    )
                raise ConfigurationError(
                    f"handler {key!r}: parameter {name!r} is neither the WorkMessage nor the WorkContext "
                    "and has no default; give it a dependency (name = Depends(...)) or remove it"
                )
            spec.other_params.append(name)
    if spec.message_param is None:
        raise ConfigurationError(
            f"handler {key!r} needs a parameter annotated WorkMessage[YourPayload] (or named 'message')"
        )
    return spec


def _has_dependency_metadata(annotation: Any) -> bool:
    """True for ``Annotated[T, Depends(...)]`` (any metadata object with a ``dependency``)."""
    if typing.get_origin(annotation) is not typing.Annotated:
        return False
    return any(hasattr(meta, "dependency") for meta in typing.get_args(annotation)[1:])


def _is_work_message(tp: Any) -> bool:
    if not isinstance(tp, type):
        return False
    return issubclass(tp, WorkMessage)


def _payload_type(annotation: Any) -> Any:
    metadata = getattr(annotation, "__pydantic_generic_metadata__", None)
    if metadata and metadata.get("args"):
        return metadata["args"][0]
    args = typing.get_args(annotation)
    return args[0] if args else Any


class HandlerRegistry:
    """Handlers by key. A key may be registered once."""

    def __init__(self) -> None:
        self._handlers: dict[str, HandlerSpec] = {}

    def add(self, key: str, func: HandlerFunc) -> HandlerSpec:
        if not key or not isinstance(key, str):
            raise ConfigurationError("a handler key must be a non-empty string")
        existing = self._handlers.get(key)
        if existing is not None and existing.func is not func:
            raise ConfigurationError(
                f"handler key {key!r} is already registered by {_qualname(existing.func)}; "
                f"{_qualname(func)} cannot take it too: give one of them another key"
            )
        spec = inspect_handler(key, func)
        self._handlers[key] = spec
        return spec

    def get(self, key: str) -> HandlerSpec | None:
        return self._handlers.get(key)

    def remove(self, key: str) -> None:
        """Forgets the handler of ``key`` (one whose registration was refused after it was read)."""
        self._handlers.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._handlers

    def keys(self) -> list[str]:
        return sorted(self._handlers)

    def specs(self) -> list[HandlerSpec]:
        """The registered handlers."""
        return list(self._handlers.values())


def _qualname(func: Callable[..., Any]) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


Invoker = Callable[[HandlerSpec, WorkMessage[Any], WorkContext], Awaitable[WorkOutcome | None]]
"""Calls a handler with its message, context and (in the web layer) its resolved dependencies."""


async def call_plain(spec: HandlerSpec, message: WorkMessage[Any], context: WorkContext) -> WorkOutcome | None:
    """Calls a handler that has no dependencies."""
    kwargs: dict[str, Any] = {}
    if spec.message_param:
        kwargs[spec.message_param] = message
    if spec.context_param:
        kwargs[spec.context_param] = context
    return await spec.func(**kwargs)


def unused_handlers(registered: Iterable[str], used: Mapping[str, str]) -> list[str]:
    """One warning per registered handler key that no subscription names (``used``: handler key
    -> a subscription that names it), with the key it most resembles: a typo in
    ``@queue.handler(...)`` otherwise leaves the subscription HandlerNotRegistered in silence."""
    unused = sorted(set(registered) - set(used))
    if not unused:
        return []
    from .words import closest

    problems = []
    for key in unused:
        guess = closest(key, used)
        hint = (f"; did you mean {guess!r} (subscription {used[guess]!r})?" if guess
                else "; declare a Subscription(handler_key=...) that names it, or remove the handler")
        problems.append(f"handler {key!r} is registered, but no subscription names it{hint}")
    return problems
