"""Takes secrets out of text the queue stores or shows: error messages, tracebacks, log lines.

What a handler's exception says is kept as ``last_error`` and shown to anyone with
``workqueue:read``; drivers and HTTP clients like to put credentials into their messages. The
patterns below cover what such messages carry: passwords in URLs, ``Authorization`` and cookie
headers, bearer tokens, JSON web tokens, PEM private keys, the queue's own API keys, and
``name=value`` pairs whose name says secret. :func:`redact` also replaces literal values: those it
is given, and those registered with :func:`register_secrets` (the jobs layer registers the app's
encryption keys there).

The same function serves every place text leaves the process: the stored ``last_error``, the log
records of the package's loggers (:func:`redacting_logger` puts :class:`RedactingFilter` on them)
and the OpenTelemetry spans (status description and exception event).
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Iterable

MASK = "***"

_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s:/@]*:)(?P<secret>\S+)(?=@)")
"""A URL's password: from the ``:`` after the user name to the last ``@`` before a space (a
password may hold ``/``, ``?``, ``#`` or ``@`` unencoded, and readers disagree on which ``@``
ends it, so the longest reading is masked)."""
_AUTH_HEADER = re.compile(
    r"(?P<head>\b(?:proxy-)?authorization\b[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|token|digest)\s+)?)"
    r"(?P<secret>[^\s\"',;]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<head>\bbearer\s+)(?P<secret>[A-Za-z0-9\-._~+/]+=*)", re.IGNORECASE)
_COOKIE = re.compile(r"(?P<head>\b(?:set-)?cookie\b[\"']?\s*[:=]\s*[\"']?)(?P<secret>[^\r\n\"']+)", re.IGNORECASE)
_API_KEY = re.compile(r"(?P<head>\bwq_[0-9a-zA-Z]+_)(?P<secret>[A-Za-z0-9\-_]+)")
_SECRET_NAME = (
    r"\b[\w\-]*(?:password|passwd|pwd|secret|token|api[_\-]?key|apikey|access[_\-]?key|private[_\-]?key"
    r"|app[_\-]?key|credential)s?[\"']?\s*[:=]\s*"
)
_NAMED_SECRET = re.compile(rf"(?P<head>{_SECRET_NAME}[\"']?)(?P<secret>[^\s\"',;&)}}\]]+)", re.IGNORECASE)
_NAMED_SECRET_QUOTED = (
    re.compile(rf"(?P<head>{_SECRET_NAME}\")(?P<secret>[^\"\r\n]+)", re.IGNORECASE),
    re.compile(rf"(?P<head>{_SECRET_NAME}')(?P<secret>[^'\r\n]+)", re.IGNORECASE),
)
"""A quoted value whose name says secret: masked up to its closing quote, spaces and all."""
_PEM_PRIVATE_KEY = re.compile(
    r"(?P<head>-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----)(?P<secret>[\s\S]*?-----END [A-Z0-9 ]*PRIVATE KEY-----)"
)
_JWT = re.compile(r"(?P<head>)(?P<secret>\beyJ[A-Za-z0-9_\-]{4,}\.eyJ[A-Za-z0-9_\-]{4,}\.[A-Za-z0-9_\-]*)")
"""A JSON web token on its own (its header and claims both begin ``{"``, ``eyJ`` in base64url)."""
_PATTERNS = (_PEM_PRIVATE_KEY, _URL_PASSWORD, _AUTH_HEADER, _BEARER, _COOKIE, _API_KEY, *_NAMED_SECRET_QUOTED,
             _NAMED_SECRET, _JWT)
_REGISTERED: set[str] = set()
MIN_SECRET_LENGTH = 4


def register_secrets(values: Iterable[str]) -> None:
    """Values that every later :func:`redact` masks wherever they appear (keys of this process)."""
    _REGISTERED.update(v for v in values if v and len(v) >= MIN_SECRET_LENGTH)


def registered_secrets() -> int:
    """How many literal secrets are registered (a cache of redacted text is keyed by it)."""
    return len(_REGISTERED)


def _mask(match: re.Match[str]) -> str:
    secret = match.group("secret")
    if secret == MASK:
        return match.group(0)
    return match.group("head") + MASK


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with credentials replaced by ``***``; ``secrets`` are literal values to hide too."""
    for value in (*secrets, *_REGISTERED):
        if value and len(value) >= MIN_SECRET_LENGTH:
            text = text.replace(value, MASK)
    for pattern in _PATTERNS:
        text = pattern.sub(_mask, text)
    return text


def redacted_traceback(exc: BaseException) -> str:
    """The whole traceback of ``exc`` (causes included), as Python prints it, redacted."""
    return redact("".join(traceback.format_exception(type(exc), exc, exc.__traceback__))).rstrip("\n")


TRACEBACK_TEXT = "traceback_text"
"""The ``extra`` key of a log record that brings its traceback already rendered."""


class RedactingFilter(logging.Filter):
    """Redacts a log record in place before any handler sees it.

    The message is redacted once formatted (``msg`` and ``args`` are replaced only when that
    changed something, so templates stay intact for grouping). A traceback is formatted here,
    redacted and kept as ``record.exc_text``, which every :class:`logging.Formatter` prints, and
    ``record.exc_info`` is cleared, so no handler formats the raw exception (and its secrets) again.
    A record given ``extra={TRACEBACK_TEXT: text}`` (the queue's own rendering of the traceback, with
    its calling frames folded) shows that text instead.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info:
            exc = record.exc_info[1]
            rendered = getattr(record, TRACEBACK_TEXT, None)
            if isinstance(rendered, str):
                record.exc_text = redact(rendered)
            elif exc is not None and not record.exc_text:
                record.exc_text = redacted_traceback(exc)
            elif record.exc_text:
                record.exc_text = redact(record.exc_text)
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_FILTER = RedactingFilter()


def redacting_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with :class:`RedactingFilter` on it (added once)."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
