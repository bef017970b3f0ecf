"""tests/private_cluster.py: a cluster of a test's own, restarted and removed without touching
the machine's server."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import asyncpg
import pytest

from fastapi_workqueue.database.postgres import to_asyncpg_dsn
from tests.conftest import PG_URL
from tests.private_cluster import (
    ClusterError,
    private_cluster,
    restart_command_for,
    running_port,
    unavailable_reason,
)

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"no private cluster here: {unavailable_reason()}"),
]

SHARED = to_asyncpg_dsn(PG_URL).rpartition("/")[0] + "/postgres"


async def started_at(dsn: str) -> datetime:
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        value: datetime = await conn.fetchval("SELECT pg_postmaster_start_time()")
        return value
    finally:
        await conn.close()


async def refuses(dsn: str) -> bool:
    try:
        conn = await asyncpg.connect(dsn, timeout=5)
    except OSError:
        return True
    await conn.close()
    return False


async def test_a_private_cluster_restarts_keeps_its_data_and_is_removed() -> None:
    shared_before = await started_at(SHARED)
    with private_cluster() as cluster:
        dsn = cluster.url(driver="postgresql")
        assert cluster.port != 5432 and running_port(cluster.data) == cluster.port
        conn = await asyncpg.connect(dsn)
        try:
            assert await conn.fetchval("SHOW data_directory") == str(cluster.data)
            await conn.execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (7)")
        finally:
            await conn.close()
        before = await started_at(dsn)

        cluster.restart()

        assert await started_at(dsn) > before
        conn = await asyncpg.connect(dsn)
        try:
            assert await conn.fetchval("SELECT n FROM kept") == 7
        finally:
            await conn.close()
        root = cluster.root
    assert not root.exists()
    assert await refuses(dsn)
    assert await started_at(SHARED) == shared_before


async def test_a_private_cluster_is_stopped_and_removed_when_the_test_fails() -> None:
    with pytest.raises(RuntimeError, match="the test failed"), private_cluster() as cluster:
        root, dsn = cluster.root, cluster.url(driver="postgresql")
        assert not await refuses(dsn)
        raise RuntimeError("the test failed")
    assert not root.exists()
    assert await refuses(dsn)


def test_only_a_data_folder_has_a_restart_command(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="not a PostgreSQL data folder"):
        restart_command_for(tmp_path)
    assert running_port(tmp_path) is None
