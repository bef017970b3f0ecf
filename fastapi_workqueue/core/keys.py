"""API keys: the scopes, how keys look, how they are hashed, and the store that keeps them."""

from __future__ import annotations

import fnmatch
import hashlib
import re
import secrets
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .topology import check_name
from .wire import WireModel

if TYPE_CHECKING:
    from .ports import Ports
    from .transport import Transport

SCOPE_PUBLISH = "workqueue:publish"
SCOPE_JOBS = "workqueue:jobs"
SCOPE_READ = "workqueue:read"
SCOPE_OPERATE = "workqueue:operate"
SCOPE_ADMIN = "workqueue:admin"
SCOPES = (SCOPE_PUBLISH, SCOPE_JOBS, SCOPE_READ, SCOPE_OPERATE, SCOPE_ADMIN)
"""Scopes are independent: admin adds payloads to listings, it does not imply read or operate;
jobs lets a key that may publish reach the job queues' topics (``jobs.*``) too."""

KEY_PREFIX = "wq"
MAX_TOPIC_PATTERNS = 100
"""The most topics (or patterns) one key may be limited to."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling the REST API, and what they may do.

    ``topics``: the topics (names, or patterns where ``*`` stands for any characters) the
    principal may publish to; None for every topic (the job queues' need :data:`SCOPE_JOBS` all
    the same).
    """

    name: str
    scopes: frozenset[str] = field(default_factory=frozenset)
    key_id: str | None = None
    topics: tuple[str, ...] | None = None

    def has(self, scope: str) -> bool:
        """True when the principal holds ``scope`` (``workqueue:read`` …)."""
        return scope in self.scopes

    def may_reach(self, topic: str) -> bool:
        """Whether ``topic`` is one of the principal's topics (every topic when it has no list)."""
        return self.topics is None or any(fnmatch.fnmatchcase(topic, pattern) for pattern in self.topics)


class ApiKeyInfo(WireModel):
    """A stored key, without its secret. ``topics``: the topics it may publish to (None: all)."""

    id: uuid.UUID
    name: str
    prefix: str
    scopes: list[str]
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None
    topics: list[str] | None = None


class CreatedApiKey(ApiKeyInfo):
    """A new key: ``key`` is the secret, shown this once."""

    key: str


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A usable key as the store answers it: never its hash. ``session_generation`` is counted up
    when a person signs out of the dashboard, which ends the sessions made with the key before."""

    id: str
    name: str
    scopes: tuple[str, ...]
    topics: tuple[str, ...] | None = None
    session_generation: int = 0

    def principal(self) -> Principal:
        return Principal(name=self.name, scopes=frozenset(self.scopes), key_id=self.id, topics=self.topics)


@runtime_checkable
class ApiKeyStore(Protocol):
    """Where keys live (the database transport implements it). It hands out no hash: a key is
    checked by :meth:`api_key_verify` with the hash of the key presented."""

    async def api_key_create(
        self, key_id: uuid.UUID, name: str, prefix: str, key_hash: str, scopes: list[str],
        expires_at: datetime | None, topics: list[str] | None = None,
    ) -> None: ...
    async def api_key_verify(self, prefix: str, key_hash: str) -> KeyRecord | None: ...
    async def api_key_session(self, prefix: str) -> KeyRecord | None: ...
    async def api_key_end_sessions(self, key_id: str, session_generation: int) -> None: ...
    async def api_key_touch(self, key_id: str) -> None: ...
    async def api_key_list(self) -> list[ApiKeyInfo]: ...
    async def api_key_revoke(self, key: str) -> int: ...


def check_scopes(scopes: list[str]) -> list[str]:
    """Validates scope names; raises ValueError naming the allowed ones."""
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise ValueError(f"unknown or missing scopes {unknown}; use one or more of {', '.join(SCOPES)}")
    return sorted(set(scopes))


def check_topics(topics: list[str] | None) -> list[str] | None:
    """Validates a key's topic list: topic names, or patterns where ``*`` stands for any
    characters (``billing.*``); raises ValueError saying what to change. None stays None."""
    if topics is None:
        return None
    if not topics:
        raise ValueError("an empty topic list would allow no topic; leave it out to allow every topic")
    if len(topics) > MAX_TOPIC_PATTERNS:
        raise ValueError(f"{len(topics)} topics were given; a key may be limited to at most {MAX_TOPIC_PATTERNS}")
    for pattern in topics:
        try:
            check_name("topic", pattern.replace("*", "x"))
        except ValueError:
            raise ValueError(
                f"topic {pattern!r} is not a topic name or pattern: use 1 to 200 letters, digits, '.', '_', "
                "':' or '-', and '*' for any characters (billing.*)"
            ) from None
    return sorted(set(topics))


_LOOKS_LIKE_A_HANDLE = re.compile(r"[0-9a-fA-F]{12}|[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?"
                                  r"[0-9a-fA-F]{12}|[0-9a-fA-F]{32}")
"""A key's prefix (12 hex digits) or id (a UUID): what ``api-keys revoke`` also takes."""


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


