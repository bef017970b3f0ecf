"""The dashboard as an ASGI app of its own, which the app mounts: its routes, error pages, static
files and the headers every answer carries."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core.errors import ConfigurationError, TransportError
from ..core.redaction import redact
from ..web.auth import Authorizer
from .access import SignInRequired, session_authorizer
from .actions import build_actions
from .csrf import CsrfRefused
from .forms import FormRefused
from .pages import build_pages
from .render import Dashboard
from .session import DEFAULT_SESSION_SECONDS, MAX_SESSION_SECONDS, SessionCodec, base_path, session_key
from .sign_in import build_sign_in

if TYPE_CHECKING:
    from ..core.kernel import Kernel
    from ..jobs.layer import Jobs

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


class SecurityHeaders:
    """Adds to every answer: a strict Content-Security-Policy (the pages load only the package's own
    script and style sheet), no framing, no sniffing, and no caching of pages."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = str(scope.get("path", "")).startswith(str(scope.get("root_path", "")).rstrip("/") + "/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"cache-control"]
                headers += [
                    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"x-frame-options", b"DENY"),
                    (b"referrer-policy", b"same-origin"),
                    (b"cache-control", b"public, max-age=3600" if static else b"no-store"),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class DashboardSource(Protocol):
    """What the dashboard reads a queue through (a ``WorkQueue`` is one): its kernel, and its jobs
    layer, made when a page first needs it."""

    @property
    def kernel(self) -> Kernel: ...

    @property
    def jobs(self) -> Jobs: ...


def create_dashboard(
    queue: DashboardSource,
    *,
    authorize: Authorizer | None = None,
    secret: str | bytes | None = None,
    session_seconds: int = DEFAULT_SESSION_SECONDS,
    poll_seconds: float = 5.0,
    title: str = "Work queue",
) -> FastAPI:
    """The operator dashboard of ``queue``, an ASGI app to mount in the app that runs the queue:
    ``app.mount("/work-queue/ui", queue.dashboard())``.

    Without ``authorize`` a sign-in page takes an API key (``workqueue api-keys create``) and keeps
    a session cookie for ``session_seconds`` (at most 12 hours), signed with ``secret``, else
    ``WORKQUEUE_DASHBOARD_SECRET``, else a key derived from ``WORKQUEUE_APP_KEY``: without any of
    them it raises ConfigurationError saying what to set. With ``authorize`` (the REST API's shape:
    a dependency that takes ``SecurityScopes`` and returns a ``Principal``, raising 401/403) the app
    decides who is who. Pages poll every ``poll_seconds``.
    """
    if session_seconds <= 0 or poll_seconds <= 0:
        raise ConfigurationError("session_seconds and poll_seconds must be positive")
    if session_seconds > MAX_SESSION_SECONDS:
        raise ConfigurationError(
            f"session_seconds is {session_seconds}; a dashboard session lasts at most {MAX_SESSION_SECONDS} "
            f"seconds ({MAX_SESSION_SECONDS // 3600} h)"
        )
    # With the app's own authorize no session is issued: a random key nobody holds stands in.
    kernel = queue.kernel
    key = session_key(secret, kernel.settings) if authorize is None else secrets.token_bytes(32)
    codec = SessionCodec(key=key, max_age=session_seconds)
    d = Dashboard(kernel=kernel, jobs=lambda: queue.jobs, codec=codec, own_sign_in=authorize is None,
                  poll_seconds=poll_seconds, title=title)
    checked = authorize or session_authorizer(kernel, codec)

    async def queue_is_open() -> None:
        if kernel.health().status == "Stopped":
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE,
                detail="the work queue is not open: mount the dashboard in the app whose lifespan runs "
                "queue.lifespan",
            )

    app = FastAPI(title=title, openapi_url=None, docs_url=None, redoc_url=None,
                  dependencies=[Depends(queue_is_open)])
    app.mount("/static", StaticFiles(packages=[("fastapi_workqueue.dashboard", "static")]), name="static")
    if authorize is None:
        app.include_router(build_sign_in(d))
    app.include_router(build_pages(d, checked))
    app.include_router(build_actions(d, checked))

    def error_page(request: Request, code: int, message: str, headers: dict[str, str] | None = None) -> HTMLResponse:
        response = d.render(request, "error.html", {"code": code, "message": message}, status_code=code)
        for name, value in (headers or {}).items():
            response.headers[name] = value
        return response

    async def on_sign_in_required(request: Request, exc: Exception) -> Response:
        base = base_path(request)
        here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        target = here if request.method == "GET" else base + "/"
        return RedirectResponse(f"{base}/sign-in?{urlencode({'next': target})}", status_code=status.HTTP_303_SEE_OTHER)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_page(request, exc.status_code, str(exc.detail), dict(exc.headers or {}))

    async def on_configuration(request: Request, exc: Exception) -> Response:
        return error_page(request, status.HTTP_500_INTERNAL_SERVER_ERROR, str(exc))

    async def on_csrf(request: Request, exc: Exception) -> Response:
        return error_page(request, status.HTTP_403_FORBIDDEN,
                          f"The form was refused: {exc}. Go back, reload the page and send it again.")

    async def on_form(request: Request, exc: Exception) -> Response:
        return error_page(request, status.HTTP_400_BAD_REQUEST, f"The form was refused: {exc}.")

    async def on_invalid(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return error_page(request, status.HTTP_400_BAD_REQUEST, f"The address is not valid ({problems}).")

    async def on_store_error(request: Request, exc: Exception) -> Response:
        return error_page(request, status.HTTP_503_SERVICE_UNAVAILABLE,
                          f"The queue's store is unavailable: {redact(str(exc))}. The page tries again by itself.",
                          {"Retry-After": "5"})

    handlers: dict[Any, Any] = {
        SignInRequired: on_sign_in_required,
        StarletteHTTPException: on_http_error,
        ConfigurationError: on_configuration,
        CsrfRefused: on_csrf,
        FormRefused: on_form,
        RequestValidationError: on_invalid,
        TransportError: on_store_error,
    }
    for kind, handler in handlers.items():
        app.add_exception_handler(kind, handler)
    app.add_middleware(SecurityHeaders)
    return app
