"""Helpers for tests that run a whole WorkQueue (host, handlers, lifespan) on the test database."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi_workqueue import (
    PublishRequest,
    Subscription,
    SubscriptionPlan,
    Topic,
    WorkMessage,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.testing.conformance.harness import eventually

from .conftest import unique

FAST = {
    "idle_poll_min_ms": 10,
    "idle_poll_max_ms": 100,
    "sweeper_interval_ms": 100,
    "reconcile_interval_ms": 200,
    "shutdown_drain_ms": 300,
}


def make_queue(
    pg_url: str,
    subscriptions: list[dict[str, Any]],
    *,
    concurrency: int = 4,
    topic: dict[str, Any] | None = None,
    **settings: Any,
) -> tuple[WorkQueue, str, dict[str, str]]:
    """A queue with one topic and the given subscriptions (each dict has a ``role``).

    Returns the queue, the topic name and the subscription names by role. The host plans only
    these subscriptions, with the fast timings above unless overridden.
    """
    topic_name = unique("topic")
    names: dict[str, str] = {}
    subs = []
    for spec in subscriptions:
        spec = dict(spec)
        role = spec.pop("role")
        names[role] = unique(role)
        subs.append(Subscription(name=names[role], topic=topic_name, handler_key=spec.pop("handler_key", role), **spec))
    options = {**FAST, **settings}
    queue = WorkQueue(
        WorkQueueSettings(
            database_url=pg_url,
            subscriptions=[SubscriptionPlan(name=n, concurrency=concurrency) for n in names.values()],
            **options,
        ),
        topics=[Topic(name=topic_name, **(topic or {}))],
        subscriptions=subs,
    )
    return queue, topic_name, names


async def wait_for(check: Callable[[], Any], within: float = 10.0, interval: float = 0.02,
                   describe: Callable[[], Any] | None = None) -> Any:
    """Polls ``check()`` (sync or async) until it is truthy; fails after ``within`` seconds (saying
    what ``describe()`` returns then). The conformance suite's :func:`eventually`, with the longer
    wait an app-level test needs."""
    return await eventually(check, within, interval, describe)


async def delivery_status(queue: WorkQueue, subscription: str, message_id: Any) -> Any:
    """The one delivery of ``message_id`` on ``subscription`` (any state), or None."""
    for status in ("Pending", "InFlight", "Completed", "DeadLettered", "Discarded"):
        for info in await queue.deliveries(subscription, status, limit=1000):
            if info.message_id == message_id:
                return info
    return None


class ClaimWatch:
    """Records what a transport's claims answer, per subscription, so that a test waits for a
    consumer's claim (an event it can observe) instead of sleeping: ``await watch.empty_claim(s)``
    returns once a claim of ``s`` has found nothing. It wraps the transport's own methods; the
    store under test is the real one."""

    def __init__(self, transport: Any) -> None:
        self.answers: list[tuple[str, int]] = []
        claim, claim_many = transport.claim, transport.claim_many

        async def counted_claim(subscription: str, limit: int) -> Any:
            batch = await claim(subscription, limit)
            self.answers.append((subscription, len(batch)))
            return batch

        async def counted_claim_many(subscriptions: Any, limit: int) -> Any:
            pairs = await claim_many(subscriptions, limit)
            self.answers.extend((s, sum(1 for name, _ in pairs if name == s)) for s in subscriptions)
            return pairs

        transport.claim, transport.claim_many = counted_claim, counted_claim_many

    async def empty_claim(self, subscription: str, within: float = 10.0) -> None:
        """Until a claim of ``subscription`` has answered nothing."""
        await wait_for(lambda: (subscription, 0) in self.answers, within=within,
                       describe=lambda: f"claims so far: {self.answers}")


async def explain_each_statement(conn: Any) -> list[str]:
    """Has PostgreSQL send ``conn`` (an asyncpg connection) the plan of every statement it runs from
    now on, nested ones included, with their actual row counts (auto_explain at level NOTICE);
    returns the list the plans arrive in. ``SET auto_explain.log_min_duration = -1`` stops it."""
    plans: list[str] = []
    conn.add_log_listener(lambda _conn, message: plans.append(str(message.message)))
    for setting in ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                    "SET auto_explain.log_analyze = on", "SET auto_explain.log_nested_statements = on",
                    "SET auto_explain.log_level = notice"):
        await conn.execute(setting)
    return plans


def rows_removed(text: str) -> list[int]:
    """Each count of rows a filter or a join filter removed in the plans of ``text``."""
    return [int(n) for n in re.findall(r"Rows Removed by (?:Join )?Filter: (\d+)", text)]


async def sweep_until_done(transport: Any, passes: int = 20, *, survive_errors: bool = False) -> set[str]:
    """Sweeps until a pass takes no lease back; returns the deliveries taken back. A pass takes at
    most its limit (1,000), oldest lease first, and the session's database holds other tests'
    leases too: a clock moved ahead finds theirs run out as well. With ``survive_errors`` a pass
    that raises ends the sweeping (a test of a sweep that must not wedge then sees what it left);
    otherwise the error is the test's."""
    taken: set[str] = set()
    for _ in range(passes):
        try:
            report = await transport.sweep()
        except Exception:
            if not survive_errors:
                raise
            return taken
        taken |= {t.delivery_id for t in report.taken_back}
        if report.ran and not report.taken_back:
            return taken
        if not report.ran:  # another pass holds the sweep lock
            await asyncio.sleep(0.05)
    return taken


