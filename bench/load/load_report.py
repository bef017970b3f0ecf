"""The load benchmark's figures: one level's run from its raw readings, medians over repeats,
the targets, and the Markdown tables bench/load/load.py prints."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

CORE_PROCESSING_RATE = 23_900.0
"""bench/README.md, "Processing at the defaults": deliveries/s of the core benchmark's no-op handler."""

CPU_ROLES = ("app", "workers", "pg_backends", "pg_background", "client", "bench", "other", "unseen")

SUMMARIZED = (
    "rps", "answered_rps", "latency_p50_ms", "latency_p99_ms", "latency_max_ms", "errors",
    "e2e_p50_ms", "e2e_p99_ms", "e2e_max_ms", "claims", "claims_empty", "claims_per_delivery",
    "empty_claim_share", "notifies_per_publish", "wakeups_per_publish", "listeners", "backlog_at_stop",
    "drain_seconds", "drain_rate", "commits_per_s", "sessions_opened", "violations",
    "client_cpu_share", "machine_busy_share",
    *(f"cpu_s.{r}" for r in CPU_ROLES), *(f"cores.{r}" for r in CPU_ROLES),
    *(f"ms_per_order.{r}" for r in CPU_ROLES), "ms_per_order.ours",
)
OURS = ("app", "workers", "pg_backends", "pg_background", "client")
"""The roles whose CPU the benchmark's orders cost (the rest is the benchmark's and other work)."""


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q * len(ordered) + 0.5)))
    return ordered[rank - 1]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def request_figures(client: dict[str, Any]) -> dict[str, Any]:
    """Throughput, latency and errors from the client's records.

    Requests/s counts the 201 answers that arrived within the load window (from the first
    request to the time after which none started), over the window's length; latency is over
    every 201, also those answered after the window; every other answer is an error of its kind."""
    records = client["records"]
    window = max(client["ended_at"] - client["started_at"], 1e-9)
    ok = [r for r in records if r[2] == "201"]
    in_window = [r for r in ok if r[0] + r[1] <= client["ended_at"]]
    answered = [r for r in records if r[0] + r[1] <= client["ended_at"]]
    errors = Counter(r[2] for r in records if r[2] != "201")
    latencies = [r[1] for r in ok]
    return {
        "window_s": round(window, 3),
        "requests": len(records),
        "accepted": len(ok),
        "rps": round(len(in_window) / window, 2),
        "answered_rps": round(len(answered) / window, 2),
        "latency_p50_ms": _ms(percentile(latencies, 0.50)),
        "latency_p99_ms": _ms(percentile(latencies, 0.99)),
        "latency_max_ms": _ms(max(latencies) if latencies else None),
        "errors": sum(errors.values()),
        "errors_by_kind": dict(sorted(errors.items())),
        "accepted_without_ids": sum(1 for r in ok if r[3] is None or r[4] is None),
    }


def end_to_end(client: dict[str, Any], settled: dict[str, float]) -> dict[str, Any]:
    """From each accepted request's start to the settle of its message's last delivery."""
    values = [settled[r[4]] - r[0] for r in client["records"] if r[2] == "201" and r[4] in settled]
    waiting = sum(1 for r in client["records"] if r[2] == "201" and r[4] is not None and r[4] not in settled)
    return {"e2e_p50_ms": _ms(percentile(values, 0.50)), "e2e_p99_ms": _ms(percentile(values, 0.99)),
            "e2e_max_ms": _ms(max(values) if values else None), "e2e_unsettled": waiting}


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, int]:
    return {k: int(after.get(k) or 0) - int(before.get(k) or 0) for k in after}


