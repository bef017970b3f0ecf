"""bench/compare/run.py's report: a column per peer that ran, "none" where a peer has no API for a
case, and the pgbench ceiling as the denominator of single publish."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "compare"))

from compare_report import PEERS, build_report


def stat(median: float) -> dict[str, Any]:
    return {"median": median, "min": median * 0.9, "max": median * 1.1, "runs": [median]}


def peer_summary(seq: float, batch: float | None, default: float, c10: float, p50: float) -> dict[str, Any]:
    summary = {"enqueue_seq_jobs_per_s": stat(seq), "process_default_jobs_per_s": stat(default),
               "process_c10_jobs_per_s": stat(c10), "latency_p50_ms": stat(p50), "latency_p99_ms": stat(p50 * 2)}
    if batch is not None:
        summary["enqueue_batch500_jobs_per_s"] = stat(batch)
    return summary


def result(peers: list[str] | None, ceiling: dict[str, Any] | None = None) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "concurrency": 10, "batch": 500, "jobs": 20000, "keys": 500, "small": 10_000, "large": 1_000_000,
        "first_n": 20_000, "mem_jobs": 100_000, "fill_batch": 5000, "claim_calls": 250, "claim_limit": 4,
        "repeats": 3, "dbos_c10_jobs": 1000,
    }
    if peers is not None:
        settings["peers"] = peers
    ours = {"publish_seq_msgs_per_s": stat(4000.0), "publish_batch_msgs_per_s": stat(60000.0),
            "process_default_deliveries_per_s": stat(24000.0), "process_c10_deliveries_per_s": stat(24000.0),
            "latency_p50_ms": stat(1.0), "latency_p99_ms": stat(3.0)}
    res: dict[str, Any] = {
        "settings": settings, "workqueue": {"summary": ours},
        "versions": {"pgqueuer": "1.6.0", "procrastinate": "3.10.0", "oban": "0.7.0", "dbos": "3.4.0"},
        "pgqueuer": {"summary": peer_summary(3200.0, 87000.0, 8000.0, 4300.0, 2.0)},
        "procrastinate": {"summary": peer_summary(1300.0, 21000.0, 630.0, 930.0, 3.0)},
        "oban": {"summary": peer_summary(2200.0, 7700.0, 2000.0, 2000.0, 2.8)},
        "dbos": {"summary": peer_summary(1150.0, None, 1750.0, 10.0, 570.0),
                 "settings": {"jobs_concurrency_run": 1000}},
    }
    if ceiling is not None:
        res["ceiling"] = ceiling
    return res


def table_row(table: str, start: str) -> list[str]:
    [line] = [ln for ln in table.splitlines() if ln.startswith(f"| {start}")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_four_peers_get_a_column_each_and_dbos_has_none_for_a_batch() -> None:
    rows, _, table = build_report(result(list(PEERS), {"summary": {"insert_c1_tps": stat(8000.0)}}))
    header = table_row(table, "measurement")
    assert header == ["measurement", "fastapi-workqueue", "pgqueuer 1.6.0", "procrastinate 3.10.0", "Oban 0.7.0",
                      "DBOS 3.4.0", "ours / pgqueuer", "ours / procrastinate", "ours / Oban", "ours / DBOS"]
    batch = table_row(table, "2. publish")
    assert batch[5] == "none" and batch[9] == "–"
    assert batch[4].startswith("7,700 ") and batch[8] == "7.79×"
    assert table_row(table, "4a.")[9] == "0.0018×"  # a small ratio keeps two significant digits
    [row] = [r for r in rows if r["measurement"].startswith("2. publish")]
    assert row["none"] == {"dbos": "no batch API"} and row["dbos"] is None
    assert "runs 1,000 jobs, not 20,000" in table


def test_the_ceiling_is_a_row_and_the_denominator_of_single_publish() -> None:
    _, targets, table = build_report(result(["pgqueuer", "dbos"], {"summary": {"insert_c1_tps": stat(8000.0)}}))
    ceiling = table_row(table, "pgbench, one INSERT + commit per transaction, 1 client")
    assert ceiling[1].startswith("8,000 ")
    assert ceiling[2:] == ["0.50×", "0.40×", "0.14×"]  # ours, pgqueuer, DBOS: single publish / ceiling
    [target] = [t for t in targets if t["target"].startswith("single publish vs the ceiling")]
    assert target["value"] == 0.5 and target["limit"] == 0.5 and target["met"] is True
    assert "Oban" not in table_row(table, "measurement")


def test_without_the_ceiling_the_report_says_why_and_the_target_is_not_measured() -> None:
    _, targets, table = build_report(result(["pgqueuer"], {"error": "pgbench not found"}))
    assert "Ceiling not measured: pgbench not found." in table
    [target] = [t for t in targets if t["target"].startswith("single publish vs the ceiling")]
    assert target["met"] is None


def test_a_result_of_before_four_peers_reads_with_its_two() -> None:
    _, targets, table = build_report(result(None))
    assert table_row(table, "measurement")[2:4] == ["pgqueuer 1.6.0", "procrastinate 3.10.0"]
    assert len(table_row(table, "measurement")) == 6
    assert {t["target"] for t in targets} >= {"single publish vs pgqueuer", "batch publish vs pgqueuer"}


def test_targets_are_the_projects_and_each_is_checked_round_by_round() -> None:
    res = result(["pgqueuer"])
    # Three interleaved rounds: ours beat pgqueuer's single publish 1.2x on the median and in
    # rounds 1 and 3, not in round 2.
    res["workqueue"]["summary"]["publish_seq_msgs_per_s"] = {"median": 3900.0, "min": 3500.0, "max": 4000.0,
                                                             "runs": [4000.0, 3500.0, 3900.0]}
    res["pgqueuer"]["summary"]["enqueue_seq_jobs_per_s"] = {"median": 3200.0, "min": 3100.0, "max": 3250.0,
                                                            "runs": [3200.0, 3250.0, 3100.0]}
    res["workqueue"]["summary"]["publish_batch_msgs_per_s"]["runs"] = [60000.0, 59000.0, 61000.0]
    _, targets, table = build_report(res)
    by_name = {t["target"]: t for t in targets}
    single = by_name["single publish vs pgqueuer"]
    assert single["limit"] == 1.2 and single["met"] is True and single["met_every_round"] is False
    assert [round(r, 3) for r in single["rounds"]] == [1.25, 1.077, 1.258]
    assert "| single publish vs pgqueuer | 1.22× | >= 1.2× | yes | **no** (1.25, 1.08, 1.26) |" in table
    # The limits: 3x pgqueuer's processing, 1.2x its batch, p50 within 1 ms, p99 at most its own.
    assert by_name["processing at defaults vs pgqueuer's defaults"]["limit"] == 3.0
    assert by_name["batch publish vs pgqueuer"]["limit"] == 1.2
    assert by_name["latency p50"]["op"] == "<=" and by_name["latency p50"]["limit"] == 1.0
    assert by_name["latency p99 vs pgqueuer's p99"]["value"] == 3.0 / 4.0
    assert by_name["worker RSS draining 100,000"]["limit"] == 50.0
    # One run on a side and three on the other: no round-by-round verdict, only the median's.
    assert by_name["batch publish vs pgqueuer"]["met_every_round"] is None
