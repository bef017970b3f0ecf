"""Counted nouns for the messages people read: ``1 delivery``, ``2 deliveries``."""

from __future__ import annotations

_PLURALS = {"delivery": "deliveries"}


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else _PLURALS.get(noun, noun + 's')}"
