"""Payloads encrypted at rest with the app key (``encrypted=True``), through ``cryptography``'s
MultiFernet: ``WORKQUEUE_APP_KEY`` encrypts, it and ``WORKQUEUE_PREVIOUS_KEYS`` decrypt, so keys can
be rotated while jobs wait. The plaintext never reaches the database, a listing or an error text.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Sequence
from typing import Any

from ..core.errors import ConfigurationError, missing_extra
from ..core.redaction import register_secrets

GENERATE = 'python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"'
NO_KEY_DECRYPTS = "no key decrypts the job's payload (WORKQUEUE_APP_KEY, WORKQUEUE_PREVIOUS_KEYS)"
DIGEST_LABEL = b"fastapi-workqueue job unique key"


class PayloadUndecryptable(ValueError):
    """No key decrypts the stored payload (or it is not an encrypted payload at all)."""


class PayloadCipher:
    """Encrypts with the current key, decrypts with any of the keys."""

    def __init__(self, current: str, previous: Sequence[str] = ()) -> None:
        try:
            from cryptography.fernet import Fernet, MultiFernet
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise missing_extra("encrypted jobs", "cryptography", "jobs") from exc
        keys = [current, *previous]
        fernets = []
        for index, key in enumerate(keys):
            try:
                fernets.append(Fernet(key.strip().encode()))
            except (ValueError, TypeError):
                which = "WORKQUEUE_APP_KEY" if index == 0 else f"key {index} of WORKQUEUE_PREVIOUS_KEYS"
                raise ConfigurationError(
                    f"{which} is not a Fernet key (32 url-safe base64-encoded bytes); make one with {GENERATE}"
                ) from None
        register_secrets(k.strip() for k in keys)
        self._current = fernets[0]
        self._all = MultiFernet(fernets)
        # A key of its own for digests, derived from each key's bytes (never Fernet's own halves).
        digest_keys = [hmac.new(base64.urlsafe_b64decode(key.strip().encode()), DIGEST_LABEL, hashlib.sha256).digest()
                       for key in keys]
        self._digest_key, self._previous_digest_keys = digest_keys[0], digest_keys[1:]

    def digest(self, text: str) -> str:
        """A keyed hash (HMAC-SHA256, hex) of ``text`` under the current key: equal texts give equal
        digests in every process that has the key, and the text cannot be read back or guessed
        from the digest without it."""
        return hmac.new(self._digest_key, text.encode(), hashlib.sha256).hexdigest()

    def previous_digests(self, text: str) -> list[str]:
        """:meth:`digest` of ``text`` under each previous key (WORKQUEUE_PREVIOUS_KEYS), newest
        first: what a process on an older key wrote before a rotation."""
        return [hmac.new(key, text.encode(), hashlib.sha256).hexdigest() for key in self._previous_digest_keys]

    def encrypt(self, data: Any) -> str:
        """The JSON of ``data``, encrypted with the current key."""
        return self._current.encrypt(json.dumps(data, separators=(",", ":")).encode()).decode("ascii")

    def decrypt(self, token: Any) -> Any:
        from cryptography.fernet import InvalidToken

        if not isinstance(token, str):
            raise PayloadUndecryptable("the job's payload is not encrypted, but the job is declared encrypted=True")
        try:
            return json.loads(self._all.decrypt(token.encode("ascii")))
        except (InvalidToken, ValueError, UnicodeError):
            raise PayloadUndecryptable(NO_KEY_DECRYPTS) from None

    def rotate(self, token: str) -> str:
        """``token`` encrypted with the current key (``workqueue jobs reencrypt``): itself when it
        already is, else decrypted with whichever key does and encrypted again. Raises
        :class:`PayloadUndecryptable` when no key does."""
        from cryptography.fernet import InvalidToken

        try:
            self._current.decrypt(token.encode("ascii"))
            return token
        except InvalidToken:
            pass
        try:
            return self._all.rotate(token.encode("ascii")).decode("ascii")
        except (InvalidToken, ValueError, UnicodeError):
            raise PayloadUndecryptable(NO_KEY_DECRYPTS) from None


def cipher_from(app_key: str | None, previous_keys: str | Sequence[str] | None) -> PayloadCipher | None:
    """The cipher of the settings, or None when no app key is set."""
    if not app_key:
        return None
    if isinstance(previous_keys, str):
        previous = [k for k in (p.strip() for p in previous_keys.split(",")) if k]
    else:
        previous = list(previous_keys or ())
    return PayloadCipher(app_key, previous)
