"""What the queue keeps of a handler's exception: where it was raised, its cause, its type and message.

The text becomes the delivery's ``last_error``, shown by the CLI, the REST API and listings, so an
operator can find the file and line of the fault without the worker's logs. It reads as Python
prints a traceback (causes first, the exception that ended the attempt last, so its last line says
what failed); it is bounded (each exception keeps its innermost frames, which hold the fault) and
passed through :func:`.redaction.redact`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import traceback
from collections.abc import Iterator

from .redaction import redact, registered_secrets

MAX_ERROR_TEXT = 4000
"""The most characters of error text stored per delivery."""
MAX_FRAMES = 8
"""Frames kept per exception of the chain: the innermost ones."""

_VALIDATION_INPUT = re.compile(r"input_value=.*?, input_type=")
"""The input a pydantic validation error quotes (a payload, say): REST shows the stored text to
callers who may not read payloads, so it is left out there."""


def storable(text: str) -> str:
    """``text`` as every store keeps it: a NUL (which PostgreSQL's text refuses) written ``\\x00``,
    a lone surrogate (which no store's UTF-8 encodes) written ``\\udXXX``; other text unchanged."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            text = text.encode("utf-8", "backslashreplace").decode()
    return text


def summary(exc: BaseException) -> str:
    """``Type: message``, as the last line of a traceback says it."""
    return "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n")


def error_text(exc: BaseException, *, limit: int = MAX_ERROR_TEXT) -> str:
    """The traceback of ``exc`` with its causes, redacted and at most ``limit`` characters. When it
    is too long, fewer frames are kept, then only ``Type: message`` (its middle cut out if need be)."""
    text = ""
    for frames in (MAX_FRAMES, 3, 1):
        text = storable(_without_inputs(redact("".join(
            traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-frames)))))
        text = text.rstrip("\n")
        if len(text) <= limit:
            return text
    return _bounded(storable(_without_inputs(redact(summary(exc)))), limit)


def stored_reason(reason: str, *, limit: int = MAX_ERROR_TEXT) -> str:
    """A handler's reason (of a retry, a dead letter, a discard or a work error) as the delivery
    keeps it: redacted, storable and at most ``limit`` characters, its middle cut out if need be.
    Kept for the reasons seen last (a job's release or overlap gives the same few again and again;
    redaction costs some 20 µs), anew once more secrets are registered."""
    return _stored_reason(reason, limit, registered_secrets())


@functools.lru_cache(maxsize=1024)
def _stored_reason(reason: str, limit: int, secrets: int) -> str:
    return _bounded(storable(redact(reason)), limit)


def _bounded(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = (limit - 5) // 2
    return f"{text[:head]} ... {text[-(limit - 5 - head):]}"


def _without_inputs(text: str) -> str:
    """``text`` with the inputs that pydantic's validation errors quote replaced by ``...``."""
    return _VALIDATION_INPUT.sub("input_value=..., input_type=", text) if "input_value=" in text else text


def _library_roots() -> tuple[str, ...]:
    """The folders of the code that calls a handler: this package, FastAPI's and Starlette's
    dependency machinery, and asyncio's task steps (found without importing them)."""
    roots = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    for name in ("fastapi", "starlette", "asyncio", "anyio"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            roots.append(os.path.dirname(os.path.abspath(spec.origin)))
    return tuple(root + os.sep for root in roots)


_ROOTS: tuple[str, ...] | None = None


def _chain(exc: traceback.TracebackException) -> Iterator[traceback.TracebackException]:
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack.extend(e for e in (current.__cause__, current.__context__) if e is not None)


class _Folded(traceback.StackSummary):
    """A stack whose leading frames (the queue's calling code) were left out: says how many."""

    folded = 0

    def format(self) -> list[str]:
        plural = "s" if self.folded != 1 else ""
        return [f"  ({self.folded} frame{plural} of the queue's calling code folded)\n", *super().format()]


def handler_traceback(exc: BaseException) -> str:
    """The traceback of a handler's exception as a log shows it: the frames of the code that called
    the handler (this package, FastAPI's dependency solving, asyncio) before the first frame of the
    user's code are folded into one line, so the user's frames come first. Redacted."""
    global _ROOTS
    if _ROOTS is None:
        _ROOTS = _library_roots()
    roots = _ROOTS
    report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    for part in _chain(report):
        frames = list(part.stack)
        lead = next((i for i, f in enumerate(frames) if not os.path.abspath(f.filename).startswith(roots)), 0)
        if lead:
            stack = _Folded(frames[lead:])
            stack.folded = lead
            part.stack = stack
    return redact("".join(report.format())).rstrip("\n")
