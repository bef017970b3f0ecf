"""``workqueue subscriptions ...`` and ``workqueue topics ...``: list, retire, delete.

A subscription removed from the code stays in the store until an operator retires it (fan-out to
it stops, what it holds drains or is discarded) and deletes it once it is empty; the same for
topics. ``list`` shows what the store holds, with the live processes that serve each subscription
and, given ``--app``, whether the app's code declares it.
"""

from __future__ import annotations

from typing import Any

import click

from ..core.errors import ConfigurationError
from ..core.retirement import DeleteResult
from ..core.wire import WireModel
from .context import Context, run
from .jobs import _with_queue
from .output import emit_json, table


class SubscriptionRow(WireModel):
    """One line of ``workqueue subscriptions list``."""

    name: str
    topic: str
    status: str
    declared: str
    served_by: int
    pending: int
    in_flight: int
    dead_lettered: int
    completed: int
    limits: str = ""
    """Its flow limits (``max_in_flight=5, rate_limit=50/s``), empty without any."""


class TopicRow(WireModel):
    """One line of ``workqueue topics list``."""

    name: str
    transport: str
    status: str
    declared: str
    subscriptions: int


def _declared_by(ctx: Context, app_path: str | None) -> tuple[set[str], set[str]] | None:
    """The subscriptions and topics the app's code declares (None without ``--app``). Given
    ``--app``, the command reads the app's own stores too (its database, and aws where its topics
    are), unless ``--database-url`` on the command line names a database."""
    if app_path is None:
        return None
    if not ctx.url_given:  # (a --database-url on the command line: that database, the app saying what it declares)
        ctx.app_path = app_path
    from .app_loader import load_target

    try:
        target = load_target(app_path)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from exc
    if target.queue is None:
        raise click.ClickException(f"--app {app_path!r}: no WorkQueue found on it; point --app at the queue")
    return set(target.queue.subscriptions), set(target.queue.topics)


def _yes_no(name: str, declared: set[str] | None) -> str:
    return "?" if declared is None else ("yes" if name in declared else "no")


def _deleted(ctx: Any, result: DeleteResult, kind: str) -> None:
    if ctx.as_json:
        emit_json(result)
    if result.ok:
        if not ctx.as_json:
            click.echo(f"{result.name}: deleted")
        return
    why = {
        "NotFound": f"there is no {kind} {result.name!r}",
        "NotRetired": f"{kind} {result.name!r} is not retired; retire it first (`workqueue {kind}s retire "
                      f"{result.name}`)",
        "HasDeliveries": f"subscription {result.name!r} still holds {result.remaining} deliveries (Pending, InFlight "
                         "or DeadLettered); let them drain, or discard them (`workqueue subscriptions retire "
                         f"{result.name} --discard-pending` and the dead letters with `workqueue discard`)",
        "HasSubscriptions": f"topic {result.name!r} still has {result.remaining} subscriptions; delete them first",
    }[result.result]
    raise click.ClickException(why)


@click.group("subscriptions")
def subscriptions() -> None:
    """List, retire and delete subscriptions."""


@subscriptions.command("list")
@click.option("--app", "app_path", envvar="WORKQUEUE_APP",
              help="MODULE:ATTR of your app or WorkQueue: say which ones its code declares (and read its stores).")
@click.pass_obj
def list_subscriptions(ctx: Any, app_path: str | None) -> None:
    """The stored subscriptions: status, whether code declares them, who serves them, counts."""
    declared = _declared_by(ctx, app_path)

    async def read(transport: Any) -> list[SubscriptionRow]:
        states = await transport.list_subscriptions()
        stats = {s.subscription: s for s in await transport.stats()}
        serving: dict[str, int] = {}
        for process in await transport.list_processes():
            if process.state == "Running":
                for name in process.subscriptions:
                    serving[name] = serving.get(name, 0) + 1
        rows = []
        for state in states:
            counts = stats.get(state.name)
            rows.append(SubscriptionRow(
                name=state.name, topic=state.topic, status=state.status,
                declared=_yes_no(state.name, None if declared is None else declared[0]),
                served_by=serving.get(state.name, 0),
                pending=counts.pending if counts else 0, in_flight=counts.in_flight if counts else 0,
                dead_lettered=counts.dead_lettered if counts else 0, completed=counts.completed if counts else 0,
                limits=", ".join(f"{k}={v}" for k, v in state.flow_limits().items()),
            ))
        return rows

    rows = run(ctx, read, app=True)
    if ctx.as_json:
        emit_json(rows)
    else:
        table(rows, ["name", "topic", "status", "declared", "served_by", "pending", "in_flight", "dead_lettered",
                     "completed", "limits"])


