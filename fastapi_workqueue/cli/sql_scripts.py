"""``workqueue sql``: the SQL scripts the package carries, read from the installed package.

The role scripts (``roles/runtime_role.sql`` …) are run by hand, as the schema owner; a wheel
carries them in ``fastapi_workqueue/_sql`` and :mod:`fastapi_workqueue.database.sql_files` finds
them there (or in a checkout's ``sql/``), so ``workqueue sql print`` works from any install.
"""

from __future__ import annotations

import re
from typing import Any

import click

from .output import emit_json


@click.group("sql")
def sql() -> None:
    """The SQL scripts the package carries (role scripts to run as the schema owner)."""


DIALECTS = ("postgresql", "mssql", "sqlite")
_MIGRATION_FILE = re.compile(r"^\d{4}_[a-z0-9_]+\.sql$")


def scripts(dialect: str) -> list[str]:
    """The SQL files of a dialect other than its numbered migrations, as ``/``-separated paths
    (``roles/runtime_role.sql`` …), sorted; read from the package (importlib.resources)."""
    from ..database.sql_files import dialect_dir

    found: list[str] = []

    def visit(node: Any, prefix: str) -> None:
        for entry in node.iterdir():
            if entry.is_dir():
                visit(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(".sql") and not (prefix == "" and _MIGRATION_FILE.match(entry.name)):
                found.append(f"{prefix}{entry.name}")

    root = dialect_dir(dialect)
    if root.is_dir():
        visit(root, "")
    return sorted(found)


@sql.command("list")
@click.pass_obj
def sql_list(ctx: Any) -> None:
    """List the scripts of every dialect (the migrations themselves run with `migrate`)."""
    found = [{"Dialect": dialect, "Path": path} for dialect in DIALECTS for path in scripts(dialect)]
    if ctx.as_json:
        emit_json(found)
        return
    width = max([len("Dialect"), *(len(f["Dialect"]) for f in found)])
    click.echo(f"{'Dialect'.ljust(width)}  Path")
    for entry in found:
        click.echo(f"{entry['Dialect'].ljust(width)}  {entry['Path']}")


@sql.command("print")
@click.argument("path")
@click.option("--dialect", default="postgresql", show_default=True, type=click.Choice(DIALECTS))
@click.pass_obj
def sql_print(ctx: Any, path: str, dialect: str) -> None:
    """Print one script, e.g. `workqueue sql print roles/runtime_role.sql | psql ...`."""
    from ..database.sql_files import read

    known = scripts(dialect)
    if path not in known:
        raise click.ClickException(
            f"{dialect} has no script {path!r}; it has: {', '.join(known) or 'none'} (`workqueue sql list`)"
        )
    text = read(dialect, *path.split("/"))
    if ctx.as_json:
        emit_json({"Dialect": dialect, "Path": path, "SQL": text})
    else:
        click.echo(text, nl=False)
