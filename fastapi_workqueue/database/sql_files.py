"""Finds the SQL files shipped with the package (or beside it in a source checkout)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

_MIGRATION = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class MigrationFile:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def label(self) -> str:
        """``0001_schema``: the file's name without ``.sql``."""
        return f"{self.version:04d}_{self.name}"


def sql_root() -> Traversable:
    """The folder holding ``<dialect>/`` SQL: inside the wheel, or ``sql/`` of a source checkout."""
    packaged = resources.files("fastapi_workqueue").joinpath("_sql")
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / "sql"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError("the package's SQL files are missing; reinstall fastapi-workqueue")


def dialect_dir(dialect: str) -> Traversable:
    return sql_root().joinpath(dialect)


def migrations(dialect: str) -> list[MigrationFile]:
    """The numbered migration files of a dialect, in order: ``0001_schema.sql`` (the schema of
    release 0.1.0), then one per later release that changed the schema."""
    found: list[MigrationFile] = []
    for entry in dialect_dir(dialect).iterdir():
        match = _MIGRATION.match(entry.name)
        if match and entry.is_file():
            found.append(MigrationFile(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    return found


def read(dialect: str, *parts: str) -> str:
    """Reads one SQL file of a dialect, e.g. ``read("postgresql", "roles", "runtime_role.sql")``."""
    node = dialect_dir(dialect)
    for part in parts:
        node = node.joinpath(part)
    return node.read_text(encoding="utf-8")
