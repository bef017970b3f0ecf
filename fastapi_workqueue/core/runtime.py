"""The consumer runtime: claims deliveries of one subscription, runs handlers, renews leases, settles.

One :class:`Consumer` per subscription per process. It claims as many deliveries as it has free
slots (``concurrency``), runs each handler in a task of its own with a :class:`WorkContext`,
renews Auto leases in batches every min(lease / 3, 30 s), aborts handlers whose delivery was
cancelled, whose lease was lost or which ran too long, and settles through a shared
:class:`Settler` that batches settles into one round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .context import AbortReason, AbortSignal, Progress, WorkContext
from .errors import TransportError
from .handlers import HandlerSpec, Invoker, PayloadInvalid
from .outcomes import Complete, DeadLetter, FatalWorkError, Retry, TransientWorkError, WorkOutcome
from .topology import SubscriptionState
from .transport import ClaimedDelivery, HeartbeatRequest, Settlement, SettleResult, Transport

log = logging.getLogger("fastapi_workqueue.runtime")

MAX_ERROR_TEXT = 4000


class Settler:
    """Batches settles from every consumer of a process into few round trips.

    A settle waits for its batch to be written; while one batch is in flight the next one
    gathers. Settles are retried while the store is unreachable, up to ``give_up_after`` seconds;
    after that the lease expires and the sweeper takes the delivery back.
    """

    def __init__(self, transport: Transport, *, max_batch: int = 500, give_up_after: float = 60.0) -> None:
        self._transport = transport
        self._max_batch = max_batch
        self._give_up_after = give_up_after
        self._pending: list[tuple[Settlement, asyncio.Future[SettleResult]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="workqueue-settler")

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def settle(self, settlement: Settlement) -> SettleResult:
        if self._task is None or self._task.done():
            results = await self._transport.settle([settlement])
            return results[0]
        future: asyncio.Future[SettleResult] = asyncio.get_running_loop().create_future()
        self._pending.append((settlement, future))
        self._wake.set()
        return await asyncio.shield(future)

    async def _run(self) -> None:
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
            await self._write(batch)

    async def _write(self, batch: list[tuple[Settlement, asyncio.Future[SettleResult]]]) -> None:
        deadline = time.monotonic() + self._give_up_after
        delay = 0.1
        while True:
            try:
                results = await self._transport.settle([s for s, _ in batch])
            except Exception as exc:
                if time.monotonic() > deadline or not (isinstance(exc, TransportError) and exc.retryable):
                    log.error("settle failed for %d deliveries (%s); their leases will expire", len(batch), exc)
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    return
                log.warning("settle failed (%s); retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
            return


@dataclass(slots=True)
class _Running:
    delivery: ClaimedDelivery
    signal: AbortSignal
    started: float
    lease_deadline: float
    task: asyncio.Task[None] | None = None
    handler_task: asyncio.Task[Any] | None = None
    renewed_at: float = 0.0
    progress: Progress | None = None
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    lease_timer: asyncio.TimerHandle | None = None


Resolver = Callable[[str], HandlerSpec | None]


class Consumer:
    """Runs one subscription in this process."""

    def __init__(
        self,
        transport: Transport,
        settler: Settler,
        subscription: SubscriptionState,
        resolve: Resolver,
        invoke: Invoker,
        *,
        concurrency: int = 4,
        idle_poll_min: float = 0.25,
        idle_poll_max: float = 5.0,
        principal: str | None = None,
        max_deliveries: int | None = None,
        stop_when_idle: bool = False,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.transport = transport
        self.settler = settler
        self.subscription = subscription
        self._resolve = resolve
        self._invoke = invoke
        self.concurrency = concurrency
        self.idle_poll_min = idle_poll_min
        self.idle_poll_max = idle_poll_max
        self.principal = principal
        self.max_deliveries = max_deliveries
        self.stop_when_idle = stop_when_idle
        self._on_error = on_error
        self.claimed_total = 0
        self.completed_total = 0
        self._running: dict[str, _Running] = {}
        self._wake = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._stopping = False
        self._loop_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.last_error: str | None = None

    # -- control -----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.subscription.name

    @property
    def active(self) -> int:
        """Deliveries this consumer is running now."""
        return len(self._running)

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._claim_loop(), name=f"workqueue-claim:{self.name}")
        self._heartbeat_task = asyncio.create_task(
            self._heartbeat_loop(), name=f"workqueue-heartbeat:{self.name}"
        )

    def wake(self) -> None:
        """New work may be claimable: look now instead of at the next poll."""
        self._wake.set()

    def update(self, subscription: SubscriptionState, concurrency: int | None = None) -> None:
        """Takes a changed definition (lease, limits) into use without a restart."""
        self.subscription = subscription
        if concurrency is not None and concurrency != self.concurrency:
            self.concurrency = max(1, concurrency)
            self._slot_freed.set()

    async def wait_finished(self) -> None:
        """Waits until the claim loop has ended (budget spent, idle with ``stop_when_idle``, or stop)."""
        if self._loop_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        while self._running:
            self._slot_freed.clear()
            await self._slot_freed.wait()

    async def stop(self, drain_seconds: float) -> None:
        """Stops claiming, drains, aborts the rest with Shutdown, drains again, releases leftovers."""
        self._stopping = True
        self._wake.set()
        self._slot_freed.set()
        if self._loop_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await self._drain(drain_seconds)
        if self._running:
            log.info("%s: aborting %d running handlers (Shutdown)", self.name, len(self._running))
            for running in list(self._running.values()):
                self._abort(running, AbortReason.SHUTDOWN)
            await self._drain(drain_seconds)
        leftovers = list(self._running.values())
        if leftovers:
            log.warning("%s: %d handlers ignored Shutdown; releasing their deliveries", self.name, len(leftovers))
            with contextlib.suppress(Exception):
                await self.transport.settle(
                    [Settlement(r.delivery.delivery_id, r.delivery.lease_token, "Release",
                                reason="released at shutdown") for r in leftovers]
                )
            for running in leftovers:
                if running.task is not None:
                    running.task.cancel()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task

    async def _drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self._running:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), timeout=remaining)

    # -- claiming ----------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        idle = self.idle_poll_min
        failures = 0
        while not self._stopping:
            free = self.concurrency - len(self._running)
            if self.max_deliveries is not None:
                free = min(free, self.max_deliveries - self.claimed_total)
                if free <= 0 and self.claimed_total >= self.max_deliveries:
                    return
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            self._wake.clear()
            try:
                batch = await self.transport.claim(self.name, free)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                self.last_error = str(exc)
                delay = min(self.idle_poll_max, self.idle_poll_min * 2 ** min(failures, 6))
                log.warning("%s: claim failed (%s); retrying in %.2f s", self.name, exc, delay)
                if self._on_error is not None:
                    self._on_error(str(exc))
                await self._sleep(delay)
                continue
            failures = 0
            self.last_error = None
            if batch:
                idle = self.idle_poll_min
                for delivery in batch:
                    self._start(delivery)
                if len(batch) == free:
                    continue
            elif self.stop_when_idle and not self._running:
                return
            await self._sleep(idle)
            if not self._wake.is_set():
                idle = min(idle * 2, self.idle_poll_max)

    async def _sleep(self, seconds: float) -> None:
        """Sleeps until a wake-up, a freed slot (when full), or ``seconds``."""
        if self._wake.is_set() or self._stopping:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds * random.uniform(0.9, 1.1))

    def _start(self, delivery: ClaimedDelivery) -> None:
        now = time.monotonic()
        sub = self.subscription
        running = _Running(
            delivery=delivery,
            signal=AbortSignal(),
            started=now,
            lease_deadline=now + sub.lease_seconds,
            renewed_at=now,
        )
        self.claimed_total += 1
        self._running[delivery.delivery_id] = running
        loop = asyncio.get_running_loop()
        if sub.max_processing_seconds is not None:
            running.timers.append(
                loop.call_later(sub.max_processing_seconds, self._abort, running, AbortReason.MAX_PROCESSING_SECONDS)
            )
        self._arm_lease_timer(running)
        running.task = asyncio.create_task(self._run(running), name=f"workqueue:{self.name}:{delivery.delivery_id}")

    def _arm_lease_timer(self, running: _Running) -> None:
        """Aborts the handler with LeaseLost when its lease runs out without a renewal."""
        if running.lease_timer is not None:
            running.lease_timer.cancel()
        delay = max(0.0, running.lease_deadline - time.monotonic())
        running.lease_timer = asyncio.get_running_loop().call_later(
            delay, self._abort, running, AbortReason.LEASE_LOST
        )

    def _abort(self, running: _Running, reason: AbortReason) -> None:
        if running.signal.abort(reason):
            log.info("%s: delivery %s aborted (%s)", self.name, running.delivery.delivery_id, reason.value)
            if running.handler_task is not None and not running.handler_task.done():
                running.handler_task.cancel()

    # -- running one delivery ----------------------------------------------------------------

    async def _run(self, running: _Running) -> None:
        delivery = running.delivery
        try:
            settlement = await self._execute(running)
            if settlement is not None:
                result = await self.settler.settle(settlement)
                if result == "LeaseLost":
                    log.warning("%s: delivery %s settled after its lease was lost; outcome ignored",
                                self.name, delivery.delivery_id)
                elif result == "Completed":
                    self.completed_total += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("%s: settling delivery %s failed: %s", self.name, delivery.delivery_id, exc)
        finally:
            for timer in running.timers:
                timer.cancel()
            if running.lease_timer is not None:
                running.lease_timer.cancel()
            self._running.pop(delivery.delivery_id, None)
            self._slot_freed.set()

    async def _execute(self, running: _Running) -> Settlement | None:
        delivery = running.delivery
        sub = self.subscription
        spec = self._resolve(sub.handler_key)
        base = (delivery.delivery_id, delivery.lease_token)
        if spec is None:
            # The handler went away (a reconcile raced us): give the delivery back untouched.
            return Settlement(*base, "Release", reason=f"handler {sub.handler_key!r} is not registered here")
        context = WorkContext(
            subscription=sub.name,
            delivery_id=delivery.delivery_id,
            attempt=delivery.attempt,
            max_attempts=delivery.max_attempts,
            signal=running.signal,
            heartbeat=lambda progress: self._manual_heartbeat(running, progress),
            log=logging.LoggerAdapter(
                logging.getLogger(f"fastapi_workqueue.handler.{sub.handler_key}"),
                {"subscription": sub.name, "delivery_id": delivery.delivery_id,
                 "message_id": str(delivery.message_id), "attempt": delivery.attempt},
            ),
            principal=self.principal,
        )
        try:
            message = spec.build_message(delivery, sub.name)
        except PayloadInvalid as exc:
            return Settlement(*base, "DeadLetter", reason=str(exc), error=_error_text(exc))
        async def call_handler() -> WorkOutcome | None:
            return await self._invoke(spec, message, context)

        handler_task = asyncio.create_task(call_handler())
        running.handler_task = handler_task
        try:
            outcome = await asyncio.shield(handler_task)
        except asyncio.CancelledError as exc:
            if not handler_task.done():
                # This task was cancelled from outside (the loop is going away): stop the handler
                # and give the delivery back.
                self._abort(running, AbortReason.SHUTDOWN)
                with contextlib.suppress(BaseException):
                    await handler_task
                return Settlement(*base, "Release", reason="released at shutdown")
            return self._settlement_for_abort(running) or _settlement_for_error(base, exc)
        except Exception as exc:
            return self._settlement_for_abort(running) or _settlement_for_error(base, exc)
        aborted = self._settlement_for_abort(running)
        if aborted is not None or running.signal.reason == AbortReason.LEASE_LOST:
            return aborted
        if outcome is None or isinstance(outcome, Complete):
            return Settlement(*base, "Complete")
        if isinstance(outcome, Retry):
            return Settlement(*base, "Retry", delay_seconds=outcome.delay_seconds, reason=outcome.reason)
        if isinstance(outcome, DeadLetter):
            return Settlement(*base, "DeadLetter", reason=outcome.reason)
        return Settlement(
            *base, "Fail", reason="invalid outcome",
            error=f"the handler returned {outcome!r}; return Outcome.complete(), Outcome.retry(...) "
            "or Outcome.dead_letter(...)",
        )

    def _settlement_for_abort(self, running: _Running) -> Settlement | None:
        reason = running.signal.reason
        base = (running.delivery.delivery_id, running.delivery.lease_token)
        if reason is None:
            return None
        if reason == AbortReason.SHUTDOWN:
            return Settlement(*base, "Release", reason="released at shutdown")
        if reason == AbortReason.CANCELLED:
            # The delivery is flagged: any outcome makes it Discarded.
            return Settlement(*base, "Fail", reason="Cancelled")
        if reason == AbortReason.MAX_PROCESSING_SECONDS:
            return Settlement(
                *base, "Fail", reason="MaxProcessingSeconds",
                error=f"the handler ran longer than max_processing_seconds "
                f"({self.subscription.max_processing_seconds} s) and was aborted",
            )
        # LeaseLost: if the store still holds our token (the lease only ran out locally), the
        # attempt fails like a sweeper expiry would; otherwise the settle answers LeaseLost.
        return Settlement(*base, "Fail", reason="LeaseLost", error="the lease ran out before the handler ended")

    # -- heartbeats --------------------------------------------------------------------------

    async def _manual_heartbeat(self, running: _Running, progress: Progress | None) -> bool:
        delivery = running.delivery
        try:
            [result] = await self.transport.heartbeat(
                [HeartbeatRequest(delivery.delivery_id, delivery.lease_token,
                                  progress.percent if progress else None,
                                  progress.message if progress else None)]
            )
        except Exception as exc:
            log.warning("%s: heartbeat of %s failed (%s)", self.name, delivery.delivery_id, exc)
            return not running.signal.aborted and time.monotonic() < running.lease_deadline
        self._apply_heartbeat(running, result.alive, result.cancel_requested, time.monotonic())
        return result.alive and not running.signal.aborted

    def _apply_heartbeat(self, running: _Running, alive: bool, cancel_requested: bool, sent_at: float) -> None:
        if cancel_requested:
            self._abort(running, AbortReason.CANCELLED)
        elif not alive:
            self._abort(running, AbortReason.LEASE_LOST)
        else:
            running.renewed_at = sent_at
            running.lease_deadline = sent_at + self.subscription.lease_seconds
            if not running.signal.aborted:
                self._arm_lease_timer(running)

    async def _heartbeat_loop(self) -> None:
        """Renews the Auto leases that are due, in one batch per tick."""
        while True:
            interval = self.subscription.heartbeat_interval_seconds
            await asyncio.sleep(min(interval, 1.0) if self._running else min(interval, 5.0))
            if not self._running:
                continue
            now = time.monotonic()
            due = [
                r for r in self._running.values()
                if not r.signal.aborted and now - r.renewed_at >= interval * 0.95
            ]
            if self.subscription.heartbeat_mode == "Manual":
                due = []  # the handler renews its own lease
            if not due:
                continue
            try:
                results = await self.transport.heartbeat(
                    [HeartbeatRequest(r.delivery.delivery_id, r.delivery.lease_token) for r in due]
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("%s: heartbeat of %d deliveries failed (%s)", self.name, len(due), exc)
                continue
            for running, result in zip(due, results, strict=True):
                self._apply_heartbeat(running, result.alive, result.cancel_requested, now)


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_TEXT else text[: MAX_ERROR_TEXT - 3] + "..."


def _settlement_for_error(base: tuple[str, str], exc: BaseException) -> Settlement:
    if isinstance(exc, FatalWorkError):
        return Settlement(*base, "DeadLetter", reason=exc.reason, error=_error_text(exc))
    if isinstance(exc, TransientWorkError):
        return Settlement(*base, "Retry", delay_seconds=exc.delay_seconds, reason=exc.reason,
                          error=_error_text(exc))
    return Settlement(*base, "Fail", reason=f"{type(exc).__name__}", error=_error_text(exc))


SettleCallback = Callable[[Settlement, SettleResult], Awaitable[None]]
