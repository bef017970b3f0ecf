"""A PostgreSQL cluster of a test's own, for chaos tests that restart or stop the server.

A test must never restart the machine's server (127.0.0.1:5432): other work and other test
sessions on it would lose their connections. :func:`private_cluster` creates a new cluster with
``initdb`` in a temp folder, starts it with trust authentication on 127.0.0.1 and a free port
(its socket in the same folder), and at the end stops it and removes the folder, also when the
test fails: ``pg_ctl stop -m fast``, then ``-m immediate``, then SIGKILL of the postmaster.
``initdb`` refuses to run as root: under root the cluster runs as the ``postgres`` OS user
(``runuser -u postgres --``), which owns the folder.

    with private_cluster() as cluster:
        url = cluster.url("workqueue_chaos")     # postgresql+asyncpg://postgres@127.0.0.1:PORT/...
        cluster.restart()                         # or run cluster.restart_command() elsewhere

A process that was only given the data folder restarts that cluster with
:func:`restart_command_for` (``pg_ctl -D DATA restart``, as the folder's owner).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SUPERUSER = "postgres"
"""The cluster's superuser (trust authentication, no password)."""
RUN_AS = "postgres"
"""The OS user a cluster runs as when the current user is root."""
LOG_NAME = "server.log"
"""The server's log, in the data folder."""
START_TIMEOUT = 60


class ClusterError(Exception):
    """A private cluster could not be created, started or stopped; the message says why."""


def find_bindir() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: ``pg_config --bindir``, else the newest
    ``/usr/lib/postgresql/<version>/bin``, else the folder of an ``initdb`` on PATH."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True)
            candidates.append(Path(out.stdout.strip()))

    def version(path: str) -> tuple[int, ...]:
        name = Path(path).parent.name
        return tuple(int(p) for p in name.split(".") if p.isdigit())

    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)]
    initdb = shutil.which("initdb")
    if initdb is not None:
        candidates.append(Path(initdb).parent)
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
            return folder
    return None


def unavailable_reason() -> str | None:
    """Why no private cluster can be made on this machine, or None when one can."""
    if find_bindir() is None:
        return "no PostgreSQL server binaries (initdb, pg_ctl) found with pg_config or in /usr/lib/postgresql/*/bin"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(RUN_AS)
        except KeyError:
            return f"running as root, and there is no {RUN_AS!r} OS user to run the cluster as (initdb refuses root)"
        if shutil.which("runuser") is None:
            return "running as root, and there is no runuser to run the cluster as another user"
    return None


def owner_prefix(path: Path) -> list[str]:
    """How to run a command as the owner of ``path``: nothing when that is us, ``runuser`` under root."""
    uid = path.stat().st_uid
    if uid == os.geteuid():
        return []
    if os.geteuid() != 0:
        raise ClusterError(f"{path} belongs to uid {uid}, not to this user: cannot run its server from here")
    return ["runuser", "-u", pwd.getpwuid(uid).pw_name, "--"]


def pg_ctl_command(data: Path, *args: str, bindir: Path | None = None) -> list[str]:
    """``pg_ctl -D DATA -l DATA/server.log ARGS``, as the data folder's owner."""
    folder = bindir or find_bindir()
    if folder is None:
        raise ClusterError("no pg_ctl found (see find_bindir)")
    return [*owner_prefix(data), str(folder / "pg_ctl"), "-D", str(data), "-l", str(data / LOG_NAME), *args]


def restart_command_for(data: Path) -> list[str]:
    """The command that restarts the cluster of data folder ``data`` (fast shutdown, waits for the start)."""
    if not (data / "PG_VERSION").is_file():
        raise ClusterError(f"{data} is not a PostgreSQL data folder (no PG_VERSION)")
    return pg_ctl_command(data, "-m", "fast", "-w", "-t", str(START_TIMEOUT), "restart")


