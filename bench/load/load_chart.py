#!/usr/bin/env python3
"""Renders bench/load/load.py's JSON as a PNG: throughput, latency, end-to-end, claims, CPU, backlog.

    python bench/load/load_chart.py bench/load/results/load.json bench/load/last-run.png   # any Python with matplotlib

Points are medians over the repeats, whiskers min–max.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"host": "#2b6cb0", "worker": "#dd6b20", "baseline": "#718096", "host-poll": "#38a169",
          "host-async-commit": "#805ad5"}
ROLES = [("app", "app", "#2b6cb0"), ("workers", "workers", "#dd6b20"),
         ("pg_backends", "PostgreSQL backends", "#2f855a"),
         ("pg_background", "PostgreSQL shared", "#9ae6b4"), ("client", "client", "#a0aec0"),
         ("bench", "bench", "#e2e8f0"), ("other", "other work", "#feb2b2"),
         ("unseen", "unseen (short-lived, kernel)", "#fed7d7")]


def series(summary: dict[str, Any], setup: str, key: str) -> tuple[list[int], list[float], list[list[float]]]:
    xs, ys, lo, hi = [], [], [], []
    for clients, s in summary.get(setup, {}).items():
        stat = s.get(key)
        if stat:
            xs.append(int(clients))
            ys.append(stat["median"])
            lo.append(stat["median"] - stat["min"])
            hi.append(stat["max"] - stat["median"])
    return xs, ys, [lo, hi]


def lines(ax: Any, summary: dict[str, Any], key: str, setups: list[str], style: str = "-o", label: str = "",
          log_y: bool = False) -> None:
    for setup in setups:
        xs, ys, err = series(summary, setup, key)
        if xs:
            ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=3, color=COLORS.get(setup, "#4a5568"),
                        label=f"{setup}{label}", markersize=4)
    ax.set_xscale("log")
    levels = sorted({int(c) for s in summary.values() for c in s})
    ax.set_xticks(levels, [str(x) for x in levels])
    ax.minorticks_off()
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("concurrent clients", fontsize=8)
    ax.tick_params(labelsize=8)


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    res = json.loads(src.read_text())
    summary = res["summary"]
    setups = list(summary)
    published = [s for s in setups if s != "baseline"]
    meta = res["meta"]

    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    a = axes.flatten()
    lines(a[0], summary, "rps", setups)
    a[0].set_title("throughput: 201 answers per second", fontsize=10)
    a[0].set_ylabel("requests/s", fontsize=8)
    a[0].set_ylim(bottom=0)
    a[0].legend(fontsize=7)

    lines(a[1], summary, "latency_p50_ms", setups, "-o", " p50", log_y=True)
    lines(a[1], summary, "latency_p99_ms", setups, "--^", " p99", log_y=True)
    a[1].axhline(250, color="#c53030", lw=0.8, ls=":")
    a[1].set_title("request latency (target: p99 <= 250 ms at 50 clients)", fontsize=10)
    a[1].set_ylabel("ms", fontsize=8)
    a[1].legend(fontsize=6, ncol=2)

    lines(a[2], summary, "e2e_p50_ms", published, "-o", " p50", log_y=True)
    lines(a[2], summary, "e2e_p99_ms", published, "--^", " p99", log_y=True)
    a[2].set_title("end to end: request start to the last delivery's settle", fontsize=10)
    a[2].set_ylabel("ms", fontsize=8)
    a[2].legend(fontsize=6, ncol=2)

    lines(a[3], summary, "claims_per_delivery", published)
    lines(a[3], summary, "notifies_per_publish", published, ":s", " NOTIFY/publish")
    a[3].axhline(1.5, color="#c53030", lw=0.8, ls=":")
    a[3].set_title("claims per delivery (target <= 1.5), NOTIFYs per publish", fontsize=10)
    a[3].set_ylim(bottom=0)
    a[3].legend(fontsize=6)

    levels = sorted({int(c) for s in summary.values() for c in s})
    level = 50 if 50 in levels else levels[-1]
    bottoms = [0.0] * len(setups)
    for role, label, color in ROLES:
        values = []
        for setup in setups:
            stat = summary[setup].get(str(level), {}).get(f"cores.{role}")
            values.append(stat["median"] if stat else 0.0)
        a[4].bar(range(len(setups)), values, bottom=bottoms, color=color, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    a[4].axhline(meta["host"]["cpus"], color="#c53030", lw=0.8, ls=":")
    a[4].set_xticks(range(len(setups)), setups, fontsize=7)
    a[4].set_title(f"CPU while the load ran, {level} clients (cores; the machine has {meta['host']['cpus']})",
                   fontsize=10)
    a[4].tick_params(labelsize=8)
    a[4].legend(fontsize=6, loc="upper right")

    width = 0.8 / max(len(published), 1)
    for i, setup in enumerate(published):
        xs, ys, err = series(summary, setup, "backlog_at_stop")
        pos = [levels.index(x) + i * width for x in xs]
        a[5].bar(pos, ys, width=width, yerr=err, capsize=2, color=COLORS.get(setup, "#4a5568"), label=setup)
        rates = {int(c): s.get("drain_rate") for c, s in summary[setup].items()}
        for p, x, y in zip(pos, xs, ys, strict=True):
            rate = rates.get(x)
            if rate:
                a[5].annotate(f"{rate['median']:,.0f}/s", (p, y), ha="center", va="bottom", fontsize=6,
                              rotation=90, xytext=(0, 2), textcoords="offset points")
    a[5].set_xticks([i + width * (len(published) - 1) / 2 for i in range(len(levels))], [str(x) for x in levels],
                    fontsize=8)
    a[5].set_xlabel("concurrent clients", fontsize=8)
    a[5].set_title("backlog when the load stopped (deliveries) and its drain rate", fontsize=10)
    a[5].tick_params(labelsize=8)
    a[5].legend(fontsize=6)

    fig.suptitle(
        f"fastapi-workqueue load benchmark: the example app under uvicorn (2 workers) on PostgreSQL — "
        f"{meta['date_utc']} UTC, commit {meta['commit']}, {meta['mode']} run, median and min–max of "
        f"{res['settings']['repeats']}, {res['settings']['duration_s']:g} s per level; load average "
        f"{meta['host']['loadavg_start'][0]} → {meta['host']['loadavg_end'][0]} (shared machine)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main()
