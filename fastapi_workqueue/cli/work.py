"""``workqueue work``: run one subscription's handlers from your app, long-running or one-shot.

Exit codes: 0 when it ran (also with an empty queue, a spent budget, ``--max-duration-ms``, a
signal, or a paused subscription); non-zero with a one-line reason when the subscription could
not run at all. A long-running worker (neither ``--once`` nor ``--max``) waits through a pause
and resumes claiming when the subscription is resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

import click

from ..core.errors import ConfigurationError, TransportError
from ..core.host import SubscriptionPlan

T = TypeVar("T")

EXIT_OK = 0
EXIT_CONFIGURATION = 2
EXIT_UNKNOWN_SUBSCRIPTION = 3
EXIT_HANDLER_NOT_REGISTERED = 4
EXIT_UNSUPPORTED = 5
EXIT_ERROR = 6

_STATE_EXIT = {
    "HandlerNotRegistered": EXIT_HANDLER_NOT_REGISTERED,
    "Unsupported": EXIT_UNSUPPORTED,
    "Error": EXIT_ERROR,
}


def load_queue(path: str) -> Any:
    """Imports ``MODULE:ATTR`` (from the current directory too) and returns the WorkQueue."""
    from ..queue import WorkQueue

    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(f"--app {path!r} is not MODULE:ATTR (for example myapp.worker:queue)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"--app {path!r}: cannot import {module_name!r} ({exc})") from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigurationError(f"--app {path!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not isinstance(target, WorkQueue):
        raise ConfigurationError(f"--app {path!r} is a {type(target).__name__}, not a WorkQueue")
    return target


async def run_work(
    queue: Any,
    subscription: str,
    *,
    once: bool = False,
    max_deliveries: int | None = None,
    concurrency: int | None = None,
    max_duration_ms: int | None = None,
    shutdown_drain_ms: int | None = None,
) -> tuple[int, str]:
    """Runs the subscription until done; returns the exit code and a one-line reason."""
    budget = max_deliveries if max_deliveries is not None else (1 if once else None)
    # A long-running worker (no --once, no --max) stays up through a pause, as a deployment's
    # pods must; a job with a budget exits 0 at once, as there is nothing for it to do.
    finite = once or budget is not None
    planned = next((p for p in queue.settings.subscriptions if p.name == subscription), None)
    wildcard = next((p for p in queue.settings.subscriptions if p.name == "*"), None)
    width = concurrency or (planned or wildcard or SubscriptionPlan()).concurrency
    overrides = {} if shutdown_drain_ms is None else {"shutdown_drain_ms": shutdown_drain_ms}
    try:
        await queue.open()
    except ConfigurationError as exc:
        return EXIT_CONFIGURATION, str(exc)
    except TransportError as exc:
        return EXIT_ERROR, str(exc)
    try:
        host = queue.build_host(
            [SubscriptionPlan(name=subscription, concurrency=width)],
            max_deliveries=budget,
            stop_when_idle=once,
            **overrides,
        )
        await host.start()
        try:
            state = next((h for h in host.health() if h.subscription == subscription), None)
            if state is None or state.state != "Running":
                name = "Error" if state is None else state.state
                reason = "unknown" if state is None else (state.reason or name)
                if name == "Paused":
                    if finite:
                        return EXIT_OK, f"{subscription}: paused, nothing to do ({reason})"
                    click.echo(f"workqueue work: {subscription}: paused ({reason}); waiting for resume", err=True)
                elif name == "Error" and "does not exist" in reason:
                    return EXIT_UNKNOWN_SUBSCRIPTION, reason
                else:
                    return _STATE_EXIT.get(name, EXIT_ERROR), f"{subscription}: {name}: {reason}"
            await _until_done(host, max_duration_ms, finite=finite)
            return EXIT_OK, f"{subscription}: ran {host.claimed_total(subscription)} deliveries"
        finally:
            await host.stop()
    finally:
        await queue.close()


def run_on_fastest_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """Runs ``coroutine`` on uvloop when it is installed (``fastapi-workqueue[fast]``), else asyncio."""
    try:
        uvloop: Any = importlib.import_module("uvloop")
    except ImportError:
        uvloop = None
    # Run outside the except block: inside it, every exception of the worker's life would carry
    # the ImportError as its context, and every logged traceback would show it.
    if uvloop is None:
        return asyncio.run(coroutine)
    result: T = uvloop.run(coroutine)
    return result


async def _until_done(host: Any, max_duration_ms: int | None, *, finite: bool) -> None:
    """Waits for a signal or the duration limit, and (``finite``: a budget or one-shot) for the
    budget to be spent or the queue to be idle. A long-running worker's consumer may stop and
    start again as the subscription is paused and resumed; only a signal or the limit ends it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait())]
    if finite:
        waiters.append(asyncio.ensure_future(host.wait_finished()))
    if max_duration_ms is not None:
        waiters.append(asyncio.ensure_future(asyncio.sleep(max_duration_ms / 1000)))
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for sig in installed:
            loop.remove_signal_handler(sig)


@click.command()
@click.option("--app", "app_path", required=True, help="MODULE:ATTR of your WorkQueue, e.g. myapp.worker:queue.")
@click.option("--subscription", required=True, help="The subscription to run.")
@click.option("--once", is_flag=True, help="Claim at most --max (default 1), run, drain, exit; exit at once if empty.")
@click.option("--max", "max_deliveries", type=click.IntRange(1), help="Receive at most this many deliveries.")
@click.option("--concurrency", type=click.IntRange(1), help="Deliveries at once (default: the settings' plan).")
@click.option("--max-duration-ms", type=click.IntRange(1), help="Stop claiming after this long, then drain.")
@click.option("--shutdown-drain-ms", type=click.IntRange(0), help="How long running handlers get on shutdown.")
@click.pass_obj
def work(
    ctx: Any, app_path: str, subscription: str, once: bool, max_deliveries: int | None,
    concurrency: int | None, max_duration_ms: int | None, shutdown_drain_ms: int | None,
) -> None:
    """Run a subscription's handlers: a worker process or a one-shot container job."""
    try:
        queue = load_queue(app_path)
    except ConfigurationError as exc:
        click.echo(f"workqueue work: {exc}", err=True)
        sys.exit(EXIT_CONFIGURATION)
    if ctx is not None and ctx.database_url:
        queue.settings = queue.settings.model_copy(update={"database_url": ctx.database_url})
    coroutine = run_work(
        queue, subscription, once=once, max_deliveries=max_deliveries, concurrency=concurrency,
        max_duration_ms=max_duration_ms, shutdown_drain_ms=shutdown_drain_ms,
    )
    code, reason = run_on_fastest_loop(coroutine)
    click.echo(f"workqueue work: {reason}", err=code != EXIT_OK)
    sys.exit(code)
