"""The test fake: ``with queue.fake() as fake:`` records dispatches instead of queuing them.

Every dispatch is checked as a real one is (the payload against its type, the envelope's limits,
the app key of an encrypted job) and, inside a transaction, recorded only when that transaction
commits: a rolled-back dispatch is not there. ``await fake.work()`` then runs what was recorded,
in the test's process, by the real consumer over an in-memory store (:mod:`.local`) (dependencies and the app's
``dependency_overrides`` included, chains continued), and returns the counts.

The app whose overrides apply is the one given (``queue.fake(app=app)``), else the one app alive
in the process that serves the queue (:mod:`fastapi_workqueue.web.serving_apps`: its lifespan is the queue's, or it
includes the queue's routers), found also when its lifespan never ran (``httpx.ASGITransport``),
else the app a lifespan bound.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..core.envelope import PreparedMessage, PublishRequest, prepare
from ..core.errors import ConfigurationError
from ..core.memory import MemoryTransport
from ..core.redaction import redacting_logger
from ..web.serving_apps import apps_of
from .definition import Job
from .envelope import JobEnvelope
from .groups import JobGroup
from .local import JobCounts, LocalRun, memory_locks
from .status import JobStatus
from .steps import MemorySteps

if TYPE_CHECKING:
    from .layer import Jobs

log = redacting_logger("fastapi_workqueue.jobs")


@dataclass(frozen=True, slots=True)
class Dispatched:
    """One recorded dispatch."""

    job: str
    id: uuid.UUID
    queue: str
    payload: Any
    """The payload as the job's payload type."""
    delay_seconds: float | None = None
    unique: str | None = None
    debounce_seconds: float | None = None
    """The window of a debounced dispatch (its record shows the last payload dispatched)."""


