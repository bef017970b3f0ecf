"""The consumer runtime under a real host: handlers, outcomes, dependencies, aborts, heartbeats."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any

import pytest
from fastapi import Depends
from pydantic import BaseModel, ConfigDict
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue import (
    AbortReason,
    ConfigurationError,
    FatalWorkError,
    Outcome,
    PublishRequest,
    TransientWorkError,
    WorkContext,
    WorkMessage,
    WorkOutcome,
)

from .support import delivery_status, make_queue, wait_for

pytestmark = pytest.mark.timeout(60)


class Order(BaseModel):
    order_id: int
    email: str


async def test_typed_payload_and_yield_dependency_per_attempt(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "email", "backoff_base_seconds": 0, "backoff_max_seconds": 0}])
    events: list[str] = []
    seen: list[tuple[Order, int, str]] = []

    async def resource() -> AsyncIterator[str]:
        events.append("open")
        try:
            yield "mailer"
        finally:
            events.append("close")

    @queue.handler("email")
    async def send(message: WorkMessage[Order], context: WorkContext, mailer: str = Depends(resource)) -> WorkOutcome:
        events.append(f"run {context.attempt}")
        seen.append((message.payload, context.attempt, mailer))
        if context.attempt == 1:
            raise TransientWorkError("smtp busy", delay_seconds=0)
        return Outcome.complete()

    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload={"order_id": 7, "email": "a@b.c"})])
        info = await wait_for(lambda: _terminal(queue, subs["email"], result.message_id))
    assert info.status == "Completed" and info.attempt == 2
    assert seen == [(Order(order_id=7, email="a@b.c"), 1, "mailer"), (Order(order_id=7, email="a@b.c"), 2, "mailer")]
    assert events == ["open", "run 1", "close", "open", "run 2", "close"]


async def test_invalid_payload_dead_letters_at_once_with_the_validation_error(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "email", "max_attempts": 5}])
    calls = 0

    @queue.handler("email")
    async def send(message: WorkMessage[Order]) -> WorkOutcome:
        nonlocal calls
        calls += 1
        return Outcome.complete()

    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload={"order_id": "not a number"})])
        info = await wait_for(lambda: _terminal(queue, subs["email"], result.message_id))
    assert calls == 0
    assert info.status == "DeadLettered" and info.attempt == 1
    assert "Order" in (info.reason or "") and "order_id" in (info.reason or "") and "email" in (info.reason or "")


class StrictInvoice(BaseModel):
    model_config = ConfigDict(strict=True)

    invoice_id: uuid.UUID
    due: datetime
    amount: Decimal


async def test_a_strict_payload_model_takes_the_json_forms_of_dates_ids_and_decimals(pg_url: str) -> None:
    # The payload is validated from its JSON text: a strict model takes an ISO date string for a
    # datetime, a UUID string for a UUID and a number for a Decimal, digit for digit.
    queue, topic, subs = make_queue(pg_url, [{"role": "billing"}])
    seen: list[StrictInvoice] = []
    invoice_id = uuid.uuid4()

    @queue.handler("billing")
    async def bill(message: WorkMessage[StrictInvoice]) -> None:
        seen.append(message.payload)

    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload={
            "invoice_id": str(invoice_id), "due": "2026-12-31T23:59:00+00:00", "amount": 0.1,
        })])
        info = await wait_for(lambda: _terminal(queue, subs["billing"], result.message_id))
    assert info.status == "Completed"
    assert seen == [StrictInvoice(invoice_id=invoice_id, due=datetime(2026, 12, 31, 23, 59, tzinfo=UTC),
                                  amount=Decimal("0.1"))]


async def test_outcomes_and_errors_map_to_delivery_states(pg_url: str) -> None:
    queue, topic, subs = make_queue(
        pg_url, [{"role": "h", "max_attempts": 2, "backoff_base_seconds": 0, "backoff_max_seconds": 0}]
    )

    @queue.handler("h")
    async def handle(message: WorkMessage[dict[str, str]], context: WorkContext) -> WorkOutcome | None:
        action = message.payload["do"]
        if action == "none":
            return None
        if action == "fatal":
            raise FatalWorkError("cannot ever work")
        if action == "crash":
            raise ValueError(f"bad thing on attempt {context.attempt}")
        if action == "dead":
            return Outcome.dead_letter("poison")
        if action == "retry":
            return Outcome.retry("later", delay_seconds=0)
        return Outcome.complete()

    async with queue.lifespan(None):
        results = await queue.publish(
            topic, [PublishRequest(payload={"do": d}) for d in ("none", "fatal", "crash", "dead", "retry", "ok")]
        )
        infos = [await wait_for(functools.partial(_terminal, queue, subs["h"], r.message_id)) for r in results]
    by_action = dict(zip(("none", "fatal", "crash", "dead", "retry", "ok"), infos, strict=True))
    assert by_action["none"].status == "Completed"
    assert by_action["ok"].status == "Completed"
    assert (by_action["fatal"].status, by_action["fatal"].attempt) == ("DeadLettered", 1)
    assert by_action["fatal"].reason == "cannot ever work"
    assert (by_action["crash"].status, by_action["crash"].attempt) == ("DeadLettered", 2)
    assert (by_action["crash"].last_error or "").splitlines()[-1] == "ValueError: bad thing on attempt 2"
    assert (by_action["dead"].status, by_action["dead"].reason) == ("DeadLettered", "poison")
    assert (by_action["retry"].status, by_action["retry"].attempt) == ("DeadLettered", 2)
    assert "later" in (by_action["retry"].reason or "")


def _connect_to_mail_server(attempt: int) -> None:
    raise ConnectionError(f"smtp://mailer:hunter2@mail.internal refused attempt {attempt}")


async def test_a_handler_exception_is_logged_with_its_traceback_and_kept_in_last_error(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue, topic, subs = make_queue(
        pg_url, [{"role": "h", "max_attempts": 2, "backoff_base_seconds": 0, "backoff_max_seconds": 0}]
    )

    @queue.handler("h")
    async def handle(message: WorkMessage[str], context: WorkContext) -> None:
        try:
            _connect_to_mail_server(context.attempt)
        except ConnectionError as exc:
            raise RuntimeError("cannot send the welcome mail") from exc

    caplog.set_level(logging.WARNING, logger="fastapi_workqueue.runtime")
    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload="x")])
        info = await wait_for(lambda: _terminal(queue, subs["h"], result.message_id))
    assert info.status == "DeadLettered"
    records = [r for r in caplog.records if r.name == "fastapi_workqueue.runtime" and r.exc_text]
    assert [r.levelno for r in records] == [logging.WARNING, logging.ERROR]
    for attempt, record in enumerate(records, 1):
        fields = vars(record)  # the log call's extra fields
        assert fields["subscription"] == subs["h"]
        assert fields["delivery_id"] == info.delivery_id
        assert fields["message_id"] == str(result.message_id)
        assert fields["attempt"] == attempt
        # The traceback is logged redacted, as text; the raw exception is not left for a handler
        # to format again.
        assert record.exc_info is None
        assert record.exc_text is not None
        assert record.exc_text.splitlines()[-1] == "RuntimeError: cannot send the welcome mail"
        assert f"ConnectionError: smtp://mailer:***@mail.internal refused attempt {attempt}" in record.exc_text
    assert "hunter2" not in caplog.text
    assert "Traceback (most recent call last):" in caplog.text
    lines = (info.last_error or "").splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: cannot send the welcome mail"
    assert any(__file__ in line and "in handle" in line for line in lines)
    assert "ConnectionError: smtp://mailer:***@mail.internal refused attempt 2" in lines
    assert any("in _connect_to_mail_server" in line for line in lines)
    assert "hunter2" not in (info.last_error or "")


@pytest.mark.parametrize("mode", ["Auto", "Manual"])
async def test_a_cancelled_handler_that_winds_down_keeps_its_key_until_it_returns(
    pg_url: str, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that takes long to stop after a cancel (clean-up, or one that ignores it) holds
    its Exclusive key until it returns: its lease is renewed meanwhile, where it ran out and the
    sweeper discarded the delivery and ran the key's next message beside it (SPEC 4: Discarded as
    soon as the handler returns, freeing its key)."""
    queue, topic, subs = make_queue(pg_url, [{"role": "k", "lease_seconds": 3.0, "partition_mode": "Exclusive",
                                              "heartbeat_mode": mode}])
    started = asyncio.Event()
    spans: dict[int, list[float]] = {}
    reasons: list[AbortReason | None] = []
    loop = asyncio.get_running_loop()

    @queue.handler("k")
    async def handle(message: WorkMessage[dict[str, int]], context: WorkContext) -> WorkOutcome:
        n = message.payload["n"]
        spans[n] = [loop.time()]
        started.set()
        try:
            for _ in range(100 if n == 1 else 0):  # (Manual: the handler renews; Auto: the runtime does too)
                if not await context.heartbeat():
                    await asyncio.sleep(30)  # the runtime's cancel arrives meanwhile
                await asyncio.sleep(0.3)
        except asyncio.CancelledError:
            reasons.append(context.signal.reason)
            await asyncio.shield(asyncio.sleep(7.0))  # over two leases of clean-up
        spans[n].append(loop.time())
        return Outcome.complete()

    async with queue.lifespan(None):
        [first, _] = await queue.publish(topic, [PublishRequest(payload={"n": n}, partition_key="key") for n in (1, 2)])
        await asyncio.wait_for(started.wait(), 10)
        [running] = await queue.deliveries(subs["k"], "InFlight")
        assert (await queue.discard(subs["k"], running.delivery_id, "operator: stop")).cancel_requested
        await wait_for(lambda: len(spans.get(2, [])) == 2, within=30)
        info = await queue.transport.get_delivery(running.delivery_id)
    assert reasons == [AbortReason.CANCELLED]
    assert spans[2][0] >= spans[1][1], (spans, "the key's next message ran beside the cancelled one")
    assert info is not None and info.status == "Discarded" and info.reason == "operator: stop"
    assert info.message_id == first.message_id
    # The operator is told, once, why the delivery stays InFlight after the cancel.
    told = [m for m in caplog.messages if "was cancelled and its handler has not returned" in m]
    assert told == [f"{subs['k']}: delivery {running.delivery_id} was cancelled and its handler has not returned; it "
                    "keeps the delivery and its key until it does (a handler stops at context.signal; stopping this "
                    "process ends it)"]


