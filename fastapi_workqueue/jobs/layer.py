"""The jobs layer of one WorkQueue: declaration, dispatch, bulk, chains, unique keys, sizes.

``queue.job``, ``queue.dispatch``, ``queue.bulk``, ``queue.chain``, ``queue.size`` and
``queue.listen`` delegate here. A job is a message on its queue's topic (:mod:`.envelope`), so
every guarantee of the core holds for it: leases, fencing, heartbeats, dead letters, the operator
tools, transactional publish.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from ..core.envelope import (
    MAX_DELAY_SECONDS,
    MAX_KEY_LENGTH,
    PreparedMessage,
    PublishRequest,
    PublishResult,
    PublishStatus,
    prepare,
    prepare_parts,
    uuid7,
)
from ..core.errors import ConfigurationError, TransportError
from ..core.message_state import MESSAGE_STATE_NEEDED
from ..core.outcomes import FollowUp, Outcome, WorkOutcome
from ..core.redaction import redacting_logger
from ..core.tasks import TaskScope
from ..core.topology import Subscription, Topic
from .context import JobContext, StepStore
from .debounce import debounce_window, dispatch_debounced, stored_key
from .definition import (
    DEFAULT_TRIES,
    Job,
    JobPayloadInvalid,
    check_job_name,
    check_priority,
    check_queue_name,
    define_job,
)
from .encryption import PayloadCipher, PayloadUndecryptable, cipher_from
from .envelope import (
    JOB_ATTRIBUTE,
    ChainLink,
    JobEnvelope,
    UniqueUntil,
    envelope_json,
    plain_envelope_json,
    queue_of,
    topic_of,
)
from .events import JobEvents
from .failed import FailedJobs
from .groups import JobGroup, group_results, make_group
from .local_status import LocalStatuses, as_job_id
from .middleware import Locks
from .queue_owners import QueueOwners
from .registry import JobRegistry
from .results import encode_result
from .runner import JobRunner
from .schedules import Schedules
from .status import JobStatus, read_status
from .steps import TransportSteps
from .taken_back import taken_back_event
from .watchdog import Overrun, Watchdog
from .worker import GROUP_NAME, OTHERS, UnwatchedQueues, job_group, parse_queues

if TYPE_CHECKING:
    from ..core.context import WorkContext
    from ..core.envelope import WorkMessage
    from ..core.host import GroupPlan, Host
    from ..core.kernel import Kernel
    from ..core.reports import TakenBack

log = redacting_logger("fastapi_workqueue.jobs")
T = TypeVar("T")

TAKEN_BACK_READS = 16
"""How many deliveries whose lease a sweep took back are read at once, for their jobs' events."""

JOBS_HANDLER = "workqueue.jobs"
"""The handler key of every job queue's subscription."""
DEFAULT_UNIQUE_FOR = 3600.0
UNIQUE_RETRIES = 3


class JobDispatchError(RuntimeError):
    """The store refused a job (the result says why); nothing of the call was queued."""

    def __init__(self, job: str, result: PublishResult, *, item: int | None = None) -> None:
        detail = result.error.message if result.error is not None else result.status.value
        which = "" if item is None else f" (bulk item {item})"
        super().__init__(f"job {job!r}{which} was not queued: {detail}")
        self.result = result
        self.item = item


DELAY_FORMS = "a number of seconds (delay=300) or a timedelta (delay=timedelta(minutes=5))"


def _seconds(delay: timedelta | float | None) -> float | None:
    if delay is None:
        return None
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        seconds = float(delay)
    else:
        raise TypeError(f"delay must be {DELAY_FORMS}; got {delay!r}")
    if seconds < 0:
        raise ValueError(f"delay must not be negative, got {delay!r}")
    if not seconds <= MAX_DELAY_SECONDS:  # (NaN too)
        raise ValueError(f"delay must be a number of seconds from 0 to {MAX_DELAY_SECONDS:.0f} (100 years), "
                         f"got {delay!r}; for a later run, schedule the job or dispatch it nearer the time")
    return seconds


def _ttl(unique_for: float) -> float | None:
    """``unique_for`` as a request's deduplication TTL (raises as a request with it does)."""
    if type(unique_for) in (int, float) and 0 < unique_for <= MAX_DELAY_SECONDS:
        return float(unique_for)
    return PublishRequest(deduplication_ttl_seconds=unique_for).deduplication_ttl_seconds


_NOTHING = object()
_ENDED = frozenset({"Completed", "DeadLettered", "Discarded"})
"""The states of a delivery that has ended (a job's message has one delivery)."""
"""No job item read yet (bulk resolves each run of items of one job once)."""
_Entry = tuple["Job", str, Any, Any, "str | None", "float | None", int]
"""A checked job of a dispatch or bulk: (job, queue, data, sealed payload, encrypted token, delay, priority)."""


_LAYERS: weakref.WeakSet[Jobs] = weakref.WeakSet()


def queues_with_jobs() -> list[object]:
    """The queues of this process that declare at least one job (the test plugin's default): the
    app-facing object of each kernel (its WorkQueue)."""
    return [layer.kernel.facade for layer in list(_LAYERS) if len(layer.registry)]


