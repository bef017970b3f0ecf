#!/usr/bin/env python3
"""The benchmark's one command: fastapi-workqueue against pgqueuer, procrastinate, Oban for Python and DBOS.

    .venv/bin/python bench/compare/run.py                      # full run, 3 repeats, four peers and the ceiling
    .venv/bin/python bench/compare/run.py --smoke              # tiny counts, no peers, well under a minute
    .venv/bin/python bench/compare/run.py --smoke --peer-list oban,dbos   # tiny counts, those peers too

It creates the databases it needs on one PostgreSQL server, installs each peer from PyPI into a
virtual environment of its own (cached in --peers-dir, reused when present; Oban's on Python 3.12),
then runs, round by round, our cases (bench/compare/workqueue_bench.py, project interpreter), the
peers' scripts (bench/compare/peers/bench_<peer>.py, each with its own interpreter) and the pgbench
ceiling of a single publish (bench/compare/ceiling.py), never two at once, rotating their order
each round. Our backlog and memory cases (no peer) follow. One JSON with every run plus
median/min/max, a Markdown table with the ratios ours/peer and the targets, and a PNG chart are
written to --out. See bench/README.md.
"""

import argparse
import contextlib
import datetime as dt
import glob
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the repository
sys.path.insert(0, str(HERE))

from workqueue_bench import summarize, summarize_raw  # noqa: E402

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
CEILING_DB = "bench_pgbench"
PYTHON_OPTION = {"3.11": "--peer-python", "3.12": "--peer-python312"}  # the option that names each interpreter
CHART_PIP = ["matplotlib>=3.8"]
DEFAULT_PG = os.environ.get("BENCH_PG_URL", "postgresql://postgres:postgres@127.0.0.1:5432")
DEFAULT_PEERS_DIR = os.environ.get("BENCH_PEERS_DIR", "/tmp/workqueue-bench-peers")
OUR_FAST = ["publish", "process", "latency", "exclusive", "ordered", "fanout"]
OUR_SLOW = ["backlog", "mem"]
PEER_CASES = {"publish": "enqueue", "process": "process", "latency": "latency"}

FULL = {"jobs": 20000, "batch": 500, "concurrency": 10, "lat_count": 200, "lat_spacing": 0.020, "keys": 500,
        "small": 10_000, "large": 1_000_000, "first_n": 20_000, "mem_jobs": 100_000, "fill_batch": 5000,
        "claim_calls": 250, "dbos_c10_jobs": 1000, "ceiling_seconds": 20}
SMOKE = {"jobs": 300, "batch": 100, "concurrency": 10, "lat_count": 20, "lat_spacing": 0.020, "keys": 20,
         "small": 300, "large": 3000, "first_n": 300, "mem_jobs": 1000, "fill_batch": 500, "claim_calls": 20,
         "dbos_c10_jobs": 30, "ceiling_seconds": 2}
# What the counts mean where the name does not say it.
COUNT_HELP = {
    "dbos_c10_jobs": "jobs of DBOS's concurrency run: its queue starts at most --concurrency workflows per 1 s "
    "poll, so 20,000 would take over half an hour",
    "ceiling_seconds": "length of one pgbench run of the ceiling",
}

MB = 1_000_000


