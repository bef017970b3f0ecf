"""How the CLI prints: tables for people, JSON for scripts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click
from pydantic import BaseModel


def to_jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    return value


def emit_json(value: Any) -> None:
    click.echo(json.dumps(to_jsonable(value), indent=2, ensure_ascii=False))


def table(rows: Sequence[BaseModel], columns: Sequence[str], *, empty: str = "(none)") -> None:
    """Prints models as a table of the given fields (snake_case names, shown as PascalCase)."""
    if not rows:
        click.echo(empty)
        return
    from ..core.wire import to_wire_name

    headers = [to_wire_name(c) for c in columns]
    cells = [[_cell(getattr(row, c)) for c in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for r in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list | tuple | set | frozenset):
        return ",".join(str(v) for v in value)
    if hasattr(value, "isoformat"):
        return str(value.isoformat(timespec="seconds"))
    text = str(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."