async def check_key(store: ApiKeyStore, key: str) -> KeyRecord | None:
    """The record of a valid, unexpired, unrevoked key; None otherwise. The store compares the
    hash of ``key`` with its own and answers no hash."""
    prefix = prefix_of(key)
    if prefix is None:
        return None
    record = await store.api_key_verify(prefix, hash_key(key))
    if record is None:
        return None
    await store.api_key_touch(record.id)  # only a key that proved itself is marked used
    return record


async def verify_key(store: ApiKeyStore, key: str) -> Principal | None:
    """The principal of a valid, unexpired, unrevoked key; None otherwise."""
    record = await check_key(store, key)
    return None if record is None else record.principal()


def _key_store_of(store: ApiKeyStore | Transport | Ports) -> ApiKeyStore:
    """The store of a queue's API keys: given ``Ports`` (``queue.ports``), their key store;
    otherwise ``store`` itself, or behind a router (a queue with topics on AWS) its database;
    TypeError when it stores no keys."""
    from .ports import Ports, api_key_store_of

    found = store.api_keys if isinstance(store, Ports) else api_key_store_of(store)
    if found is None:
        raise TypeError(f"{type(store).__name__} stores no API keys: they live in the queue's database")
    return found


async def create_key(
    store: ApiKeyStore | Transport | Ports, name: str, scopes: list[str], expires_at: datetime | None = None,
    topics: list[str] | None = None,
) -> CreatedApiKey:
    """Creates and stores a key; the returned secret is not stored anywhere. ``store`` is the key
    store, a queue's ports (``queue.ports``) or its transport (``queue.transport``: behind a router, its
    database keeps the keys).
    ``topics`` limits the topics it may publish to (names or ``*`` patterns); None allows every
    topic but the job queues', which also need :data:`SCOPE_JOBS`."""
    if not name.strip():
        raise ValueError("an API key needs a name (who or what uses it)")
    if _LOOKS_LIKE_A_HANDLE.fullmatch(name.strip()):
        # (`workqueue api-keys revoke X` takes a prefix, an id or a name: this name would also
        # match another key's prefix or id, and revoke both)
        raise ValueError(f"an API key's name cannot read as a key's prefix or id ({name!r}); give it a name that "
                         "says who or what uses it")
    scopes = check_scopes(scopes)
    topics = check_topics(topics)
    keys = _key_store_of(store)
    key, prefix = generate_key()
    key_id = uuid.uuid4()
    await keys.api_key_create(key_id, name, prefix, hash_key(key), scopes, expires_at, topics)
    return CreatedApiKey(
        id=key_id, name=name, prefix=prefix, scopes=scopes, created_at=datetime.now(UTC), expires_at=expires_at,
        key=key, topics=topics,
    )
