"""How the CLI prints: tables for people, JSON for scripts."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from typing import Any

import click
from pydantic import BaseModel

from ..core.processes import Holder


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
"""Text longer than this wraps onto more lines of its cell (whole words; a longer word keeps its
line and widens the column): a table never cuts what it shows."""
KEEP_END = frozenset({"last_error", "error"})
"""Columns of which only the last line is shown: an error's last line holds its cause (``delivery``
and ``--json`` show every line)."""
CUT = frozenset({"payload"})
"""Columns cut at :data:`CELL_WIDTH` instead (a payload may be 256 KiB: ``delivery ID --payload``
and ``--json`` show it whole)."""


def table(rows: Sequence[BaseModel], columns: Sequence[str], *, empty: str = "(none)") -> None:
    """Prints models as a table of the given fields (snake_case names, shown as PascalCase); a long
    cell wraps onto as many lines as it needs, the other cells of its row left blank there."""
    if not rows:
        click.echo(empty)
        return
    from ..core.wire import to_wire_name

    headers = [to_wire_name(c) for c in columns]
    cells = [[_cell(getattr(row, c), keep_end=c in KEEP_END, cut=c in CUT) for c in columns] for row in rows]
    widths = [max(len(h), *(len(line) for r in cells for line in r[i])) for i, h in enumerate(headers)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for r in cells:
        for index in range(max(len(lines) for lines in r)):
            parts = [(lines[index] if index < len(lines) else "").ljust(w) for lines, w in zip(r, widths, strict=True)]
            click.echo("  ".join(parts).rstrip())


def _cell(value: Any, *, keep_end: bool = False, cut: bool = False) -> list[str]:
    """The lines of one cell: the value's text, wrapped at :data:`CELL_WIDTH` (or cut there)."""
    if value is None:
        return ["-"]
    if isinstance(value, Holder):
        return [value.label()]
    if isinstance(value, list | tuple | set | frozenset):
        text = ",".join(str(v) for v in value)
    elif hasattr(value, "isoformat"):
        return [str(value.isoformat(timespec="seconds"))]
    elif isinstance(value, dict):
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    elif keep_end:
        lines = [line.strip() for line in str(value).splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    else:
        text = " ".join(str(value).split())
    if cut:
        text = text.replace("\n", " ")
        return [text if len(text) <= CELL_WIDTH else text[: CELL_WIDTH - 3] + "..."]
    return textwrap.wrap(text, CELL_WIDTH, break_long_words=False, break_on_hyphens=False) or [""]


def record(row: BaseModel) -> None:
    """Prints one model whole, a field a line (``Name  value``); long text keeps all its lines."""
    from ..core.wire import to_wire_name

    values = row.model_dump(mode="json", by_alias=False)
    width = max(len(to_wire_name(name)) for name in values)
    for name, value in values.items():
        raw = getattr(row, name, None)
        if value is None:
            text = "-"
        elif isinstance(raw, Holder):
            text = raw.label()  # (as the tables show it)
        elif isinstance(raw, BaseModel):  # a nested model: its fields as the JSON names them
            text = json.dumps(raw.model_dump(mode="json", by_alias=True), ensure_ascii=False)
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
