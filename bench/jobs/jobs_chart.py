#!/usr/bin/env python3
"""Renders bench/jobs/jobs_bench.py's results.json as a PNG: each jobs case beside what it is compared with.

    python bench/jobs/jobs_chart.py results.json results.png     # any interpreter with matplotlib

Bars are medians, whiskers min–max over the rounds (bench/compare/chart.py's ``bars``).
"""

import json
import sys
from pathlib import Path

import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compare"))  # chart.py

from chart import COLORS, bars

JOBS, CORE = "jobs", "core"
COLORS = {**COLORS, JOBS: "#2f855a", CORE: COLORS["fastapi-workqueue"]}


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    res = json.loads(src.read_text())
    ours = res["jobs"]["summary"]
    pgq = (res.get("pgqueuer") or {}).get("summary") or {}
    batch = res["settings"]["batch"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.5))
    # (name, figure, note): the note ("") shows only where a figure is missing (compare/chart.py's bars).
    bars(axes[0], "dispatch / publish, 1 per call", "per second",
         [(JOBS, ours.get("dispatch_seq_jobs_per_s"), ""), (CORE, ours.get("publish_seq_msgs_per_s"), "")])
    bars(axes[1], f"bulk / batch publish of {batch}", "per second",
         [(JOBS, ours.get("bulk_jobs_per_s"), ""), (CORE, ours.get("publish_batch_msgs_per_s"), "")])
    bars(axes[2], "processing no-ops, defaults", "per second",
         [(JOBS, ours.get("jobs_process_per_s"), ""), (CORE, ours.get("process_default_per_s"), ""),
          ("pgqueuer", pgq.get("process_default_jobs_per_s"), "")])
    bars(axes[3], "jobs: one queue vs five taken fairly", "jobs/s",
         [("1 queue", ours.get("jobs_process_per_s"), ""), ("5 queues", ours.get("jobs_five_per_s"), "")])
    for ax in axes[:3]:
        for patch, label in zip(ax.patches, [t.get_text() for t in ax.get_xticklabels()], strict=False):
            patch.set_color(COLORS.get(label, COLORS[JOBS]))
    for patch in axes[3].patches:
        patch.set_color(COLORS[JOBS])
    meta = res["meta"]
    fig.suptitle(f"jobs layer vs the core and pgqueuer {res['versions'].get('pgqueuer') or '-'} — "
                 f"{meta['date_utc']} UTC, commit {meta['commit']}, {meta['mode']} run, median and min–max of "
                 f"{res['settings']['repeats']}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main()
