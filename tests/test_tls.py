"""A PostgreSQL server that requires TLS: the URL's TLS mode, in libpq's spelling (``sslmode=``) or
SQLAlchemy's (``ssl=``), reaches both the queue's own connections and the request sessions.

The server is a private cluster (``tests/private_cluster.py``) with ``ssl = on``, a self-signed
certificate for 127.0.0.1, and ``hostssl`` as the only way in over TCP.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import text

from fastapi_workqueue import ConfigurationError, PublishRequest, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.database_url import libpq_tls, split_libpq_tls

from .private_cluster import RUN_AS, PrivateCluster, private_cluster, unavailable_reason
from .support import FAST

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_the_tls_mode_is_written_for_each_driver() -> None:
    assert libpq_tls("postgresql://u@h/db?ssl=require") == "postgresql://u@h/db?sslmode=require"
    assert libpq_tls("postgresql://u@h/db?sslmode=verify-full&sslrootcert=/c.pem") == (
        "postgresql://u@h/db?sslmode=verify-full&sslrootcert=/c.pem")
    assert libpq_tls("postgresql://u@h/db?ssl=Require&sslmode=require&application_name=a") == (
        "postgresql://u@h/db?application_name=a&sslmode=require")
    assert split_libpq_tls("postgresql+asyncpg://u:p%40w@h/db?sslmode=require&sslrootcert=/c.pem&x=1") == (
        "postgresql+asyncpg://u:p%40w@h/db?x=1", "postgresql://?sslmode=require&sslrootcert=/c.pem")
    assert split_libpq_tls("postgresql+asyncpg://u@h/db?ssl=prefer") == (
        "postgresql+asyncpg://u@h/db", "postgresql://?sslmode=prefer")
    assert split_libpq_tls("postgresql+asyncpg://u@h/db") == ("postgresql+asyncpg://u@h/db", None)


@pytest.mark.parametrize(("query", "says"), [
    ("sslmode=requir", "sslmode='requir' is not a TLS mode; use one of disable, allow, prefer, require"),
    ("ssl=true", "ssl='true' is not a TLS mode"),
    ("ssl=require&sslmode=disable", "two TLS modes, ssl='require' and sslmode='disable'; keep one"),
])
def test_a_tls_mode_that_cannot_work_is_refused_with_what_to_write(query: str, says: str) -> None:
    url = f"postgresql+asyncpg://app:s3cret@127.0.0.1/db?{query}"
    with pytest.raises(ConfigurationError, match=says) as refused:
        WorkQueue(WorkQueueSettings(database_url=url)).transport  # noqa: B018 (made on first use)
    assert "s3cret" not in str(refused.value)


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[tuple[PrivateCluster, Path]]:
    """A private cluster that takes TCP connections over TLS only; and its certificate."""
    if (reason := unavailable_reason()) is not None or shutil.which("openssl") is None:
        pytest.skip(reason or "no openssl to make a certificate")
    folder = Path(tempfile.mkdtemp(prefix="workqueue-tls-"))
    try:
        cert, key = folder / "server.crt", folder / "server.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                        "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                        "-out", str(cert)], check=True, capture_output=True, timeout=60)
        key.chmod(0o600)
        if os.geteuid() == 0:  # the server runs as RUN_AS and must own its key
            user = pwd.getpwnam(RUN_AS)
            for path in (folder, cert, key):
                os.chown(path, user.pw_uid, user.pw_gid)
        with private_cluster({"ssl": "on", "ssl_cert_file": f"'{cert}'", "ssl_key_file": f"'{key}'"}) as cluster:
            hba = cluster.data / "pg_hba.conf"
            hba.write_text("local all all trust\nhostssl all all 127.0.0.1/32 trust\n")
            cluster.restart()
            yield cluster, cert
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _backends_without_tls(cluster: PrivateCluster, database: str) -> tuple[int, int]:
    """How many connections to ``database`` there are, and how many of them are not TLS (read
    over the cluster's socket, which is not TCP)."""
    admin = await asyncpg.connect(host=str(cluster.root), port=cluster.port, user="postgres", database="postgres")
    try:
        row = await admin.fetchrow(
            "SELECT count(*) AS n, count(*) FILTER (WHERE NOT s.ssl) AS plain FROM pg_stat_activity a "
            "JOIN pg_stat_ssl s USING (pid) WHERE a.datname = $1", database)
        assert row is not None
        return int(row["n"]), int(row["plain"])
    finally:
        await admin.close()


@pytest.mark.parametrize("spelling", ["sslmode=verify-full&sslrootcert={cert}", "ssl=require"])
async def test_the_queue_and_its_sessions_reach_a_server_that_requires_tls(
    tls_cluster: tuple[PrivateCluster, Path], spelling: str,
) -> None:
    cluster, cert = tls_cluster
    database = f"tls_{abs(hash(spelling)) % 10**6}"
    admin = await asyncpg.connect(host=str(cluster.root), port=cluster.port, user="postgres", database="postgres")
    await admin.execute(f"DROP DATABASE IF EXISTS {database}")
    await admin.execute(f"CREATE DATABASE {database}")
    await admin.close()
    plain = WorkQueue(WorkQueueSettings(database_url=f"{cluster.url(database)}?sslmode=disable", auto_migrate=True,
                                        enabled=False, **FAST))
    with pytest.raises(Exception, match=r"no encryption|pg_hba"):
        await plain.open()  # without TLS the server turns the connection away
    await plain.close()

    url = f"{cluster.url(database)}?{spelling.format(cert=cert)}"
    queue = WorkQueue(WorkQueueSettings(database_url=url, auto_migrate=True, enabled=False, **FAST),
                      topics=[Topic(name="tls.t")])
    async with queue.lifespan(None):
        [published] = await queue.publish("tls.t", [PublishRequest(payload={"over": "tls"})])
        assert published.ok
        async with queue.sessionmaker() as session:
            on_tls = await session.scalar(text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"))
        assert on_tls is True
        connections, without_tls = await _backends_without_tls(cluster, database)
    assert connections >= 2 and without_tls == 0
