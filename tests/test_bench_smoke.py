"""The benchmark's smoke mode runs end to end, so bench/compare/ cannot rot (the full run is not part of CI)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import asyncpg
import pytest

from fastapi_workqueue.database.postgres import to_asyncpg_dsn

ROOT = Path(__file__).resolve().parent.parent


def smoke_dsn() -> str:
    """A database of its own on the test server (the host of WORKQUEUE_TEST_DATABASE_URL when set)."""
    base = to_asyncpg_dsn(os.environ.get("WORKQUEUE_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/x"))
    return f"{base.rpartition('/')[0]}/workqueue_bench_smoke_{os.getpid()}"


async def drop_database(dsn: str) -> None:
    base, _, name = dsn.rpartition("/")
    admin = await asyncpg.connect(f"{base}/postgres")
    try:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
    finally:
        await admin.close()


def positive(stat: object) -> bool:
    return isinstance(stat, dict) and all(v > 0 for v in (stat["median"], stat["min"], stat["max"]))


@pytest.mark.timeout(300)
async def test_bench_smoke_mode_measures_every_case(tmp_path: Path) -> None:
    dsn = smoke_dsn()
    await drop_database(dsn)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "bench" / "compare" / "run.py"), "--smoke", "--skip-peers", "--no-chart",
        "--workqueue-dsn", dsn, "--out", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, cwd=ROOT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    finally:
        await drop_database(dsn)
        await drop_database(f"{dsn}_small")  # the small backlog's own database
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]

    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["failures"] == []
    summary = result["workqueue"]["summary"]
    conc = result["settings"]["concurrency"]
    for key in (
        "publish_seq_msgs_per_s", "publish_batch_msgs_per_s",
        "process_default_deliveries_per_s", f"process_c{conc}_deliveries_per_s",
        "latency_p50_ms", "latency_p99_ms",
        "keyed_none_deliveries_per_s", "exclusive_deliveries_per_s", "ordered_deliveries_per_s",
        "fanout_deliveries_per_s", "fanout_publish_messages_per_s",
        "backlog_small_claim_p50_ms", "backlog_large_claim_p50_ms",
        "backlog_small_deliveries_per_s", "backlog_large_deliveries_per_s", "backlog_large_fill_seconds",
        "mem_vmhwm_kib", "mem_rss_at_ready_kib", "mem_deliveries_per_s",
    ):
        assert positive(summary.get(key)), f"{key}: {summary.get(key)}"
    assert summary["claim_large_over_small"] > 0
    raw = result["workqueue"]["raw"]
    for key in ("process_default", f"process_c{conc}", "keyed_none", "exclusive", "ordered", "fanout", "mem"):
        for run in raw[key]:
            assert "warning" not in run, run
            assert run["completed_in_db"] == run["deliveries"], run
    assert raw["latency"][0]["received"] == result["settings"]["lat_count"]
    for key in ("backlog_small", "backlog_large"):
        assert raw[key][0]["completed_in_first_n"] == raw[key][0]["first_n"]
    assert {t["target"] for t in result["targets"]}, "the report lists the targets"
    assert (tmp_path / "results.md").read_text().count("|") > 50