def running_port(data: Path) -> int | None:
    """The port of the server running on ``data`` (from ``postmaster.pid``), or None."""
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
    except OSError:
        return None
    return int(lines[3]) if len(lines) > 3 and lines[3].strip().isdigit() else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class PrivateCluster:
    """A cluster in a temp folder of its own: ``root`` holds the data folder and the socket."""

    bindir: Path
    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.data / LOG_NAME

    def url(self, database: str = "postgres", driver: str = "postgresql+asyncpg") -> str:
        """A URL for the library (or ``driver="postgresql"`` for asyncpg and psql)."""
        return f"{driver}://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def pg_ctl(self, *args: str) -> list[str]:
        return pg_ctl_command(self.data, *args, bindir=self.bindir)

    def restart_command(self) -> list[str]:
        return restart_command_for(self.data)

    def _run(self, argv: Sequence[str], timeout: float = START_TIMEOUT + 30) -> subprocess.CompletedProcess[str]:
        # Output to a file, not a pipe: a server started by pg_ctl would keep a pipe open.
        with tempfile.TemporaryFile("w+") as out:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, text=True,
                                  cwd=self.root, timeout=timeout, check=False)
            out.seek(0)
            return subprocess.CompletedProcess(done.args, done.returncode, out.read(), "")

    def _fail(self, what: str, done: subprocess.CompletedProcess[str]) -> ClusterError:
        log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        return ClusterError(f"{what} failed (exit {done.returncode}): {done.stdout.strip()}\n{log}")

    def is_running(self) -> bool:
        return self._run(self.pg_ctl("status"), timeout=30).returncode == 0

    def start(self) -> None:
        done = self._run(self.pg_ctl("-w", "-t", str(START_TIMEOUT), "start"))
        if done.returncode != 0:
            raise self._fail(f"starting the private cluster on port {self.port}", done)

    def restart(self) -> None:
        done = self._run(self.restart_command())
        if done.returncode != 0:
            raise self._fail("restarting the private cluster", done)

    def stop(self) -> None:
        """Stops the server: fast, then immediate, then SIGKILL of the postmaster."""
        for mode in ("fast", "immediate"):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._run(self.pg_ctl("-m", mode, "-w", "-t", "30", "stop"), timeout=45)
            if not self.is_running():
                return
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.data / "postmaster.pid").read_text().splitlines()[0])
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.is_running():
                time.sleep(0.1)


def create_cluster(settings: Mapping[str, str] | None = None) -> PrivateCluster:
    """Creates and starts a private cluster (see :func:`private_cluster`); the caller stops and removes it."""
    reason = unavailable_reason()
    if reason is not None:
        raise ClusterError(f"cannot create a private PostgreSQL cluster: {reason}")
    bindir = find_bindir()
    assert bindir is not None
    root = Path(tempfile.mkdtemp(prefix="workqueue-pg-"))
    try:
        if os.geteuid() == 0:
            user = pwd.getpwnam(RUN_AS)
            os.chown(root, user.pw_uid, user.pw_gid)
        cluster = PrivateCluster(bindir, root, free_port())
        done = cluster._run([*owner_prefix(root), str(bindir / "initdb"), "-D", str(cluster.data), "-U", SUPERUSER,
                             "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"])
        if done.returncode != 0:
            raise ClusterError(f"initdb failed (exit {done.returncode}): {done.stdout.strip()[-3000:]}")
        base = {"listen_addresses": "'127.0.0.1'", "unix_socket_directories": f"'{root}'"}
        conf = {**base, **(settings or {})}
        for attempt in range(3):  # the free port may be taken between the probe and the start
            lines = [f"{name} = {value}" for name, value in {**conf, "port": str(cluster.port)}.items()]
            (cluster.data / "postgresql.auto.conf").write_text("\n".join(lines) + "\n")
            try:
                cluster.start()
                return cluster
            except ClusterError:
                if attempt == 2:
                    raise
                cluster.port = free_port()
        raise AssertionError("unreachable")
    except BaseException:
        remove_cluster(root)
        raise


def remove_cluster(root: Path) -> None:
    """Stops the cluster in ``root`` if it runs, and removes the folder."""
    bindir = find_bindir()
    if bindir is not None and (root / "data" / "PG_VERSION").exists():
        PrivateCluster(bindir, root, 0).stop()
    shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def private_cluster(settings: Mapping[str, str] | None = None) -> Iterator[PrivateCluster]:
    """A started private cluster, stopped and removed at the end whatever happens.

    ``settings`` are extra server settings (``{"max_connections": "200"}``; strings as in
    postgresql.conf).
    """
    cluster = create_cluster(settings)
    try:
        yield cluster
    finally:
        remove_cluster(cluster.root)
