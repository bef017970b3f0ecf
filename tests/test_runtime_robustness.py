"""The consumer runtime where it is easy to get wrong: a settle batch with one text the store
cannot keep, a lease a newer deploy shortened, abort listeners that raise, a claim that fails
half-way through a consumer's groups, and a handler that raises CancelledError itself."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import pytest

from fastapi_workqueue import Outcome, PublishRequest, WorkContext, WorkMessage, WorkOutcome

from .support import delivery_status, make_queue, wait_for

pytestmark = pytest.mark.timeout(60)


async def test_a_nul_in_one_handlers_error_does_not_lose_the_other_outcomes_of_its_settle_batch(
    pg_url: str,
) -> None:
    """A handler's exception text becomes last_error, and PostgreSQL text cannot hold a NUL. The four
    handlers end together, so their settles share one batch: the three completions are written, and
    the failure with its error (the NUL written out), none left to its lease."""
    queue, topic, subs = make_queue(pg_url, [{"role": "h", "lease_seconds": 1, "max_attempts": 1}], concurrency=8)
    payloads = ("ok1", "bad", "ok2", "ok3")
    runs: dict[str, int] = {}
    gate = asyncio.Event()

    @queue.handler("h")
    async def handle(message: WorkMessage[str], context: WorkContext) -> WorkOutcome:
        runs[message.payload] = runs.get(message.payload, 0) + 1
        await gate.wait()
        if message.payload == "bad":
            raise ValueError("binary field was b'\x00\x01'")
        return Outcome.complete()

    async with queue.lifespan(None):
        results = await queue.publish(topic, [PublishRequest(payload=p) for p in payloads])
        await wait_for(lambda: len(runs) == 4)
        gate.set()  # all four return at once: their settles share one batch
        infos = [await wait_for(functools.partial(_terminal, queue, subs["h"], r.message_id), within=20)
                 for r in results]
    states = {p: (i.status, i.reason) for p, i in zip(payloads, infos, strict=True)}
    assert runs == {"ok1": 1, "bad": 1, "ok2": 1, "ok3": 1}, runs
    assert [states[p][0] for p in ("ok1", "ok2", "ok3")] == ["Completed"] * 3, states
    # The failing attempt itself is settled with its error (not left for the sweeper).
    assert states["bad"][0] == "DeadLettered" and "ValueError" in (infos[1].last_error or ""), states


async def test_the_settler_writes_one_by_one_what_the_store_refused_as_a_batch(pg_url: str) -> None:
    """A store that refuses one settle of a batch (not for being away: for what it holds) costs the
    others nothing: the settler writes them one by one and gives up only the one refused."""
    from fastapi_workqueue.core.errors import TransportError
    from fastapi_workqueue.core.settler import Settler
    from fastapi_workqueue.core.transport import Settlement

    queue, topic, subs = make_queue(pg_url, [{"role": "h"}])
    await queue.open()
    try:
        transport = queue.transport
        results = await queue.publish(topic, [PublishRequest(payload=i) for i in range(4)])
        claimed = await transport.claim(subs["h"], 10)
        assert len(claimed) == 4

        class RefusesPoison:
            """The real store, refusing every settle call that carries the reason "poison"."""

            def __getattr__(self, name: str) -> Any:
                return getattr(transport, name)

            async def settle(self, settlements: list[Settlement]) -> Any:
                if any(s.reason == "poison" for s in settlements):
                    raise TransportError("the store refused it", retryable=False)
                return await transport.settle(settlements)

        settler = Settler(RefusesPoison())  # type: ignore[arg-type]
        answers: dict[str, Any] = {}
        for index, delivery in enumerate(claimed):
            reason = "poison" if index == 1 else None
            kind = "DeadLetter" if reason else "Complete"
            settler.submit(Settlement(delivery.delivery_id, delivery.lease_token, kind, reason=reason),  # type: ignore[arg-type]
                           lambda s, r: answers.__setitem__(s.delivery_id, r))
        await settler.flush()
        await settler.close()
        states = {r.message_id: (await delivery_status(queue, subs["h"], r.message_id)).status for r in results}
    finally:
        await queue.close()
    by_delivery = {d.delivery_id: d for d in claimed}
    assert sorted(answers.values(), key=str) == ["Completed", "Completed", "Completed", None]
    assert answers[claimed[1].delivery_id] is None
    assert states[by_delivery[claimed[1].delivery_id].message_id] == "InFlight"  # left to its lease
    assert sorted(states.values()) == ["Completed", "Completed", "Completed", "InFlight"]


async def test_a_lease_shortened_by_a_rolling_deploy_is_counted_as_the_store_grants_it(pg_url: str) -> None:
    """A newer deploy declares the subscription with a shorter lease (synced at its start). An older
    process, until its next reconcile (30 s by default), still counts (and heartbeats) the old, long
    one, so the store leases what it claims and renews for that lease too: the store's lease never
    runs out under a handler that its process counts as leased, and no second handler runs the
    delivery at once."""
    from fastapi_workqueue import Subscription, Topic, WorkQueue, WorkQueueSettings

    queue, topic, subs = make_queue(
        pg_url, [{"role": "long", "lease_seconds": 6, "backoff_base_seconds": 0, "backoff_max_seconds": 0}],
        reconcile_interval_ms=30000,  # the default
    )
    running = 0
    most = 0
    runs = 0

    @queue.handler("long")
    async def long(message: WorkMessage[Any], context: WorkContext) -> WorkOutcome:
        nonlocal running, most, runs
        runs += 1
        running += 1
        most = max(most, running)
        try:
            await asyncio.sleep(3.0)
        finally:
            running -= 1
        return Outcome.complete()

    async with queue.lifespan(None):
        # The new deploy: the same subscription with a 1 s lease, synced when it opens.
        newer = WorkQueue(
            WorkQueueSettings(database_url=pg_url, enabled=False),
            topics=[Topic(name=topic)],
            subscriptions=[Subscription(name=subs["long"], topic=topic, handler_key="long", lease_seconds=1,
                                        backoff_base_seconds=0, backoff_max_seconds=0)],
        )
        await newer.open()
        await newer.close()
        [result] = await queue.publish(topic, [PublishRequest(payload=1)])
        await wait_for(lambda: runs >= 1)
        await asyncio.sleep(2.5)
        info = await delivery_status(queue, subs["long"], result.message_id)
    assert most == 1 and runs == 1, f"{runs} runs, {most} at once; delivery {info.status} attempt {info.attempt}"


async def test_an_abort_listener_that_raises_neither_keeps_the_abort_from_its_handler_nor_stops_heartbeats(
    pg_url: str,
) -> None:
    """``context.signal.add_listener(callback)`` stops work started elsewhere (docs/handlers.md). A
    callback that raises (it kills a child process that already exited) is logged: the operator's
    cancel still cancels its handler's task, and the consumer's heartbeats go on, so the other
    handler, which only awaits, keeps its lease and completes."""
    queue, topic, subs = make_queue(pg_url, [{"role": "h", "lease_seconds": 0.9}])
    started: dict[str, asyncio.Event] = {"a": asyncio.Event(), "b": asyncio.Event()}
    ended: dict[str, Any] = {}

    def kill_child(reason: Any) -> None:
        raise ProcessLookupError("no such process")  # the child had already exited

    @queue.handler("h")
    async def handle(message: WorkMessage[str], context: WorkContext) -> WorkOutcome:
        if message.payload == "a":
            context.signal.add_listener(kill_child)
        started[message.payload].set()
        try:
            await asyncio.sleep(3.0)
        except asyncio.CancelledError:
            ended[message.payload] = ("cancelled", context.signal.reason)
            raise
        ended[message.payload] = ("returned", context.signal.reason)
        return Outcome.complete()

    async with queue.lifespan(None):
        [a, b] = await queue.publish(topic, [PublishRequest(payload="a"), PublishRequest(payload="b")])
        await asyncio.wait_for(asyncio.gather(started["a"].wait(), started["b"].wait()), 10)
        [held] = [d for d in await queue.deliveries(subs["h"], "InFlight") if d.message_id == a.message_id]
        await queue.discard(subs["h"], held.delivery_id, "operator: stop a")
        await wait_for(lambda: len(ended) == 2, within=15)
        info_b = await wait_for(lambda: _terminal(queue, subs["h"], b.message_id))
    # The cancel reaches handler a (its task is cancelled), and b, which only awaited, keeps its lease.
    assert ended["a"][0] == "cancelled", ended
    assert ended["b"] == ("returned", None), ended
    assert info_b.status == "Completed" and info_b.attempt == 1


async def test_an_abort_listener_that_raises_does_not_stop_the_shutdown_from_releasing_what_runs(
    pg_url: str,
) -> None:
    """The same callback at shutdown: every handler is aborted all the same and what was running is
    released to Pending without spending its attempt."""
    queue, topic, subs = make_queue(pg_url, [{"role": "h"}], shutdown_drain_ms=300)
    started = {"a": asyncio.Event(), "b": asyncio.Event()}

    def kill_child(reason: Any) -> None:
        raise ProcessLookupError("no such process")

    @queue.handler("h")
    async def handle(message: WorkMessage[str], context: WorkContext) -> WorkOutcome:
        if message.payload == "a":
            context.signal.add_listener(kill_child)
        started[message.payload].set()
        await asyncio.sleep(5)
        return Outcome.complete()

    async with queue.lifespan(None):
        results = await queue.publish(topic, [PublishRequest(payload="a"), PublishRequest(payload="b")])
        await asyncio.wait_for(asyncio.gather(started["a"].wait(), started["b"].wait()), 10)
    await queue.open()
    try:
        infos = [await delivery_status(queue, subs["h"], r.message_id) for r in results]
    finally:
        await queue.close()
    # SPEC §4 shutdown: what is left is released to Pending without consuming an attempt.
    assert [(i.status, i.attempt) for i in infos] == [("Pending", 0), ("Pending", 0)]


async def test_a_claim_that_fails_in_a_later_group_does_not_strand_what_earlier_groups_claimed(
    pg_url: str,
) -> None:
    """A consumer of several groups (a job worker's ``--queue=mail,*``) claims group by group. When a
    later group's claim fails (here the database cancels it; a dropped connection or a statement
    timeout does the same), what the earlier groups claimed, already InFlight in the store, runs
    (once) and completes instead of waiting out its lease."""
    import asyncpg

    from fastapi_workqueue.core.host import GroupPlan
    from fastapi_workqueue.database.postgres import to_asyncpg_dsn

    queue, topic, subs = make_queue(
        pg_url,
        [{"role": "first", "handler_key": "h", "lease_seconds": 2, "max_attempts": 1},
         # A flow limit: its claim takes the subscription's claim lock (a plain claim could fail the same way).
         {"role": "second", "handler_key": "h", "max_in_flight": 10}],
        sweeper_interval_ms=100,
    )
    ran: list[str] = []

    @queue.handler("h")
    async def handle(message: WorkMessage[str], context: WorkContext) -> WorkOutcome:
        ran.append(context.subscription)
        return Outcome.complete()

    observer = await asyncpg.connect(to_asyncpg_dsn(pg_url))
    await queue.open()
    host = None
    try:
        second_id = await observer.fetchval("SELECT id FROM workqueue.subscription WHERE name = $1", subs["second"])
        await observer.execute("SELECT pg_advisory_lock(hashtext('workqueue.claim'), $1)", second_id)
        host = queue.build_host([], groups=[GroupPlan(name="g", patterns=(subs["first"], subs["second"]))])
        await host.start()
        [result] = await queue.publish(topic, [PublishRequest(payload="x")])

        # A claim waiting for the observer's lock, as the lock manager has it now (pg_stat_activity
        # may still show a backend that has already left the wait, and a cancel sent to it would
        # land on its next statement: the settle of what the first group claimed).
        waiting = "pg_backend_pid() = ANY(pg_catalog.pg_blocking_pids(pid)) AND strpos(query, 'workqueue.claim') > 0"
        blocked_claims = f"SELECT pid FROM pg_catalog.pg_stat_activity WHERE {waiting}"
        cancel_if_waiting = (
            f"SELECT pg_cancel_backend(pid) FROM pg_catalog.pg_stat_activity WHERE pid = $1 AND {waiting}")
        first_status = (
            "SELECT d.status FROM workqueue.delivery d JOIN workqueue.subscription s ON s.id = d.subscription_id "
            "WHERE s.name = $1")
        for _ in range(50):
            # The consumer's claim of the second group waits for the lock. Once the first group's
            # claim before it in the same call took the delivery (InFlight, or already run and
            # settled when this looks), the database cancels the waiting claim; until then it
            # cancels claims that took nothing (nothing is lost).
            [row] = await wait_for(lambda: observer.fetch(blocked_claims))
            claimed_first = await observer.fetchval(first_status, subs["first"]) != "Pending"
            if not await observer.fetchval(cancel_if_waiting, row["pid"]):
                continue  # it left the wait (a cancel before this one): look again
            if claimed_first:
                break
        else:
            raise AssertionError("the first group's delivery was never claimed")
        await observer.execute("SELECT pg_advisory_unlock(hashtext('workqueue.claim'), $1)", second_id)
        info = await wait_for(lambda: _terminal(queue, subs["first"], result.message_id), within=15)
        await wait_for(lambda: _terminal(queue, subs["second"], result.message_id), within=15)
    finally:
        if host is not None:
            await host.stop()
        await queue.close()
        await observer.close()
    # The delivery claimed from the first group runs (once) and completes.
    assert ran.count(subs["first"]) == 1, (ran, info.status, info.reason)
    assert info.status == "Completed", (info.status, info.reason)


async def test_a_cancelled_error_the_handler_raises_itself_spends_the_attempt(pg_url: str) -> None:
    """A handler that awaits a child task somebody else cancelled (a client library's own timeout, a
    watchdog) ends with ``CancelledError`` although the runtime never aborted it: a failed attempt,
    as any other exception (backoff, then DeadLettered when the attempts are spent), not a give-back
    as at shutdown, which would run it again at once, without end."""
    queue, topic, subs = make_queue(pg_url, [{"role": "h", "max_attempts": 2}])
    runs = 0

    @queue.handler("h")
    async def handle(message: WorkMessage[str], context: WorkContext) -> WorkOutcome:
        nonlocal runs
        runs += 1
        child = asyncio.create_task(asyncio.sleep(10))
        asyncio.get_running_loop().call_soon(child.cancel)  # e.g. the child's own watchdog gave up
        await child
        return Outcome.complete()

    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload="x")])
        info = await wait_for(lambda: _terminal(queue, subs["h"], result.message_id), within=8,
                              describe=lambda: f"{runs} runs so far")
    assert info.status == "DeadLettered" and runs == 2, (info.status, runs)


async def test_a_group_waiting_out_a_rate_limit_runs_new_work_of_its_unlimited_subscription_at_once(
    pg_url: str,
) -> None:
    """A consumer of a group (a job worker's ``--queue=mail,*``) whose rate-limited subscription has
    work held back waits for the limit's next token (here up to the idle poll, 30 s). Work published
    meanwhile to a subscription of the group without a limit needs no token: its wake-up ends the
    wait, and it runs at once."""
    from fastapi_workqueue import Subscription, SubscriptionPlan, Topic, WorkQueue, WorkQueueSettings
    from fastapi_workqueue.core.host import GroupPlan

    from .conftest import unique
    from .support import FAST

    limited_topic, free_topic, limited, free = unique("lim-t"), unique("free-t"), unique("lim"), unique("free")
    queue = WorkQueue(
        WorkQueueSettings(database_url=pg_url, **{**FAST, "idle_poll_max_ms": 30000},
                          subscriptions=[SubscriptionPlan(name=limited), SubscriptionPlan(name=free)]),
        topics=[Topic(name=limited_topic), Topic(name=free_topic)],
        subscriptions=[Subscription(name=limited, topic=limited_topic, handler_key="h", rate_limit="1/m"),
                       Subscription(name=free, topic=free_topic, handler_key="h")],
    )
    ran: list[str] = []

    @queue.handler("h")
    async def handle(message: WorkMessage[str], context: WorkContext) -> None:
        ran.append(message.payload)

    await queue.open()
    host = None
    try:
        host = queue.build_host([], groups=[GroupPlan(name="g", patterns=(limited, free))])
        await host.start()
        consumer = host.group_consumers["g"]
        await queue.publish(limited_topic, [PublishRequest(payload="limited-1"), PublishRequest(payload="limited-2")])
        # One token: the first runs, the second is held back for a minute.
        await wait_for(lambda: ran == ["limited-1"] and consumer.claim_loop == "waiting_for_limit",
                       describe=lambda: (ran, consumer.claim_loop))
        await queue.publish(free_topic, [PublishRequest(payload="free")])
        await wait_for(lambda: "free" in ran, within=10, describe=lambda: (ran, consumer.claim_loop))
        assert ran == ["limited-1", "free"]
    finally:
        if host is not None:
            await host.stop()
        await queue.close()


async def _terminal(queue: Any, subscription: str, message_id: Any) -> Any:
    info = await delivery_status(queue, subscription, message_id)
    return info if info is not None and info.status in ("Completed", "DeadLettered", "Discarded") else None


def test_storable_text_keeps_what_every_store_can_hold() -> None:
    """A NUL (PostgreSQL's text refuses it) and a lone surrogate (no UTF-8 encodes it) are written
    out; anything else is kept as it is."""
    from fastapi_workqueue.core.failures import error_text, storable

    assert storable("plain") == "plain"
    assert storable("héllo ✓") == "héllo ✓"
    assert storable("a\x00b") == "a\\x00b"
    assert storable("x\ud800y") == "x\\ud800y"
    try:
        raise ValueError("bytes b'\x00' and \udcff")
    except ValueError as exc:
        text = error_text(exc)
    text.encode()  # no lone surrogate left
    assert "\x00" not in text and "ValueError" in text


@pytest.mark.parametrize("store", ["postgresql", "sqlite"])
async def test_a_delivery_whose_lease_ran_out_before_its_handler_began_is_not_run(
    store: str, pg_url: str, sqlite_url: str
) -> None:
    """Two deliveries claimed together; the first handler blocks the event loop past the lease.
    The second's task was made in time, but its first step comes after its lease ran out (another
    worker may hold it, and its key, by then): it is given back, never begun late."""
    url = pg_url if store == "postgresql" else sqlite_url
    queue, topic, subs = make_queue(url, [{"role": "w", "lease_seconds": 1.5}], concurrency=2)
    began_late: list[bool] = []

    @queue.handler("w")
    async def handle(message: WorkMessage[str], context: WorkContext) -> WorkOutcome:
        if message.payload == "block":
            if context.attempt == 1:
                time.sleep(2.5)  # noqa: ASYNC251 (blocks the event loop on purpose, past the 1.5 s lease)
            return Outcome.complete()
        began_late.append(context.lease_ran_out)  # (before any await: what runs if it is begun)
        await asyncio.sleep(0)
        return Outcome.complete()

    async with queue.lifespan(None):
        # One publish, one claim of both: the blocking one (priority 9) is begun first.
        await queue.publish(topic, [PublishRequest(payload="block", priority=9), PublishRequest(payload="victim")])
        await wait_for(lambda: began_late, within=20)
        await wait_for(lambda: _all_completed(queue, subs["w"]), within=20)
    assert began_late == [False]


async def _all_completed(queue: Any, subscription: str) -> bool:
    [stats] = await queue.stats(subscription)
    return bool(stats.completed == 2)
