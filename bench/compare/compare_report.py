"""bench/compare/run.py's report: the peers it knows, and the Markdown table, rows and targets of a result.

Apart from run.py so that it imports nothing of the library's (workqueue_bench.py clears the
``WORKQUEUE_*`` environment on import) and can be read and tested on a result alone.
"""

from typing import Any

# Each peer: its script in peers/, its database, what its venv installs from PyPI, the Python it
# needs, how the report names it, the packages whose versions results.json records, and the figures
# its library has no API for (shown as "none").
PEERS: dict[str, dict[str, Any]] = {
    "pgqueuer": {"script": "bench_pgqueuer.py", "db": "bench_pgqueuer", "pip": ["pgqueuer>=1,<2", "asyncpg"],
                 "python": "3.11", "title": "pgqueuer", "packages": ["pgqueuer", "asyncpg", "uvloop"]},
    "procrastinate": {"script": "bench_procrastinate.py", "db": "bench_procrastinate",
                      "pip": ["procrastinate[psycopg]>=3,<4"], "python": "3.11", "title": "procrastinate",
                      "packages": ["procrastinate", "psycopg", "psycopg-pool"]},
    "oban": {"script": "bench_oban.py", "db": "bench_oban", "pip": ["oban>=0.7,<0.8"], "python": "3.12",
             "title": "Oban", "packages": ["oban", "psycopg", "psycopg-pool", "orjson", "uvloop"]},
    "dbos": {"script": "bench_dbos.py", "db": "bench_dbos", "pip": ["dbos>=3.4,<3.5"], "python": "3.11",
             "title": "DBOS", "packages": ["dbos", "sqlalchemy", "psycopg"],
             "count_args": {"--c10-jobs": "dbos_c10_jobs"},
             "none": {"enqueue_batch500_jobs_per_s": "no batch API"}},
}

MB = 1_000_000  # the report's MB: 10^6 bytes


def med(s: dict[str, Any] | None) -> float | None:
    return None if not s else s["median"]


def fmt_num(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.{digits}f}"


def fmt_stat(s: dict[str, Any] | None, digits: int = 0, scale: float = 1.0) -> str:
    if not s:
        return "n/a"
    return (f"{fmt_num(s['median'] * scale, digits)} [{fmt_num(s['min'] * scale, digits)}–"
            f"{fmt_num(s['max'] * scale, digits)}]")


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def runs(s: dict[str, Any] | None) -> list[float] | None:
    """The value of each round (``runs``), or None when the result does not keep them."""
    return list(s["runs"]) if s and s.get("runs") else None


def paired_ratios(a: list[float | None], b: list[float | None]) -> list[float]:
    """a/b round by round (the two figures of a round were measured minutes apart at most, under
    the same load); empty unless both have every round."""
    if not a or len(a) != len(b):
        return []
    ratios = [ratio(x, y) for x, y in zip(a, b, strict=True)]
    return [r for r in ratios if r is not None] if all(r is not None for r in ratios) else []


