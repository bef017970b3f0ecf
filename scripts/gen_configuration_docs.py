"""Writes the settings tables of docs/configuration.md from ``WorkQueueSettings``.

Every field becomes a row: its variable (``WORKQUEUE_<NAME>``), its type with its bounds, its
default and its meaning (the field's docstring in ``fastapi_workqueue/settings.py``). The tables sit
between two markers; the page's prose around them is kept. ``tests/test_docs_configuration.py``
fails when the committed page differs from what this writes.

    python scripts/gen_configuration_docs.py          # rewrites the page
    python scripts/gen_configuration_docs.py --check  # exit 1 when the page is out of date
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
BEGIN = "<!-- settings: written by scripts/gen_configuration_docs.py from WorkQueueSettings; do not edit -->"
END = "<!-- /settings -->"

GROUPS: list[tuple[str, str]] = [
    ("Jobs", r"^(jobs?_|app_key$|previous_keys$)"),
    ("Metrics and traces", r"^(otel$|prometheus$|metrics_)"),
    ("AWS", r"^aws_"),
]
"""Sections after the first ("The queue and its host"), each with the fields whose names match."""

SEE_ALSO: dict[str, str] = {
    "database_url": "[PostgreSQL](postgresql.md), [SQLite](sqlite.md), [SQL Server](sql-server.md)",
    "subscriptions": "[Concepts](concepts.md#topics-subscriptions-messages-deliveries)",
    "busy_requests": "[Production](production.md#under-load-the-session-pool-where-the-handlers-run-what-to-watch)",
    "session_pool_size": "[Production](production.md#under-load-the-session-pool-where-the-handlers-run-what-to-watch)",
    "jobs_mode": "[Jobs](jobs.md)",
    "app_key": "[Jobs](jobs.md)",
    "otel": "[Observability](observability.md)",
    "prometheus": "[Observability](observability.md)",
    "aws_region": "[AWS](aws.md)",
}
"""A link added to a field's meaning: the page that explains it further."""


def field_docstrings(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of ``cls``'s class body, by field name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    found: dict[str, str] = {}
    for node, following in zip(body.body, [*body.body[1:], None], strict=True):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            found[node.target.id] = following.value.value
    return found


def markdown(docstring: str) -> str:
    """A docstring as one line of Markdown: ``x`` and :role:`x` become `x`."""
    text = " ".join(inspect.cleandoc(docstring).split())
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def type_name(annotation: Any) -> str:
    """``str | None``, ``list[SubscriptionPlan]``, ``"async" | "sync"`` …"""
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(arg) for arg in typing.get_args(annotation))
    if origin in (types.UnionType, typing.Union):
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(arg) for arg in typing.get_args(annotation))}]"
    return str(getattr(annotation, "__name__", annotation))


def bounds(field: FieldInfo) -> str:
    """The field's numeric bounds: ``≥ 1``, ``> 0``, ``0 to 20``."""
    found = {}
    for meta in field.metadata:
        for kind in ("ge", "gt", "le", "lt"):
            if isinstance(meta, getattr(annotated_types, kind.capitalize())):
                found[kind] = getattr(meta, kind)
    if "ge" in found and "le" in found:
        return f"{_number(found['ge'])} to {_number(found['le'])}"
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    return ", ".join(f"{signs[kind]} {_number(value)}" for kind, value in found.items())


def _number(value: float) -> str:
    """An integer written whole (``2147483647``), a fraction as Python writes it short (``0.5``)."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def default_text(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, SecretStr):
        value = value.get_secret_value()  # a default is no secret
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, list | dict | BaseModel):
        return f"`{json.dumps(to_jsonable_python(value, by_alias=False))}`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def cell(text: str) -> str:
    """``text`` in a table cell: its pipes escaped. A pipe inside a code span would show its
    backslash on the site (Python-Markdown), so a docstring that has one is refused."""
    if any("|" in span for span in re.findall(r"`[^`]*`", text)):
        raise SystemExit(f"a settings docstring has a | inside `code`; write it otherwise: {text}")
    return text.replace("|", "\\|")


def type_cell(field: FieldInfo) -> str:
    """``int``, ≥ 1 or ``str`` | ``None``: each type in code, the bars and bounds outside."""
    kind = " | ".join(f"`{part}`" for part in type_name(field.annotation).split(" | "))
    return cell(f"{kind}, {bounds(field)}" if bounds(field) else kind)


def group_of(name: str) -> str:
    for title, pattern in GROUPS:
        if re.search(pattern, name):
            return title
    return "The queue and its host"


def tables() -> str:
    """The settings' sections and tables, as Markdown."""
    from fastapi_workqueue.settings import ENV_PREFIX, WorkQueueSettings

    docs = field_docstrings(WorkQueueSettings)
    undocumented = [name for name in WorkQueueSettings.model_fields if not docs.get(name, "").strip()]
    if undocumented:
        raise SystemExit(f"settings without a docstring in fastapi_workqueue/settings.py: {', '.join(undocumented)}")
    rows: dict[str, list[str]] = {"The queue and its host": [], **{title: [] for title, _ in GROUPS}}
    for name, field in WorkQueueSettings.model_fields.items():
        meaning = markdown(docs[name])
        if name in SEE_ALSO:
            meaning = f"{meaning} See {SEE_ALSO[name]}."
        rows[group_of(name)].append(
            f"| `{ENV_PREFIX}{name.upper()}` | {type_cell(field)} | {cell(default_text(field))} | {cell(meaning)} |"
        )
    out = []
    for title, lines in rows.items():
        if lines:
            out += [f"### {title}", "", "| variable | type | default | meaning |", "|---|---|---|---|", *lines, ""]
    return "\n".join(out).rstrip("\n")


def render(page: str) -> str:
    """``page`` with the text between the markers replaced by the tables of the current settings."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{PAGE} lacks the markers {BEGIN!r} … {END!r}")
    return f"{page[:start]}{BEGIN}\n\n{tables()}\n\n{page[end:]}"


def main(argv: list[str]) -> int:
    current = PAGE.read_text(encoding="utf-8")
    wanted = render(current)
    if "--check" in argv:
        if current != wanted:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/gen_configuration_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        PAGE.write_text(wanted, encoding="utf-8")
        print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))
