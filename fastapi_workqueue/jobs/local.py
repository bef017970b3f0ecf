"""Runs jobs in this process without a worker: sync mode and the test fake.

The jobs are published to a :class:`~fastapi_workqueue.testing.MemoryTransport` of their own and
the real consumer (:class:`~fastapi_workqueue.core.runtime.Consumer`) runs them there, one at a
time, through the same runner as a worker (envelope, decryption, validation, middleware,
dependencies with the app's overrides, timeout, events, chains). Delays and backoff are not waited
for: the in-memory store's clock moves on to the next due delivery, so a job that is released or
fails runs again at once until its tries are spent, and the next job of a chain runs after the one
before it succeeded. ``job.once`` markers are the store's (sync mode: the queue's transport) or a
store the fake keeps.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..core.clock import ManualClock
from ..core.context import WorkContext
from ..core.envelope import PreparedMessage, WorkMessage
from ..core.errors import TransportError
from ..core.handlers import HandlerSpec, call_plain
from ..core.memory import MemoryTransport
from ..core.message_state import HELD_UNTIL
from ..core.outcomes import WorkOutcome
from ..core.redaction import redacting_logger
from ..core.runtime import Consumer
from ..core.settler import Settler
from ..core.topology import Topic
from ..core.transport import Settlement, SettleResult, Transport
from .envelope import queue_of, topic_of
from .groups import LOCAL_STATE
from .middleware import Locks
from .results import decode_result
from .status import JobStatus, status_of
from .steps import LOCAL_STEPS

if TYPE_CHECKING:
    from .layer import Jobs

log = redacting_logger("fastapi_workqueue.jobs")
MAX_ONCE_BUSY = 50
"""How often an attempt that meets a busy ``once()`` key is sent back before it counts as released."""


@dataclass(slots=True)
class Counts:
    """What a run of jobs came to."""

    processed: int = 0
    failed: int = 0
    released: int = 0
    discarded: int = 0

    def as_counts(self) -> JobCounts:
        return JobCounts(asdict(self))


class JobCounts(dict[str, int]):
    """What ``await fake.work()`` ran to: ``counts.processed`` or ``counts["processed"]``, and the
    same for ``failed``, ``released`` and ``discarded``; equal to the plain dict of the four."""

    __slots__ = ()

    @property
    def processed(self) -> int:
        """Attempts that completed their job."""
        return self["processed"]

    @property
    def failed(self) -> int:
        """Jobs that failed for good (tries spent, or a ``FatalWorkError``)."""
        return self["failed"]

    @property
    def released(self) -> int:
        """Attempts that ended with the job coming back (an error with tries left, a release)."""
        return self["released"]

    @property
    def discarded(self) -> int:
        """Jobs that discarded themselves."""
        return self["discarded"]


class _LocalStore(MemoryTransport):
    """The in-memory store of a local run: it counts what each settle made of an attempt, creates a
    chained job's queue on its first follow-up, and keeps ``once`` markers in ``once_store``."""

    def __init__(self, run: LocalRun, once_store: Transport | None) -> None:
        self.manual = ManualClock()
        super().__init__(clock=self.manual)
        self._run = run
        self._once_store = once_store

    async def once_begin(self, key: str, running_seconds: float) -> tuple[str, str | None]:
        if self._once_store is None:
            return await super().once_begin(key, running_seconds)
        return await self._once_store.once_begin(key, running_seconds)

    async def once_finish(self, key: str, token: str, ttl_seconds: float) -> bool:
        if self._once_store is None:
            return await super().once_finish(key, token, ttl_seconds)
        return await self._once_store.once_finish(key, token, ttl_seconds)

    async def once_abort(self, key: str, token: str) -> bool:
        if self._once_store is None:
            return await super().once_abort(key, token)
        return await self._once_store.once_abort(key, token)

    async def once_renew(self, key: str, token: str, running_seconds: float) -> bool:
        if self._once_store is None:
            return await super().once_renew(key, token, running_seconds)
        return await self._once_store.once_renew(key, token, running_seconds)

    async def settle(self, settlements: Sequence[Settlement]) -> list[SettleResult]:
        results = await super().settle(settlements)
        for settlement, result in zip(settlements, results, strict=True):
            await self._run.settled(settlement, result)
        return results

    async def settle_with_follow_ups(self, settlement: Settlement) -> SettleResult:
        for follow_up in settlement.follow_ups:
            await self._run.ensure_queue(follow_up.topic)
        result = await super().settle_with_follow_ups(settlement)
        if result == "Completed":
            for follow_up in settlement.follow_ups:
                for message in follow_up.messages:
                    self._run.queued(follow_up.topic, message)
        return result


