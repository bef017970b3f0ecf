"""Runs a statement on the caller's SQLAlchemy session, inside the caller's transaction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class SessionExecutor:
    """Executes driver-level SQL on an ``AsyncSession`` or ``AsyncConnection``.

    The session must be bound to the queue's database. Its transaction is joined, never committed
    here: a rollback by the caller publishes nothing.
    """

    def __init__(self, session: Any) -> None:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

        if not isinstance(session, AsyncSession | AsyncConnection):
            raise TypeError(
                f"session must be a SQLAlchemy AsyncSession or AsyncConnection, got {type(session).__name__}"
            )
        self._session = session

    async def connection(self) -> Any:
        from sqlalchemy.ext.asyncio import AsyncSession

        if isinstance(self._session, AsyncSession):
            return await self._session.connection()
        return self._session

    async def fetch(self, sql: str, args: Sequence[Any]) -> list[Mapping[str, Any]]:
        conn = await self.connection()
        result = await conn.exec_driver_sql(sql, tuple(args))
        return list(result.mappings().all())
