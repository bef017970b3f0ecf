"""Runs one attempt of a job: the core handler of every job queue.

It reads the job envelope, finds the job, decrypts and validates its payload, runs the job's
middleware and the job (with its dependencies, as a handler's are solved) under its timeout, and
turns what happened into the delivery's outcome and the job's events:

| the attempt | outcome | event |
|---|---|---|
| returns None | Completed (and the next job of a chain is queued in the same transaction) | JobProcessed |
| returns a value (``store_result=True``: kept with the job in that transaction) | Completed | JobProcessed |
| returns what cannot be stored (``store_result=True``: not JSON, or too large) | DeadLettered | JobFailed |
| returns ``job.release(d)``, or finds its overlap key taken | back after ``d`` s, a try used | JobReleased |
| returns ``job.discard(reason)`` | Discarded | JobDiscarded |
| raises (``TransientWorkError`` or any error) | back after backoff | JobReleased error |
| runs past its timeout (also: returns after it, having blocked the loop) | back after backoff | JobReleased timeout |
| returns after its lease ran out (blocked loop), or its worker died | as the sweeper wrote | the sweeper's |
| raises on its last try, or ``FatalWorkError`` | DeadLettered | JobFailed |
| has a payload that cannot be decrypted or validated | DeadLettered at once | JobFailed |
| names a job this process does not know | back after backoff | JobReleased unknown-job |
| names such a job on a queue that is not this app's (:mod:`.queue_owners`) | back at once, no try used | none |
| meets ``once()`` busy in another attempt | back in 5 s, no try used | JobReleased once-busy |
| is stopped by a shutdown | back at once, no try used | JobReleased shutdown |
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ..core.context import AbortReason, AbortSignal, GivenBack, OnceBusy, WorkContext, cancelled_by_the_handler
from ..core.envelope import WorkMessage
from ..core.outcomes import FatalWorkError, Outcome, TransientWorkError, WorkOutcome
from ..core.redaction import redacting_logger
from .context import JobContext, JobDiscard, JobRelease
from .definition import Job, JobPayloadInvalid
from .encryption import PayloadUndecryptable
from .envelope import PLAIN_KEYS, VERSION, EnvelopeInvalid, JobEnvelope, queue_of, topic_of
from .events import E, JobDiscarded, JobEvent, JobFailed, JobProcessed, JobProcessing, JobReleased, ReleaseReason
from .middleware import JobAttempt
from .results import ResultNotStorable
from .steps import SealedSteps, sealed_once

if TYPE_CHECKING:
    from .layer import Jobs

log = redacting_logger("fastapi_workqueue.jobs")

UNKNOWN_JOB_BACK_SECONDS = 5.0
"""When a job this worker does not declare comes back, within its grace (``job_unknown_grace_seconds``)."""
UNKNOWN_JOB_WARN_SECONDS = 60.0
"""The least time between two warnings of one worker about one undeclared job."""


class JobTimedOut(TransientWorkError):
    """The job ran past its timeout; its signal aborted and its task was cancelled."""


@dataclass(slots=True)
class _Timer:
    """The timeout of one attempt: aborts the job's signal and cancels its task when it passes."""

    task: asyncio.Task[Any] | None
    signal: AbortSignal
    fired: bool = False

    def fire(self) -> None:
        self.fired = True
        self.signal.abort(AbortReason.MAX_PROCESSING_SECONDS)
        if self.task is not None and not self.task.done():
            self.task.cancel()


