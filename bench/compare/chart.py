#!/usr/bin/env python3
"""Renders bench/compare/run.py's results.json as a PNG: headline figures vs the peers, and our extra cases.

    python bench/compare/chart.py results.json results.png     # any interpreter with matplotlib

Bars are medians, whiskers min–max over the repeats.
"""

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"fastapi-workqueue": "#2b6cb0", "pgqueuer": "#dd6b20", "procrastinate": "#718096"}


def stat(summary: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    return (summary or {}).get(key)


def bars(ax: Any, title: str, unit: str, items: list[tuple[str, dict[str, Any] | None]], digits: int = 0) -> None:
    names = [n for n, s in items if s]
    if not names:
        ax.set_visible(False)
        return
    meds = [s["median"] for _, s in items if s]
    lo = [s["median"] - s["min"] for _, s in items if s]
    hi = [s["max"] - s["median"] for _, s in items if s]
    colors = [COLORS.get(n, "#4a5568") for n in names]
    ax.bar(range(len(names)), meds, yerr=[lo, hi], capsize=4, color=colors)
    ax.set_xticks(range(len(names)), [n.replace("fastapi-", "") for n in names], fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit, fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    for x, v in enumerate(meds):
        ax.annotate(f"{v:,.{digits}f}", (x, v), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                    textcoords="offset points")


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    res = json.loads(src.read_text())
    ours = res["workqueue"]["summary"]
    pgq = (res.get("pgqueuer") or {}).get("summary")
    pro = (res.get("procrastinate") or {}).get("summary")
    conc = res["settings"]["concurrency"]
    batch = res["settings"]["batch"]
    meta = res["meta"]

    fig, axes = plt.subplots(2, 4, figsize=(16, 8))
    a = axes.flatten()
    peers = [("fastapi-workqueue", ours), ("pgqueuer", pgq), ("procrastinate", pro)]
    keys = {"fastapi-workqueue": ("publish_seq_msgs_per_s", "publish_batch_msgs_per_s",
                                  "process_default_deliveries_per_s", f"process_c{conc}_deliveries_per_s"),
            "pgqueuer": ("enqueue_seq_jobs_per_s", "enqueue_batch500_jobs_per_s", "process_default_jobs_per_s",
                         f"process_c{conc}_jobs_per_s")}
    keys["procrastinate"] = keys["pgqueuer"]
    titles = ["1. publish, 1 per call", f"2. publish, batches of {batch}", "3a. process, library defaults",
              f"3b. process, concurrency {conc}"]
    units = ["messages/s", "messages/s", "deliveries (jobs)/s", "deliveries (jobs)/s"]
    for i in range(4):
        bars(a[i], titles[i], units[i], [(n, stat(s, keys[n][i])) for n, s in peers])
    bars(a[4], "4a. latency p50 (lower is better)", "ms", [(n, stat(s, "latency_p50_ms")) for n, s in peers], 1)
    bars(a[5], "4b. latency p99 (lower is better)", "ms", [(n, stat(s, "latency_p99_ms")) for n, s in peers], 1)
    keyed = [("None", stat(ours, "process_default_deliveries_per_s")),
             ("Exclusive", stat(ours, "exclusive_deliveries_per_s")),
             ("Ordered", stat(ours, "ordered_deliveries_per_s")),
             ("fan-out x5", stat(ours, "fanout_deliveries_per_s"))]
    bars(a[6], f"5. ours by partition mode ({res['settings']['keys']} keys), defaults", "deliveries/s", keyed)
    for p in a[6].patches:
        p.set_color(COLORS["fastapi-workqueue"])
    backlog = [(f"{res['settings']['small']:,}", stat(ours, "backlog_small_claim_p50_ms")),
               (f"{res['settings']['large']:,}", stat(ours, "backlog_large_claim_p50_ms"))]
    bars(a[7], "5. claim round trip by Pending backlog (p50)", "ms", backlog, 2)
    for p in a[7].patches:
        p.set_color(COLORS["fastapi-workqueue"])
    mem = stat(ours, "mem_vmhwm_kib")
    note = f"worker peak RSS draining {res['settings']['mem_jobs']:,}: "
    note += f"{mem['median'] * 1024 / 1e6:.1f} MB" if mem else "n/a"
    fig.suptitle(
        f"fastapi-workqueue vs pgqueuer {res['versions'].get('pgqueuer') or '-'} and procrastinate "
        f"{res['versions'].get('procrastinate') or '-'} — {meta['date_utc']} UTC, commit {meta['commit']}, "
        f"{meta['mode']} run, median and min–max of {res['settings']['repeats']}\n{note}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main()
