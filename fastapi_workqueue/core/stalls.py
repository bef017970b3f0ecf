"""Store calls that wait too long: a claim or a settle stuck behind a lock is said, not silent.

A claim waits on the store without a timeout, as it must (a slow store is not a lost one). When
another session holds a lock on the queue's tables (a migration's ``ALTER TABLE``, a ``VACUUM
FULL``, an operator's ``LOCK TABLE``) or the store has stalled, the consumer then waits with
nothing to show for it. A :class:`StallWatch` marks each such call's start and end; the host looks
at its watches every few seconds, logs a call that has waited ``stalled_store_call_ms`` once, at
WARNING, and again when it returns, and health reports the subscriptions it holds up in Error.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .redaction import redacting_logger

log = redacting_logger("fastapi_workqueue.stalls")

STALL_CAUSES = (
    "another session may hold a lock on the queue's tables (a migration, a VACUUM FULL or a LOCK TABLE: "
    "see pg_locks and pg_stat_activity), or the store has stalled"
)
"""What keeps a call of a server database waiting, as the log and health say it."""
SQLITE_STALL_CAUSES = (
    "another process may hold the SQLite file's write lock (a request's session that published and has not "
    "committed, or a stalled process), or the disk has stalled"
)
"""The same for an SQLite file. (A call there waits for another process's write lock at most
``WORKQUEUE_SQLITE_BUSY_TIMEOUT_MS``, 30 s by default, and then fails as busy, which health shows
as the subscription's error.)"""
MSSQL_STALL_CAUSES = (
    "another session may hold a lock on the queue's tables (a migration, an index rebuild: see "
    "sys.dm_tran_locks and sys.dm_exec_requests), or the store has stalled"
)


def stall_causes(transport_name: str) -> str:
    """What may keep a call of the transport named ``transport_name`` waiting."""
    return {"sqlite": SQLITE_STALL_CAUSES, "mssql": MSSQL_STALL_CAUSES}.get(transport_name, STALL_CAUSES)


class StallWatch:
    """The call of one kind under way (one at a time): since when, and whether it was said."""

    __slots__ = ("_clock", "_since", "_warned", "what")

    def __init__(self, what: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        """What waits, for the log: ``"orders: a claim"``."""
        self._clock = clock
        self._since: float | None = None
        self._warned = False

    def begin(self) -> None:
        """A call starts."""
        self._since = self._clock()

    def end(self) -> None:
        """The call returned (or failed); says so when it had been said to stall."""
        if self._warned and self._since is not None:
            log.warning("%s answered after %.0f s of waiting for the store", self.what, self._clock() - self._since)
        self._since = None
        self._warned = False

    def waited(self) -> float | None:
        """Seconds the call under way has waited, or None when none is under way."""
        since = self._since
        return None if since is None else self._clock() - since

    def stalled(self, after: float) -> float | None:
        """Seconds waited when the call under way has waited ``after`` seconds or more, else None."""
        waited = self.waited()
        return waited if after > 0 and waited is not None and waited >= after else None

    def check(self, after: float, causes: str = STALL_CAUSES) -> None:
        """Logs, once per call, a call that has waited ``after`` seconds or more, with what may
        keep it waiting (:func:`stall_causes`)."""
        waited = self.stalled(after)
        if waited is not None and not self._warned:
            self._warned = True
            log.warning("%s has waited %.0f s for the store: %s; nothing is lost, the call goes on waiting",
                        self.what, waited, causes)


def stall_reason(what: str, waited: float, causes: str = STALL_CAUSES) -> str:
    """The health reason of a subscription that a stalled call holds up."""
    return f"{what} has waited {waited:.0f} s for the store: {causes}"
