"""The AWS commands: ``export-topology``, ``import-bindings``, ``lambda-policy`` and
``validate-bindings --transport aws``.

They read the queue from ``--app MODULE:ATTR`` (or ``WORKQUEUE_APP``): its topics and subscriptions
give the manifest, its settings the region, the endpoint and where bindings are kept.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import traceback
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import click

from ..core.errors import WorkQueueError
from ..core.reports import BindingReport
from .output import emit_json, table

T = TypeVar("T")

APP_HELP = "MODULE:ATTR of your app or WorkQueue (default: WORKQUEUE_APP)."


def _verbose() -> bool:
    ctx = click.get_current_context(silent=True)
    obj = getattr(ctx, "obj", None) if ctx is not None else None
    return bool(getattr(obj, "verbose", False))


def _as_json() -> bool:
    ctx = click.get_current_context(silent=True)
    obj = getattr(ctx, "obj", None) if ctx is not None else None
    return bool(getattr(obj, "as_json", False))


def _fail(exc: BaseException) -> click.ClickException:
    if _verbose():
        traceback.print_exception(exc, file=sys.stderr)
    return click.ClickException(str(exc))


def _run(awaitable: Awaitable[T]) -> T:
    async def main() -> T:
        return await awaitable

    try:
        return asyncio.run(main())
    except (WorkQueueError, ValueError) as exc:
        raise _fail(exc) from exc


def _queue(app_path: str | None) -> Any:
    from ..core.errors import ConfigurationError
    from .app_loader import load_target

    if not app_path:
        raise click.UsageError("no app: pass --app MODULE:ATTR (your app or its WorkQueue) or set WORKQUEUE_APP")
    try:
        target = load_target(app_path)
    except ConfigurationError as exc:
        raise _fail(exc) from exc
    if target.queue is None:
        raise click.ClickException(
            f"--app {app_path!r}: no WorkQueue found before the app starts; set app.state.queue = queue in the "
            "module, or point --app at the WorkQueue itself (MODULE:queue)"
        )
    return target.queue


def _aws(module: str) -> Any:
    """A module of the aws package (the transport's side of it)."""
    try:
        return importlib.import_module(f"fastapi_workqueue.aws.{module}")
    except ModuleNotFoundError as exc:
        raise click.ClickException(
            f"the AWS transport is not available ({exc}): install it with pip install 'fastapi-workqueue[aws]'"
        ) from exc


def _manifest(queue: Any) -> dict[str, Any]:
    from ..core.errors import ConfigurationError

    try:
        manifest: dict[str, Any] = _aws("manifest").build_manifest(
            list(queue.topics.values()), list(queue.subscriptions.values()), queue.settings
        )
    except ConfigurationError as exc:
        raise _fail(exc) from exc
    return manifest


def _read_json(path: str, what: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"cannot read {what} {path}: {exc.strerror}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.ClickException(f"{what} {path} is not JSON (line {exc.lineno}: {exc.msg})") from exc


@click.command("export-topology")
@click.option("--transport", type=click.Choice(["aws"]), required=True, help="The transport to export.")
@click.option("--app", "app_path", envvar="WORKQUEUE_APP", help=APP_HELP)
@click.option("--output", "output", default="-", show_default=True, metavar="FILE",
              help="Where to write the manifest ('-' for stdout).")
def export_topology(transport: str, app_path: str | None, output: str) -> None:
    """Write the manifest of the aws topics and their subscriptions (the Terraform module's input)."""
    manifest = _manifest(_queue(app_path))
    text = json.dumps(manifest, indent=2, sort_keys=False) + "\n"
    if output == "-":
        click.echo(text, nl=False)
        return
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(text, encoding="utf-8")
    click.echo(f"wrote {output}: {len(manifest['topics'])} topic(s), {len(manifest['subscriptions'])} "
               "subscription(s); next: terraform apply, then workqueue import-bindings", err=True)


@click.command("import-bindings")
@click.argument("bindings_file", metavar="BINDINGS.json")
@click.option("--app", "app_path", envvar="WORKQUEUE_APP", help=APP_HELP)
def import_bindings(bindings_file: str, app_path: str | None) -> None:
    """Store the Terraform module's binding_import (or the whole `terraform output -json`) with the topology."""
    module = _aws("bindings")
    data = _read_json(bindings_file, "bindings file")
    try:
        bindings = module.Bindings.parse(data)
    except (ValueError, WorkQueueError) as exc:
        raise _fail(exc) from exc
    queue = _queue(app_path)
    _run(_with_engine(queue, module.store_bindings(queue.kernel, bindings)))
    if _as_json():
        emit_json({"Topics": sorted(bindings.topics), "Subscriptions": sorted(bindings.subscriptions)})
    else:
        click.echo(f"imported the bindings of {len(bindings.topics)} topic(s) and {len(bindings.subscriptions)} "
                   "subscription(s); next: workqueue validate-bindings --transport aws")


@click.command("lambda-policy")
@click.argument("subscription")
@click.option("--app", "app_path", envvar="WORKQUEUE_APP", help=APP_HELP)
@click.option("--bindings", "bindings_file", metavar="FILE",
              help="The module's binding_import (or `terraform output -json`) instead of the stored bindings.")
def lambda_policy(subscription: str, app_path: str | None, bindings_file: str | None) -> None:
    """Print the WORKQUEUE_SUBSCRIPTION_POLICY of a Lambda serving SUBSCRIPTION (one line of JSON)."""
    queue = _queue(app_path)
    sub = queue.subscriptions.get(subscription)
    if sub is None:
        raise click.ClickException(
            f"subscription {subscription!r} is not declared by the app: it declares {sorted(queue.subscriptions)}"
        )
    topic = queue.topics.get(sub.topic)
    if topic is None:
        raise click.ClickException(f"subscription {subscription!r} names topic {sub.topic!r}, which the app does "
                                   "not declare")
    module = _aws("bindings")
    if bindings_file:
        try:
            bindings = module.Bindings.parse(_unwrap(_read_json(bindings_file, "bindings file")))
        except (ValueError, WorkQueueError) as exc:
            raise _fail(exc) from exc
    else:
        bindings = _run(_with_engine(queue, module.load_bindings(queue.kernel)))
    try:
        policy = _aws("lambda_policy").lambda_policy(sub, topic, bindings, region=queue.settings.aws_region)
    except WorkQueueError as exc:
        raise _fail(exc) from exc
    click.echo(json.dumps(policy, separators=(",", ":")))


async def _with_engine(queue: Any, awaitable: Awaitable[T]) -> T:
    """Awaits ``awaitable`` (which may use the queue's engine), then disposes of the engine."""
    try:
        return await awaitable
    finally:
        await queue.kernel.sessions.dispose()


def validate_aws(
    app_path: str | None, manifest_file: str | None, bindings_file: str | None, endpoint_url: str | None
) -> BindingReport:
    """The report of ``validate-bindings --transport aws``: the manifest and bindings from the files
    given, or from the app's queue (its topology and its stored bindings)."""
    validate_aws_bindings = _aws("validate").validate_aws_bindings
    queue = None if manifest_file and bindings_file else _queue(app_path)
    manifest = _read_json(manifest_file, "manifest") if manifest_file else _manifest(queue)
    if bindings_file:
        try:
            bindings = _aws("bindings").Bindings.parse(_unwrap(_read_json(bindings_file, "bindings file"))).document()
        except (ValueError, WorkQueueError) as exc:
            raise _fail(exc) from exc
    else:
        assert queue is not None  # (read from the app when no bindings file is given)
        bindings = _run(_with_engine(queue, _aws("bindings").load_bindings(queue.kernel))).model_dump(mode="json")
    if endpoint_url is None and queue is not None:
        endpoint_url = getattr(queue.settings, "aws_endpoint_url", None)
    region = manifest.get("region") if isinstance(manifest, dict) else None
    if not region:
        raise click.ClickException("the manifest names no region: export it again with WORKQUEUE_AWS_REGION set")
    report: BindingReport = _run(validate_aws_bindings(manifest, bindings, region=region, endpoint_url=endpoint_url))
    return report


def _unwrap(data: Any) -> Any:
    """The binding_import object of a `terraform output -json` document, or ``data`` itself."""
    if isinstance(data, dict) and isinstance(data.get("binding_import"), dict) and "value" in data["binding_import"]:
        return data["binding_import"]["value"]
    if not isinstance(data, dict) or "subscriptions" not in data or "topics" not in data:
        raise click.ClickException(
            "the bindings file is neither the module's binding_import nor `terraform output -json`: "
            "write it with `terraform output -json binding_import > bindings.json`"
        )
    return data


def print_report(report: BindingReport, as_json: bool) -> None:
    """Prints a validate-bindings report and exits 1 when it has an Error."""
    if as_json:
        emit_json(report)
    else:
        click.echo(f"{report.transport}: {'ok' if report.ok else 'problems found'}")
        table(report.issues, ["severity", "subject", "message"], empty="no issues")
    if not report.ok:
        sys.exit(1)
