"""Counted nouns, durations and guesses for the messages people read: ``1 delivery``, ``2 deliveries``,
``10 min``, "did you mean ..."."""

from __future__ import annotations

from collections.abc import Iterable

_PLURALS = {"delivery": "deliveries"}


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else _PLURALS.get(noun, noun + 's')}"


def duration(seconds: float) -> str:
    """``0.5 s``, ``45 s``, ``10 min``, ``2 h``, ``3 d``."""
    if seconds < 10:
        return f"{round(seconds, 1):g} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate ``name`` most resembles (a typo's "did you mean"), or None."""
    import difflib  # (only for a mistake: a process that makes none never needs it)

    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None
