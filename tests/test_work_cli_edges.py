"""``workqueue work`` at its edges, with real worker processes: exit 70's reason line and summary, a
signal while the app's lifespan starts, the summary's counts through a drain, and --once/--max across
several subscriptions (one budget for the worker)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fastapi_workqueue import WorkQueue, WorkQueueSettings

from .apps import cli_app
from .conftest import private_database
from .test_cli import APP, Cli
from .test_jobs_cli import Jobs

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
async def own_db() -> AsyncIterator[str]:
    """A migrated PostgreSQL database of the test's own: these workers leave deliveries behind in the
    CLI app's subscriptions, which the other CLI tests share in the session's database."""
    async with private_database("workqueue_work") as url:
        yield url


@pytest.fixture
async def cli(own_db: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cli]:
    """As tests/test_cli.py's ``cli``, on the test's own database."""
    ops = WorkQueue(WorkQueueSettings(database_url=own_db, enabled=False, auto_migrate=True),
                    topics=[*cli_app.queue.topics.values()], subscriptions=[*cli_app.queue.subscriptions.values()])
    async with ops.lifespan(None):
        yield Cli(own_db, tmp_path_factory.mktemp("cli"), ops)


async def test_exit_70_ends_with_the_documented_reason_line_and_json_summary(database_url: str, tmp_path: Path) -> None:
    """docs/cli.md: "Codes 2 to 6 and 70 come with one line on stderr that says why, `workqueue work:
    <reason>`" and "With `--json` the worker ends with one JSON line on stdout"."""
    jobs = Jobs(database_url, tmp_path)
    async with jobs.producer.lifespan(None):
        await jobs.producer.dispatch(jobs.app.stuck, {})
    worker = await jobs.start("--json", "--queue", jobs.queue_name, "--stop-timeout", "0.5")
    out, err = await asyncio.wait_for(worker.communicate(), 60)
    assert worker.returncode == 70, err.decode()
    reasons = [line for line in err.decode().splitlines() if line.startswith("workqueue work:")]
    assert len(reasons) == 1, f"no 'workqueue work: <reason>' line on stderr for exit 70: {err.decode()!r}"
    lines = [line for line in out.decode().splitlines() if line.strip()]
    assert lines and json.loads(lines[-1])["ExitCode"] == 70, f"no JSON summary on stdout: {out.decode()!r}"


SLOW_START_APP = '''
import asyncio, contextlib, os
from pathlib import Path
from fastapi import FastAPI
from fastapi_workqueue import Outcome, Subscription, Topic, WorkQueue, WorkQueueSettings

queue = WorkQueue(WorkQueueSettings(subscriptions=[{"name": "*", "concurrency": 1}], auto_migrate=True),
                  topics=[Topic(name="review.slow-start")],
                  subscriptions=[Subscription(name="review.slow-start", topic="review.slow-start",
                                              handler_key="review.slow-start")])

@queue.handler("review.slow-start")
async def handle(message, context):
    return Outcome.complete()

MARK = Path(os.environ["REVIEW_MARK"])

@contextlib.asynccontextmanager
async def lifespan(app):
    async with queue.lifespan(app) as state:
        MARK.write_text("starting")
        for _ in range(400):  # the app warms up until the test lets it go on
            if MARK.with_suffix(".go").exists():
                break
            await asyncio.sleep(0.05)
        yield state
    MARK.write_text("shut down")

app = FastAPI(lifespan=lifespan)
app.state.queue = queue
'''


async def test_sigterm_while_the_apps_lifespan_starts_is_a_graceful_stop(database_url: str, tmp_path: Path) -> None:
    """docs/scaling.md: "a job exits 0 whenever it ran, including on an empty queue, a spent `--max`,
    `--max-duration-ms`, a signal"; SPEC §7 "SIGTERM and SIGINT drain"; docs/cli.md "The lifespan's
    shutdown runs after the drain". A SIGTERM that arrives while the app's lifespan is starting (a
    pod scaled down or rolled while it warms up) kills the worker with the default handler instead:
    exit -15 (143), the lifespan's shutdown never runs, no summary."""
    import os
    import sys

    (tmp_path / "review_slow_start_app.py").write_text(SLOW_START_APP)
    mark = tmp_path / "mark.txt"
    root = ROOT
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{root}", WORKQUEUE_DATABASE_URL=database_url, REVIEW_MARK=str(mark))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fastapi_workqueue", "--json", "work", "--app", "review_slow_start_app:app",
        "--subscription", "review.slow-start", cwd=tmp_path, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        for _ in range(600):
            if mark.exists() or proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        assert mark.read_text() == "starting"
        proc.terminate()  # SIGTERM while the lifespan starts
        await asyncio.sleep(0.2)
        mark.with_suffix(".go").touch()  # the app finishes warming up
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, f"exit {proc.returncode}; stdout {out.decode()!r}; stderr {err.decode()[-600:]!r}"
    assert mark.read_text() == "shut down"


async def test_json_claimed_counts_a_claim_that_returns_during_the_drain(own_db: str, tmp_path: Path) -> None:
    """docs/cli.md: "With `--json` the worker ends with one JSON line on stdout:
    {"ExitCode": 0, "Reason": "…: ran 3 deliveries", "Subscription": "…", "Claimed": 3, "Settled": 3,
    "Completed": 3}". A claim on its way when SIGTERM arrives returns during the drain; its deliveries are
    released (settled) but ``Claimed`` was taken before ``host.stop()``: the summary says Claimed 0,
    Settled 3 (seen with plain load too: Claimed 272, Settled 373 after a SIGTERM mid-stream)."""
    import os
    import signal
    import sys

    import asyncpg

    from fastapi_workqueue import PublishRequest, WorkQueue, WorkQueueSettings
    from fastapi_workqueue.database.postgres import to_asyncpg_dsn

    from .apps import cli_app
    from .support import wait_for

    ops = WorkQueue(WorkQueueSettings(database_url=own_db, enabled=False, auto_migrate=True),
                    topics=[*cli_app.queue.topics.values()], subscriptions=[*cli_app.queue.subscriptions.values()])
    root = ROOT
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env.update(PYTHONPATH=str(root), WORKQUEUE_DATABASE_URL=own_db)
    err_path = tmp_path / "worker.err"
    async with ops.lifespan(None):
        assert await ops.pause(cli_app.IDLE) is not None
        with err_path.open("wb") as err_file:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fastapi_workqueue", "--json", "work", "--app", "tests.apps.cli_app:queue",
                "--subscription", cli_app.IDLE, cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=err_file,
            )
        locker = await asyncpg.connect(to_asyncpg_dsn(own_db))
        try:
            await wait_for(lambda: "waiting for resume" in err_path.read_text(), within=30, interval=0.05)
            published = await ops.publish(cli_app.IDLE, [PublishRequest(payload={"n": i}) for i in range(3)])
            assert all(r.status == "Accepted" for r in published)
            tx = locker.transaction()
            await tx.start()
            await locker.execute("LOCK TABLE workqueue.delivery IN ACCESS EXCLUSIVE MODE")
            await ops.resume(cli_app.IDLE)
            # The worker's next reconcile resumes the subscription and its consumer claims at once;
            # the claim cannot complete while the table is locked.
            await wait_for(lambda: f"{cli_app.IDLE}: running" in err_path.read_text(), within=30, interval=0.05)
            proc.send_signal(signal.SIGTERM)
            await wait_for(lambda: "signal received" in err_path.read_text(), within=30, interval=0.05)
            await tx.rollback()  # the claim on its way returns two deliveries, during the drain
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        finally:
            await locker.close()
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err_path.read_text()
        summary = json.loads(out.decode().splitlines()[-1])
        assert summary["Settled"] == 2, summary  # two (the concurrency) were claimed, then released at shutdown
        assert summary["Claimed"] >= summary["Settled"], summary


async def test_once_claims_at_most_one_delivery_across_several_subscriptions(cli: Cli) -> None:
    """docs/cli.md: "`--once` claims at most `--max` (default 1), runs, drains and exits"; docs/scaling.md:
    "`--max N` bounds the deliveries received, so a job never claims work it will not run". With two
    `--subscription`s the budget is applied per consumer: `--once` receives one delivery of each."""
    for topic in (cli_app.BASIC, cli_app.SLOW):
        await cli.publish(topic, {"once": True})
    ran = await cli("work", "--app", APP, "--subscription", cli_app.BASIC, "--subscription", cli_app.SLOW,
                    "--once", "--json", within=30)
    assert ran.json()["Claimed"] == 1, ran.json()


async def test_max_ends_the_worker_once_it_received_n_across_several_subscriptions(cli: Cli) -> None:
    """docs/scaling.md: "`--max N` bounds the deliveries received ... Without `--once` the worker runs until
    it has received N, a signal, or `--max-duration-ms`." With two subscriptions and `--max 2`, the worker
    receives one delivery of each (2 in all) and then never ends: each consumer waits for a second."""
    for topic in (cli_app.CRASH, cli_app.HANG):
        await cli.publish(topic, {"max": True})
    proc = await cli.start("work", "--app", APP, "--subscription", cli_app.CRASH, "--subscription", cli_app.HANG,
                           "--max", "2", "--json")
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 20)
    except TimeoutError:
        proc.terminate()
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        raise AssertionError(
            f"received 2 deliveries but still running 20 s later; after SIGTERM: {out.decode()!r}") from None
    assert proc.returncode == 0, err.decode()
    assert json.loads(out.decode().splitlines()[-1])["Claimed"] == 2
