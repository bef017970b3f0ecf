"""What a running handler can see and do: its abort signal, heartbeat, attempt and log."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from .lifecycle import is_final_attempt
from .redaction import redacting_logger

MAX_PROGRESS_MESSAGE = 500

log = redacting_logger("fastapi_workqueue.runtime")


async def call_sync_or_async(fn: Callable[[], Any]) -> Any:
    """Calls ``fn`` and awaits what it returns when that is awaitable: ``once`` and ``step`` take
    ``lambda: mailer.send(...)`` whether ``send`` is a coroutine function or a plain one.

    ``fn`` runs on the event loop, as written: a plain function that blocks (a synchronous HTTP
    client) holds the loop, and with it the heartbeats that keep the lease; give it as
    ``lambda: asyncio.to_thread(payments.charge, ...)``, whose coroutine runs it in a thread. (Run
    in a thread of its own by default, a function would run twice where it needs the loop.)"""
    result = fn()
    if inspect.isawaitable(result):
        result = await result
    return result


class AbortReason(StrEnum):
    """Why the runtime aborted a handler."""

    CANCELLED = "Cancelled"
    """An operator discarded the running delivery; it becomes Discarded when the handler returns."""
    LEASE_LOST = "LeaseLost"
    """The lease expired or was taken over; the handler's outcome is ignored."""
    MAX_PROCESSING_SECONDS = "MaxProcessingSeconds"
    """The handler ran past the subscription's cap; a failed attempt."""
    SHUTDOWN = "Shutdown"
    """The host is stopping; the delivery goes back to Pending without consuming the attempt."""


class OnceBusy(Exception):
    """Raised by :meth:`WorkContext.once` while another attempt runs the same key.

    The runtime gives the delivery back for a few seconds without spending an attempt.
    """

    def __init__(self, key: str) -> None:
        super().__init__(f"once key {key!r} is being run by another attempt")
        self.key = key


class GivenBack(Exception):
    """Raised by a handler for a delivery this process does not run (the jobs layer: a job of
    another app's queue). The runtime gives it back after ``delay_seconds`` without spending an
    attempt, as it does for :class:`OnceBusy`."""

    def __init__(self, reason: str, delay_seconds: float = 1.0) -> None:
        super().__init__(reason)
        self.delay_seconds = delay_seconds


class WorkAborted(Exception):
    """Raised by :meth:`AbortSignal.raise_if_aborted` inside an aborted handler."""

    def __init__(self, reason: AbortReason) -> None:
        super().__init__(f"work aborted: {reason.value}")
        self.reason = reason


def _call_listener(listener: Callable[[AbortReason], object], reason: AbortReason) -> None:
    try:
        listener(reason)
    except Exception:
        log.exception(
            "an abort listener (%r) raised; the handler is aborted (%s) all the same", listener, reason.value)


def cancelled_by_the_handler(signal: AbortSignal) -> bool:
    """Whether a ``CancelledError`` that ended a handler is the handler's own (it awaited a task
    somebody else cancelled): the runtime did not abort it, and nobody cancelled the task it runs
    in. Such an attempt failed, as with any other exception."""
    task = asyncio.current_task()
    return signal.reason is None and task is not None and not task.cancelling()


class AbortSignal:
    """Tells a handler that it must stop, and why.

    The runtime also cancels the handler's task when it aborts, so an ``await`` inside the
    handler raises :class:`asyncio.CancelledError`; check :attr:`aborted` in CPU-bound loops.
    """

    __slots__ = ("_event", "_listeners", "_reason")

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._reason: AbortReason | None = None
        self._listeners: list[Callable[[AbortReason], object]] = []

    @property
    def aborted(self) -> bool:
        """True once the runtime has aborted the handler."""
        return self._reason is not None

    @property
    def reason(self) -> AbortReason | None:
        """The reason of the abort, or None while the handler may go on."""
        return self._reason

    def abort(self, reason: AbortReason) -> bool:
        """Aborts with ``reason``; the first reason wins. Returns True when this call aborted."""
        if self._reason is not None:
            return False
        self._reason = reason
        self._event.set()
        for listener in self._listeners:
            _call_listener(listener, reason)
        return True

    def add_listener(self, listener: Callable[[AbortReason], object]) -> None:
        """Calls ``listener(reason)`` when the signal aborts (at once when it has). A listener that
        raises is logged; the abort goes on (the handler's task is cancelled all the same)."""
        if self._reason is not None:
            _call_listener(listener, self._reason)
        else:
            self._listeners.append(listener)

    async def wait(self) -> AbortReason:
        """Waits until the signal aborts and returns the reason."""
        await self._event.wait()
        assert self._reason is not None
        return self._reason

    def raise_if_aborted(self) -> None:
        """Raises :class:`WorkAborted` when the signal has aborted."""
        if self._reason is not None:
            raise WorkAborted(self._reason)


