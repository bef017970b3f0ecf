"""Times and durations out of range are refused where they are given, with what to change: never
accepted and then left to fail (a lease too short to start a handler, a schedule whose next tick no
datetime holds, a message held back past any plan)."""

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from fastapi_workqueue import ConfigurationError, PublishRequest, Subscription, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.envelope import PublishStatus

from .support import make_queue


@pytest.mark.parametrize("lease", [0.001, 1e-6, 0.49])
def test_a_lease_too_short_to_start_a_handler_is_refused(lease: float) -> None:
    """A 1 ms lease ran out before any handler could start: every delivery went back unrun, again
    and again, and was dead-lettered."""
    with pytest.raises(ValidationError, match="lease_seconds"):
        Subscription(name="s", topic="t", handler_key="h", lease_seconds=lease)
    with pytest.raises(ConfigurationError, match=r"WORKQUEUE_JOB_LEASE_SECONDS.*greater than or equal to 0\.5"):
        WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db", job_lease_seconds=lease)
    assert Subscription(name="s", topic="t", handler_key="h", lease_seconds=0.5).lease_seconds == 0.5
    # What an earlier release stored still reads (the bound is the declaration's, not the store's).
    from fastapi_workqueue.core.topology import SubscriptionState

    stored = SubscriptionState(id=1, name="s", topic="t", handler_key="h", lease_seconds=0.25)
    assert stored.lease_seconds == 0.25


@pytest.mark.parametrize("every", [float("nan"), float("inf"), 1e12, timedelta(days=365 * 101)])
def test_a_schedule_every_that_no_datetime_holds_is_refused_at_declaration(every: Any) -> None:
    """every=1e12 was accepted; then `workqueue schedules` failed with "year 33658 is out of range"
    and the host logged an error every second. NaN and inf raised Python's own errors."""
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db", enabled=False))

    @queue.job("tick")
    async def tick(payload: dict[str, Any]) -> None:
        return None

    with pytest.raises(ConfigurationError, match=r"schedule '.*': every.*100 years"):
        queue.schedule(tick, every=every, payload={})


async def test_a_not_before_over_100_years_ahead_is_refused_as_a_delay_is(sqlite_url: str) -> None:
    """``not_before=2206-01-01`` (for 2026) was stored Pending for 180 years, where a delay of 101
    years is refused."""
    queue, topic, subs = make_queue(sqlite_url, [{"role": "a"}], enabled=False)
    async with queue.lifespan(None):
        far = datetime(2206, 1, 1, tzinfo=UTC)
        [refused] = await queue.publish(topic, [PublishRequest(payload=1, not_before=far)])
        near = datetime.now(UTC) + timedelta(days=365 * 99)
        [taken] = await queue.publish(topic, [PublishRequest(payload=2, not_before=near)])
        [stats] = await queue.stats(subs["a"])
    assert refused.status == PublishStatus.REJECTED and refused.error is not None
    assert "more than 100 years ahead" in refused.error.message and "check the year" in refused.error.message
    assert taken.status == PublishStatus.ACCEPTED and stats.pending == 1


@pytest.mark.parametrize("unique_for", [float("nan"), 1e12, 0, -1])
async def test_a_unique_for_out_of_range_names_unique_for(sqlite_url: str, unique_for: float) -> None:
    """NaN and 1e12 were refused by a validation error of ``deduplication_ttl_seconds``, a field
    the caller never set."""
    queue = WorkQueue(WorkQueueSettings(database_url=sqlite_url, auto_migrate=True, enabled=False))

    @queue.job("once-a-while")
    async def job(payload: dict[str, Any]) -> None:
        return None

    async with queue.lifespan(None):
        with pytest.raises(ValueError, match=r"^unique_for must be a number of seconds above 0 and at most"):
            await queue.dispatch(job, {}, unique="k", unique_for=unique_for)


def test_a_subscription_of_a_job_queues_topic_is_refused_at_declaration() -> None:
    """A subscription on topic ``jobs.orders`` was accepted, its publishes answered Accepted, and
    nothing ever ran them: the host leaves job queues' topics to the job workers. Health showed no
    subscription and the log said nothing."""
    from fastapi_workqueue import Topic

    with pytest.raises(ConfigurationError, match=r"subscription 'orders.mail' names topic 'jobs.orders'.*"
                                                 r"would never be served.*'orders'"):
        WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db", enabled=False),
                  topics=[Topic(name="jobs.orders")],
                  subscriptions=[Subscription(name="orders.mail", topic="jobs.orders", handler_key="mail")])
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db", enabled=False),
                      topics=[Topic(name="orders")],
                      subscriptions=[Subscription(name="jobs.mail", topic="orders", handler_key="mail")])
    assert "jobs.mail" in queue.subscriptions  # (a subscription's own name is free)


def test_a_server_short_of_resources_or_a_statement_timeout_is_passing_not_final() -> None:
    """Disk full, out of connections and a statement timeout were "not retryable": a settle that
    met one was given up at once (its handler ran again once its lease ran out), and a request's
    session answered 500 instead of 503 with Retry-After when the server had no connection left."""
    import sqlite3

    import asyncpg

    from fastapi_workqueue.core.errors import TransportError, TransportUnavailable
    from fastapi_workqueue.database.errors import map_error
    from fastapi_workqueue.database.sqlite import _mapped

    for exc in (asyncpg.exceptions.DiskFullError("could not extend file: No space left on device"),
                asyncpg.exceptions.TooManyConnectionsError("sorry, too many clients already")):
        mapped = map_error(exc, "settle")
        assert isinstance(mapped, TransportUnavailable) and mapped.retryable, mapped
    timed_out = map_error(asyncpg.exceptions.QueryCanceledError("canceling statement due to statement timeout"),
                          "settle")
    assert isinstance(timed_out, TransportError) and timed_out.retryable
    full = _mapped(sqlite3.OperationalError("database or disk is full"), "settle", lambda: TransportError("busy"))
    assert isinstance(full, TransportUnavailable) and full.retryable
    refused = map_error(asyncpg.exceptions.CheckViolationError("new row violates check constraint"), "settle")
    assert isinstance(refused, TransportError) and not refused.retryable


async def test_a_publish_after_the_sqlite_file_was_deleted_is_refused_not_lost(tmp_path: Any) -> None:
    """The file deleted under a running process: every publish answered Accepted into the unlinked
    file (health 200, nothing logged), and all of it was gone when the process ended."""
    import contextlib
    import os

    from fastapi_workqueue import Topic
    from fastapi_workqueue.core.errors import TransportError

    path = tmp_path / "q.db"
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{path}", auto_migrate=True, enabled=False),
                      topics=[Topic(name="t")])
    async with queue.lifespan(None):
        [first] = await queue.publish("t", [PublishRequest(payload=1)])
        assert first.status == PublishStatus.ACCEPTED
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(f"{path}{suffix}")
        with pytest.raises(TransportError, match=r"was deleted or replaced while this process had it open"):
            await queue.publish("t", [PublishRequest(payload=2)])


def test_the_held_time_of_a_groups_message_is_not_taken_for_a_typo() -> None:
    from fastapi_workqueue.core.envelope import prepare
    from fastapi_workqueue.core.message_state import HELD_UNTIL

    assert prepare(PublishRequest(payload=1, not_before=HELD_UNTIL)).not_before == HELD_UNTIL
