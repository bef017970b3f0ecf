"""Checks the shape of a database URL before any driver sees it, and says what to change without
repeating the URL (it may hold a password)."""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Literal
from urllib.parse import quote, unquote

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
            f"{source} has more than one '@' before its host: a password (or user name) with '@' in it must be "
            "percent-encoded ('@' as %40; urllib.parse.quote(password, safe='') gives it)"
        )
    return scheme.split("+", 1)[0].lower()


DatabaseKind = Literal["postgresql", "sqlite", "mssql"]
"""The databases the library stores in."""

POSTGRES_NEEDS_ASYNCPG = "PostgreSQL needs asyncpg: pip install 'fastapi-workqueue[postgres]'"


def database_kind(url: str) -> DatabaseKind:
    """Which database ``url`` names (``postgres://`` is PostgreSQL), after :func:`database_scheme`'s
    checks; :class:`ConfigurationError` for a scheme the library does not store in, and for
    PostgreSQL when asyncpg (the ``postgres`` extra) is not installed. Both the queue's transport
    and the request sessions' engine check a URL here."""
    scheme = database_scheme(url)
    if scheme in ("postgresql", "postgres"):
        if importlib.util.find_spec("asyncpg") is None:
            raise ConfigurationError(POSTGRES_NEEDS_ASYNCPG)
        return "postgresql"
    if scheme == "sqlite":
        return "sqlite"
    if scheme == "mssql":
        return "mssql"
    raise ConfigurationError(f"database URL scheme {scheme!r} is not supported; use {EXAMPLES}")


_USER_INFO = re.compile(r"(?P<user>[^:/@]*)(?::(?P<password>[^@]*))?@")


def encoded_user_info(rest: str) -> str:
    """A URL's part after ``://`` with its user name and password percent-encoded, read as
    SQLAlchemy reads them (the password runs to the first ``@``, so it may hold ``/``, ``?`` or
    ``#`` unencoded): libpq-style parsers, asyncpg's among them, would end the host at such a
    character and take the password's head for the port."""
    match = _USER_INFO.match(rest)
    if match is None:
        return rest
    user, password = (unquote(match.group("user")), match.group("password"))
    info = quote(user, safe="")
    if password is not None:
        info += ":" + quote(unquote(password), safe="")
    return f"{info}@{rest[match.end():]}"


TLS_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
"""The TLS modes of a PostgreSQL URL, libpq's ``sslmode`` values (asyncpg's ``ssl`` takes the same)."""

LIBPQ_TLS_PARAMETERS = frozenset({
    "sslmode", "sslrootcert", "sslcert", "sslkey", "sslpassword", "sslcrl", "sslnegotiation",
    "ssl_min_protocol_version", "ssl_max_protocol_version",
})
"""The TLS parameters of a libpq-style PostgreSQL URL (``?sslmode=require&sslrootcert=…``)."""


def _query_items(url: str) -> tuple[str, list[tuple[str, str]]]:
    """``url`` before its query, and the query's items as written (each ``key`` and its raw ``key=value``)."""
    base, sep, query = url.partition("?")
    if not sep:
        return url, []
    return base, [(item.partition("=")[0], item) for item in query.split("&") if item]


def _joined(base: str, items: list[tuple[str, str]]) -> str:
    return base + ("?" + "&".join(raw for _, raw in items) if items else "")


def _tls_mode(value: str, spelling: str) -> str:
    mode = value.strip().lower()
    if mode not in TLS_MODES:
        raise ConfigurationError(
            f"the database URL's {spelling}={value!r} is not a TLS mode; use one of {', '.join(TLS_MODES)} "
            "(require for a server that must use TLS, verify-full to check its certificate too)"
        )
    return mode


