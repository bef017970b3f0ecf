"""What ``workqueue work --app MODULE:ATTR`` runs: the app (or the bare WorkQueue) and its lifespan.

``ATTR`` names a FastAPI or Starlette app, or a WorkQueue. With an app, the queue is found on it
(``app.state.queue``, a WorkQueue among the app's state or the module's attributes, or the
``{"workqueue": queue}`` state that ``queue.lifespan`` yields), and the app's lifespan runs through
the ASGI lifespan protocol, as a server runs it, without serving HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigurationError
from ..core.redaction import redacting_logger
from ..core.tasks import TaskScope

if TYPE_CHECKING:
    from ..core.settings import WorkQueueSettings
    from ..queue import WorkQueue

log = redacting_logger("fastapi_workqueue.cli")

POINT_AT_IT = (
    "set app.state.queue = queue in the module, or point --app at the WorkQueue itself (MODULE:queue)"
)


@dataclass(slots=True)
class Target:
    """What ``--app`` named: a queue, an app, or both once the app's queue is found."""

    path: str
    module: ModuleType
    app: Any = None
    queue: Any = None


def load_target(path: str) -> Target:
    """Imports ``MODULE:ATTR`` (from the current directory too); raises ConfigurationError in one line."""
    from ..queue import WorkQueue

    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(
            f"--app {path!r} is not MODULE:ATTR (for example myapp.main:app or myapp.worker:queue)"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ConfigurationError(f"--app {path!r}: there is no module {module_name!r} ({exc})") from exc
        raise _import_failed(path, module_name, exc) from exc
    except Exception as exc:
        raise _import_failed(path, module_name, exc) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigurationError(f"--app {path!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if isinstance(target, WorkQueue):
        return Target(path, module, queue=target)
    if _is_app(target):
        return Target(path, module, app=target, queue=queue_before_start(target, module, path))
    raise ConfigurationError(
        f"--app {path!r} is a {type(target).__name__}, not a FastAPI or Starlette app nor a WorkQueue"
    )


def queue_of_its_own(settings: WorkQueueSettings) -> WorkQueue:
    """A WorkQueue of the command's own, on ``settings`` (its database), for a command that runs
    without an app: the jobs commands, the aws bindings' lookup. The CLI makes queues here and
    only here, as it loads them here (the package's other modules never import ``queue.py``)."""
    from ..queue import WorkQueue

    return WorkQueue(settings)


def _import_failed(path: str, module_name: str, exc: BaseException) -> ConfigurationError:
    text = " ".join(str(exc).split())
    return ConfigurationError(
        f"--app {path!r}: importing {module_name!r} raised {type(exc).__name__}: {text} (--verbose shows the traceback)"
    )


def _is_app(target: Any) -> bool:
    from starlette.applications import Starlette

    return isinstance(target, Starlette)


def _queues_in(values: dict[str, Any], where: str) -> dict[int, tuple[str, Any]]:
    from ..queue import WorkQueue

    return {id(v): (f"{where}{name}", v) for name, v in values.items() if isinstance(v, WorkQueue)}


def queue_before_start(app: Any, module: ModuleType, path: str) -> Any:
    """The app's WorkQueue as far as it can be seen before its lifespan runs, or None.

    ``app.state.queue`` wins; otherwise the one WorkQueue among the app's state and the module's
    attributes. Several of them: a ConfigurationError saying how to point at one."""
    from ..queue import WorkQueue

    pinned = getattr(app.state, "queue", None)
    if isinstance(pinned, WorkQueue):
        return pinned
    found = _queues_in(dict(vars(app.state).get("_state", {})), "app.state.")
    found.update(_queues_in(vars(module), f"{module.__name__}."))
    if len(found) > 1:
        names = ", ".join(sorted(name for name, _ in found.values()))
        raise ConfigurationError(f"--app {path!r}: found several WorkQueues ({names}); {POINT_AT_IT}")
    return next(iter(found.values()))[1] if found else None


def queue_from_lifespan_state(state: dict[str, Any], path: str) -> Any:
    """The WorkQueue the app's lifespan yielded (``{"workqueue": queue}``); ConfigurationError if none or several."""
    found = _queues_in(state, "the lifespan's state ")
    if len(found) == 1:
        return next(iter(found.values()))[1]
    if found:
        names = ", ".join(sorted(name for name, _ in found.values()))
        raise ConfigurationError(f"--app {path!r}: found several WorkQueues ({names}); {POINT_AT_IT}")
    raise ConfigurationError(
        f"--app {path!r}: no WorkQueue found on the app (not in app.state, the module or the state its lifespan "
        f"yields); {POINT_AT_IT}"
    )


class LifespanFailed(Exception):
    """The app's lifespan reported a failure without raising (``lifespan.startup.failed``)."""


@contextlib.asynccontextmanager
async def app_lifespan(app: Any) -> AsyncIterator[dict[str, Any]]:
    """Runs ``app``'s lifespan through the ASGI lifespan protocol, as a server would, and yields
    its state (what the lifespan yielded). Middleware and ``app.state`` behave as under uvicorn.

    An exception of the start-up propagates as it was raised; an app that does not speak the
    lifespan protocol runs without one."""
    state: dict[str, Any] = {}
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": state}
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    started: asyncio.Future[None] = loop.create_future()
    stopped: asyncio.Future[None] = loop.create_future()

    async def receive() -> dict[str, Any]:
        return await inbox.get()

    async def send(message: dict[str, Any]) -> None:
        kind = message.get("type")
        target = started if kind in ("lifespan.startup.complete", "lifespan.startup.failed") else stopped
        if target.done():
            return
        if kind in ("lifespan.startup.failed", "lifespan.shutdown.failed"):
            target.set_exception(LifespanFailed(str(message.get("message") or kind)))
        else:
            target.set_result(None)

    lifespan = TaskScope("workqueue-app-lifespan")
    task = lifespan.spawn(app(scope, receive, send), name="workqueue-app-lifespan", watch=False)
    await inbox.put({"type": "lifespan.startup"})
    await asyncio.wait([started, task], return_when=asyncio.FIRST_COMPLETED)
    if task.done() and not started.done():
        exc = task.exception()
        if exc is not None:
            raise exc
        log.info("the app has no lifespan; running without one")
        yield state
        return
    if started.exception() is not None:
        # Starlette sends startup.failed and then raises the exception itself: prefer that one.
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(task), 5)
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        raise started.exception()  # type: ignore[misc]
    try:
        yield state
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait([stopped, task], return_when=asyncio.FIRST_COMPLETED)
        if stopped.done() and stopped.exception() is not None:
            log.error("the app's lifespan failed at shutdown: %s", stopped.exception())
        await lifespan.close(grace=1.0, finish_within=5.0)
        if task.done() and not task.cancelled():
            task.exception()  # raised at shutdown: logged above through the lifespan's own message
