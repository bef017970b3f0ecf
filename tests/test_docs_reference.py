"""docs/reference.md renders every public name and no internal one, each public member documented.

The page's top-level ``:::`` entries are kept equal to ``fastapi_workqueue.__all__`` and to
``fastapi_workqueue.jobs.__all__``; the site is built (``mkdocs build --strict``) and the anchors of
the rendered page are compared with the public members found by ``inspect``: every public member
renders, except the internals named in INTERNAL (which the page's ``filters`` leave out), and has a
docstring.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import fastapi_workqueue
import fastapi_workqueue.jobs
from fastapi_workqueue import WorkQueue, WorkQueueSettings

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference.md"
DIRECTIVE = re.compile(r"^::: (\S+)[ \t]*$", re.MULTILINE)
SUMMARY_ONLY = re.compile(r"^::: (\S+)[ \t]*\n    options:\n      members: false[ \t]*$", re.MULTILINE)
"""Entries rendered without their members (``members: false``): a transport, whose methods are the port."""
ANCHOR = re.compile(r'id="(fastapi_workqueue\.[\w.]+)"')

INTERNAL: dict[str, set[str]] = {
    # Used by the package's own modules and tests (the CLI, the jobs fake, the layers' kernel): not for users.
    "fastapi_workqueue.WorkQueue": {"bind_app", "build_host", "handlers", "kernel", "request_load"},
    "fastapi_workqueue.WorkQueueSettings": {"host_options", "session_pool"},
    "fastapi_workqueue.jobs.Job": {"key", "load", "validate"},
    "fastapi_workqueue.jobs.JobFake": {"record", "record_debounced", "record_group"},
}
"""Public-looking members that the reference leaves out (docs/reference.md's ``filters``)."""

ISSUE_NAMES = {
    "fastapi_workqueue.WorkQueue": [
        "stats", "backlog", "dead_letters", "deliveries", "get_delivery", "partitions", "pause", "resume",
        "health_router", "metrics_router", "dashboard", "dispatch", "bulk", "chain", "size", "listen",
        "schedule", "fake", "publish",
    ],
    "fastapi_workqueue.Outcome": ["discard"],
    "fastapi_workqueue.PublishResults": ["raise_for_errors"],
}
"""Members the issue names one by one (``retire`` joins them when WorkQueue has it)."""


def directives() -> list[str]:
    return DIRECTIVE.findall(REFERENCE.read_text(encoding="utf-8"))


def resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError:
        return getattr(resolve(module), name)


def _owner(cls: type, name: str) -> type | None:
    """The first class of the MRO that defines ``name``, if it is the package's (members inherited
    from pydantic, Exception, list … are not the package's)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass if klass.__module__.startswith("fastapi_workqueue") else None
    return None


def public_members(cls: type, *, inherited_from_documented: bool = True) -> dict[str, Any]:
    """The public methods and properties of ``cls`` that the package defines, by name; without
    those a documented base class defines (they render with it) unless ``inherited_from_documented``."""
    documented = set(documented_classes().values())
    found = {}
    for name in dir(cls):
        owner = _owner(cls, name)
        if name.startswith("_") or owner is None:
            continue
        if owner is not cls and owner in documented and not inherited_from_documented:
            continue
        value = vars(owner)[name]
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property | functools.cached_property):
            found[name] = value
    return found


def instance_attributes() -> set[str]:
    """The public attributes a WorkQueue sets on itself."""
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))
    return {name for name in vars(queue) if not name.startswith("_")}


def documented_classes() -> dict[str, type]:
    """The classes the page renders with their members."""
    summary_only = set(SUMMARY_ONLY.findall(REFERENCE.read_text(encoding="utf-8")))
    return {path: obj for path in directives() if path not in summary_only and inspect.isclass(obj := resolve(path))}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The anchors of the built reference page: ``fastapi_workqueue.WorkQueue.publish`` …"""
    site = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, f"mkdocs build --strict failed (the docs extra installed?):\n{built.stderr}"
    return set(ANCHOR.findall((site / "reference.html").read_text(encoding="utf-8")))


def test_the_reference_has_an_entry_for_every_exported_name_and_no_other() -> None:
    entries = directives()
    assert len(entries) == len(set(entries)), "a name has two ::: entries"
    top = {p.removeprefix("fastapi_workqueue.") for p in entries if p.count(".") == 1}
    assert sorted(set(fastapi_workqueue.__all__) - top) == [], "exported but not in docs/reference.md"
    assert sorted(top - set(fastapi_workqueue.__all__)) == [], "in docs/reference.md but not exported"

    jobs = {p.removeprefix("fastapi_workqueue.jobs.") for p in entries if p.startswith("fastapi_workqueue.jobs.")}
    also_top = {n for n in fastapi_workqueue.jobs.__all__
                if n in top and getattr(fastapi_workqueue, n) is getattr(fastapi_workqueue.jobs, n)}
    assert sorted(set(fastapi_workqueue.jobs.__all__) - jobs - also_top) == []
    assert sorted(jobs - set(fastapi_workqueue.jobs.__all__)) == []
    for path in entries:
        resolve(path)  # every entry names something that exists


def test_every_entry_and_public_member_renders_and_no_internal_does(rendered: set[str]) -> None:
    missing = [path for path in directives() if path not in rendered]
    assert missing == []
    for path, cls in documented_classes().items():
        members = set(public_members(cls, inherited_from_documented=False))
        if cls is WorkQueue:
            members |= instance_attributes()
        internal = INTERNAL.get(path, set())
        assert sorted(internal - members) == [], f"{path}: INTERNAL names members it does not have"
        shown = {anchor.removeprefix(path + ".") for anchor in rendered if anchor.startswith(path + ".")}
        assert sorted(members - internal - shown) == [], f"{path}: public members that do not render"
        assert sorted(internal & shown) == [], f"{path}: internals that render"


def test_the_names_the_issue_lists_render(rendered: set[str]) -> None:
    wanted = [f"{path}.{name}" for path, names in ISSUE_NAMES.items() for name in names]
    if hasattr(WorkQueue, "retire"):
        wanted.append("fastapi_workqueue.WorkQueue.retire")
    wanted += [f"fastapi_workqueue.{name}" for name in ("PublishResults", "PublishFailed", "UnknownTopic",
                                                        "JobContext")]
    wanted += [f"fastapi_workqueue.jobs.{name}" for name in ("without_overlapping", "JobFake", "JobEvent")]
    assert sorted(set(wanted) - rendered) == []


def test_every_public_member_has_a_docstring() -> None:
    undocumented = [
        f"{path}.{name}"
        for path, cls in documented_classes().items()
        for name, value in public_members(cls).items()
        if not inspect.getdoc(value.fget if isinstance(value, property) else value)
    ]
    undocumented += [p for p in directives() if callable(obj := resolve(p)) and not inspect.getdoc(obj)]
    assert undocumented == []
