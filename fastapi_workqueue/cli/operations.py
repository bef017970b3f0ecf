"""The operator's commands on the store: migrate, publish, stats, deliveries, a delivery and its
attempts, search, dead letters, partitions, replay, discard, backlog, pause, resume,
validate-bindings and prune."""

from __future__ import annotations

import json
import sys
import uuid
from datetime import datetime
from typing import Any

import click
from pydantic import BaseModel

from ..core.reports import DeliveryStatus, PartitionCondition
from ..core.words import count
from ..web.operator_view import found_deliveries, kept_attempts, shown, shown_all
from .context import Context, app_option, parse_duration, pass_context, run
from .output import emit_json, record, table

DELIVERY_COLUMNS = ("delivery_id", "message_id", "topic", "partition_key", "attempt", "status")
DELIVERY_TIMES = ("claimed_at", "lease_expires_at", "visible_at")


@click.command()
@pass_context
def migrate(ctx: Context) -> None:
    """Apply pending schema migrations (run as the schema owner)."""
    applied = run(ctx, lambda t: t.migrate())
    if ctx.as_json:
        emit_json({"Applied": applied})
    else:
        click.echo("applied: " + ", ".join(applied) if applied else "the schema is up to date")


@click.command()
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
    from ..core.envelope import PublishRequest, RequestRejected, named_as_given, prepare

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
    async def publish_prepared(transport: Any) -> list[Any]:
        return named_as_given(await transport.publish(topic, prepared), prepared)

    results = run(ctx, publish_prepared, app=True)
    if ctx.as_json:
        emit_json(results)
    else:
        table(results, ["status", "message_id"])
    if any(not r.ok for r in results):
        first = next(r for r in results if not r.ok)
        message = first.error.message if first.error else first.status.value
        if first.error is not None and first.error.code == "UnknownTopic" and ctx.acts_on_app():
            # (--app syncs no topology: a topic the app declares is in the store once the app has started)
            message += ("; a topic the app declares is written to the store when the app, or `workqueue work "
                        "--app`, starts: start it once, then publish")
        raise click.ClickException(message)


@click.command()
@app_option
@click.option("--subscription")
@pass_context
def stats(ctx: Context, subscription: str | None) -> None:
    """Deliveries per state, per subscription."""
    from .targets import PASS_APP, database_subscriptions_elsewhere

    async def read(transport: Any) -> tuple[list[Any], set[str]]:
        elsewhere = set() if ctx.acts_on_app() else await database_subscriptions_elsewhere(transport, ctx.url())
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
                     "dead_lettered", "completed", "discarded", "oldest_pending_at"])


@click.command("dead-letters")
@app_option
@click.option("--subscription", required=True)
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 10000))
@click.option("--after", callback=lambda _c, _p, v: _cursor(v), help="Page after this delivery id.")
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


@click.command()
@app_option
@click.option("--subscription", required=True)
@click.option("--status", "status", default="InFlight", show_default=True,
              type=click.Choice(["Pending", "InFlight", "Completed", "DeadLettered", "Discarded"]))
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 10000))
@click.option("--after", callback=lambda _c, _p, v: _cursor(v), help="Page after this delivery id.")
@click.option("--payload", "include_payload", is_flag=True, help="Include payloads.")
@pass_context
def deliveries(
    ctx: Context, subscription: str, status: DeliveryStatus, limit: int, after: str | None, include_payload: bool
) -> None:
    """Deliveries of one state, oldest first: find the id of a stuck InFlight delivery."""
    from .targets import held_elsewhere_note

    note: list[str] = []

    async def listing(transport: Any) -> list[Any]:
        found = await transport.list_deliveries(subscription, status, limit=limit, after=after,
                                                include_payload=include_payload)
        if status == "InFlight" and not found and after is None:
            note.extend(await held_elsewhere_note(transport, subscription))
        return list(found)

    rows = shown_all(run(ctx, listing, subscription=subscription, app=True))
    for line in note:
        click.echo(line, err=True)
    if ctx.as_json:
        emit_json(rows)
    else:
        table(rows, [*DELIVERY_COLUMNS, *(["holder"] if status == "InFlight" else []), "reason", "last_error",
                     "created_at", *DELIVERY_TIMES, *(["payload"] if include_payload else [])])


@click.command()
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


@click.command()
@app_option
@click.argument("delivery_id")
@pass_context
def attempts(ctx: Context, delivery_id: str) -> None:
    """A delivery's kept attempts, oldest first: those that did not simply complete (failed,
    dead-lettered, discarded, lease expired, replayed), each with its reason and error."""
    from ..core.attempts import AttemptInfo
    from ..core.ports import Ports

    async def read(transport: Any) -> list[AttemptInfo]:
        if await transport.get_delivery(delivery_id) is None:
            raise click.ClickException(f"delivery {delivery_id!r} does not exist")
        kept = await kept_attempts(Ports.of(transport), delivery_id)
        if kept is None:
            raise click.ClickException(f"the transport of delivery {delivery_id!r} keeps no attempt history")
        return kept

    rows = run(ctx, read, delivery_id=delivery_id, app=True)
    if ctx.as_json:
        emit_json(rows)
    else:
        table(rows, ["attempt", "outcome", "started_at", "ended_at", "reason", "error"],
              empty="(none: no attempt of it failed, expired, or was dead-lettered, discarded or replayed)")


