"""Runs jobs in this process, attempt after attempt, without a worker: sync mode and the test fake.

Each attempt goes through the same runner as in a worker (envelope, decryption, validation,
middleware, dependencies with the app's overrides, timeout, events), with a context whose lease
never runs out. Delays and backoff are not waited for: a job that is released or fails runs again
at once until its tries are spent; the next job of a chain runs after the one before succeeded.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..core.context import AbortSignal, OnceBusy, OnceStore, Progress, WorkContext
from ..core.envelope import PreparedMessage, WorkMessage
from ..core.lifecycle import dead_letters, settlement_for
from ..core.outcomes import Outcome
from ..core.redaction import redacting_logger
from .definition import DEFAULT_TRIES
from .envelope import queue_of, topic_of
from .middleware import Locks

if TYPE_CHECKING:
    from .layer import Jobs

log = redacting_logger("fastapi_workqueue.jobs")
MAX_ONCE_BUSY = 50
"""How often an attempt that meets a busy ``once()`` key is run again before it counts as released."""


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


OnceFunc = OnceStore


class InProcess:
    """Runs queued jobs here. ``once`` keeps ``job.once`` markers (the store's, or a dict's)."""

    def __init__(
        self,
        jobs: Jobs,
        *,
        once: OnceFunc | None = None,
        on_queued: Callable[[str, PreparedMessage], None] | None = None,
        raise_failures: bool = True,
    ) -> None:
        self._jobs = jobs
        self._once = once or _store_once(jobs)
        self._on_queued = on_queued
        self._raise = raise_failures
        self._deliveries = 0
        self.counts = Counts()

    async def run_until_done(self, queue: str, message: PreparedMessage) -> Counts:
        """Runs ``message`` and whatever it queues (a chain's next jobs) until nothing is left."""
        try:
            return await self._run_until_done(queue, message)
        finally:
            await self._jobs.drain_events()

    async def _run_until_done(self, queue: str, message: PreparedMessage) -> Counts:
        todo: deque[tuple[str, PreparedMessage, int]] = deque([(queue, message, 1)])
        busy = 0
        while todo:
            queue, message, attempt = todo.popleft()
            tries = message.max_attempts or DEFAULT_TRIES
            context = self._context(queue, message, attempt, tries)
            outcome: Any
            try:
                outcome = await self._jobs.runner.run(self._message(queue, message, attempt), context)
                if outcome is None:  # (a handler's None completes, as a worker's runtime reads it)
                    outcome = Outcome.complete()
            except Exception as exc:  # OnceBusy, FatalWorkError or the job's error, as a worker's runtime sees it
                outcome = exc
            if isinstance(outcome, OnceBusy):
                busy += 1
                _settled(context, "Pending")
                if busy < MAX_ONCE_BUSY:
                    todo.append((queue, message, attempt))  # no try used
                else:
                    self.counts.released += 1
                continue
            settlement = settlement_for(f"in-process-{self._deliveries}", "", outcome)
            if settlement.kind == "Complete":
                self.counts.processed += 1
                _settled(context, "Completed")
                for follow_up in settlement.follow_ups:
                    next_queue = queue_of(follow_up.topic) or follow_up.topic
                    for queued in follow_up.messages:
                        if self._on_queued is not None:
                            self._on_queued(next_queue, queued)
                        todo.append((next_queue, queued, 1))
            elif settlement.kind == "Discard":
                self.counts.discarded += 1
                _settled(context, "Discarded")
            elif dead_letters(settlement.kind, attempt, tries):
                self.counts.failed += 1
                _settled(context, "DeadLettered")
                if self._raise and isinstance(outcome, Exception):
                    raise outcome
            else:  # a retry: at once, the next attempt
                self.counts.released += 1
                _settled(context, "Pending")
                todo.append((queue, message, attempt + 1))
        return self.counts

    def _message(self, queue: str, message: PreparedMessage, attempt: int) -> WorkMessage[Any]:
        self._deliveries += 1
        topic = topic_of(queue)
        return WorkMessage[Any].model_construct(
            message_id=message.message_id, topic=topic, subscription=topic,
            delivery_id=f"in-process-{self._deliveries}", attempt=attempt, partition_key=message.partition_key,
            attributes=message.attributes, payload=json.loads(message.payload_json or "null"),
            payload_ref=message.payload_ref, correlation_id=message.correlation_id, published_at=None,
        )

    def _context(self, queue: str, message: PreparedMessage, attempt: int, tries: int) -> WorkContext:
        return WorkContext(
            subscription=topic_of(queue), delivery_id=f"in-process-{self._deliveries}", attempt=attempt,
            max_attempts=tries, signal=AbortSignal(), heartbeat=_alive,
            log=logging.LoggerAdapter(log, {"job_id": str(message.message_id)}), once=self._once,
        )


def _settled(context: WorkContext, result: str) -> None:
    """What the store's settle callback does for a worker: the attempt's after-settle callbacks."""
    for callback in context.after_settle_callbacks:
        try:
            callback(result)
        except Exception:
            log.exception("an after_settle callback failed")


async def _alive(progress: Progress | None) -> bool:
    return True


def _store_once(jobs: Jobs) -> OnceFunc:
    """``job.once`` on the store's markers (sync mode)."""

    async def once(key: str, fn: Callable[[], Awaitable[Any]], ttl_seconds: float) -> bool:
        transport = jobs.queue.transport
        state, token = await transport.once_begin(key, max(jobs.lease_seconds, 60.0))
        if state == "Done":
            return False
        if state == "Busy" or token is None:
            raise OnceBusy(key)
        try:
            await fn()
        except BaseException:
            await transport.once_abort(key, token)
            raise
        await transport.once_finish(key, token, ttl_seconds)
        return True

    return once


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


def memory_once() -> OnceFunc:
    """``job.once`` on markers in a dict (the test fake)."""
    done: set[str] = set()

    async def once(key: str, fn: Callable[[], Awaitable[Any]], ttl_seconds: float) -> bool:
        if key in done:
            return False
        await fn()
        done.add(key)
        return True

    return once