def libpq_tls(url: str) -> str:
    """A PostgreSQL URL with its TLS mode written as libpq writes it (``sslmode=``), for a driver
    that reads the URL as libpq does (asyncpg's DSN): SQLAlchemy's spelling ``ssl=require`` becomes
    ``sslmode=require``. Both spellings at once must agree."""
    base, items = _query_items(url)
    ssl = [raw.partition("=")[2] for key, raw in items if key == "ssl"]
    if not ssl:
        for key, raw in items:
            if key == "sslmode":
                _tls_mode(raw.partition("=")[2], "sslmode")
        return url
    mode = _tls_mode(ssl[-1], "ssl")
    given = [_tls_mode(raw.partition("=")[2], "sslmode") for key, raw in items if key == "sslmode"]
    if given and given[-1] != mode:
        raise ConfigurationError(
            f"the database URL gives two TLS modes, ssl={ssl[-1]!r} and sslmode={given[-1]!r}; keep one of them"
        )
    kept = [(key, raw) for key, raw in items if key not in ("ssl", "sslmode")]
    return _joined(base, [*kept, ("sslmode", f"sslmode={mode}")])


def split_libpq_tls(url: str) -> tuple[str, str | None]:
    """A PostgreSQL URL for SQLAlchemy's asyncpg dialect, which hands every query parameter to
    ``asyncpg.connect`` as an argument and so refuses libpq's ``sslmode``, ``sslrootcert``, …: the
    URL without them, and a DSN that carries them (``postgresql://?sslmode=require``; asyncpg
    reads it beside the other arguments), or None when the URL has none."""
    base, items = _query_items(libpq_tls(url))
    tls = [(key, raw) for key, raw in items if key in LIBPQ_TLS_PARAMETERS]
    if not tls:
        return url, None
    return _joined(base, [(key, raw) for key, raw in items if key not in LIBPQ_TLS_PARAMETERS]), _joined(
        "postgresql://", tls)


LIBPQ_CLIENT_ONLY = frozenset({
    "keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count", "tcp_user_timeout",
    "gssencmode", "channel_binding", "requiressl", "sslcompression", "sslsni", "requirepeer", "gssdelegation",
    "load_balance_hosts", "hostaddr", "fallback_application_name",
})
"""libpq's parameters that shape its own connection and never reach the server; asyncpg, which
sends every parameter it does not know to the server as a setting, would have the server refuse them."""


def without_client_only(url: str) -> str:
    """A PostgreSQL URL without libpq's client-only parameters (:data:`LIBPQ_CLIENT_ONLY`), its
    ``fallback_application_name`` kept as the ``application_name`` when the URL gives none."""
    base, items = _query_items(url)
    if not any(key in LIBPQ_CLIENT_ONLY for key, _ in items):
        return url
    kept = [(key, raw) for key, raw in items if key not in LIBPQ_CLIENT_ONLY]
    fallback = [raw.partition("=")[2] for key, raw in items if key == "fallback_application_name"]
    if fallback and not any(key == "application_name" for key, _ in kept):
        kept.append(("application_name", f"application_name={fallback[-1]}"))
    return _joined(base, kept)


SQLALCHEMY_ASYNCPG_PARAMETERS = frozenset({"prepared_statement_cache_size", "async_fallback"})
"""Query parameters that SQLAlchemy's asyncpg dialect reads itself (neither asyncpg's nor the server's)."""


def split_for_sqlalchemy(url: str) -> tuple[str, str | None]:
    """A PostgreSQL URL for SQLAlchemy's asyncpg dialect, which hands every query parameter it does
    not know to ``asyncpg.connect`` as an argument (and so refuses ``application_name``, libpq's
    ``sslmode``, …): the URL with only the dialect's own parameters, and a DSN with every other
    one (``postgresql://?application_name=app&sslmode=require``), which asyncpg reads as it reads
    the queue's own URL; None when there is none."""
    base, items = _query_items(libpq_tls(without_client_only(url)))
    rest = [(key, raw) for key, raw in items if key not in SQLALCHEMY_ASYNCPG_PARAMETERS]
    own = [(key, raw) for key, raw in items if key in SQLALCHEMY_ASYNCPG_PARAMETERS]
    return _joined(base, own), (_joined("postgresql://", rest) if rest else None)


