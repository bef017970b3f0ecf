"""The load benchmark's smoke mode runs end to end, so bench/load/load.py cannot rot (the full run is not CI's).

It runs every set-up (the example app under uvicorn with 2 workers, its host or its workers
consuming, and the baseline route) at 1 and 8 clients for 2 s against the test server, in a
database of its own, and checks what the benchmark found: throughput, no error at one client,
every accepted order with exactly one message whose deliveries all completed, every field.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from fastapi_workqueue.database.postgres import to_asyncpg_dsn

ROOT = Path(__file__).resolve().parent.parent
SETUPS = ("host", "worker", "baseline", "publish")
LEVELS = ("1", "8")

RUN_FIELDS = (
    "setup", "clients", "round", "window_s", "requests", "accepted", "rps", "answered_rps", "latency_p50_ms",
    "latency_p99_ms", "latency_max_ms", "errors", "errors_by_kind", "client_cpu_seconds", "client_cpu_share",
    "load_window_s", "backlog_at_end", "backlog_at_stop", "drained", "drain_seconds", "drain_rate", "calls",
    "function_ms_per_order", "commits_per_s", "sessions_opened", "cpu_load", "cpu_drain", "loadavg_before",
    "loadavg_after", "check", "orders_without_201", "violations", "listeners",
)
PUBLISHED_FIELDS = (
    "e2e_p50_ms", "e2e_p99_ms", "e2e_max_ms", "publish_calls", "deliveries_completed", "claims",
    "claims_with_work", "claims_empty", "claims_per_delivery", "empty_claim_share", "notifies",
    "notifies_per_publish", "wakeups_per_publish",
)
CPU_ROLES = ("app", "workers", "pg_backends", "pg_background", "client", "bench", "other", "unseen")


def server() -> str:
    """The test server (the host of WORKQUEUE_TEST_DATABASE_URL when set), without a database."""
    dsn = to_asyncpg_dsn(os.environ.get("WORKQUEUE_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/x"))
    return dsn.rpartition("/")[0]


async def drop_database(base: str, name: str) -> None:
    admin = await asyncpg.connect(f"{base}/postgres")
    try:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
    finally:
        await admin.close()


def median(summary: dict[str, Any], key: str) -> float:
    stat = summary[key]
    assert isinstance(stat, dict), (key, stat)
    return float(stat["median"])


@pytest.mark.timeout(300)
async def test_bench_load_smoke_mode_drives_every_setup(tmp_path: Path) -> None:
    base, name = server(), f"workqueue_bench_load_smoke_{os.getpid()}"
    output = tmp_path / "load.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "bench" / "load" / "load.py"), "--smoke", "--pg-url", base, "--database", name,
        "--output", str(output),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, cwd=ROOT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    finally:
        await drop_database(base, name)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]

    result = json.loads(output.read_text())
    for key in ("date_utc", "commit", "command", "mode", "host", "versions", "minutes"):
        assert key in result["meta"], key
    assert result["meta"]["mode"] == "smoke"
    assert result["settings"]["clients"] == [1, 8]
    assert set(result["settings"]["setups"]) == set(SETUPS)
    assert result["server"]["server_version"]
    assert result["violations"] == [], result["violations"]
    for setup in SETUPS:
        for level in LEVELS:
            [run] = result["runs"][setup][level]
            missing = [f for f in RUN_FIELDS + (PUBLISHED_FIELDS if setup != "baseline" else ()) if f not in run]
            assert not missing, (setup, level, missing)
            assert set(CPU_ROLES) <= set(run["cpu_load"]["seconds"]) | {"workers", "pg_background", "other"}
            assert run["rps"] > 0, (setup, level, run["rps"])
            assert run["violations"] == 0, run["check"]
            check = run["check"]
            assert check["accepted"] == run["accepted"] > 0
            assert check["orders_missing"] == 0
            if setup == "baseline":
                assert check["messages_published"] == 0, check
                continue
            # Every 201 order has exactly one message, with one delivery per subscription, all Completed.
            assert check["messages_missing"] == 0, check
            assert check["messages_without_all_deliveries"] == 0, check
            assert check["deliveries"] == 2 * run["accepted"], check
            assert check["deliveries_not_completed"] == 0, check
            assert run["drained"] is True
            assert run["e2e_p50_ms"] > 0 and run["claims"] > 0 and run["listeners"] == 2, run
            assert run["deliveries_completed"] == 2 * run["accepted"]
        assert result["runs"][setup]["1"][0]["errors"] == 0, result["runs"][setup]["1"][0]["errors_by_kind"]
        for level in LEVELS:
            summary = result["summary"][setup][level]
            assert median(summary, "rps") > 0
            assert summary["latency_p99_ms"] and summary["cores.app"]
    assert len(result["targets"]) == 8
    [publishing] = [t for t in result["targets"] if t["target"].startswith("publishing alone")]
    assert publishing["value"] is not None and publishing["value"] > 0, publishing
    # the host set-up drained the orders stored before it started, with no HTTP load
    [processing] = result["processing"]
    assert processing["deliveries"] == 2 * processing["orders"] == 100 and processing["left"] == 0
    assert processing["rate"] > 0 and result["processing_rate"] == processing["rate"]
    assert all({"target", "value", "limit", "met"} <= set(t) for t in result["targets"])
    assert result["activity"]["host, 8 clients"]["samples"] > 0
    assert result["table_markdown"].count("|") > 100
    assert "claims / delivery" in text and "| target |" in text
