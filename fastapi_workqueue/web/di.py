"""Resolves a handler's FastAPI dependencies (``Depends``, yield dependencies) once per attempt."""

from __future__ import annotations

import inspect
import typing
from contextlib import AsyncExitStack
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.dependencies.utils import get_dependant, solve_dependencies
from starlette.requests import Request

from ..core.context import WorkContext
from ..core.envelope import WorkMessage
from ..core.errors import ConfigurationError
from ..core.handlers import HandlerSpec, call_plain
from ..core.outcomes import WorkOutcome


def _stub_for(spec: HandlerSpec) -> Any:
    """A callable whose signature holds only the handler's dependency parameters."""
    hints = typing.get_type_hints(spec.func, include_extras=True)
    signature = inspect.signature(spec.func)
    params = [
        p.replace(annotation=hints.get(name, p.annotation))
        for name, p in signature.parameters.items()
        if name in spec.other_params
    ]

    async def stub(**kwargs: Any) -> None:  # pragma: no cover - never called
        return None

    stub.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=params, return_annotation=inspect.Signature.empty
    )
    stub.__name__ = getattr(spec.func, "__name__", "handler")
    return stub


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
        """Builds (and checks) the dependency graph of a handler at registration."""
        if not spec.other_params:
            return
        dependant = get_dependant(path=f"/workqueue/{spec.key}", call=_stub_for(spec))
        loose = [p.name for p in (*dependant.query_params, *dependant.body_params,
                                  *dependant.path_params, *dependant.header_params,
                                  *dependant.cookie_params)]
        if loose:
            raise ConfigurationError(
                f"handler {spec.key!r}: parameters {loose} are not dependencies; a handler takes its "
                "WorkMessage, its WorkContext and Depends(...) parameters only"
            )
        self._dependants[spec.key] = dependant

    async def __call__(
        self, spec: HandlerSpec, message: WorkMessage[Any], context: WorkContext
    ) -> WorkOutcome | None:
        dependant = self._dependants.get(spec.key)
        if dependant is None:
            return await call_plain(spec, message, context)
        scope: dict[str, Any] = {
            "type": "http",
            "method": "POST",
            "path": f"/workqueue/{spec.key}",
            "raw_path": f"/workqueue/{spec.key}".encode(),
            "root_path": "",
            "scheme": "workqueue",
            "query_string": b"",
            "headers": [],
            "client": None,
            "server": None,
            "app": self.app,
            "state": {},
            "workqueue.message": message,
            "workqueue.context": context,
        }
        async with AsyncExitStack() as request_stack:
            scope["fastapi_inner_astack"] = request_stack
            async with AsyncExitStack() as function_stack:
                scope["fastapi_function_astack"] = function_stack
                request = Request(scope)
                solved = await solve_dependencies(
                    request=request,
                    dependant=dependant,
                    dependency_overrides_provider=self.app,
                    async_exit_stack=request_stack,
                    embed_body_fields=False,
                )
                if solved.errors:
                    raise ConfigurationError(
                        f"handler {spec.key!r}: dependencies could not be resolved: {solved.errors}"
                    )
                kwargs = dict(solved.values)
                if spec.message_param:
                    kwargs[spec.message_param] = message
                if spec.context_param:
                    kwargs[spec.context_param] = context
                return await spec.func(**kwargs)


def current_message(request: Request) -> WorkMessage[Any]:
    """A dependency that gives the delivery's message to other dependencies of a handler."""
    message = request.scope.get("workqueue.message")
    if message is None:
        raise RuntimeError("current_message is only available to work queue handlers")
    return typing.cast(WorkMessage[Any], message)


def current_context(request: Request) -> WorkContext:
    """A dependency that gives the delivery's WorkContext to other dependencies of a handler."""
    context = request.scope.get("workqueue.context")
    if context is None:
        raise RuntimeError("current_context is only available to work queue handlers")
    return typing.cast(WorkContext, context)