class JobFake:
    """Records dispatches; asserts on them; runs them with :meth:`work`."""

    def __init__(self, jobs: Jobs, app: Any = None) -> None:
        self._jobs = jobs
        self._app = app
        """The app whose state and ``dependency_overrides`` jobs see in :meth:`work` (found when None)."""
        self.records: list[Dispatched] = []
        self._waiting: list[tuple[str, PreparedMessage]] = []
        self._held_unique: set[str] = set()
        self._steps = MemorySteps()
        self._once_store = MemoryTransport()  # job.once markers, kept while the fake lives
        self._locks = memory_locks()
        self._saved: tuple[Any, Any, Any] | None = None
        self._statuses: dict[uuid.UUID, JobStatus] = {}
        self._debounced: dict[uuid.UUID, str] = {}
        self._groups: dict[uuid.UUID, JobGroup] = {}
        """The group of each recorded ``then`` job, by its id."""
        self._told_no_app = False
        """The debounce key of each recorded debounced job, by id."""
        """What :meth:`work` made of each job it ran, by id."""

    # -- activation --------------------------------------------------------------------------

    def __enter__(self) -> JobFake:
        self._saved = (self._jobs.fake, self._jobs.steps, self._jobs.locks)
        self._jobs.schedules.forget_looks()  # (queue.run_schedules under this fake starts afresh)
        self._jobs.fake = self
        self._jobs.steps = self._steps
        self._jobs.locks = self._locks
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            self._jobs.fake, self._jobs.steps, self._jobs.locks = self._saved
            self._jobs.schedules.forget_looks()
            self._saved = None

    async def __aenter__(self) -> JobFake:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)

    # -- recording ---------------------------------------------------------------------------

    def record(self, job: Job, data: Any, queue: str, request: PublishRequest, *,
               unique: str | None = None, session: Any = None) -> uuid.UUID | None:
        """Checks a dispatch as the store would and records it (at the commit of its transaction)."""
        prepared = prepare(request)
        key = request.deduplication_key
        if key is not None and key in self._held_unique:
            return None
        entry = Dispatched(job=job.name, id=prepared.message_id, queue=queue, payload=job.load(data),
                           delay_seconds=request.delay_seconds, unique=unique)

        def keep() -> None:
            self.records.append(entry)
            self._waiting.append((queue, prepared))
            if key is not None:
                self._held_unique.add(key)

        if not _after_commit(keep, session):
            keep()
        return prepared.message_id

    def record_debounced(self, job: Job, data: Any, queue: str, request: PublishRequest, *, debounce_key: str,
                         window: float, session: Any = None) -> uuid.UUID:
        """Records a debounced dispatch: while a job dispatched with the same key waits for
        :meth:`work`, it takes this payload (one record, the last payload) and keeps its id."""
        for index, (waiting_queue, message) in enumerate(self._waiting):
            if waiting_queue == queue and self._debounced.get(message.message_id) == debounce_key:
                fresh = prepare(request.model_copy(update={"message_id": message.message_id}))
                self._waiting[index] = (queue, fresh)
                self.records[:] = [
                    replace(r, payload=job.load(data), debounce_seconds=window) if r.id == message.message_id else r
                    for r in self.records
                ]
                return message.message_id
        prepared = prepare(request)
        entry = Dispatched(job=job.name, id=prepared.message_id, queue=queue, payload=job.load(data),
                           debounce_seconds=window)

        def keep() -> None:
            self.records.append(entry)
            self._waiting.append((queue, prepared))
            self._debounced[prepared.message_id] = debounce_key

        if not _after_commit(keep, session):
            keep()
        return prepared.message_id

    def record_group(self, group: JobGroup, members: list[tuple[Job, str, PreparedMessage]],
                     then: tuple[Job, str, PreparedMessage], *, session: Any = None) -> None:
        """Records a group: its members as dispatches, then its ``then`` job (held: :meth:`work`
        runs it after the members, with their statuses in ``job.group_results``)."""
        entries = [(job, queue, message) for job, queue, message in [*members, then]]

        def keep() -> None:
            for job, queue, message in entries:
                envelope = JobEnvelope.from_json(_payload(message))
                self.records.append(Dispatched(job=job.name, id=message.message_id, queue=queue,
                                               payload=job.load(self._jobs.open_payload(job, envelope))))
                self._waiting.append((queue, message))
            self._groups[then[2].message_id] = group

        if not _after_commit(keep, session):
            keep()

    # -- assertions --------------------------------------------------------------------------

    def dispatched(self, job: Any) -> list[Any]:
        """The payloads ``job`` was dispatched with, in order, as the job receives them (instances of
        its payload model: ``dispatched(job)[0].user_id``)."""
        name = self._jobs.registry.resolve(job).name
        return [r.payload for r in self.records if r.job == name]

    def assert_dispatched(self, job: Any, times: int | None = None,
                          where: Callable[[Any], bool] | Mapping[str, Any] | None = None) -> None:
        """Fails unless ``job`` was dispatched (``times`` times, counting only the payloads that
        ``where`` accepts: a predicate on the payload, or a mapping of fields the payload must have,
        ``where={"user_id": 1}``)."""
        name = self._jobs.registry.resolve(job).name
        every = self.dispatched(job)
        payloads = [p for p in every if where is None or _matches(p, where)]
        if times is None and not payloads:
            raise AssertionError(f"job {name!r} was not dispatched{_matching(where)}; dispatched: {self._summary()}"
                                 f"{_payloads_of(name, every)}")
        if times is not None and len(payloads) != times:
            raise AssertionError(
                f"job {name!r} was dispatched {len(payloads)} time(s){_matching(where)}, expected {times}"
                f"{_payloads_of(name, every)}"
            )

    def assert_not_dispatched(self, job: Any) -> None:
        """Fails if ``job`` was dispatched at all."""
        name = self._jobs.registry.resolve(job).name
        count = len(self.dispatched(job))
        if count:
            raise AssertionError(f"job {name!r} was dispatched {count} time(s), expected none")

    def _summary(self) -> str:
        return ", ".join(sorted({r.job for r in self.records})) or "nothing"

    # -- running -----------------------------------------------------------------------------

    async def work(self) -> JobCounts:
        """Runs every recorded job not run yet (and the jobs they chain), here and now, and says
        what that came to (``.processed``, ``.failed``, ``.released``, ``.discarded``)."""
        runner = LocalRun(self._jobs, once_store=self._once_store, on_queued=self._chained, raise_failures=False)
        kernel = self._jobs.kernel
        bound = kernel.bound_app
        if self._waiting and self._app is None:
            self._app = self._find_app(bound)
        kernel.bind_app(self._app)  # (for these attempts only: the lifespan's app comes back after)
        try:
            while self._waiting:
                # (it stays listed, Pending, while it runs, and its status is known before the next
                # one runs: a wait() beside work() never finds it missing)
                queue, message = self._waiting[0]
                group = self._groups.pop(message.message_id, None)
                try:
                    if group is None:
                        await runner.run_until_done(queue, message)
                    else:  # (its members ran before it, in this run's store)
                        await runner.run_group([], (queue, message), group.id, list(group.member_ids))
                finally:
                    self._statuses.update((status.id, status) for status in await runner.statuses())
                    self._waiting.pop(0)
                envelope = JobEnvelope.from_json(_payload(message))
                if envelope.unique_key is not None:
                    self._held_unique.discard(envelope.unique_key)
        finally:
            kernel.bind_app(bound)
        return runner.counts.as_counts()

    def status(self, job_id: uuid.UUID) -> JobStatus | None:
        """What ``queue.job_status`` answers under the fake: a recorded job not run yet is Pending;
        one :meth:`work` ran is what came of it (without the attempt history); None for an id the
        fake never recorded."""
        found = self._statuses.get(job_id)
        if found is not None:
            return found
        for queue, message in self._waiting:
            if message.message_id == job_id:
                record = next((r for r in self.records if r.id == job_id), None)
                return JobStatus(id=job_id, job=None if record is None else record.job, queue=queue,
                                 state="Pending", attempt=0, tries=message.max_attempts or 1)
        return None

    def _find_app(self, bound: Any) -> Any:
        """The app that serves the queue (:mod:`fastapi_workqueue.web.serving_apps`), else the one bound."""
        if not any(job.dependency_params for job in self._jobs.registry):
            return bound  # (no job has a dependency to override: no need to look)
        apps = apps_of(self._jobs.kernel.facade)
        if len(apps) == 1:
            return apps[0]
        if not apps and bound is None and not self._told_no_app:
            self._told_no_app = True
            log.warning(
                "fake.work(): no app serves this queue and none is bound, so the jobs' dependencies run as "
                "declared, without any app's dependency_overrides: pass the app, queue.fake(app=app) (or "
                "workqueue_app = \"myapp.main:app\" in your pytest configuration)")
        if not apps or bound in apps:
            return bound
        raise ConfigurationError(
            f"fake.work() found {len(apps)} apps that serve this queue and cannot tell whose "
            "dependency_overrides apply: pass the app, queue.fake(app=app) (with the workqueue_fake fixture, a "
            "workqueue_app fixture that returns it, or workqueue_app = \"myapp.main:app\" in your pytest "
            "configuration)"
        )

    def _chained(self, queue: str, message: PreparedMessage) -> None:
        envelope = JobEnvelope.from_json(_payload(message))
        job = self._jobs.registry.find(envelope.job)
        if job is not None:
            self.records.append(Dispatched(job=job.name, id=message.message_id, queue=queue,
                                           payload=job.load(self._jobs.open_payload(job, envelope))))


