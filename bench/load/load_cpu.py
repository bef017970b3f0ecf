"""CPU seconds per role (app, workers, PostgreSQL backends, client …), read from /proc.

A thread scans /proc every ``interval`` seconds and keeps, for every process it has seen, the CPU
it has used since it was first seen (since the sampler started, or since the process was born
after that), so a process that exits between two readings keeps what it used until the last
scan. ``mark()`` scans once more and answers the totals per role; the CPU of a window is the
difference of two marks.

Roles: the process trees of the pids given to :meth:`CpuSampler.set_roles` (``app``,
``workers``, ``client``); this process (``bench``); PostgreSQL backends of the benchmark's
database (``pg_backends``, told apart by the database in their process title); the server's
shared processes (``pg_background``: WAL writer, checkpointer, autovacuum …, shared with every
database of the server, told apart from other servers' by the cluster name in the title); and
everything else (``other``: other work on the machine, including other databases' backends), of
which the largest commands are kept too. What the machine was busy with beyond all of these
(processes born and gone between two scans, kernel threads) is ``unseen``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class _Seen:
    base: float
    last: float
    role: str
    command: str


@dataclass
class CpuMark:
    """Cumulative CPU seconds per role since the sampler started, and the machine's own counters."""

    by_role: dict[str, float]
    other_by_command: dict[str, float]
    machine_busy: float
    machine_total: float


def diff(after: CpuMark, before: CpuMark) -> dict[str, object]:
    """The CPU of the window between two marks: seconds per role, the busiest other commands,
    and the machine's busy share (of all its cores)."""
    roles = {k: round(after.by_role.get(k, 0.0) - before.by_role.get(k, 0.0), 2)
             for k in sorted(set(after.by_role) | set(before.by_role))}
    others = {k: after.other_by_command.get(k, 0.0) - before.other_by_command.get(k, 0.0)
              for k in after.other_by_command}
    top = {k: round(v, 2) for k, v in sorted(others.items(), key=lambda kv: -kv[1])[:5] if v >= 0.05}
    total = after.machine_total - before.machine_total
    busy = after.machine_busy - before.machine_busy
    cpus = os.cpu_count() or 1
    # CPU the scans did not see: processes born and gone between two scans, the kernel's own.
    unseen = busy - sum(roles.values())
    return {"seconds": {**roles, "unseen": round(max(0.0, unseen), 2)}, "other_top": top,
            "machine_busy_share": round(busy / total, 3) if total > 0 else None,
            "machine_busy_cores": round(busy / (total / cpus), 3) if total > 0 else None}


def _machine() -> tuple[float, float]:
    with open("/proc/stat") as fh:
        parts = fh.readline().split()[1:]
    values = [int(p) for p in parts]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    return (total - idle) / TICK, total / TICK


def _postgres_role(command: str, database: str, cluster: str) -> str:
    """A PostgreSQL process's role from its title: ``postgres: [cluster: ]user db host(port) state``."""
    if cluster and not command.startswith(f"postgres: {cluster}: "):
        return "other"  # another server on this machine
    parts = command.split()
    for i, part in enumerate(parts):
        if i >= 2 and ("(" in part or part == "[local]"):
            return "pg_backends" if parts[i - 1] == database else "other"
    return "pg_background"


class CpuSampler(threading.Thread):
    """Samples /proc in the background; see the module's docstring."""

    def __init__(self, database: str, cluster: str = "", interval: float = 0.25) -> None:
        super().__init__(daemon=True, name="cpu-sampler")
        self.database = database
        self.cluster = cluster
        self.interval = interval
        self.me = os.getpid()
        self._roots: dict[str, set[int]] = {}
        self._seen: dict[int, _Seen] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._first = True
        self._scan()
        self._first = False

    def set_roles(self, roots: dict[str, set[int]]) -> None:
        """Names the process trees to tell apart: role → root pids (their descendants count too)."""
        with self._lock:
            self._roots = {k: set(v) for k, v in roots.items()}

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(self.interval):
            self._scan()

    def mark(self) -> CpuMark:
        """Scans now and answers the cumulative CPU per role."""
        self._scan()
        busy, total = _machine()
        with self._lock:
            by_role: dict[str, float] = {}
            other: dict[str, float] = {}
            for seen in self._seen.values():
                used = seen.last - seen.base
                by_role[seen.role] = by_role.get(seen.role, 0.0) + used
                if seen.role == "other":
                    other[seen.command] = other.get(seen.command, 0.0) + used
        return CpuMark(by_role=by_role, other_by_command=other, machine_busy=busy, machine_total=total)

    def _scan(self) -> None:
        procs: dict[int, tuple[int, float, str]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    stat = fh.read()
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    command = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if not command:  # a kernel thread
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            procs[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, command)
        with self._lock:
            owner: dict[int, str] = {self.me: "bench"}
            for role, pids in self._roots.items():
                for pid in pids:
                    owner[pid] = role
            changed = True
            while changed:  # descendants take their ancestor's role
                changed = False
                for pid, (ppid, _, _) in procs.items():
                    if pid not in owner and ppid in owner and owner[ppid] != "bench":
                        owner[pid] = owner[ppid]
                        changed = True
            for pid, (_, cpu, command) in procs.items():
                role = owner.get(pid) or (
                    _postgres_role(command, self.database, self.cluster) if command.startswith("postgres: ")
                    else "other")
                seen = self._seen.get(pid)
                if seen is None:
                    # Seen at the first scan: count from now. Seen later: born since the last scan.
                    seen = _Seen(base=cpu if self._first else 0.0, last=cpu, role=role, command=command[:80])
                    self._seen[pid] = seen
                seen.last = max(seen.last, cpu)
                seen.role = role
