"""A job: an async function declared with ``@queue.job(name, ...)``, and what its signature asks for.

The function takes its payload (annotated with a pydantic model, or any type pydantic validates
and that survives a round trip through JSON), optionally a :class:`~.context.JobContext`, and
FastAPI dependencies (``Depends``), as handlers do. Its policy (tries, backoff, timeout, queue) is
written into every job at dispatch, so a job waiting through a deploy keeps the policy it was
dispatched with.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Secret, SecretBytes, SecretStr, TypeAdapter, ValidationError
from pydantic.errors import PydanticSchemaGenerationError, PydanticUserError
from pydantic_core import PydanticSerializationError

from ..core.envelope import (
    MAX_ATTEMPTS_LIMIT,
    MAX_BACKOFF_ENTRIES,
    MAX_DELAY_SECONDS,
    MAX_PRIORITY,
    MIN_PRIORITY,
    serialization_problem,
)
from ..core.errors import ConfigurationError
from ..core.flow import parse_rate
from .context import JobContext

DEFAULT_QUEUE = "default"
DEFAULT_TRIES = 3
RESERVED_PREFIX = "workqueue."
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,199}$")
_QUEUE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,79}$")

JobFunc = Callable[..., Awaitable[Any]]


class JobPayloadInvalid(ValueError):
    """A payload that does not validate against its job's payload type; nothing was queued."""

    def __init__(self, job: str, errors: str) -> None:
        super().__init__(f"the payload for job {job!r} is invalid: {errors}")
        self.job = job
        self.errors = errors


_VALID_QUEUES: set[str] = set()
"""Queue names already checked (a dispatch checks its queue's name each time)."""


def check_queue_name(queue: str) -> str:
    """A queue name: letters, digits, ``_`` and ``-`` (it names a topic and a subscription)."""
    if type(queue) is str and queue in _VALID_QUEUES:
        return queue
    if not isinstance(queue, str) or not _QUEUE.match(queue):
        raise ConfigurationError(
            f"queue name {queue!r} is not valid: use letters, digits, '_' and '-' (at most 80), e.g. 'mail'"
        )
    if len(_VALID_QUEUES) < 1024:
        _VALID_QUEUES.add(queue)
    return queue


def check_priority(priority: int, what: str = "priority") -> int:
    """A job's priority: a whole number from 0 (the default) to 9, higher first (raises ValueError)."""
    if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(
            f"{what} must be a whole number from {MIN_PRIORITY} to {MAX_PRIORITY} (higher runs first), got {priority!r}"
        )
    return priority


def check_backoff(backoff: Sequence[float] | float | None) -> tuple[float, ...] | None:
    if backoff is None:
        return None
    steps = (backoff,) if isinstance(backoff, int | float) else tuple(backoff)
    if len(steps) > MAX_BACKOFF_ENTRIES:
        raise ConfigurationError(
            f"backoff has {len(steps)} steps; at most {MAX_BACKOFF_ENTRIES} are allowed (the last one repeats)"
        )
    if not steps or any(not isinstance(s, int | float) or not 0 <= s <= MAX_DELAY_SECONDS for s in steps):
        raise ConfigurationError(
            f"backoff {backoff!r} must be seconds (0 to 100 years) or a non-empty list of them, e.g. [10, 60, 300]"
        )
    return tuple(float(s) for s in steps)


