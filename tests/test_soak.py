"""The soak and chaos run, short: what CI runs of ``python -m tests.soak.run`` (docs/soak.md).

3,000 messages from 500 producers (one per key, each awaiting its acceptance) through the REST
API over 75 s, into the app under uvicorn (host on) and one ``workqueue work`` process per
subscription (None, Exclusive, Ordered). Meanwhile three worker processes are SIGKILLed and
restarted, ten InFlight deliveries are cancelled and PostgreSQL is restarted once, while a
checker polls the database every 100 ms. The runner checks every invariant at the end and
writes a JSON report; this test asserts that the report has no violation and that every chaos
event happened.

The run gets a PostgreSQL cluster of its own (tests/private_cluster.py: a temp folder and a free
port, stopped and removed at the end whatever happens), and the restart is that cluster's: the
machine's server on 5432, which other work shares, is never restarted (the test checks that its
start time did not change). The run is a process group of its own: whatever happens, every
process it started is killed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from fastapi_workqueue.database.postgres import to_asyncpg_dsn
from tests.conftest import PG_URL
from tests.private_cluster import PrivateCluster, private_cluster, unavailable_reason

pytestmark = pytest.mark.timeout(360)

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = 3000
KEYS = 500
DURATION = 75
RUN_TIMEOUT = 320.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[PrivateCluster]:
    """A private PostgreSQL cluster for this module's runs, removed at the end."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"the soak run restarts a private PostgreSQL cluster, and none can be made here: {reason}")
    with private_cluster() as made:
        yield made


async def started_at(dsn: str) -> datetime:
    conn = await asyncpg.connect(dsn)
    try:
        value: datetime = await conn.fetchval("SELECT pg_postmaster_start_time()")
        return value
    finally:
        await conn.close()


def shared_server() -> str:
    """The admin DSN of the server the other tests use (127.0.0.1:5432 unless configured)."""
    return to_asyncpg_dsn(PG_URL).rpartition("/")[0] + "/postgres"


async def run_soak(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.soak.run", *args, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith(("WORKQUEUE_", "SOAK_"))},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, output.decode(errors="replace")


async def database_exists(dsn: str, name: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return bool(await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name))
    finally:
        await conn.close()


async def test_soak_run_refuses_to_restart_a_server_it_was_not_given(tmp_path: Path, cluster: PrivateCluster) -> None:
    """A database URL alone names no cluster to restart; a data folder of another server is refused."""
    name = f"workqueue_soak_refused_{os.getpid()}"
    shared_url = f"{PG_URL.rsplit('/', 1)[0]}/{name}"
    before = await started_at(shared_server())

    logs = ("--log-dir", str(tmp_path / "logs"))
    code, output = await run_soak("--database-url", shared_url, "--messages", "1", "--duration", "1", *logs)
    assert code == 2, output
    assert "restarts only a PostgreSQL cluster it was given" in output and "--pg-data-dir" in output

    # The private cluster's data folder with a URL on another port: refused before any database is made.
    code, output = await run_soak("--database-url", shared_url, "--pg-data-dir", str(cluster.data),
                                  "--messages", "1", "--duration", "1", *logs)
    assert code == 2, output
    assert f"listens on port {cluster.port}" in output, output
    assert not await database_exists(shared_server(), name)
    assert await started_at(shared_server()) == before


async def test_short_soak_run_keeps_every_invariant(tmp_path: Path, cluster: PrivateCluster) -> None:
    url = cluster.url(f"workqueue_soak_ci_{os.getpid()}")
    shared_before = await started_at(shared_server())
    private_before = await started_at(cluster.url(driver="postgresql"))
    report_path = tmp_path / "report.json"
    began = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.soak.run",
        "--messages", str(MESSAGES), "--keys", str(KEYS), "--duration", str(DURATION), "--workers", "1",
        "--kills", "3", "--cancels", "10", "--drain-timeout", "90",
        "--database-url", url, "--pg-data-dir", str(cluster.data),
        "--report", str(report_path), "--log-dir", str(tmp_path / "logs"),
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith(("WORKQUEUE_", "SOAK_"))},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # the runner and every worker it starts: one process group
    )
    output = b""
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT)
    except TimeoutError:
        pytest.fail(f"the soak run did not end within {RUN_TIMEOUT} s")
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # any worker left behind
    elapsed = time.monotonic() - began
    text = output.decode(errors="replace")
    print(text)
    assert report_path.exists(), f"the soak run wrote no report (exit {proc.returncode}):\n{text[-5000:]}"
    report: dict[str, Any] = json.loads(report_path.read_text())

    assert report["violations"] == [], "\n".join(report["violations"])
    assert proc.returncode == 0, text[-5000:]
    assert report["publish"]["accepted"] == MESSAGES
    held = report["publish"]["cancel_messages"]  # each cancel publishes a message of its own
    assert held == 10
    assert report["publish"]["stored_messages"] == MESSAGES + held
    counts = report["deliveries"]
    assert set(counts) == {"soak.none", "soak.exclusive", "soak.ordered"}
    assert all(sum(c.values()) == MESSAGES + held for c in counts.values()), counts
    assert sum(c.get("Completed", 0) for c in counts.values()) >= 3 * MESSAGES - 10 - 20, counts
    assert report["handler_runs"]["by_outcome"].get("transient", 0) > 0, "no handler failed: the 2 % did not happen"

    chaos = report["chaos"]
    assert len(chaos["kills"]) == 3
    assert all(k["restarted_pid"] and k["ready_after_s"] is not None for k in chaos["kills"]), chaos["kills"]
    assert {k["process"] for k in chaos["kills"]} >= {"app", "work-ordered-1"}
    assert sum(k["held_in_flight"] for k in chaos["kills"]) > 0, "no kill hit a worker holding deliveries"
    assert len(chaos["cancels"]) == 10
    assert all(c["final_status"] == "Discarded" for c in chaos["cancels"])
    # The runtime aborted the running handler (unless a kill took its process first).
    assert sum("aborted:Cancelled" in c["runs"] for c in chaos["cancels"]) >= 8, chaos["cancels"]
    restart = chaos["pg_restart"]
    assert restart is not None and restart["exit"] == 0
    assert restart["processes"], "no worker process lived through the PostgreSQL restart"
    assert report["config"]["pg_restart"] == " ".join(cluster.restart_command())
    # The private cluster was restarted; the machine's server was not.
    assert await started_at(cluster.url(driver="postgresql")) > private_before
    assert await started_at(shared_server()) == shared_before
    assert report["checker"]["polls"] > 100
    print(f"soak test took {elapsed:.0f} s")
