"""The package's import rules, read from the source (so ``TYPE_CHECKING`` and function-level imports
count as much as those at the top of a module):

- ``core`` imports nothing of the package outside ``core``;
- no module imports ``fastapi_workqueue.queue`` (the app-facing ``WorkQueue``) but the package's
  ``__init__`` (its public name) and the CLI's app loading (which finds the app's queue and makes
  the CLI's own queues); the layers receive the kernel (``core/kernel.py``) instead;
- no module imports the package root (``from fastapi_workqueue import ...``, ``from .. import``);
- no cycle between the package's parts: each subpackage is one node, each top-level module another.

The checker runs on the package and on small made-up packages, so that it is seen to catch each kind
of violation (docs/design/kernel.md).
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Mapping
from pathlib import Path

PACKAGE = "fastapi_workqueue"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

QUEUE = f"{PACKAGE}.queue"
QUEUE_IMPORTERS = frozenset({PACKAGE, f"{PACKAGE}.cli.app_loader"})
"""The modules that may import queue.py: the package's ``__init__`` and the CLI's app loading."""


def module_imports(name: str, source: str, *, is_package: bool, modules: Collection[str]) -> set[str]:
    """The modules of the package that module ``name`` imports anywhere in ``source``. ``from X import
    n`` counts as module ``X.n`` when that is one of ``modules``, else as ``X``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


def read_package(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package (by dotted name) with the package's modules it imports."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return {
        name: module_imports(name, path.read_text(encoding="utf-8"), is_package=is_package, modules=files)
        for name, (path, is_package) in files.items()
    }


def node_of(module: str) -> str:
    """The part of the package a module belongs to: its subpackage, or itself for a top-level
    module (``__init__`` for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def part_graph(imports: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the package's parts (see :func:`node_of`)."""
    graph: dict[str, set[str]] = {}
    for module, targets in imports.items():
        here = node_of(module)
        graph.setdefault(here, set()).update(node_of(t) for t in targets if node_of(t) != here)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``: each strongly connected part of more than one node, sorted
    (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def problems(imports: Mapping[str, set[str]]) -> list[str]:
    """Every import that breaks a rule of the module's docstring, one line each."""
    found = []
    for module, targets in sorted(imports.items()):
        for target in sorted(targets):
            if node_of(module) == "core" and node_of(target) != "core":
                found.append(f"{module} imports {target}: core imports nothing of the package outside core")
            if target == QUEUE and module not in QUEUE_IMPORTERS:
                found.append(f"{module} imports {QUEUE}: a layer receives the kernel (core/kernel.py), not the "
                             "WorkQueue")
            if target == PACKAGE and module != PACKAGE:
                found.append(f"{module} imports the package root {PACKAGE}: import from the module that "
                             "defines the name")
    found += [f"the parts {' <-> '.join(cycle)} import each other" for cycle in cycles(part_graph(imports))]
    return found


def made_up(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """:func:`read_package` of a package given as ``{"fastapi_workqueue/core/x.py": source}``."""
    files = {}
    for path, source in sources.items():
        parts = Path(path).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_package else parts)] = (source, is_package)
    return {name: module_imports(name, source, is_package=is_package, modules=files)
            for name, (source, is_package) in files.items()}


def test_the_package_keeps_its_import_rules() -> None:
    imports = read_package()
    assert f"{PACKAGE}.core.kernel" in imports and len(imports) > 100  # (the package itself was read)
    assert problems(imports) == []


def test_only_the_package_root_and_the_cli_app_loading_import_the_queue() -> None:
    importers = {module for module, targets in read_package().items() if QUEUE in targets}
    assert importers == QUEUE_IMPORTERS


def test_a_violation_planted_in_the_package_fails_it() -> None:
    imports = read_package()
    imports[f"{PACKAGE}.core.kernel"].add(f"{PACKAGE}.web.di")  # core reaching up (and web -> core: a cycle)
    imports[f"{PACKAGE}.jobs.layer"].add(QUEUE)
    found = problems(imports)
    assert any("core.kernel imports fastapi_workqueue.web.di" in p for p in found), found
    assert any("jobs.layer imports fastapi_workqueue.queue" in p for p in found), found
    assert any("core <-> " in p and "web" in p for p in found), found


MADE_UP = {
    "fastapi_workqueue/__init__.py": "from .queue import WorkQueue\n",
    "fastapi_workqueue/queue.py": "from .core.kernel import Kernel\nfrom .jobs import layer\n",
    "fastapi_workqueue/core/__init__.py": "",
    "fastapi_workqueue/core/kernel.py": (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ..web.session import RequestSessions\n"
    ),
    "fastapi_workqueue/web/__init__.py": "",
    "fastapi_workqueue/web/session.py": "from .. import __version__\n",
    "fastapi_workqueue/jobs/__init__.py": "",
    "fastapi_workqueue/jobs/layer.py": (
        "def run_now():\n"
        "    from ..testing.memory import MemoryTransport\n"
        "    from fastapi_workqueue.queue import WorkQueue\n"
    ),
    "fastapi_workqueue/testing/__init__.py": "",
    "fastapi_workqueue/testing/memory.py": "import fastapi_workqueue.jobs.layer\n",
}


def test_the_checker_reads_relative_type_checking_and_function_level_imports() -> None:
    imports = made_up(MADE_UP)
    assert imports["fastapi_workqueue.core.kernel"] == {"fastapi_workqueue.web.session"}
    assert imports["fastapi_workqueue.web.session"] == {"fastapi_workqueue"}
    assert imports["fastapi_workqueue.jobs.layer"] == {"fastapi_workqueue.testing.memory", QUEUE}
    assert imports["fastapi_workqueue.queue"] == {"fastapi_workqueue.core.kernel", "fastapi_workqueue.jobs.layer"}
    assert part_graph(imports)["jobs"] == {"testing", "queue"}


def test_the_checker_names_each_kind_of_violation_of_a_made_up_package() -> None:
    found = problems(made_up(MADE_UP))
    assert found == [
        "fastapi_workqueue.core.kernel imports fastapi_workqueue.web.session: core imports nothing of the package "
        "outside core",
        "fastapi_workqueue.jobs.layer imports fastapi_workqueue.queue: a layer receives the kernel (core/kernel.py), "
        "not the WorkQueue",
        "fastapi_workqueue.web.session imports the package root fastapi_workqueue: import from the module that "
        "defines the name",
        "the parts __init__ <-> core <-> jobs <-> queue <-> testing <-> web import each other",
    ]


def test_a_made_up_package_that_keeps_the_rules_passes() -> None:
    kept = dict(MADE_UP)
    kept["fastapi_workqueue/core/kernel.py"] = "from .ports import Ports\n"
    kept["fastapi_workqueue/core/ports.py"] = ""
    kept["fastapi_workqueue/web/session.py"] = "from ..core.kernel import Kernel\n"
    kept["fastapi_workqueue/jobs/layer.py"] = "def run_now():\n    from ..core.memory import MemoryTransport\n"
    kept["fastapi_workqueue/core/memory.py"] = ""
    del kept["fastapi_workqueue/testing/memory.py"]
    assert problems(made_up(kept)) == []
