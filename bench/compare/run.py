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

from compare_report import PEERS, build_report, fmt_num, fmt_stat, med, paired_ratios, ratio  # noqa: E402, F401  (bench/jobs uses them)
from workqueue_bench import summarize, summarize_raw  # noqa: E402

CEILING_DB = "bench_pgbench"
PYTHON_OPTION = {"3.11": "--peer-python", "3.12": "--peer-python312"}  # the option that names each interpreter
CHART_PIP = ["matplotlib>=3.8"]
DEFAULT_PG = os.environ.get("BENCH_PG_URL", "postgresql://postgres:postgres@127.0.0.1:5432")
DEFAULT_PEERS_DIR = os.environ.get("BENCH_PEERS_DIR", "/tmp/workqueue-bench-peers")
OUR_FAST = ["publish", "process", "latency", "exclusive", "ordered", "fanout"]
OUR_SLOW = ["backlog", "mem"]
PEER_CASES = {"publish": "enqueue", "process": "process", "latency": "latency"}

FULL = {"jobs": 20000, "batch": 500, "concurrency": 10, "lat_count": 200, "lat_spacing": 0.020, "keys": 500,
        "keyed_jobs": 100_000,
        "small": 10_000, "large": 1_000_000, "first_n": 20_000, "mem_jobs": 100_000, "fill_batch": 5000,
        "claim_calls": 250, "dbos_c10_jobs": 1000, "ceiling_seconds": 20}
SMOKE = {"jobs": 300, "batch": 100, "concurrency": 10, "lat_count": 20, "lat_spacing": 0.020, "keys": 20,
         "keyed_jobs": 300,
         "small": 300, "large": 3000, "first_n": 300, "mem_jobs": 1000, "fill_batch": 500, "claim_calls": 20,
         "dbos_c10_jobs": 30, "ceiling_seconds": 2}
# What the counts mean where the name does not say it.
COUNT_HELP = {
    "keyed_jobs": "deliveries of the Exclusive and Ordered cases and of the None case they are compared with",
    "dbos_c10_jobs": "jobs of DBOS's concurrency run: its queue starts at most --concurrency workflows per 1 s "
    "poll, so 20,000 would take over half an hour",
    "ceiling_seconds": "length of one pgbench run of the ceiling",
}


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
        "--keys", str(counts["keys"]), "--keyed-jobs", str(counts["keyed_jobs"]),
        "--small", str(counts["small"]), "--large", str(counts["large"]),
        "--first-n", str(counts["first_n"]), "--mem-jobs", str(counts["mem_jobs"]),
        "--fill-batch", str(counts["fill_batch"]), "--claim-calls", str(counts["claim_calls"]),
    ]
    fast = [w for w in OUR_FAST if w in which]
    slow = [w for w in OUR_SLOW if w in which]
    noise: list[dict[str, Any]] = []
    wq_db = wq_dsn.rpartition("/")[2]
    monitor = NoiseMonitor({wq_db, f"{wq_db}_small", CEILING_DB, *(p["db"] for p in PEERS.values())})
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
