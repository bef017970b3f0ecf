"""The REST API's guard against cross-site request forgery.

An app whose ``authorize`` reads a cookie (a session) is open to another site's page that makes the
browser send a form, or a ``fetch`` without headers of its own, to ``/work-queue/...``: the browser
attaches the cookie and asks the app nothing first. Such a request of a changing method (POST, PUT,
PATCH, DELETE) is refused with 403 when the browser says it comes from another site or origin
(``Sec-Fetch-Site``, else ``Origin``). A request that carries the ``X-API-Key`` header, a bearer
token or a JSON body is not refused here: a browser sends those across sites only after a CORS
preflight that the app's own CORS settings answered. Clients that are not browsers send neither
header and are never refused. (The dashboard's forms carry their own token: :mod:`..dashboard.csrf`.)
"""

# (no `from __future__ import annotations`: the wrapper's annotation names its closure's `authorize`,
# which FastAPI must read as an object, not as text it cannot resolve)

from typing import Annotated
from urllib.parse import urlsplit

from fastapi import HTTPException, Request, Security, status

from ..core.keys import Principal
from .auth import Authorizer

CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
FORM_CONTENT_TYPES = frozenset({"", "application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})
"""The content types a page can send to another site without a preflight (none at all among them)."""

REFUSAL = (
    "a request from another site's page, with the browser's cookies and nothing else to show for "
    "itself, cannot change the work queue (cross-site request forgery); send it from a page of this "
    "app, or with the X-API-Key header, a bearer token or a JSON body (which the app's CORS settings "
    "then allow or refuse)"
)


def from_another_site(request: Request) -> bool:
    """Whether a browser says the request comes from a page of another site or origin."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site not in ("same-origin", "none")
    origin = request.headers.get("origin")
    return origin is not None and (origin == "null" or urlsplit(origin).netloc != request.headers.get("host"))


def sent_without_preflight(request: Request) -> bool:
    """Whether a browser would send this request across sites without asking the app first: no
    header of its own (a Basic authorization is the browser's own), a form's content type or none."""
    headers = request.headers
    if "x-api-key" in headers:
        return False
    authorization = headers.get("authorization")
    if authorization is not None and not authorization.lower().startswith("basic "):
        return False
    return headers.get("content-type", "").partition(";")[0].strip().lower() in FORM_CONTENT_TYPES


def refuse_forgery(request: Request) -> None:
    """Raises 403 for a changing request a page of another site made the browser send (see above)."""
    if request.method in CHANGING_METHODS and from_another_site(request) and sent_without_preflight(request):
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail=REFUSAL)


def same_site_or_preflighted(authorize: Authorizer) -> Authorizer:
    """``authorize``, with :func:`refuse_forgery` checked once it has answered (the route has not
    run yet). The scopes a route asks for reach ``authorize`` as before."""

    async def checked(request: Request, principal: Annotated[Principal, Security(authorize)]) -> Principal:
        refuse_forgery(request)
        return principal

    checked.__name__ = getattr(authorize, "__name__", "authorize")
    return checked
