"""``workqueue work``: run one subscription's handlers from your app, long-running or one-shot.

``--app MODULE:ATTR`` names the FastAPI or Starlette app (its lifespan runs, so handlers see
``request.app.state`` and ``app.dependency_overrides`` as under a server) or the WorkQueue itself.
Exit codes: 0 when it ran (also with an empty queue, a spent budget, ``--max-duration-ms``, a
signal, or a paused subscription); non-zero with a one-line reason when the subscription could
not run at all. A long-running worker (neither ``--once`` nor ``--max``) waits through a pause
and resumes claiming when the subscription is resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from ..core.errors import ConfigurationError, TransportError
from ..core.host import SubscriptionPlan
from ..core.redaction import redact, redacting_logger
from ..core.runtime import HANDLER_TASK_PREFIX
from ..core.tasks import TaskScope
from ..core.words import count
from .app_loader import LifespanFailed, app_lifespan, load_target, queue_from_lifespan_state
from .log_setup import configure_logging

T = TypeVar("T")

log = redacting_logger("fastapi_workqueue.cli")

EXIT_OK = 0
EXIT_CONFIGURATION = 2
EXIT_UNKNOWN_SUBSCRIPTION = 3
EXIT_HANDLER_NOT_REGISTERED = 4
EXIT_UNSUPPORTED = 5
EXIT_ERROR = 6
EXIT_JOB_STUCK = 70
"""A job ignored its timeout and the stop timeout (the BSD EX_SOFTWARE code)."""

_STATE_EXIT = {
    "HandlerNotRegistered": EXIT_HANDLER_NOT_REGISTERED,
    "Undeclared": EXIT_HANDLER_NOT_REGISTERED,
    "Retired": EXIT_HANDLER_NOT_REGISTERED,
    "Unsupported": EXIT_UNSUPPORTED,
    "Error": EXIT_ERROR,
}


@dataclass(slots=True)
class WorkSummary:
    """How a run ended: the exit code, a one-line reason, and what the worker did."""

    subscription: str
    code: int = EXIT_OK
    reason: str = ""
    claimed: int = 0
    settled: int = 0
    completed: int = 0

    def ended(self, code: int, reason: str) -> WorkSummary:
        self.code, self.reason = code, reason
        return self

    def as_json(self) -> str:
        return json.dumps({
            "ExitCode": self.code, "Reason": self.reason, "Subscription": self.subscription,
            "Claimed": self.claimed, "Settled": self.settled, "Completed": self.completed,
        }, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class WorkPlan:
    """What one worker runs: subscriptions, each with a consumer of its own, and job queues."""

    subscriptions: tuple[str, ...] = ()
    queues: str | None = None
    """The job queues (``mail,*``); None: none, unless no subscription is named either."""
    jobs: bool = False

    @property
    def label(self) -> str:
        parts = list(self.subscriptions)
        if self.jobs:
            parts.append(f"jobs ({self.queues or '*'})")
        return ", ".join(parts)


async def run_work(
    queue: Any,
    plan: WorkPlan | str,
    *,
    app: Any = None,
    app_path: str = "",
    once: bool = False,
    max_deliveries: int | None = None,
    concurrency: int | None = None,
    max_duration_ms: int | None = None,
    shutdown_drain_ms: int | None = None,
    as_json: bool = False,
) -> WorkSummary:
    """Runs the plan until done, inside ``app``'s lifespan when an app is given.

    The lifespan opens the queue but starts no host of its own (:func:`host_run_by_worker`); the
    worker's host runs, drains on a signal, and the lifespan's shutdown runs after the drain. A
    signal from the start on (the app's lifespan starting included) is a graceful stop. ``as_json``:
    the summary a job stuck past its stop timeout ends the process with goes out as JSON too."""
    if isinstance(plan, str):
        plan = WorkPlan(subscriptions=(plan,))
    summary = WorkSummary(plan.label)
    with _stop_on_signals() as stop:
        return await _run_in_app(queue, plan, summary, stop, app=app, app_path=app_path, once=once,
                                 max_deliveries=max_deliveries, concurrency=concurrency,
                                 max_duration_ms=max_duration_ms, shutdown_drain_ms=shutdown_drain_ms,
                                 as_json=as_json)


async def _run_in_app(
    queue: Any, plan: WorkPlan, summary: WorkSummary, stop: asyncio.Event, *, app: Any, app_path: str, once: bool,
    max_deliveries: int | None, concurrency: int | None, max_duration_ms: int | None,
    shutdown_drain_ms: int | None, as_json: bool,
) -> WorkSummary:
    from ..core.kernel import host_run_by_worker

    async def run(on: Any, *, needs_no_app: bool) -> WorkSummary:
        if stop.is_set():  # (a signal while the app's lifespan started: nothing is claimed)
            return summary.ended(EXIT_OK, f"{plan.label}: stopped by a signal before it started")
        return await _run(
            on, plan, summary, stop, needs_no_app=needs_no_app, once=once, max_deliveries=max_deliveries,
            concurrency=concurrency, max_duration_ms=max_duration_ms, shutdown_drain_ms=shutdown_drain_ms,
            as_json=as_json, app_path=app_path,
        )

    if app is None:
        return await run(queue, needs_no_app=True)
    started = False
    with host_run_by_worker():
        try:
            async with app_lifespan(app) as state:
                started = True
                if queue is None:
                    queue = queue_from_lifespan_state(state, app_path)
                queue.bind_app(app)
                return await run(queue, needs_no_app=False)
        except ConfigurationError as exc:
            return summary.ended(EXIT_CONFIGURATION, str(exc))
        except TransportError as exc:
            return summary.ended(EXIT_ERROR, str(exc))
        except LifespanFailed as exc:
            return summary.ended(EXIT_ERROR, f"the app's lifespan failed at start-up: {_one_line(str(exc))}")
        except Exception as exc:
            if started:
                raise
            return summary.ended(
                EXIT_ERROR, f"the app's lifespan failed at start-up: {type(exc).__name__}: {_one_line(str(exc))}"
            )


def _one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def _stop_the_process(overrun: Any, *, summary: WorkSummary, as_json: bool) -> None:
    """A job is still running the stop timeout after its timeout (it blocks the event loop, or
    swallowed the cancellation): end the worker with exit code 70, its reason line on stderr and
    (``--json``) its summary on stdout, as every other exit. Called from the jobs' watchdog thread,
    so it works while the loop is blocked; ``os._exit`` because the loop cannot be trusted to run a
    clean shutdown. The delivery comes back when its lease runs out; a supervisor starts a new
    worker."""
    log.critical(
        "job %s (%s) ignored its timeout of %g s and is still running %g s later (it blocks the event loop or "
        "swallowed the cancellation); ending the worker with exit code %d: the job comes back when its lease "
        "runs out", overrun.job.name, overrun.context.id, overrun.timeout, overrun.stop_timeout, EXIT_JOB_STUCK,
    )
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    summary.ended(EXIT_JOB_STUCK, (
        f"job {overrun.job.name} ({overrun.context.id}) ignored its timeout of {overrun.timeout:g} s and the stop "
        f"timeout of {overrun.stop_timeout:g} s; it comes back when its lease runs out"))
    with contextlib.suppress(Exception):  # (straight to the descriptors: the loop is not to be trusted)
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, f"workqueue work: {summary.reason}\n".encode())
        if as_json:
            os.write(1, f"{summary.as_json()}\n".encode())
    os._exit(EXIT_JOB_STUCK)


async def _run(
    queue: Any,
    plan: WorkPlan,
    summary: WorkSummary,
    stop: asyncio.Event,
    *,
    needs_no_app: bool,
    once: bool,
    max_deliveries: int | None,
    concurrency: int | None,
    max_duration_ms: int | None,
    shutdown_drain_ms: int | None,
    as_json: bool,
    app_path: str = "",
) -> WorkSummary:
    budget = max_deliveries if max_deliveries is not None else (1 if once else None)
    # A long-running worker (no --once, no --max) stays up through a pause, as a deployment's
    # pods must; a job with a budget exits 0 at once, as there is nothing for it to do.
    finite = once or budget is not None
    wildcard = next((p for p in queue.settings.subscriptions if p.name == "*"), None)
    plans = []
    for name in plan.subscriptions:
        planned = next((p for p in queue.settings.subscriptions if p.name == name), None)
        plans.append(SubscriptionPlan(name=name, concurrency=concurrency or (planned or wildcard or
                                                                              SubscriptionPlan()).concurrency))
    overrides = {} if shutdown_drain_ms is None else {"shutdown_drain_ms": shutdown_drain_ms}
    stop_timeout = (shutdown_drain_ms if shutdown_drain_ms is not None else queue.settings.shutdown_drain_ms) / 1000
    groups = []
    if plan.jobs:
        from ..jobs.worker import check_fits_lease, parse_queues

        if queue._jobs is None or not len(queue.jobs.registry):
            return summary.ended(EXIT_CONFIGURATION, (
                f"--app {app_path or 'the queue'} declares no jobs: declare them with @queue.job(...) in a module "
                "the app imports, or run its subscriptions with --subscription NAME (repeat it for several)"
            ))
        try:
            check_fits_lease(queue.jobs, parse_queues(plan.queues), stop_timeout)
            groups = queue.jobs.groups(plan.queues, concurrency)
        except ConfigurationError as exc:
            return summary.ended(EXIT_CONFIGURATION, str(exc))
        queue.jobs.stuck = functools.partial(_stop_the_process, summary=summary, as_json=as_json)
        queue.jobs.stop_timeout = stop_timeout
    mode = ", ".join(part for part in (
        "once" if once else "", f"at most {count(budget, 'delivery')}" if budget is not None else "",
        f"for at most {max_duration_ms} ms" if max_duration_ms is not None else "",
    ) if part) or "until a signal"
    width = "; ".join([f"subscription {p.name}, concurrency {p.concurrency}" for p in plans]
                      + [f"jobs of {' then '.join(g.patterns)}, concurrency {g.concurrency}" for g in groups])
    log.info("worker starting: database %s; %s; %s", redact(queue.settings.database_url or "(none)"), width, mode)
    try:
        await queue.open()
    except ConfigurationError as exc:
        return summary.ended(EXIT_CONFIGURATION, str(exc))
    except TransportError as exc:
        return summary.ended(EXIT_ERROR, str(exc))
    try:
        if plan.jobs and plan.queues:
            from ..jobs.worker import parse_queues, unknown_queues

            unknown = await unknown_queues(queue.jobs, parse_queues(plan.queues), queue.transport)
            if unknown:
                declared = sorted(queue.jobs.registry.queues())
                return summary.ended(EXIT_UNKNOWN_SUBSCRIPTION, (
                    f"job queue(s) {', '.join(map(repr, unknown))} do not exist: no job of the app declares them and "
                    f"the store holds none; the app's job queues are {', '.join(declared)} (check --queue)"
                ))
        if needs_no_app:
            for name in plan.subscriptions:
                where = await _handler_needing_an_app(queue, name)
                if where is not None:
                    return summary.ended(EXIT_CONFIGURATION, (
                        f"{name}: {where} takes a Request, which needs the app (request.app); point --app "
                        "at the FastAPI or Starlette app (MODULE:app) instead of the WorkQueue"
                    ))
            if plan.jobs:
                where = queue.jobs.app_needed()
                if where is not None:
                    return summary.ended(EXIT_CONFIGURATION, (
                        f"{where} takes a Request, which needs the app (request.app); point --app at the FastAPI "
                        "or Starlette app (MODULE:app) instead of the WorkQueue"
                    ))
        host = queue.build_host(plans, groups=groups, max_deliveries=budget, stop_when_idle=once, **overrides)
        await host.start()
        try:
            for name in plan.subscriptions:
                state = next((h for h in host.health() if h.subscription == name), None)
                if state is None or state.state != "Running":
                    kind = "Error" if state is None else state.state
                    reason = "unknown" if state is None else (state.reason or kind)
                    if kind == "Paused":
                        if finite and len(plan.subscriptions) == 1 and not plan.jobs:
                            return summary.ended(EXIT_OK, f"{name}: paused, nothing to do ({reason})")
                        click.echo(f"workqueue work: {name}: paused ({reason}); waiting for resume", err=True)
                    elif kind == "Error" and "does not exist" in reason:
                        return summary.ended(EXIT_UNKNOWN_SUBSCRIPTION, reason)
                    else:
                        return summary.ended(_STATE_EXIT.get(kind, EXIT_ERROR), f"{name}: {kind}: {reason}")
            # Every long-running process whose host runs keeps the schedules, whatever it consumes
            # (a tick is queued once however many do): a worker of one subscription beside web
            # processes without a host is the only host there may be.
            schedules = not finite and queue._jobs is not None and bool(queue._jobs.schedules.items)
            if plan.jobs:
                queue.jobs.watch_queues(host, plan.queues)
            if schedules:
                queue.jobs.schedules.start()
            try:
                await _until_done(host, stop, max_duration_ms, finite=finite)
            finally:
                if plan.jobs:
                    await queue.jobs.stop_watching()
                if schedules:
                    await queue.jobs.schedules.stop()
        finally:
            # The consumers of the plan, also those a pause retired, for their counts; read after
            # the stop, so a claim that returned during the drain is counted.
            consumers = [c for name in plan.subscriptions for c in host.consumers_of(name)]
            consumers += [c for g in groups if (c := host.group_consumers.get(g.name)) is not None]
            await host.stop()
            summary.claimed = sum(c.claimed_total for c in consumers)
            summary.settled = sum(c.settled_total - c.lost_total for c in consumers)  # (what the store took)
            summary.completed = sum(c.completed_total for c in consumers)
        return summary.ended(EXIT_OK, f"{plan.label}: ran {count(summary.claimed, 'delivery')}")
    finally:
        await queue.close()


async def _handler_needing_an_app(queue: Any, subscription: str) -> str | None:
    """Where the subscription's handler takes a Request (see ``Kernel.app_needed_by``)."""
    declared = queue.subscriptions.get(subscription)
    key = declared.handler_key if declared is not None else None
    if key is None:
        with contextlib.suppress(Exception):  # the host reports an unreadable topology itself
            stored = await queue.transport.list_subscriptions()
            key = next((s.handler_key for s in stored if s.name == subscription), None)
    return None if key is None else queue.kernel.app_needed_by(key)


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


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[asyncio.Event]:
    """An event SIGTERM and SIGINT set, from before the host starts (a signal while it starts is a
    graceful stop as well, never the default handler's kill) until the worker has drained."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        yield stop
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _until_done(host: Any, stop: asyncio.Event, max_duration_ms: int | None, *, finite: bool) -> None:
    """Waits for ``stop`` (a signal) or the duration limit, and (``finite``: a budget or one-shot)
    for the budget to be spent or the queue to be idle. A long-running worker's consumer may stop
    and start again as the subscription is paused and resumed; only a signal or the limit ends it."""
    scope = TaskScope("workqueue-work-until")
    waiters: list[asyncio.Task[Any]] = [scope.spawn(stop.wait(), name="workqueue-work-signal")]
    if finite:
        waiters.append(scope.spawn(host.wait_finished(), name="workqueue-work-finished"))
    if max_duration_ms is not None:
        waiters.append(scope.spawn(asyncio.sleep(max_duration_ms / 1000), name="workqueue-work-limit"))
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            log.info("signal received: no more claims; draining the running handlers")
    finally:
        await scope.close()


def _serve_metrics(host: str, port: int) -> None:
    """This worker's counters (``workqueue_processed_total`` ...) for a scraper; the database's
    gauges are served by the app's ``queue.metrics_router``."""
    try:
        from prometheus_client import start_http_server
    except ImportError as exc:
        raise click.UsageError(
            "--metrics-port needs prometheus-client: pip install 'fastapi-workqueue[prometheus]'"
        ) from exc
    from ..observability.tally import export_process_tally

    export_process_tally()
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        raise click.UsageError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                               "pick a free port") from exc


