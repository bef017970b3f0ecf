"""The settings stand below the layers they configure: ``settings.py`` and every module of the
package it imports, directly or through others, are in ``core`` (read from the source, so lazy and
``TYPE_CHECKING`` imports count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import fastapi_workqueue

PACKAGE = Path(fastapi_workqueue.__file__).parent


def _source(module: str) -> Path | None:
    relative = Path(*module.split(".")[1:])
    for candidate in (PACKAGE / relative / "__init__.py", (PACKAGE / relative).with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its source."""
    path = _source(module)
    assert path is not None, module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            names = [target, *(f"{target}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {name for name in names if name.startswith("fastapi_workqueue") and _source(name) is not None}
    return found


def test_the_settings_import_nothing_of_the_package_above_core() -> None:
    seen: set[str] = set()
    todo = ["fastapi_workqueue.settings"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(_imports(module))
    outside = sorted(m for m in seen - {"fastapi_workqueue.settings"} if not m.startswith("fastapi_workqueue.core."))
    assert outside == [], f"fastapi_workqueue.settings reaches {outside}; settings may use core only"