async def test_operator_cancel_aborts_running_handler_and_discards(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The cancel arrives with a heartbeat (every lease/3). A lease of 0.9 s ran out on a loaded
    # machine before a renewal came back, and the handler ended LeaseLost instead.
    queue, topic, subs = make_queue(pg_url, [{"role": "slow", "lease_seconds": 3.0}])
    caplog.set_level(logging.INFO, logger="fastapi_workqueue")
    started = asyncio.Event()
    reasons: list[AbortReason | None] = []

    @queue.handler("slow")
    async def slow(message: WorkMessage[Any], context: WorkContext) -> WorkOutcome:
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            reasons.append(context.signal.reason)
        return Outcome.complete()

    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload=1)])
        await asyncio.wait_for(started.wait(), 10)
        [running] = await queue.deliveries(subs["slow"], "InFlight")
        action = await queue.discard(subs["slow"], running.delivery_id, "operator: hung")
        assert action.result == "CancelRequested" and action.cancel_requested
        info = await wait_for(lambda: _terminal(queue, subs["slow"], result.message_id))
    assert reasons == [AbortReason.CANCELLED]
    assert info.status == "Discarded" and info.reason == "operator: hung"
    [aborted] = [r for r in caplog.records if r.getMessage().endswith(f"{running.delivery_id} aborted (Cancelled)")]
    assert (aborted.__dict__["delivery_id"], aborted.__dict__["subscription"]) == (running.delivery_id, subs["slow"])