@dataclass(frozen=True, slots=True)
class JobPolicy:
    """What a job is dispatched with, unless the dispatch says otherwise."""

    tries: int = DEFAULT_TRIES
    backoff: tuple[float, ...] | None = None
    """The delay after failed attempt n is item n, the last repeating; None: the queue's exponential
    full-jitter backoff."""
    timeout: float | None = None
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    """The priority its jobs are dispatched with (0 to 9, higher first), unless a dispatch says otherwise."""
    concurrency: int | None = None
    """At most this many jobs of its queue run at once, in every process: the queue's ``max_in_flight``."""
    rate_limit: str | None = None
    """At most this many jobs of its queue start per second, minute or hour: the queue's ``rate_limit``."""

    def __post_init__(self) -> None:
        if not isinstance(self.tries, int) or not 1 <= self.tries <= MAX_ATTEMPTS_LIMIT:
            raise ConfigurationError(f"tries must be a whole number of at least 1, got {self.tries!r}")
        if self.timeout is not None and not 0 < self.timeout <= MAX_DELAY_SECONDS:
            raise ConfigurationError(f"timeout must be a number of seconds above 0, got {self.timeout!r}")
        check_queue_name(self.queue)
        try:
            check_priority(self.priority)
            if self.rate_limit is not None:
                object.__setattr__(self, "rate_limit", str(parse_rate(self.rate_limit)))
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        if self.concurrency is not None and (
            type(self.concurrency) is not int or not 1 <= self.concurrency <= MAX_ATTEMPTS_LIMIT
        ):
            raise ConfigurationError(
                f"concurrency must be a whole number of at least 1 (the most jobs of the queue running at once, "
                f"in every process), got {self.concurrency!r}"
            )

    @property
    def queue_limits(self) -> dict[str, int | str]:
        """The limits it gives its queue, as the queue's subscription names them."""
        limits: dict[str, int | str] = {}
        if self.concurrency is not None:
            limits["max_in_flight"] = self.concurrency
        if self.rate_limit is not None:
            limits["rate_limit"] = self.rate_limit
        return limits


@dataclass(slots=True, eq=False)
class Job:
    """A declared job: its name, function, policy and what the function takes."""

    name: str
    func: JobFunc
    policy: JobPolicy
    encrypted: bool = False
    middleware: tuple[Any, ...] = ()
    store_result: bool = False
    """Its return value is stored with the job (``job_status`` and ``wait`` read it)."""
    payload_param: str | None = None
    payload_type: Any = Any
    context_param: str | None = None
    dependency_params: list[str] = field(default_factory=list)
    adapter: TypeAdapter[Any] = field(default_factory=lambda: TypeAdapter(Any))
    reads_back_checked: bool = False
    """Its payload type writes JSON in a way of its own (a custom serializer, a field left out of
    the JSON): each dispatch reads the payload back and refuses one that does not come back as given."""

    @property
    def key(self) -> str:
        """The key its dependencies are prepared under (one namespace with handler keys)."""
        return f"job:{self.name}"

    def validate(self, payload: Any) -> Any:
        """The payload as JSON-ready data, after validation against the payload type."""
        if self.payload_param is None and payload is not None and payload != {}:
            raise JobPayloadInvalid(self.name, (
                f"the job takes no payload (its function has no payload parameter), got a {type(payload).__name__}; "
                "dispatch it without one, or give the function a payload parameter"
            ))
        adapter = self.adapter  # (its validator and serializer themselves: the adapter's wrappers cost as much)
        try:
            value = adapter.validator.validate_python(payload)
        except ValidationError as exc:
            raise JobPayloadInvalid(self.name, _short(exc)) from None
        # A model instance is not validated again: one changed after it was built (or built with
        # model_construct) may hold a value of another type, which the worker would refuse. Its JSON
        # is read back as the worker reads it, and refused here when it does not read.
        instance = value is payload and type(payload) is not dict and isinstance(payload, BaseModel)
        try:  # (by field name: `load` reads names)
            data = adapter.serializer.to_python(value, mode="json", warnings="none" if instance else True)
        except PydanticSerializationError as exc:
            raise JobPayloadInvalid(self.name, serialization_problem(exc)) from None
        except UnicodeDecodeError as exc:  # bytes that are not UTF-8, which JSON cannot carry as text
            raise JobPayloadInvalid(self.name, (
                f"bytes that are not UTF-8 ({exc.reason} at byte {exc.start}) cannot be stored as JSON; send them "
                "as base64 (a pydantic Base64Bytes field) or store them elsewhere and pass a reference"
            )) from None
        except (ValueError, RecursionError) as exc:  # (after UnicodeDecodeError, a ValueError too)
            if "depth" not in str(exc) and not isinstance(exc, RecursionError):
                raise
            raise JobPayloadInvalid(self.name, "it nests deeper than a payload may (200 levels); flatten it") from None
        if self.reads_back_checked:
            self._check_reads_back(value, data)
        elif instance:
            try:
                self.load(data)
            except JobPayloadInvalid as exc:
                raise JobPayloadInvalid(self.name, (
                    f"{exc.errors} (a model instance is not validated again: one changed after it was built, or "
                    "built with model_construct, can hold a value of another type; build it with its constructor "
                    "or model_validate)")) from None
        return data

    def _check_reads_back(self, value: Any, data: Any) -> None:
        """Refuses a payload whose JSON does not read back as ``value`` (the job would get another
        value, or fail at run time without a retry)."""
        try:
            back = self.load(data)
        except JobPayloadInvalid as exc:
            why = str(exc).partition("is invalid: ")[2] or str(exc)
            raise JobPayloadInvalid(self.name, (
                f"its JSON does not read back ({why}): a custom serializer writes what its field does not read; "
                "make the serializer and the field agree"
            )) from None
        if back != value:
            raise JobPayloadInvalid(self.name, (
                f"it reads back from its JSON as {back!r}, not as given ({value!r}): a custom serializer or a "
                "field with exclude=True changes it; make them agree, or leave the field out of the payload"
            ))

    def load(self, data: Any) -> Any:
        """The stored payload as the function's payload type (raises :class:`JobPayloadInvalid`).

        ``data`` is what the payload's JSON reads as. What the Python objects do not validate is
        validated again as JSON (pydantic's JSON mode), which a strict model needs: it takes an ISO
        date string for a ``datetime`` only from JSON. Fields are read by their names (as
        :meth:`validate` writes them) and by their aliases (as a producer elsewhere may write them)."""
        validator = self.adapter.validator  # (once per attempt: without the wrapper)
        try:
            return validator.validate_python(data, by_alias=True, by_name=True)
        except ValidationError:
            pass
        try:
            return validator.validate_json(json.dumps(data), by_alias=True, by_name=True)
        except ValidationError as exc:
            raise JobPayloadInvalid(self.name, _short(exc)) from None