class Jobs:
    """Jobs of one :class:`~fastapi_workqueue.WorkQueue`, on its kernel."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        _LAYERS.add(self)
        self.registry = JobRegistry()
        self.events = JobEvents()
        self.runner = JobRunner(self)
        self.steps: StepStore = TransportSteps(lambda: self.kernel.transport)
        self.locks = Locks(self._once_begin, self._once_abort, self._once_renew)
        self._cipher: PayloadCipher | None = None
        self._cipher_loaded = False
        self._synced: set[str] = set()
        self._sync_lock = asyncio.Lock()
        self.stuck: Callable[[Overrun], None] = log_stuck
        """Called from the watchdog's thread when an attempt still runs the stop timeout after its
        timeout: logs a critical error here (an app's host); ``workqueue work`` exits 70."""
        self.watchdog = Watchdog(lambda overrun: self.stuck(overrun))
        self.fake: Any = None
        """The test fake while ``queue.fake()`` is active: dispatches are recorded, not queued."""
        self.schedules = Schedules(self)
        self.failed = FailedJobs(self)
        self._emitting = TaskScope("workqueue-job-events")
        self._stop_timeout: float | None = None
        self._watcher: UnwatchedQueues | None = None
        self.local_statuses = LocalStatuses()
        """Sync mode: the statuses of the jobs run in this process (the newest ones)."""
        self.owners = QueueOwners(self)
        """Which job queues are this app's, and which this process leaves as another app's."""
        kernel.taken_back_listeners.append(self._taken_back)

    # -- events ------------------------------------------------------------------------------

    def emit_soon(self, event: Any) -> None:
        """Calls the listeners of ``event`` in a task of their own (from a settle's callback)."""
        self._emitting.spawn(self.events.emit(event), name="workqueue-job-event")

    def _taken_back(self, taken_back: Sequence[TakenBack]) -> None:
        """Emits the event of each job whose lease this process's sweeper took back (its worker
        stopped: :mod:`.taken_back`), when the queue has listeners."""
        if not self.events:
            return
        jobs = [(item, queue) for item in taken_back if (queue := queue_of(item.subscription)) is not None]
        if jobs:  # (one task a pass: a pass may take back a thousand)
            self._emitting.spawn(self._emit_taken_back(jobs), name="workqueue-job-event")

    async def _emit_taken_back(self, jobs: list[tuple[TakenBack, str]]) -> None:
        """Reads the deliveries a few at a time and emits the event of each job this app declares
        (the sweep is the database's: with two apps on one database, it takes back the other app's
        leases too, whose events are not this app's to hear)."""
        transport = self.kernel.transport
        for start in range(0, len(jobs), TAKEN_BACK_READS):
            chunk = jobs[start:start + TAKEN_BACK_READS]
            infos = await asyncio.gather(*(transport.get_delivery(item.delivery_id, include_payload=True)
                                           for item, _ in chunk), return_exceptions=True)
            for (item, queue), info in zip(chunk, infos, strict=True):
                if isinstance(info, BaseException):
                    log.warning("the event of job delivery %s, whose lease the sweeper took back (%s), was not "
                                "emitted: the store did not answer (%s)", item.delivery_id, item.result, info)
                    continue
                if info is None:
                    continue
                event = taken_back_event(item, info, queue)
                if self.registry.find(event.job) is not None:
                    self.emit_soon(event)

    async def drain_events(self) -> None:
        """Waits for the listeners still running (the queue's close)."""
        await self._emitting.join()

    # -- beside a worker ---------------------------------------------------------------------

    def watch_queues(self, host: Host, queues: str | None) -> None:
        """Starts the warning about jobs ready on queues that the strict list ``queues`` (the host's
        job group) leaves out; it looks while the host runs no job. The host is the one
        re-planned when a queue is left as another app's (:class:`.queue_owners.QueueOwners`)."""
        self.owners.watch(host)

        def idle() -> bool:
            consumer = host.group_consumers.get(GROUP_NAME)
            return consumer is None or consumer.held == 0

        if self._watcher is None:
            self._watcher = UnwatchedQueues(self, parse_queues(queues), idle=idle)
            self._watcher.start()  # (a list with * leaves nothing out: no task starts)

    def groups(self, queues: str | None = None, concurrency: int | None = None) -> list[GroupPlan]:
        """The consumer of the job queues, none while no job is declared: ``queues`` (``mail,*``;
        default ``WORKQUEUE_JOB_QUEUES``, unset: every queue fairly) at ``concurrency`` (default
        ``WORKQUEUE_JOB_CONCURRENCY``)."""
        if not len(self.registry):
            return []
        settings = self.kernel.settings
        spec = queues if queues is not None else settings.job_queues
        self.owners.named.update(q for q in parse_queues(spec) if q != OTHERS)
        return [job_group(spec, concurrency or settings.job_concurrency, leaves=self.owners.leaves)]

    async def stop_watching(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            await watcher.stop()
        await self.owners.close()

    # -- settings ----------------------------------------------------------------------------

    @property
    def lease_seconds(self) -> float:
        return float(self.kernel.settings.job_lease_seconds)

    @property
    def stop_timeout(self) -> float:
        """Seconds a job that ran past its timeout has to stop before the worker ends (exit 70)."""
        if self._stop_timeout is not None:
            return self._stop_timeout
        return self.kernel.settings.shutdown_drain_ms / 1000

    @stop_timeout.setter
    def stop_timeout(self, seconds: float) -> None:
        self._stop_timeout = seconds

    @property
    def sync(self) -> bool:
        return self.kernel.settings.jobs_mode == "sync"

    def cipher(self) -> PayloadCipher | None:
        if not self._cipher_loaded:
            settings = self.kernel.settings
            key = settings.app_key.get_secret_value() if settings.app_key is not None else None
            previous = settings.previous_keys.get_secret_value() if settings.previous_keys is not None else None
            self._cipher = cipher_from(key, previous)
            self._cipher_loaded = True
        return self._cipher

    def check(self) -> None:
        """What must hold before the app starts: a key for encrypted jobs (raises ConfigurationError)."""
        encrypted = sorted(job.name for job in self.registry if job.encrypted)
        if encrypted and self.cipher() is None:
            raise ConfigurationError(
                f"job(s) {', '.join(repr(n) for n in encrypted)} are declared encrypted=True but no app key is set: "
                "set WORKQUEUE_APP_KEY (a Fernet key; WorkQueueSettings(app_key=...)); make one with "
                'python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"'
            )

    # -- declaration -------------------------------------------------------------------------

    def declare(self, name: str, **options: Any) -> Callable[[Any], Any]:
        """``@queue.job(name, tries=, backoff=, timeout=, queue=, encrypted=, middleware=[...])``."""
        check_job_name(name)

        def register(func: Any) -> Any:
            job = define_job(name, func, **options)
            self.check_queue_limits(job)
            self.registry.add(job)
            try:
                self.kernel.prepare_dependencies(job.key, job.func, job.dependency_params)
            except ConfigurationError:
                self.registry.remove(job.name)
                raise
            self.declare_queue(job.policy.queue)
            return func

        return register

    def app_needed(self) -> str | None:
        """Where a job's dependencies take a Request (so the job needs to run with the app), or None."""
        for job in self.registry:
            where = self.kernel.app_needed_by(job.key)
            if where is not None:
                return where
        return None

    def check_queue_limits(self, job: Job) -> None:
        """A job's limits (``concurrency``, ``rate_limit``) are its queue's: a job that declares
        others than one already on the queue is refused (ConfigurationError), naming both."""
        limits = job.policy.queue_limits
        if not limits:
            return
        for other in self.registry:
            if other.name == job.name or other.policy.queue != job.policy.queue:
                continue
            theirs = other.policy.queue_limits
            if theirs and theirs != limits:
                raise ConfigurationError(
                    f"jobs {other.name!r} and {job.name!r} run on queue {job.policy.queue!r} with different limits "
                    f"({_limits_text(other)} and {_limits_text(job)}): a queue's limits hold for every job on it; "
                    f"put one of them on a queue of its own (queue='...'), or declare the same limits"
                )

    def queue_limits(self, name: str) -> dict[str, int | str]:
        """The limits the jobs of queue ``name`` declare (the first job that declares any)."""
        job: Job
        for job in self.registry:
            if job.policy.queue == name and job.policy.queue_limits:
                return job.policy.queue_limits
        return {}

    def declare_queue(self, name: str) -> None:
        """Adds the topic and subscription of job queue ``name`` to the queue's topology, with the
        limits its jobs declare (a queue declared before one of its jobs declared limits takes them)."""
        check_queue_name(name)
        topic = topic_of(name)
        if topic in self.kernel.topics:
            known = self.kernel.subscriptions.get(topic)
            wanted = self.subscription_for(name)
            if known is not None and known.handler_key == JOBS_HANDLER and known.flow_limits() != wanted.flow_limits():
                self.kernel.subscriptions[topic] = wanted
                self._synced.discard(topic)
            return
        self.kernel.add_topic(Topic(name=topic))
        self.kernel.add_subscription(self.subscription_for(name))
        if self.kernel.resolve_handler(JOBS_HANDLER) is None:
            self.kernel.add_handler(JOBS_HANDLER, self.runner.run)

    def subscription_for(self, name: str) -> Subscription:
        topic = topic_of(name)
        return Subscription(name=topic, topic=topic, handler_key=JOBS_HANDLER, lease_seconds=self.lease_seconds,
                            max_attempts=DEFAULT_TRIES, **self.queue_limits(name))

    async def ensure_queue(self, name: str) -> str:
        """The topic of job queue ``name``, declared and written to the store (once per process)."""
        topic = topic_of(name)
        if topic in self._synced:  # declared and in the store already: the common case, at every dispatch
            return topic
        self.declare_queue(name)
        if self.kernel.is_open:
            async with self._sync_lock:
                if topic not in self._synced:
                    await self.kernel.transport.sync_topology([self.kernel.topics[topic]],
                                                             [self.kernel.subscriptions[topic]])
                    self._synced.add(topic)
        return topic

    def mark_synced(self) -> None:
        """The queue's open() wrote the declared topology: every declared job queue is in the store."""
        self._synced.update(t for t in self.kernel.topics if queue_of(t) is not None)

    # -- building messages -------------------------------------------------------------------

    def seal(self, job: Job, data: Any) -> tuple[Any, str | None]:
        """(payload, encrypted token) for the envelope of ``job``."""
        if not job.encrypted:
            return data, None
        cipher = self.cipher()
        if cipher is None:
            raise ConfigurationError(
                f"job {job.name!r} is encrypted=True but no app key is set: set WORKQUEUE_APP_KEY"
            )
        return None, cipher.encrypt(data)

    def unique_key(self, job: Job, unique: str) -> str:
        """The stored unique key of a dispatch: ``<job>:<key>``; for an encrypted job the key is a
        keyed hash under the app key (``<job>:hmac-sha256:<hex>``), so it is not stored in clear and
        equal keys still meet in every process that has the same WORKQUEUE_APP_KEY."""
        if not job.encrypted:
            stored = f"{job.name}:{unique}"
            if len(stored) > MAX_KEY_LENGTH:  # (refused as this key, not as the stored one the caller never set)
                raise ValueError(f"unique is {len(unique)} characters; for job {job.name!r} at most "
                                 f"{MAX_KEY_LENGTH - len(job.name) - 1} are allowed (the key is stored after the job's "
                                 "name); pass a shorter key, or a hash of it")
            return stored
        cipher = self.cipher()
        if cipher is None:
            raise ConfigurationError(
                f"job {job.name!r} is encrypted=True but no app key is set: set WORKQUEUE_APP_KEY"
            )
        return f"{job.name}:hmac-sha256:{cipher.digest(unique)}"

    def open_payload(self, job: Job, envelope: JobEnvelope) -> Any:
        """The stored payload in the clear (decrypted for an encrypted job)."""
        if not job.encrypted:
            return envelope.payload
        cipher = self.cipher()
        if cipher is None:
            raise PayloadUndecryptable("the job is encrypted=True but this process has no WORKQUEUE_APP_KEY")
        return cipher.decrypt(envelope.encrypted)

    def request(
        self,
        job: Job,
        data: Any,
        *,
        job_id: uuid.UUID | None = None,
        delay: float | None = None,
        tries: int | None = None,
        backoff: Sequence[float] | None = None,
        timeout: float | None = None,
        unique: str | None = None,
        unique_until: UniqueUntil = "done",
        unique_for: float = DEFAULT_UNIQUE_FOR,
        chain: Sequence[ChainLink] = (),
        group: uuid.UUID | None = None,
        not_before: datetime | None = None,
        priority: int | None = None,
    ) -> PublishRequest:
        payload, encrypted = self.seal(job, data)
        policy = job.policy
        backoff = policy.backoff if backoff is None else backoff
        envelope = JobEnvelope(
            job=job.name, payload=payload, encrypted=encrypted,
            timeout=policy.timeout if timeout is None else timeout,
            unique_key=None if unique is None else self.unique_key(job, unique),
            unique_until=None if unique is None else unique_until, chain=tuple(chain), group=group,
        )
        fields: dict[str, Any] = {"attributes": {JOB_ATTRIBUTE: job.name}, "payload": envelope.to_json(),
                                  "max_attempts": tries or policy.tries}
        # Only the fields a job sets: each one given is one more for the model to validate.
        if job_id is not None:
            fields["message_id"] = job_id
        if delay is not None:
            fields["delay_seconds"] = delay
        if not_before is not None:
            fields["not_before"] = not_before
        if backoff is not None:
            fields["backoff_seconds"] = list(backoff)
        if unique is not None:
            fields["deduplication_key"] = envelope.unique_key
            fields["deduplication_ttl_seconds"] = unique_for
        chosen = policy.priority if priority is None else priority
        if chosen:
            fields["priority"] = chosen
        return PublishRequest(**fields)

    def link(self, job: Job, data: Any, queue: str | None = None, priority: int | None = None,
             delay: float | None = None) -> ChainLink:
        payload, encrypted = self.seal(job, data)
        policy = job.policy
        return ChainLink(job=job.name, id=uuid7(), queue=queue or policy.queue, tries=policy.tries,
                         backoff=policy.backoff, timeout=policy.timeout, payload=payload, encrypted=encrypted,
                         priority=policy.priority if priority is None else priority, delay=delay)

    def message(self, job: Job, payload: Any, encrypted: str | None, *, max_envelope_bytes: int,
                delay: float | None = None, unique: str | None = None, unique_until: UniqueUntil = "done",
                ttl: float | None = None, priority: int = 0) -> PreparedMessage:
        """``prepare(self.request(...))`` of a sealed payload (see :meth:`seal`) without building the
        request, for ``delay`` and ``ttl`` already checked (:func:`_seconds`, :func:`_ttl`); raises
        :class:`RequestRejected`."""
        policy = job.policy
        key = None if unique is None else self.unique_key(job, unique)
        envelope: Any = None
        encoded = None
        if encrypted is None and policy.timeout is None and key is None:
            encoded = plain_envelope_json(job.name, payload)  # (the common job: one encoding, of its payload)
        else:
            envelope = envelope_json(job.name, payload, encrypted, policy.timeout, key,
                                     None if unique is None else unique_until)
        return prepare_parts(
            envelope, {JOB_ATTRIBUTE: job.name}, deduplication_key=key, deduplication_ttl_seconds=ttl,
            delay_seconds=delay, max_attempts=policy.tries,
            backoff_seconds=None if policy.backoff is None else list(policy.backoff),
            max_envelope_bytes=max_envelope_bytes, encoded=encoded, priority=priority,
        )

    async def _send(self, topic: str, entries: list[_Entry], session: Any, *, unique: str | None = None,
                    unique_until: UniqueUntil = "done", ttl: float | None = None) -> list[PublishResult]:
        """Publishes checked jobs to ``topic`` as ``queue.publish`` of their requests would."""
        cap = self.kernel.envelope_cap(topic)
        message = self.message

        def make(index: int) -> PreparedMessage:
            job, _, _, payload, encrypted, delay, priority = entries[index]
            return message(job, payload, encrypted, delay=delay, unique=unique, unique_until=unique_until,
                           ttl=ttl, max_envelope_bytes=cap, priority=priority)

        return await self.kernel.publish_each(topic, len(entries), make, session=session)

    def next_request(self, envelope: JobEnvelope) -> tuple[str, PublishRequest] | None:
        """The next job of a chain (queue, request), carrying the rest of the chain."""
        if not envelope.chain:
            return None
        first, rest = envelope.chain[0], envelope.chain[1:]
        following = JobEnvelope(job=first.job, payload=first.payload, encrypted=first.encrypted,
                                timeout=first.timeout, chain=rest)
        return first.queue, PublishRequest(
            message_id=first.id, attributes={JOB_ATTRIBUTE: first.job}, payload=following.to_json(),
            max_attempts=first.tries, backoff_seconds=None if first.backoff is None else list(first.backoff),
            priority=first.priority, delay_seconds=first.delay,
        )

    def completion(self, envelope: JobEnvelope, result: str | None = None,
                   frees: tuple[tuple[str, str, uuid.UUID], ...] = ()) -> WorkOutcome:
        """Complete, with the chain's next job queued, ``result`` (a stored result's text) kept and
        the unique keys ``frees`` names freed in the same transaction."""
        following = self.next_request(envelope)
        if following is None:
            return Outcome.complete(result=result, frees=frees)
        queue, request = following
        return Outcome.complete(then=[FollowUp(topic_of(queue), [prepare(request)])], result=result, frees=frees)

    def result_text(self, job: Job, value: Any) -> str:
        """The stored text of what ``job`` (declared ``store_result=True``) returned; raises
        :class:`~.results.ResultNotStorable`."""
        return encode_result(job, value, self.cipher() if job.encrypted else None)

    # -- dispatch ----------------------------------------------------------------------------

    async def dispatch(
        self,
        job: Any,
        payload: Any = None,
        *,
        delay: timedelta | float | None = None,
        queue: str | None = None,
        unique: str | None = None,
        unique_until: UniqueUntil = "done",
        unique_for: float = DEFAULT_UNIQUE_FOR,
        debounce: timedelta | float | None = None,
        debounce_key: str | None = None,
        session: Any = None,
        priority: int | None = None,
    ) -> uuid.UUID | None:
        """Validates ``payload``, queues the job and returns its id (None: ``unique`` key held).
        ``debounce`` with ``debounce_key``: see :mod:`.debounce`. ``priority`` (0 to 9) replaces the
        job's declared priority for this dispatch."""
        definition = self.registry.resolve(job)
        chosen = definition.policy.priority if priority is None else check_priority(priority)
        window = debounce_window(debounce, debounce_key, unique=unique, delay=delay)
        if window is not None:
            assert debounce_key is not None
            return await self._debounced(definition, payload, queue, window, debounce_key, session, chosen)
        if unique_until not in ("done", "processing"):
            raise ValueError(f"unique_until must be 'done' or 'processing', got {unique_until!r}")
        if unique is not None and not (isinstance(unique, str) and unique):
            raise ValueError(f"unique must be a non-empty string key, got {unique!r}")
        if isinstance(unique_for, bool) or not isinstance(unique_for, int | float) \
                or not 0 < unique_for <= MAX_DELAY_SECONDS:  # (NaN too)
            raise ValueError(f"unique_for must be a number of seconds above 0 and at most {MAX_DELAY_SECONDS:.0f} "
                             f"(100 years), got {unique_for!r}")
        data = definition.validate(payload)
        target = check_queue_name(queue) if queue is not None else definition.policy.queue
        seconds = _seconds(delay)
        if self.fake is not None or self.sync:
            request = self.request(definition, data, delay=seconds, unique=unique, unique_until=unique_until,
                                   unique_for=unique_for, priority=chosen)
            if self.fake is not None:
                recorded: uuid.UUID | None = self.fake.record(definition, data, target, request, unique=unique,
                                                              session=session)
                return recorded
            return await self.run_now(definition, target, prepare(request))
        sealed, encrypted = self.seal(definition, data)
        ttl = None if unique is None else _ttl(unique_for)
        topic = topic_of(target)
        if topic not in self._synced:  # (else in the store already: the common case, without a coroutine)
            topic = await self.ensure_queue(target)
        entries: list[_Entry] = [(definition, target, data, sealed, encrypted, seconds, chosen)]
        if unique is None:
            [result] = await self._send(topic, entries, session)
        else:
            result = await self._dispatch_unique(topic, entries, self.unique_key(definition, unique), unique,
                                                 unique_until, ttl, session)
        if result.status == PublishStatus.DUPLICATE and unique is not None:
            return None
        if not result.ok or result.message_id is None:
            raise JobDispatchError(definition.name, result)
        return result.message_id

    async def _dispatch_unique(self, topic: str, entries: list[_Entry], key: str, unique: str,
                               unique_until: UniqueUntil, ttl: float | None, session: Any) -> PublishResult:
        """Publishes a unique job. A key still held by a job that has ended (discarded or cancelled
        by an operator, or failed by the sweeper or the store: paths that do not pass through the
        job's own runner) is freed and the job published again, in the same transaction."""
        async def send(tx: Any) -> PublishResult:
            [sent] = await self._send(topic, entries, tx, unique=unique, unique_until=unique_until, ttl=ttl)
            return sent

        result = await self._publish(send, session, retry_in_savepoint=True)
        holder = result.message_id
        if result.status != PublishStatus.DUPLICATE or holder is None or not await self._ended(holder):
            return result
        transport = self.kernel.transport

        async def free_and_send(tx: Any) -> PublishResult:
            await transport.release_deduplication_key(topic, key, holder, session=tx)
            return await send(tx)

        return await self._publish(free_and_send, session, retry_in_savepoint=True)

    async def _ended(self, job_id: uuid.UUID) -> bool:
        """Whether job ``job_id`` has ended: every delivery of its message settled (a job the
        store does not show, perhaps one of the caller's own transaction, has not)."""
        deliveries = await self.kernel.transport.message_deliveries(job_id)
        return bool(deliveries) and all(d.status in _ENDED for d in deliveries)

    async def _debounced(self, definition: Job, payload: Any, queue: str | None, window: float, key: str,
                         session: Any, priority: int) -> uuid.UUID:
        data = definition.validate(payload)
        target = check_queue_name(queue) if queue is not None else definition.policy.queue
        request = self.request(definition, data, priority=priority)
        if self.fake is not None:
            recorded: uuid.UUID = self.fake.record_debounced(definition, data, target, request,
                                                             debounce_key=stored_key(self, definition, key),
                                                             window=window, session=session)
            return recorded
        if self.sync:  # (the window is not waited for, as a delay is not)
            return await self.run_now(definition, target, prepare(request))
        return await dispatch_debounced(self, definition, request, target, window, key, session)

    async def bulk(self, items: Iterable[tuple[Any, Any]], *, session: Any = None) -> list[uuid.UUID]:
        """Queues several jobs in one transaction; every payload is checked before any is queued."""
        entries: list[_Entry] = []
        resolve, seal = self.registry.resolve, self.seal
        last: Any = _NOTHING
        definition: Job | None = None
        for item in items:
            if type(item) is tuple and len(item) == 2:  # (job, payload): the common item, read directly
                job, payload = item
                options: dict[str, Any] = {}
            else:
                job, payload, options = _item(item)
            if job is not last:  # (the same job item after item: resolved once)
                definition, last = resolve(job), job
            assert definition is not None
            try:
                data = definition.validate(payload)
            except JobPayloadInvalid as exc:  # (which of the items: nothing is queued)
                raise JobPayloadInvalid(definition.name, f"bulk item {len(entries)}: {exc.errors}") from None
            target = check_queue_name(options.get("queue") or definition.policy.queue) if options \
                else definition.policy.queue
            if definition.encrypted:
                sealed, encrypted = seal(definition, data)
            else:
                sealed, encrypted = data, None
            priority = definition.policy.priority
            if options and options.get("priority") is not None:
                priority = check_priority(options["priority"])
            entries.append((definition, target, data, sealed, encrypted,
                            _seconds(options.get("delay")) if options else None, priority))
        if not entries:
            return []
        if self.fake is not None:
            return [self.fake.record(d, data, q, self.request(d, data, delay=delay, priority=p), session=session)
                    for d, q, data, _, _, delay, p in entries]
        if self.sync:
            return [await self.run_now(d, q, prepare(self.request(d, data, delay=delay, priority=p)))
                    for d, q, data, _, _, delay, p in entries]
        by_topic: dict[str, list[int]] = {}
        topics: dict[str, str] = {}
        for index, entry in enumerate(entries):
            target = entry[1]
            topic = topics.get(target)
            if topic is None:
                topic = topics[target] = await self.ensure_queue(target)
            by_topic.setdefault(topic, []).append(index)
        ids: list[uuid.UUID | None] = [None] * len(entries)

        async def publish_all(tx: Any) -> None:
            for topic, indexes in by_topic.items():
                chosen = entries if len(indexes) == len(entries) else [entries[i] for i in indexes]
                results = await self._send(topic, chosen, tx)
                refused = [(index, result) for index, result in zip(indexes, results, strict=True)
                           if not result.ok or result.message_id is None]
                if refused:  # (the item that was refused, not the first of those it aborted)
                    index, result = next(((i, r) for i, r in refused
                                          if r.error is None or r.error.code != "BatchAborted"), refused[0])
                    raise JobDispatchError(entries[index][0].name, result, item=index)
                for index, result in zip(indexes, results, strict=True):
                    ids[index] = result.message_id

        await self._in_one_transaction(publish_all, session, several=len(by_topic) > 1)
        return [i for i in ids if i is not None]

    async def chain(self, items: Iterable[tuple[Any, Any]], *, session: Any = None) -> list[uuid.UUID]:
        """Queues the first job now; each next one is queued in the transaction that completes the
        one before. Every payload is checked first. Returns the ids of all of them. A step's
        ``delay`` counts from when it is queued (the first: now; a next one: once the one before
        succeeded)."""
        steps = []
        for item in items:
            job, payload, options = _item(item)
            definition = self.registry.resolve(job)
            priority = options.get("priority")
            steps.append((definition, definition.validate(payload), options.get("queue"),
                          None if priority is None else check_priority(priority), _seconds(options.get("delay"))))
        if not steps:
            return []
        links = [self.link(d, data, q, p, delay) for d, data, q, p, delay in steps[1:]]
        first, data, queue, priority, delay = steps[0]
        target = check_queue_name(queue or first.policy.queue)
        request = self.request(first, data, job_id=uuid7(), chain=links, priority=priority, delay=delay)
        ids = [request.message_id, *(link.id for link in links)]
        if self.fake is not None:
            self.fake.record(first, data, target, request, session=session)
            return [i for i in ids if i is not None]
        if self.sync:
            await self.run_now(first, target, prepare(request))
            return [i for i in ids if i is not None]
        topic = await self.ensure_queue(target)
        for link in links:
            await self.ensure_queue(link.queue)
        [result] = await self._publish(lambda tx: self.kernel.publish(topic, [request], session=tx), session)
        if not result.ok:
            raise JobDispatchError(first.name, result)
        return [i for i in ids if i is not None]

    async def size(self, queue: str | None = None) -> int:
        """Jobs that wait or run on ``queue`` (on every job queue when None)."""
        names = [topic_of(check_queue_name(queue))] if queue is not None else None
        total = 0
        for stats in await self.kernel.operator.stats():
            if queue_of(stats.subscription) is None or (names is not None and stats.subscription not in names):
                continue
            total += stats.pending + stats.in_flight
        return total

    # -- publishing --------------------------------------------------------------------------

    async def publish_in(self, send: Callable[[Any], Awaitable[T]], session: Any) -> T:
        """``send(tx)`` in the caller's transaction (``session``, or the request's), retried in a
        savepoint when the store asks to try again (a key another transaction took at once)."""
        return await self._publish(send, session, retry_in_savepoint=True)

    async def _publish(
        self, send: Callable[[Any], Awaitable[T]], session: Any, *, retry_in_savepoint: bool = False
    ) -> T:
        """``send(tx)`` in the caller's transaction (retried in a savepoint for a unique key)."""
        tx = self.kernel.sessions.resolve(session)
        if tx is None or not retry_in_savepoint or not self.kernel.transport.capabilities.savepoint_retry:
            return await send(tx)  # (SQLite: its single writer serializes the dispatchers already)
        # A unique key dispatched at once by another transaction: the store asks to try again. A
        # savepoint keeps the caller's transaction usable, and the second try sees the key held.
        for attempt in range(1, UNIQUE_RETRIES + 1):
            try:
                async with _savepoint(tx):
                    return await send(tx)
            except TransportError as exc:
                if not exc.retryable or attempt == UNIQUE_RETRIES:
                    raise
                await asyncio.sleep(0.02 * attempt)
        raise AssertionError("unreachable")

    async def _in_one_transaction(self, work: Callable[[Any], Any], session: Any, *, several: bool) -> None:
        tx = self.kernel.sessions.resolve(session)
        if tx is not None or not several:
            await work(tx)
            return
        async with self.kernel.sessions.sessionmaker() as own, own.begin():
            await work(own)

    async def in_one_transaction(self, work: Callable[[Any], Any], session: Any) -> None:
        """``work(tx)``: several writes in the caller's transaction, or in one of their own (a
        store without a caller's transaction, the memory transport, runs them one after the other)."""
        await self._in_one_transaction(work, session,
                                       several=self.kernel.transport.capabilities.transactional_publish)

    # -- groups ------------------------------------------------------------------------------

    async def group(self, items: Iterable[Any], *, then: Any, session: Any = None) -> JobGroup:
        """Queues ``items`` (``(job, payload)`` or ``(job, payload, {"queue": ...})``) and ``then``,
        which runs once every member ended (see :mod:`.groups`)."""
        return await make_group(self, items, then, session)

    async def group_results(self, group_id: uuid.UUID) -> list[JobStatus]:
        """The status of each member of a group, in order (the ``then`` job's ``job.group_results``)."""
        return await group_results(self, group_id)

    async def run_group_now(self, members: list[tuple[str, PreparedMessage]], then: tuple[str, PreparedMessage],
                            group: JobGroup) -> None:
        """Sync mode: runs a group's members and then its ``then`` job, before ``group`` returns."""
        from .local import LocalRun

        run = LocalRun(self, once_store=self.kernel.transport)
        try:
            await run.run_group(members, then, group.id, list(group.member_ids))
        finally:
            self.local_statuses.update(await run.statuses())

    async def reencrypt(self, *, page: int = 500) -> int:
        """Encrypts the payloads of waiting and failed encrypted jobs again with the current key
        (after a key rotation, before an old key is dropped from WORKQUEUE_PREVIOUS_KEYS). A job
        that runs meanwhile keeps its payload; run it again later. A job that no key decrypts is
        left as it is and named in a warning. Returns how many it rewrote."""
        cipher = self.cipher()
        if cipher is None:
            raise ConfigurationError("reencrypting needs the app key: set WORKQUEUE_APP_KEY")
        transport = self.kernel.transport
        rewritten = 0
        undecryptable: list[str] = []
        for sub in await transport.list_subscriptions():
            if queue_of(sub.name) is None:
                continue
            for status in ("Pending", "DeadLettered"):
                after: str | None = None
                while True:
                    infos = await transport.list_deliveries(sub.name, status, limit=page, after=after,
                                                            include_payload=True)
                    for info in infos:
                        try:
                            if await self._reencrypt_one(cipher, info):
                                rewritten += 1
                        except PayloadUndecryptable:
                            undecryptable.append(str(info.message_id))
                    if len(infos) < page:
                        break
                    after = infos[-1].delivery_id
        if undecryptable:
            log.warning(
                "reencrypt: %d job(s) that no key decrypts were left as they are (they fail at once when they "
                "run; add the key they were encrypted with to WORKQUEUE_PREVIOUS_KEYS, or forget them): %s",
                len(undecryptable), ", ".join(undecryptable[:20]) + (" …" if len(undecryptable) > 20 else ""),
            )
        return rewritten

    async def _reencrypt_one(self, cipher: PayloadCipher, info: Any) -> bool:
        try:
            envelope = JobEnvelope.from_json(info.payload)
        except ValueError:
            return False
        if envelope.encrypted is None and not envelope.chain:
            return False
        links = tuple(
            link if link.encrypted is None else replace(link, encrypted=cipher.rotate(link.encrypted))
            for link in envelope.chain
        )
        fresh = replace(envelope, encrypted=None if envelope.encrypted is None else cipher.rotate(envelope.encrypted),
                        chain=links)
        if fresh == envelope:
            return False
        prepared = prepare(PublishRequest(message_id=info.message_id, partition_key=info.partition_key,
                                          attributes=info.attributes or {}, payload=fresh.to_json(),
                                          correlation_id=info.correlation_id))
        done: bool = await self.kernel.transport.rewrite_payload(
            info.message_id, prepared.payload_json, prepared.content_hash, prepared.envelope_bytes
        )
        return done

    async def release_unique(self, queue: str, key: str, job_id: uuid.UUID) -> None:
        """Frees a unique key this job holds (a key held by a later job stays)."""
        if self.fake is not None:
            return
        with contextlib.suppress(Exception):  # at worst the key expires after unique_for
            await self.kernel.transport.release_deduplication_key(topic_of(queue), key, job_id)

    # -- status ------------------------------------------------------------------------------

    async def status(self, job_id: uuid.UUID | str, *, reveal_encrypted: bool = True) -> JobStatus | None:
        """The status of job ``job_id``, or None when no job has that id (never dispatched, or
        purged with the retention). ``reveal_encrypted=False`` leaves an encrypted job's result out
        (the REST API)."""
        job_id = as_job_id(job_id)
        if self.fake is not None:
            found: JobStatus | None = self.fake.status(job_id)
            return found
        if self.sync:
            return self.local_statuses.get(job_id)
        ports = self.kernel.ports
        if ports.state is None:
            raise ConfigurationError(MESSAGE_STATE_NEEDED)
        return await read_status(job_id, self.kernel.transport, ports.state, ports.attempts, self.cipher(),
                                 reveal_encrypted=reveal_encrypted)

    # -- running in this process -------------------------------------------------------------

    async def run_now(self, job: Job, queue: str, message: PreparedMessage) -> uuid.UUID:
        """Sync mode: runs the job at its dispatch, before the dispatch returns (see :mod:`.local`)."""
        from .local import LocalRun

        run = LocalRun(self, once_store=self.kernel.transport)
        try:
            await run.run_until_done(queue, message)
        finally:
            self.local_statuses.update(await run.statuses())
        return message.message_id

    def caller(self, job: Job, payload: Any, job_context: JobContext, message: WorkMessage[Any],
               context: WorkContext) -> Callable[[], Any]:
        """The call of the job's function with its payload, context and dependencies."""
        fixed: dict[str, Any] = {}
        if job.payload_param is not None:
            fixed[job.payload_param] = payload
        if job.context_param is not None:
            fixed[job.context_param] = job_context

        if not job.dependency_params:  # nothing to solve: the function itself, called with what it takes
            func = job.func

            async def call_plain() -> Any:
                return await func(**fixed)

            return call_plain

        async def call() -> Any:
            return await self.kernel.call_with_dependencies(job.key, job.func, fixed, message, context)

        return call

    async def once_state(self, key: str) -> str:
        """Where ``job.once``'s marker ``key`` stands, without taking it: ``Done``, ``Busy`` or ``Free``
        (in the store, or in the fake's memory under ``queue.fake()``)."""
        return await self.locks.state(key)

    async def _once_begin(self, key: str, seconds: float) -> tuple[str, str | None]:
        return await self.kernel.transport.once_begin(key, seconds)

    async def _once_abort(self, key: str, token: str) -> bool:
        return await self.kernel.transport.once_abort(key, token)

    async def _once_renew(self, key: str, token: str, seconds: float) -> bool:
        return await self.kernel.transport.once_renew(key, token, seconds)


def _item(item: Any) -> tuple[Any, Any, dict[str, Any]]:
    if not isinstance(item, tuple | list) or len(item) not in (2, 3):
        raise TypeError(
            f"each item is (job, payload) or (job, payload, {{'queue': ..., 'delay': ..., 'priority': ...}}), "
            f"got {item!r}"
        )
    options = dict(item[2]) if len(item) == 3 else {}
    unknown = set(options) - {"queue", "delay", "priority"}
    if unknown:
        raise TypeError(
            f"unknown options {sorted(unknown)} for a job in bulk() or chain(); use queue, delay and priority"
        )
    return item[0], item[1], options


def _limits_text(job: Job) -> str:
    policy = job.policy
    parts = [f"concurrency={policy.concurrency}" if policy.concurrency is not None else "",
             f"rate_limit={policy.rate_limit!r}" if policy.rate_limit is not None else ""]
    return ", ".join(p for p in parts if p) or "none"


@contextlib.asynccontextmanager
async def _savepoint(tx: Any) -> Any:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(tx, AsyncSession | AsyncConnection):
        async with tx.begin_nested():
            yield
    else:
        yield


def log_stuck(overrun: Overrun) -> None:
    """The ``stuck`` policy of an app's own host: a critical error, logged from the watchdog's thread
    (it is heard while the job blocks the event loop). The app server goes on: ending it would
    surprise; ``workqueue work`` workers end with exit code 70 instead."""
    log.critical(
        "job %s (%s) is still running %g s after its timeout of %g s: it blocks the event loop or swallowed "
        "the cancellation. Requests and other jobs of this process wait while the loop is blocked, and once "
        "the job's lease runs out another worker may run it at the same time. This process (an app's host) "
        "goes on; run timed jobs in `workqueue work` workers, which end with exit code 70 here, and make the "
        "job await (asyncio.to_thread for blocking calls) or stop when job.signal aborts",
        overrun.job.name, overrun.context.id, overrun.stop_timeout, overrun.timeout,
    )
