"""Writes settles in batches: whatever gathers while one batch is in flight goes in the next."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .errors import TransportError
from .observe import NO_OBSERVER, Observer
from .redaction import redacting_logger
from .stalls import StallWatch
from .tasks import TaskScope
from .transport import Settlement, SettleResult, Transport
from .words import count

log = redacting_logger("fastapi_workqueue.settler")

T = TypeVar("T")

SettleDone = Callable[[Settlement, SettleResult | None], None]
"""Called once a settle is written (with its result) or given up (with None)."""


class Settler:
    """Batches the settles of every consumer of a process into few round trips.

    A settle is submitted without waiting; the handler's slot is free at once. While the store is
    unreachable, a batch is retried for up to ``give_up_after`` seconds; after that its leases
    expire and the sweeper takes the deliveries back, so nothing is lost.
    """

    def __init__(self, transport: Transport, *, max_batch: int = 500, give_up_after: float = 60.0,
                 observer: Observer = NO_OBSERVER) -> None:
        self._transport = transport
        self._observer = observer
        self._max_batch = max_batch
        self._give_up_after = give_up_after
        self._pending: list[tuple[Settlement, SettleDone | None]] = []
        self._in_flight = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._written = asyncio.Event()
        self._tasks = TaskScope("workqueue-settler")
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._give_up_at: float | None = None
        """A stop's deadline (monotonic): a batch the store has not taken by then is given up."""
        self._stopping = asyncio.Event()
        self.watch = StallWatch("writing settles")
        """The write under way, for the host's look at calls that wait too long (:mod:`.stalls`)."""
        self._attempt_timeout: asyncio.Timeout | None = None
        """The timeout of the write under way: a stop that begins while it waits on the store moves
        it to the stop's deadline."""

    @property
    def backlog(self) -> int:
        """Settles submitted and not yet written."""
        return len(self._pending) + self._in_flight

    def start(self) -> None:
        if self._task is None:
            self._closing = False
            self._give_up_at = None  # (a stop's deadline is that stop's)
            self._stopping.clear()
            self._tasks.reopen()
            self._task = self._tasks.spawn(self._run(), name="workqueue-settler")

    def submit(self, settlement: Settlement, done: SettleDone | None = None) -> None:
        """Queues a settle for the next batch."""
        self._pending.append((settlement, done))
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self.start()

    async def wait_below(self, limit: int) -> None:
        """Waits until fewer than ``limit`` settles are waiting to be written (back-pressure for
        claims: a consumer does not claim faster than its outcomes can be written)."""
        while self.backlog >= limit:
            self._written.clear()
            await self._written.wait()

    async def flush(self) -> None:
        """Waits until every submitted settle is written (or given up)."""
        while self.backlog:
            self._idle.clear()
            await self._idle.wait()

    def give_up_by(self, moment: float) -> None:
        """From now on, a batch the store has not taken by ``moment`` (``time.monotonic()``) is
        given up, its deliveries left to their leases: a stop while the store is out of reach ends
        within its deadline instead of retrying for ``give_up_after`` seconds a batch."""
        self._give_up_at = moment if self._give_up_at is None else min(self._give_up_at, moment)
        self._stopping.set()
        if self._attempt_timeout is not None and not self._attempt_timeout.expired():
            # (a write that began before the stop, waiting on a store that does not answer)
            self._attempt_timeout.reschedule(self._loop_deadline())

    async def close(self) -> None:
        """Writes what is queued, then stops."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._tasks.close()

    async def _observed(self, settlements: list[Settlement], write: Awaitable[T]) -> T:
        """``write``, the store's call that settles ``settlements``, inside the observers' settle scope."""
        scope = self._observer.settle_started(settlements)
        try:
            answer = await write
        except BaseException as exc:
            if scope is not None:
                scope.end(exc)
            raise
        if scope is not None:
            scope.end(None)
        return answer

    async def _settle(self, settlements: list[Settlement], written: dict[int, SettleResult]) -> None:
        """One batch for the plain settles; one transaction for the completions with follow-ups or
        a result (their messages are published, their results kept, with them), or one each when
        the store cannot write them together. What is written goes into ``written``, so a retry
        after a failure writes only the rest. A completion refused on its own (a follow-up the
        publish refuses) does not hold back the others: its error is raised once they are written."""
        plain = [s for s in settlements if not s.one_transaction and id(s) not in written]
        if plain:
            results = await self._observed(plain, self._transport.settle(plain))
            for settlement, result in zip(plain, results, strict=True):
                written[id(settlement)] = result
        together = [s for s in settlements if s.one_transaction and id(s) not in written]
        if len(together) > 1:
            answers = await self._observed(together, self._transport.settle_together(together))
            if answers is not None:
                for settlement, result in zip(together, answers, strict=True):
                    written[id(settlement)] = result
        refused: Exception | None = None
        for settlement in settlements:
            if settlement.one_transaction and id(settlement) not in written:
                try:
                    written[id(settlement)] = await self._observed(
                        [settlement], self._transport.settle_with_follow_ups(settlement))
                except Exception as exc:
                    if isinstance(exc, TransportError) and exc.retryable:
                        raise  # the store is out of reach: the batch is tried again
                    refused = refused or exc  # (a follow-up refused) the others are written all the same
        if refused is not None:
            raise refused

    async def _run(self) -> None:
        while True:
            if not self._pending:
                self._idle.set()
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
            self._in_flight = len(batch)
            try:
                await self._write(batch)
            finally:
                self._in_flight = 0
                self._written.set()

    async def _each(self, settlements: list[Settlement], written: dict[int, SettleResult], refused: set[int]) -> None:
        """Writes the settlements one by one (after the store refused them as a batch): one the
        store refuses on its own is logged and left to its lease, and the others are written."""
        for settlement in settlements:
            if id(settlement) in written or id(settlement) in refused:
                continue
            try:
                await self._settle([settlement], written)
            except Exception as exc:
                if isinstance(exc, TransportError) and exc.retryable:
                    raise  # the store is out of reach: the rest is tried again
                refused.add(id(settlement))
                log.error("settle of delivery %s refused (%s); its lease will expire", settlement.delivery_id, exc)

    def _loop_deadline(self) -> float:
        """When the attempt under way must end, on the loop's clock: the stop's deadline."""
        assert self._give_up_at is not None
        return asyncio.get_running_loop().time() + max(self._give_up_at - time.monotonic(), 0)

    async def _write(self, batch: list[tuple[Settlement, SettleDone | None]]) -> None:
        deadline = time.monotonic() + self._give_up_after
        delay = 0.1
        settlements = [s for s, _ in batch]
        written: dict[int, SettleResult] = {}
        refused: set[int] | None = None  # (one by one, once the store refused the batch)
        while True:
            try:
                attempt = (self._settle(settlements, written) if refused is None
                           else self._each(settlements, written, refused))
                # (during a stop, or once one begins, the attempt ends by the stop's deadline)
                try:
                    async with asyncio.timeout_at(
                        None if self._give_up_at is None else self._loop_deadline()
                    ) as self._attempt_timeout:
                        self.watch.begin()
                        await attempt
                finally:
                    self.watch.end()
                    self._attempt_timeout = None
                results: list[SettleResult | None] = [written.get(id(s)) for s in settlements]
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, TimeoutError):  # (the stop's deadline passed while the store was silent)
                    exc = TransportError("the store did not answer before the stop's deadline", retryable=True)
                retryable = isinstance(exc, TransportError) and exc.retryable
                if not retryable and refused is None and len(settlements) - len(written) > 1:
                    # One settle the store refuses (a text it cannot keep, say) must not cost the
                    # others theirs: each is written on its own.
                    log.warning("the store refused a batch of %s (%s); writing them one by one",
                                count(len(settlements) - len(written), "settle"), exc)
                    refused = set()
                    continue
                stopping = self._give_up_at is not None and time.monotonic() >= self._give_up_at
                if time.monotonic() > deadline or not retryable or stopping:
                    log.error("settle failed for %s (%s); their leases will expire",
                              count(len(batch) - len(written), "delivery"), exc)
                    results = [written.get(id(s)) for s in settlements]
                    break
                log.warning("settle failed (%s); retrying in %.1f s", exc, delay)
                if self._give_up_at is None:
                    with contextlib.suppress(TimeoutError):  # (a stop wakes it: one more try, within its deadline)
                        await asyncio.wait_for(self._stopping.wait(), delay)
                else:
                    await asyncio.sleep(max(min(delay, self._give_up_at - time.monotonic()), 0))
                delay = min(delay * 2, 5.0)
        for (settlement, done), result in zip(batch, results, strict=True):
            if done is not None:
                try:
                    done(settlement, result)
                except Exception:  # pragma: no cover - a callback must not stop the settler
                    log.exception("settle callback failed")
