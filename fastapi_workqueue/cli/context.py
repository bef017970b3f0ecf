"""What every ``workqueue`` command shares: the context of the call (database URL, ``--json``,
``--verbose``, ``--app``), running an action on the database or the app's queue, and the options
every command takes."""

from __future__ import annotations

import asyncio
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from ..core.errors import WorkQueueError
from ..core.settings import DEFAULT_DATABASE_URL

DEFAULT_DATABASE_FILE = DEFAULT_DATABASE_URL.partition(":///")[2]

T = TypeVar("T")


class Context:
    def __init__(
        self, database_url: str | None, as_json: bool, verbose: bool = False, app_path: str | None = None
    ) -> None:
        self.database_url = database_url
        self.as_json = as_json
        self.verbose = verbose
        self.app_path = app_path
        self.url_given = False
        """``--database-url`` was given on the command line (not read from WORKQUEUE_DATABASE_URL)."""
        self.app_given = False
        """``--app`` was given on the command line (not read from WORKQUEUE_APP)."""

    def acts_on_app(self) -> bool:
        """Whether a command that takes ``--app`` acts on the app's own stores: ``--app`` (or
        WORKQUEUE_APP) is set and no ``--database-url`` on the command line says otherwise. Both on
        the command line name two places to act on: refused, so a change never lands in the other."""
        if not self.app_path:
            return False
        if self.url_given and self.app_given:
            raise click.UsageError(
                "--app and --database-url name two places to act on; pass one of them: --app reaches the "
                "app's own stores (its database, and aws where its topics are), --database-url one database"
            )
        return not self.url_given

    def url(self) -> str:
        if not self.database_url:
            from ..core.settings import misspelt_database_url_problem

            if "WORKQUEUE_DATABASE_URL" in os.environ:  # (set, but empty: as the app refuses it)
                raise click.UsageError(
                    "WORKQUEUE_DATABASE_URL is set, but empty: give it the database URL (for example "
                    "postgresql+asyncpg://postgres@127.0.0.1:5432/app, or sqlite+aiosqlite:///workqueue.db), "
                    "unset it for the default file, or pass --database-url"
                )
            if (problem := misspelt_database_url_problem(
                ": name the variable WORKQUEUE_DATABASE_URL, or pass --database-url"
            )) is not None:  # (as the app refuses: a command must not answer from a file nobody meant)
                raise click.UsageError(problem)
        if not self.database_url and os.path.isfile(DEFAULT_DATABASE_FILE):
            # The library's default database: an app started with nothing configured uses it.
            click.echo(f"(using {DEFAULT_DATABASE_URL}: the default database, found here)", err=True)
            self.database_url = DEFAULT_DATABASE_URL
        if not self.database_url:
            raise click.UsageError(
                "no database: pass --database-url or set WORKQUEUE_DATABASE_URL "
                "(for example postgresql+asyncpg://postgres@127.0.0.1:5432/app, or sqlite+aiosqlite:///workqueue.db "
                "for the embedded default)"
            )
        return self.database_url


def run(
    ctx: Context, action: Callable[[Any], Awaitable[T]], *, subscription: str | None = None,
    delivery_id: str | None = None, app: bool = False,
) -> T:
    """Runs ``action(transport)`` on the database alone, or with ``app`` and ``--app`` given on the
    app's queue (every transport of its topics, :mod:`.targets`). On the database alone, a
    ``subscription`` or ``delivery_id`` of another transport is refused with what to pass."""
    from .targets import on_app, on_database

    async def main() -> T:
        if app and ctx.acts_on_app():
            assert ctx.app_path is not None
            return await on_app(ctx.app_path, action, subscription)
        return await on_database(ctx.url(), action, subscription, delivery_id)

    try:
        return asyncio.run(main())
    except (WorkQueueError, ValueError) as exc:
        if ctx.verbose:
            traceback.print_exception(exc, file=sys.stderr)
        raise click.ClickException(str(exc)) from exc


def app_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--app MODULE:ATTR`` (default ``WORKQUEUE_APP``) of an operator command: it then reaches
    every transport of the app's topics, aws too."""
    from .targets import APP_HELP

    def set_app(click_ctx: click.Context, param: click.Parameter, value: str | None) -> None:
        if value:
            context = click_ctx.find_object(Context)
            assert context is not None
            context.app_path = value
            context.app_given = click_ctx.get_parameter_source("app_path") == ParameterSource.COMMANDLINE

    return click.option("--app", "app_path", envvar="WORKQUEUE_APP", help=APP_HELP, expose_value=False,
                        callback=set_app)(command)


pass_context = click.make_pass_decorator(Context)


MAX_DURATION_SECONDS = 100 * 365 * 86400
"""The longest duration an option takes: 100 years."""


def parse_duration(text: str, *, bare_unit: str = "s", option: str | None = None) -> float:
    """Seconds: ``90m``, ``12h``, ``7d``, ``3600s`` as written; a bare number is in ``bare_unit``
    (``3600`` → 3600 s, or with ``bare_unit="d"``, ``7`` → 7 days). ``option`` names it in errors."""
    hint = f"'{option}'" if option else None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    try:
        seconds = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text) * units[bare_unit]
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a duration (use 3600, 90m, 12h or 7d)", param_hint=hint) from exc
    if not 0 <= seconds <= MAX_DURATION_SECONDS:  # (NaN and infinity too)
        raise click.BadParameter(f"{text!r} is not a duration from 0 to 100 years (use 3600, 90m, 12h or 7d)",
                                 param_hint=hint)
    return seconds


def _set_json(click_ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        click_ctx.find_object(Context).as_json = True  # type: ignore[union-attr]


def _set_verbose(click_ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        click_ctx.find_object(Context).verbose = True  # type: ignore[union-attr]


def _set_database_url(click_ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:
        context = click_ctx.find_object(Context)
        assert context is not None
        context.database_url = value
        context.url_given = True


def accept_global_options(command: click.Command) -> None:
    """Lets ``--json``, ``--verbose`` and ``--database-url`` follow the command's name too:
    ``workqueue stats --json``."""
    names = {name for param in command.params for name in param.opts}
    if "--json" not in names:
        command.params.append(click.Option(
            ["--json"], is_flag=True, expose_value=False, callback=_set_json, help="Print JSON instead of tables.",
        ))
    if "--verbose" not in names:
        command.params.append(click.Option(
            ["--verbose"], is_flag=True, expose_value=False, callback=_set_verbose,
            help="Show the traceback behind an error.",
        ))
    if "--database-url" not in names:
        command.params.append(click.Option(
            ["--database-url"], expose_value=False, callback=_set_database_url,
            help="The database URL (default: WORKQUEUE_DATABASE_URL).",
        ))
