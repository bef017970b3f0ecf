"""Resolves a handler's FastAPI dependencies (``Depends``, yield dependencies) once per attempt.

The whole graph is checked when the handler is registered: a dependency, however deep, may take
only other dependencies, ``Request``, ``HTTPConnection``, ``Response`` and ``SecurityScopes``;
a query parameter, a body, a header, a cookie, a path parameter, a WebSocket or BackgroundTasks
exist only in a real request and are refused with the path to them. The FastAPI internals this
needs live in :mod:`fastapi_workqueue.web.fastapi_internals`, imported with FastAPI only when a
handler declares a dependency: a worker whose handlers take just the message and the context never
loads FastAPI.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigurationError
from ..core.handlers import HandlerSpec, call_plain
from ..core.redaction import redacting_logger
from ..core.request_load import IN_ATTEMPT

if TYPE_CHECKING:
    from ..core.context import WorkContext
    from ..core.envelope import WorkMessage
    from ..core.outcomes import WorkOutcome
    from .fastapi_internals import Dependant, GraphProblem

log = redacting_logger("fastapi_workqueue.handlers")

ALLOWED = "other dependencies, Request, HTTPConnection, Response and SecurityScopes"


def _stub_for(func: Callable[..., Any], names: list[str]) -> Any:
    """A callable whose signature holds only ``func``'s dependency parameters ``names``."""
    hints = typing.get_type_hints(func, include_extras=True)
    signature = inspect.signature(func)
    params = [
        p.replace(annotation=hints.get(name, p.annotation))
        for name, p in signature.parameters.items()
        if name in names
    ]

    async def stub(**kwargs: Any) -> None:  # pragma: no cover - never called
        return None

    stub.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=params, return_annotation=inspect.Signature.empty
    )
    stub.__name__ = getattr(func, "__name__", "handler")
    return stub


def _path_to_type(func: Callable[..., Any], names: list[str], type_name: str,
                  seen: frozenset[int] = frozenset()) -> list[str] | None:
    """The chain of dependency names and the parameter under ``func``'s dependency parameters
    ``names`` that is annotated with a class named ``type_name`` (FastAPI's error names the class,
    not where it is), or None."""
    try:
        hints = typing.get_type_hints(func, include_extras=True)
        parameters = inspect.signature(func).parameters
    except (TypeError, ValueError, NameError):
        return None
    for pname, param in parameters.items():
        if pname not in names:
            continue
        annotation = hints.get(pname, param.annotation)
        depends = param.default if hasattr(param.default, "dependency") else next(
            (m for m in getattr(annotation, "__metadata__", ()) if hasattr(m, "dependency")), None)
        call = getattr(depends, "dependency", None)
        if call is None or id(call) in seen:
            continue
        label = getattr(call, "__name__", type(call).__name__)
        try:
            inner = typing.get_type_hints(call, include_extras=True)
            inner_params = list(inspect.signature(call).parameters)
        except (TypeError, ValueError, NameError):
            continue
        for inner_name in inner_params:
            bare = inner.get(inner_name)
            bare = typing.get_args(bare)[0] if typing.get_origin(bare) is typing.Annotated else bare
            if getattr(bare, "__name__", None) == type_name:
                return [label, inner_name]
        deeper = _path_to_type(call, inner_params, type_name, seen | {id(call)})
        if deeper is not None:
            return [label, *deeper]
    return None


def _path(key: str, problem: GraphProblem) -> str:
    kind, _, name = key.partition(":") if key.startswith("job:") else ("handler", "", key)
    return " -> ".join((f"{kind} {name!r}", *problem.chain, problem.parameter))


