"""Jobs and issue 31's flow control: a job's ``priority`` is what it is dispatched with (a dispatch,
a bulk item or a chain step may say otherwise); ``concurrency`` and ``rate_limit`` are its queue's
(``max_in_flight`` and ``rate_limit`` of the queue's subscription), so two jobs of one queue that
declare different limits are refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from fastapi_workqueue import ConfigurationError, WorkQueue, WorkQueueSettings

from .support import FAST, wait_for


class Mail(BaseModel):
    to: str


def make(url: str = "sqlite+aiosqlite:///unused.db") -> WorkQueue:
    return WorkQueue(WorkQueueSettings(database_url=url, enabled=False))


def test_a_jobs_limits_are_its_queues() -> None:
    queue = make()

    @queue.job("mail.reset", queue="mail", priority=9, rate_limit="50/s", concurrency=5)
    async def reset(payload: Mail) -> None:
        return None

    sub = queue.subscriptions["jobs.mail"]
    assert (sub.max_in_flight, sub.rate_limit, sub.key_concurrency) == (5, "50/s", None)
    assert queue.jobs.registry.resolve(reset).policy.priority == 9


def test_a_job_without_limits_shares_its_queues_and_a_later_limit_reaches_the_queue() -> None:
    queue = make()

    @queue.job("mail.digest", queue="mail")
    async def digest(payload: Mail) -> None:
        return None

    assert queue.subscriptions["jobs.mail"].flow_limits() == {}

    @queue.job("mail.reset", queue="mail", concurrency=3)
    async def reset(payload: Mail) -> None:
        return None

    assert queue.subscriptions["jobs.mail"].flow_limits() == {"max_in_flight": 3}

    @queue.job("mail.welcome", queue="mail", concurrency=3)  # the same limits: fine
    async def welcome(payload: Mail) -> None:
        return None


def test_two_jobs_of_one_queue_with_different_limits_are_refused_naming_both() -> None:
    queue = make()

    @queue.job("mail.reset", queue="mail", concurrency=5)
    async def reset(payload: Mail) -> None:
        return None

    with pytest.raises(ConfigurationError, match=r"'mail\.reset' and 'mail\.newsletter'.*queue of its own"):
        @queue.job("mail.newsletter", queue="mail", rate_limit="10/s")
        async def newsletter(payload: Mail) -> None:
            return None
    assert "mail.newsletter" not in [job.name for job in queue.jobs.registry]


@pytest.mark.parametrize(("options", "says"), [
    ({"priority": 10}, "priority must be a whole number from 0 to 9"),
    ({"priority": -1}, "priority must be a whole number from 0 to 9"),
    ({"rate_limit": "lots"}, "rate_limit 'lots' is not a rate"),
    ({"concurrency": 0}, "concurrency must be a whole number of at least 1"),
])
def test_bad_flow_options_are_refused_at_declaration(options: dict[str, Any], says: str) -> None:
    queue = make()
    with pytest.raises(ConfigurationError, match=says):
        @queue.job("mail.bad", **options)
        async def bad(payload: Mail) -> None:
            return None


@pytest.fixture
async def opened(tmp_path: Path) -> AsyncIterator[WorkQueue]:
    queue = make(f"sqlite+aiosqlite:///{tmp_path / 'jobs.db'}")

    @queue.job("mail.newsletter", queue="mail")
    async def newsletter(payload: Mail) -> None:
        return None

    @queue.job("mail.reset", queue="mail", priority=9)
    async def reset(payload: Mail) -> None:
        return None

    await queue.open()
    yield queue
    await queue.close()


async def claimed_order(queue: WorkQueue) -> list[Any]:
    return [c.message_id for c in await queue.transport.claim("jobs.mail", 20)]


async def test_the_declared_priority_goes_first_and_a_dispatch_can_change_it(opened: WorkQueue) -> None:
    low = await opened.dispatch("mail.newsletter", {"to": "a"})
    urgent = await opened.dispatch("mail.reset", {"to": "b"})
    lowered = await opened.dispatch("mail.reset", {"to": "c"}, priority=0)
    raised = await opened.dispatch("mail.newsletter", {"to": "d"}, priority=5)
    assert await claimed_order(opened) == [urgent, raised, low, lowered]
    with pytest.raises(ValueError, match="priority must be a whole number from 0 to 9"):
        await opened.dispatch("mail.reset", {"to": "e"}, priority=12)


async def test_bulk_items_and_chain_steps_take_a_priority(opened: WorkQueue) -> None:
    low, high = await opened.bulk([("mail.newsletter", {"to": "a"}), ("mail.newsletter", {"to": "b"}, {"priority": 7})])
    first, second = await opened.chain([("mail.newsletter", {"to": "c"}, {"priority": 8}),
                                        ("mail.newsletter", {"to": "d"}, {"priority": 3})])
    assert await claimed_order(opened) == [first, high, low]
    link = opened.jobs.link(opened.jobs.registry.resolve("mail.reset"), {"to": "x"})
    assert link.priority == 9 and link.to_json()["priority"] == 9
    assert opened.jobs.link(opened.jobs.registry.resolve("mail.newsletter"), {"to": "y"}).to_json().get(
        "priority") is None
    assert second is not None


async def test_a_limit_a_later_deploy_gives_one_job_queue_does_not_stop_the_others(fresh_url: str) -> None:
    """A worker serves two job queues without limits (one claim across both, claim_many); a new
    deploy gives one of them a ``concurrency``. Before the worker reads the subscriptions again (its
    reconcile interval is long here), the store refuses its claim across both: it claims each on its
    own instead, so the jobs of both queues still run at once (every claim failed, and retried, until
    the next reconcile: 30 s by default)."""
    ran: list[str] = []

    def declare(queue: WorkQueue, limited: bool) -> list[Any]:
        @queue.job("flow.a", queue="qa", concurrency=2 if limited else None)
        async def first(payload: dict[str, Any]) -> None:
            ran.append("qa")

        @queue.job("flow.b", queue="qb")
        async def second(payload: dict[str, Any]) -> None:
            ran.append("qb")

        return [first, second]

    worker = WorkQueue(WorkQueueSettings(database_url=fresh_url, auto_migrate=True, subscriptions=[],
                                         **{**FAST, "reconcile_interval_ms": 600_000}))
    declare(worker, limited=False)
    deploy = WorkQueue(WorkQueueSettings(database_url=fresh_url, auto_migrate=True, enabled=False, subscriptions=[]))
    first, second = declare(deploy, limited=True)
    async with worker.lifespan(None):
        await worker.dispatch("flow.b", {})
        await wait_for(lambda: ran == ["qb"])  # the worker claims across both queues
        async with deploy.lifespan(None):  # (its topology sync writes the limit)
            assert deploy.subscriptions["jobs.qa"].max_in_flight == 2
            await deploy.dispatch(second, {})
            await deploy.dispatch(first, {})
            await wait_for(lambda: sorted(ran) == ["qa", "qb", "qb"], within=4, describe=lambda: ran)
