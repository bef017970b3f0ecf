"""A database session per request, committed before the response is sent.

Publishes made while it is open join its transaction: a request that fails publishes nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

current_session: ContextVar[AsyncSession | None] = ContextVar("workqueue_current_session", default=None)
"""The request's session while the session dependency is open; ``queue.publish`` joins it."""


def to_sqlalchemy_url(url: str) -> str:
    """Picks the async driver SQLAlchemy needs when the URL names none."""
    scheme, _, rest = url.partition("://")
    if scheme in ("postgresql", "postgres"):
        return f"postgresql+asyncpg://{rest}"
    if scheme == "sqlite":
        return f"sqlite+aiosqlite://{rest}"
    return url


class RequestSessions:
    """Owns the SQLAlchemy engine for request sessions, created on first use."""

    def __init__(self, url_getter: Any) -> None:
        self._url_getter = url_getter
        self._engine: AsyncEngine | None = None
        self._maker: async_sessionmaker[AsyncSession] | None = None

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            from sqlalchemy.ext.asyncio import create_async_engine

            url = to_sqlalchemy_url(self._url_getter())
            # SQLite: wait for the single writer instead of failing at once.
            options: dict[str, Any] = {"connect_args": {"timeout": 10}} if url.startswith("sqlite") else {}
            self._engine = create_async_engine(url, pool_pre_ping=True, **options)
        return self._engine

    @property
    def sessionmaker(self) -> async_sessionmaker[AsyncSession]:
        if self._maker is None:
            from sqlalchemy.ext.asyncio import async_sessionmaker

            self._maker = async_sessionmaker(self.engine, expire_on_commit=False)
        return self._maker

    async def dispose(self) -> None:
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None
            self._maker = None

    async def dependency(self) -> AsyncIterator[AsyncSession]:
        """Opens a session in a transaction; commits when the endpoint returns, rolls back when it raises."""
        async with self.sessionmaker() as session, session.begin():
            token = current_session.set(session)
            try:
                yield session
            finally:
                current_session.reset(token)
