"""What the queue keeps of a handler's exception: where it was raised, its cause, its type and message.

The text becomes the delivery's ``last_error``, shown by the CLI, the REST API and listings, so an
operator can find the file and line of the fault without the worker's logs. It reads as Python
prints a traceback (causes first, the exception that ended the attempt last, so its last line says
what failed); it is bounded (each exception keeps its innermost frames, which hold the fault) and
passed through :func:`.redaction.redact`.
"""

from __future__ import annotations

import traceback

from .redaction import redact

MAX_ERROR_TEXT = 4000
"""The most characters of error text stored per delivery."""
MAX_FRAMES = 8
"""Frames kept per exception of the chain: the innermost ones."""


def summary(exc: BaseException) -> str:
    """``Type: message``, as the last line of a traceback says it."""
    return "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n")


def error_text(exc: BaseException, *, limit: int = MAX_ERROR_TEXT) -> str:
    """The traceback of ``exc`` with its causes, redacted and at most ``limit`` characters. When it
    is too long, fewer frames are kept, then only ``Type: message`` (its middle cut out if need be)."""
    text = ""
    for frames in (MAX_FRAMES, 3, 1):
        text = redact("".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-frames)))
        text = text.rstrip("\n")
        if len(text) <= limit:
            return text
    text = redact(summary(exc))
    if len(text) <= limit:
        return text
    head = (limit - 5) // 2
    return f"{text[:head]} ... {text[-(limit - 5 - head):]}"
