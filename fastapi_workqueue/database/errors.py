"""Maps driver exceptions to the library's own at the transport boundary."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..core.errors import ConfigurationError, SchemaMissing, TransportError, TransportUnavailable

T = TypeVar("T")

_RETRYABLE_SQLSTATES = {"40001", "40P01", "55P03"}  # serialization, deadlock, lock not available
_PASSING_SQLSTATES = {"57014"}  # query_canceled: a statement_timeout (a lock held long, a slow server) ends
_RESOURCES_SQLSTATES_PREFIX = "53"  # insufficient resources: disk full, out of memory, too many connections
_UNAVAILABLE_SQLSTATES_PREFIX = ("08", "57P")  # connection exceptions, operator intervention
_MISSING_SCHEMA_SQLSTATES = {"3F000", "42883", "42P01"}  # schema, function, table missing
_AUTH_SQLSTATES = {"28000", "28P01"}
_NO_DATABASE_SQLSTATE = "3D000"  # invalid_catalog_name: the database named in the URL does not exist
_OBJECT_IN_USE_SQLSTATE = "55006"  # raised by sync_subscription: a change that live deliveries forbid


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver exception, when it carries one."""
    code = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    if code is None and exc.__cause__ is not None and exc.__cause__ is not exc:
        return sqlstate(exc.__cause__)
    return code if isinstance(code, str) else None


def map_error(exc: BaseException, operation: str) -> Exception:
    """Turns a driver exception into a :class:`TransportError` (or a configuration error)."""
    if isinstance(exc, TransportError | ConfigurationError):
        return exc
    code = sqlstate(exc)
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if code in _AUTH_SQLSTATES:
        return ConfigurationError(
            f"{operation}: the database refused the credentials ({text}); check WORKQUEUE_DATABASE_URL"
        )
    if code == _NO_DATABASE_SQLSTATE:
        return ConfigurationError(
            f"{operation}: {text}; create the database (CREATE DATABASE, as a superuser) or point "
            "WORKQUEUE_DATABASE_URL at one that exists"
        )
    if code == _OBJECT_IN_USE_SQLSTATE:
        return ConfigurationError(f"{operation}: {text}")
    if code == "42501":
        return ConfigurationError(
            f"{operation}: the database role lacks a privilege ({text}); the application's login needs "
            "sql/postgresql/roles/runtime_role.sql, operator actions (replay, discard, pause, resume, prune) "
            "operator_role.sql and API key management admin_role.sql (re-run them after migrations), and "
            "migrations need the schema owner: run them as the owner, not with WORKQUEUE_AUTO_MIGRATE under "
            "the runtime role"
        )
    if code in _MISSING_SCHEMA_SQLSTATES:
        return SchemaMissing(
            f"{operation}: the work queue schema is missing or out of date ({text}); run "
            "`queue.migrate()` (or `workqueue migrate`), or set WORKQUEUE_AUTO_MIGRATE=1"
        )
    if code in _RETRYABLE_SQLSTATES or code in _PASSING_SQLSTATES:
        return TransportError(f"{operation}: {text}", retryable=True)
    if code is not None and code.startswith(_RESOURCES_SQLSTATES_PREFIX) and code != "53400":
        # (53400, configuration_limit_exceeded: temp_file_limit, a limit a retry meets again)
        # (the server lacks room or connections now: a settle given up for it runs the handler again)
        return TransportUnavailable(f"{operation}: the database is short of resources ({text}); retry later")
    if code is not None and (
        code.startswith(_UNAVAILABLE_SQLSTATES_PREFIX)
        # 55000 at connect time: ALTER DATABASE … ALLOW_CONNECTIONS false (maintenance), for a while
        or (code == "55000" and "not currently accepting connections" in text)
    ):
        return TransportUnavailable(f"{operation}: the database is unavailable ({text}); retry later")
    if isinstance(exc, socket.gaierror):
        # A name that does not resolve is most often a typo in the URL, seldom an outage.
        return TransportUnavailable(
            f"{operation}: the database host name does not resolve ({text}); check the host in "
            "WORKQUEUE_DATABASE_URL"
        )
    if isinstance(exc, OSError | ConnectionError | asyncio.TimeoutError) or _is_connection_error(exc):
        return TransportUnavailable(f"{operation}: the database is unavailable ({text}); retry later")
    return TransportError(f"{operation}: {text}")


def _is_connection_error(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name in {
        "ConnectionDoesNotExistError",
        "InterfaceError",
        "InternalClientError",
        "ConnectionFailureError",
        "CannotConnectNowError",
        "TooManyConnectionsError",
        "ClientCannotConnectError",
        "OperationalError",
    }


async def with_retries(
    operation: str,
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int = 3,
    base_delay: float = 0.05,
    first_failure: Exception | None = None,
) -> T:
    """Runs ``call``, retrying deadlocks, serialization failures and dropped connections.

    ``first_failure``: the caller already made the first attempt, which raised this (a hot path
    tries once without this wrapper and hands over only when that fails).
    """
    failure = first_failure
    for attempt in range(1, attempts + 1):
        if failure is None:
            try:
                return await call()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failure = exc
        mapped = map_error(failure, operation)
        if attempt == attempts or not (isinstance(mapped, TransportError) and mapped.retryable):
            if mapped is failure:
                raise failure
            raise mapped from failure
        failure = None
        await asyncio.sleep(base_delay * 2 ** (attempt - 1))
    raise AssertionError("unreachable")