def summarize(values: list[float | int | None]) -> dict[str, float] | None:
    got = [float(v) for v in values if v is not None]
    if not got:
        return None
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def flatten(run: dict[str, Any]) -> dict[str, Any]:
    """The run's figures with the CPU split as ``cpu_s.<role>`` and ``cores.<role>`` (while the load
    ran), and ``ms_per_order.<role>``: CPU-milliseconds per accepted order over the load and the
    drain, so that work the load pushed past its end (a backlog) counts too."""
    flat = dict(run)
    seconds = run.get("cpu_load", {}).get("seconds", {})
    drained = run.get("cpu_drain", {}).get("seconds", {})
    accepted = run.get("accepted") or 0
    for role in CPU_ROLES:
        flat[f"cpu_s.{role}"] = seconds.get(role, 0.0)
        flat[f"cores.{role}"] = round(seconds.get(role, 0.0) / run["load_window_s"], 3) if run.get("load_window_s") \
            else None
        both = seconds.get(role, 0.0) + drained.get(role, 0.0)
        flat[f"ms_per_order.{role}"] = round(1000 * both / accepted, 2) if accepted else None
    flat["ms_per_order.ours"] = round(sum(flat[f"ms_per_order.{r}"] or 0.0 for r in OURS), 2) if accepted else None
    flat["machine_busy_share"] = run.get("cpu_load", {}).get("machine_busy_share")
    return flat


