"""Every use of FastAPI's (and Starlette's) non-public parts, in one place.

FastAPI has no public API for solving a dependency graph outside a request, so the handler
bridge (:mod:`fastapi_workqueue.web.di`) calls the functions a route calls. What each use relies
on is written next to it; the DI tests run on the lowest FastAPI the project supports (the
``fastapi>=`` of pyproject.toml, in ``.venv-fastapi-min`` made by ``scripts/test``) and on the
newest, so a release that changes one of them fails there first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

# ``Dependant`` (fastapi.dependencies.models) is the graph FastAPI builds from a signature. We read
# its fields ``call``, ``dependencies`` (the sub-dependants), the ``*_params`` lists (what a request
# would fill in: query, body, path, header, cookie) and the ``*_param_name`` fields (parameters
# typed Request, HTTPConnection, WebSocket, Response, BackgroundTasks, SecurityScopes). These are
# the same from 0.121 to today.
from fastapi.dependencies.models import Dependant

# ``get_dependant(path=..., call=...)`` builds that graph, as ``APIRoute`` does for an endpoint;
# ``solve_dependencies(request=, dependant=, dependency_overrides_provider=, async_exit_stack=,
# embed_body_fields=)`` resolves it, applying ``app.dependency_overrides``, and answers an object
# with ``values`` (the keyword arguments) and ``errors``. Keyword-only in every version we support.
from fastapi.dependencies.utils import get_dependant, solve_dependencies
from starlette.requests import Request

__all__ = [
    "Dependant",
    "GraphProblem",
    "build_dependant",
    "connection_parameters",
    "request_only_parameters",
    "request_scope",
    "scopes_of",
    "set_request_body",
    "solve",
    "walk",
]

# Since 0.106 FastAPI closes yield dependencies through exit stacks it finds in the request scope
# under these keys (not through the ``async_exit_stack`` argument, which it keeps for callers like
# us): "request" scoped ones on the first, "function" scoped ones (``Depends(scope="function")``,
# 0.121+) on the second, which closes before the first. solve_dependencies asserts both are there.
_REQUEST_STACK_KEY = "fastapi_inner_astack"
_FUNCTION_STACK_KEY = "fastapi_function_astack"

_LOOSE_KINDS = (
    ("query_params", "a query parameter"),
    ("body_params", "a request body"),
    ("path_params", "a path parameter"),
    ("header_params", "a header"),
    ("cookie_params", "a cookie"),
)


@dataclass(frozen=True, slots=True)
class GraphProblem:
    """A parameter somewhere in a dependency graph: the chain of callables to it, and what it is."""

    chain: tuple[str, ...]
    parameter: str
    kind: str


def build_dependant(call: Any, path: str = "/workqueue") -> Dependant:
    """The dependency graph of ``call``'s signature, as FastAPI builds it for an endpoint."""
    return get_dependant(path=path, call=call)


def _name(call: Any) -> str:
    return str(getattr(call, "__name__", None) or type(call).__name__)


def walk(dependant: Dependant, chain: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Dependant]]:
    """Every node of the graph with the chain of callable names below the root that leads to it."""
    yield chain, dependant
    for sub in dependant.dependencies:
        yield from walk(sub, (*chain, _name(sub.call)))


def request_only_parameters(dependant: Dependant) -> list[GraphProblem]:
    """Parameters that only a real request fills in (query, body, path, header, cookie, WebSocket,
    BackgroundTasks), anywhere in the graph."""
    found: list[GraphProblem] = []
    for chain, node in walk(dependant):
        for attribute, kind in _LOOSE_KINDS:
            for field in getattr(node, attribute):
                found.append(GraphProblem(chain, field.name, kind))
        if node.websocket_param_name:
            found.append(GraphProblem(chain, node.websocket_param_name, "a WebSocket"))
        if node.background_tasks_param_name:
            found.append(GraphProblem(chain, node.background_tasks_param_name,
                                      "BackgroundTasks (they would never run: a handler sends no response)"))
    return found


def connection_parameters(dependant: Dependant, *, ignore: tuple[Any, ...] = ()) -> list[GraphProblem]:
    """Parameters typed ``Request`` or ``HTTPConnection`` anywhere in the graph, except in the
    callables of ``ignore``."""
    found: list[GraphProblem] = []
    for chain, node in walk(dependant):
        if node.call in ignore:
            continue
        for name in (node.request_param_name, node.http_connection_param_name):
            if name:
                found.append(GraphProblem(chain, name, "a Request"))
    return found


def request_scope(app: Any, path: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The ASGI scope of the synthetic request a handler's dependencies see: ``request.app`` is
    ``app`` (None outside an app), no headers, no query, no body."""
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "scheme": "workqueue",
        "query_string": b"",
        "headers": [],
        "client": None,
        "server": None,
        "app": app,
        "state": {},
        **extra,
    }


async def solve(
    dependant: Dependant, scope: dict[str, Any], overrides_provider: Any, request_stack: AsyncExitStack,
    function_stack: AsyncExitStack,
) -> tuple[dict[str, Any], list[Any]]:
    """Resolves ``dependant`` for a synthetic request of ``scope``; yield dependencies close with
    the two stacks. Returns the keyword arguments and FastAPI's errors (empty when it worked)."""
    scope[_REQUEST_STACK_KEY] = request_stack
    scope[_FUNCTION_STACK_KEY] = function_stack
    solved = await solve_dependencies(
        request=Request(scope),
        dependant=dependant,
        # (a Starlette app has no overrides: FastAPI reads the attribute of whatever it is given)
        dependency_overrides_provider=overrides_provider if hasattr(overrides_provider, "dependency_overrides")
        else None,
        async_exit_stack=request_stack,
        embed_body_fields=False,
    )
    return dict(solved.values), list(solved.errors)


def scopes_of(dependant: Dependant) -> list[str]:
    """The OAuth scopes a route's ``Security`` dependencies ask for (for its OpenAPI entry).

    Newer releases keep a node's own scopes in ``own_oauth_scopes``; 0.121 kept them, with its
    parents', in ``security_scopes``."""
    own = getattr(dependant, "own_oauth_scopes", None)
    if own is None and not hasattr(dependant, "own_oauth_scopes"):
        own = getattr(dependant, "security_scopes", None)
    found: list[str] = list(own or ())
    for sub in dependant.dependencies:
        found.extend(s for s in scopes_of(sub) if s not in found)
    return found


def set_request_body(request: Request, body: bytes) -> None:
    """Hands a body already read from the stream to FastAPI: ``Request.body()`` returns
    ``request._body`` when it is set, which Starlette's Request does in every version."""
    request._body = body
