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


CELL_WIDTH = 60
KEEP_END = frozenset({"last_error", "error"})
"""Columns whose end matters most: an error's last line holds its cause, so a long one loses its start."""


def table(rows: Sequence[BaseModel], columns: Sequence[str], *, empty: str = "(none)") -> None:
    """Prints models as a table of the given fields (snake_case names, shown as PascalCase)."""
    if not rows:
        click.echo(empty)
        return
    from ..core.wire import to_wire_name

    headers = [to_wire_name(c) for c in columns]
    cells = [[_cell(getattr(row, c), keep_end=c in KEEP_END) for c in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for r in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _cell(value: Any, *, keep_end: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, list | tuple | set | frozenset):
        return ",".join(str(v) for v in value)
    if hasattr(value, "isoformat"):
        return str(value.isoformat(timespec="seconds"))
    if isinstance(value, dict):
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    elif keep_end:
        lines = [line.strip() for line in str(value).splitlines() if line.strip()]
        text = lines[-1] if lines else ""
        return text if len(text) <= CELL_WIDTH else "..." + text[-(CELL_WIDTH - 3):]
    else:
        text = str(value)
    text = text.replace("\n", " ")
    return text if len(text) <= CELL_WIDTH else text[: CELL_WIDTH - 3] + "..."


def record(row: BaseModel) -> None:
    """Prints one model whole, a field a line (``Name  value``); long text keeps all its lines."""
    from ..core.wire import to_wire_name

    values = row.model_dump(mode="json", by_alias=False)
    width = max(len(to_wire_name(name)) for name in values)
    for name, value in values.items():
        if value is None:
            text = "-"
        elif name == "payload":
            text = json.dumps(value, ensure_ascii=False, indent=2)
        elif isinstance(value, dict | list):
            text = json.dumps(value, ensure_ascii=False)
        else:
            text = str(value)
        first, *rest = text.splitlines() or [""]
        click.echo(f"{to_wire_name(name).ljust(width)}  {first}".rstrip())
        for line in rest:
            click.echo(f"{' ' * width}  {line}".rstrip())
