"""The ``workqueue`` command (also ``python -m fastapi_workqueue``).

Every command reads the database from ``--database-url`` or ``WORKQUEUE_DATABASE_URL``, prints
a table for people and JSON with ``--json``. ``work`` runs a subscription's handlers from your
app: ``workqueue work --app myapp.queue:queue --subscription orders.email --once``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import click

from ..core.errors import WorkQueueError
from ..core.keys import SCOPES, create_key
from ..core.reports import DeliveryStatus, PartitionCondition
from ..core.settings import DEFAULT_DATABASE_URL
from ..core.words import count
from ..web.operator_view import shown, shown_all
from .aws import export_topology, import_bindings, lambda_policy
from .jobs import jobs, schedules
from .output import emit_json, record, table
from .processes import processes
from .sql_scripts import sql
from .topology import subscriptions, topics

DEFAULT_DATABASE_FILE = DEFAULT_DATABASE_URL.partition(":///")[2]

T = TypeVar("T")

DELIVERY_COLUMNS = ("delivery_id", "message_id", "topic", "partition_key", "attempt", "status")
DELIVERY_TIMES = ("claimed_at", "lease_expires_at", "visible_at")


class Context:
    def __init__(
        self, database_url: str | None, as_json: bool, verbose: bool = False, app_path: str | None = None
    ) -> None:
        self.database_url = database_url
        self.as_json = as_json
        self.verbose = verbose
        self.app_path = app_path

    def url(self) -> str:
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
        if app and ctx.app_path:
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
            click_ctx.find_object(Context).app_path = value  # type: ignore[union-attr]

    return click.option("--app", "app_path", envvar="WORKQUEUE_APP", help=APP_HELP, expose_value=False,
                        callback=set_app)(command)


pass_context = click.make_pass_decorator(Context)


@click.group()
@click.option("--database-url", envvar="WORKQUEUE_DATABASE_URL", help="postgresql+asyncpg://user@host/db")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--verbose", is_flag=True, help="Show the traceback behind an error.")
@click.version_option(package_name="fastapi-workqueue")
@click.pass_context
def cli(click_ctx: click.Context, database_url: str | None, as_json: bool, verbose: bool) -> None:
    """Operate a fastapi-workqueue: publish, inspect, replay, discard, run workers."""
    click_ctx.obj = Context(database_url, as_json, verbose)


@cli.command()
@pass_context
def migrate(ctx: Context) -> None:
    """Apply pending schema migrations (run as the schema owner)."""
    applied = run(ctx, lambda t: t.migrate())
    if ctx.as_json:
        emit_json({"Applied": applied})
    else:
        click.echo("applied: " + ", ".join(applied) if applied else "the schema is up to date")


@cli.command()
@app_option
@click.option("--topic", required=True)
@click.option("--payload", required=True, help="JSON, e.g. '{\"order\": 7}'.")
@click.option("--partition-key")
@click.option("--attribute", "attributes", multiple=True, help="NAME=VALUE, repeatable.")
@click.option("--correlation-id")
@click.option("--count", default=1, show_default=True, type=click.IntRange(1, 100000))
@click.option("--priority", default=0, show_default=True, type=click.IntRange(0, 9), help="0 to 9, higher first.")
@pass_context
def publish(
    ctx: Context, topic: str, payload: str, partition_key: str | None, attributes: tuple[str, ...],
    correlation_id: str | None, count: int, priority: int,
) -> None:
    """Publish a test message (or --count of them, in one call)."""
    from ..core.envelope import PublishRequest, RequestRejected, prepare

    try:
        body = json.loads(payload)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--payload") from exc
    attrs: dict[str, str] = {}
    for item in attributes:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--attribute")
        attrs[name] = value
    try:
        prepared = [
            prepare(PublishRequest(payload=body, partition_key=partition_key, attributes=attrs,
                                   correlation_id=correlation_id, priority=priority))
            for _ in range(count)
        ]
    except RequestRejected as exc:
        raise click.ClickException(exc.error.message) from exc
    results = run(ctx, lambda t: t.publish(topic, prepared), app=True)
    if ctx.as_json:
        emit_json(results)
    else:
        table(results, ["status", "message_id"])
    if any(not r.ok for r in results):
        first = next(r for r in results if not r.ok)
        raise click.ClickException(first.error.message if first.error else first.status.value)


@cli.command()
@app_option
@click.option("--subscription")
@pass_context
def stats(ctx: Context, subscription: str | None) -> None:
    """Deliveries per state, per subscription."""
    from .targets import PASS_APP, database_subscriptions_elsewhere

    async def read(transport: Any) -> tuple[list[Any], set[str]]:
        elsewhere = set() if ctx.app_path else await database_subscriptions_elsewhere(transport)
        return [r for r in await transport.stats(subscription) if r.subscription not in elsewhere], elsewhere

    rows, elsewhere = run(ctx, read, subscription=subscription, app=True)
    if subscription and not rows:
        raise click.ClickException(f"subscription {subscription!r} does not exist")
    if elsewhere:
        click.echo(f"({len(elsewhere)} subscription(s) of aws topics are not listed: {sorted(elsewhere)}; "
                   f"{PASS_APP} to reach them)", err=True)
    if ctx.as_json:
        emit_json(rows)
    else:
        table(rows, ["subscription", "status", "partition_mode", "pending", "claimable", "in_flight",
                     "dead_lettered", "completed", "discarded"])


@cli.command("dead-letters")
@app_option
@click.option("--subscription", required=True)
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 10000))
@click.option("--after", help="Page after this delivery id.")
@click.option("--payload", "include_payload", is_flag=True, help="Include payloads.")
@pass_context
def dead_letters(ctx: Context, subscription: str, limit: int, after: str | None, include_payload: bool) -> None:
    """Dead-lettered deliveries with their reason and last error."""
    rows = shown_all(run(ctx, lambda t: t.list_deliveries(
        subscription, "DeadLettered", limit=limit, after=after, include_payload=include_payload),
        subscription=subscription, app=True))
    if ctx.as_json:
        emit_json(rows)
    else:
        table(rows, [*DELIVERY_COLUMNS[:5], "reason", "last_error", *DELIVERY_TIMES, "settled_at",
                     *(["payload"] if include_payload else [])])


@cli.command()
@app_option
@click.option("--subscription", required=True)
@click.option("--status", "status", default="InFlight", show_default=True,
              type=click.Choice(["Pending", "InFlight", "Completed", "DeadLettered", "Discarded"]))
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 10000))
@click.option("--after", help="Page after this delivery id.")
@click.option("--payload", "include_payload", is_flag=True, help="Include payloads.")
@pass_context
def deliveries(
    ctx: Context, subscription: str, status: DeliveryStatus, limit: int, after: str | None, include_payload: bool
) -> None:
    """Deliveries of one state, oldest first: find the id of a stuck InFlight delivery."""
    rows = shown_all(run(ctx, lambda t: t.list_deliveries(
        subscription, status, limit=limit, after=after, include_payload=include_payload),
        subscription=subscription, app=True))
    if ctx.as_json:
        emit_json(rows)
    else:
        table(rows, [*DELIVERY_COLUMNS, "reason", "last_error", "created_at", *DELIVERY_TIMES,
                     *(["payload"] if include_payload else [])])


@cli.command()
@app_option
@click.argument("delivery_id")
@click.option("--payload", "include_payload", is_flag=True, help="Include the payload.")
@pass_context
def delivery(ctx: Context, delivery_id: str, include_payload: bool) -> None:
    """One delivery whole: state, attempts, lease, progress, reason, last error, timestamps."""
    info = run(ctx, lambda t: t.get_delivery(delivery_id, include_payload=include_payload),
               delivery_id=delivery_id, app=True)
    if info is None:
        raise click.ClickException(f"delivery {delivery_id!r} does not exist")
    if ctx.as_json:
        emit_json(shown(info))
    else:
        record(shown(info))


@cli.command()
@app_option
@click.option("--subscription", required=True)
@click.option("--condition", type=click.Choice(["Blocked", "InFlight", "Idle"]))
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 10000))
@pass_context
def partitions(ctx: Context, subscription: str, condition: PartitionCondition | None, limit: int) -> None:
    """Keys of an Exclusive or Ordered subscription: Blocked, InFlight or Idle."""
    rows = run(ctx, lambda t: t.partitions(subscription, condition, limit=limit), subscription=subscription,
               app=True)
    if ctx.as_json:
        emit_json(rows)
    else:
        table(rows, ["partition_key", "condition", "head_delivery_id", "head_status", "head_attempt",
                     "waiting_items"])


@cli.command()
@app_option
@click.option("--subscription", required=True)
@click.option("--delivery", "delivery_id", required=True)
@click.option("--note", help="What changed (kept on the delivery).")
@pass_context
def replay(ctx: Context, subscription: str, delivery_id: str, note: str | None) -> None:
    """Replay a dead letter: Pending again, same MessageID and Ordered position."""
    _action(ctx, run(ctx, lambda t: t.replay(subscription, delivery_id, note), subscription=subscription,
                     delivery_id=delivery_id, app=True))


@cli.command()
@app_option
@click.option("--subscription", required=True)
@click.option("--delivery", "delivery_id", required=True)
@click.option("--reason", help="Why (kept on the delivery).")
@pass_context
def discard(ctx: Context, subscription: str, delivery_id: str, reason: str | None) -> None:
    """Discard a Pending or DeadLettered delivery, or cancel one that runs."""
    _action(ctx, run(ctx, lambda t: t.discard(subscription, delivery_id, reason), subscription=subscription,
                     delivery_id=delivery_id, app=True))


def _action(ctx: Context, result: Any) -> None:
    if ctx.as_json:
        emit_json(result)
    else:
        extra = " (the handler is told to stop; the delivery is Discarded when it returns)" if (
            result.cancel_requested) else ""
        if getattr(result, "reason", None):
            extra = f": {result.reason}"
        click.echo(f"{result.result}: delivery {result.delivery_id} of {result.subscription}{extra}")
    if not result.ok:
        sys.exit(1)


@cli.command()
@app_option
@click.option("--subscription", required=True)
@pass_context
def backlog(ctx: Context, subscription: str) -> None:
    """Claimable Pending (single flight per key) plus InFlight, for autoscalers."""
    result = run(ctx, lambda t: t.backlog(subscription), subscription=subscription, app=True)
    if result is None:
        raise click.ClickException(f"subscription {subscription!r} does not exist")
    if ctx.as_json:
        emit_json(result)
    else:
        table([result], ["subscription", "claimable", "in_flight", "backlog"])


def _set_status(ctx: Context, subscription: str, status: str) -> None:
    changed = run(ctx, lambda t: t.set_subscription_status(subscription, status), subscription=subscription,
                  app=True)
    if changed is None:
        raise click.ClickException(f"subscription {subscription!r} does not exist")
    if ctx.as_json:
        emit_json({"Subscription": subscription, "Status": status, "Changed": changed})
    else:
        click.echo(f"{subscription}: {status}" + ("" if changed else " (it already was)"))


@cli.command()
@app_option
@click.option("--subscription", required=True)
@pass_context
def pause(ctx: Context, subscription: str) -> None:
    """Stop claiming from a subscription (deliveries still accrue)."""
    _set_status(ctx, subscription, "Paused")


@cli.command()
@app_option
@click.option("--subscription", required=True)
@pass_context
def resume(ctx: Context, subscription: str) -> None:
    """Claim from a paused subscription again."""
    _set_status(ctx, subscription, "Active")


@cli.command("validate-bindings")
@click.option("--transport", type=click.Choice(["database", "aws"]), default="database", show_default=True,
              help="database: the schema and what the store offers; aws: the AWS resources against the topology.")
@click.option("--app", "app_path", envvar="WORKQUEUE_APP", help="aws: MODULE:ATTR of your app or WorkQueue.")
@click.option("--manifest", "manifest_file", metavar="FILE", help="aws: an exported manifest instead of the app's.")
@click.option("--bindings", "bindings_file", metavar="FILE", help="aws: a bindings file instead of the stored ones.")
@click.option("--endpoint-url", envvar="WORKQUEUE_AWS_ENDPOINT_URL", help="aws: a local emulator's URL.")
@pass_context
def validate_bindings(
    ctx: Context, transport: str, app_path: str | None, manifest_file: str | None, bindings_file: str | None,
    endpoint_url: str | None,
) -> None:
    """Check the bindings read-only; exit 1 on an Error."""
    from .aws import print_report, validate_aws

    if transport == "aws":
        report = validate_aws(app_path, manifest_file, bindings_file, endpoint_url)
    else:
        report = run(ctx, lambda t: t.validate_bindings())
    print_report(report, ctx.as_json)


@cli.command()
@app_option
@click.option("--older-than", "older_than", default="7d", show_default=True,
              help="Age of Completed and Discarded deliveries to remove: 3600, 90m, 12h, 7d.")
@pass_context
def prune(ctx: Context, older_than: str) -> None:
    """Remove Completed and Discarded deliveries settled longer ago than --older-than."""
    seconds = parse_duration(older_than)
    removed = run(ctx, lambda t: t.prune(seconds), app=True)
    if ctx.as_json:
        emit_json({"Removed": removed})
    else:
        click.echo(f"removed {count(removed, 'delivery')} settled more than {older_than} ago")


@cli.group("api-keys")
def api_keys() -> None:
    """Create, list and revoke API keys for the REST API."""


@api_keys.command("create")
@click.option("--name", required=True, help="Who or what uses the key.")
@click.option("--scopes", required=True, help=f"Comma-separated: {', '.join(SCOPES)}.")
@click.option("--expires-in", help="Lifetime: 3600, 90m, 12h, 30d.")
@click.option("--topic", "topics", multiple=True,
              help="A topic the key may publish to, or a pattern with * (billing.*); repeat it for more. "
                   "Without it: every topic (a job queue's, jobs.*, with workqueue:jobs only).")
@pass_context
def api_keys_create(ctx: Context, name: str, scopes: str, expires_in: str | None, topics: tuple[str, ...]) -> None:
    """Create a key; it is shown once."""
    wanted = [s.strip() for s in scopes.split(",") if s.strip()]
    expires = datetime.now(UTC) + timedelta(seconds=parse_duration(expires_in)) if expires_in else None
    allowed = [t.strip() for t in topics] if topics else None
    created = run(ctx, lambda t: create_key(t, name, wanted, expires, allowed))
    if ctx.as_json:
        emit_json(created)
    else:
        click.echo(created.key)
        limited = f", topics {', '.join(created.topics)}" if created.topics is not None else ""
        click.echo(f"(key {created.prefix} for {created.name}, scopes {', '.join(created.scopes)}{limited}; "
                   "store it now, it is not shown again)", err=True)


@api_keys.command("list")
@pass_context
def api_keys_list(ctx: Context) -> None:
    """List keys (never their secrets)."""
    keys = run(ctx, lambda t: t.api_key_list())
    if ctx.as_json:
        emit_json(keys)
    else:
        table(keys, ["prefix", "name", "scopes", "topics", "created_at", "expires_at", "revoked_at", "last_used_at"])


@api_keys.command("revoke")
@click.argument("key")
@pass_context
def api_keys_revoke(ctx: Context, key: str) -> None:
    """Revoke a key by its prefix, id or name."""
    count = run(ctx, lambda t: t.api_key_revoke(key))
    if ctx.as_json:
        emit_json({"Revoked": count})
    elif count:
        click.echo(f"revoked {count} key(s)")
    if not count:
        raise click.ClickException(f"no active key matches {key!r}")


def parse_duration(text: str, *, bare_unit: str = "s") -> float:
    """Seconds: ``90m``, ``12h``, ``7d``, ``3600s`` as written; a bare number is in ``bare_unit``
    (``3600`` → 3600 s, or with ``bare_unit="d"``, ``7`` → 7 days)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text) * units[bare_unit]
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a duration (use 3600, 90m, 12h or 7d)") from exc


def _set_json(click_ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        click_ctx.find_object(Context).as_json = True  # type: ignore[union-attr]


def _set_verbose(click_ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        click_ctx.find_object(Context).verbose = True  # type: ignore[union-attr]


def _set_database_url(click_ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:
        click_ctx.find_object(Context).database_url = value  # type: ignore[union-attr]


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


cli.add_command(sql)
cli.add_command(export_topology)
cli.add_command(import_bindings)
cli.add_command(lambda_policy)
cli.add_command(jobs)
cli.add_command(schedules)
cli.add_command(subscriptions)
cli.add_command(processes)
cli.add_command(topics)

for _command in [*cli.commands.values(), *api_keys.commands.values(), *sql.commands.values(),
                 *jobs.commands.values(), *subscriptions.commands.values(), *topics.commands.values()]:
    if not isinstance(_command, click.Group):
        accept_global_options(_command)


def main() -> None:
    """Entry point of the ``workqueue`` command."""
    from .work import work

    if "work" not in cli.commands:
        accept_global_options(work)
        cli.add_command(work)
    cli(prog_name="workqueue")
