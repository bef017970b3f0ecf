"""What a database's ``schema_migration`` rows say about it, the same for every dialect: which
shipped migrations it lacks, or why this release must not migrate it.

Release 0.1.0 ships one migration per dialect, ``0001_schema``; builds before it carried a chain
of migrations (PostgreSQL 0001-0037, SQL Server 0001-0028, SQLite 0001-0013) that it does not
continue. A database that chain migrated is recognised by its rows (the old ``0001_schema``'s
checksum, or versions this release does not ship beside a ``0001`` it does not recognise) and
refused with one line that says what to do, never migrated into a silent mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..core.errors import ConfigurationError
from .sql_files import MigrationFile, migrations

PRE_RELEASE_FIRST_CHECKSUMS: Mapping[str, str] = {
    "postgresql": "679b3243ba4f853d591944e3311d5744c0bd3a59448ecc9a07a83b4a4cdaee96",
    "sqlite": "810227851bff6eeec605d2acaadad35959a196cb9b2f5c6035c19b777330c1d3",
    "mssql": "ee5fa9833356c629c3b4bf54027f0c45ed9fa2029838ab09f7bc69bce090b8e0",
}
"""The checksum of ``0001_schema.sql`` as the pre-release chain shipped it, per dialect."""

_START_AGAIN: Mapping[str, str] = {
    "postgresql": "drop its schema (DROP SCHEMA workqueue CASCADE) or use a new database",
    "sqlite": "use a new file (or drop the queue's tables from this one)",
    "mssql": "drop the objects of schema workqueue and the schema, or use a new database",
}


def pre_release_chain(dialect: str, recorded: Mapping[int, str]) -> str | None:
    """The one line that says what to do with a database the pre-release chain migrated, or None.

    ``recorded`` maps each version in the database's ``schema_migration`` to its checksum."""
    shipped = {m.version: m.checksum for m in migrations(dialect)}
    first = recorded.get(1)
    if first is None or first == shipped.get(1):
        return None
    unshipped = sorted(v for v in recorded if v not in shipped)
    if first != PRE_RELEASE_FIRST_CHECKSUMS.get(dialect) and not unshipped:
        return None  # an edited 0001, not the old chain: pending() says so
    versions = sorted(recorded)
    return (
        f"this database holds the work queue schema of a build before 0.1.0 (migrations "
        f"{versions[0]:04d}-{versions[-1]:04d} in its schema_migration table), which this release cannot "
        f"upgrade: it ships one migration, 0001_schema; move or finish the work the database holds, "
        f"then {_START_AGAIN.get(dialect, 'start from an empty database')} and run `workqueue migrate`"
    )


def pending(dialect: str, recorded: Mapping[int, str]) -> list[MigrationFile]:
    """The shipped migrations ``recorded`` lacks, in order. Raises :class:`ConfigurationError` for a
    database the pre-release chain migrated, or one where a shipped migration was applied with other
    content than this release ships."""
    if (refusal := pre_release_chain(dialect, recorded)) is not None:
        raise ConfigurationError(refusal)
    missing: list[MigrationFile] = []
    for migration in migrations(dialect):
        checksum = recorded.get(migration.version)
        if checksum is None:
            missing.append(migration)
        elif checksum != migration.checksum:
            raise ConfigurationError(
                f"migration {migration.label} was changed after it was applied to this database: the database "
                f"was made by another build of this release, which this one cannot upgrade; move or finish the "
                f"work it holds, then {_START_AGAIN.get(dialect, 'start from an empty database')} and run "
                "`workqueue migrate` (a change to a shipped schema belongs in a new migration file)"
            )
    return missing
