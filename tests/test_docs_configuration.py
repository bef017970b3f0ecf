"""docs/configuration.md lists every setting of WorkQueueSettings: variable, type, default, meaning.

The tables are written by scripts/gen_configuration_docs.py; the page must be what it writes, and,
read back as a table, must hold each field once with its default.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from pydantic import BaseModel, SecretStr
from pydantic_core import to_jsonable_python

from fastapi_workqueue.settings import WorkQueueSettings

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
SCRIPT = ROOT / "scripts" / "gen_configuration_docs.py"
ROW = re.compile(r"^\| `WORKQUEUE_(?P<name>\w+)` \| (?P<type>.+?) \| (?P<default>.+?) \| (?P<meaning>.+) \|$", re.M)


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_configuration_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_default(name: str) -> str:
    value = WorkQueueSettings.model_fields[name].get_default(call_default_factory=True)
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict | BaseModel):
        return json.dumps(to_jsonable_python(value, by_alias=False))
    if isinstance(value, str):
        return value or '""'
    return str(value)


def test_the_page_is_what_the_script_writes() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert generator().render(page) == page, "run: python scripts/gen_configuration_docs.py"


def test_the_script_checks_the_page() -> None:
    checked = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_every_setting_has_one_row_with_its_type_default_and_meaning() -> None:
    rows = {}
    for match in ROW.finditer(PAGE.read_text(encoding="utf-8")):
        name = match["name"].lower()
        assert name not in rows, f"WORKQUEUE_{match['name']} has two rows"
        rows[name] = match
    fields = WorkQueueSettings.model_fields
    assert sorted(set(fields) - set(rows)) == [], "settings missing from docs/configuration.md"
    assert sorted(set(rows) - set(fields)) == [], "rows for variables that are no setting"
    for name, row in rows.items():
        default = row["default"].strip("`")
        wanted = expected_default(name)
        if isinstance(fields[name].default, int | float) and not isinstance(fields[name].default, bool):
            assert float(default) == float(wanted), name
        else:
            assert default == wanted, name
        assert row["type"].strip() and len(row["meaning"]) > 10, name