@subscriptions.command("retire")
@click.argument("name")
@click.option("--discard-pending", is_flag=True, help="Discard its Pending deliveries instead of letting them drain.")
@click.option("--reason", help="Kept with each discarded delivery.")
@click.pass_obj
def retire(ctx: Any, name: str, discard_pending: bool, reason: str | None) -> None:
    """Stop the fan-out to a subscription removed from the code; what it holds drains."""
    if reason is not None and not discard_pending:
        raise click.UsageError("--reason goes with --discard-pending (it is kept with the discarded deliveries)")
    result = _with_queue(ctx, lambda q: q.retire(name, discard_pending=discard_pending, reason=reason))
    if ctx.as_json:
        emit_json(result)
        return
    text = f"{name}: Retired" + ("" if result.changed else " (it already was)")
    if discard_pending:
        text += f"; discarded {result.discarded} Pending"
    click.echo(text)


@subscriptions.command("delete")
@click.argument("name")
@click.pass_obj
def delete(ctx: Any, name: str) -> None:
    """Delete a retired subscription that holds nothing any more (admin)."""
    _deleted(ctx, _with_queue(ctx, lambda q: q.delete_subscription(name)), "subscription")


@click.group("topics")
def topics() -> None:
    """List, retire, take back and delete topics."""


@topics.command("list")
@click.option("--app", "app_path", envvar="WORKQUEUE_APP",
              help="MODULE:ATTR of your app or WorkQueue: say which ones its code declares (and read its stores).")
@click.pass_obj
def list_topics(ctx: Any, app_path: str | None) -> None:
    """The stored topics: transport, status, whether code declares them, their subscriptions."""
    declared = _declared_by(ctx, app_path)

    async def read(transport: Any) -> list[TopicRow]:
        subscriptions_of: dict[str, int] = {}
        for state in await transport.list_subscriptions():
            subscriptions_of[state.topic] = subscriptions_of.get(state.topic, 0) + 1
        return [
            TopicRow(name=t.name, transport=t.transport, status=getattr(t, "status", "Active"),
                     declared=_yes_no(t.name, None if declared is None else declared[1]),
                     subscriptions=subscriptions_of.get(t.name, 0))
            for t in await transport.list_topics()
        ]

    rows = run(ctx, read, app=True)
    if ctx.as_json:
        emit_json(rows)
    else:
        table(rows, ["name", "transport", "status", "declared", "subscriptions"])


def _topic_status(ctx: Any, name: str, status: Any) -> None:
    change = _with_queue(ctx, lambda q: q.set_topic_status(name, status))
    if ctx.as_json:
        emit_json(change)
    else:
        click.echo(f"{name}: {change.status}" + ("" if change.changed else " (it already was)"))


@topics.command("retire")
@click.argument("name")
@click.pass_obj
def retire_topic(ctx: Any, name: str) -> None:
    """Refuse new messages on a topic; its subscriptions drain what they hold."""
    _topic_status(ctx, name, "Retired")


@topics.command("resume")
@click.argument("name")
@click.pass_obj
def resume_topic(ctx: Any, name: str) -> None:
    """Take back a retired (or paused) topic."""
    _topic_status(ctx, name, "Active")


@topics.command("delete")
@click.argument("name")
@click.pass_obj
def delete_topic(ctx: Any, name: str) -> None:
    """Delete a retired topic that no subscription names any more (admin)."""
    _deleted(ctx, _with_queue(ctx, lambda q: q.delete_topic(name)), "topic")