def _payload(message: PreparedMessage) -> Any:
    import json

    return json.loads(message.payload_json or "null")


def _matches(payload: Any, where: Callable[[Any], bool] | Mapping[str, Any]) -> bool:
    if not isinstance(where, Mapping):
        return bool(where(payload))
    fields = payload.model_dump() if isinstance(payload, BaseModel) else payload
    if not isinstance(fields, Mapping):
        raise TypeError(
            f"where={dict(where)!r} compares fields, but this job's payload is a {type(payload).__name__}: "
            "pass a predicate instead, where=lambda payload: ..."
        )
    unknown = [key for key in where if key not in fields]
    if unknown and isinstance(payload, BaseModel):  # (a misspelt field would only ever fail to match)
        raise TypeError(f"where= names {unknown[0]!r}, which {type(payload).__name__} has no field of; its fields "
                        f"are {', '.join(type(payload).model_fields)}")
    return all(key in fields and fields[key] == value for key, value in where.items())


def _payloads_of(name: str, payloads: list[Any], shown: int = 5) -> str:
    """The payloads ``name`` was dispatched with, for a failed assertion (the first ``shown``)."""
    if not payloads:
        return ""
    listed = "; ".join(repr(p) for p in payloads[:shown])
    more = f" and {len(payloads) - shown} more" if len(payloads) > shown else ""
    return f"; {name!r} was dispatched with: {listed}{more}"


def _matching(where: Callable[[Any], bool] | Mapping[str, Any] | None) -> str:
    if where is None:
        return ""
    return f" with {dict(where)!r}" if isinstance(where, Mapping) else " with a payload that matches"


def _after_commit(keep: Callable[[], None], session: Any) -> bool:
    """Runs ``keep`` when the dispatch's transaction commits and never when it rolls back (True), or
    says there is no transaction (False): the caller's ``session=``, or the request's."""
    from sqlalchemy import event
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    from ..web.session import current_session

    tx = session if session is not None else current_session()
    target: Any
    if isinstance(tx, AsyncSession):
        target, on_commit, on_rollback = tx.sync_session, "after_commit", "after_rollback"
    elif isinstance(tx, AsyncConnection):
        target, on_commit, on_rollback = tx.sync_connection, "commit", "rollback"
    else:
        return False
    ended = False

    def committed(*_: Any) -> None:
        nonlocal ended
        if not ended:
            ended = True
            keep()

    def rolled_back(*_: Any) -> None:
        nonlocal ended
        ended = True

    event.listen(target, on_commit, committed, once=True)
    event.listen(target, on_rollback, rolled_back, once=True)
    return True
