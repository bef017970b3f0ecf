"""Forms are protected against cross-site requests twice over: each carries the token of a cookie
that only the dashboard's own pages can read (double submit; the cookie is SameSite=Strict), and a
request whose ``Origin`` (or ``Sec-Fetch-Site``) says it comes from another site is refused.

Kept as it is, on the standard library's ``secrets`` and ``hmac.compare_digest``, rather than signed
with itsdangerous or moved to a CSRF middleware: a double-submit token is a random value compared
with its cookie, with nothing to sign unless it is bound to a session, and the sign-in form has no
session yet, while a dashboard behind the app's own ``authorize`` has no secret shared between its
processes (a token signed by one would be refused by the next). A middleware would do the same
comparison for every route of the app, where these checks guard the dashboard's forms only.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any
from urllib.parse import urlsplit

CSRF_COOKIE = "workqueue_csrf"
CSRF_FIELD = "csrf"


class CsrfRefused(Exception):
    """A form without a valid token, or sent from another site."""


def csrf_token(request: Any) -> tuple[str, bool]:
    """The token the page's forms carry, and whether it is new (and must be set as a cookie)."""
    current = request.cookies.get(CSRF_COOKIE)
    if current and 20 <= len(current) <= 100 and current.isascii():
        return current, False
    return secrets.token_urlsafe(32), True


def check_csrf(request: Any, form: dict[str, str]) -> None:
    """Raises :class:`CsrfRefused` unless the form's token matches the cookie and the request is
    same-origin."""
    if request.headers.get("sec-fetch-site") == "cross-site":
        raise CsrfRefused("the form was sent from another site")
    origin = request.headers.get("origin")
    if origin and origin != "null" and urlsplit(origin).netloc != request.headers.get("host"):
        raise CsrfRefused("the form was sent from another origin")
    cookie = request.cookies.get(CSRF_COOKIE, "")
    sent = form.get(CSRF_FIELD, "")
    if not cookie or not sent or not hmac.compare_digest(cookie.encode(), sent.encode()):
        raise CsrfRefused("the form's token is missing or out of date")
