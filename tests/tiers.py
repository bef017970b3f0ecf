"""Test tiers: every collected test gets one kind, and ``slow`` when it is slow.

The markers are registered in pyproject.toml (``--strict-markers``); ``tests/conftest.py`` applies
them at collection, so no test file needs to name them:

- kind, exactly one per test: ``aws`` (under ``tests/aws/``, or a conformance case on the ``aws``
  harness: a moto server), ``browser`` (``tests/dashboard/test_browser.py``: headless Chromium),
  ``integration`` (a real database: one of :data:`DATABASE_FIXTURES`, or a database named in the
  code the test runs, :data:`USES_DATABASE`), ``unit`` (the rest). An explicit kind marker on a test
  replaces ``unit``; one that contradicts a database the test uses leaves two kinds, and the
  collection stops with a usage error that names the test (as ``--strict-markers`` does for an
  unknown marker), in every run, whatever part of the suite it collects.
- ``slow``: the code the test runs starts processes (:data:`STARTS_PROCESSES`), it drives a
  browser, carries ``@pytest.mark.slow``, is in one of :data:`SLOW_MODULES`, or reaches one of
  :data:`SLOW_DEFINITIONS` (a test or a helper that starts processes out of sight, or costs more
  than about 3 s on the 2-core machine: ``pytest --durations``). ``pytest -m "not slow"`` is the
  inner loop.

"The code the test runs" is read from the source: the test function, the fixtures it uses (from
its file or a conftest.py), and the functions and classes of the same file they name, followed
name by name. Helpers imported from another module of tests/ are not followed into, but they are
reached under the name they have where they are defined: :data:`SLOW_DEFINITIONS` names such a
helper once (``aws/test_cli_aws.py::workqueue``) for every test whose code calls it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

KINDS = ("unit", "integration", "aws", "browser")
TIERS = pytest.StashKey[dict[str, tuple[tuple[str, ...], bool]]]()
"""What each collected test got, by node id: its kinds and whether it is slow (read by tests/test_tiers.py)."""

DATABASE_FIXTURES = frozenset({
    "pg_url", "sqlite_url", "database_url", "fresh_url", "pg_transport", "harness", "scratch_url",
    "second_scratch_url", "own_database",
})
"""Fixtures that hand a test a real database (every fixture built on them counts through pytest's closure)."""

USES_DATABASE = re.compile(
    r"\bPG_URL\b|sqlite(\+aiosqlite)?:///\{|\b(Sqlite|Postgres|Mssql)Transport\(|\bcreate_async_engine\(|"
    r"\b(asyncpg|aiosqlite|sqlite3)\.connect\("
)
"""A database the code a test runs opens: the session's server, a file of its own (an f-string URL), a
transport, an engine or a driver's connection (a URL named and never opened does not count)."""

STARTS_PROCESSES = re.compile(
    r"\bcreate_subprocess_(exec|shell)\(|\bsubprocess\.(run|Popen|call|check_call|check_output)\(|\bPopen\(|"
    r"\brunpytest_subprocess\(|\bmultiprocessing\b|\bprivate_cluster\("
)
"""A process started by the code a test runs."""

SLOW_MODULES = frozenset({
    "test_soak.py",  # a worker fleet under a private cluster restart
    "test_multiprocess.py",  # worker processes, SIGKILLed
    "test_hostile.py",  # API fuzzing (schemathesis), a database that goes away mid-run
    "test_private_cluster.py",  # initdb, start, restart, remove a cluster
    "test_stall.py",  # worker processes stalled past their lease
    "test_cli.py",  # the `workqueue` command in subprocesses
    "test_jobs_cli.py",  # job worker processes, signals, schedules across processes
    "test_bench_smoke.py",  # bench/compare/run.py --smoke
    "test_bench_load_smoke.py",  # bench/load/load.py --smoke (uvicorn, clients)
    "test_bench_jobs_smoke.py",  # bench/jobs/jobs_bench.py --smoke
    "dashboard/test_browser.py",  # Chromium
    "dashboard/test_bounded_reads.py",  # a million rows
})
"""Modules, relative to tests/, whose every test is slow."""

SLOW_DEFINITIONS = frozenset({
    # a property-based state machine against its model, on both stores
    "test_model.py::test_the_delivery_state_machine_matches_its_model",
    # sqlfluff's parse of every T-SQL file, some 50 s once per session, for every check that reads it
    # (the checks of the same files that need no parse stay in the inner loop)
    "test_mssql_sql.py::parse_tree",
    # processes started through a helper of another module, or a script
    "aws/test_cli_aws.py::workqueue",  # the `workqueue` command in a subprocess (test_cli_operator, test_move)
    "test_docs_getting_started.py::test_a_worker_process_handles_what_the_web_process_publishes",
    "test_docs_getting_started.py::test_the_first_app_welcomes_a_user_in_its_own_process",
    "test_docs_reference.py::test_every_entry_and_public_member_renders_and_no_internal_does",
    # over about 3 s (pytest --durations on the shared 2-core machine)
    "test_jobs_outcomes.py::test_a_taken_overlap_key_or_a_busy_once_key_sends_the_attempt_back_saying_why",
    "test_leases.py::test_the_end_of_an_attempt_leaves_the_next_attempt_of_the_same_delivery_alone",
    "test_jobs_worker.py::test_a_missed_tick_is_queued_only_with_catch_up",
    # 17 s: 13.5 s of it the test's own waits, messages arriving late in a long poll (0, 4.5 and 9 s)
    "aws/test_lease_defaults.py::test_messages_arriving_late_in_a_long_poll_run_in_order_on_their_first_attempt",
    # 6 s, 5 s and 3.5 s: leases of 5 s and retries on moto, in real time
    "aws/test_lease_defaults.py::test_a_short_lease_keeps_every_attempt_and_the_librarys_dead_letter_comes_first",
    "aws/test_fifo_order.py::test_two_workers_keep_each_keys_order_through_retries",
    "aws/test_fifo_order.py::test_a_retrying_head_keeps_its_key_in_order",
    # 1.5 to 3 s there, mostly waiting on real time: out of the inner loop, which must stay under 2 min
    "test_claim_many.py::test_claim_many_reads_each_claim_index_up_to_the_limit_whatever_the_backlog",
    "test_example_app.py::test_processes_starting_at_once_on_an_empty_database_all_start",
    "test_jobs_worker.py::test_a_job_that_blocks_the_loop_past_its_timeout_is_timed_out_not_processed",
    "test_jobs_worker.py::test_a_job_that_returns_after_its_lease_ran_out_is_not_processed",
    "test_jobs_worker.py::test_a_lifespan_worker_with_a_strict_list_warns_on_its_own_when_idle",
    "test_runtime.py::test_auto_heartbeat_keeps_a_long_handler_leased",
    "test_runtime.py::test_fast_handlers_are_fed_ahead_and_all_complete",
    "test_scaler.py::test_the_documented_query_counts_what_backlog_counts",
    "dashboard/test_pages.py::test_while_the_store_is_away_a_caller_not_signed_in_sees_no_driver_text",
    "conformance/test_publish.py::test_c07_filters_match_case_sensitively[aws]",
    "conformance/test_claim_many.py::test_each_delivery_is_leased_for_its_own_subscription[aws]",
    "conformance/test_lease.py::test_c12_a_short_lease_runs_out_in_real_time[aws]",
})
"""Functions and classes, ``file relative to tests/::name``, that make slow every test whose code
reaches them: a slow test itself (every parameter; with ``[...]``, that case only), or a helper or
fixture it uses."""


@cache
def _relative(path: Path) -> str | None:
    try:
        return path.resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return None


@dataclass(frozen=True)
class _Definition:
    source: str
    names: frozenset[str]  # the names its code refers to


@cache
def _source(path: Path) -> tuple[list[str], list[ast.stmt]]:
    """A file's lines and top-level statements, parsed once (none when it is missing)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return [], []
    return text.splitlines(keepends=True), ast.parse(text).body


@cache
def _definitions(path: Path) -> dict[str, _Definition]:
    """The top-level functions and classes of a test file, by name (fixtures among them)."""
    lines, body = _source(path)
    found: dict[str, _Definition] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
            found[node.name] = _Definition("".join(lines[node.lineno - 1 : node.end_lineno]), names)
    return found


def _module_file(path: Path, module: str | None, level: int) -> Path | None:
    """The file of tests/ that ``from <module> import ...`` in ``path`` reads, if it is one."""
    parts = (module or "").split(".") if module else []
    if level:  # relative: from the file's package, one level up per extra dot
        base = path.resolve().parent
        for _ in range(level - 1):
            base = base.parent
    elif parts and parts[0] == TESTS.name:
        base, parts = TESTS, parts[1:]
    else:
        return None
    target = base.joinpath(*parts)
    for candidate in (target.with_suffix(".py"), target / "__init__.py"):
        if candidate.is_file() and _relative(candidate) is not None:
            return candidate
    return None


@cache
def _imports(path: Path) -> dict[str, str]:
    """The names a test file imports from other modules of tests/, each as ``file relative to
    tests/::name`` where it is defined (what :data:`SLOW_DEFINITIONS` may name)."""
    found: dict[str, str] = {}
    for node in _source(path)[1]:
        if isinstance(node, ast.ImportFrom):
            source = _module_file(path, node.module, node.level)
            if source is not None:
                for alias in node.names:
                    found[alias.asname or alias.name] = f"{_relative(source)}::{alias.name}"
    return found


def _conftests(path: Path) -> list[Path]:
    """The conftest.py files that apply to a test file, nearest first, up to tests/."""
    found: list[Path] = []
    for folder in path.resolve().parents:
        found.append(folder / "conftest.py")
        if folder == TESTS:
            return found
    return [path.resolve().parent / "conftest.py"]


@dataclass(frozen=True)
class _Reached:
    code: str  # their source, joined
    definitions: frozenset[str]  # "file relative to tests/::name"


def _reached(item: pytest.Item) -> _Reached:
    """The code a test runs of its own: its function, the fixtures it uses and the functions and
    classes of its file (or of the fixture's conftest) that they name, followed name by name."""
    path = Path(item.path)
    files = [path, *_conftests(path)]
    todo = [(path, getattr(item, "originalname", item.name))]
    cls: type | None = getattr(item, "cls", None)
    if cls is not None:  # a method: its class is what the file defines
        todo.append((path, cls.__name__))
    imported: set[str] = set()  # helpers of other modules, by where they are defined
    for name in getattr(item, "fixturenames", ()):
        owner = next((file for file in files if name in _definitions(file)), None)  # the nearest definition
        if owner is not None:
            todo.append((owner, name))
        elif name in _imports(path):  # a fixture the test file imports from another module
            imported.add(_imports(path)[name])
    seen: set[tuple[Path, str]] = set()
    parts: list[str] = []
    while todo:
        file, name = todo.pop()
        defined = _definitions(file)
        if (file, name) in seen or name not in defined:
            continue
        seen.add((file, name))
        parts.append(defined[name].source)
        todo.extend((file, used) for used in defined[name].names if used in defined)
        imported.update(_imports(file)[used] for used in defined[name].names if used in _imports(file))
    return _Reached(
        "\n".join(parts), frozenset({f"{_relative(file)}::{name}" for file, name in seen} | imported)
    )


def kind_of(item: pytest.Item, reached: _Reached) -> str:
    """The kind the test's path and use say."""
    module = _relative(Path(item.path)) or ""
    callspec = getattr(item, "callspec", None)
    if module.startswith("aws/") or (callspec is not None and callspec.params.get("harness") == "aws"):
        return "aws"
    if module == "dashboard/test_browser.py":
        return "browser"
    if DATABASE_FIXTURES.intersection(getattr(item, "fixturenames", ())) or USES_DATABASE.search(reached.code):
        return "integration"
    return "unit"


def is_slow(item: pytest.Item, kind: str, reached: _Reached) -> bool:
    """True when the test's path, its marker or the code it runs say it is slow."""
    if kind == "browser" or item.get_closest_marker("slow") is not None:
        return True
    module = _relative(Path(item.path))
    if module in SLOW_MODULES or f"{module}::{item.name}" in SLOW_DEFINITIONS:
        return True
    if SLOW_DEFINITIONS & reached.definitions:
        return True
    return STARTS_PROCESSES.search(reached.code) is not None


def apply(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks every item with its kind and, when slow, ``slow``; records both in ``config.stash``."""
    record: dict[str, tuple[tuple[str, ...], bool]] = {}
    for item in items:
        reached = _reached(item)
        computed = kind_of(item, reached)
        explicit = [kind for kind in KINDS if item.get_closest_marker(kind) is not None]
        if computed not in explicit and (computed != "unit" or not explicit):
            item.add_marker(computed)
        slow = is_slow(item, computed, reached)
        if slow and item.get_closest_marker("slow") is None:
            item.add_marker("slow")
        record[item.nodeid] = (tuple(k for k in KINDS if item.get_closest_marker(k) is not None), slow)
    config.stash[TIERS] = record
    wrong = {nodeid: kinds for nodeid, (kinds, _) in record.items() if len(kinds) != 1}
    if wrong:
        raise pytest.UsageError(
            f"each test needs exactly one of {', '.join(KINDS)}; tests/tiers.py gives it from what the test "
            "uses, and an explicit marker must agree with it: "
            + "; ".join(f"{nodeid} has {' and '.join(kinds) or 'none'}" for nodeid, kinds in wrong.items())
        )
