"""Who may see and do what on the dashboard.

Reading a page needs ``workqueue:read``, an action ``workqueue:operate``, and payloads are shown
only to a principal that also holds ``workqueue:admin``, as over REST. By default the principal is
the API key a person signed in with (:mod:`.session`); an app passes its own ``authorize``
dependency instead (the shape of the REST API's: it takes ``SecurityScopes`` and returns a
``Principal``, raising 401 or 403).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import HTTPException, Request, status
from fastapi.security import SecurityScopes

from ..core.errors import ConfigurationError, TransportError
from ..core.keys import SCOPE_ADMIN, SCOPE_OPERATE, ApiKeyStore, Principal
from ..web.auth import Authorizer, require_scopes, store_unavailable
from .session import SESSION_COOKIE, SessionCodec

if TYPE_CHECKING:
    from ..core.kernel import Kernel


class SignInRequired(Exception):
    """No valid session: the browser is sent to the sign-in page."""


@dataclass(frozen=True, slots=True)
class Viewer:
    """The principal a page is rendered for, and what the page offers it."""

    principal: Principal
    signed_in_here: bool

    @property
    def can_operate(self) -> bool:
        return self.principal.has(SCOPE_OPERATE)

    @property
    def sees_payloads(self) -> bool:
        return self.principal.has(SCOPE_ADMIN)


def key_store(kernel: Kernel) -> ApiKeyStore:
    """The queue's API key store; 501 on a transport that keeps no keys."""
    store = kernel.ports.api_keys
    if store is None:
        raise HTTPException(
            status.HTTP_501_NOT_IMPLEMENTED,
            detail="this transport stores no API keys: pass the app's own authorize dependency to "
            "queue.dashboard(authorize=...)",
        )
    return store


def session_authorizer(kernel: Kernel, codec: SessionCodec) -> Authorizer:
    """The default: the API key a person signed in with, from the session cookie."""

    async def authorize(request: Request, security_scopes: SecurityScopes) -> Principal:
        try:
            principal = await codec.principal(key_store(kernel), request.cookies.get(SESSION_COOKIE))
        except (TransportError, ConfigurationError) as exc:
            # Not signed in yet: the driver's text (hosts, database names) goes to the log only.
            raise store_unavailable(exc) from exc
        if principal is None:
            raise SignInRequired()
        return require_scopes(principal, security_scopes)

    return authorize
