"""The consumer runtime: claims deliveries, runs handlers, renews leases, settles.

One :class:`Consumer` per subscription per process, or one for several subscriptions that share its
slots: in strict order between groups, the oldest due delivery first within a group (how a job
worker takes its queues). It keeps up to ``concurrency`` handlers
running, claiming as many deliveries as it has free slots. Each handler runs in a task of its
own with a :class:`WorkContext`. Auto leases are renewed in batches every min(lease / 3, 30 s);
a handler whose delivery was cancelled, whose lease was lost or which ran too long is aborted:
its signal says why and its task is cancelled. Outcomes go to the shared :class:`Settler`, which
writes them in batches; a slot is free again as soon as its handler returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import math
import random
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from .budget import DeliveryBudget
from .context import (
    AbortReason,
    AbortSignal,
    GivenBack,
    OnceBusy,
    Progress,
    WorkContext,
    cancelled_by_the_handler,
)
from .errors import SessionPoolExhausted, TransportNotReady
from .failures import error_text, handler_traceback, storable, summary
from .handlers import HandlerSpec, Invoker, PayloadInvalid
from .leases import LocalLease, counting, start_margin
from .lifecycle import INVALID_OUTCOME_REASON, dead_letters, settlement_for
from .observe import NO_OBSERVER, Observer
from .outcomes import Complete, FatalWorkError, TransientWorkError
from .ports import interrupter_of
from .redaction import TRACEBACK_TEXT, redact, redacting_logger
from .request_load import RequestLoad
from .settler import Settler
from .stalls import StallWatch
from .tasks import TaskScope, cancel_and_wait
from .topology import SubscriptionState
from .transport import (
    CLAIM_MANY_REFUSAL,
    Claimed,
    ClaimedDelivery,
    HeartbeatRequest,
    HeldBack,
    Settlement,
    SettleResult,
    Transport,
)
from .words import count

log = redacting_logger("fastapi_workqueue.runtime")

ONCE_BUSY_RETRY_SECONDS = 5.0
POOL_BUSY_RETRY_SECONDS = 1.0
"""When a delivery whose attempt found no free database connection comes back."""
POOL_WARN_SECONDS = 30.0
POOL_FREE_GIVE_BACKS = 10
"""How often one delivery goes back without spending a try for want of a database connection."""

SETTLE_BACKLOG_LIMIT = 1000
"""A consumer claims no more while this many of the process's outcomes wait to be written."""
PREFETCH_BELOW_SECONDS = 0.05
"""Handlers that take less than this on average get a second set of deliveries claimed ahead."""
SHUTDOWN_RELEASE_REASON = "released at shutdown"
"""The reason of the Release a stopping host gives back what it holds with."""
HANDLER_TASK_PREFIX = "workqueue-handler:"
"""The name of a handler's task begins so (its delivery id follows)."""
MAX_PREFETCH = 200
"""The most deliveries claimed ahead of free slots. Claims of no-op handlers take 4-6 ms on a busy
2-core machine, in which the worker runs about 50 deliveries: with 100 ahead (claiming again at
half) it waited for every claim, with 200 it drains 5-15 % faster (bench/README.md)."""
LEFTOVER_GRACE_SECONDS = 0.5
"""How long a stopping consumer waits, after releasing them, for handlers that ignored Shutdown."""
WAKE_BACKOFF_MIN = 0.01
"""The first pause after a wake-up claim that found nothing; it doubles up to ``wake_backoff``."""
GIVES_BACK: frozenset[str] = frozenset({"Retry", "Fail", "Release"})
"""The settlements that may leave a delivery Pending, due again later."""
GIVEN_BACK_TRACKED = 32
"""The most deliveries given back that a consumer looks up the due time of before it sleeps."""
GIVEN_BACK_MARGIN_SECONDS = 0.005
"""How long after a given-back delivery's due time the idle claim loop looks for it."""
SLOT_POLL_SECONDS = 0.1
"""How long a consumer whose work a ``max_in_flight`` or ``key_concurrency`` limit holds back waits
before it looks again (at once when one of its own deliveries of the subscription settles)."""

Resolver = Callable[[str], HandlerSpec | None]

ClaimLoopState = Literal["stopped", "claiming", "waiting_for_slot", "waiting_for_work", "waiting_for_limit"]
"""What a consumer's claim loop does now (:attr:`Consumer.claim_loop`)."""

__all__ = ["ClaimLoopState", "Consumer", "Resolver", "Settler"]


@dataclass(slots=True, eq=False)
class _Running:
    """A delivery this consumer holds under lease: claimed ahead, or running. Keyed by its lease
    token: a delivery claimed again after its lease ran out is another entry."""

    delivery: ClaimedDelivery
    signal: AbortSignal
    lease: LocalLease
    sub: SubscriptionState
    task: asyncio.Task[None] | None = None
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    lease_timer: asyncio.TimerHandle | None = None
    started_at: float = 0.0
    entered: bool = False
    released: bool = False
    context: WorkContext | None = None
    error: BaseException | None = None
    cancel_told: bool = False
    """The log has said that this cancelled handler has not returned (once)."""


Groups = Sequence[Sequence[SubscriptionState]]
"""Subscriptions one consumer serves: groups in strict order, the subscriptions of a group fairly."""


