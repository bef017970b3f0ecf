"""The sign-in page (an API key for a session cookie) and signing out."""

from __future__ import annotations

from fastapi import APIRouter, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from ..core.errors import ConfigurationError, TransportError
from ..core.keys import SCOPE_READ, check_key, prefix_of
from ..core.redaction import redact, redacting_logger
from .access import key_store
from .csrf import check_csrf
from .forms import local_path, read_form
from .render import Dashboard
from .session import SESSION_COOKIE, base_path, cookie_options

log = redacting_logger("fastapi_workqueue.dashboard")
STORE_AWAY = "The queue's store is unavailable, so the key cannot be checked now; try again in a moment."


def build_sign_in(d: Dashboard) -> APIRouter:
    router = APIRouter()

    def page(
        request: Request, *, error: str | None = None, status_code: int = 200, next_path: str = ""
    ) -> HTMLResponse:
        return d.render(request, "sign_in.html", {"error": error, "next": next_path}, status_code=status_code)

    @router.get("/sign-in", response_class=HTMLResponse)
    async def sign_in_page(request: Request) -> HTMLResponse:
        base = base_path(request)
        return page(request, next_path=local_path(request.query_params.get("next"), base, base + "/"))

    @router.post("/sign-in", response_model=None)
    async def sign_in(request: Request) -> Response:
        form = await read_form(request)
        check_csrf(request, form)
        base = base_path(request)
        next_path = local_path(form.get("next"), base, base + "/")
        key = form.get("api_key", "").strip()
        store = key_store(d.kernel)
        try:
            record = await check_key(store, key) if key else None
        except (TransportError, ConfigurationError) as exc:
            log.warning("cannot check an API key at sign-in: %s", redact(str(exc)))
            away = page(request, error=STORE_AWAY, status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                        next_path=next_path)
            away.headers["Retry-After"] = "5"
            return away
        prefix = prefix_of(key)
        if record is None or prefix is None:
            return page(request, error="That API key is not valid: it is unknown, expired or revoked.",
                        status_code=status.HTTP_401_UNAUTHORIZED, next_path=next_path)
        principal = record.principal()
        if not principal.has(SCOPE_READ):
            return page(request, error=f"The key {principal.name!r} lacks the scope {SCOPE_READ}, which the "
                        "dashboard needs; sign in with a key that holds it.",
                        status_code=status.HTTP_403_FORBIDDEN, next_path=next_path)
        response = RedirectResponse(next_path, status_code=status.HTTP_303_SEE_OTHER)
        response.set_cookie(SESSION_COOKIE, d.codec.issue(record, prefix), samesite="lax",
                            **cookie_options(request, d.codec.max_age))
        return response

    @router.post("/sign-out", response_model=None)
    async def sign_out(request: Request) -> Response:
        """Ends the session on the server too: the key's session generation is counted up, so this
        cookie (and any other made with the key before) no longer signs in, wherever it was copied."""
        form = await read_form(request)
        check_csrf(request, form)
        base = base_path(request)
        try:
            await d.codec.end(key_store(d.kernel), request.cookies.get(SESSION_COOKIE))
        except (TransportError, ConfigurationError) as exc:
            log.warning("cannot end a dashboard session at sign-out: %s", redact(str(exc)))
            return d.render(request, "error.html", {
                "code": status.HTTP_503_SERVICE_UNAVAILABLE,
                "message": "The queue's store is unavailable, so the session cannot be ended now; sign out again "
                           "in a moment.",
            }, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)
        response = RedirectResponse(f"{base}/sign-in", status_code=status.HTTP_303_SEE_OTHER)
        options = cookie_options(request, None)
        response.delete_cookie(SESSION_COOKIE, path=options["path"], secure=options["secure"], httponly=True,
                               samesite="lax")
        return response

    return router
