"""Debounced dispatch: ``dispatch(job, payload, debounce=timedelta(seconds=30), debounce_key="user:7")``.

Dispatches with one debounce key (per job and job queue) within the window make one job: the
first queues it due a window later; each next one, while that job still waits out its window,
replaces its payload and pushes it a window on from now. So the job runs once, a window after the
last dispatch, with the last payload. The key is a deduplication key of the job queue's topic,
``~debounce:<job>:<key>`` (a keyed hash instead of the key for an encrypted job, as unique keys
are): it cannot meet a unique key, whose first character is a job name's. The store decides
(:meth:`~fastapi_workqueue.core.message_state.MessageState.debounce`) in one transaction; two
dispatchers that queue the first job at once meet on the key, and the second replaces the first's
payload.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..core.clock import SYSTEM_CLOCK, time_to_pass
from ..core.envelope import MAX_DELAY_SECONDS, PublishRequest, PublishResult, PublishStatus, RequestRejected, prepare
from ..core.errors import ConfigurationError, TransportError
from ..core.message_state import MESSAGE_STATE_NEEDED

if TYPE_CHECKING:
    from .definition import Job
    from .layer import Jobs

KEY_PREFIX = "~debounce:"
TRIES = 5
"""How often a dispatch asks the store again after another dispatcher queued the key's job first."""


def debounce_window(debounce: timedelta | float | None, debounce_key: str | None, *, unique: str | None,
                    delay: timedelta | float | None) -> float | None:
    """The window in seconds of a debounced dispatch (None: not debounced); raises ValueError for
    options that do not go together."""
    if debounce is None and debounce_key is None:
        return None
    if debounce is None:
        raise ValueError("debounce_key needs debounce=, the window: e.g. debounce=timedelta(seconds=30)")
    if not isinstance(debounce_key, str) or not debounce_key:
        raise ValueError(
            f"debounce needs a debounce_key, a non-empty string naming what the dispatches are about "
            f"(debounce_key=f'user:{{user.id}}'), got {debounce_key!r}"
        )
    if unique is not None:
        raise ValueError("a dispatch is either unique= or debounce=: a debounced key already makes one job")
    if delay is not None:
        raise ValueError("a debounced job runs its window after the last dispatch: give debounce= and no delay")
    seconds = debounce.total_seconds() if isinstance(debounce, timedelta) else debounce
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= MAX_DELAY_SECONDS:
        raise ValueError(f"debounce must be a timedelta or seconds above 0 (at most 100 years), got {debounce!r}")
    return float(seconds)


def stored_key(jobs: Jobs, job: Job, key: str) -> str:
    """The deduplication key of ``key`` for ``job``: ``~debounce:<job>:<key>`` (hashed when encrypted)."""
    return KEY_PREFIX + jobs.unique_key(job, key)


async def dispatch_debounced(jobs: Jobs, job: Job, request: PublishRequest, target: str, window: float, key: str,
                             session: Any) -> uuid.UUID:
    """Queues ``job`` debounced on ``key`` and returns its id (the waiting job's, when there is one).
    ``request`` is the job's message (``jobs.request``), its priority included."""
    state = jobs.kernel.ports.state
    if state is None:
        raise ConfigurationError(MESSAGE_STATE_NEEDED)
    topic = await jobs.ensure_queue(target)
    dedup = stored_key(jobs, job, key)
    now = time_to_pass(getattr(state, "clock", SYSTEM_CLOCK))
    timing: dict[str, Any] = {"delay_seconds": window} if now is None else \
        {"not_before": now + timedelta(seconds=window)}  # (a test's clock: due by that clock's time)
    request = request.model_copy(update={"deduplication_key": dedup, "deduplication_ttl_seconds": window, **timing})
    try:
        message = prepare(request, max_envelope_bytes=jobs.kernel.envelope_cap(topic))
    except RequestRejected as exc:
        from .layer import JobDispatchError

        raise JobDispatchError(job.name, PublishResult(status=PublishStatus.REJECTED, error=exc.error)) from None

    async def send(tx: Any) -> uuid.UUID:
        from .layer import JobDispatchError

        for _ in range(TRIES):
            waiting = await state.debounce(topic, dedup, message, window, session=tx)
            if waiting is not None:
                return waiting
            [result] = await jobs.kernel.publish_prepared(topic, 1, [message], {}, session=tx)
            if result.status == PublishStatus.ACCEPTED and result.message_id is not None:
                return result.message_id
            if result.status != PublishStatus.DUPLICATE:
                raise JobDispatchError(job.name, result)
        raise TransportError(f"job {job.name!r} was not queued: other dispatches with debounce key {key!r} kept "
                             "queuing it first; try again", retryable=True)

    found: uuid.UUID = await jobs.publish_in(send, session)
    return found