class Log:
    """Prints and appends to OUT/run.log."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        with self.path.open("a") as fh:
            fh.write(text + "\n")


def git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def library_digest(root: Path = ROOT) -> str:
    """A hash of the library's code and SQL, to notice changes made while the benchmark runs."""
    h = hashlib.sha256()
    for base in (root / "fastapi_workqueue", root / "sql"):
        for path in sorted(base.rglob("*")):
            if path.is_file() and path.suffix in (".py", ".sql"):
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def db_url(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def ensure_databases(base: str, names: list[str], log: Log, recreate: bool = False) -> None:
    """Creates the databases that do not exist (all of them anew with ``recreate``)."""
    import asyncio

    import asyncpg

    async def go() -> None:
        admin = await asyncpg.connect(db_url(base, "postgres"))
        try:
            have = {r["datname"] for r in await admin.fetch("SELECT datname FROM pg_database")}
            for name in names:
                if name in have and recreate:
                    await admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = $1 AND pid <> pg_backend_pid()", name)
                    await admin.execute(f'DROP DATABASE "{name}"')
                    have.discard(name)
                if name not in have:
                    await admin.execute(f'CREATE DATABASE "{name}"')
                    log(f"created database {name}")
        finally:
            await admin.close()

    asyncio.run(go())


def ensure_venv(peers_dir: Path, name: str, pip: list[str], python: str, log: Log) -> Path:
    """A venv with ``pip`` installed from PyPI, reused when the same specs were installed before."""
    venv = peers_dir / name
    marker = venv / ".bench-installed"
    py = venv / "bin" / "python"
    if marker.exists() and py.exists() and marker.read_text() == json.dumps(pip):
        return py
    if venv.exists():
        shutil.rmtree(venv)
    peers_dir.mkdir(parents=True, exist_ok=True)
    log(f"== creating venv {venv} ({' '.join(pip)})")
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pip], check=True,
                   timeout=1200)
    marker.write_text(json.dumps(pip))
    return py


def python_version_of(py: str) -> str | None:
    """``"3.12"`` for an interpreter that runs, None for one that does not (a pyenv shim without it)."""
    try:
        res = subprocess.run([py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def find_python(version: str) -> str | None:
    """An interpreter of ``version``: ``python3.12`` on PATH if it runs, else pyenv's newest 3.12.x."""
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")

    def newest_first(path: str) -> list[int]:
        release = Path(path).parents[1].name  # <root>/versions/3.12.1/bin/python3.12
        return [int(p) for p in release.split(".") if p.isdigit()]

    found = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"), key=newest_first, reverse=True)
    for candidate in [shutil.which(f"python{version}"), *found]:
        if candidate and python_version_of(candidate) == version:
            return candidate
    return None


def peer_interpreter(name: str, pythons: dict[str, str | None]) -> str:
    """The interpreter that creates ``name``'s venv; says what to pass when none fits."""
    need = PEERS[name]["python"]
    py = pythons.get(need)
    if py is None:
        raise ValueError(f"{name} needs Python {need}, and none was found (not python{need} on PATH nor in pyenv's "
                         f"versions); install it (`pyenv install {need}`) or pass {PYTHON_OPTION[need]} PATH")
    have = python_version_of(py)
    if have != need:
        raise ValueError(f"{name} needs Python {need}, but {py} is {'Python ' + have if have else 'not runnable'}; "
                         f"pass {PYTHON_OPTION[need]} PATH")
    return py


def pip_versions(py: Path, packages: list[str]) -> dict[str, str | None]:
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: out[p] = None\n"
        "print(json.dumps(out))\n"
    )
    try:
        res = subprocess.run([str(py), "-c", code, *packages], capture_output=True, text=True, timeout=60)
        return json.loads(res.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


def wait_quiet(monitor: "NoiseMonitor", log: Log, limit: float) -> None:
    """Waits (at most ``limit`` s) until other processes used < 10 % of a core for 5 s."""
    t0 = time.time()
    monitor.take()
    said = False
    while time.time() - t0 < limit:
        time.sleep(5)
        busy = {k: v for k, v in monitor.take(raw=True).items() if v > 0}
        if sum(busy.values()) < 0.5:
            break
        if not said:
            log(f"  waiting up to {limit:.0f} s for other processes to go quiet: {busy}")
            said = True
    else:
        if limit > 0:
            log(f"  still busy after {limit:.0f} s; measuring anyway")
    if said and time.time() - t0 < limit:
        log(f"  quiet after {time.time() - t0:.0f} s")
    monitor.take()


def snapshot_library(ref: str, dest: Path) -> str:
    """Extracts ``fastapi_workqueue/`` and ``sql/`` of commit ``ref`` into ``dest``; returns its short hash."""
    sha = git("rev-parse", "--short", f"{ref}^{{commit}}")
    if not sha:
        raise SystemExit(f"--library-ref {ref!r} is not a commit of this repository")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", sha, "fastapi_workqueue", "sql"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return sha


def run_step(cmd: list[str], log: Log, timeout: float, monitor: "NoiseMonitor | None" = None,
             noise: list[dict[str, Any]] | None = None, label: str = "", quiet_wait: float = 0,
             env: dict[str, str] | None = None) -> int:
    """Runs one benchmark script, streaming its output to the console and run.log."""
    if monitor is not None:
        wait_quiet(monitor, log, quiet_wait)
    log("$ " + " ".join(cmd))
    t0 = time.time()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                          env=env) as proc:

        def pump() -> None:
            assert proc.stdout is not None
            with contextlib.suppress(ValueError):  # the pipe closes when the step is stopped
                for line in proc.stdout:
                    log("  " + line.rstrip())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt, SystemExit) as exc:
            why = f"timed out after {timeout:.0f} s" if isinstance(exc, subprocess.TimeoutExpired) else "stopped"
            log(f"!! {why}; stopping pid {proc.pid}")
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            rc = -1
        reader.join(timeout=10)
    log(f"  (exit {rc}, {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.2f})")
    if monitor is not None:
        other = monitor.take()
        if noise is not None:
            noise.append({"step": label, "seconds": round(time.time() - t0), "other_cpu_s": other})
        if other:
            log(f"  other processes used CPU meanwhile (s): {other}")
    return rc