async def test_manual_heartbeat_reports_cancel_and_lost_lease_aborts(pg_url: str) -> None:
    queue, topic, subs = make_queue(
        pg_url,
        [
            {"role": "manual", "heartbeat_mode": "Manual", "lease_seconds": 0.6, "backoff_base_seconds": 0,
             "backoff_max_seconds": 0},
        ],
    )
    heartbeats: list[bool] = []
    reasons: list[AbortReason | None] = []
    attempts: list[int] = []

    @queue.handler("manual")
    async def manual(message: WorkMessage[str], context: WorkContext) -> WorkOutcome:
        attempts.append(context.attempt)
        if message.payload == "cancel-me":
            for _ in range(100):
                alive = await context.heartbeat({"Percent": 10, "Message": "working"})
                heartbeats.append(alive)
                if not alive:
                    return Outcome.complete()
                await asyncio.sleep(0.05)
        if message.payload == "stuck" and context.attempt == 1:
            # Never heartbeats: the lease runs out and the runtime aborts with LeaseLost.
            try:
                await asyncio.sleep(30)
            finally:
                reasons.append(context.signal.reason)
        return Outcome.complete()

    async with queue.lifespan(None):
        [cancel] = await queue.publish(topic, [PublishRequest(payload="cancel-me")])
        await wait_for(lambda: len(heartbeats) >= 3)
        [running] = await queue.deliveries(subs["manual"], "InFlight")
        progress = await queue.get_delivery(running.delivery_id)
        assert progress is not None and progress.progress_percent == 10 and progress.progress_message == "working"
        await queue.discard(subs["manual"], running.delivery_id, "stop")
        cancelled = await wait_for(lambda: _terminal(queue, subs["manual"], cancel.message_id))
        [stuck] = await queue.publish(topic, [PublishRequest(payload="stuck")])
        recovered = await wait_for(lambda: _terminal(queue, subs["manual"], stuck.message_id))
        # The first run's abort and the sweeper's expiry race; the abort follows within a moment.
        await wait_for(lambda: reasons)
    assert heartbeats[-1] is False and all(heartbeats[:-1])
    assert cancelled.status == "Discarded"
    assert reasons == [AbortReason.LEASE_LOST]
    assert recovered.status == "Completed" and recovered.attempt == 2


async def test_auto_heartbeat_keeps_a_long_handler_leased(pg_url: str) -> None:
    # A handler of 2.5 leases. (A lease of 0.6 s, renewed every 0.2 s, ran out on a loaded machine
    # when one renewal came 0.4 s late; at 2 s a renewal may be 1.3 s late.)
    queue, topic, subs = make_queue(pg_url, [{"role": "long", "lease_seconds": 2.0}])
    runs = 0

    @queue.handler("long")
    async def long(message: WorkMessage[Any], context: WorkContext) -> WorkOutcome:
        nonlocal runs
        runs += 1
        await asyncio.sleep(5.0)
        assert not context.signal.aborted
        return Outcome.complete()

    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload=1)])
        info = await wait_for(lambda: _terminal(queue, subs["long"], result.message_id))
    assert runs == 1
    assert info.status == "Completed" and info.attempt == 1


