"""Which process holds what: the identity of this process and the registry of the processes that
run a host.

Every claim records the claiming process (:func:`current_process`), so an operator can tell which
host, pid and process start holds an InFlight delivery. A process that runs a host also keeps a row
in the store's process registry (:class:`ProcessRegistry`): what it serves, how many slots it has
and how many are busy, renewed every beat; a row not renewed within three beats is ``Gone``.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from typing import Literal, Protocol, runtime_checkable

from .wire import WireModel

ProcessState = Literal["Running", "Stopped", "Gone"]


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """This process as the store knows it: a random id, the host name, the pid and its start."""

    id: uuid.UUID
    hostname: str
    pid: int
    started_at: datetime


def _start_time(pid: int) -> datetime:
    """When the process started (Linux: from ``/proc``); elsewhere when the queue first asked."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as system:
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
        return datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"), UTC)
    except (OSError, ValueError, IndexError, StopIteration):
        return datetime.fromtimestamp(time.time(), UTC)


_current: ProcessIdentity | None = None


def current_process() -> ProcessIdentity:
    """The identity of this process (a new one after a fork: it is another process)."""
    global _current
    pid = os.getpid()
    if _current is None or _current.pid != pid:
        _current = ProcessIdentity(uuid.uuid4(), socket.gethostname(), pid, _start_time(pid))
    return _current


@cache
def package_version() -> str:
    """The installed version of fastapi-workqueue ("0" when run from a tree without metadata).

    Read from the ``Version`` header of the package's METADATA: ``importlib.metadata.version``
    parses the whole file, the README included, with the email parser, which left about 0.5 MB in
    every process that registers (bench/README.md, memory)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        text = distribution("fastapi-workqueue").read_text("METADATA") or ""
    except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
        return "0"
    for line in text.partition("\n\n")[0].splitlines():  # the headers end at the first blank line
        name, _, value = line.partition(":")
        if name == "Version":
            return value.strip()
    return "0"  # pragma: no cover - METADATA always names its version


class Holder(WireModel):
    """The process that holds an InFlight delivery (or held its last attempt). ``hostname``,
    ``pid`` and ``started_at`` are None when the process's row is gone from the registry."""

    process_id: uuid.UUID
    hostname: str | None = None
    pid: int | None = None
    started_at: datetime | None = None

    def label(self) -> str:
        """``host pid 123`` (or the process id when the registry no longer knows it)."""
        if self.hostname is None or self.pid is None:
            return f"process {self.process_id}"
        return f"{self.hostname} pid {self.pid}"


class ProcessInfo(WireModel):
    """A process that runs (or ran) a host, as the registry knows it."""

    process_id: uuid.UUID
    hostname: str
    pid: int
    started_at: datetime
    version: str
    subscriptions: list[str]
    slots: int
    busy: int
    last_seen_at: datetime
    stopped_at: datetime | None = None
    state: ProcessState
    in_flight: int
    """Deliveries it holds InFlight now."""


@dataclass(frozen=True, slots=True)
class ProcessBeat:
    """What a process reports of itself at each beat."""

    identity: ProcessIdentity
    subscriptions: tuple[str, ...]
    slots: int
    busy: int
    interval_seconds: float


@runtime_checkable
class ProcessRegistry(Protocol):
    """The store's registry of processes (database transports keep one)."""

    async def process_beat(self, beat: ProcessBeat) -> None:
        """Writes or renews the process's row."""
        ...

    async def process_stop(self, process_id: uuid.UUID) -> None:
        """Marks the process stopped (its row stays: the deliveries it held name it)."""
        ...

    async def list_processes(self) -> list[ProcessInfo]:
        """The known processes, live ones first."""
        ...