def _pool_exhausted(exc: BaseException) -> bool:
    """Whether the attempt failed for want of a database connection of a pool of this process (the
    session pool, or an engine of the app's own): SessionPoolExhausted, or SQLAlchemy's pool
    TimeoutError, raised or behind what was raised."""
    errors = sys.modules.get("sqlalchemy.exc")
    cause: BaseException | None = exc
    for _ in range(4):
        if cause is None:
            return False
        if isinstance(cause, SessionPoolExhausted) or (errors is not None and isinstance(cause, errors.TimeoutError)):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class Consumer:
    """Runs one subscription, or several sharing one concurrency, in this process."""

    def __init__(
        self,
        transport: Transport,
        settler: Settler,
        subscription: SubscriptionState | Groups,
        resolve: Resolver,
        invoke: Invoker,
        *,
        concurrency: int = 4,
        idle_poll_min: float = 0.25,
        idle_poll_max: float = 5.0,
        wake_backoff: float = 0.1,
        principal: str | None = None,
        max_deliveries: int | None = None,
        stop_when_idle: bool = False,
        budget: DeliveryBudget | None = None,
        prefetch: int | None = None,
        on_error: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str | None = None,
        observer: Observer = NO_OBSERVER,
        request_load: RequestLoad | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.transport = transport
        self.settler = settler
        self._groups: list[list[SubscriptionState]] = []
        self._claim_each = False
        self._pool_backs: dict[str, int] = {}  # (delivery id: times given back for want of a connection)
        self._pool_warned_at = -math.inf
        self.subscription: SubscriptionState
        self._set_groups([[subscription]] if isinstance(subscription, SubscriptionState) else subscription)
        self._name = name or self.subscription.name
        self._resolve = resolve
        self._invoke = invoke
        self.concurrency = concurrency
        self.idle_poll_min = idle_poll_min
        self.idle_poll_max = idle_poll_max
        self.wake_backoff = wake_backoff
        self._empty_wakes = 0
        self._empty_wake_at = 0.0
        self.empty_wake_claims = 0
        self.principal = principal
        self.stop_when_idle = stop_when_idle
        self.prefetch = prefetch
        self._on_error = on_error
        self._clock = clock
        self._observer = observer
        self._request_load = request_load
        self._held: dict[str, _Running] = {}
        self._buffer: deque[_Running] = deque()
        self._handler_seconds: float | None = None
        self._claim_seconds: float | None = None
        self.claimed_total = 0
        self.completed_total = 0
        self.settled_total = 0
        self.lost_total = 0
        """Settlements the store answered LeaseLost (the lease ran out first): they changed nothing."""
        self._running: dict[str, _Running] = {}
        self._held_back: HeldBack | None = None
        """What the last claim said a flow limit kept back (None: nothing)."""
        self._slot_settled = False
        self._wake = asyncio.Event()
        self._woken_unlimited = False
        """A wake-up since the last claim named work of a subscription without a flow limit (or
        named none): a wait for a flow limit of another one of the group then ends."""
        self.budget = budget if budget is not None else (
            DeliveryBudget(max_deliveries) if max_deliveries is not None else None)
        """How many deliveries may still be claimed: this consumer's ``max_deliveries``, or the one
        budget a host shares among its consumers (``workqueue work --once`` and ``--max``)."""
        if self.budget is not None:
            self.budget.watch(self._wake)
        self._slot_freed = asyncio.Event()
        self._stopping = False
        self._paused = False
        self._tasks = TaskScope(f"workqueue-consumer:{self._name}")
        self._interrupter = interrupter_of(transport)
        self._given_back: list[str] = []
        """Deliveries this consumer settled back to Pending (a retry, a failed attempt with tries
        left, a release) whose due time it has not looked up yet."""
        self._due_back: list[float] = []
        """When those deliveries come due (a heap of ``clock()`` times)."""
        self._claim_sent_at = 0.0
        self._recheck = False
        self._loop_task: asyncio.Task[None] | None = None
        self._loop_state: ClaimLoopState = "claiming"
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.last_error: str | None = None
        self.last_error_public = False
        """Whether :attr:`last_error` may be shown to anyone (a :class:`TransportNotReady`'s text)."""
        self.claim_watch = StallWatch(f"{self._name}: a claim", clock)
        """The claim under way, for the host's look at calls that wait too long (:mod:`.stalls`)."""

    # -- control -----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def groups(self) -> list[list[SubscriptionState]]:
        """The subscriptions it claims from: groups in strict order."""
        return self._groups

    def _set_groups(self, groups: Groups) -> None:
        self._groups = [list(group) for group in groups if group]
        self._claim_each = False  # (the subscriptions as read now: claim_many takes the unlimited ones)
        # The subscriptions without a flow limit: a wake-up of one ends a wait for another's limit.
        self._unlimited = frozenset(s.name for group in self._groups for s in group if not s.flow_limited)
        if self._groups:
            self.subscription = self._groups[0][0]

    @property
    def active(self) -> int:
        """Handlers this consumer is running now."""
        return len(self._running)

    def active_for(self, subscription: str) -> int:
        """Handlers of ``subscription`` this consumer is running now."""
        return sum(1 for r in self._running.values() if r.sub.name == subscription)

    @property
    def held(self) -> int:
        """Deliveries this consumer holds under lease: running, or claimed ahead and waiting for a slot."""
        return len(self._held)

    @property
    def claim_loop(self) -> ClaimLoopState:
        """What the claim loop does now: ``stopped`` (not started, or ended by a pause, a stop, a
        spent budget or an idle one-shot run: it claims nothing until resumed), ``waiting_for_slot``
        (every slot is held: it claims again once one frees), ``waiting_for_work`` (its last claim
        found nothing or failed: it waits for a wake-up or its next poll), ``waiting_for_limit`` (a
        flow limit kept claimable work back: it waits for the limit's next token or slot) or
        ``claiming``.

        A test that must show nothing more is claimed waits for ``stopped`` or ``waiting_for_slot``
        instead of sleeping: the state is reached only when the consumer decided not to claim."""
        if self._loop_task is None or self._loop_task.done():
            return "stopped"
        return self._loop_state

    @property
    def paused(self) -> bool:
        """True while claiming is paused (running handlers go on and settle)."""
        return self._paused

    def start(self) -> None:
        self.settler.start()
        if self._request_load is not None:
            self._request_load.subscribe(self._slot_freed.set)
        self._start_claiming()
        self._heartbeat_task = self._tasks.spawn(self._heartbeat_loop(), name=f"workqueue-heartbeat:{self.name}")

    def _start_claiming(self) -> None:
        self._loop_state = "claiming"
        self._loop_task = self._tasks.spawn(self._claim_loop(), name=f"workqueue-claim:{self.name}")

    def pause(self) -> None:
        """Stops claiming. Handlers that run go on, renew their leases and settle as usual;
        deliveries claimed ahead and not started go back to Pending without spending an attempt."""
        if self._paused or self._stopping:
            return
        self._paused = True
        self._wake.set()
        self._slot_freed.set()
        self._interrupt_claims()
        self._release_buffer("released: the subscription was paused")
        if self._running:
            log.info("%s: paused; %d running handlers finish and settle", self.name, len(self._running))

    def resume(self) -> None:
        """Claims again after :meth:`pause`."""
        if not self._paused or self._stopping:
            return
        self._paused = False
        if self._loop_task is None or self._loop_task.done():
            self._start_claiming()

    def wake(self, subscription: str | None = None) -> None:
        """New work may be claimable (of ``subscription``, or of any of this consumer's): look now
        instead of at the next poll."""
        if subscription is None or subscription in self._unlimited:
            self._woken_unlimited = True
        self._wake.set()

    def update(self, subscription: SubscriptionState | Groups, concurrency: int | None = None) -> None:
        """Takes changed definitions (lease, limits, the subscriptions of a group) into use without a
        restart. Deliveries already held keep the definition they were claimed under."""
        self._set_groups([[subscription]] if isinstance(subscription, SubscriptionState) else subscription)
        if concurrency is not None and concurrency != self.concurrency:
            self.concurrency = max(1, concurrency)
            self._slot_freed.set()

    async def wait_finished(self) -> None:
        """Waits until the claim loop ended (budget spent, idle in one-shot mode, or stop),
        every handler returned and every settle is written.

        Cancelling the caller cancels only this wait: the claim loop and the handlers go on until
        :meth:`stop` (a signal during a long handler must reach the drain, not wait for it).
        """
        if self._loop_task is not None:
            await asyncio.wait([self._loop_task])
        while self._held:
            self._slot_freed.clear()
            await self._slot_freed.wait()
        await self.settler.flush()

    async def stop(self, drain_seconds: float) -> None:
        """Stops claiming, drains, aborts the rest with Shutdown, drains again, releases leftovers."""
        self._stopping = True
        self._wake.set()
        self._slot_freed.set()
        self._interrupt_claims()
        if self._request_load is not None:
            self._request_load.unsubscribe(self._slot_freed.set)
        if self._loop_task is not None:
            # A claim under way ends at once; one the store does not answer within 1.5 s (out of
            # reach) is cancelled: what it may have claimed comes back when its lease runs out. So a
            # stop keeps to 2 x the drain and 5 s, the store away or not (docs/production.md).
            done, _ = await asyncio.wait([self._loop_task], timeout=min(max(drain_seconds, 0.5), 1.5))
            if not done:
                await cancel_and_wait([self._loop_task], owner=self.name)
            else:
                with contextlib.suppress(asyncio.CancelledError):
                    await self._loop_task
        if self._buffer:
            log.info("%s: stopping; %s claimed ahead go back to Pending: %s",
                     self.name, count(len(self._buffer), "delivery"), _ids(self._buffer))
        self._release_buffer(SHUTDOWN_RELEASE_REASON)
        if self._running:
            log.info("%s: stopping; %d running handlers get %.1f s to finish: %s",
                     self.name, len(self._running), drain_seconds, _ids(self._running.values()))
        await self._drain(drain_seconds)
        if self._running:
            log.info("%s: aborting %s (Shutdown); their deliveries go back to Pending without spending the "
                     "attempt: %s", self.name, count(len(self._running), "running handler"),
                     _ids(self._running.values()))
            for running in list(self._running.values()):
                self._abort(running, AbortReason.SHUTDOWN)
            await self._drain(drain_seconds)
        leftovers = list(self._running.values())
        if leftovers:
            log.warning("%s: %s ignored Shutdown; releasing their deliveries: %s",
                        self.name, count(len(leftovers), "handler"), _ids(leftovers))
            for running in leftovers:
                running.released = True
            with contextlib.suppress(Exception):  # (the store out of reach: their leases bring them back)
                await asyncio.wait_for(self.transport.settle(
                    [Settlement(r.delivery.delivery_id, r.delivery.lease_token, "Release",
                                reason=SHUTDOWN_RELEASE_REASON) for r in leftovers]
                ), 1.0)  # (within the stop's bound: 2 x the drain and 2 s, the settler's deadline)
        if self._heartbeat_task is not None:
            await cancel_and_wait([self._heartbeat_task], owner=self.name)
        # What is left are handlers that ignored Shutdown (their deliveries were released above):
        # the scope cancels them once more and leaves them behind after a moment.
        await self._tasks.close(grace=LEFTOVER_GRACE_SECONDS)
        await self.settler.flush()

    def _interrupt_claims(self) -> None:
        """Ends a claim that waits for work (an SQS long poll) instead of waiting it out."""
        if self._interrupter is not None:
            self._interrupter.interrupt_claims([s.name for group in self._groups for s in group])

    def _release_buffer(self, reason: str) -> None:
        """Gives back deliveries claimed ahead and not started, without spending their attempt."""
        while self._buffer:
            running = self._buffer.popleft()
            self._drop(running)
            delivery = running.delivery
            self.settler.submit(
                Settlement(delivery.delivery_id, delivery.lease_token, "Release", reason=reason), self._settled
            )

    def _drop(self, running: _Running) -> None:
        for timer in running.timers:
            timer.cancel()
        if running.lease_timer is not None:
            running.lease_timer.cancel()
        self._held.pop(running.delivery.lease_token, None)
        self._running.pop(running.delivery.lease_token, None)

    async def _drain(self, seconds: float) -> None:
        deadline = self._clock() + seconds
        while self._running:
            remaining = deadline - self._clock()
            if remaining <= 0:
                return
            self._slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), timeout=remaining)

    # -- claiming ----------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        idle = self.idle_poll_min
        failures = 0
        woken = False
        while not self._stopping and not self._paused:
            concurrency = self.concurrency
            load = self._request_load
            if load is not None and load.busy:
                concurrency = load.limit(concurrency)  # requests first: no claiming ahead either
                prefetch = 0
            else:
                prefetch = self._prefetch_target()
            free = concurrency + prefetch - len(self._held)
            if prefetch and len(self._held) > concurrency + prefetch // 2:
                # Claim ahead again once half of what was claimed ahead has started: the claim's
                # round trip overlaps the other half, so fast handlers never wait for the store
                # (the next claim tops the consumer up to concurrency + prefetch, never more).
                free = 0
            if self.budget is not None:
                if self.budget.remaining <= 0:
                    return
                if self.budget.available <= 0:  # (claims of other consumers under way hold the rest)
                    self._wake.clear()
                    self.budget.wake_when_settled(self._wake)
                    await self._wake.wait()  # (a stop wakes it too)
                    continue
                free = min(free, self.budget.available)
            if free <= 0:
                self._slot_freed.clear()
                self._loop_state = "waiting_for_slot"
                await self._slot_freed.wait()
                self._loop_state = "claiming"
                continue
            if self.settler.backlog >= SETTLE_BACKLOG_LIMIT:
                await self.settler.wait_below(SETTLE_BACKLOG_LIMIT)
                continue
            if woken and await self._back_off_after_empty_wakes():
                continue
            self._wake.clear()
            self._woken_unlimited = False  # what the claim below looks for
            settled_before = self.settled_total
            if load is not None and load.busy:
                load.busy_claims += 1
            try:
                sent_at = self._claim_sent_at = self._clock()
                self.claim_watch.begin()
                try:
                    batch = await self._claim_within_budget(free) if self._groups else []
                finally:
                    self.claim_watch.end()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                self.last_error = str(exc)
                self.last_error_public = isinstance(exc, TransportNotReady)
                delay = min(self.idle_poll_max, self.idle_poll_min * 2 ** min(failures, 6))
                log.warning("%s: claim failed (%s); retrying in %.2f s", self.name, exc, delay)
                if self._on_error is not None:
                    self._on_error(str(exc))
                self._loop_state = "waiting_for_work"
                await self._sleep(delay)
                self._loop_state = "claiming"
                continue
            failures = 0
            self.last_error = None
            self._count_wake_claim(woken, bool(batch))
            woken = False
            if batch:
                idle = self.idle_poll_min
                for sub, delivery in batch:
                    self._hold(sub, delivery, sent_at)
                if self._paused:  # paused while this claim was on its way: give the batch back
                    self._release_buffer("released: the subscription was paused")
                    return
                self._fill()
                if len(batch) == free:
                    continue
            if self._held_back is not None:
                # A flow limit keeps claimable work back: wait for it, not for new work.
                idle = self.idle_poll_min
                self._loop_state = "waiting_for_limit"
                # A wake-up that ended the wait makes the next claim a wake-up claim (its pause applies).
                woken = await self._wait_for_limit(self._held_back)
                self._loop_state = "claiming"
                continue
            if not batch and self.stop_when_idle and not self._held:
                # One-shot: idle only when a claim made after this consumer's own settles were
                # written finds nothing (settling a keyed delivery is what frees its key's next one).
                if self.settler.backlog or self.settled_total != settled_before:
                    await self.settler.flush()
                    continue
                return
            self._loop_state = "waiting_for_work"
            due_in = await self._until_given_back_due(idle)
            await self._sleep(due_in, jitter=due_in >= idle)
            self._loop_state = "claiming"
            woken = self._wake.is_set() and not self._recheck
            self._recheck = False
            if not woken:
                idle = min(idle * 2, self.idle_poll_max)

    async def _until_given_back_due(self, idle: float) -> float:
        """``idle``, or less when a delivery this consumer gave back comes due sooner: the store
        draws a retry's delay (with jitter) and nothing wakes a consumer when it comes due, while
        the idle poll may have grown to seconds. Looked up once per delivery, only when idle."""
        if self._given_back:
            given, self._given_back = self._given_back, []
            for delivery_id in given:
                try:
                    info = await self.transport.get_delivery(delivery_id)
                except Exception:  # (a hint only: the idle poll still finds it)
                    continue
                if info is not None and info.status == "Pending" and info.visible_at is not None:
                    wait = (info.visible_at - datetime.now(UTC)).total_seconds()
                    heapq.heappush(self._due_back, self._clock() + max(wait, 0.0))
        due = self._due_back
        while due and due[0] <= self._claim_sent_at:  # (the last claim looked after it came due)
            heapq.heappop(due)
        if not due:
            return idle
        return min(idle, max(due[0] - self._clock(), 0.0) + GIVEN_BACK_MARGIN_SECONDS)

    def _given_back_when_pending(
        self, settled: Callable[[Settlement, SettleResult | None], None]
    ) -> Callable[[Settlement, SettleResult | None], None]:
        """``settled``, and a note of the delivery when the store left it Pending (and a wake-up of
        an idle claim loop, so that its sleep is cut to when the delivery comes due)."""

        def done(settlement: Settlement, result: SettleResult | None) -> None:
            settled(settlement, result)
            if result == "Pending" and not self._stopping and len(self._given_back) < GIVEN_BACK_TRACKED:
                self._given_back.append(settlement.delivery_id)
                if self._loop_state == "waiting_for_work":
                    self._recheck = True
                    self._wake.set()

        return done

    async def _wait_for_limit(self, held: HeldBack) -> bool:
        """Waits while a flow limit of the subscription holds its work back: until the next token
        is due (``retry_after``; a wake-up brings no token, so it does not end the wait), or, for
        a slot (``max_in_flight``, ``key_concurrency``), until one of this consumer's deliveries
        settles or :data:`SLOT_POLL_SECONDS` pass. Stop and pause end it at once, and so does a
        wake-up for a subscription of the group that has no flow limit: its work waits for no token
        (True then)."""
        if held.retry_after is None:
            seconds = SLOT_POLL_SECONDS * random.uniform(0.9, 1.1)
        else:
            seconds = min(max(held.retry_after, 0.001), self.idle_poll_max)
        deadline = self._clock() + seconds
        self._slot_settled = False
        while not self._stopping and not self._paused:
            if self._unlimited and self._woken_unlimited:
                return True
            if held.retry_after is None and self._slot_settled:
                return False
            remaining = deadline - self._clock()
            if remaining <= 0:
                return False
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=remaining)
        return False

    async def _back_off_after_empty_wakes(self) -> bool:
        """Before a claim a wake-up asked for: waits out the pause that follows wake-up claims
        which found nothing, so the wake-ups that arrive meanwhile make one claim. True when the
        consumer was stopped or paused meanwhile.

        Every process that runs a subscription hears each NOTIFY of it, and all but one find the
        delivery taken; without the pause each publish costs one claim per listening consumer.
        The pause is short (``WAKE_BACKOFF_MIN`` doubling to ``wake_backoff`` with each such claim;
        a claim that finds work halves the count, so the process that mostly loses the race stays
        out of it and the one that wins claims at once); after a quiet spell a wake-up claims at once.
        """
        if not self._empty_wakes or self.wake_backoff <= 0:
            return False
        pause = min(self.wake_backoff, WAKE_BACKOFF_MIN * 2 ** (self._empty_wakes - 1))
        remaining = self._empty_wake_at + pause - self._clock()
        if remaining > 0:
            await asyncio.sleep(remaining)
        return self._stopping or self._paused

    def _count_wake_claim(self, woken: bool, found: bool) -> None:
        """Counts wake-up claims that found nothing (a claim that finds work halves the count)."""
        if found:
            self._empty_wakes //= 2  # a process that mostly loses the race keeps most of its pause
        elif woken:
            self._empty_wakes = min(self._empty_wakes + 1, 16)
            self._empty_wake_at = self._clock()
            self.empty_wake_claims += 1

    def _prefetch_target(self) -> int:
        """How many deliveries to claim ahead of free slots.

        While handlers are short (under ``PREFETCH_BELOW_SECONDS`` on average), the runtime claims
        ahead what the running handlers will finish within one claim round trip, and claims again
        once half of it has started, so a fast handler never waits for the store. Slow handlers
        get nothing ahead: work stays claimable by other processes.
        """
        if self.prefetch is not None:
            return self.prefetch
        handler, claim = self._handler_seconds, self._claim_seconds
        if handler is None or claim is None or handler > PREFETCH_BELOW_SECONDS or self.budget is not None:
            return 0
        if any(s.flow_limited for group in self._groups for s in group):
            return 0  # what is claimed ahead holds a slot (and a token) that another process could run
        return min(MAX_PREFETCH, math.ceil(self.concurrency * claim / max(handler, 1e-6)))

    async def _claim_within_budget(self, limit: int) -> list[tuple[SubscriptionState, ClaimedDelivery]]:
        """:meth:`_claim`, what it brings taken off the budget (reserved while the claim is out)."""
        budget = self.budget
        if budget is None:
            return await self._claim(limit)
        reserved = budget.reserve(limit)
        got = 0
        try:
            batch = await self._claim(reserved)
            got = len(batch)
            return batch
        finally:
            budget.settle(reserved, got)

    async def _claim(self, limit: int) -> list[tuple[SubscriptionState, ClaimedDelivery]]:
        """Up to ``limit`` deliveries: from the first group while it has claimable work, then the next.
        A group of several subscriptions is claimed in one call, the oldest due delivery first."""
        started = self._clock()
        batch: list[tuple[SubscriptionState, ClaimedDelivery]] = []
        held: list[HeldBack] = []
        try:
            for group in self._groups:
                wanted = limit - len(batch)
                if wanted <= 0:
                    break
                # A subscription with flow limits is claimed on its own (claim_many takes none).
                shared = [s for s in group if not s.flow_limited] if len(group) > 1 and not self._claim_each else []
                if len(shared) > 1:
                    by_name = {s.name: s for s in shared}
                    try:
                        with counting({s.name: s.lease_seconds for s in shared}):
                            pairs = await self.transport.claim_many([s.name for s in shared], wanted)
                    except ValueError as exc:
                        if CLAIM_MANY_REFUSAL not in str(exc):
                            raise
                        # The store has a limit or a partition mode for one of them that this
                        # consumer has not read yet (a deploy changed it): each is claimed on its
                        # own until the host reads the subscriptions again.
                        log.info("%s: %s; claiming its subscriptions one by one until they are read again",
                                 self.name, exc)
                        self._claim_each = True
                        shared = []
                    else:
                        batch.extend((by_name[name], d) for name, d in pairs)
                for sub in (s for s in group if len(shared) < 2 or s.flow_limited):
                    wanted = limit - len(batch)
                    if wanted <= 0:
                        break
                    with counting({sub.name: sub.lease_seconds}):
                        got = await self.transport.claim(sub.name, wanted)
                    batch.extend((sub, d) for d in got)
                    if isinstance(got, Claimed) and got.held_back is not None:
                        held.append(got.held_back)
        except Exception as exc:
            if not batch:
                raise
            # What the claims before it took is leased to this process already: it runs (the claim
            # that failed took nothing), and the next claim tries the rest again.
            log.warning("%s: a claim failed (%s) after %s were claimed; running those", self.name, exc,
                        count(len(batch), "delivery"))
            held.clear()
        self._held_back = _soonest(held) if len(batch) < limit else None
        took = self._clock() - started
        previous = self._claim_seconds
        self._claim_seconds = took if previous is None else previous * 0.8 + took * 0.2
        return batch

    async def _sleep(self, seconds: float, *, jitter: bool = True) -> None:
        """Sleeps until a wake-up or ``seconds`` (with jitter, so processes do not poll in step)."""
        if self._wake.is_set() or self._stopping or self._paused:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds * random.uniform(0.9, 1.1) if jitter else seconds)

    def _hold(self, sub: SubscriptionState, delivery: ClaimedDelivery, sent_at: float) -> None:
        """Takes a claimed delivery under lease, waiting for a free slot. The lease is counted from
        when the claim was sent (:mod:`.leases`), not from when its answer arrived, or from as much
        later as the transport says it started the lease (an SQS long poll that waited)."""
        started = sent_at + max(0.0, delivery.lease_offset_seconds)
        running = _Running(delivery, AbortSignal(), LocalLease.claimed(started, sub.lease_seconds), sub)
        self.claimed_total += 1
        self._held[delivery.lease_token] = running
        self._buffer.append(running)
        self._arm_lease_timer(running)

    def _fill(self) -> None:
        """Starts held deliveries while there are free slots; gives back those whose lease has
        too little left (the claim was slow, or this process stalled) instead of starting them."""
        while self._buffer and len(self._running) < self.concurrency and not self._stopping and not self._paused:
            running = self._buffer.popleft()
            remaining = running.lease.remaining(self._clock())
            if running.signal.aborted or remaining < start_margin(running.lease.lease_seconds):
                self._give_back(running, remaining)
            else:
                self._start(running)

    def _give_back(self, running: _Running, remaining: float) -> None:
        """Releases a delivery that is not started: its claim may have run out in the store, where
        the sweeper may already have handed it to another worker (the release then changes
        nothing); otherwise it is Pending again without spending the attempt."""
        self._drop(running)
        delivery = running.delivery
        log.warning(
            "%s: delivery %s not started: %.2f s of its %.1f s lease left (the claim took long, or this "
            "process stalled); giving it back", self.name, delivery.delivery_id, max(remaining, 0.0),
            running.lease.lease_seconds,
        )
        self.settler.submit(
            Settlement(delivery.delivery_id, delivery.lease_token, "Release",
                       reason="released: too little of its lease was left to start"),
            self._settled,
        )
        self._slot_freed.set()

    def _start(self, running: _Running) -> None:
        sub = running.sub
        self._running[running.delivery.lease_token] = running
        loop = asyncio.get_running_loop()
        if sub.max_processing_seconds is not None:
            running.timers.append(
                loop.call_later(sub.max_processing_seconds, self._abort, running, AbortReason.MAX_PROCESSING_SECONDS)
            )
        name = f"{HANDLER_TASK_PREFIX}{running.delivery.delivery_id}"
        running.task = self._tasks.spawn(self._run(running), name=name)

    def _arm_lease_timer(self, running: _Running) -> None:
        """Aborts the handler with LeaseLost when its lease runs out without a renewal."""
        if running.lease_timer is not None:
            running.lease_timer.cancel()
        delay = max(0.0, running.lease.remaining(self._clock()))
        running.lease_timer = asyncio.get_running_loop().call_later(
            delay, self._abort, running, AbortReason.LEASE_LOST
        )

    def _abort(self, running: _Running, reason: AbortReason) -> None:
        """Signals the handler why it must stop and cancels its task."""
        if running.signal.abort(reason):
            log.info("%s: delivery %s aborted (%s)", self.name, running.delivery.delivery_id, reason.value,
                     extra=_delivery_fields(running))
            # A task that has not started yet sees the signal when it does (cancelling it then would
            # skip its clean-up).
            if running.entered and running.task is not None and not running.task.done():
                running.task.cancel()

    # -- running one delivery ----------------------------------------------------------------

    async def _run(self, running: _Running) -> None:
        # A handler's duration counts from its first step, not from its task's creation: the wait
        # for the event loop (which grows with the concurrency and the process's load) is not the
        # handler's, and would keep the deliveries of fast handlers from being claimed ahead.
        running.started_at = self._clock()
        settlement: Settlement | None = None
        scope = self._observer.process_started(running.sub.name, running.delivery)
        try:
            if scope is None:
                settlement = await self._execute(running)
            else:
                with scope.active():
                    settlement = await self._execute(running)
        except asyncio.CancelledError:
            # Cancelled from outside (the event loop is going away): give the delivery back.
            if not running.signal.aborted:
                running.signal.abort(AbortReason.SHUTDOWN)
            settlement = self._settlement_for_abort(running)
            raise
        finally:
            if scope is not None:
                scope.end(_observed_outcome(running.signal.reason, settlement, running.delivery), running.error)
            self._drop(running)
            took = self._clock() - running.started_at
            previous = self._handler_seconds
            self._handler_seconds = took if previous is None else previous * 0.9 + took * 0.1
            if settlement is not None and not running.released:
                callbacks = running.context.after_settle_callbacks if running.context is not None else ()
                done = self._settled if not callbacks else _then(self._settled, callbacks)
                if settlement.kind in GIVES_BACK and running.sub.transport_name == "database":
                    done = self._given_back_when_pending(done)
                self.settler.submit(settlement, done)
            # (the context's heartbeat and once, and the error's traceback, refer back to it: no cycle is left)
            running.context = running.error = None
            self._fill()
            self._slot_freed.set()

    def _settled(self, settlement: Settlement, result: SettleResult | None) -> None:
        self.settled_total += 1
        if self._held_back is not None:  # a slot a flow limit waits for may be free now
            self._slot_settled = True
            self._wake.set()
        if result == "Completed":
            self.completed_total += 1
        elif result == "LeaseLost":
            self.lost_total += 1
        if result == "LeaseLost" and settlement.reason != "LeaseLost":
            log.warning("%s: delivery %s settled after its lease was lost; outcome ignored",
                        self.name, settlement.delivery_id)

    async def _execute(self, running: _Running) -> Settlement | None:
        running.entered = True
        if running.signal.aborted:
            return self._settlement_for_abort(running)
        delivery = running.delivery
        sub = running.sub
        base = (delivery.delivery_id, delivery.lease_token)
        remaining = running.lease.remaining(self._clock())
        if remaining < start_margin(running.lease.lease_seconds):
            # Its task was made in time, but the process stalled (a handler blocked the event loop)
            # before its first step: the store may have handed the delivery, and its key, to another
            # worker since. Given back without running the handler, as a late claim is (_fill).
            log.warning("%s: delivery %s not started: %.2f s of its %.1f s lease left (this process stalled before "
                        "its handler began); giving it back", self.name, delivery.delivery_id, max(remaining, 0.0),
                        running.lease.lease_seconds, extra=_delivery_fields(running))
            return Settlement(*base, "Release", reason="released: too little of its lease was left to start")
        spec = self._resolve(sub.handler_key)
        if spec is None:
            # The handler went away (a reconcile raced us): give the delivery back untouched.
            return Settlement(*base, "Release", reason=f"handler {sub.handler_key!r} is not registered here")
        try:
            message = spec.build_message(delivery, sub.name)
        except PayloadInvalid as exc:
            return self._failed(running, exc, Settlement(*base, "DeadLetter", reason=storable(redact(str(exc))),
                                                         error=error_text(exc)))
        context = WorkContext(
            subscription=sub.name,
            delivery_id=delivery.delivery_id,
            attempt=delivery.attempt,
            max_attempts=delivery.max_attempts,
            signal=running.signal,
            heartbeat=_ManualHeartbeat(self, running),
            log=_DeliveryLog(_handler_logger(sub.handler_key), sub.name, delivery),
            principal=self.principal,
            once=_OnceStore(self, running),
            lease_left=lambda: running.lease.remaining(self._clock()),
        )
        running.context = context
        task = running.task
        try:
            outcome = await self._invoke(spec, message, context)
        except asyncio.CancelledError as exc:
            if not running.signal.aborted:
                if cancelled_by_the_handler(running.signal):
                    return self._failed(running, exc, settlement_for(*base, exc))
                raise  # not ours: the loop is going away
            if task is not None:
                task.uncancel()
            return self._settlement_for_abort(running) or self._failed(running, exc, settlement_for(*base, exc))
        except OnceBusy as exc:
            if running.signal.aborted:
                return self._settlement_for_abort(running)
            # Another attempt runs the same once() key: come back later without spending a try.
            return Settlement(*base, "Release", delay_seconds=ONCE_BUSY_RETRY_SECONDS, reason=str(exc))
        except GivenBack as exc:
            if running.signal.aborted:
                return self._settlement_for_abort(running)
            return Settlement(*base, "Release", delay_seconds=exc.delay_seconds, reason=str(exc))
        except Exception as exc:
            if running.signal.aborted and task is not None and task.cancelling():
                task.uncancel()
            aborted = self._settlement_for_abort(running)
            if aborted is not None:
                return aborted
            if _pool_exhausted(exc) and self._free_pool_back(running.delivery.delivery_id):
                # (the process's shortage, not the message's: no try spent, a bounded number of times,
                # since a handler that always waits in vain, needing two sessions of a pool of one say, would
                # otherwise come back for ever)
                self._warn_pool(running, exc)
                return Settlement(*base, "Release", delay_seconds=POOL_BUSY_RETRY_SECONDS, reason=summary(exc))
            return self._failed(running, exc, settlement_for(*base, exc))
        if running.signal.aborted:
            if task is not None and task.cancelling():
                task.uncancel()
            # A handler that says, with an explicit Outcome.complete(), that it finished its work anyway
            # within the shutdown's drain completes it (released, the work would run again after the
            # restart; its lease is still held). None is how a handler stops as asked: released.
            if not (running.signal.reason == AbortReason.SHUTDOWN and isinstance(outcome, Complete)):
                return self._settlement_for_abort(running)
        if self._returned_too_late(running):
            return self._settlement_for_abort(running)
        settlement = settlement_for(*base, outcome)
        if settlement.reason == INVALID_OUTCOME_REASON and settlement.kind == "Fail":
            # (a programming error, logged as a raised one is: the stored error alone says it too late)
            self._log_attempt(running, settlement, settlement.error or INVALID_OUTCOME_REASON)
        return settlement

    def _free_pool_back(self, delivery_id: str) -> bool:
        """Whether a delivery whose attempt found no free connection goes back without spending a try:
        at most :data:`POOL_FREE_GIVE_BACKS` times in this process; then its attempts count again."""
        backs = self._pool_backs.get(delivery_id, 0)
        if backs >= POOL_FREE_GIVE_BACKS:
            return False
        if len(self._pool_backs) >= 1000:  # (bounded: the oldest is forgotten)
            del self._pool_backs[next(iter(self._pool_backs))]
        self._pool_backs[delivery_id] = backs + 1
        return True

    def _warn_pool(self, running: _Running, exc: BaseException) -> None:
        """Says, at most once every :data:`POOL_WARN_SECONDS` per consumer, that an attempt found
        no free database connection and went back."""
        now = time.monotonic()
        if now - self._pool_warned_at < POOL_WARN_SECONDS:
            return
        self._pool_warned_at = now
        log.warning(
            "%s: delivery %s found no free database connection (%s): it goes back in %g s without spending a try. "
            "More handlers of this process hold a session at once than its pool has connections: raise "
            "WORKQUEUE_SESSION_POOL_SIZE (or WORKQUEUE_SESSION_POOL_OVERFLOW) to the subscriptions' concurrency plus "
            "the requests in flight, or lower the concurrency", self.name, running.delivery.delivery_id,
            summary(exc), POOL_BUSY_RETRY_SECONDS,
        )

    def _returned_too_late(self, running: _Running) -> bool:
        """True when the handler returned after its lease ran out as this process counts it (it
        blocked the event loop, so neither a heartbeat nor the lease timer could run): the store may
        have handed the delivery to another worker, so its outcome is not this attempt's to write.
        The attempt then ends as the lease timer would have ended it, with LeaseLost."""
        if running.lease.remaining(self._clock()) > 0:
            return False
        if running.signal.abort(AbortReason.LEASE_LOST):
            log.warning("%s: delivery %s: the handler returned after its lease of %.1f s ran out (it blocked the "
                        "event loop?); its outcome is ignored", self.name, running.delivery.delivery_id,
                        running.lease.lease_seconds, extra=_delivery_fields(running))
        return True

    def _failed(self, running: _Running, exc: BaseException, settlement: Settlement) -> Settlement:
        """Logs a failed attempt: WARNING when the delivery will be retried, ERROR when it is
        dead-lettered. A ``TransientWorkError`` or ``FatalWorkError`` (raised on purpose) is one line
        with its reason and cause; any other exception keeps its traceback, the queue's calling
        frames folded so that the user's come first. The record carries the delivery's fields."""
        running.error = exc
        if isinstance(exc, TransientWorkError | FatalWorkError):
            cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
            self._log_attempt(running, settlement, f"{type(exc).__name__}: {exc.reason}"
                              + (f" (caused by {summary(cause)})" if cause is not None else ""))
            return settlement
        delivery = running.delivery
        final = dead_letters(settlement.kind, delivery.attempt, delivery.max_attempts)
        what = "dead-lettering it" if final else "it will be retried"
        fields = _delivery_fields(running)
        work = _work_label(running)
        log.log(
            logging.ERROR if final else logging.WARNING,
            "%s: delivery %s%s (message %s) failed on attempt %d of %d with %s; %s",
            running.sub.name, delivery.delivery_id, work, delivery.message_id, delivery.attempt,
            delivery.max_attempts, type(exc).__name__, what,
            exc_info=(type(exc), exc, exc.__traceback__),
            extra={**fields, TRACEBACK_TEXT: handler_traceback(exc)},
        )
        return settlement

    def _log_attempt(self, running: _Running, settlement: Settlement, detail: str) -> None:
        """One line for a failed attempt: WARNING while it will be retried, ERROR when it dead-letters."""
        delivery = running.delivery
        final = dead_letters(settlement.kind, delivery.attempt, delivery.max_attempts)
        log.log(logging.ERROR if final else logging.WARNING, "%s: delivery %s%s attempt %d of %d: %s; %s",
                running.sub.name, delivery.delivery_id, _work_label(running), delivery.attempt,
                delivery.max_attempts, detail, "dead-lettering it" if final else "it will be retried",
                extra=_delivery_fields(running))

    def _settlement_for_abort(self, running: _Running) -> Settlement | None:
        reason = running.signal.reason
        base = (running.delivery.delivery_id, running.delivery.lease_token)
        if reason is None:
            return None
        if reason == AbortReason.SHUTDOWN:
            return Settlement(*base, "Release", reason=SHUTDOWN_RELEASE_REASON)
        if reason == AbortReason.CANCELLED:
            # The delivery is flagged: any outcome makes it Discarded.
            return Settlement(*base, "Fail", reason="Cancelled")
        if reason == AbortReason.MAX_PROCESSING_SECONDS:
            return Settlement(
                *base, "Fail", reason="MaxProcessingSeconds",
                error=f"the handler ran longer than max_processing_seconds "
                f"({running.sub.max_processing_seconds} s) and was aborted",
            )
        # LeaseLost: if the store still holds our token (the lease only ran out locally), the
        # attempt fails like a sweeper expiry would; otherwise the settle answers LeaseLost.
        return Settlement(*base, "Fail", reason="LeaseLost", error="the lease ran out before the handler ended")

    # -- heartbeats --------------------------------------------------------------------------

    async def manual_heartbeat(self, running: _Running, progress: Progress | None) -> bool:
        delivery = running.delivery
        sent_at = self._clock()
        lease = self._current(running.sub).lease_seconds
        try:
            [result] = await self.transport.heartbeat(
                [HeartbeatRequest(delivery.delivery_id, delivery.lease_token,
                                  progress.percent if progress else None,
                                  progress.message if progress else None, lease)]
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s: heartbeat of %s failed (%s)", self.name, delivery.delivery_id, exc)
            return not running.signal.aborted and running.lease.remaining(self._clock()) > 0
        self._apply_heartbeat(running, result.alive, result.cancel_requested, sent_at, lease)
        return result.alive and not running.signal.aborted

    def _apply_heartbeat(self, running: _Running, alive: bool, cancel_requested: bool, sent_at: float,
                         lease_seconds: float) -> None:
        """What a renewal answered; ``lease_seconds`` is the lease it asked the store for (the store
        granted that one, so the process counts that one)."""
        if cancel_requested:
            self._abort(running, AbortReason.CANCELLED)
            if running.signal.reason is AbortReason.CANCELLED:
                # The store renewed it: the key stays busy while the handler winds down, and the
                # delivery becomes Discarded when it returns (SPEC 4), not when the lease runs out.
                running.lease.renew(sent_at, lease_seconds)
                self._arm_lease_timer(running)
        elif not alive:
            self._abort(running, AbortReason.LEASE_LOST)
        elif not running.signal.aborted:
            running.lease.renew(sent_at, lease_seconds)
            self._arm_lease_timer(running)

    def _current(self, sub: SubscriptionState) -> SubscriptionState:
        """The newest definition of ``sub`` this consumer has (a reconcile may have changed it)."""
        for group in self._groups:
            for candidate in group:
                if candidate.name == sub.name:
                    return candidate
        return sub

    async def _heartbeat_loop(self) -> None:
        """Renews the Auto leases that are due, in one batch per tick."""
        while True:
            interval = min((s.heartbeat_interval_seconds for g in self._groups for s in g),
                           default=self.subscription.heartbeat_interval_seconds)
            await asyncio.sleep(min(interval, 1.0) if self._held else min(interval, 5.0))
            if not self._held:
                continue
            # Manual: the handler renews its own lease; deliveries held ahead are renewed here.
            waiting = {id(r) for r in self._buffer}
            now = self._clock()
            # A cancelled handler that has not returned yet is renewed here too (Manual mode
            # included: it was told to stop), so that its key stays busy until it returns.
            due = [
                r for r in self._held.values()
                if ((not r.signal.aborted and (r.sub.heartbeat_mode != "Manual" or id(r) in waiting))
                    or r.signal.reason is AbortReason.CANCELLED)
                and now - r.lease.renewed_at >= self._current(r.sub).heartbeat_interval_seconds * 0.95
            ]
            if not due:
                continue
            for running in due:
                if running.signal.reason is AbortReason.CANCELLED and not running.cancel_told:
                    running.cancel_told = True
                    log.warning(
                        "%s: delivery %s was cancelled and its handler has not returned; it keeps the delivery "
                        "and its key until it does (a handler stops at context.signal; stopping this process "
                        "ends it)", running.sub.name, running.delivery.delivery_id)
            leases = [self._current(r.sub).lease_seconds for r in due]
            try:
                results = await self.transport.heartbeat(
                    [HeartbeatRequest(r.delivery.delivery_id, r.delivery.lease_token, lease_seconds=lease)
                     for r, lease in zip(due, leases, strict=True)]
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("%s: heartbeat of %s failed (%s)", self.name, count(len(due), "delivery"), exc)
                continue
            for running, result, lease in zip(due, results, leases, strict=True):
                if self._held.get(running.delivery.lease_token) is not running:
                    continue  # its attempt ended while the renewal was under way: the answer is for nobody
                self._apply_heartbeat(running, result.alive, result.cancel_requested, now, lease)


@functools.cache
def _handler_logger(handler_key: str) -> logging.Logger:
    """The logger of a handler's ``context.log`` (looked up once per handler key)."""
    return redacting_logger(f"fastapi_workqueue.handler.{handler_key}")


class _ManualHeartbeat:
    """``context.heartbeat`` of one delivery."""

    __slots__ = ("_consumer", "_running")

    def __init__(self, consumer: Consumer, running: _Running) -> None:
        self._consumer = consumer
        self._running = running

    async def __call__(self, progress: Progress | None) -> bool:
        return await self._consumer.manual_heartbeat(self._running, progress)


class _OnceStore:
    """``context.once`` of one delivery: a marker per key in the transport."""

    __slots__ = ("_consumer", "_running")

    def __init__(self, consumer: Consumer, running: _Running) -> None:
        self._consumer = consumer
        self._running = running

    async def __call__(self, key: str, fn: Callable[[], Awaitable[Any]], ttl_seconds: float) -> bool:
        transport = self._consumer.transport
        sub = self._running.sub
        hold = max(sub.lease_seconds, sub.max_processing_seconds or 0.0, 60.0)
        state, token = await transport.once_begin(key, hold)
        if state == "Done":
            return False
        if state == "Busy" or token is None:
            raise OnceBusy(key)
        try:
            await fn()
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(transport.once_abort(key, token))
            raise
        await asyncio.shield(transport.once_finish(key, token, ttl_seconds))
        return True


class _DeliveryLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """``context.log``: the handler's logger with the delivery's ids on every record."""

    def __init__(self, logger: logging.Logger, subscription: str, delivery: ClaimedDelivery) -> None:
        super().__init__(logger, {})
        self._subscription = subscription
        self._delivery = delivery

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        delivery = self._delivery
        extra = {"subscription": self._subscription, "delivery_id": delivery.delivery_id,
                 "message_id": str(delivery.message_id), "attempt": delivery.attempt}
        kwargs["extra"] = {**extra, **(kwargs.get("extra") or {})}
        return msg, kwargs


def _then(
    settled: Callable[[Settlement, SettleResult | None], None], callbacks: Sequence[Callable[[str | None], object]]
) -> Callable[[Settlement, SettleResult | None], None]:
    """The settle callback that also calls a handler's ``after_settle`` callbacks (an error in one is logged)."""

    def done(settlement: Settlement, result: SettleResult | None) -> None:
        settled(settlement, result)
        for callback in callbacks:
            try:
                callback(result)
            except Exception:
                log.exception("an after_settle callback of delivery %s failed", settlement.delivery_id)

    return done


def _work_label(running: _Running) -> str:
    """`` (job notes.send-digest)`` when the attempt's handler named what it works on."""
    context = running.context
    name = context.work_name if context is not None else None
    return f" (job {name})" if name else ""


def _soonest(held: Sequence[HeldBack]) -> HeldBack | None:
    """Of the limits several claims reported, the one to wait for first: a slot (no time) before
    any token, else the token due soonest."""
    if not held:
        return None
    return min(held, key=lambda h: -1.0 if h.retry_after is None else h.retry_after)


def _delivery_fields(running: _Running) -> dict[str, Any]:
    """The delivery's fields a log record of its attempt carries."""
    delivery = running.delivery
    return {"subscription": running.sub.name, "delivery_id": delivery.delivery_id,
            "message_id": str(delivery.message_id), "attempt": delivery.attempt}


def _ids(runnings: Iterable[_Running], shown: int = 10) -> str:
    """Delivery ids for a log line: the first ``shown`` and how many more."""
    ids = [r.delivery.delivery_id for r in runnings]
    text = ", ".join(ids[:shown])
    return text + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


def _observed_outcome(
    aborted: AbortReason | None, settlement: Settlement | None, delivery: ClaimedDelivery,
) -> str | None:
    """What the observers count an attempt as: how it ends the delivery, as docs/observability.md
    says. Its settlement's kind, except that a cancelled attempt is discarded (the store discards a
    delivery flagged for cancel whatever it is settled with), a Retry or Fail of the last attempt
    dead-letters, and one whose lease ran out is abandoned (None)."""
    if settlement is None or aborted == AbortReason.LEASE_LOST:
        return None
    if aborted == AbortReason.CANCELLED:
        return "Discard"
    if dead_letters(settlement.kind, delivery.attempt, delivery.max_attempts):
        return "DeadLetter"
    return settlement.kind