async def test_max_processing_seconds_aborts_and_counts_a_failed_attempt(pg_url: str) -> None:
    queue, topic, subs = make_queue(
        pg_url, [{"role": "cap", "max_processing_seconds": 0.3, "max_attempts": 2, "backoff_base_seconds": 0,
                  "backoff_max_seconds": 0}]
    )
    reasons: list[AbortReason | None] = []

    @queue.handler("cap")
    async def capped(message: WorkMessage[Any], context: WorkContext) -> WorkOutcome:
        try:
            await asyncio.sleep(30)
        finally:
            reasons.append(context.signal.reason)
        return Outcome.complete()

    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload=1)])
        info = await wait_for(lambda: _terminal(queue, subs["cap"], result.message_id))
    assert reasons == [AbortReason.MAX_PROCESSING_SECONDS] * 2
    assert info.status == "DeadLettered" and info.attempt == 2
    assert "max_processing_seconds" in (info.last_error or "")


async def test_shutdown_aborts_after_drain_and_releases_without_consuming_attempt(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "slow"}], shutdown_drain_ms=1000)
    started = asyncio.Event()
    reasons: list[AbortReason | None] = []
    quick_started, quick_done = asyncio.Event(), asyncio.Event()

    @queue.handler("slow")
    async def slow(message: WorkMessage[str], context: WorkContext) -> WorkOutcome:
        if message.payload == "quick":
            quick_started.set()
            await asyncio.sleep(0.05)
            quick_done.set()
            return Outcome.complete()
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            reasons.append(context.signal.reason)
        return Outcome.complete()

    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload="slow")])
        await asyncio.wait_for(started.wait(), 10)
        [quick] = await queue.publish(topic, [PublishRequest(payload="quick")])
        await asyncio.wait_for(quick_started.wait(), 10)  # both run when the shutdown begins
    # The quick handler finished inside the drain; the slow one was aborted and released.
    assert quick_done.is_set()
    assert reasons == [AbortReason.SHUTDOWN]
    await queue.open()
    try:
        info = await delivery_status(queue, subs["slow"], result.message_id)
        assert info.status == "Pending" and info.attempt == 0
        assert (await delivery_status(queue, subs["slow"], quick.message_id)).status == "Completed"
    finally:
        await queue.close()


async def test_a_handler_that_finishes_its_work_after_the_shutdowns_abort_completes_it(pg_url: str) -> None:
    """A handler that catches the shutdown's abort, finishes its work and returns
    ``Outcome.complete()`` within the second drain completes its delivery: it was released, and the
    work ran again after the restart. One that stops (raises, returns None or a retry) is released
    without spending a try."""
    queue, topic, subs = make_queue(pg_url, [{"role": "slow"}], shutdown_drain_ms=500)
    started: set[str] = set()
    runs: list[tuple[str, AbortReason | None]] = []

    @queue.handler("slow")
    async def slow(message: WorkMessage[str], context: WorkContext) -> WorkOutcome | None:
        started.add(message.payload)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            runs.append((message.payload, context.signal.reason))
            await asyncio.sleep(0.05)  # (finishes what it started)
            if message.payload == "finishes":
                return Outcome.complete()
            if message.payload == "retries":
                return Outcome.retry("stopped by the shutdown")
            if message.payload == "returns":
                return None  # (stops as asked: its work is not done)
            raise
        return Outcome.complete()

    async with queue.lifespan(None):
        kinds = ("finishes", "retries", "stops", "returns")
        results = await queue.publish(topic, [PublishRequest(payload=p) for p in kinds])
        await wait_for(lambda: len(started) == 4, within=10)
    assert sorted(runs) == sorted((p, AbortReason.SHUTDOWN) for p in kinds)
    await queue.open()
    try:
        finished, retried, stopped, returned = [await delivery_status(queue, subs["slow"], r.message_id)
                                                for r in results]
        assert (finished.status, finished.attempt) == ("Completed", 1)
        assert (retried.status, retried.attempt) == ("Pending", 0)
        assert (stopped.status, stopped.attempt) == ("Pending", 0)
        assert (returned.status, returned.attempt) == ("Pending", 0)
    finally:
        await queue.close()


