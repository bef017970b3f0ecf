"""What the queue keeps of a handler's exception: type, message, where it was raised, and its cause.

The text becomes the delivery's ``last_error``, shown by the CLI, the REST API and listings, so an
operator can find the file and line of the fault without the worker's logs. It is bounded (the
innermost frames are kept, as they hold the fault) and passed through :func:`.redaction.redact`.
"""

from __future__ import annotations

import traceback

from .redaction import redact

MAX_ERROR_TEXT = 4000
"""The most characters of error text stored per delivery."""
MAX_FRAMES = 8
"""Frames kept per exception: the innermost ones."""
MAX_CAUSES = 2
"""How many exceptions down the ``raise … from`` / ``during handling`` chain are described."""


def _summary(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _frames(exc: BaseException, keep: int) -> list[str]:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or keep <= 0:
        return []
    shown = frames[-keep:]
    lines = ["Traceback (most recent call last):"]
    if len(frames) > len(shown):
        lines.append(f"  ... {len(frames) - len(shown)} outer frames left out")
    lines.extend(line.rstrip("\n") for line in traceback.format_list(shown))
    return lines


def _cause(exc: BaseException) -> tuple[str, BaseException] | None:
    if exc.__cause__ is not None:
        return "Caused by", exc.__cause__
    if exc.__context__ is not None and not exc.__suppress_context__:
        return "While handling", exc.__context__
    return None


def _describe(exc: BaseException, keep: int) -> str:
    parts = [_summary(exc), *_frames(exc, keep)]
    current, seen = exc, {id(exc)}
    for _ in range(MAX_CAUSES):
        link = _cause(current)
        if link is None or id(link[1]) in seen:
            break
        label, current = link
        seen.add(id(current))
        parts.append(f"{label}: {_summary(current)}")
        parts.extend(_frames(current, min(keep, 3)))
    return "\n".join(parts)


def error_text(exc: BaseException, *, limit: int = MAX_ERROR_TEXT) -> str:
    """``Type: message``, then the innermost frames of the traceback and the cause, redacted and
    at most ``limit`` characters. The first line always says what failed."""
    text = ""
    for keep in (MAX_FRAMES, 3, 1, 0):
        text = redact(_describe(exc, keep))
        if len(text) <= limit:
            return text
    return text[: limit - 3] + "..."