@click.command()
@app_option
@click.argument("query")
@click.option("--limit", default=25, show_default=True, type=click.IntRange(1, 100))
@pass_context
def search(ctx: Context, query: str, limit: int) -> None:
    """The deliveries whose id, MessageID, partition key, correlation ID or job name is QUERY
    (exactly), newest first."""
    from ..core.ports import Ports
    from ..core.search import FoundDelivery

    async def find(transport: Any) -> list[FoundDelivery]:
        found = await found_deliveries(Ports.of(transport), query, limit)
        if found is None:
            raise click.ClickException("this transport cannot search")
        return found

    found = run(ctx, find, app=True)
    if ctx.as_json:
        emit_json(found)
        return
    rows = [_FoundRow(matched=f.matched, **f.delivery.model_dump(include=set(_FoundRow.model_fields), by_alias=False))
            for f in found]
    table(rows, list(_FoundRow.model_fields), empty=f"nothing matches {query!r}")


class _FoundRow(BaseModel):
    """A row of ``search``'s table: what matched, and the delivery."""

    matched: str
    subscription: str
    delivery_id: str
    message_id: uuid.UUID
    topic: str | None
    partition_key: str | None
    status: str
    attempt: int
    created_at: datetime | None


@click.command()
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


@click.command()
@app_option
@click.option("--subscription", required=True)
@click.option("--delivery", "delivery_id", required=True)
@click.option("--note", help="What changed (kept on the delivery).")
@pass_context
def replay(ctx: Context, subscription: str, delivery_id: str, note: str | None) -> None:
    """Replay a dead letter: Pending again, same MessageID and Ordered position."""
    text = _operator_text(note, "--note")
    _action(ctx, run(ctx, lambda t: t.replay(subscription, delivery_id, text), subscription=subscription,
                     delivery_id=delivery_id, app=True))


@click.command()
@app_option
@click.option("--subscription", required=True)
@click.option("--delivery", "delivery_id", required=True)
@click.option("--reason", help="Why (kept on the delivery).")
@pass_context
def discard(ctx: Context, subscription: str, delivery_id: str, reason: str | None) -> None:
    """Discard a Pending or DeadLettered delivery, or cancel one that runs."""
    text = _operator_text(reason, "--reason")
    _action(ctx, run(ctx, lambda t: t.discard(subscription, delivery_id, text), subscription=subscription,
                     delivery_id=delivery_id, app=True))


def _operator_text(text: str | None, option: str) -> str | None:
    """A note or reason as the stores keep it (redacted), checked as every other path checks it."""
    from ..core.operator import operator_text

    try:
        return operator_text(text, "it")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{option}'") from None


def _cursor(value: str | None) -> str | None:
    """A paging cursor: a DeliveryID (digits, or ``aws:...`` on an aws subscription)."""
    if value is None or (value.isascii() and value.isdigit()) or value.startswith("aws:"):
        return value
    raise click.BadParameter(f"{value!r} is not a DeliveryID: give the DeliveryID of the last row of the page "
                             "before (digits, or aws:... on an aws subscription)")


def _action(ctx: Context, result: Any) -> None:
    if ctx.as_json:
        emit_json(result)
    else:
        extra = " (the handler is told to stop; the delivery is Discarded when it returns)" if (
            result.cancel_requested) else ""
        if getattr(result, "reason", None):
            extra = f": {result.reason}"
        click.echo(f"{result.result}: delivery {result.delivery_id} of {result.subscription}{extra}")
        if result.result == "NotFound" and _is_uuid(result.delivery_id):
            click.echo(f"{result.delivery_id} reads as a MessageID (or a job's id), not a DeliveryID: "
                       f"`workqueue search {result.delivery_id}` lists its deliveries; a job is cancelled with "
                       f"`workqueue jobs cancel {result.delivery_id}`", err=True)
    if not result.ok:
        sys.exit(1)


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


@click.command()
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


@click.command()
@app_option
@click.option("--subscription", required=True)
@pass_context
def pause(ctx: Context, subscription: str) -> None:
    """Stop claiming from a subscription (deliveries still accrue)."""
    _set_status(ctx, subscription, "Paused")


@click.command()
@app_option
@click.option("--subscription", required=True)
@pass_context
def resume(ctx: Context, subscription: str) -> None:
    """Claim from a paused subscription again."""
    _set_status(ctx, subscription, "Active")


@click.command("validate-bindings")
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


@click.command()
@app_option
@click.option("--older-than", "older_than", default="7d", show_default=True,
              help="Age of Completed and Discarded deliveries to remove: 3600, 90m, 12h, 7d.")
@pass_context
def prune(ctx: Context, older_than: str) -> None:
    """Remove Completed and Discarded deliveries settled longer ago than --older-than."""
    seconds = parse_duration(older_than, option="--older-than")
    removed = run(ctx, lambda t: t.prune(seconds), app=True)
    if ctx.as_json:
        emit_json({"Removed": removed})
    else:
        click.echo(f"removed {count(removed, 'delivery')} settled more than {older_than} ago")