@pytest.mark.parametrize("through", ["sessionmaker", "dependency"])
async def test_an_attempt_that_finds_no_free_session_goes_back_without_spending_a_try(
    pg_url: str, through: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Handlers that hold sessions longer than the pool's timeout, more at once than the pool has
    connections: the attempts that wait in vain for one go back without spending a try (they
    failed and were dead-lettered, healthy work lost to the process's own shortage), and the
    warning names the setting to raise."""
    from sqlalchemy import text

    queue, topic, subs = make_queue(pg_url, [{"role": "a", "max_attempts": 1}], concurrency=3,
                                    session_pool_size=1, session_pool_timeout_ms=200)
    done: list[int] = []

    async def hold(session: AsyncSession, n: int) -> None:
        await session.execute(text("SELECT 1"))
        await asyncio.sleep(0.5)
        done.append(n)

    if through == "sessionmaker":
        @queue.handler("a")
        async def handle(message: WorkMessage[int]) -> WorkOutcome:
            async with queue.sessionmaker() as session:
                await hold(session, message.payload)
            return Outcome.complete()
    else:
        @queue.handler("a")
        async def handle_with(message: WorkMessage[int], session: AsyncSession = queue.session) -> WorkOutcome:
            await hold(session, message.payload)
            return Outcome.complete()

    with caplog.at_level(logging.WARNING, logger="fastapi_workqueue.runtime"):
        async with queue.lifespan(None):
            await queue.publish(topic, [PublishRequest(payload=n) for n in range(4)])

            async def all_done() -> Any:
                [stats] = await queue.stats(subs["a"])
                return stats if stats.completed + stats.dead_lettered == 4 else None

            stats = await wait_for(all_done, within=30)
    assert (stats.completed, stats.dead_lettered) == (4, 0)
    assert sorted(done) == [0, 1, 2, 3]
    said = [r.getMessage() for r in caplog.records if "found no free database connection" in r.getMessage()]
    assert said and "WORKQUEUE_SESSION_POOL_SIZE" in said[0], said


async def test_a_handler_that_never_gets_a_session_spends_its_tries_after_a_few_free_give_backs(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sessions at once from a pool of one: the second never comes. Given back without a try
    for ever, the delivery would never end; after a few free give-backs it spends its tries."""
    from fastapi_workqueue.core import runtime

    monkeypatch.setattr(runtime, "POOL_FREE_GIVE_BACKS", 2)
    monkeypatch.setattr(runtime, "POOL_BUSY_RETRY_SECONDS", 0.05)
    queue, topic, subs = make_queue(pg_url, [{"role": "a", "max_attempts": 2}], concurrency=1,
                                    session_pool_size=1, session_pool_timeout_ms=100)
    runs: list[int] = []

    @queue.handler("a")
    async def handle(message: WorkMessage[int], session: AsyncSession = queue.session) -> WorkOutcome:
        runs.append(message.attempt)
        async with queue.sessionmaker() as second:
            await second.connection()
        return Outcome.complete()

    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload=1)])

        async def ended() -> Any:
            [stats] = await queue.stats(subs["a"])
            return stats if stats.dead_lettered else None

        await wait_for(ended, within=30)
    assert len(runs) == 2 + 2, runs  # (two free give-backs, then its two tries)


async def test_exclusive_keys_never_run_twice_at_once_in_one_process(pg_url: str) -> None:
    queue, topic, _ = make_queue(pg_url, [{"role": "x", "partition_mode": "Exclusive"}], concurrency=8)
    running: Counter[str] = Counter()
    overlaps: list[str] = []
    done: list[str] = []

    @queue.handler("x")
    async def handle(message: WorkMessage[int], context: WorkContext) -> WorkOutcome:
        key = message.partition_key or ""
        running[key] += 1
        if running[key] > 1:
            overlaps.append(key)
        await asyncio.sleep(0.01)
        running[key] -= 1
        done.append(key)
        return Outcome.complete()

    async with queue.lifespan(None):
        for batch in range(3):
            await queue.publish(topic, [PublishRequest(partition_key=f"k{i % 4}", payload=batch) for i in range(12)])
        await wait_for(lambda: len(done) == 36, within=20)
    assert overlaps == []


async def test_a_handler_key_cannot_be_registered_twice(pg_url: str) -> None:
    queue, _, _ = make_queue(pg_url, [{"role": "a"}])

    @queue.handler("a")
    async def first(message: WorkMessage[Any]) -> WorkOutcome:
        return Outcome.complete()

    with pytest.raises(ConfigurationError, match="already registered"):

        @queue.handler("a")
        async def second(message: WorkMessage[Any]) -> WorkOutcome:
            return Outcome.complete()


async def test_handler_signature_problems_are_refused_at_registration(pg_url: str) -> None:
    queue, _, _ = make_queue(pg_url, [{"role": "a"}])
    with pytest.raises(ConfigurationError, match="async"):
        queue.handler("sync")(lambda message: None)  # type: ignore[type-var]  # a sync handler, on purpose

    async def loose(message: WorkMessage[Any], limit: int) -> WorkOutcome:
        return Outcome.complete()

    with pytest.raises(ConfigurationError, match="limit"):
        queue.handler("loose")(loose)

    async def no_message(context: WorkContext) -> WorkOutcome:
        return Outcome.complete()

    with pytest.raises(ConfigurationError, match="WorkMessage"):
        queue.handler("nomsg")(no_message)

    async def like_a_job(payload: dict[str, Any]) -> None:  # (a job's shape: the payload itself)
        pass

    with pytest.raises(ConfigurationError, match=re.escape(
            "parameter 'payload' is annotated as the payload; a handler takes the message, which carries it: "
            "write message: WorkMessage[dict[str, Any]] and read message.payload")):
        queue.handler("payload")(like_a_job)


