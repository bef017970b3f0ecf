"""Groups (fan-in): ``queue.group([(resize, {...}), (resize, {...})], then=(notify_done, {...}))``.

The members are queued as jobs are, and the ``then`` job with them, held back (due at 9999-12-31)
in the same transaction; the store counts each member's end (Completed, Failed or Discarded: a
settle, a lease that ran out on the last try, an operator's discard) in the transaction that ends
it, and the end that counts the last member makes the ``then`` job due, once, whichever processes
end the last members at once (:mod:`fastapi_workqueue.core.message_state`). A member that fails
or is discarded ends too: ``then`` always runs, and sees each member's status in
``job.group_results`` (in the order the members were given), the results of those that
completed among them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.envelope import PreparedMessage, RequestRejected, prepare, uuid7
from ..core.errors import ConfigurationError
from ..core.message_state import HELD_UNTIL, MESSAGE_STATE_NEEDED, GroupMember, MessageState
from .definition import check_queue_name
from .envelope import topic_of
from .results import decode_result
from .status import JobStatus, status_of

if TYPE_CHECKING:
    from .definition import Job
    from .encryption import PayloadCipher
    from .layer import Jobs

MAX_MEMBERS = 10000
"""The most members a group may have."""

LOCAL_STATE: ContextVar[MessageState | None] = ContextVar("workqueue_local_group_state", default=None)
"""The store of a run in this process (sync mode, the fake): a ``then`` job run there reads its
group there."""


@dataclass(frozen=True, slots=True)
class JobGroup:
    """A group made by ``queue.group``: its id, its members' job ids (in order) and the ``then`` job's."""

    id: uuid.UUID
    member_ids: tuple[uuid.UUID, ...]
    then_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class _Planned:
    job: Job
    queue: str
    message: PreparedMessage


def _item(item: Any, what: str) -> tuple[Any, Any, dict[str, Any]]:
    if not isinstance(item, tuple | list) or len(item) not in (2, 3):
        raise TypeError(f"{what} is (job, payload) or (job, payload, {{'queue': ...}}), got {item!r}")
    options = dict(item[2]) if len(item) == 3 else {}
    unknown = set(options) - {"queue"}
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)} for {what}; a group's jobs take queue only")
    return item[0], item[1], options


def _plan(jobs: Jobs, item: Any, what: str, **fields: Any) -> _Planned:
    job, payload, options = _item(item, what)
    definition = jobs.registry.resolve(job)
    data = definition.validate(payload)
    queue = check_queue_name(options["queue"]) if "queue" in options else definition.policy.queue
    request = jobs.request(definition, data, **fields)
    try:
        message = prepare(request, max_envelope_bytes=jobs.kernel.envelope_cap(topic_of(queue)))
    except RequestRejected as exc:
        raise ValueError(f"{what} ({definition.name!r}) cannot be queued: {exc.error.message}") from None
    return _Planned(definition, queue, message)


async def make_group(jobs: Jobs, items: Iterable[Any], then: Any, session: Any) -> JobGroup:
    """Queues the members and the held ``then`` job in one transaction and makes them a group."""
    group_id = uuid7()
    members = [_plan(jobs, item, f"member {index} of the group") for index, item in enumerate(items)]
    if not members:
        raise ValueError("a group needs at least one member job: queue.group([(job, payload), ...], then=...)")
    if len(members) > MAX_MEMBERS:
        raise ValueError(f"a group has at most {MAX_MEMBERS} members, got {len(members)}: make several groups")
    if then is None:
        raise ValueError("a group needs then=(job, payload): the job that runs once every member ended")
    last = _plan(jobs, then, "then", group=group_id, not_before=HELD_UNTIL)
    group = JobGroup(group_id, tuple(m.message.message_id for m in members), last.message.message_id)
    if jobs.fake is not None:
        jobs.fake.record_group(group, [(m.job, m.queue, m.message) for m in members],
                               (last.job, last.queue, last.message), session=session)
        return group
    if jobs.sync:
        await jobs.run_group_now([(m.queue, m.message) for m in members], (last.queue, last.message), group)
        return group
    state = jobs.kernel.ports.state
    if state is None:
        raise ConfigurationError(MESSAGE_STATE_NEEDED)
    by_topic: dict[str, list[PreparedMessage]] = {}
    for planned in [*members, last]:
        topic = await jobs.ensure_queue(planned.queue)
        by_topic.setdefault(topic, []).append(planned.message)

    async def publish_all(tx: Any) -> None:
        from .layer import JobDispatchError

        for topic, messages in by_topic.items():
            results = await jobs.kernel.publish_prepared(topic, len(messages), messages, {}, session=tx)
            for message, result in zip(messages, results, strict=True):
                if not result.ok:
                    planned = next(p for p in [*members, last] if p.message is message)
                    raise JobDispatchError(planned.job.name, result)
        await state.group_create(group_id, list(group.member_ids), group.then_id, session=tx)

    await jobs.in_one_transaction(publish_all, session)
    return group


def _member_status(member: GroupMember, cipher: PayloadCipher | None) -> JobStatus:
    if member.delivery is None:
        return JobStatus(id=member.message_id, job=None, queue="", state="Discarded", attempt=0, tries=0,
                         reason="no longer stored (purged with the retention, or never published)",
                         ended_at=member.ended_at)
    result = None
    if member.result is not None and member.delivery.status == "Completed":
        result = decode_result(member.result, cipher, member.message_id)
    return status_of(member.delivery, [], result)


async def group_results(jobs: Jobs, group_id: uuid.UUID) -> list[JobStatus]:
    """Each member's status, in order (as ``job.group_results`` gives them to the ``then`` job)."""
    state = LOCAL_STATE.get() or jobs.kernel.ports.state
    if state is None:
        raise ConfigurationError(MESSAGE_STATE_NEEDED)
    cipher = jobs.cipher()
    return [_member_status(member, cipher) for member in await state.group_members(group_id)]

