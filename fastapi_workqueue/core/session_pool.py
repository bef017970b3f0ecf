"""The size of the request sessions' connection pool: a value the settings build and the web layer
uses (here, so that the settings need nothing of the web layer)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SessionPool:
    """The request sessions' connection pool (``WORKQUEUE_SESSION_POOL_*``)."""

    size: int = 10
    overflow: int = 0
    timeout_seconds: float = 5.0
    pre_ping: bool = False
    sqlite_busy_seconds: float = 30.0
    """SQLite: how long a statement of a request session waits for the file's write lock
    (``WORKQUEUE_SQLITE_BUSY_TIMEOUT_MS``, as the queue's own calls)."""