class JobRunner:
    """The handler behind every job queue's subscription."""

    def __init__(self, jobs: Jobs) -> None:
        self._jobs = jobs
        self._queues: dict[str, str] = {}
        self._unknown_warned: dict[str, float] = {}

    async def run(self, message: WorkMessage[Any], context: WorkContext) -> WorkOutcome | None:
        """Runs one attempt of the job in ``message`` (registered as the job queues' handler)."""
        data = message.payload
        jobs = self._jobs
        # The common attempt, on a path of its own: a plain envelope (no timeout, unique key, chain
        # or encryption) of a job without middleware or dependencies, on a queue without listeners.
        # What it does is what the general path does for it, without the envelope object, the
        # events' fields or the wrapper; anything else (a payload that does not validate, too)
        # takes the general path, which reports it.
        if type(data) is dict and data.keys() == PLAIN_KEYS and data["v"] == VERSION and not jobs.events \
                and type(name := data["job"]) is str and (job := jobs.registry.find(name)) is not None \
                and not job.middleware and not job.dependency_params and not job.encrypted:
            context.work_name = name  # the queue's log lines name the job
            try:
                payload = job.load(data["payload"])
            except JobPayloadInvalid:
                return await self._run(message, context)
            queue = self._queues.get(message.topic) or self._queue(message.topic)
            if queue not in jobs.owners.own:
                jobs.owners.ran_from(queue)
            kwargs: dict[str, Any] = {}
            if job.payload_param is not None:
                kwargs[job.payload_param] = payload
            if job.context_param is not None:
                kwargs[job.context_param] = JobContext(
                    message.message_id, job.name, context.attempt, context.max_attempts, queue, context.signal,
                    lambda: _JobLog(log, job.name, message, context.attempt), context.once, jobs.steps,
                )
            started = time.monotonic()
            result = await job.func(**kwargs)
            if result is None:
                return None  # Completed
            return await self._ended(result, JobEnvelope(name, data["payload"]), message, context, queue, started)
        return await self._run(message, context)

    def _in_grace(self, message: WorkMessage[Any]) -> bool:
        """True while a job this worker does not declare goes back without spending a try: within
        ``job_unknown_grace_seconds`` of its dispatch."""
        grace = float(self._jobs.kernel.settings.job_unknown_grace_seconds)
        published = message.published_at
        if grace <= 0 or published is None:
            return False
        if published.tzinfo is None:
            published = published.replace(tzinfo=UTC)
        return (datetime.now(UTC) - published).total_seconds() < grace

    def _warn_unknown(self, name: str, queue: str) -> None:
        """Says, at most once a minute per job name, that a job this worker does not declare went back."""
        now = time.monotonic()
        if now - self._unknown_warned.get(name, -UNKNOWN_JOB_WARN_SECONDS) < UNKNOWN_JOB_WARN_SECONDS:
            return
        self._unknown_warned[name] = now
        log.warning(
            "job %r on queue %r is not declared in this process: it goes back without spending a try, for a "
            "worker that declares it (a rolling deploy), until WORKQUEUE_JOB_UNKNOWN_GRACE_SECONDS after its "
            "dispatch; then it spends its tries. Declare it with @queue.job(%r) in a module the worker imports",
            name, queue, name,
        )

    def _queue(self, topic: str) -> str:
        """The job queue of a topic (read once per topic)."""
        queue = self._queues[topic] = queue_of(topic) or topic
        return queue

    async def _run(self, message: WorkMessage[Any], context: WorkContext) -> WorkOutcome | None:
        """One attempt on the general path: every envelope, job and queue."""
        queue = self._queues.get(message.topic) or self._queue(message.topic)
        try:
            envelope = JobEnvelope.from_json(message.payload)
        except EnvelopeInvalid as exc:
            raise FatalWorkError(str(exc)) from None
        context.work_name = envelope.job
        jobs = self._jobs
        job = jobs.registry.find(envelope.job)
        if job is None:
            if await jobs.owners.leave(queue, envelope.job):
                raise GivenBack(f"job {envelope.job!r} is not declared by this app, which leaves queue {queue!r}")
            error = TransientWorkError(
                f"no job named {envelope.job!r} is declared in this process; declare it with "
                f"@queue.job({envelope.job!r}) in a module the worker imports (another app that shares this "
                f"database and job queue {queue!r} runs jobs this app does not know: give each app queues of "
                "its own)"
            )
            base = _fields(envelope, message, queue, context)
            if self._in_grace(message):  # (a rolling deploy's: a worker of the new release runs it)
                self._after(context, lambda: base.event(JobReleased, reason="unknown-job", error=error))
                self._warn_unknown(envelope.job, queue)
                raise GivenBack(str(error), delay_seconds=UNKNOWN_JOB_BACK_SECONDS)
            await self._after_error(base, context, envelope, error, "unknown-job")
            raise error
        if queue not in jobs.owners.own:
            jobs.owners.ran_from(queue)
        try:
            payload = job.load(jobs.open_payload(job, envelope) if job.encrypted else envelope.payload)
        except (PayloadUndecryptable, JobPayloadInvalid) as exc:
            failure, why_failed = FatalWorkError(str(exc)), str(exc)
            base = _fields(envelope, message, queue, context)
            self._after(context, lambda: base.event(JobFailed, error=failure, reason=why_failed,
                                                    chain_ended=bool(envelope.chain)))
            raise failure from None
        if envelope.timeout is None:
            signal = context.signal  # nothing aborts the job that does not abort its delivery
        else:  # its own, which its timeout aborts too
            signal = AbortSignal()
            context.signal.add_listener(signal.abort)
        steps, once = jobs.steps, context.once
        if job.encrypted and (cipher := jobs.cipher()) is not None:  # (its steps and once keys sealed too)
            steps, once = SealedSteps(steps, cipher), sealed_once(once, cipher, jobs.once_state)
        job_context = JobContext(
            message.message_id, job.name, context.attempt, context.max_attempts, queue, signal,
            lambda: _JobLog(log, job.name, message, context.attempt), once, steps,
        )
        if envelope.group is not None:  # the then job of a group: what became of each member
            job_context.group_id = envelope.group
            job_context.group_results = await jobs.group_results(envelope.group)
        if envelope.unique_key is not None and envelope.unique_until == "processing":
            await jobs.release_unique(queue, envelope.unique_key, message.message_id)
        if jobs.events:  # (no event is built for a queue without listeners)
            await self._emit(_fields(envelope, message, queue, context).event(JobProcessing))
        started = time.monotonic()
        try:
            if envelope.timeout is None and not job.middleware and not job.dependency_params:
                # The common job: its function, called with what it takes (no wrapper to build).
                kwargs: dict[str, Any] = {}
                if job.payload_param is not None:
                    kwargs[job.payload_param] = payload
                if job.context_param is not None:
                    kwargs[job.context_param] = job_context
                result = await job.func(**kwargs)
            else:
                result = await self._attempt(job, payload, job_context, envelope, message, context)
        except OnceBusy:
            self._after(context, lambda: _fields(envelope, message, queue, context).event(JobReleased,
                                                                                           reason="once-busy"))
            raise
        except asyncio.CancelledError as exc:
            if cancelled_by_the_handler(context.signal):
                await self._after_error(_fields(envelope, message, queue, context), context, envelope, exc, "error")
            else:
                self._aborted(context, _fields(envelope, message, queue, context), envelope)
            raise
        except FatalWorkError as exc:
            await self._failed(_fields(envelope, message, queue, context), context, envelope, exc, str(exc))
            raise
        except Exception as exc:
            why: ReleaseReason = "timeout" if isinstance(exc, JobTimedOut) else "error"
            await self._after_error(_fields(envelope, message, queue, context), context, envelope, exc, why)
            raise
        if result is None:  # the common outcome first: no isinstance checks, no event unless heard
            if jobs.events:
                seconds = time.monotonic() - started
                self._after(context, lambda: _fields(envelope, message, queue, context).event(JobProcessed,
                                                                                               seconds=seconds),
                            written="Completed", chained=bool(envelope.chain))
            frees = _frees(queue, envelope, message)
            return jobs.completion(envelope, frees=frees) if envelope.chain or frees else None
        return await self._ended(result, envelope, message, context, queue, started)

    async def _ended(self, result: Any, envelope: JobEnvelope, message: WorkMessage[Any], context: WorkContext,
                     queue: str, started: float) -> WorkOutcome:
        """The outcome of an attempt whose job returned something other than None."""
        jobs = self._jobs
        base = _fields(envelope, message, queue, context)
        if isinstance(result, JobDiscard):
            await self._end_unique(queue, envelope, message, context)
            self._after(context, lambda: base.event(JobDiscarded, reason=result.reason,
                                                    chain_ended=bool(envelope.chain)),
                        written="Discarded", chained=bool(envelope.chain))
            return Outcome.discard(f"{result.reason}; {_chain_note(envelope)}" if envelope.chain else result.reason)
        if isinstance(result, JobRelease):
            reason = "released by the job" if result.reason == "release" else "its overlap key was taken"
            if context.is_final_attempt:
                reason = await self._failed(base, context, envelope, None, f"{reason} on its last try")
            else:
                released: ReleaseReason = "overlap" if result.reason == "overlap" else "release"
                self._after(context, lambda: base.event(JobReleased, reason=released,
                                                        delay_seconds=result.delay_seconds))
            return Outcome.retry(reason, delay_seconds=result.delay_seconds)
        stored: str | None = None
        job = jobs.registry.find(envelope.job)
        if job is not None and job.store_result:
            try:
                stored = jobs.result_text(job, result)
            except ResultNotStorable as exc:
                failure = FatalWorkError(str(exc))
                await self._failed(base, context, envelope, failure, str(exc))
                raise failure from None
        self._after(context, lambda: base.event(JobProcessed, seconds=time.monotonic() - started),
                    written="Completed", chained=bool(envelope.chain))
        return jobs.completion(envelope, stored, _frees(queue, envelope, message))

    async def _attempt(
        self, job: Job, payload: Any, job_context: JobContext, envelope: JobEnvelope, message: WorkMessage[Any],
        context: WorkContext,
    ) -> Any:
        """The middleware, then the job, under the job's timeout."""
        call = self._jobs.caller(job, payload, job_context, message, context)
        if job.middleware:
            attempt = JobAttempt(job=job_context, payload=payload, definition=job, timeout=envelope.timeout,
                                 lease_seconds=self._jobs.lease_seconds, locks=self._jobs.locks)
            for middleware in reversed(job.middleware):
                call = _wrap(middleware, attempt, call)
        if envelope.timeout is None:
            return await call()
        timer = _Timer(asyncio.current_task(), job_context.signal)
        started = time.monotonic()
        handle = asyncio.get_running_loop().call_later(envelope.timeout, timer.fire)
        # The stop timeout is watched from a thread: a job that blocks the loop blocks a check on it too.
        watch = self._jobs.watchdog.watch(job, job_context, envelope.timeout, self._jobs.stop_timeout)
        try:
            result = await call()
        except asyncio.CancelledError:
            if not timer.fired or context.signal.aborted:
                raise
            if timer.task is not None:
                timer.task.uncancel()
            raise JobTimedOut(
                f"job {job.name!r} ran longer than its timeout of {envelope.timeout:g} s and was stopped"
            ) from None
        finally:
            handle.cancel()
            watch.end()
        took = time.monotonic() - started
        if timer.fired or took >= envelope.timeout:
            # It returned, but past its timeout: it blocked the event loop (the timer could not run)
            # or swallowed the cancellation. A timed-out attempt, whatever it returned.
            if timer.fired and timer.task is not None and timer.task.cancelling():
                timer.task.uncancel()
            raise JobTimedOut(
                f"job {job.name!r} returned after {took:.1f} s, past its timeout of {envelope.timeout:g} s "
                "(it blocked the event loop or ignored the cancellation); the attempt counts as timed out"
            )
        return result

    async def _after_error(
        self, base: _Fields, context: WorkContext, envelope: JobEnvelope, exc: BaseException,
        reason: ReleaseReason,
    ) -> None:
        if context.is_final_attempt:
            await self._failed(base, context, envelope, exc, f"{type(exc).__name__} on its last try")
        else:
            self._after(context, lambda: base.event(JobReleased, reason=reason, error=exc))

    async def _failed(self, base: _Fields, context: WorkContext, envelope: JobEnvelope,
                      exc: BaseException | None, reason: str) -> str:
        """Emits JobFailed (once settled) and returns the failure's reason, the chain's end noted."""
        if envelope.chain:
            note = _chain_note(envelope)
            if exc is not None:
                exc.add_note(note)
            reason = f"{reason}; {note}"
        if envelope.unique_key is not None and not context.lease_ran_out:
            await self._jobs.release_unique(base.queue, envelope.unique_key, base.job_id)
        self._after(context, lambda: base.event(JobFailed, error=exc, reason=reason, chain_ended=bool(envelope.chain)))
        return reason

    async def _end_unique(self, queue: str, envelope: JobEnvelope, message: WorkMessage[Any],
                          context: WorkContext) -> None:
        """Frees the job's unique key (held until done) as its attempt ends, unless the attempt's
        lease ran out first: then the job is not done (the store runs it again, perhaps on another
        worker) and the key stays held by it."""
        if context.lease_ran_out:
            return
        for _, key, job_id in _frees(queue, envelope, message):
            await self._jobs.release_unique(queue, key, job_id)

    def _aborted(self, context: WorkContext, base: _Fields, envelope: JobEnvelope) -> None:
        """The event of an attempt the runtime aborted (its task cancelled): released at a
        shutdown, discarded by an operator's cancel, released (or failed, on its last try) when its
        lease ran out; each as the store settles it."""
        reason = context.signal.reason
        chained = bool(envelope.chain)
        if reason == AbortReason.SHUTDOWN:  # (Discarded instead when an operator's cancel came first)
            self._after(context, lambda: base.event(JobReleased, reason="shutdown"), written="Pending",
                        chained=chained)
        elif reason == AbortReason.CANCELLED:
            self._after(context, lambda: base.event(JobDiscarded, reason="cancelled by an operator",
                                                    chain_ended=chained),
                        written="Discarded", chained=chained)
        elif reason == AbortReason.LEASE_LOST:
            self._after(context, lambda: base.event(JobReleased, reason="lease-lost"), written="Pending",
                        chained=chained)

    async def _emit(self, event: JobEvent) -> None:
        await self._jobs.events.emit(event)

    def _after(self, context: WorkContext, make: Callable[[], JobEvent], *, written: str | None = None,
               chained: bool = False) -> None:
        """Emits the event ``make`` builds (now, when the queue has listeners) once the attempt's
        outcome is written to the store (listeners see what the store knows: a failed job is in the
        failed jobs when JobFailed is heard).

        ``written`` is what the store answers when it wrote the outcome (``"Completed"`` for
        JobProcessed, ``"Discarded"`` for JobDiscarded). An attempt the store settled otherwise was
        not processed; what became of it is emitted instead (:func:`_not_written`). An attempt that
        whose settle the store answers ``LeaseLost`` after the lease ran out (the sweeper took the
        lease back: the attempt ran past it, or its settle waited past it for the store), or not
        at all, emits nothing: the sweeper that takes the lease back emits what became of the job
        (:mod:`.taken_back`), once. ``LeaseLost`` while the lease still runs is the answer to a
        repeat of a settle whose first answer was lost (the store wrote it): the event is emitted
        then, as no lease is left to take back."""
        if self._jobs.events:
            event = make()
            emit_soon = self._jobs.emit_soon

            def settled(result: str | None) -> None:
                # (the lease as it stands when the answer comes, not when the attempt ended)
                if result is None or (result == "LeaseLost" and context.lease_ran_out):
                    return
                if result == "LeaseLost" or written is None or result == written:
                    emit_soon(event)
                else:
                    emit_soon(_not_written(event, result, chained))

            context.after_settle(settled)