class LocalRun:
    """Runs queued jobs here (see the module's docstring). ``once_store`` keeps ``job.once``
    markers (the queue's transport in sync mode; None: the run's own store)."""

    def __init__(
        self,
        jobs: Jobs,
        *,
        once_store: Transport | None = None,
        on_queued: Callable[[str, PreparedMessage], None] | None = None,
        raise_failures: bool = True,
    ) -> None:
        self._jobs = jobs
        self._on_queued = on_queued
        self._raise = raise_failures
        self.store = _LocalStore(self, once_store)
        self.counts = Counts()
        self._errors: dict[str, BaseException] = {}
        self._failure: BaseException | None = None
        self._busy = 0
        self._queues: set[str] = set()

    async def run_until_done(self, queue: str, message: PreparedMessage) -> Counts:
        """Runs ``message`` and whatever it queues (a chain's next jobs) until nothing is left; in
        sync mode a job that failed for good raises its error here."""
        return await self._run([(queue, message)])

    async def run_group(self, members: list[tuple[str, PreparedMessage]], then: tuple[str, PreparedMessage],
                        group_id: uuid.UUID, member_ids: list[uuid.UUID]) -> Counts:
        """Runs a group: ``members`` (jobs this run ran before may be members too, ``member_ids``
        names them all) and the held ``then`` job once they ended."""

        async def make_group() -> None:
            await self.store.group_create(group_id, member_ids, then[1].message_id)

        return await self._run([*members, then], before_drain=make_group)

    async def _run(self, messages: list[tuple[str, PreparedMessage]],
                   before_drain: Callable[[], Awaitable[None]] | None = None) -> Counts:
        try:
            for queue, message in messages:
                topic = await self.ensure_queue(topic_of(queue))
                [result] = await self.store.publish(topic, [message])
                if not result.ok:
                    raise TransportError(f"job {message.message_id} could not be run here: {result.error}")
            if before_drain is not None:
                await before_drain()
            await self._drain()
        finally:
            await self._jobs.drain_events()
        failure, self._failure = self._failure, None
        if failure is not None and self._raise:
            raise failure
        return self.counts

    async def statuses(self) -> list[JobStatus]:
        """The status of every job of this run (what a run's own store knows: no attempt history)."""
        store = self.store
        cipher = self._jobs.cipher()
        found: list[JobStatus] = []
        for sub in await store.list_subscriptions():
            for state in ("Pending", "InFlight", "Completed", "DeadLettered", "Discarded"):
                for info in await store.list_deliveries(sub.name, state, limit=1_000_000):
                    result = None
                    if state == "Completed":
                        text = await store.result_get(info.message_id)
                        result = None if text is None else decode_result(text, cipher, info.message_id)
                    found.append(status_of(info, [], result))
        return found

    async def ensure_queue(self, topic: str) -> str:
        """The job queue of ``topic`` in the run's store (created on first use)."""
        if topic not in self._queues:
            name = queue_of(topic) or topic
            await self.store.sync_topology([Topic(name=topic)], [self._jobs.subscription_for(name)])
            self._queues.add(topic)
        return topic

    def queued(self, topic: str, message: PreparedMessage) -> None:
        if self._on_queued is not None:
            self._on_queued(queue_of(topic) or topic, message)

    async def settled(self, settlement: Settlement, result: SettleResult) -> None:
        """Counts what a settle made of one attempt, as the fake reports it."""
        error = self._errors.pop(settlement.delivery_id, None)
        if result == "Completed":
            self.counts.processed += 1
        elif result == "Discarded":
            self.counts.discarded += 1
        elif result == "DeadLettered":
            self.counts.failed += 1
            if isinstance(error, Exception) and self._failure is None:
                self._failure = error
        elif result == "Pending" and settlement.kind == "Release":  # a busy once() key: no try used
            self._busy += 1
            if self._busy >= MAX_ONCE_BUSY:
                self.counts.released += 1
                info = await self.store.get_delivery(settlement.delivery_id)
                if info is not None:
                    await self.store.discard(info.subscription, settlement.delivery_id, "once() key stayed busy")
        elif result == "Pending":
            self.counts.released += 1

    async def _invoke(self, spec: HandlerSpec, message: WorkMessage[Any], context: WorkContext) -> WorkOutcome | None:
        try:
            return await call_plain(spec, message, context)
        except Exception as exc:
            self._errors[message.delivery_id] = exc
            raise

    async def _drain(self) -> None:
        """Consumes until no delivery is left Pending or InFlight, moving the store's clock on to
        the next due delivery whenever the consumer finds nothing claimable."""
        store = self.store
        local = LOCAL_STATE.set(store)  # (a group's then job reads its group here; the consumer's tasks see it)
        steps = LOCAL_STEPS.set(store)  # (and its steps keep their results here, beside the job)
        try:
            await self._consume_all(store)
        finally:
            LOCAL_STEPS.reset(steps)
            LOCAL_STATE.reset(local)

    async def _consume_all(self, store: _LocalStore) -> None:
        while True:
            subscriptions = await store.list_subscriptions()
            settler = Settler(store)
            consumer = Consumer(store, settler, [subscriptions], self._jobs.kernel.resolve_handler, self._invoke,
                                concurrency=1, stop_when_idle=True, idle_poll_min=0.0, name="jobs in process")
            consumer.start()
            try:
                await consumer.wait_finished()
            finally:
                await consumer.stop(0)
                await settler.close()
            waiting = [info.visible_at for sub in await store.list_subscriptions()
                       for info in await store.list_deliveries(sub.name, "Pending", limit=1000)
                       if info.visible_at is not None and info.visible_at < HELD_UNTIL]
            if not waiting:
                return
            ahead = (min(waiting) - store.manual.now()).total_seconds()
            if ahead > 0:
                store.manual.advance(ahead)


def memory_locks() -> Locks:
    """Overlap locks in a dict (the test fake)."""
    held: dict[str, str] = {}

    async def begin(key: str, seconds: float) -> tuple[str, str | None]:
        if key in held:
            return "Busy", None
        held[key] = token = uuid.uuid4().hex
        return "Run", token

    async def end(key: str, token: str) -> bool:
        return held.pop(key, None) == token

    async def renew(key: str, token: str, seconds: float) -> bool:
        return held.get(key) == token

    return Locks(begin, end, renew)
