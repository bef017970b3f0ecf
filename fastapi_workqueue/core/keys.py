"""API keys: the scopes, how keys look, how they are hashed, and the store that keeps them."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from .wire import WireModel

SCOPE_PUBLISH = "workqueue:publish"
SCOPE_READ = "workqueue:read"
SCOPE_OPERATE = "workqueue:operate"
SCOPE_ADMIN = "workqueue:admin"
SCOPES = (SCOPE_PUBLISH, SCOPE_READ, SCOPE_OPERATE, SCOPE_ADMIN)
"""Scopes are independent: admin adds payloads to listings, it does not imply read or operate."""

KEY_PREFIX = "wq"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling the REST API, and what they may do."""

    name: str
    scopes: frozenset[str] = field(default_factory=frozenset)
    key_id: str | None = None

    def has(self, scope: str) -> bool:
        """True when the principal holds ``scope`` (``workqueue:read`` …)."""
        return scope in self.scopes


class ApiKeyInfo(WireModel):
    """A stored key, without its secret."""

    id: uuid.UUID
    name: str
    prefix: str
    scopes: list[str]
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None


class CreatedApiKey(ApiKeyInfo):
    """A new key: ``key`` is the secret, shown this once."""

    key: str


@dataclass(frozen=True, slots=True)
class StoredKey:
    id: str
    name: str
    key_hash: str
    scopes: tuple[str, ...]


class ApiKeyStore(Protocol):
    """Where keys live (the database transport implements it)."""

    async def api_key_create(
        self, key_id: uuid.UUID, name: str, prefix: str, key_hash: str, scopes: list[str], expires_at: datetime | None
    ) -> None: ...
    async def api_key_lookup(self, prefix: str) -> StoredKey | None: ...
    async def api_key_touch(self, key_id: str) -> None: ...
    async def api_key_list(self) -> list[ApiKeyInfo]: ...
    async def api_key_revoke(self, key: str) -> int: ...


def check_scopes(scopes: list[str]) -> list[str]:
    """Validates scope names; raises ValueError naming the allowed ones."""
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise ValueError(f"unknown or missing scopes {unknown}; use one or more of {', '.join(SCOPES)}")
    return sorted(set(scopes))


def generate_key() -> tuple[str, str]:
    """A new secret key and its public prefix: ``wq_<prefix>_<secret>``."""
    prefix = secrets.token_hex(6)
    return f"{KEY_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}", prefix


def hash_key(key: str) -> str:
    """The stored form of a key: SHA-256 (keys are long random strings, no slow hash is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def prefix_of(key: str) -> str | None:
    """The public prefix of a well-formed key, or None."""
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        return None
    if not (parts[1].isascii() and parts[1].isalnum()):
        return None  # prefixes are hex: anything else (a NUL byte, say) is no key, not a question for the store
    return parts[1]


async def verify_key(store: ApiKeyStore, key: str) -> Principal | None:
    """The principal of a valid, unexpired, unrevoked key; None otherwise."""
    prefix = prefix_of(key)
    if prefix is None:
        return None
    stored = await store.api_key_lookup(prefix)
    if stored is None or not hmac.compare_digest(stored.key_hash, hash_key(key)):
        return None
    await store.api_key_touch(stored.id)  # only a key that proved itself is marked used
    return Principal(name=stored.name, scopes=frozenset(stored.scopes), key_id=stored.id)


async def create_key(
    store: ApiKeyStore, name: str, scopes: list[str], expires_at: datetime | None = None
) -> CreatedApiKey:
    """Creates and stores a key; the returned secret is not stored anywhere."""
    if not name.strip():
        raise ValueError("an API key needs a name (who or what uses it)")
    scopes = check_scopes(scopes)
    key, prefix = generate_key()
    key_id = uuid.uuid4()
    await store.api_key_create(key_id, name, prefix, hash_key(key), scopes, expires_at)
    return CreatedApiKey(
        id=key_id, name=name, prefix=prefix, scopes=scopes, created_at=datetime.now(UTC), expires_at=expires_at,
        key=key,
    )