def _finish(summary: WorkSummary, *, as_json: bool) -> None:
    if summary.code != EXIT_OK or not as_json:
        click.echo(f"workqueue work: {summary.reason}", err=summary.code != EXIT_OK)
    if as_json:
        click.echo(summary.as_json())
    sys.exit(summary.code)


@click.command()
@click.option("--app", "app_path", envvar="WORKQUEUE_APP", required=True,
              help="MODULE:ATTR of your FastAPI or Starlette app (e.g. myapp.main:app), or of its WorkQueue "
                   "(default: WORKQUEUE_APP).")
@click.option("--subscription", "subscriptions", multiple=True,
              help="A subscription to run (repeat for several, each with a consumer of its own).")
@click.option("--queue", "queues", default=None,
              help="Job queues to take, in strict order: mail,default; * is every other queue, fairly (mail,*). "
                   "Default without --subscription: every job queue, fairly.")
@click.option("--once", is_flag=True, help="Claim at most --max (default 1), run, drain, exit; exit at once if empty.")
@click.option("--max", "max_deliveries", type=click.IntRange(1), help="Receive at most this many deliveries.")
@click.option("--concurrency", type=click.IntRange(1), help="Deliveries at once (default: the settings' plan).")
@click.option("--max-duration-ms", type=click.IntRange(1), help="Stop claiming after this long, then drain.")
@click.option("--shutdown-drain-ms", type=click.IntRange(0), help="How long running handlers get on shutdown.")
@click.option("--stop-timeout", type=click.FloatRange(0), default=None,
              help="Seconds running jobs get after SIGTERM (and after their timeout before exit code 70); "
                   "the same as --shutdown-drain-ms, in seconds.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="Log records at this level and above go to stderr.")
@click.option("--log-format", default="text", show_default=True, type=click.Choice(["text", "json"]),
              help="text, or one JSON object a line (time, level, logger, message, delivery fields).")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve this process's Prometheus counters on http://HOST:PORT/metrics (the prometheus extra).")
@click.option("--metrics-host", default="0.0.0.0", show_default=True, help="The address --metrics-port listens on.")
@click.pass_obj
def work(
    ctx: Any, app_path: str, subscriptions: tuple[str, ...], queues: str | None, once: bool,
    max_deliveries: int | None, concurrency: int | None, max_duration_ms: int | None,
    shutdown_drain_ms: int | None, stop_timeout: float | None, log_level: str, log_format: Any,
    metrics_port: int | None, metrics_host: str,
) -> None:
    """Run subscriptions' handlers or jobs: a worker process or a one-shot container job."""
    configure_logging(log_level, log_format)
    if metrics_port is not None:
        _serve_metrics(metrics_host, metrics_port)
    as_json = bool(ctx is not None and ctx.as_json)
    if stop_timeout is not None:
        if shutdown_drain_ms is not None:
            raise click.UsageError("give --stop-timeout or --shutdown-drain-ms, not both")
        shutdown_drain_ms = round(stop_timeout * 1000)
    database_url = ctx.database_url if ctx is not None else None
    if database_url:
        os.environ["WORKQUEUE_DATABASE_URL"] = database_url  # for settings the module reads at import
    plan = WorkPlan(subscriptions=subscriptions, queues=queues, jobs=queues is not None or not subscriptions)
    try:
        target = load_target(app_path)
    except ConfigurationError as exc:
        if ctx is not None and ctx.verbose and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        _finish(WorkSummary(plan.label, EXIT_CONFIGURATION, str(exc)), as_json=as_json)
        return
    if target.queue is not None and database_url:
        target.queue.settings = target.queue.settings.model_copy(update={"database_url": database_url})
    coroutine = run_work(
        target.queue, plan, app=target.app, app_path=app_path, once=once, max_deliveries=max_deliveries,
        concurrency=concurrency, max_duration_ms=max_duration_ms, shutdown_drain_ms=shutdown_drain_ms,
        as_json=as_json,
    )

    async def then_leave_abandoned_handlers() -> WorkSummary:
        summary = await coroutine
        _exit_without_abandoned_handlers(summary, as_json=as_json)
        return summary

    _finish(run_on_fastest_loop(then_leave_abandoned_handlers()), as_json=as_json)


def _exit_without_abandoned_handlers(summary: WorkSummary, *, as_json: bool) -> None:
    """Ends the process now when handlers ignored the stop: the host released their deliveries to
    Pending, so another worker may run them, and a handler still running here would run beside it
    (on an Exclusive key too). Waiting for them, as the event loop's end would, could take forever."""
    abandoned = [t for t in asyncio.all_tasks()
                 if t is not asyncio.current_task() and not t.done() and t.get_name().startswith(HANDLER_TASK_PREFIX)]
    if not abandoned:
        return
    log.warning("%s still run after the stop; their deliveries were released (back to Pending, or Discarded "
                "where a cancel was asked) and the worker exits without waiting for them (they would run beside "
                "the worker that takes them next)", count(len(abandoned), "handler"))
    if summary.code != EXIT_OK or not as_json:
        os.write(2 if summary.code != EXIT_OK else 1, f"workqueue work: {summary.reason}\n".encode())
    if as_json:
        os.write(1, f"{summary.as_json()}\n".encode())
    logging.shutdown()
    os._exit(summary.code)