@dataclass(frozen=True, slots=True)
class Progress:
    """A small operator hint: a percentage and a short message (≤ 500 characters)."""

    percent: int | None = None
    message: str | None = None

    def __post_init__(self) -> None:
        if self.percent is not None and not 0 <= self.percent <= 100:
            raise ValueError(f"progress percent must be within 0..100, got {self.percent}")
        if self.message is not None and len(self.message) > MAX_PROGRESS_MESSAGE:
            raise ValueError(
                f"progress message is {len(self.message)} characters; at most {MAX_PROGRESS_MESSAGE} are allowed"
            )


class Heartbeater(Protocol):
    async def __call__(self, progress: Progress | None) -> bool: ...


class OnceStore(Protocol):
    async def __call__(self, key: str, fn: Callable[[], Awaitable[Any]], ttl_seconds: float) -> bool: ...


class WorkContext:
    """Everything a handler may use besides its message.

    ``signal`` aborts with a reason (``Cancelled``, ``LeaseLost``, ``MaxProcessingSeconds``,
    ``Shutdown``); ``heartbeat()`` renews the lease and stores progress; ``attempt`` counts from 1.
    """

    __slots__ = (
        "_heartbeat",
        "_lease_left",
        "_once",
        "after_settle_callbacks",
        "attempt",
        "delivery_id",
        "log",
        "max_attempts",
        "principal",
        "signal",
        "subscription",
        "work_name",
    )

    def __init__(
        self,
        *,
        subscription: str,
        delivery_id: str,
        attempt: int,
        max_attempts: int,
        signal: AbortSignal,
        heartbeat: Heartbeater,
        log: logging.LoggerAdapter[logging.Logger],
        principal: str | None = None,
        once: OnceStore | None = None,
        lease_left: Callable[[], float] | None = None,
    ) -> None:
        self.subscription = subscription
        self.delivery_id = delivery_id
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.signal = signal
        self.log = log
        self.principal = principal
        self._heartbeat = heartbeat
        self._once = once
        self._lease_left = lease_left
        self.after_settle_callbacks: list[Callable[[str | None], object]] = []
        self.work_name: str | None = None
        """What this attempt works on, for the queue's log lines (the jobs layer puts the job's
        name here); None for a plain handler."""

    def after_settle(self, callback: Callable[[str | None], object]) -> None:
        """Calls ``callback(result)`` once this attempt's outcome is written to the store (``result``
        is the settle's answer, e.g. ``"Completed"``, ``"LeaseLost"``; None when it could not be
        written). For what must happen after the store knows, not before."""
        self.after_settle_callbacks.append(callback)

    @property
    def lease_ran_out(self) -> bool:
        """True once this attempt's lease has run out as this process counts it, or the attempt
        was told it lost its lease: what it writes now may no longer be its to write (the store
        may have handed the delivery to another worker). False where no lease is counted here."""
        if self.signal.reason == AbortReason.LEASE_LOST:
            return True
        return self._lease_left is not None and self._lease_left() <= 0

    @property
    def is_final_attempt(self) -> bool:
        """True when a failure of this attempt dead-letters the delivery."""
        return is_final_attempt(self.attempt, self.max_attempts)

    async def heartbeat(self, progress: Progress | dict[str, Any] | None = None) -> bool:
        """Renews the lease now and stores ``progress``.

        Returns False once the lease is lost or an operator cancelled the delivery: stop then.
        ``progress`` may be a :class:`Progress` or ``{"Percent": 40, "Message": "..."}``.
        """
        if isinstance(progress, dict):
            progress = Progress(
                percent=progress.get("Percent", progress.get("percent")),
                message=progress.get("Message", progress.get("message")),
            )
        if self.signal.aborted:
            return False
        return await self._heartbeat(progress)

    async def once(self, key: str, fn: Callable[[], Any], *, ttl_seconds: float = 86400) -> bool:
        """Runs ``fn`` (a plain or a coroutine function) unless it already succeeded for ``key``
        (within ``ttl_seconds``).

        Returns True when ``fn`` ran now, False when it had already run. Repeats become rare,
        not impossible: a worker that dies between ``fn`` and the marker runs it again.
        """
        if self._once is None:
            raise RuntimeError("context.once needs a transport that stores markers")
        return await self._once(key, lambda: call_sync_or_async(fn), ttl_seconds)
