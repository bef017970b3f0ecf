"""Checks the shape of a database URL before any driver sees it, and says what to change without
repeating the URL (it may hold a password)."""

from __future__ import annotations

import re

from .errors import ConfigurationError

EXAMPLES = (
    "postgresql+asyncpg://user:password@host:5432/db, sqlite+aiosqlite:///path/to/file.db or "
    "mssql+aioodbc://user:password@host/db?driver=ODBC+Driver+18+for+SQL+Server"
)

_HEAD = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")
_KNOWN_HEAD = re.compile(r"(?:postgresql|postgres|sqlite|mssql)(?:\+[a-z0-9]+)?", re.IGNORECASE)
"""What an error may repeat of a URL's start: a scheme the library knows (anything else may be a secret)."""


def database_scheme(url: str, *, source: str = "the database URL") -> str:
    """The base scheme of ``url`` (``postgresql``, ``sqlite``, ``mssql``: the part before ``+``,
    lower case), after checking that the URL can be read: ``scheme://`` first, and at most one
    ``@`` before the host (a password with ``@`` in it must be percent-encoded). Raises
    :class:`ConfigurationError` naming ``source`` and what to change."""
    scheme, sep, rest = url.partition("://")
    if not sep or not _HEAD.fullmatch(scheme):
        head = _KNOWN_HEAD.match(url)
        begins = f" (it begins {head.group(0)!r})" if head else ""
        raise ConfigurationError(
            f"{source} does not start with a scheme and '://'{begins}; write it as {EXAMPLES}"
        )
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if authority.count("@") > 1:
        raise ConfigurationError(
            f"{source} has more than one '@' before its host: a password (or user name) with '@', ':', '/', "
            "'?' or '#' in it must be percent-encoded ('@' as %40; urllib.parse.quote(password, safe='') gives it)"
        )
    return scheme.split("+", 1)[0].lower()
