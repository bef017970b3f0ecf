"""Requests first: the consumers of a web process claim less while it serves many requests."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

IN_ATTEMPT: ContextVar[bool] = ContextVar("workqueue_in_attempt", default=False)
"""True while a handler's (or job's) dependencies are solved and it runs: a request session it
takes is not a request of the process, and does not count in :class:`RequestLoad`."""


class RequestLoad:
    """Counts the requests this process serves now; its consumers yield to them.

    While at least ``busy_at`` requests are in flight (0: never), each consumer of the process's
    host claims only up to ``busy_concurrency`` deliveries at once (handlers already running go
    on). When the count falls below ``busy_at`` the consumers are told at once and claim at their
    full concurrency again, so a backlog left by a surge drains at full speed as soon as it ends.
    """

    def __init__(self, busy_at: int = 0, busy_concurrency: int = 1) -> None:
        if busy_at < 0 or busy_concurrency < 1:
            raise ValueError(f"busy_at must be >= 0 and busy_concurrency >= 1, got {busy_at}, {busy_concurrency}")
        self.busy_at = busy_at
        self.busy_concurrency = busy_concurrency
        self.in_flight = 0
        self.busy_claims = 0
        """Claims made while busy, at the reduced limit (for tests and benchmarks)."""
        self._on_idle: list[Callable[[], None]] = []

    @property
    def busy(self) -> bool:
        """True while enough requests are in flight that consumers claim at the reduced limit."""
        return 0 < self.busy_at <= self.in_flight

    def limit(self, concurrency: int) -> int:
        """How many deliveries a consumer of ``concurrency`` may hold now."""
        return min(concurrency, self.busy_concurrency) if self.busy else concurrency

    def enter(self) -> None:
        """A request started."""
        self.in_flight += 1

    def leave(self) -> None:
        """A request ended; consumers hear of it when that ends the busy spell."""
        was_busy = self.busy
        self.in_flight -= 1
        if was_busy and not self.busy:
            for callback in list(self._on_idle):
                callback()

    def subscribe(self, on_idle: Callable[[], None]) -> None:
        """Calls ``on_idle()`` whenever a busy spell ends."""
        self._on_idle.append(on_idle)

    def unsubscribe(self, on_idle: Callable[[], None]) -> None:
        if on_idle in self._on_idle:
            self._on_idle.remove(on_idle)