def _not_written(event: JobEvent, result: str, chained: bool) -> JobEvent:
    """What an attempt that ended as ``event`` came to when the store settled it as ``result``
    instead (an operator's cancel turns any outcome into Discarded)."""
    fields = _Fields(event.job, event.job_id, event.queue, event.attempt, event.tries)
    if result == "DeadLettered":  # (the lease ran out on its last try: a failed attempt)
        reason = "its lease ran out before the attempt ended, on its last try"
        if chained:
            reason = f"{reason}; the chain ends here"
        return fields.event(JobFailed, reason=reason, chain_ended=chained)
    if result == "Discarded":  # (an operator cancelled it meanwhile)
        return fields.event(JobDiscarded, reason="cancelled by an operator", chain_ended=chained)
    return fields.event(JobReleased, reason="lease-lost")


def _chain_note(envelope: JobEnvelope) -> str:
    return f"the chain ends here: the {len(envelope.chain)} job(s) queued after it will not run"


def _fields(envelope: JobEnvelope, message: WorkMessage[Any], queue: str, context: WorkContext) -> _Fields:
    """The fields of an attempt's events, built only when an event or a failure needs them."""
    return _Fields(envelope.job, message.message_id, queue, context.attempt, context.max_attempts)


@dataclass(frozen=True, slots=True)
class _Fields:
    """What every event of one attempt carries."""

    job: str
    job_id: uuid.UUID
    queue: str
    attempt: int
    tries: int

    def event(self, kind: type[E], **extra: Any) -> E:
        return kind(job=self.job, job_id=self.job_id, queue=self.queue, attempt=self.attempt, tries=self.tries,
                    **extra)


def _wrap(
    middleware: Any, attempt: JobAttempt, call_next: Callable[[], Awaitable[Any]]
) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        return await middleware(attempt, call_next)

    return call


class _JobLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """``job.log``: the jobs logger with the job's name, id, queue and attempt on every record."""

    def __init__(self, logger: logging.Logger, name: str, message: WorkMessage[Any], attempt: int) -> None:
        super().__init__(logger, {})
        self._fields = {"job": name, "job_id": str(message.message_id), "subscription": message.subscription,
                        "delivery_id": message.delivery_id, "message_id": str(message.message_id),
                        "attempt": attempt}

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        kwargs["extra"] = {**self._fields, **(kwargs.get("extra") or {})}
        return msg, kwargs


def _frees(queue: str, envelope: JobEnvelope, message: WorkMessage[Any]) -> tuple[tuple[str, str, uuid.UUID], ...]:
    """The unique key a completion frees in its own transaction (held until done), or none: a key
    held until processing was freed as the attempt began, and a completion that finds its lease
    lost frees nothing (the job runs again and keeps holding it)."""
    if envelope.unique_key is None or envelope.unique_until == "processing":
        return ()
    return ((topic_of(queue), envelope.unique_key, message.message_id),)