class NoiseMonitor(threading.Thread):
    """Samples /proc every second: CPU used by processes outside this benchmark, per command.

    PostgreSQL backends are told apart by the database in their process title, so the work of
    other sessions on the same server shows up as ``postgres backend (<db>)``.
    """

    def __init__(self, own_dbs: set[str]) -> None:
        super().__init__(daemon=True)
        self.own_dbs = own_dbs
        self.tick = os.sysconf("SC_CLK_TCK")
        self.last: dict[int, float] = {}
        self.acc: dict[str, float] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def _scan(self) -> dict[int, tuple[int, float, str]]:
        procs: dict[int, tuple[int, float, str]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    stat = fh.read()
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if not cmd:  # kernel thread
                continue
            procs[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self.tick, cmd)
        return procs

    def _key(self, cmd: str) -> str | None:
        if cmd.startswith("postgres: "):
            parts = cmd.split()
            if len(parts) >= 5 and ("(" in parts[4] or parts[4] == "[local]"):
                return None if parts[3] in self.own_dbs else f"postgres backend ({parts[3]})"
            return None  # checkpointer, WAL writer, autovacuum: shared by everyone
        return cmd[:80]

    def run(self) -> None:
        me = os.getpid()
        while not self.stopped.wait(1.0):
            procs = self._scan()
            ours = {me}
            changed = True
            while changed:
                changed = False
                for pid, (ppid, _, _) in procs.items():
                    if ppid in ours and pid not in ours:
                        ours.add(pid)
                        changed = True
            with self.lock:
                for pid, (_, cpu, cmd) in procs.items():
                    before = self.last.get(pid)
                    self.last[pid] = cpu
                    if pid in ours or before is None:
                        continue
                    key = self._key(cmd)
                    if key and cpu > before:
                        self.acc[key] = self.acc.get(key, 0.0) + cpu - before

    def take(self, raw: bool = False) -> dict[str, float]:
        """CPU seconds of other processes since the last call, largest first (>= 0.5 s unless ``raw``)."""
        with self.lock:
            acc, self.acc = self.acc, {}
        return {k: round(v, 1) for k, v in sorted(acc.items(), key=lambda kv: -kv[1]) if raw or v >= 0.5}


# ---------------------------------------------------------------- merging
def merge_raw(files: list[Path]) -> tuple[dict[str, list[Any]], list[dict[str, Any]]]:
    raw: dict[str, list[Any]] = {}
    docs = []
    for f in files:
        if not f.exists():
            continue
        doc = json.loads(f.read_text())
        docs.append(doc)
        for key, runs in doc.get("raw", {}).items():
            raw.setdefault(key, []).extend(runs)
    return raw, docs


def summarize_peer(raw: dict[str, list[Any]]) -> dict[str, Any]:
    """The peers' own summary (bench/compare/peers/*.py), over the runs of every round."""
    s: dict[str, Any] = {}
    for key, runs in raw.items():
        if key.startswith("enqueue"):
            s[key] = summarize(runs)
        elif key.startswith("process"):
            s[key + "_jobs_per_s"] = summarize([x["jobs_per_s"] for x in runs])
        elif key == "latency":
            s["latency_p50_ms"] = summarize([x["p50_ms"] for x in runs])
            s["latency_p99_ms"] = summarize([x["p99_ms"] for x in runs])
            s["latency_enqueue_call_p50_ms"] = summarize([x.get("enqueue_call_p50_ms") for x in runs])
    return s


# ---------------------------------------------------------------- table
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

    none = med(ours.get("process_default_deliveries_per_s"))
    extras = [
        (f"Exclusive, {result['settings']['keys']} keys (deliveries/s)", ours.get("exclusive_deliveries_per_s"), 0,
         f"{fmt_num(ratio(med(ours.get('exclusive_deliveries_per_s')), none), 2)}× None"),
        (f"Ordered, {result['settings']['keys']} keys (deliveries/s)", ours.get("ordered_deliveries_per_s"), 0,
         f"{fmt_num(ratio(med(ours.get('ordered_deliveries_per_s')), none), 2)}× None"),
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

    def target(name: str, value: float | None, limit: float, op: str, unit: str = "") -> dict[str, Any]:
        met = None if value is None else (value >= limit if op == ">=" else value <= limit)
        return {"target": name, "value": value, "limit": limit, "op": op, "unit": unit, "met": met}

    keys, small, large = result["settings"]["keys"], result["settings"]["small"], result["settings"]["large"]
    mem_jobs = result["settings"]["mem_jobs"]
    pgq = summaries.get("pgqueuer") or {}
    p_def = med(pgq.get("process_default_jobs_per_s"))
    r_def = med((summaries.get("procrastinate") or {}).get("process_default_jobs_per_s"))
    mem = med(ours.get("mem_vmhwm_kib"))
    single = med(ours.get("publish_seq_msgs_per_s"))
    targets = [
        target("processing at defaults vs pgqueuer's defaults", ratio(none, p_def), 1.0, ">=", "×"),
        target("processing at defaults vs procrastinate's defaults", ratio(none, r_def), 8.0, ">=", "×"),
        target("single publish vs pgqueuer", ratio(single, med(pgq.get("enqueue_seq_jobs_per_s"))), 1.0, ">=", "×"),
        target("single publish vs the ceiling (pgbench, one INSERT + commit per transaction, 1 client)",
               ratio(single, med(ceiling_stat)), 0.5, ">=", "×"),
        target("batch publish vs pgqueuer", ratio(med(ours.get("publish_batch_msgs_per_s")),
                                                  med(pgq.get("enqueue_batch500_jobs_per_s"))), 0.7, ">=", "×"),
        target("latency p50 vs pgqueuer's p50", ratio(med(ours.get("latency_p50_ms")),
                                                      med(pgq.get("latency_p50_ms"))), 1.0, "<=", "×"),
        target("latency p99", med(ours.get("latency_p99_ms")), 20.0, "<=", " ms"),
        target(f"Exclusive ({keys} keys) vs None", ratio(med(ours.get("exclusive_deliveries_per_s")), none), 0.5, ">=",
               "×"),
        target(f"Ordered ({keys} keys) vs None", ratio(med(ours.get("ordered_deliveries_per_s")), none), 0.3, ">=",
               "×"),
        target(f"claim with {large:,} Pending vs {small:,}", ours.get("claim_large_over_small"), 1.3, "<=", "×"),
        target(f"worker RSS draining {mem_jobs:,}", None if mem is None else mem * 1024 / MB, 150.0, "<=", " MB"),
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
    lines += ["", "| target | measured | limit | met |", "| --- | --- | --- | --- |"]
    for t in targets:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}{t['unit']}"
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {v} | {t['op']} {t['limit']:g}{t['unit']} | {met} |")
    return rows + extra_rows + ([ceiling_row] if ceiling_row else []), targets, "\n".join(lines)


# ---------------------------------------------------------------- main
def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)  # stops the running step (and its workers) too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny counts, 1 repeat, peers skipped unless --peers")
    ap.add_argument("--repeats", type=int, default=None, help="repeats (default 3; 1 with --smoke)")
    ap.add_argument("--slow-repeats", type=int, default=None,
                    help="repeats of the backlog (1M fill) and memory cases (default: --repeats)")
    ap.add_argument("--only", default=",".join(OUR_FAST + OUR_SLOW),
                    help="our cases to run; the peers run the matching ones of publish,process,latency")
    ap.add_argument("--skip-peers", action="store_true", help="run our cases only")
    ap.add_argument("--peers", action="store_true", help="run the peers in --smoke mode too")
    ap.add_argument("--peer-list", default=None,
                    help=f"the peers to run, comma-separated, from {','.join(PEERS)} (default: all four); naming "
                    "them runs them in --smoke mode too")
    ap.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=None,
                    help="measure the pgbench ceiling of a single publish each round (default: on when the peers "
                    "run the publish case); needs pgbench and psql")
    ap.add_argument("--out", default=str(HERE / "results"), help="output folder")
    ap.add_argument("--pg-url", default=DEFAULT_PG, help="server URL without database ($BENCH_PG_URL)")
    ap.add_argument("--workqueue-dsn", default=None, help="database of our cases (default: <pg-url>/bench_workqueue)")
    ap.add_argument("--quiet-wait", type=float, default=None,
                    help="before each step, wait up to this many seconds for other processes to go quiet "
                    "(default 180; 0 with --smoke)")
    ap.add_argument("--library-ref", default=None,
                    help="measure the library (fastapi_workqueue/ and sql/) of this commit, extracted with "
                    "git archive, instead of the work tree (which may change while the benchmark runs)")
    ap.add_argument("--fresh-db", action=argparse.BooleanOptionalAction, default=True,
                    help="drop and recreate our database at the start (default: on)")
    ap.add_argument("--peers-dir", default=DEFAULT_PEERS_DIR, help="cache of the peer venvs ($BENCH_PEERS_DIR)")
    ap.add_argument("--peer-python", default=shutil.which("python3.11") or sys.executable,
                    help="Python 3.11 interpreter that creates the venvs of pgqueuer, procrastinate and DBOS")
    ap.add_argument("--peer-python312", default=None,
                    help="Python 3.12 interpreter that creates Oban's venv (default: python3.12 on PATH if it runs, "
                    "else the newest 3.12 of pyenv's versions)")
    ap.add_argument("--chart", action=argparse.BooleanOptionalAction, default=None,
                    help="render the PNG chart (default: on, off with --smoke); needs a venv with matplotlib")
    for key, value in FULL.items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(value), default=None,
                        help=f"{COUNT_HELP.get(key, '')}{'; ' if key in COUNT_HELP else ''}default {value} "
                        f"(smoke {SMOKE[key]})")
    args = ap.parse_args()

    counts = dict(SMOKE if args.smoke else FULL)
    for key in FULL:
        if getattr(args, key) is not None:
            counts[key] = getattr(args, key)
    repeats = args.repeats or (1 if args.smoke else 3)
    slow_repeats = args.slow_repeats or repeats
    peer_names = list(PEERS) if args.peer_list is None else [n.strip() for n in args.peer_list.split(",") if n.strip()]
    unknown_peers = [n for n in peer_names if n not in PEERS]
    if unknown_peers:
        ap.error(f"unknown peers {unknown_peers}; choose from {','.join(PEERS)}")
    run_peers = (not args.skip_peers and bool(peer_names)
                 and (args.peers or args.peer_list is not None or not args.smoke))
    chart = args.chart if args.chart is not None else not args.smoke
    if args.quiet_wait is None:
        args.quiet_wait = 0.0 if args.smoke else 180.0
    which = [w for w in args.only.split(",") if w]
    unknown = set(which) - set(OUR_FAST + OUR_SLOW)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; choose from {','.join(OUR_FAST + OUR_SLOW)}")
    peer_only = sorted({PEER_CASES[w] for w in which if w in PEER_CASES})
    if not peer_only:
        run_peers = False
    selected = peer_names if run_peers else []
    run_ceiling = args.ceiling if args.ceiling is not None else (run_peers and "publish" in which)

    out = Path(args.out).resolve()
    rounds_dir = out / "rounds"
    rounds_dir.mkdir(parents=True, exist_ok=True)
    for old in rounds_dir.glob("*.json"):
        old.unlink()
    (out / "run.log").unlink(missing_ok=True)
    log = Log(out / "run.log")
    started = time.time()
    wq_dsn = args.workqueue_dsn or db_url(args.pg_url, "bench_workqueue")
    lib_root, our_env = ROOT, None
    if args.library_ref:
        lib_root = out / "library"
        commit = snapshot_library(args.library_ref, lib_root)
        our_env = {**os.environ, "PYTHONPATH": str(lib_root)}
        uncommitted = False
    else:
        commit = git("rev-parse", "--short", "HEAD")
        uncommitted = bool(git("status", "--porcelain", "--", "fastapi_workqueue", "sql"))
    meta: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "commit": commit,
        "library_source": f"git archive of {args.library_ref} ({commit}) in {lib_root}" if args.library_ref
        else f"work tree {ROOT}",
        "library_changes_uncommitted": uncommitted,
        "library_digest_start": library_digest(lib_root),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                 "loadavg_start": os.getloadavg()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "mode": "smoke" if args.smoke else "full",
    }
    log(f"== fastapi-workqueue benchmark ({meta['mode']}) commit {meta['commit']} at {meta['date_utc']} UTC")
    log(f"   counts {counts}, repeats {repeats}, slow repeats {slow_repeats}, "
        f"peers {','.join(selected) or 'none'}, ceiling {run_ceiling}")
    if importlib.util.find_spec("uvloop") is None:
        # pgqueuer's worker runs on uvloop (its CLI installs and uses it); ours would run on asyncio.
        log("   note: uvloop is not installed in this interpreter, so our worker runs on asyncio; "
            "`pip install -e '.[fast]'` (scripts/test does) installs it")

    if args.fresh_db:
        # Our schema is applied from the work tree at the start of the run.
        wq_base, _, wq_name = wq_dsn.rpartition("/")
        ensure_databases(wq_base, [wq_name], log, recreate=True)
    failures: list[str] = []
    peer_py: dict[str, Path] = {}
    peer_errors: dict[str, str] = {}
    if selected:
        ensure_databases(args.pg_url, [PEERS[n]["db"] for n in selected], log)
        pythons: dict[str, str | None] = {"3.11": args.peer_python, "3.12": args.peer_python312}
        if pythons["3.12"] is None and any(PEERS[n]["python"] == "3.12" for n in selected):
            pythons["3.12"] = find_python("3.12")
        for name in selected:
            try:
                peer_py[name] = ensure_venv(Path(args.peers_dir), name, PEERS[name]["pip"],
                                            peer_interpreter(name, pythons), log)
            except ValueError as exc:
                peer_errors[name] = str(exc)
            except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                peer_errors[name] = f"venv/install failed: {exc}"
            if name in peer_errors:
                log(f"!! {name}: {peer_errors[name]}")
                failures.append(f"{name}: {peer_errors[name]}")
    ceiling_error: str | None = None
    if run_ceiling:
        missing = [tool for tool in ("pgbench", "psql") if shutil.which(tool) is None]
        if missing:
            ceiling_error = (f"{' and '.join(missing)} not found (PostgreSQL's client programs, e.g. "
                             "`apt-get install postgresql-client`)")
            log(f"!! ceiling: {ceiling_error}")
            failures.append(f"ceiling: {ceiling_error}")
        else:
            ensure_databases(args.pg_url, [CEILING_DB], log)

    ours_common = [
        sys.executable, str(HERE / "workqueue_bench.py"), "--dsn", wq_dsn,
        "--jobs", str(counts["jobs"]), "--batch", str(counts["batch"]), "--concurrency", str(counts["concurrency"]),
        "--lat-count", str(counts["lat_count"]), "--lat-spacing", str(counts["lat_spacing"]),
        "--keys", str(counts["keys"]), "--small", str(counts["small"]), "--large", str(counts["large"]),
        "--first-n", str(counts["first_n"]), "--mem-jobs", str(counts["mem_jobs"]),
        "--fill-batch", str(counts["fill_batch"]), "--claim-calls", str(counts["claim_calls"]),
    ]
    fast = [w for w in OUR_FAST if w in which]
    slow = [w for w in OUR_SLOW if w in which]
    noise: list[dict[str, Any]] = []
    monitor = NoiseMonitor({wq_dsn.rpartition("/")[2], CEILING_DB, *(p["db"] for p in PEERS.values())})
    monitor.start()
    our_files: list[Path] = []
    peer_files: dict[str, list[Path]] = {name: [] for name in PEERS}
    ceiling_files: list[Path] = []
    for r in range(repeats):
        steps: list[tuple[str, list[str], Path]] = []
        if fast:
            f = rounds_dir / f"workqueue_r{r + 1}.json"
            steps.append(("workqueue", [*ours_common, "--only", ",".join(fast), "--repeats", "1", "--out", str(f)], f))
        for name, py in peer_py.items():
            f = rounds_dir / f"{name}_r{r + 1}.json"
            steps.append((name, [
                str(py), str(HERE / "peers" / PEERS[name]["script"]), "--dsn", db_url(args.pg_url, PEERS[name]["db"]),
                "--jobs", str(counts["jobs"]), "--batch", str(counts["batch"]),
                "--concurrency", str(counts["concurrency"]), "--repeats", "1",
                "--lat-count", str(counts["lat_count"]), "--lat-spacing", str(counts["lat_spacing"]),
                "--only", ",".join(peer_only), "--out", str(f),
                *(x for opt, key in PEERS[name].get("count_args", {}).items() for x in (opt, str(counts[key]))),
            ], f))
        if run_ceiling and ceiling_error is None:
            f = rounds_dir / f"ceiling_r{r + 1}.json"
            steps.append(("ceiling", [
                sys.executable, str(HERE / "ceiling.py"), "--dsn", db_url(args.pg_url, CEILING_DB),
                "--seconds", str(counts["ceiling_seconds"]), "--repeats", "1", "--out", str(f),
            ], f))
        shift = r % len(steps) if steps else 0
        steps = steps[shift:] + steps[:shift]  # rotate who goes first
        log(f"== round {r + 1}/{repeats}: {', '.join(s[0] for s in steps)}")
        for name, cmd, f in steps:
            rc = run_step(cmd, log, timeout=3600, monitor=monitor, noise=noise, label=f"{name} round {r + 1}",
                          quiet_wait=args.quiet_wait, env=our_env if name == "workqueue" else None)
            if rc != 0 or not f.exists():
                failures.append(f"{name} round {r + 1}: exit {rc}")
                continue
            {"workqueue": our_files, "ceiling": ceiling_files}.get(name, peer_files.get(name, [])).append(f)
    if slow:
        f = rounds_dir / "workqueue_slow.json"
        log(f"== our backlog and memory cases ({slow_repeats} repeats)")
        rc = run_step([*ours_common, "--only", ",".join(slow), "--repeats", str(slow_repeats), "--out", str(f)],
                      log, timeout=4 * 3600, monitor=monitor, noise=noise, label="workqueue slow cases",
                      quiet_wait=args.quiet_wait, env=our_env)
        if rc != 0 or not f.exists():
            failures.append(f"workqueue slow cases: exit {rc}")
        else:
            our_files.append(f)

    # merge
    raw, docs = merge_raw(our_files)
    ours: dict[str, Any] = {"summary": summarize_raw(raw), "raw": raw}
    if docs:
        ours.update({k: docs[0].get(k) for k in ("versions", "python", "postgres", "migrations")})
        ours["settings"] = docs[0].get("settings")
    result: dict[str, Any] = {
        "meta": meta,
        "settings": {**counts, "repeats": repeats, "slow_repeats": slow_repeats, "claim_limit": 4,
                     "cases": which, "peers": selected, "peer_cases": peer_only if run_peers else [],
                     "ceiling": run_ceiling},
        "versions": {"fastapi-workqueue": (ours.get("versions") or {}).get("fastapi-workqueue")},
        "workqueue": ours,
    }
    for name in selected:
        if name in peer_errors:
            result[name] = {"error": peer_errors[name]}
            continue
        if not peer_files[name]:
            result[name] = None
            continue
        praw, pdocs = merge_raw(peer_files[name])
        result[name] = {"summary": summarize_peer(praw), "raw": praw, "version": pdocs[0].get("version"),
                        "none": PEERS[name].get("none", {}),
                        "python": pdocs[0].get("python"), "postgres": pdocs[0].get("postgres"),
                        "settings": pdocs[0].get("settings"),
                        "packages": pip_versions(peer_py[name], PEERS[name]["packages"])}
        result["versions"][name] = pdocs[0].get("version")
    if run_ceiling:
        if ceiling_error:
            result["ceiling"] = {"error": ceiling_error}
        elif ceiling_files:
            craw, cdocs = merge_raw(ceiling_files)
            result["ceiling"] = {"summary": {"insert_c1_tps": summarize([x["tps"] for x in craw.get("insert_c1", [])])},
                                 "raw": craw, "version": cdocs[0].get("version"), "settings": cdocs[0].get("settings")}
            result["versions"]["pgbench"] = cdocs[0].get("version")
        else:
            result["ceiling"] = {"error": "every pgbench step failed (run.log says why)"}
    meta["library_digest_end"] = library_digest(lib_root)
    meta["library_changed_during_run"] = meta["library_digest_end"] != meta["library_digest_start"]
    meta["loadavg_end"] = os.getloadavg()
    meta["minutes"] = (time.time() - started) / 60
    meta["failures"] = failures
    meta["other_cpu_per_step"] = noise
    monitor.stopped.set()
    meta["library_path_measured"] = sorted({d.get("library_path") for d in docs if d.get("library_path")})
    _, targets, table = build_report(result)
    result["targets"] = targets
    result["table_markdown"] = table
    busy = sum(sum(n["other_cpu_s"].values()) for n in noise)
    wall = sum(n["seconds"] for n in noise) or 1
    meta["other_cpu_share"] = busy / wall
    noise_note = (f" Other processes on the machine used {busy:,.0f} CPU-seconds during the {wall / 60:.0f} min of "
                  f"measurement ({100 * busy / wall:.0f} % of one core; per step in run.log).")
    source = " (library measured from the commit's files, git archive)" if args.library_ref else ""
    if meta["library_changes_uncommitted"]:
        source = " (library files modified in the work tree)"
    header = (f"Run of {meta['date_utc']} UTC, commit {meta['commit']}{source}, "
              f"{meta['mode']} mode, {repeats} repeats ({slow_repeats} for backlog and memory), "
              f"{meta['minutes']:.0f} min; median [min–max]; ratios are ours / peer of the medians "
              "(for latency lower is better)." + noise_note)
    result["header_markdown"] = header
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(header + "\n\n" + table + "\n")
    log("")
    log(header)
    log("")
    log(table)
    if meta["library_changed_during_run"]:
        log("!! the library's code or SQL changed while the benchmark ran; figures may mix versions")
    if failures:
        log("!! failures: " + "; ".join(failures))

    if chart:
        try:
            py = ensure_venv(Path(args.peers_dir), "chart", CHART_PIP, args.peer_python, log)
            subprocess.run([str(py), str(HERE / "chart.py"), str(out / "results.json"), str(out / "results.png")],
                           check=True, timeout=300)
            log(f"chart: {out / 'results.png'}")
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            log(f"!! chart not rendered: {exc}")
    log(f"results: {out / 'results.json'}, {out / 'results.md'} ({meta['minutes']:.1f} min)")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
