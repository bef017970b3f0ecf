"""The dashboard's own sign-in: an API key, exchanged for a signed session cookie.

The cookie (HttpOnly, SameSite=Lax, Secure over HTTPS, scoped to the dashboard's path) holds the
key's public prefix, an expiry and an HMAC of both. The HMAC's key is derived from the key's stored
SHA-256 (and the app's ``secret``, when it passes one), so a cookie is checked against the store on
every request: any process can check it, with no secret to share between them, and revoking or
expiring the API key ends the sessions made with it at once. The API key itself is never stored in
the cookie.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any

from ..core.keys import ApiKeyStore, Principal, StoredKey

SESSION_COOKIE = "workqueue_dashboard"
DEFAULT_SESSION_SECONDS = 8 * 3600


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@dataclass(frozen=True, slots=True)
class SessionCodec:
    """Issues and checks session cookies."""

    secret: bytes = b""
    max_age: int = DEFAULT_SESSION_SECONDS

    def _signature(self, stored: StoredKey, prefix: str, expires: int) -> str:
        key = hashlib.sha256(b"fastapi-workqueue dashboard session\0" + self.secret + b"\0" + stored.key_hash.encode())
        return _b64(hmac.new(key.digest(), f"{prefix}.{expires}".encode(), hashlib.sha256).digest())

    def issue(self, stored: StoredKey, prefix: str, now: float | None = None) -> str:
        """A cookie value for a key that was just verified."""
        expires = int((time.time() if now is None else now) + self.max_age)
        return f"{prefix}.{expires}.{self._signature(stored, prefix, expires)}"

    async def principal(self, store: ApiKeyStore, value: str | None, now: float | None = None) -> Principal | None:
        """Who a cookie signs in, or None when it is missing, malformed, expired, forged, or made
        with a key that is revoked or expired now."""
        if not value:
            return None
        parts = value.split(".")
        if len(parts) != 3 or not parts[1].isdigit() or not (parts[0].isascii() and parts[0].isalnum()):
            return None
        prefix, expires, signature = parts[0], int(parts[1]), parts[2]
        if expires < (time.time() if now is None else now):
            return None
        stored = await store.api_key_lookup(prefix)
        if stored is None or not hmac.compare_digest(signature, self._signature(stored, prefix, expires)):
            return None
        return Principal(name=stored.name, scopes=frozenset(stored.scopes), key_id=stored.id)


def cookie_options(request: Any, max_age: int | None) -> dict[str, Any]:
    """Where and how the dashboard's cookies are set: its own path, HttpOnly, Secure over HTTPS."""
    return {
        "path": base_path(request) or "/",
        "httponly": True,
        "secure": request.url.scheme == "https",
        "max_age": max_age,
    }


def base_path(request: Any) -> str:
    """The path the dashboard is mounted at (``/work-queue/ui``), without a trailing slash."""
    return str(request.scope.get("root_path", "")).rstrip("/")
