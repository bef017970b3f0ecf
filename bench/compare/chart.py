#!/usr/bin/env python3
"""Renders bench/compare/run.py's results.json as a PNG: headline figures vs the peers, and our extra cases.

    python bench/compare/chart.py results.json results.png     # any interpreter with matplotlib

Bars are medians, whiskers min–max over the repeats. A peer without the API for a case shows
"none" where its bar would be; the pgbench ceiling of a single publish is the dashed line of the
first panel. A panel whose bars span more than 50× is drawn on a log scale (DBOS polls its queues
once a second, so its latency and capped processing sit two to three orders of magnitude away).
"""

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"fastapi-workqueue": "#2b6cb0", "pgqueuer": "#dd6b20", "procrastinate": "#718096", "oban": "#6b46c1",
          "dbos": "#2f855a"}
TITLES = {"fastapi-workqueue": "workqueue", "pgqueuer": "pgqueuer", "procrastinate": "procrastinate",
          "oban": "Oban", "dbos": "DBOS"}
LOG_SPREAD = 50


def stat(summary: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    return (summary or {}).get(key)


def bars(ax: Any, title: str, unit: str, items: list[tuple[str, dict[str, Any] | None, str]],
         digits: int = 0) -> None:
    """One bar per item with a figure; an item without one shows its note ("none") in its place."""
    shown = [(n, s, note) for n, s, note in items if s or note]
    if not any(s for _, s, _ in shown):
        ax.set_visible(False)
        return
    meds = [s["median"] if s else 0.0 for _, s, _ in shown]
    lo = [s["median"] - s["min"] if s else 0.0 for _, s, _ in shown]
    hi = [s["max"] - s["median"] if s else 0.0 for _, s, _ in shown]
    ax.bar(range(len(shown)), meds, yerr=[lo, hi], capsize=4, color=[COLORS.get(n, "#4a5568") for n, _, _ in shown])
    ax.set_xticks(range(len(shown)), [TITLES.get(n, n) for n, _, _ in shown], fontsize=8)
    positive = [m for m in meds if m > 0]
    if positive and max(positive) / min(positive) > LOG_SPREAD:
        ax.set_yscale("log")
        title += " (log scale)"
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit, fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    bottom = ax.get_ylim()[0]
    for x, (_, s, note) in enumerate(shown):
        if s:
            ax.annotate(f"{s['median']:,.{digits}f}", (x, s["median"]), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
        else:
            ax.annotate(note, (x, bottom), ha="center", va="bottom", fontsize=8, xytext=(0, 4),
                        textcoords="offset points", style="italic")


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    res = json.loads(src.read_text())
    ours = res["workqueue"]["summary"]
    names = res["settings"].get("peers")
    if names is None:  # a result of before four peers
        names = ["pgqueuer", "procrastinate"]
    summaries = {n: (res.get(n) or {}).get("summary") for n in names}
    conc = res["settings"]["concurrency"]
    batch = res["settings"]["batch"]
    meta = res["meta"]

    fig, axes = plt.subplots(2, 4, figsize=(18, 8.5))
    a = axes.flatten()
    our_keys = ("publish_seq_msgs_per_s", "publish_batch_msgs_per_s", "process_default_deliveries_per_s",
                f"process_c{conc}_deliveries_per_s", "latency_p50_ms", "latency_p99_ms")
    peer_keys = ("enqueue_seq_jobs_per_s", "enqueue_batch500_jobs_per_s", "process_default_jobs_per_s",
                 f"process_c{conc}_jobs_per_s", "latency_p50_ms", "latency_p99_ms")
    titles = ["1. publish, 1 per call", f"2. publish, batches of {batch}", "3a. process, library defaults",
              f"3b. process, concurrency {conc}", "4a. latency p50 (lower is better)",
              "4b. latency p99 (lower is better)"]
    units = ["messages/s", "messages/s", "deliveries (jobs)/s", "deliveries (jobs)/s", "ms", "ms"]
    for i in range(6):
        items = [("fastapi-workqueue", stat(ours, our_keys[i]), "")]
        for n in names:
            s = stat(summaries[n], peer_keys[i])
            # results.json names the figures a peer's library has no API for
            no_api = s is None and summaries[n] and peer_keys[i] in (res.get(n) or {}).get("none", {})
            items.append((n, s, "none" if no_api else ""))
        bars(a[i], titles[i], units[i], items, 1 if i >= 4 else 0)
    ceiling = stat((res.get("ceiling") or {}).get("summary"), "insert_c1_tps")
    if ceiling and a[0].get_visible():
        a[0].axhline(ceiling["median"], color="#c53030", linestyle="--", linewidth=1)
        a[0].annotate(f"ceiling: pgbench INSERT + commit, 1 client, {ceiling['median']:,.0f}/s",
                      (0.02, ceiling["median"]), xycoords=("axes fraction", "data"), va="bottom", fontsize=7,
                      color="#c53030")
        a[0].set_ylim(top=max(a[0].get_ylim()[1], ceiling["max"] * 1.1))
    # The None case the keyed ones are compared with (compare_report.py: older results, 3a's).
    keyed_jobs = res["settings"].get("keyed_jobs")
    keyed = [("None", stat(ours, "keyed_none_deliveries_per_s") or stat(ours, "process_default_deliveries_per_s"), ""),
             ("Exclusive", stat(ours, "exclusive_deliveries_per_s"), ""),
             ("Ordered", stat(ours, "ordered_deliveries_per_s"), ""),
             ("fan-out x5", stat(ours, "fanout_deliveries_per_s"), "")]
    title = f"5. ours by partition mode ({res['settings']['keys']} keys), defaults"
    if keyed_jobs:
        title += f"; keyed and None: {keyed_jobs:,}"
    bars(a[6], title, "deliveries/s", keyed)
    for p in a[6].patches:
        p.set_color(COLORS["fastapi-workqueue"])
    backlog = [(f"{res['settings']['small']:,}", stat(ours, "backlog_small_claim_p50_ms"), ""),
               (f"{res['settings']['large']:,}", stat(ours, "backlog_large_claim_p50_ms"), "")]
    bars(a[7], "5. claim round trip by Pending backlog (p50)", "ms", backlog, 2)
    for p in a[7].patches:
        p.set_color(COLORS["fastapi-workqueue"])
    mem = stat(ours, "mem_vmhwm_kib")
    note = f"worker peak RSS draining {res['settings']['mem_jobs']:,}: "
    note += f"{mem['median'] * 1024 / 1e6:.1f} MB" if mem else "n/a"
    versions = ", ".join(f"{TITLES.get(n, n)} {res['versions'].get(n) or '-'}" for n in names) or "no peers"
    fig.suptitle(
        f"fastapi-workqueue vs {versions} — {meta['date_utc']} UTC, commit {meta['commit']}, "
        f"{meta['mode']} run, median and min–max of {res['settings']['repeats']}\n{note}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main()
