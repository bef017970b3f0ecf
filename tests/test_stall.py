"""A worker stopped (SIGSTOP) inside its claim for longer than the lease never runs what it claimed
alongside the worker that took it over: no delivery in two handlers at once, no key with two holders.

Worker A claims three keys' heads and stops itself inside the claim, after the store committed it
(tests/apps/stall_app.py). Worker B starts; its sweeper expires A's leases and B runs the
deliveries. Once B's handlers are running, A is continued with SIGCONT. A must give the deliveries
back instead of starting them (it logs each one it gives back). Every handler run is recorded with
wall-clock start and end times by both processes; no two runs of one delivery, and no two runs of
one key, may overlap. The test runs on PostgreSQL and on an SQLite file shared by both processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkQueue, WorkQueueSettings

from .conftest import unique
from .support import wait_for

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
LEASE_SECONDS = 2.0
HANDLER_SECONDS = 3.0
KEYS = 3


def runs(record: Path) -> list[dict[str, Any]]:
    """Each handler run: its delivery, key, attempt, process, start and end."""
    started: dict[tuple[Any, ...], dict[str, Any]] = {}
    done = []
    for line in record.read_text().splitlines():
        event = json.loads(line)
        ident = (event["pid"], event["delivery_id"], event["attempt"])
        if event["event"] == "start":
            started[ident] = event
        else:
            done.append({**started.pop(ident), "end": event["at"], "reason": event["reason"]})
    assert not started, f"handler runs without an end: {started}"
    return done


def overlaps(spans: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    spans = sorted(spans, key=lambda r: r["at"])
    return [(a, b) for a, b in itertools.pairwise(spans) if b["at"] < a["end"]]


async def test_a_worker_stalled_inside_its_claim_past_the_lease_runs_nothing_twice(
    database_url: str, tmp_path: Path
) -> None:
    topic, name = unique("stall-topic"), unique("stall-sub")
    record, marker = tmp_path / "runs.jsonl", tmp_path / "stopped"
    record.touch()
    env = {
        **os.environ, "WORKQUEUE_DATABASE_URL": database_url, "STALL_APP_TOPIC": topic, "STALL_APP_SUBSCRIPTION": name,
        "STALL_APP_LEASE_SECONDS": str(LEASE_SECONDS), "STALL_APP_HANDLER_SECONDS": str(HANDLER_SECONDS),
        "STALL_APP_RECORD": str(record), "PYTHONPATH": str(ROOT),
    }
    queue = WorkQueue(
        WorkQueueSettings(database_url=database_url, auto_migrate=True, enabled=False),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=name, topic=topic, handler_key="stall.record", partition_mode="Exclusive",
                                    lease_seconds=LEASE_SECONDS, max_attempts=10)],
    )
    command = [sys.executable, "-m", "fastapi_workqueue", "work", "--app", "tests.apps.stall_app:queue",
               "--subscription", name]
    workers: list[asyncio.subprocess.Process] = []
    # What the workers log goes to files: a pipe nobody reads while they run fills (64 KB: B's
    # sweeper logs a line for each lease it takes back, other tests' too in the session's database)
    # and stops the worker that writes to it.
    a_log, b_log = tmp_path / "a.err", tmp_path / "b.err"
    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(partition_key=f"k{i}", payload=i) for i in range(KEYS)])
        try:
            with a_log.open("wb") as a_err:
                a = await asyncio.create_subprocess_exec(
                    *command, env={**env, "STALL_APP_STOP_MARKER": str(marker)}, cwd=ROOT,
                    stdout=asyncio.subprocess.DEVNULL, stderr=a_err,
                )
            workers.append(a)
            await wait_for(marker.exists, within=30, describe=lambda: "worker A has not claimed and stopped")
            stalled = json.loads(marker.read_text())
            assert len(stalled) == KEYS
            with b_log.open("wb") as b_err:
                b = await asyncio.create_subprocess_exec(
                    *command, env=env, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=b_err,
                )
            workers.append(b)
            # B's sweeper takes the expired leases back and B runs what A claimed.
            await wait_for(lambda: _started_by(record, b.pid) >= KEYS, within=30,
                           describe=lambda: f"worker B has not run A's deliveries: {record.read_text()}")
            os.kill(a.pid, signal.SIGCONT)
            # A's claim returns: with too little of their leases left, A gives each delivery back.
            await wait_for(lambda: a_log.read_text().count("not started") >= KEYS, within=30,
                           describe=lambda: a_log.read_text())
            await wait_for(lambda: _completed(record) >= KEYS, within=30, describe=lambda: record.read_text())
        finally:
            for proc in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.send_signal(signal.SIGTERM)
            for proc, log in zip(workers, (a_log, b_log), strict=False):
                await asyncio.wait_for(proc.wait(), 30)
                assert proc.returncode == 0, log.read_text()[-3000:]
        [stats] = await queue.stats(name)
        assert (stats.completed, stats.pending, stats.in_flight) == (KEYS, 0, 0)
    done = runs(record)
    by_delivery: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in done:
        by_delivery[run["delivery_id"]].append(run)
        by_key[run["key"]].append(run)
    assert sorted(by_delivery) == sorted(stalled)
    assert all(not overlaps(spans) for spans in by_delivery.values()), by_delivery
    assert all(not overlaps(spans) for spans in by_key.values()), by_key
    assert {r["pid"] for r in done if r["reason"] is None} == {b.pid}, done


def _started_by(record: Path, pid: int | None) -> int:
    return sum(1 for line in record.read_text().splitlines()
               if (e := json.loads(line))["event"] == "start" and e["pid"] == pid)


def _completed(record: Path) -> int:
    return sum(1 for line in record.read_text().splitlines()
               if (e := json.loads(line))["event"] == "end" and e["reason"] is None)

