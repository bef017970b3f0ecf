"""Flow limits hold across processes (issue 31): three ``workqueue work`` processes on one
subscription of ``tests/apps/flow_app.py``, on PostgreSQL and on SQLite (a database of the test's own).

The handlers write when each run starts and ends (one file per process, wall-clock times); the
test replays those records to find how many ran at once. ``max_in_flight=5``: never a sixth,
also while one process is SIGKILLed with runs in hand (its slots free when their leases run
out, and the work still completes). ``key_concurrency=2``: never three of one key. A ``20/s``
rate limit: 600 ± 5 % starts in 30 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import PublishRequest
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.database import create_database_transport
from fastapi_workqueue.database.routines import RoutineTransport
from tests.apps import flow_app

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
APP = "tests.apps.flow_app:queue"
WORKERS = 3


class Fleet:
    """Three worker processes on one subscription, and what their handlers recorded."""

    def __init__(self, url: str, folder: Path, subscription: str) -> None:
        self.url, self.folder, self.subscription = url, folder, subscription
        self.record = folder / "runs"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.killed_at: dict[int, float] = {}

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
        env.update(PYTHONPATH=str(ROOT), WORKQUEUE_DATABASE_URL=self.url, FLOW_APP_RECORD=str(self.record),
                   PYTHONUNBUFFERED="1")
        for i in range(WORKERS):
            with (self.folder / f"w{i}.err").open("wb") as err:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "fastapi_workqueue", "work", "--app", APP, "--subscription",
                     self.subscription],
                    cwd=self.folder, env=env, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL))

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        self.killed_at[proc.pid] = time.time()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def errors(self) -> str:
        return "\n".join((self.folder / f"w{i}.err").read_text(errors="replace")[-3000:] for i in range(WORKERS))

    def runs(self) -> list[dict[str, Any]]:
        lines = []
        for path in self.folder.glob("runs.*"):
            lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return lines

    def intervals(self) -> list[tuple[float, float, str | None]]:
        """Each run as (start, end, key): a run of a killed process without an end ended at the kill."""
        starts: dict[tuple[str, int, int], dict[str, Any]] = {}
        ends: dict[tuple[str, int, int], float] = {}
        for run in self.runs():
            ident = (run["message_id"], run["attempt"], run["pid"])
            if run["event"] == "start":
                starts[ident] = run
            else:
                ends[ident] = run["at"]
        out = []
        for ident, run in starts.items():
            end = ends.get(ident, self.killed_at.get(run["pid"], time.time()))
            out.append((run["at"], end, run["key"]))
        return out


def peak(intervals: list[tuple[float, float, str | None]]) -> int:
    """The most runs at once: a run counts from its start until its end (an end before a start at
    the same instant)."""
    events = sorted([(end, -1) for _, end, _ in intervals] + [(start, 1) for start, _, _ in intervals])
    running = best = 0
    for _, step in events:
        running += step
        best = max(best, running)
    return best


@pytest.fixture
async def store(fresh_url: str) -> AsyncIterator[RoutineTransport]:
    transport = create_database_transport(fresh_url)
    await transport.open()
    await transport.migrate()
    yield transport
    await transport.close()


@asynccontextmanager
async def fleet(url: str, folder: Path, subscription: str) -> AsyncIterator[Fleet]:
    workers = Fleet(url, folder, subscription)
    workers.start()
    try:
        yield workers
    finally:
        workers.stop()


async def wait_until(check: Any, within: float, what: str, fleet: Fleet) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {within} s\n{fleet.errors()}")
        await asyncio.sleep(0.1)


async def declared(store: RoutineTransport, subscription: str) -> bool:
    return any(s.name == subscription for s in await store.list_subscriptions())


async def completed(store: RoutineTransport, subscription: str, count: int) -> bool:
    stats = await store.stats(subscription)
    return bool(stats) and stats[0].completed >= count


async def test_max_in_flight_never_runs_a_sixth_across_three_processes(
    store: RoutineTransport, fresh_url: str, tmp_path: Path
) -> None:
    total = 80
    async with fleet(fresh_url, tmp_path, flow_app.LIMITED) as workers:
        await wait_until(lambda: declared(store, flow_app.LIMITED), 60, "the workers declared nothing", workers)
        await store.publish(flow_app.LIMITED, [prepare(PublishRequest(payload={"sleep": 0.2})) for _ in range(total)])
        await wait_until(lambda: asyncio.sleep(0, len(workers.runs()) >= 20), 60, "20 runs did not start", workers)
        workers.kill(workers.procs[0])  # its runs in hand hold their slots until their leases run out
        await wait_until(lambda: completed(store, flow_app.LIMITED, total), 120, "the work did not complete",
                         workers)
    intervals = workers.intervals()
    assert peak(intervals) == 5, f"peak {peak(intervals)} (never above max_in_flight 5, and the limit was reached)"


async def test_key_concurrency_never_runs_three_of_one_key_across_three_processes(
    store: RoutineTransport, fresh_url: str, tmp_path: Path
) -> None:
    keys, per_key = 3, 15
    async with fleet(fresh_url, tmp_path, flow_app.KEYS) as workers:
        await wait_until(lambda: declared(store, flow_app.KEYS), 60, "the workers declared nothing", workers)
        messages = [PublishRequest(payload={"sleep": 0.15}, partition_key=f"k{i % keys}")
                    for i in range(keys * per_key)]
        await store.publish(flow_app.KEYS, [prepare(m) for m in messages])
        await wait_until(lambda: completed(store, flow_app.KEYS, keys * per_key), 120, "the work did not complete",
                         workers)
    by_key: dict[str | None, list[tuple[float, float, str | None]]] = defaultdict(list)
    for interval in workers.intervals():
        by_key[interval[2]].append(interval)
    assert {key: peak(runs) for key, runs in by_key.items()} == {f"k{i}": 2 for i in range(keys)}


async def test_a_20_per_second_rate_limit_runs_600_in_30_seconds_across_three_processes(
    store: RoutineTransport, fresh_url: str, tmp_path: Path
) -> None:
    window = 30.0
    async with fleet(fresh_url, tmp_path, flow_app.RATE) as workers:
        await wait_until(lambda: declared(store, flow_app.RATE), 60, "the workers declared nothing", workers)
        for _ in range(2):
            await store.publish(flow_app.RATE, [prepare(PublishRequest(payload={"sleep": 0.01})) for _ in range(500)])
        await wait_until(lambda: asyncio.sleep(0, bool(workers.runs())), 60, "nothing started", workers)
        first = min(run["at"] for run in workers.runs())
        await asyncio.sleep(max(0.0, first + window + 1.0 - time.time()))
        starts = [run["at"] for run in workers.runs() if run["event"] == "start"]
    in_window = sum(1 for at in starts if first <= at < first + window)
    assert 570 <= in_window <= 630, f"{in_window} started in {window:.0f} s (20/s: 600 ± 5 %)"
    assert len({run["pid"] for run in workers.runs()}) == WORKERS, "every process took part"
