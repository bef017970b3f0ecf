"""The ``workqueue`` command (also ``python -m fastapi_workqueue``).

Every command reads the database from ``--database-url`` or ``WORKQUEUE_DATABASE_URL``, prints
a table for people and JSON with ``--json``. ``work`` runs a subscription's handlers from your
app: ``workqueue work --app myapp.queue:queue --subscription orders.email --once``.
"""

from __future__ import annotations

import importlib

import click
from click.core import ParameterSource

from .context import (
    DEFAULT_DATABASE_FILE,
    Context,
    accept_global_options,
    app_option,
    parse_duration,
    pass_context,
    run,
)

__all__ = [
    "DEFAULT_DATABASE_FILE", "Context", "accept_global_options", "app_option", "cli", "main", "parse_duration",
    "pass_context", "run",
]

COMMANDS: dict[str, str] = {
    "api-keys": "api_keys:api_keys",
    "attempts": "operations:attempts",
    "backlog": "operations:backlog",
    "dead-letters": "operations:dead_letters",
    "deliveries": "operations:deliveries",
    "delivery": "operations:delivery",
    "discard": "operations:discard",
    "export-topology": "aws:export_topology",
    "import-bindings": "aws:import_bindings",
    "jobs": "jobs:jobs",
    "lambda-policy": "aws:lambda_policy",
    "migrate": "operations:migrate",
    "partitions": "operations:partitions",
    "pause": "operations:pause",
    "processes": "processes:processes",
    "prune": "operations:prune",
    "publish": "operations:publish",
    "replay": "operations:replay",
    "resume": "operations:resume",
    "schedules": "jobs:schedules",
    "search": "operations:search",
    "sql": "sql_scripts:sql",
    "stats": "operations:stats",
    "subscriptions": "topology:subscriptions",
    "topics": "topology:topics",
    "validate-bindings": "operations:validate_bindings",
    "work": "work:work",
}
"""Every command by name, as ``module:attribute`` in this package: a command's module is imported
when the command is run or listed, so ``workqueue work`` loads none of the others."""


class LazyGroup(click.Group):
    """A group whose commands (:data:`COMMANDS`) are imported when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, _, attribute = COMMANDS[cmd_name].partition(":")
            command: click.Command = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
            _accept_global_options_everywhere(command)
            self.add_command(command, cmd_name)
        return self.commands.get(cmd_name)


def _accept_global_options_everywhere(command: click.Command) -> None:
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _accept_global_options_everywhere(sub)
    else:
        accept_global_options(command)


@click.group(cls=LazyGroup)
@click.option("--database-url", envvar="WORKQUEUE_DATABASE_URL", help="postgresql+asyncpg://user@host/db")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--verbose", is_flag=True, help="Show the traceback behind an error.")
@click.version_option(package_name="fastapi-workqueue")
@click.pass_context
def cli(click_ctx: click.Context, database_url: str | None, as_json: bool, verbose: bool) -> None:
    """Operate a fastapi-workqueue: publish, inspect, replay, discard, run workers."""
    click_ctx.obj = Context(database_url, as_json, verbose)
    click_ctx.obj.url_given = click_ctx.get_parameter_source("database_url") == ParameterSource.COMMANDLINE
    if click_ctx.invoked_subcommand != "work":  # (`work` starts the app, which refuses or warns itself)
        for problem in environment_problems():
            click.echo(f"warning: {problem}", err=True)


def environment_problems() -> list[str]:
    """What is wrong with the ``WORKQUEUE_*`` variables: names that are no setting, and values an app
    would refuse to start with. An operator command warns of them and goes on (it may be what
    repairs the app), where the app stops."""
    from ..core.errors import ConfigurationError
    from ..core.settings import WorkQueueSettings, unknown_variables

    problems = unknown_variables()
    try:
        WorkQueueSettings()
    except ConfigurationError as exc:
        problems.append(f"{exc}; an app started with these variables would refuse to start")
    return problems


def main() -> None:
    """Entry point of the ``workqueue`` command."""
    cli(prog_name="workqueue")


def every_command() -> click.Group:
    """The ``workqueue`` group with every command loaded (for the docs and their tests)."""
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        cli.get_command(ctx, name)
    return cli
