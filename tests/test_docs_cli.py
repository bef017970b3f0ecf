"""docs/cli.md covers every command and option of ``workqueue``, walked from click's command tree.

Each command has a row of its own in the page's tables (``| `jobs prune [--older-than DAYS] …` |``)
that names each of its options, every spelling included; the options every command takes
(``--json``, ``--verbose``, ``--database-url``) and the group's own (``--version``) are in the
page's opening paragraphs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import click

from fastapi_workqueue import cli as cli_module

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"
EVERY_COMMAND = {"--json", "--verbose", "--database-url"}
"""Options every command takes (cli.accept_global_options), described once, at the top."""


def command_tree() -> click.Group:
    """The ``workqueue`` group with every command loaded (each is imported when first asked for)."""
    return cli_module.every_command()


def commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, click.Command]]:
    """Every command that is not a group, as ``("jobs prune", command)``."""
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


def option_names(command: click.Command) -> set[str]:
    return {name for param in command.params if isinstance(param, click.Option)
            for name in (*param.opts, *param.secondary_opts)}


def rows() -> dict[str, str]:
    """The page's command rows, by command path: ``{"jobs prune": "| `jobs prune [...]` | ... |"}``."""
    found: dict[str, str] = {}
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `([a-z][a-z-]*(?: [a-z][a-z-]*)?)[ `]", line)
        if match:
            assert match[1] not in found, f"two rows for {match[1]!r}"
            found[match[1]] = line
    return found


def test_every_command_has_a_row_and_every_row_a_command() -> None:
    paths = {path for path, _ in commands(command_tree())}
    documented = set(rows())
    assert sorted(paths - documented) == [], "commands missing from docs/cli.md"
    assert sorted(documented - paths) == [], "rows of docs/cli.md for commands that do not exist"


def test_every_option_is_named_in_its_command_row() -> None:
    table = rows()
    missing = [
        f"{path} {option}"
        for path, command in commands(command_tree())
        for option in sorted(option_names(command) - EVERY_COMMAND)
        if not re.search(rf"{re.escape(option)}(?![\w-])", table.get(path, ""))
    ]
    assert missing == []


def test_the_options_of_every_command_and_of_the_group_are_in_the_opening() -> None:
    opening = PAGE.read_text(encoding="utf-8").split("\n### ", 1)[0]
    group = command_tree()
    wanted = option_names(group) | EVERY_COMMAND | {"--help"}
    assert sorted(o for o in wanted if not re.search(rf"{re.escape(o)}(?![\w-])", opening)) == []
    for path, command in commands(group):  # so the opening's word holds for each of them
        assert option_names(command) >= EVERY_COMMAND, path


def test_the_work_options_the_issue_names_are_explained() -> None:
    section = PAGE.read_text(encoding="utf-8").split("## `workqueue work`", 1)[1]
    for option in ("--subscription", "--queue", "--stop-timeout", "--metrics-port", "--metrics-host",
                   "--once", "--max", "--concurrency", "--max-duration-ms", "--shutdown-drain-ms",
                   "--log-level", "--log-format"):
        assert re.search(rf"`{re.escape(option)}[ `]", section), option
