"""The apps alive in the process that serve a queue: whose dependency overrides its handlers and
jobs see when no lifespan bound an app.

A lifespan binds its app to the queue (``queue.bind_app``), and dependencies then see the app's
``state`` and ``dependency_overrides``. A test that enters ``queue.lifespan()`` without the app,
or drives the app without its lifespan (``httpx.ASGITransport`` runs none, ``fake.work()``),
leaves the queue without an app, and the real dependencies would run. So the queue looks for the
app among the Starlette and FastAPI apps alive in the process: one whose lifespan is the queue's
(``FastAPI(lifespan=queue.lifespan)``, also once routers' lifespans are merged into it, or a
lifespan function that uses the queue by name), or that includes one of the queue's routers.
"""

from __future__ import annotations

import functools
import gc
import types
from typing import Any

MAX_DEPTH = 4
"""How deep into wrappers and closures a lifespan is followed to the queue."""


def apps_of(queue: Any) -> list[Any]:
    """The Starlette and FastAPI apps alive in this process that serve ``queue``."""
    from starlette.applications import Starlette

    endpoints = _endpoints_of(queue)
    found = [obj for obj in gc.get_objects() if issubclass(type(obj), Starlette) and _serves(obj, queue, endpoints)]
    if len(found) > 1:  # apps of earlier tests that only the cycle collector frees
        del found
        gc.collect()
        found = [obj for obj in gc.get_objects()
                 if issubclass(type(obj), Starlette) and _serves(obj, queue, endpoints)]
    return found


def _routers_of(queue: Any) -> list[Any]:
    """The queue's routers built so far."""
    routers = [queue.health_router, getattr(queue, "_router", None), getattr(queue, "_metrics_router", None)]
    return [router for router in routers if router is not None]


def _endpoints_of(queue: Any) -> set[int]:
    """The ids of the endpoints of the queue's routers (an app that includes a router copies its
    routes, with the same endpoint functions, in FastAPI before 0.16x)."""
    return {id(route.endpoint) for router in _routers_of(queue) for route in router.routes
            if getattr(route, "endpoint", None) is not None}


def _serves(app: Any, queue: Any, endpoints: set[int]) -> bool:
    router = getattr(app, "router", None)
    if router is None:
        return False
    if _refers_to(getattr(router, "lifespan_context", None), queue, MAX_DEPTH):
        return True
    return _includes(router, {id(r) for r in _routers_of(queue)}, endpoints, MAX_DEPTH)


def _includes(router: Any, routers: set[int], endpoints: set[int], depth: int) -> bool:
    """True when ``router`` has one of the queue's routes, or includes one of its routers (newer
    FastAPI keeps an included router as a route that names it: ``original_router``)."""
    for route in getattr(router, "routes", ()):
        if id(getattr(route, "endpoint", None)) in endpoints:
            return True
        included = getattr(route, "original_router", None)
        if included is not None and (id(included) in routers
                                     or (depth > 0 and _includes(included, routers, endpoints, depth - 1))):
            return True
    return False


def _refers_to(target: Any, queue: Any, depth: int) -> bool:
    """True when ``target`` is a method of ``queue``, or a function whose wrapped function, closure
    or global names lead to ``queue`` within ``depth`` steps."""
    if target is None or depth < 0:
        return False
    if isinstance(target, types.MethodType):
        return target.__self__ is queue
    if isinstance(target, functools.partial):
        return _refers_to(target.func, queue, depth - 1)
    if not isinstance(target, types.FunctionType):
        return False
    names = target.__code__.co_names
    if any(target.__globals__.get(name) is queue for name in names):
        return True
    inner = [getattr(target, "__wrapped__", None)]
    for cell in target.__closure__ or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # (an empty cell)
            continue
    return any(value is queue or _refers_to(value, queue, depth - 1) for value in inner)
