"""Chooses the database transport from the URL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.database_url import POSTGRES_NEEDS_ASYNCPG, database_kind
from ..core.errors import ConfigurationError

if TYPE_CHECKING:
    from .routines import RoutineTransport


def create_database_transport(
    url: str, *, sqlite_busy_timeout_ms: int | None = None, **options: Any,
) -> RoutineTransport:
    """A transport for ``url``: ``postgresql+asyncpg://…``, ``sqlite+aiosqlite:///file.db`` or
    ``mssql+aioodbc://…`` (aioodbc is imported when the SQL Server transport opens).
    ``sqlite_busy_timeout_ms`` bounds each SQLite operation's wait for the file's write lock.
    ``clock=`` (a :class:`~fastapi_workqueue.core.clock.ManualClock` in tests) is the time claims,
    heartbeats, settles, sweeps and prunes run at, ``rng=`` the source of the retries' jitter;
    the server databases also take ``pool_min_size``, ``pool_max_size``, ``listen`` and
    ``connect_timeout``. Any other option is a TypeError."""
    kind = database_kind(url)
    if kind == "sqlite":
        from .sqlite import SqliteTransport

        if sqlite_busy_timeout_ms is not None:
            options["busy_timeout_ms"] = sqlite_busy_timeout_ms
        return SqliteTransport(url, **options)
    if kind == "postgresql":
        try:
            from .postgres import PostgresTransport
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise ConfigurationError(POSTGRES_NEEDS_ASYNCPG) from exc
        return PostgresTransport(url, **options)
    from .mssql import MssqlTransport

    return MssqlTransport(url, **options)
