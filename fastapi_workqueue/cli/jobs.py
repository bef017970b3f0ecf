"""``workqueue jobs ...`` and ``workqueue schedules``: failed jobs, re-encryption, the schedules.

``jobs failed|cancel|retry|forget|prune`` and ``jobs reencrypt`` work on the store alone (the app key
comes from ``WORKQUEUE_APP_KEY``); ``schedules`` needs the app (``--app``), where they are declared.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from ..core.errors import ConfigurationError, WorkQueueError
from .output import emit_json, table

T = TypeVar("T")


def _with_queue(ctx: Any, action: Callable[[Any], Awaitable[T]]) -> T:
    """Runs ``action(queue)`` on a WorkQueue opened on the command's database, with no host."""
    from ..core.settings import settings_beside_invalid_variables
    from .app_loader import queue_of_its_own

    queue = queue_of_its_own(settings_beside_invalid_variables(
        database_url=ctx.url(), enabled=False, sync_topology=False, auto_migrate=False, pool_size=2, listen=False))

    async def main() -> T:
        await queue.open()
        try:
            return await action(queue)
        finally:
            await queue.close()

    try:
        return asyncio.run(main())
    except (WorkQueueError, ValueError, LookupError) as exc:
        raise click.ClickException(str(exc).strip("'\"")) from exc


@click.group("jobs")
def jobs() -> None:
    """Failed jobs and encrypted payloads."""


@jobs.command("failed")
@click.option("--queue", "queue_name", help="One job queue (default: all of them).")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 10000))
@click.option("--payload", "include_payload", is_flag=True, help="Include payloads (never an encrypted one's).")
@click.pass_obj
def failed(ctx: Any, queue_name: str | None, limit: int, include_payload: bool) -> None:
    """Jobs that failed for good, with their reason and redacted error."""
    rows = _with_queue(ctx, lambda q: q.failed_jobs(queue_name, limit=limit, include_payload=include_payload))
    if ctx.as_json:
        emit_json(rows)
    else:
        table(rows, ["id", "job", "queue", "attempts", "failed_at", "reason", "error",
                     *(["payload"] if include_payload else [])])


@jobs.command("retry")
@click.argument("job_id")
@click.option("--note", help="Why it is retried (kept with the delivery).")
@click.pass_obj
def retry(ctx: Any, job_id: str, note: str | None) -> None:
    """Queue a failed job again, with the same id."""
    result = _with_queue(ctx, lambda q: q.retry_job(_uuid(job_id), note))
    _action(ctx, result)


@jobs.command("cancel")
@click.argument("job_id")
@click.option("--reason", help="Why it is cancelled (kept with the job).")
@click.pass_obj
def cancel(ctx: Any, job_id: str, reason: str | None) -> None:
    """Cancel a waiting job (Discarded at once) or a running one (its cancel requested)."""
    result = _with_queue(ctx, lambda q: q.cancel_job(_uuid(job_id), reason))
    _action(ctx, result)


@jobs.command("forget")
@click.argument("job_id")
@click.pass_obj
def forget(ctx: Any, job_id: str) -> None:
    """Drop a failed job."""
    result = _with_queue(ctx, lambda q: q.forget_job(_uuid(job_id)))
    _action(ctx, result)


@jobs.command("prune")
@click.option("--older-than", "--older-than-days", "--days", "older_than", default="7", show_default=True,
              help="Age of the failure in days (7, 0.5), or with a unit: 90m, 12h, 30d, 3600s.")
@click.option("--queue", "queue_name", help="One job queue (default: all of them).")
@click.pass_obj
def prune(ctx: Any, older_than: str, queue_name: str | None) -> None:
    """Drop the jobs that failed longer ago than --older-than days."""
    from .context import parse_duration

    seconds = parse_duration(older_than, bare_unit="d", option="--older-than")
    count = _with_queue(ctx, lambda q: q.prune_failed_jobs(seconds / 86400, queue_name))
    if ctx.as_json:
        emit_json({"Pruned": count})
    else:
        click.echo(f"pruned {count} failed job(s)")


@jobs.command("reencrypt")
@click.pass_obj
def reencrypt(ctx: Any) -> None:
    """Encrypt waiting and failed encrypted jobs again with the current WORKQUEUE_APP_KEY."""
    count = _with_queue(ctx, lambda q: q.reencrypt_jobs())
    if ctx.as_json:
        emit_json({"Reencrypted": count})
    else:
        click.echo(f"re-encrypted {count} job(s) with the current key")


@click.command("schedules")
@click.option("--app", "app_path", envvar="WORKQUEUE_APP", required=True,
              help="MODULE:ATTR of your app or WorkQueue, where schedules live.")
@click.pass_obj
def schedules(ctx: Any, app_path: str) -> None:
    """The app's schedules, each with its next run."""
    from .app_loader import load_target

    try:
        target = load_target(app_path)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from exc
    queue = target.queue
    if queue is None:
        raise click.ClickException(f"--app {app_path!r}: no WorkQueue found on it; point --app at the queue")
    rows = queue.jobs.schedules.listing() if queue._jobs is not None else []
    if ctx.as_json:
        emit_json(rows)
    elif not rows:
        click.echo("(no schedules)")
    else:
        keys = list(rows[0])
        widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
        click.echo("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)).rstrip())
        for row in rows:
            click.echo("  ".join(str(row[k]).ljust(w) for k, w in zip(keys, widths, strict=True)).rstrip())


def _uuid(text: str) -> Any:
    import uuid

    try:
        return uuid.UUID(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a job id (a UUID)", param_hint="JOB_ID") from None


def _action(ctx: Any, result: Any) -> None:
    if ctx.as_json:
        emit_json(result)
    else:
        click.echo(f"{result.result}: delivery {result.delivery_id} of {result.subscription}")
    if not result.ok:
        raise SystemExit(1)
