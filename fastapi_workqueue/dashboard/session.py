"""The dashboard's own sign-in: an API key, exchanged for a signed session cookie.

The cookie (HttpOnly, SameSite=Lax, Secure over HTTPS, scoped to the dashboard's path) holds the
key's public prefix, the key's session generation, an expiry and an HMAC of the three, keyed with
a server secret that never sits in the database: ``queue.dashboard(secret=...)``,
``WORKQUEUE_DASHBOARD_SECRET``, or one derived from ``WORKQUEUE_APP_KEY``. Every request checks
the cookie against the store as well: revoking or expiring the API key ends its sessions at once,
and signing out counts the key's session generation up, which ends every cookie issued before.
A cookie claims at most :data:`MAX_SESSION_SECONDS`; one that claims a later expiry is refused
even when its signature holds. The API key itself is never stored in the cookie.

The signature is itsdangerous's (``Signer``, HMAC-SHA256, a key derived from the secret with the
cookie's own salt), replacing a hand-written HMAC. The expiry stays in the signed value rather than
in itsdangerous's timestamp: a ``TimestampSigner`` refuses a cookie stamped ahead of its own clock,
and another process that issued it may run :data:`CLOCK_SKEW_SECONDS` ahead.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:
    from itsdangerous import BadSignature, Signer
except ImportError as exc:  # pragma: no cover - the dashboard extra installs it
    from ..core.errors import missing_extra

    raise missing_extra("the dashboard", "itsdangerous", "dashboard") from exc

from ..core.errors import ConfigurationError
from ..core.keys import ApiKeyStore, KeyRecord, Principal
from ..core.redaction import register_secrets

if TYPE_CHECKING:
    from ..core.settings import WorkQueueSettings

SESSION_COOKIE = "workqueue_dashboard"
DEFAULT_SESSION_SECONDS = 8 * 3600
MAX_SESSION_SECONDS = 12 * 3600
"""The longest session the dashboard issues or accepts."""
CLOCK_SKEW_SECONDS = 60
"""How far ahead of this process's clock another process may have issued a cookie."""
MIN_SECRET_BYTES = 16
_KEY_LABEL = b"fastapi-workqueue dashboard session v2"
NO_SECRET = (
    "the dashboard's sign-in signs its session cookies with a server secret, and none is set: set "
    "WORKQUEUE_DASHBOARD_SECRET (or pass queue.dashboard(secret=...)), at least 16 characters, the same in "
    "every process that serves the dashboard, e.g. from "
    "python -c \"import secrets; print(secrets.token_urlsafe(32))\"; or set WORKQUEUE_APP_KEY, from which "
    "it is derived. An app with its own authentication passes queue.dashboard(authorize=...) instead"
)


def session_key(secret: str | bytes | None, settings: WorkQueueSettings) -> bytes:
    """The secret the session cookies are signed with: from ``secret``, else ``WORKQUEUE_DASHBOARD_SECRET``,
    else ``WORKQUEUE_APP_KEY``; raises ConfigurationError saying what to set when none is."""
    if secret is None and settings.dashboard_secret is not None:
        secret = settings.dashboard_secret.get_secret_value()
    if secret is None and settings.app_key is not None:
        secret = settings.app_key.get_secret_value()
    if isinstance(secret, str):
        register_secrets([secret])  # masked wherever a log or error text would show it
    material = secret.encode() if isinstance(secret, str) else secret
    if not material:
        raise ConfigurationError(NO_SECRET)
    if len(material) < MIN_SECRET_BYTES:
        raise ConfigurationError(
            f"the dashboard's session secret is {len(material)} characters; use at least {MIN_SECRET_BYTES} "
            "random ones (python -c \"import secrets; print(secrets.token_urlsafe(32))\")"
        )
    return material


@dataclass(frozen=True, slots=True)
class Session:
    """What a cookie claims once its signature and expiry hold."""

    prefix: str
    generation: int
    expires: int


@dataclass(frozen=True, slots=True)
class SessionCodec:
    """Issues and checks session cookies, signed with ``key`` (see :func:`session_key`)."""

    key: bytes
    max_age: int = DEFAULT_SESSION_SECONDS
    _signer: Signer = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.max_age <= MAX_SESSION_SECONDS:
            raise ConfigurationError(
                f"session_seconds is {self.max_age}; a dashboard session lasts more than 0 and at most "
                f"{MAX_SESSION_SECONDS} seconds ({MAX_SESSION_SECONDS // 3600} h)"
            )
        signer = Signer(self.key, salt=_KEY_LABEL, sep=".", key_derivation="hmac", digest_method=hashlib.sha256)
        object.__setattr__(self, "_signer", signer)  # (a field of a frozen dataclass, set once here)

    def issue(self, record: KeyRecord, prefix: str, now: float | None = None) -> str:
        """A cookie value for a key that was just verified: ``prefix.generation.expiry.signature``."""
        expires = int((time.time() if now is None else now) + self.max_age)
        return self._signer.sign(f"{prefix}.{record.session_generation}.{expires}").decode()

    def read(self, value: str | None, now: float | None = None) -> Session | None:
        """The session a cookie claims, or None when it is missing, malformed, forged, expired or
        claims to last longer than this codec's lifetime (:data:`MAX_SESSION_SECONDS` at most)."""
        if not value or len(value) > 200 or not value.isascii():
            return None
        try:
            signed = self._signer.unsign(value).decode()
        except BadSignature:
            return None
        parts = signed.split(".")
        if len(parts) != 3 or not parts[0].isalnum():
            return None
        prefix, generation, expires = parts
        if not (f"{generation}{expires}".isascii() and generation.isdigit() and expires.isdigit()):
            return None
        session = Session(prefix=prefix, generation=int(generation), expires=int(expires))
        current = time.time() if now is None else now
        if not current <= session.expires <= current + self.max_age + CLOCK_SKEW_SECONDS:
            return None
        return session

    async def record(self, store: ApiKeyStore, value: str | None, now: float | None = None) -> KeyRecord | None:
        """The key a cookie signs in with, or None when the cookie does not hold (:meth:`read`), or
        its key is revoked or expired now, or it was signed out of (its generation is past)."""
        session = self.read(value, now)
        if session is None:
            return None
        record = await store.api_key_session(session.prefix)
        if record is None or record.session_generation != session.generation:
            return None
        return record

    async def principal(self, store: ApiKeyStore, value: str | None, now: float | None = None) -> Principal | None:
        """Who a cookie signs in, or None (see :meth:`record`)."""
        record = await self.record(store, value, now)
        return None if record is None else record.principal()

    async def end(self, store: ApiKeyStore, value: str | None) -> None:
        """Signs out: the cookie's key gets a new session generation, so this cookie and every
        other one issued with the key before stop working."""
        session = self.read(value)
        if session is None:
            return
        record = await store.api_key_session(session.prefix)
        if record is not None and record.session_generation == session.generation:
            await store.api_key_end_sessions(record.id, session.generation)


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