@pytest.mark.parametrize("store", ["pg", "sqlite"])
async def test_work_errors_raised_on_purpose_log_one_line_without_a_traceback(
    store: str, pg_url: str, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue, topic, subs = make_queue(pg_url if store == "pg" else sqlite_url, [
        {"role": "retry", "max_attempts": 2, "backoff_base_seconds": 0, "backoff_max_seconds": 0},
        {"role": "fatal"},
    ])

    @queue.handler("retry")
    async def retry(message: WorkMessage[str], context: WorkContext) -> None:
        try:
            raise ConnectionError("smtp://mail:hunter2@relay refused")
        except ConnectionError as exc:
            raise TransientWorkError("the relay is down", delay_seconds=0) from exc

    @queue.handler("fatal")
    async def fatal(message: WorkMessage[str], context: WorkContext) -> None:
        raise FatalWorkError("order 12 was cancelled")

    caplog.set_level(logging.INFO, logger="fastapi_workqueue.runtime")
    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload="x")])
        ended = {role: await wait_for(functools.partial(_terminal, queue, subs[role], result.message_id))
                 for role in ("retry", "fatal")}
    assert {info.status for info in ended.values()} == {"DeadLettered"}
    records = [r for r in caplog.records if r.name == "fastapi_workqueue.runtime" and "attempt" in r.getMessage()]
    lines = {(vars(r)["subscription"], vars(r)["attempt"]): (r.levelno, r.getMessage()) for r in records}
    assert all(r.exc_info is None and r.exc_text is None for r in records)  # no traceback
    retry_id = ended["retry"].delivery_id
    assert lines[(subs["retry"], 1)] == (logging.WARNING, (
        f"{subs['retry']}: delivery {retry_id} attempt 1 of 2: TransientWorkError: the relay is down "
        "(caused by ConnectionError: smtp://mail:***@relay refused); it will be retried"))
    assert lines[(subs["retry"], 2)][0] == logging.ERROR and lines[(subs["retry"], 2)][1].endswith("dead-lettering it")
    level, text = lines[(subs["fatal"], 1)]
    assert level == logging.ERROR
    assert text.endswith("attempt 1 of 5: FatalWorkError: order 12 was cancelled; dead-lettering it")
    assert "hunter2" not in caplog.text and "Traceback" not in caplog.text


def _charge_card(amount: int) -> None:
    raise LookupError(f"no card for amount {amount}")


async def test_an_unexpected_exception_logs_the_users_frames_first(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "h", "max_attempts": 1}])

    @queue.handler("h")
    async def handle(message: WorkMessage[str], context: WorkContext, amount: int = Depends(limit)) -> None:
        _charge_card(amount)

    caplog.set_level(logging.WARNING, logger="fastapi_workqueue.runtime")
    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload="x")])
        info = await wait_for(lambda: _terminal(queue, subs["h"], result.message_id))
    [record] = [r for r in caplog.records if r.name == "fastapi_workqueue.runtime" and r.exc_text]
    assert record.exc_text is not None
    lines = record.exc_text.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    # The queue's runtime, FastAPI's dependency solving and asyncio called the handler: one line.
    assert lines[1].startswith("  (") and lines[1].endswith("frames of the queue's calling code folded)")
    assert __file__ in lines[2] and "in handle" in lines[2]
    assert any("in _charge_card" in line for line in lines)
    assert not any("fastapi_workqueue" in line and "File" in line for line in lines)
    assert lines[-1] == "LookupError: no card for amount 42"
    # The stored error keeps every frame (an operator reading it wants the whole path).
    assert "fastapi_workqueue" in (info.last_error or "")


async def _terminal(queue: Any, subscription: str, message_id: Any) -> Any:
    info = await delivery_status(queue, subscription, message_id)
    if info is not None and info.status in ("Completed", "DeadLettered", "Discarded"):
        return info
    return None


def limit() -> int:
    return 42


async def test_annotated_dependencies_and_model_payloads(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "a"}])
    seen: list[tuple[Order, int]] = []

    @queue.handler("a")
    async def handle(message: WorkMessage[Order], cap: Annotated[int, Depends(limit)]) -> WorkOutcome:
        seen.append((message.payload, cap))
        return Outcome.complete()

    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload=Order(order_id=3, email="x@y.z"))])
        info = await wait_for(lambda: _terminal(queue, subs["a"], result.message_id))
    assert info.status == "Completed"
    assert seen == [(Order(order_id=3, email="x@y.z"), 42)]


async def test_context_once_runs_the_side_effect_once_across_retries(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "a", "backoff_base_seconds": 0, "backoff_max_seconds": 0}])
    sent: list[str] = []
    answers: list[bool] = []

    @queue.handler("a")
    async def handle(message: WorkMessage[str], context: WorkContext) -> WorkOutcome:
        async def send() -> None:
            sent.append(message.payload)

        answers.append(await context.once(f"welcome:{message.message_id}", send))
        if context.attempt == 1:
            raise TransientWorkError("the next step failed", delay_seconds=0)
        return Outcome.complete()

    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload="mail")])
        info = await wait_for(lambda: _terminal(queue, subs["a"], result.message_id))
    assert info.status == "Completed" and info.attempt == 2
    assert sent == ["mail"]
    assert answers == [True, False]


