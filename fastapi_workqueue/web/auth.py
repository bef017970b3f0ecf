"""Who may call the REST API: API keys with scopes, or the app's own dependency.

An authorizer is a FastAPI dependency that takes ``SecurityScopes`` and returns a
:class:`~fastapi_workqueue.core.keys.Principal`, raising 401 without valid credentials and 403
without the scopes the route asks for. The default one checks API keys sent as
``Authorization: Bearer <key>`` or ``X-API-Key: <key>``; an app with OAuth or sessions passes
its own to ``queue.create_router(authorize=...)``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import Depends, HTTPException, status
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer, SecurityScopes

from ..core.errors import ConfigurationError, TransportError
from ..core.keys import Principal, verify_key
from ..core.redaction import redact, redacting_logger

if TYPE_CHECKING:
    from ..core.kernel import Kernel

log = redacting_logger("fastapi_workqueue.web")

Authorizer = Callable[..., Awaitable[Principal]]

_bearer = HTTPBearer(auto_error=False, description="An API key created with `workqueue api-keys create`.")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="The same API key, in a header of its own.")


def require_scopes(principal: Principal, security_scopes: SecurityScopes) -> Principal:
    """Raises 403 naming the scopes ``principal`` lacks."""
    missing = [s for s in security_scopes.scopes if not principal.has(s)]
    if missing:
        raise HTTPException(
            status_code=status.HTTP_403_FORBIDDEN,
            detail=f"this credential lacks the scope {', '.join(missing)}",
        )
    return principal


def api_key_authorizer(kernel: Kernel) -> Authorizer:
    """The default authorizer: API keys stored (hashed) by the queue's transport."""

    async def authorize(
        security_scopes: SecurityScopes,
        bearer: HTTPAuthorizationCredentials | None = Depends(_bearer),
        header_key: str | None = Depends(_header),
    ) -> Principal:
        key = header_key or (bearer.credentials if bearer is not None else None)
        challenge = {"WWW-Authenticate": "Bearer"}
        if not key:
            raise HTTPException(
                status_code=status.HTTP_401_UNAUTHORIZED,
                detail="an API key is required: send Authorization: Bearer <key> or X-API-Key: <key>",
                headers=challenge,
            )
        if not kernel.is_open:
            raise not_open()
        store = kernel.ports.api_keys
        if store is None:
            raise HTTPException(status_code=status.HTTP_501_NOT_IMPLEMENTED, detail="this transport stores no API keys")
        try:
            principal = await verify_key(store, key)
        except (TransportError, ConfigurationError) as exc:
            raise store_unavailable(exc) from exc
        if principal is None:
            raise HTTPException(
                status_code=status.HTTP_401_UNAUTHORIZED,
                detail="the API key is not valid (unknown, expired or revoked)",
                headers=challenge,
            )
        return require_scopes(principal, security_scopes)

    return authorize


def not_open() -> HTTPException:
    """503 for a route of a queue whose app's lifespan has not opened it: retrying will not help."""
    return HTTPException(
        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
        detail="the work queue is not open: include its routers in the app whose lifespan runs queue.lifespan "
        "(FastAPI(lifespan=queue.lifespan); a mounted app's lifespan does not run)",
    )


def store_unavailable(exc: Exception) -> HTTPException:
    """503 for a caller who is not authenticated yet, while the store cannot check credentials
    (unreachable, gone, or refusing the application's role): the driver's text (hosts, database
    names) goes to the log, the answer says only that the store is away."""
    log.warning("cannot check an API key: %s", redact(str(exc)))
    return HTTPException(
        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
        detail="cannot check the API key now: the queue's store is unavailable; retry later",
        headers={"Retry-After": "1"},
    )