class LoggedProcess:
    """A subprocess whose stdout and stderr go to files, read once it has ended: a pipe nobody
    reads while the process runs fills (64 KB) and stops it. ``communicate()`` waits and answers
    both as an ``asyncio.subprocess.Process`` would."""

    def __init__(self, proc: asyncio.subprocess.Process, out: Path, err: Path) -> None:
        self.proc, self.out, self.err = proc, out, err

    @classmethod
    async def start(cls, *command: str, logs: Path, **kwargs: Any) -> LoggedProcess:
        """Starts ``command`` (``asyncio.create_subprocess_exec``'s other arguments in ``kwargs``);
        its output goes to two new files in the folder ``logs`` (a test's ``tmp_path``)."""
        stem = f"process-{uuid.uuid4().hex[:8]}"
        out, err = logs / f"{stem}.out", logs / f"{stem}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            proc = await asyncio.create_subprocess_exec(*command, stdout=stdout, stderr=stderr, **kwargs)
        return cls(proc, out, err)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        self.proc.kill()

    async def wait(self) -> int:
        return await self.proc.wait()

    async def communicate(self) -> tuple[bytes, bytes]:
        await self.proc.wait()
        return self.out.read_bytes(), self.err.read_bytes()

    def stderr_so_far(self) -> str:
        return self.err.read_text(errors="replace")


async def stop_time_in_an_outage(url: str, cut_off: Callable[[], Awaitable[None]], drain: float = 0.5) -> float:
    """Seconds a queue's stop takes when ``cut_off()`` has taken its database away while two
    handlers ran: they return once it is away, so their settles meet the outage."""
    topic, sub = unique("outage-stop"), unique("outage-stop-sub")
    queue = WorkQueue(
        WorkQueueSettings(database_url=url, auto_migrate=True, subscriptions=[SubscriptionPlan(name=sub)],
                          **{**FAST, "shutdown_drain_ms": int(drain * 1000)}),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=sub, topic=topic, handler_key="outage-stop", lease_seconds=30)],
    )
    returned: list[int] = []
    away = asyncio.Event()

    @queue.handler("outage-stop")
    async def work(message: WorkMessage[dict[str, int]]) -> None:
        await away.wait()
        returned.append(message.payload["n"])

    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(queue.lifespan(None))
        await queue.publish(topic, [PublishRequest(payload={"n": n}) for n in range(2)])
        host = queue.host
        assert host is not None
        await wait_for(lambda: len(host.consumers[sub]._running) == 2, within=10)
        await cut_off()
        away.set()
        await wait_for(lambda: len(returned) == 2, within=10)
        await asyncio.sleep(0.3)  # the settle is on its way into the outage
        started = time.monotonic()
        await stack.aclose()
        return time.monotonic() - started