async def test_context_once_busy_key_releases_without_spending_an_attempt(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "a", "max_attempts": 1}])
    gate = asyncio.Event()
    entered = asyncio.Event()
    key = f"shared-{uuid.uuid4()}"

    @queue.handler("a")
    async def handle(message: WorkMessage[str], context: WorkContext) -> WorkOutcome:
        async def slow() -> None:
            entered.set()
            await gate.wait()

        await context.once(key, slow)
        return Outcome.complete()

    async with queue.lifespan(None):
        [first] = await queue.publish(topic, [PublishRequest(payload="first")])
        await asyncio.wait_for(entered.wait(), 10)
        [second] = await queue.publish(topic, [PublishRequest(payload="second")])

        async def second_released() -> Any:
            info = await delivery_status(queue, subs["a"], second.message_id)
            return info if info is not None and info.status == "Pending" and info.reason else None

        waiting = await wait_for(second_released)
        gate.set()
        done = await wait_for(lambda: _terminal(queue, subs["a"], first.message_id))
    assert done.status == "Completed"
    # Released for a few seconds without spending its only attempt.
    assert waiting.attempt == 0 and "being run by another attempt" in (waiting.reason or "")


async def test_slow_handlers_never_hold_more_than_concurrency(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "slow"}], concurrency=2)
    done: list[int] = []

    @queue.handler("slow")
    async def slow(message: WorkMessage[int]) -> WorkOutcome:
        await asyncio.sleep(0.12)
        done.append(message.payload)
        return Outcome.complete()

    most = 0
    async with queue.lifespan(None):
        assert queue.host is not None
        consumer = queue.host.consumers[subs["slow"]]
        await queue.publish(topic, [PublishRequest(payload=i) for i in range(8)])

        def all_done() -> bool:  # sampled every 5 ms: the most it ever held
            nonlocal most
            most = max(most, consumer.held)
            return len(done) == 8

        await wait_for(all_done, interval=0.005, describe=lambda: done)
    assert sorted(done) == list(range(8))
    assert most == 2  # nothing claimed ahead of free slots


async def test_fast_handlers_are_fed_ahead_and_all_complete(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "fast"}], concurrency=2)
    done: list[int] = []
    running = 0
    most_running = 0

    @queue.handler("fast")
    async def fast(message: WorkMessage[int]) -> WorkOutcome:
        nonlocal running, most_running
        running += 1
        most_running = max(most_running, running)
        await asyncio.sleep(0)
        running -= 1
        done.append(message.payload)
        return Outcome.complete()

    async with queue.lifespan(None):
        for batch in range(4):
            await queue.publish(topic, [PublishRequest(payload=batch * 500 + i) for i in range(500)])
        await wait_for(lambda: len(done) == 2000, within=30)
        assert queue.host is not None
        consumer = queue.host.consumers[subs["fast"]]
        claimed_ahead = consumer.claimed_total
    assert sorted(done) == list(range(2000))
    assert most_running <= 2  # concurrency bounds running handlers, whatever was claimed ahead
    assert claimed_ahead == 2000


async def test_pause_lets_running_handlers_finish_and_settle(pg_url: str) -> None:
    """A pause stops claiming; handlers already running are not aborted: they finish and settle."""
    queue, topic, subs = make_queue(pg_url, [{"role": "a"}], concurrency=2, reconcile_interval_ms=60_000)
    sub = subs["a"]
    started = asyncio.Event()
    release = asyncio.Event()
    aborts: list[Any] = []
    handled: list[str] = []

    @queue.handler("a")
    async def handle(message: WorkMessage[str], context: WorkContext) -> WorkOutcome:
        if message.payload == "slow":
            started.set()
            try:
                await release.wait()
            except asyncio.CancelledError:
                aborts.append(context.signal.reason)
                raise
        handled.append(message.payload)
        return Outcome.complete()

    async with queue.lifespan(None):
        [slow] = await queue.publish(topic, [PublishRequest(payload="slow")])
        await asyncio.wait_for(started.wait(), 10)
        assert await queue.pause(sub) is True
        # The process that paused reports it at once, with the handler still running.
        [health] = [h for h in queue.health().subscriptions if h.subscription == sub]
        assert health.state == "Paused"
        assert health.active == 1
        assert queue.host is not None
        consumer = queue.host.consumers[sub]
        # The claim loop has ended (it claims nothing until resumed), so what is published now stays Pending.
        await wait_for(lambda: consumer.claim_loop == "stopped", describe=lambda: consumer.claim_loop)
        await queue.publish(topic, [PublishRequest(payload="while paused")])
        release.set()
        info = await wait_for(lambda: _terminal(queue, sub, slow.message_id))
        assert info.status == "Completed" and info.attempt == 1
        assert aborts == [] and handled == ["slow"]
        [stats] = await queue.stats(sub)
        assert (stats.pending, stats.in_flight) == (1, 0)
        await queue.resume(sub)
        await wait_for(lambda: handled == ["slow", "while paused"])