def pop_statement_cache_size(url: str) -> tuple[str, int | None]:
    """A PostgreSQL URL without SQLAlchemy's own parameters, and the size its
    ``prepared_statement_cache_size`` gives asyncpg's statement cache (None when it gives none):
    the queue's own connections honour it (0 for a pool that keeps no prepared statements) rather
    than send it to the server as a setting it does not know."""
    base, items = _query_items(url)
    given = [raw.partition("=")[2] for key, raw in items if key == "prepared_statement_cache_size"]
    kept = _joined(base, [(key, raw) for key, raw in items if key not in SQLALCHEMY_ASYNCPG_PARAMETERS])
    if not given:
        return kept, None
    if not (given[-1].isascii() and given[-1].isdigit()):
        raise ConfigurationError(
            f"the database URL's prepared_statement_cache_size={given[-1]!r} is not a whole number; write it as "
            "prepared_statement_cache_size=0 (no prepared statements kept) or a size such as 100"
        )
    return kept, int(given[-1])


def pop_connect_timeout(url: str) -> tuple[str, float | None]:
    """A PostgreSQL URL without libpq's ``connect_timeout`` (seconds), and that timeout (None when
    the URL gives none). asyncpg takes it as an argument, not as a URL parameter: left in, it would
    reach the server as a setting it does not know."""
    base, items = _query_items(url)
    given = [raw.partition("=")[2] for key, raw in items if key == "connect_timeout"]
    if not given:
        return url, None
    try:
        seconds = float(given[-1])
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ConfigurationError(
            f"the database URL's connect_timeout={given[-1]!r} is not a number of seconds above 0; write it as "
            "connect_timeout=10"
        )
    return _joined(base, [(key, raw) for key, raw in items if key != "connect_timeout"]), seconds



FILE_URL_HINT = (
    "set WORKQUEUE_DATABASE_URL to sqlite+aiosqlite:///relative/file.db (in the working directory) or "
    "sqlite+aiosqlite:////absolute/path/file.db"
)


def sqlite_path(url: str) -> str:
    """``sqlite+aiosqlite:///relative.db`` / ``sqlite:////absolute.db`` → a file path."""
    if database_scheme(url) != "sqlite":
        raise ConfigurationError("the database URL is not SQLite; use sqlite+aiosqlite:///path/to/file.db")
    rest = url.partition("://")[2]
    path = rest[1:] if rest.startswith("/") else rest
    # Percent-encoded as SQLAlchemy reads it (%20 a space), so that the request sessions' engine
    # and the queue open one file.
    if "?" in path or "#" in path:
        # (the queue's own connection would open the part before it, in silence: another file)
        raise ConfigurationError(
            "the SQLite URL has a '?' or '#' after its path: the queue takes no parameters there, and a '?' "
            "or '#' in the file's path must be percent-encoded (%3F, %23); " + FILE_URL_HINT
        )
    path = unquote(path)
    if path == ":memory:" or path.startswith("file::memory:"):
        raise ConfigurationError(
            f"SQLite needs a file that every connection and process of the queue shares, not :memory: ({url!r}); "
            + FILE_URL_HINT
        )
    if not path:
        raise ConfigurationError(f"the SQLite URL {url!r} names no file; " + FILE_URL_HINT)
    return path


def sqlite_directory(path: str) -> str:
    """The directory an SQLite file lives in (its path made absolute)."""
    return os.path.dirname(os.path.abspath(path))


def missing_sqlite_directory(path: str) -> ConfigurationError | None:
    """The error for an SQLite file whose directory does not exist (None when it does)."""
    directory = sqlite_directory(path)
    if os.path.isdir(directory):
        return None
    return ConfigurationError(
        f"the directory {directory!r} of the SQLite file {path!r} does not exist; create it, or "
        + FILE_URL_HINT + " in a directory that exists"
    )