def per_round(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[float] | None:
    """``a / b`` round by round of two summaries (:func:`paired_ratios` of their runs: the rounds
    are interleaved, so run i of each side ran in round i). None unless both kept every round."""
    return paired_ratios(list(runs(a) or []), list(runs(b) or [])) or None


def fmt_ratio(v: float | None) -> str:
    """``1.07×``; two significant digits below 0.1 (``0.0021×``), so a small ratio does not read 0.00×."""
    if v is None:
        return "n/a"
    return f"{v:,.2f}×" if v >= 0.1 else f"{v:.2g}×"


def peers_of(result: dict[str, Any]) -> list[str]:
    """The peers a result was run with (a result of before four peers: the two it had)."""
    names = result["settings"].get("peers")
    return list(names) if names is not None else ["pgqueuer", "procrastinate"]


def peer_title(result: dict[str, Any], name: str) -> str:
    """``pgqueuer 1.6.0``: the report's name and the version that ran."""
    return f"{PEERS[name]['title']} {result.get('versions', {}).get(name) or ''}".strip()


def peer_notes(result: dict[str, Any], names: list[str]) -> list[str]:
    """What a reader needs to know to compare a peer's figures: where its configuration differs."""
    conc = result["settings"]["concurrency"]
    notes = []
    if "oban" in names and (result.get("oban") or {}).get("summary"):
        notes.append(f"Oban: 3a and 3b are one configuration, run twice: a queue's default limit is 10 "
                     f"(3b is `queues={{'default': {conc}}}`). Its batch call inserts one row per job in one "
                     "transaction.")
    if "dbos" in names and (result.get("dbos") or {}).get("summary"):
        jobs = ((result["dbos"].get("settings") or {}).get("jobs_concurrency_run")
                or result["settings"].get("dbos_c10_jobs"))
        notes.append(f"DBOS: no batch API (none in row 2). Its queues are polled once a second, not woken by "
                     f"NOTIFY: latency is about half the polling interval, and 3b (`worker_concurrency={conc}`) "
                     f"starts at most {conc} workflows per poll, so it runs {jobs:,} jobs, not "
                     f"{result['settings']['jobs']:,}.")
    return notes


def build_report(result: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """The rows and targets of results.json and the Markdown of results.md."""
    ours = result["workqueue"]["summary"]
    names = peers_of(result)
    summaries = {n: (result.get(n) or {}).get("summary") for n in names}
    conc = result["settings"]["concurrency"]
    batch = result["settings"]["batch"]

    # (label, our key, the peers' key, digits, higher is better)
    head = [
        ("1. publish, 1 per call (msgs/s)", "publish_seq_msgs_per_s", "enqueue_seq_jobs_per_s", 0, True),
        (f"2. publish, batches of {batch} (msgs/s)", "publish_batch_msgs_per_s", "enqueue_batch500_jobs_per_s", 0,
         True),
        ("3a. process, library defaults (deliveries/s)", "process_default_deliveries_per_s",
         "process_default_jobs_per_s", 0, True),
        (f"3b. process, concurrency {conc} (deliveries/s)", f"process_c{conc}_deliveries_per_s",
         f"process_c{conc}_jobs_per_s", 0, True),
        ("4a. latency p50 (ms)", "latency_p50_ms", "latency_p50_ms", 1, False),
        ("4b. latency p99 (ms)", "latency_p99_ms", "latency_p99_ms", 1, False),
    ]
    rows = []
    for label, our_key, peer_key, digits, higher in head:
        o = ours.get(our_key)
        row: dict[str, Any] = {"measurement": label, "workqueue": o, "digits": digits, "higher_is_better": higher,
                               "none": {}}
        for n in names:
            p = (summaries[n] or {}).get(peer_key)
            row[n] = p
            row[f"ratio_{n}"] = ratio(med(o), med(p))
            if p is None and summaries[n] and peer_key in PEERS[n].get("none", {}):
                row["none"][n] = PEERS[n]["none"][peer_key]
        rows.append(row)

    none_stat = ours.get("process_default_deliveries_per_s")
    none = med(none_stat)
    # The keyed cases are compared with the None case run at their own count (older results: 3a's).
    keyed_none_stat = ours.get("keyed_none_deliveries_per_s") or none_stat
    keyed_none = med(keyed_none_stat)
    keyed_jobs = result["settings"].get("keyed_jobs", result["settings"]["jobs"])
    keyed = f"{result['settings']['keys']} keys, {keyed_jobs:,}"
    extras = [
        (f"None, {keyed_jobs:,} deliveries (deliveries/s)",
         ours.get("keyed_none_deliveries_per_s"), 0, "what Exclusive and Ordered are compared with"),
        (f"Exclusive, {keyed} deliveries (deliveries/s)", ours.get("exclusive_deliveries_per_s"), 0,
         f"{fmt_num(ratio(med(ours.get('exclusive_deliveries_per_s')), keyed_none), 2)}× None"),
        (f"Ordered, {keyed} deliveries (deliveries/s)", ours.get("ordered_deliveries_per_s"), 0,
         f"{fmt_num(ratio(med(ours.get('ordered_deliveries_per_s')), keyed_none), 2)}× None"),
        ("fan-out to 5 subscriptions, processing (deliveries/s)", ours.get("fanout_deliveries_per_s"), 0,
         f"{fmt_num(ratio(med(ours.get('fanout_deliveries_per_s')), none), 2)}× None"),
        (f"fan-out to 5 subscriptions, publish in batches of {batch} (msgs/s)",
         ours.get("fanout_publish_messages_per_s"), 0,
         f"{fmt_num(med(ours.get('fanout_publish_deliveries_per_s')))} deliveries/s"),
        (f"claim round trip, {result['settings']['small']:,} Pending (ms, p50 of "
         f"{result['settings']['claim_calls']} claims of {result['settings']['claim_limit']})",
         ours.get("backlog_small_claim_p50_ms"), 3,
         f"p10 {fmt_stat(ours.get('backlog_small_claim_p10_ms'), 3)} ms"),
        (f"claim round trip, {result['settings']['large']:,} Pending (ms)", ours.get("backlog_large_claim_p50_ms"), 3,
         f"{fmt_num(ours.get('claim_large_over_small'), 2)}× the small backlog (per repeat "
         f"{fmt_stat(ours.get('claim_large_over_small_per_repeat'), 2)}); p10 "
         f"{fmt_stat(ours.get('backlog_large_claim_p10_ms'), 3)} ms, "
         f"{fmt_num(ours.get('claim_p10_large_over_small'), 2)}×"),
        (f"process first {min(result['settings']['first_n'], result['settings']['small']):,}, "
         f"{result['settings']['small']:,} Pending (deliveries/s)", ours.get("backlog_small_deliveries_per_s"), 0, ""),
        (f"process first {min(result['settings']['first_n'], result['settings']['large']):,}, "
         f"{result['settings']['large']:,} Pending (deliveries/s)", ours.get("backlog_large_deliveries_per_s"), 0,
         f"{fmt_num(ratio(med(ours.get('backlog_large_deliveries_per_s')), med(ours.get('backlog_small_deliveries_per_s'))), 2)}"  # noqa: E501
         "× the small backlog"),
        (f"fill of {result['settings']['large']:,} (s, batches of {result['settings']['fill_batch']})",
         ours.get("backlog_large_fill_seconds"), 1, ""),
        (f"worker peak RSS draining {result['settings']['mem_jobs']:,} (VmHWM, MB)", ours.get("mem_vmhwm_kib"), 1,
         f"at READY {fmt_stat(ours.get('mem_rss_at_ready_kib'), 1, 1024 / MB)} MB"),
        (f"drain rate of those {result['settings']['mem_jobs']:,} (deliveries/s)", ours.get("mem_deliveries_per_s"),
         0, ""),
    ]
    ceiling = result.get("ceiling") or {}
    ceiling_stat = (ceiling.get("summary") or {}).get("insert_c1_tps")
    ceiling_error = ceiling.get("error")
    ceiling_row: dict[str, Any] | None = None
    if ceiling_stat:
        ceiling_row = {"measurement": "pgbench, one INSERT + commit per transaction, 1 client (transactions/s)",
                       "ceiling": ceiling_stat, "digits": 0,
                       "ratio_workqueue": ratio(med(ours.get("publish_seq_msgs_per_s")), med(ceiling_stat))}
        for n in names:
            ceiling_row[f"ratio_{n}"] = ratio(med((summaries[n] or {}).get("enqueue_seq_jobs_per_s")),
                                              med(ceiling_stat))
    extra_rows = []
    for label, stat, digits, note in extras:
        scale = 1024 / MB if "MB" in label else 1.0
        extra_rows.append({"measurement": label, "workqueue": stat, "digits": digits, "scale": scale, "note": note})

    def target(name: str, value: float | None, limit: float, op: str, unit: str = "",
               rounds: list[float] | None = None) -> dict[str, Any]:
        """A target met (or not) on the medians, and in each round when ``rounds`` are known."""
        def meets(v: float) -> bool:
            return v >= limit if op == ">=" else v <= limit
        met = None if value is None else meets(value)
        every = None if not rounds else all(meets(v) for v in rounds)
        return {"target": name, "value": value, "limit": limit, "op": op, "unit": unit, "met": met,
                "rounds": rounds, "met_every_round": every}

    keys, small, large = result["settings"]["keys"], result["settings"]["small"], result["settings"]["large"]
    mem_jobs = result["settings"]["mem_jobs"]
    pgq = summaries.get("pgqueuer") or {}
    mem = ours.get("mem_vmhwm_kib")
    targets = [
        # bench/README.md, "Targets": what the project holds itself to against the peers.
        target("processing at defaults vs pgqueuer's defaults", ratio(none, med(pgq.get("process_default_jobs_per_s"))),
               3.0, ">=", "×", per_round(none_stat, pgq.get("process_default_jobs_per_s"))),
        target("single publish vs pgqueuer", ratio(med(ours.get("publish_seq_msgs_per_s")),
                                                   med(pgq.get("enqueue_seq_jobs_per_s"))), 1.2, ">=", "×",
               per_round(ours.get("publish_seq_msgs_per_s"), pgq.get("enqueue_seq_jobs_per_s"))),
        target("single publish vs the ceiling (pgbench, one INSERT + commit per transaction, 1 client)",
               ratio(med(ours.get("publish_seq_msgs_per_s")), med(ceiling_stat)), 0.5, ">=", "×",
               per_round(ours.get("publish_seq_msgs_per_s"), ceiling_stat)),
        target("batch publish vs pgqueuer", ratio(med(ours.get("publish_batch_msgs_per_s")),
                                                  med(pgq.get("enqueue_batch500_jobs_per_s"))), 1.2, ">=", "×",
               per_round(ours.get("publish_batch_msgs_per_s"), pgq.get("enqueue_batch500_jobs_per_s"))),
        target("latency p50", med(ours.get("latency_p50_ms")), 1.0, "<=", " ms", runs(ours.get("latency_p50_ms"))),
        target("latency p99 vs pgqueuer's p99", ratio(med(ours.get("latency_p99_ms")), med(pgq.get("latency_p99_ms"))),
               1.0, "<=", "×", per_round(ours.get("latency_p99_ms"), pgq.get("latency_p99_ms"))),
        target(f"Exclusive ({keys} keys) vs None", ratio(med(ours.get("exclusive_deliveries_per_s")), keyed_none), 0.8,
               ">=", "×", per_round(ours.get("exclusive_deliveries_per_s"), keyed_none_stat)),
        target(f"Ordered ({keys} keys) vs None", ratio(med(ours.get("ordered_deliveries_per_s")), keyed_none), 0.8,
               ">=", "×", per_round(ours.get("ordered_deliveries_per_s"), keyed_none_stat)),
        target(f"claim with {large:,} Pending vs {small:,}", ours.get("claim_large_over_small"), 1.3, "<=", "×"),
        target(f"worker RSS draining {mem_jobs:,}", None if mem is None else mem["median"] * 1024 / MB, 50.0, "<=",
               " MB", None if mem is None else [v * 1024 / MB for v in runs(mem) or []]),
    ]

    # Markdown
    def md_row(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    def cell(row: dict[str, Any], name: str) -> str:
        return "none" if name in row["none"] else fmt_stat(row[name], row["digits"])

    lines = [
        md_row(["measurement", "fastapi-workqueue", *(peer_title(result, n) for n in names),
                *(f"ours / {PEERS[n]['title']}" for n in names)]),
        md_row(["---"] * (2 + 2 * len(names))),
    ]
    for row in rows:
        lines.append(md_row([row["measurement"], fmt_stat(row["workqueue"], row["digits"]),
                             *(cell(row, n) for n in names),
                             *("–" if n in row["none"] else fmt_ratio(row[f"ratio_{n}"]) for n in names)]))
    notes = peer_notes(result, names)
    if notes:
        lines += ["", *(f"* {note}" for note in notes)]
    if ceiling_row is not None:
        lines += ["", md_row(["ceiling, same server and run", "median [min–max]",
                              *(f"{t} / ceiling" for t in ["fastapi-workqueue", *(PEERS[n]["title"] for n in names)])]),
                  md_row(["---"] * (3 + len(names))),
                  md_row([ceiling_row["measurement"], fmt_stat(ceiling_row["ceiling"]),
                          *(fmt_ratio(ceiling_row[f"ratio_{n}"]) for n in ["workqueue", *names])])]
    elif ceiling_error:
        lines += ["", f"Ceiling not measured: {ceiling_error}."]
    lines += ["", "| our extra case | median [min–max] | note |", "| --- | --- | --- |"]
    for row in extra_rows:
        lines.append(f"| {row['measurement']} | {fmt_stat(row['workqueue'], row['digits'], row['scale'])} | "
                     f"{row['note']} |")
    lines += ["", "| target | measured (median) | limit | met on the median | met in every round |",
              "| --- | --- | --- | --- | --- |"]
    for t in targets:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}{t['unit']}"
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        every = ("n/a" if t["met_every_round"] is None else
                 f"{'yes' if t['met_every_round'] else '**no**'} ({', '.join(f'{r:.2f}' for r in t['rounds'])})")
        lines.append(f"| {t['target']} | {v} | {t['op']} {t['limit']:g}{t['unit']} | {met} | {every} |")
    return rows + extra_rows + ([ceiling_row] if ceiling_row else []), targets, "\n".join(lines)