async def test_the_sweeper_logs_each_lease_it_takes_back_with_its_holder(
    fresh_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from sqlalchemy import text

    from fastapi_workqueue.core.processes import current_process

    # A database of its own: on the session's, another queue still sweeping it can hold the sweep
    # lock (the pass then does not run) or the row, and CI once saw this pass take back nothing.
    store = "sqlite" if fresh_url.startswith("sqlite") else "pg"
    queue, topic, subs = make_queue(fresh_url, [{"role": "slow", "lease_seconds": 30}], sweeper_enabled=False,
                                    auto_migrate=True)
    caplog.set_level(logging.INFO, logger="fastapi_workqueue.host")
    async with queue.lifespan(None):  # no handler is registered: only the test claims
        await queue.publish(topic, [PublishRequest(payload="x")])
        [claimed] = await queue.transport.claim(subs["slow"], 1)
        past = ("UPDATE workqueue.delivery SET lease_expires_at = now() - interval '1 second' WHERE id = :id"
                if store == "pg" else "UPDATE delivery SET lease_expires_at = lease_expires_at - 3600 WHERE id = :id")
        async with queue.engine.begin() as conn:
            await conn.execute(text(past), {"id": int(claimed.delivery_id)})
        host = queue.host
        assert host is not None
        assert await host.sweep_once() >= 1
    me = current_process()
    [line] = [r.getMessage() for r in caplog.records
              if r.name == "fastapi_workqueue.host" and f"delivery {claimed.delivery_id} " in r.getMessage()]
    assert line == (f"sweeper: took back delivery {claimed.delivery_id} of {subs['slow']} on attempt 1 from "
                    f"{me.hostname} pid {me.pid}, whose lease ran out; it will be retried")


async def test_a_sweeper_pass_that_takes_back_many_leases_logs_the_first_and_counts_the_rest(
    fresh_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A crashed worker that held hundreds of deliveries costs the log 20 lines and one of counts by
    subscription, not a line each."""
    from sqlalchemy import text

    from fastapi_workqueue.core.host import TAKEN_BACK_LOGGED

    store = "sqlite" if fresh_url.startswith("sqlite") else "pg"
    queue, topic, subs = make_queue(fresh_url, [{"role": "a"}, {"role": "b"}], sweeper_enabled=False,
                                    auto_migrate=True)
    caplog.set_level(logging.INFO, logger="fastapi_workqueue.host")
    async with queue.lifespan(None):  # no handler is registered: only the test claims
        await queue.publish(topic, [PublishRequest(payload=i) for i in range(30)])
        claimed = [*await queue.transport.claim(subs["a"], 30), *await queue.transport.claim(subs["b"], 30)]
        past = ("UPDATE workqueue.delivery SET lease_expires_at = now() - interval '1 second' WHERE status = 'InFlight'"
                if store == "pg" else "UPDATE delivery SET lease_expires_at = lease_expires_at - 3600 "
                "WHERE status = 'InFlight'")
        async with queue.engine.begin() as conn:
            await conn.execute(text(past))
        host = queue.host
        assert host is not None
        assert await host.sweep_once() == len(claimed) == 60
    lines = [r.getMessage() for r in caplog.records
             if r.name == "fastapi_workqueue.host" and "sweeper:" in r.getMessage()]
    assert len(lines) == TAKEN_BACK_LOGGED + 1, lines
    assert all(line.startswith("sweeper: took back delivery ") for line in lines[:-1])
    named = Counter(line.split(" of ")[1].split(" ")[0] for line in lines[:-1])
    rest = {name: 30 - named[name] for name in subs.values()}
    shown = ", ".join(f"{n} of {name}" for name, n in sorted(rest.items()) if n)
    assert lines[-1] == f"sweeper: also took back 40 deliveries whose leases ran out in this pass ({shown})"


async def test_a_handler_that_returns_no_outcome_is_logged_at_each_attempt(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``return True`` (or a dict, a string) is a programming error: each attempt says so in the
    log, as a raised exception is (WARNING while it will be retried, ERROR when it dead-letters),
    not only the dead letter's stored error."""
    queue, topic, subs = make_queue(sqlite_url, [{"role": "r", "max_attempts": 2, "backoff_base_seconds": 0,
                                                  "backoff_max_seconds": 0}])

    @queue.handler("r")
    async def handle(message: WorkMessage[Any]) -> Any:
        return True

    caplog.set_level(logging.WARNING, logger="fastapi_workqueue")
    async with queue.lifespan(None):
        [published] = await queue.publish(topic, [PublishRequest(payload=1)])
        info = await wait_for(lambda: _terminal(queue, subs["r"], published.message_id))
    assert info.status == "DeadLettered"
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "the handler returned True" in r.getMessage()]
    tail = "the handler returned True; return Outcome.complete(), Outcome.retry(...), Outcome.dead_letter(...) or " \
           "Outcome.discard(...)"
    assert said == [
        (logging.WARNING, f"{subs['r']}: delivery {info.delivery_id} attempt 1 of 2: {tail}; it will be retried"),
        (logging.ERROR, f"{subs['r']}: delivery {info.delivery_id} attempt 2 of 2: {tail}; dead-lettering it"),
    ]