def summarize_level(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max over the repeats of every figure; errors by kind as medians and totals."""
    flat = [flatten(r) for r in runs]
    out: dict[str, Any] = {k: summarize([f.get(k) for f in flat]) for k in SUMMARIZED}
    kinds = sorted({k for r in runs for k in r.get("errors_by_kind", {})})
    out["errors_by_kind"] = {k: statistics.median([r.get("errors_by_kind", {}).get(k, 0) for r in runs])
                             for k in kinds}
    out["errors_by_kind_total"] = {k: sum(r.get("errors_by_kind", {}).get(k, 0) for r in runs) for k in kinds}
    out["violations_total"] = sum(r.get("violations") or 0 for r in runs)
    out["repeats"] = len(runs)
    return out


def med(summary: dict[str, Any], setup: str, clients: int, key: str) -> float | None:
    stat = summary.get(setup, {}).get(str(clients), {}).get(key)
    return None if not stat else stat["median"]


def _target(name: str, value: float | None, limit: float, op: str, unit: str = "", note: str = "") -> dict[str, Any]:
    met = None if value is None else (value >= limit if op == ">=" else value <= limit)
    return {"target": name, "value": value, "limit": limit, "op": op, "unit": unit, "met": met, "note": note}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _paired(first: list[float | None], second: list[float | None]) -> list[float]:
    """first[i] / second[i] for every round; empty unless both lists have every round's figure."""
    if not first or len(first) != len(second):
        return []
    ratios = [_ratio(x, y) for x, y in zip(first, second, strict=True)]
    return [r for r in ratios if r is not None] if all(r is not None for r in ratios) else []


def paired_ratios(runs: dict[str, Any] | None, a: str, b: str, clients: int) -> list[float]:
    """Set-up ``a``'s requests/s over ``b``'s round by round (a round runs its set-ups back to back,
    under the same load); empty unless both ran every round."""
    if not runs:
        return []
    first = [r.get("rps") for r in runs.get(a, {}).get(str(clients)) or []]
    second = [r.get("rps") for r in runs.get(b, {}).get(str(clients)) or []]
    return _paired(first, second)


def _by_round(ratios: list[float]) -> str:
    if not ratios:
        return ""
    return (f"; round by round {', '.join(f'{r:.2f}' for r in ratios)}×, "
            f"median {statistics.median(ratios):.2f}×")


DRAIN_TOLERANCE = 0.9
"""The drain target: the drain's rate at least this share of the same round's processing rate.
The two are the same handlers on the same backlog shape, so the drain's expected ratio is 1; one
pair of 10-20 s measurements on the 2-core machine spreads about ±10 % (four runs of one commit
read 0.82, 0.94, 1.00 and 1.02), which a limit of exactly 1 would fail half the time."""


def targets(summary: dict[str, Any], core_rate: float = CORE_PROCESSING_RATE,
            processing_rate: float | None = None, runs: dict[str, Any] | None = None,
            processing: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The task's targets on the medians of one run. The drain compares with ``processing_rate`` (the
    host draining a pre-filled backlog of the same handlers with no HTTP load) when it was measured,
    else with the core benchmark's ``core_rate``. With ``runs``, a ratio of two set-ups also gives,
    in its note, the same ratio round by round."""
    out = []
    h1, h50 = med(summary, "host", 1, "rps"), med(summary, "host", 50, "rps")
    out.append(_target("host: requests/s at 50 clients vs at 1 client", _ratio(h50, h1), 1.0, ">=", "×",
                       f"{h50} vs {h1} req/s"))
    w50 = med(summary, "worker", 50, "rps")
    out.append(_target("host vs worker set-up: requests/s at 50 clients", _ratio(h50, w50), 0.8, ">=", "×",
                       f"{h50} vs {w50} req/s"))
    out.append(_target("host: latency p99 at 50 clients", med(summary, "host", 50, "latency_p99_ms"), 250, "<=",
                       " ms"))
    errors200 = med(summary, "host", 200, "errors")
    total200 = summary.get("host", {}).get("200", {}).get("errors_by_kind_total")
    # A 503 with Retry-After is a refusal, which issue 16 allows ("requests wait or are refused with
    # 503 and Retry-After, never reset"): counted and shown, not an error for this target.
    failed200 = None if total200 is None else {k: v for k, v in total200.items() if k != "503_retry_after"}
    out.append(_target("host: errors at 200 clients (any repeat, dropped connections included; 503 with "
                       "Retry-After is a refusal, not an error)",
                       None if errors200 is None or failed200 is None else float(sum(failed200.values())), 0, "<=", "",
                       f"by kind over the repeats: {total200 or {}}"))
    loaded = [(c, v) for c in (8, 50, 200) if (v := med(summary, "host", c, "claims_per_delivery")) is not None]
    worst = max(loaded, key=lambda cv: cv[1]) if loaded else None
    out.append(_target("host: claims per delivery under load (worst of 8, 50, 200 clients)",
                       worst[1] if worst else None, 1.5, "<=", "", f"at {worst[0]} clients" if worst else ""))
    rate = med(summary, "host", 50, "drain_rate")
    backlog = med(summary, "host", 50, "backlog_at_stop")
    drains = [r.get("drain_rate") for r in ((runs or {}).get("host", {}).get("50") or [])]
    paired = _paired(drains, [p.get("rate") for p in processing or []])
    name = "host: drain rate of the backlog left after 50 clients"
    if backlog == 0:
        out.append(_target(name, 1.0, DRAIN_TOLERANCE, ">=", "×", "nothing was left to drain"))
    elif processing_rate is not None:
        # Each host round measures its processing rate before its load: the drain of that round over
        # it, the median of the rounds against the measurement's own spread (DRAIN_TOLERANCE).
        note = (f"drain {rate}/s of a backlog of {backlog} deliveries over the same handlers draining a "
                f"pre-filled backlog with no HTTP load, {processing_rate:,.0f}/s (both read alike: the "
                f"deliveries settled after the first tenth, by their settled_at)")
        value = statistics.median(paired) if paired else _ratio(rate, processing_rate)
        out.append(_target(name, value, DRAIN_TOLERANCE, ">=", "×", note + _by_round(paired)))
    else:
        out.append(_target(name, rate, core_rate, ">=", " deliveries/s",
                           f"backlog {backlog} deliveries; the core benchmark's processing at the defaults: "
                           f"{core_rate:,.0f}/s"))
    h8, b8 = med(summary, "host", 8, "rps"), med(summary, "baseline", 8, "rps")
    p8 = med(summary, "publish", 8, "rps")
    out.append(_target("publishing alone (nothing consuming) vs baseline (no publish): requests/s at 8 clients",
                       _ratio(p8, b8), 0.75, ">=", "×",
                       f"{p8} vs {b8} req/s{_by_round(paired_ratios(runs, 'publish', 'baseline', 8))}"))
    out.append(_target("host (publishing and consuming in the same processes) vs baseline: requests/s at 8 "
                       "clients", _ratio(h8, b8), 0.75, ">=", "×",
                       f"{h8} vs {b8} req/s{_by_round(paired_ratios(runs, 'host', 'baseline', 8))}"))
    return out


# -- Markdown ---------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _stat(stat: dict[str, float] | None, digits: int = 0, spread: bool = True) -> str:
    if not stat:
        return "n/a"
    text = _num(stat["median"], digits)
    if spread and stat["n"] > 1 and stat["min"] != stat["max"]:
        text += f" [{_num(stat['min'], digits)}–{_num(stat['max'], digits)}]"
    return text


def _share(stat: dict[str, float] | None) -> str:
    return "n/a" if not stat else f"{100 * stat['median']:.0f} %"


def tables(result: dict[str, Any]) -> str:
    """The figures, the CPU split, the database activity and the targets, as Markdown."""
    summary = result["summary"]
    lines = [
        "| set-up | clients | req/s | p50 ms | p99 ms | max ms | errors (median; kinds) | e2e p50 ms | e2e p99 ms "
        "| claims / delivery | empty claims | NOTIFY / publish | backlog at stop | drain s | drain /s | violations |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for setup, levels in summary.items():
        for clients, s in levels.items():
            kinds = ", ".join(f"{k}: {v:g}" for k, v in s["errors_by_kind_total"].items()) or "-"
            lines.append(
                f"| {setup} | {clients} | {_stat(s['rps'])} | {_stat(s['latency_p50_ms'], 1)} "
                f"| {_stat(s['latency_p99_ms'], 1)} | {_stat(s['latency_max_ms'], 0, False)} "
                f"| {_stat(s['errors'], 0, False)} ({kinds}) | {_stat(s['e2e_p50_ms'], 0, False)} "
                f"| {_stat(s['e2e_p99_ms'], 0, False)} | {_stat(s['claims_per_delivery'], 2, False)} "
                f"| {_share(s.get('empty_claim_share'))} "
                f"| {_stat(s['notifies_per_publish'], 2, False)} | {_stat(s['backlog_at_stop'], 0, False)} "
                f"| {_stat(s['drain_seconds'], 2, False)} | {_stat(s['drain_rate'], 0, False)} "
                f"| {s['violations_total']} |")
    lines += ["", "CPU while the load ran (cores: CPU-seconds per second of the load window, medians; "
              "2 cores in all):", "",
              "| set-up | clients | app | workers | PostgreSQL backends | PostgreSQL shared | client | bench | other "
              "| unseen | machine busy | commits/s | connections opened |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for setup, levels in summary.items():
        for clients, s in levels.items():
            cores = " | ".join(_stat(s[f"cores.{r}"], 2, False) for r in CPU_ROLES)
            lines.append(f"| {setup} | {clients} | {cores} | {_share(s.get('machine_busy_share'))} "
                         f"| {_stat(s['commits_per_s'], 0, False)} | {_stat(s['sessions_opened'], 0, False)} |")
    lines += ["", "CPU per accepted order, over the load and the drain (CPU-ms; 'ours' adds app, workers, "
              "PostgreSQL and client: 2 cores give 2,000 CPU-ms a second, so 2,000 / ours bounds the orders/s):", "",
              "| set-up | clients | app | workers | PostgreSQL backends | PostgreSQL shared | client | ours "
              "| bound: orders/s on 2 idle cores |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for setup, levels in summary.items():
        for clients, s in levels.items():
            per = " | ".join(_stat(s[f"ms_per_order.{r}"], 2, False) for r in OURS)
            ours = s.get("ms_per_order.ours")
            bound = _num(2000 / ours["median"]) if ours and ours["median"] else "n/a"
            lines.append(f"| {setup} | {clients} | {per} | {_stat(ours, 2, False)} | {bound} |")
    activity = result.get("activity") or {}
    for key, act in activity.items():
        if not act:
            continue
        age = act["open_transaction_age_ms"]
        lines += ["", f"pg_stat_activity, {key} ({act['samples']} samples every 100 ms, "
                  f"{act['sessions_per_sample']} client sessions of the database per sample; "
                  f"shares of session-samples; open transactions' age p50/p90/p99 "
                  f"{age['p50']}/{age['p90']}/{age['p99']} ms):", "",
                  "| state and wait event | share |", "| --- | ---: |"]
        lines += [f"| {k} | {100 * v:.1f} % |" for k, v in act["by_state_and_wait"].items()]
        lines += ["", "| busy sessions: state, statement, wait event | share |", "| --- | ---: |"]
        lines += [f"| {k} | {100 * v:.1f} % |" for k, v in act["busy_by_statement"].items()]
    lines += ["", "| target | measured | limit | met |", "| --- | --- | --- | --- |"]
    for t in result["targets"]:
        value = "n/a" if t["value"] is None else f"{t['value']:,.2f}{t['unit']}"
        met = "not measured" if t["met"] is None else ("met" if t["met"] else "**not met**")
        note = f" ({t['note']})" if t["note"] else ""
        lines.append(f"| {t['target']} | {value}{note} | {t['op']} {t['limit']:g}{t['unit']} | {met} |")
    return "\n".join(lines)
