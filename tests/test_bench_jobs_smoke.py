"""The jobs benchmark's smoke mode runs end to end, so bench/jobs/jobs_bench.py cannot rot."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from tests.test_bench_smoke import drop_database, positive, smoke_dsn

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
async def test_jobs_bench_smoke_mode_measures_every_case(tmp_path: Path) -> None:
    dsn = smoke_dsn().replace("workqueue_bench_smoke_", "workqueue_jobs_bench_smoke_")
    core_dsn = dsn + "_core"
    five_dsn = dsn + "_five"
    for url in (dsn, five_dsn, core_dsn):
        await drop_database(url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "bench" / "jobs" / "jobs_bench.py"), "--smoke", "--no-chart",
        "--dsn", dsn, "--core-dsn", core_dsn, "--out", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, cwd=ROOT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    finally:
        for url in (dsn, five_dsn, core_dsn):
            await drop_database(url)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]

    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["failures"] == []
    summary = result["jobs"]["summary"]
    for key in (
        "dispatch_seq_jobs_per_s", "publish_seq_msgs_per_s", "bulk_jobs_per_s", "publish_batch_msgs_per_s",
        "jobs_process_per_s", "process_default_per_s", "jobs_five_per_s",
    ):
        assert positive(summary.get(key)), f"{key}: {summary.get(key)}"
    raw = result["jobs"]["raw"]
    for key in ("jobs_process", "process_default", "jobs_five"):
        for run in raw[key]:
            assert "warning" not in run, run
            assert run["completed_in_db"] == run["deliveries"], run
    for key in ("jobs_process", "process_default"):  # two turns a round in smoke mode, summed
        for run in raw[key]:
            assert len(run["turns"]) == 2, run
            assert run["deliveries"] == sum(t["deliveries"] for t in run["turns"])
            assert run["deliveries_per_s"] == pytest.approx(
                run["deliveries"] / sum(t["seconds"] for t in run["turns"]))
    assert raw["jobs_five"][0]["queues"] == ["a", "b", "c", "d", "e"]
    assert result["settings"]["jobs_five_database"] == five_dsn
    targets = {t["target"]: t for t in result["targets"]}
    assert len(targets) == 5
    assert all(t["value"] is not None for name, t in targets.items() if "pgqueuer" not in name), targets
    assert (tmp_path / "results.md").read_text().count("|") > 30
