"""The load benchmark's drain target: the drain over the same round's processing, read alike."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "load"))

from load_report import DRAIN_TOLERANCE, summarize_level, targets


def drain_target(drains: list[float], backlogs: list[int], rates: list[float]) -> dict[str, Any]:
    runs = {"host": {"50": [{"drain_rate": d, "backlog_at_stop": b} for d, b in zip(drains, backlogs, strict=True)]}}
    summary = {"host": {"50": summarize_level(runs["host"]["50"])}}
    processing = [{"rate": r} for r in rates]
    [target] = [t for t in targets(summary, processing_rate=sorted(rates)[len(rates) // 2], runs=runs,
                                   processing=processing) if t["target"].startswith("host: drain rate")]
    return target


def test_the_drain_is_read_round_by_round_against_that_rounds_processing() -> None:
    # Medians alone would read 240 / 250 = 0.96; round by round the drains are 1.0, 0.8 and 0.8.
    target = drain_target([300.0, 240.0, 160.0], [4000, 4000, 4000], [300.0, 300.0, 200.0])
    assert target["value"] == 0.8
    assert target["limit"] == DRAIN_TOLERANCE and target["met"] is False
    assert "round by round 1.00, 0.80, 0.80×" in target["note"]


def test_a_drain_within_the_measurements_spread_meets_the_target() -> None:
    target = drain_target([250.0, 285.0, 240.0], [3400, 3900, 3600], [262.0, 279.0, 244.0])
    assert 0.95 < target["value"] < 0.99 and target["met"] is True


def test_nothing_left_to_drain_meets_the_target() -> None:
    target = drain_target([0.0], [0], [250.0])
    assert target["met"] is True and target["note"] == "nothing was left to drain"
