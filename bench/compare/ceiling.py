#!/usr/bin/env python3
"""The server's ceiling for a single publish: pgbench, one INSERT + commit per transaction, 1 client.

    .venv/bin/python bench/compare/ceiling.py --dsn postgresql://postgres@127.0.0.1:5432/bench_pgbench

The method of bench/compare/peers/pgbench/run_pgbench.sh (its `insert_c1` case): the tables of
`pgbench/setup.sql`, then per run `TRUNCATE ins_t RESTART IDENTITY`, `VACUUM ANALYZE ins_t`,
`CHECKPOINT` and `pgbench -n -M prepared -c 1 -j 1 -T <seconds> -f pgbench/insert.sql`: one
connection committing one small-row INSERT after another, which is what a loop of single
publishes does with nothing of a queue's own work. `bench/compare/run.py` runs it once per round
beside the libraries and divides each one's single-publish rate by its transactions/s.
Writes JSON (`--out`) in the shape of the peers' scripts: `raw.insert_c1` holds one entry per run.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "peers" / "pgbench"
DEFAULT_DSN = os.environ.get("BENCH_PGBENCH_DSN", "postgresql://postgres:postgres@127.0.0.1:5432/bench_pgbench")


def psql(dsn: str, *args: str) -> str:
    """Runs psql on ``dsn``; stops at the first error."""
    res = subprocess.run(["psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-d", dsn, *args],
                         capture_output=True, text=True, timeout=600, env=quiet_env())
    if res.returncode != 0:
        raise SystemExit(f"psql failed ({' '.join(args)}): {res.stderr.strip()}")
    return res.stdout.strip()


def quiet_env() -> dict[str, str]:
    return {**os.environ, "PGOPTIONS": os.environ.get("PGOPTIONS", "-c client_min_messages=warning")}


def parse_pgbench(text: str) -> dict[str, Any]:
    """tps, average latency and transactions of pgbench's summary."""

    def number(pattern: str) -> float | None:
        match = re.search(pattern, text)
        return float(match.group(1)) if match else None

    tps = number(r"tps = ([0-9.]+)")
    if tps is None:
        raise SystemExit(f"pgbench printed no tps:\n{text[-2000:]}")
    transactions = number(r"number of transactions actually processed: ([0-9]+)")
    return {"tps": tps, "latency_avg_ms": number(r"latency average = ([0-9.]+) ms"),
            "transactions": None if transactions is None else int(transactions)}


def one_run(dsn: str, seconds: int) -> dict[str, Any]:
    psql(dsn, "-c", "TRUNCATE ins_t RESTART IDENTITY", "-c", "VACUUM ANALYZE ins_t")
    psql(dsn, "-c", "CHECKPOINT")
    res = subprocess.run(
        ["pgbench", "-n", "-M", "prepared", "-c", "1", "-j", "1", "-T", str(seconds), "-f",
         str(SCRIPTS / "insert.sql"), dsn],
        capture_output=True, text=True, timeout=seconds + 60, env=quiet_env(),
    )
    if res.returncode != 0:
        raise SystemExit(f"pgbench failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    return {**parse_pgbench(res.stdout), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="database of the pgbench tables ($BENCH_PGBENCH_DSN)")
    ap.add_argument("--seconds", type=int, default=20, help="length of one pgbench run (default 20)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "results" / "ceiling.json"))
    args = ap.parse_args()
    if args.seconds < 1:
        ap.error("--seconds must be at least 1")

    psql(args.dsn, "-f", str(SCRIPTS / "setup.sql"))
    runs = []
    for r in range(args.repeats):
        run = one_run(args.dsn, args.seconds)
        runs.append(run)
        print(f"[run {r + 1}] insert_c1: {run['tps']:,.0f} transactions/s "
              f"(latency average {run['latency_avg_ms']} ms)", flush=True)
    version = subprocess.run(["pgbench", "--version"], capture_output=True, text=True).stdout.strip()
    tps = [x["tps"] for x in runs]
    result = {
        "peer": "pgbench",
        "version": (re.findall(r"\) ([0-9][^ ]*)", version) or [version or None])[0],
        "postgres": psql(args.dsn, "-c", "SHOW server_version"),
        "settings": {
            "case": "insert_c1: pgbench -n -M prepared -c 1 -j 1, one INSERT INTO ins_t (payload) VALUES ('x') "
            "and its commit per transaction",
            "seconds": args.seconds,
            "server": psql(args.dsn, "-c", "SELECT string_agg(name || '=' || setting, ', ' ORDER BY name) "
                           "FROM pg_settings WHERE name IN ('synchronous_commit', 'fsync', 'wal_sync_method', "
                           "'commit_delay', 'shared_buffers')"),
        },
        "summary": {"insert_c1_tps": {"median": statistics.median(tps), "min": min(tps), "max": max(tps),
                                      "runs": tps}},
        "raw": {"insert_c1": runs},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