def _short(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "payload"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _json_adapter(name: str, tp: Any) -> TypeAdapter[Any]:
    """A TypeAdapter for ``tp``, refused unless pydantic can write it as JSON and read it back."""
    try:
        # NaN and infinities are written as themselves, not as null (pydantic's default), so that the
        # publish refuses them as it refuses them in any payload: JSON has no such numbers. (A model
        # carries its own configuration.)
        adapter: TypeAdapter[Any]
        try:
            adapter = TypeAdapter(tp, config=ConfigDict(ser_json_inf_nan="constants"))
        except PydanticUserError as exc:
            if exc.code != "type-adapter-config-unused":
                raise
            adapter = TypeAdapter(tp)  # (a model, dataclass or TypedDict: its own configuration)
        adapter.json_schema(mode="validation")
        adapter.json_schema(mode="serialization")
    except (PydanticSchemaGenerationError, PydanticUserError, TypeError) as exc:
        why = str(exc).splitlines()[0].rstrip(".")
        raise ConfigurationError(
            f"job {name!r}: its payload type {getattr(tp, '__name__', tp)!r} cannot be stored as JSON ({why}); "
            "a job payload is stored as JSON: use a pydantic model of strings, numbers, booleans, lists and "
            "objects (pass IDs, not records or open resources)"
        ) from None
    problems = _lost_in_json(tp, set())
    if problems:
        raise ConfigurationError(
            f"job {name!r}: its payload would not come back from JSON as it was given: {'; '.join(problems[:3])}"
        )
    return adapter


def _writes_its_own_json(tp: Any, seen: set[type]) -> bool:
    """Whether a model in ``tp`` has a custom serializer or leaves a field out of its JSON: what it
    writes may not read back as given, so each dispatch checks it (other types cost nothing)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel) and tp not in seen:
        seen.add(tp)
        decorators = tp.__pydantic_decorators__
        if decorators.field_serializers or decorators.model_serializers:
            return True
        for info in tp.model_fields.values():
            if info.exclude is True or _writes_its_own_json(info.annotation, seen):
                return True
    return any(_writes_its_own_json(arg, seen) for arg in typing.get_args(tp))


def _lost_in_json(tp: Any, seen: set[type]) -> list[str]:
    """What of a payload type pydantic writes as JSON in a form that does not read back as given
    (the job would get another value, or fail at run time after a dispatch that was accepted)."""
    problems: list[str] = []
    if isinstance(tp, type) and issubclass(tp, SecretStr | SecretBytes | Secret):
        problems.append(f"a {tp.__name__} is written as '**********' (keep the secret out of the payload, or use a "
                        "plain str field with encrypted=True)")
    elif isinstance(tp, type) and issubclass(tp, BaseModel) and tp not in seen:
        seen.add(tp)
        for field_name, info in tp.model_fields.items():
            if info.exclude is True and info.is_required():
                problems.append(f"{tp.__name__}.{field_name} is required but left out of the JSON (exclude=True); "
                                "give it a default or include it")
            problems += _lost_in_json(info.annotation, seen)
        if tp.model_computed_fields and tp.model_config.get("extra") == "forbid":
            names = ", ".join(tp.model_computed_fields)
            problems.append(f"{tp.__name__} writes its computed fields ({names}) into the JSON and forbids extra "
                            "fields when it reads it back; allow or ignore extra fields")
    for arg in typing.get_args(tp):
        problems += _lost_in_json(arg, seen)
    return problems


def _has_dependency(param: inspect.Parameter, annotation: Any) -> bool:
    if hasattr(param.default, "dependency"):
        return True
    if typing.get_origin(annotation) is typing.Annotated:
        return any(hasattr(meta, "dependency") for meta in typing.get_args(annotation)[1:])
    return False


def define_job(
    name: str,
    func: JobFunc,
    *,
    tries: int = DEFAULT_TRIES,
    backoff: Sequence[float] | float | None = None,
    timeout: float | None = None,
    queue: str = DEFAULT_QUEUE,
    encrypted: bool = False,
    middleware: Sequence[Any] = (),
    store_result: bool = False,
    priority: int = 0,
    rate_limit: str | None = None,
    concurrency: int | None = None,
) -> Job:
    """Reads ``func``'s signature and checks the declaration; raises :class:`ConfigurationError`."""
    check_job_name(name)
    if not inspect.iscoroutinefunction(func):
        raise ConfigurationError(f"job {name!r} must be an async function (async def)")
    policy = JobPolicy(tries=tries, backoff=check_backoff(backoff), timeout=timeout, queue=queue, priority=priority,
                       concurrency=concurrency, rate_limit=rate_limit)
    for mw in middleware:
        if not callable(mw):
            raise ConfigurationError(
                f"job {name!r}: middleware {mw!r} is not callable (write async def mw(attempt, call_next))"
            )
    if not isinstance(store_result, bool):
        raise ConfigurationError(f"job {name!r}: store_result must be True or False, got {store_result!r}")
    return _read_signature(Job(name=name, func=func, policy=policy, encrypted=encrypted,
                               middleware=tuple(middleware), store_result=store_result))


def check_job_name(name: str) -> None:
    """Raises :class:`ConfigurationError` unless ``name`` can name a job."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"job name {name!r} is not valid: use letters, digits, '.', '_', ':' and '-' (at most 200), "
            "e.g. 'billing.send-invoice-reminder'"
        )
    if name.startswith(RESERVED_PREFIX):
        raise ConfigurationError(f"job name {name!r}: names under {RESERVED_PREFIX!r} belong to the library")


def _read_signature(job: Job) -> Job:
    name, func = job.name, job.func
    try:
        hints = typing.get_type_hints(func, include_extras=True)
    except Exception as exc:
        raise ConfigurationError(f"job {name!r}: cannot resolve its type hints ({exc})") from exc
    for pname, param in inspect.signature(func).parameters.items():
        annotation = hints.get(pname, param.annotation)
        bare = typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation
        if bare is JobContext or (pname == "job" and annotation is param.empty):
            job.context_param = pname
        elif _has_dependency(param, annotation):
            job.dependency_params.append(pname)
        elif job.payload_param is None and param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD,
                                                           param.KEYWORD_ONLY):
            job.payload_param = pname
            job.payload_type = Any if annotation is param.empty else bare
        elif param.default is param.empty and param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            raise ConfigurationError(
                f"job {name!r}: parameter {pname!r} is neither the payload, the JobContext nor a dependency; "
                "give it a dependency (name = Depends(...)) or remove it"
            )
    job.adapter = _json_adapter(name, job.payload_type)
    job.reads_back_checked = _writes_its_own_json(job.payload_type, set())
    return job

