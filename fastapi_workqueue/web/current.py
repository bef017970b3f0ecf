"""The dependencies that hand a handler's other dependencies the delivery's message and context.

Apart from :mod:`fastapi_workqueue.web.di` because FastAPI reads their ``Request`` annotation from
this module's names: importing Starlette here keeps it out of a worker whose handlers declare no
dependencies.
"""

from __future__ import annotations

import typing
from typing import Any

from starlette.requests import Request

from ..core.context import WorkContext
from ..core.envelope import WorkMessage

__all__ = ["current_context", "current_message"]


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