class DependencyInvoker:
    """Calls handlers, solving their dependencies as FastAPI would for a request.

    Each attempt gets a fresh dependency cache; yield dependencies are cleaned up when the
    attempt ends. Dependencies see a synthetic request whose ``app`` is the running app, so
    ``request.app.state`` and ``app.dependency_overrides`` work.
    """

    def __init__(self) -> None:
        self.app: Any = None
        self._dependants: dict[str, Dependant] = {}

    def prepare(self, spec: HandlerSpec) -> None:
        """Builds the dependency graph of a handler at registration and checks all of it."""
        self.prepare_call(spec.key, spec.func, spec.other_params)

    def prepare_call(self, key: str, func: Callable[..., Any], params: list[str]) -> None:
        """Builds and checks the graph of ``func``'s dependency parameters ``params`` under ``key``."""
        if not params:
            return
        from .fastapi_internals import build_dependant, request_only_parameters

        try:
            dependant = build_dependant(_stub_for(func, params))
        except Exception as exc:  # FastAPI's own refusal of a parameter type (FastAPIError, …)
            kind, _, name = key.partition(":") if key.startswith("job:") else ("handler", "", key)
            text = str(exc).strip()
            typed = re.search(r"<class '(?:[\w.]*\.)?(\w+)'>", text)
            chain = _path_to_type(func, params, typed.group(1)) if typed else None
            where = f" ({' -> '.join((f'{kind} {name!r}', *chain))})" if chain else ""
            what = (f"one of its dependencies takes a parameter typed {typed.group(1)}{where}, which FastAPI can "
                    "only read from a request" if typed else f"FastAPI cannot build its dependencies ({text[:200]})")
            raise ConfigurationError(
                f"{kind} {name!r}: {what}; a dependency may take only {ALLOWED}: take the running attempt's "
                "context or message with Depends(current_context) or Depends(current_message)"
            ) from exc
        problems = request_only_parameters(dependant)
        if problems:
            first = problems[0]
            more = f" (and {len(problems) - 1} more: {', '.join(_path(key, p) for p in problems[1:])})" if (
                len(problems) > 1) else ""
            raise ConfigurationError(
                f"{_path(key, first)}: {first.kind}{more}; a handler's dependencies may take only {ALLOWED} "
                "(a handler has no HTTP request: read what you need from the message or the app's state)"
            )
        self._dependants[key] = dependant

    def app_needed_by(self, spec: HandlerSpec) -> str | None:
        """Where the handler's dependencies take a Request or HTTPConnection (which gives them
        ``request.app``), or None. ``current_message`` and ``current_context`` need no app."""
        return self.app_needed_by_key(spec.key)

    def app_needed_by_key(self, key: str) -> str | None:
        """:meth:`app_needed_by` for the dependencies prepared under ``key``."""
        dependant = self._dependants.get(key)
        if dependant is None:
            return None
        from .current import current_context, current_message
        from .fastapi_internals import connection_parameters

        found = connection_parameters(dependant, ignore=(current_message, current_context))
        return _path(key, found[0]) if found else None

    async def __call__(
        self, spec: HandlerSpec, message: WorkMessage[Any], context: WorkContext
    ) -> WorkOutcome | None:
        if spec.key not in self._dependants:
            return await call_plain(spec, message, context)
        fixed: dict[str, Any] = {}
        if spec.message_param:
            fixed[spec.message_param] = message
        if spec.context_param:
            fixed[spec.context_param] = context
        result: WorkOutcome | None = await self.call(spec.key, spec.func, fixed, message, context)
        return result

    async def call(
        self, key: str, func: Callable[..., Any], fixed: dict[str, Any], message: WorkMessage[Any],
        context: WorkContext,
    ) -> Any:
        """Calls ``func(**fixed, **dependencies)``, the dependencies prepared under ``key`` solved
        for this attempt (yield dependencies cleaned up when it returns)."""
        dependant = self._dependants.get(key)
        if dependant is None:
            return await func(**fixed)
        from .fastapi_internals import request_scope

        scope = request_scope(
            self.app, f"/workqueue/{key}", {"workqueue.message": message, "workqueue.context": context}
        )
        attempt = IN_ATTEMPT.set(True)  # (a request session it takes is the host's work, not a request)
        try:
            return await self._solve_and_call(key, func, dependant, scope, fixed)
        finally:
            IN_ATTEMPT.reset(attempt)

    async def _solve_and_call(self, key: str, func: Callable[..., Any], dependant: Dependant,
                              scope: dict[str, Any], fixed: dict[str, Any]) -> Any:
        from .fastapi_internals import solve
        from .session import current_request_transaction, fail_request_transaction

        raised: BaseException | None = None
        before = current_request_transaction()
        async with AsyncExitStack() as request_stack, AsyncExitStack() as function_stack:
            try:
                values, errors = await solve(dependant, scope, self.app, request_stack, function_stack)
                if errors:
                    raise ConfigurationError(f"{key!r}: dependencies could not be resolved: {errors}")
                values.update(fixed)
                return await func(**values)
            except BaseException as exc:
                raised = exc
                fail_request_transaction(before)  # (its session rolls back, whatever a dependency does with exc)
                raise
        # Here only when a yield dependency caught what was raised (by the handler, or by another
        # dependency as they were solved) and did not raise it again. FastAPI answers such a request
        # 500; the attempt fails as it would have without the dependency.
        if raised is None:  # pragma: no cover - the block above returns or raises
            raise RuntimeError(f"{key!r}: the dependencies ended the attempt without a result")
        log.warning("%r: a yield dependency caught the %s raised under it and did not raise it again; the "
                    "attempt ends as the exception says all the same (raise it again in the dependency's except "
                    "block, as FastAPI asks)", key, type(raised).__name__)
        raise raised
