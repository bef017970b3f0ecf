"""``queue.session``: the request session as a FastAPI dependency, in both spellings.

``session: AsyncSession = queue.session`` is the dependency itself. FastAPI users also write
``Depends(queue.session)``, which hands FastAPI the dependency as if it were a function: the object
below is callable for that, and its one parameter is the same function-scoped dependency, so both
spellings share one session, committed before the response.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi.params import Depends

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession


class SessionDependency(Depends):
    """A ``Depends`` on the request session that ``Depends(...)`` may wrap once more."""

    def __init__(self, dependency: Callable[[], AsyncIterator[AsyncSession]]) -> None:
        super().__init__(dependency, scope="function")

    def __hash__(self) -> int:
        # (FastAPI caches a dependency's value by the callable: every ``queue.session`` is one key;
        # the lowest FastAPI's ``Depends`` is an unfrozen dataclass, which leaves instances unhashable)
        return hash((SessionDependency, self.dependency))

    @property
    def __signature__(self) -> inspect.Signature:
        # (FastAPI reads the parameters of a callable dependency from its signature: the session,
        # solved by the function-scoped dependency; a plain call, so it may depend on that scope)
        session = inspect.Parameter("session", inspect.Parameter.KEYWORD_ONLY, default=Depends(
            self.dependency, scope="function"), annotation=Any)
        return inspect.Signature([session], return_annotation=Any)

    async def __call__(self, *, session: AsyncSession) -> AsyncSession:
        return session
