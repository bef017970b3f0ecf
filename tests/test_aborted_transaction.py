"""A publish in a transaction that a caught error has aborted is never answered Accepted in silence.

PostgreSQL answers the COMMIT of an aborted transaction (a statement failed, the caller caught the
error and went on) with a rollback and no error: a publish made in it would leave the caller with
the MessageID of a message that never existed. The commit raises ``TransactionAborted`` instead,
in a request's ``queue.session``, in a handler's, and in a session of the application's own; a
failure inside a savepoint (which leaves the transaction whole) commits as usual.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue import (
    Outcome,
    PublishRequest,
    TransactionAborted,
    WorkContext,
    WorkMessage,
    WorkOutcome,
)

from .support import make_queue, wait_for

pytestmark = pytest.mark.timeout(60)


async def _known(queue: Any, message_id: uuid.UUID) -> bool:
    async with queue.sessionmaker() as session:
        found: int | None = await session.scalar(
            text("SELECT count(*) FROM workqueue.message WHERE id = :i"), {"i": message_id})
    return found == 1


async def test_a_request_that_caught_a_failed_statement_is_not_committed_in_silence(pg_url: str) -> None:
    queue, topic, _ = make_queue(pg_url, [{"role": "a"}], enabled=False)
    app = FastAPI(lifespan=queue.lifespan)
    ids: dict[str, uuid.UUID] = {}

    @app.post("/tolerant/{way}")
    async def tolerant(way: str, session: AsyncSession = queue.session) -> dict[str, str]:
        [result] = await queue.publish(topic, [PublishRequest(payload={"way": way})])
        assert result.message_id is not None
        ids[way] = result.message_id
        if way == "savepoint":
            with contextlib.suppress(DBAPIError):  # the savepoint rolls back: the transaction is whole
                async with session.begin_nested():
                    await session.execute(text("SELECT 1 / 0"))
        else:
            with contextlib.suppress(DBAPIError):  # the transaction is aborted: PostgreSQL rolls it back at COMMIT
                await session.execute(text("SELECT 1 / 0"))
        return {"status": result.status.value}

    async with queue.lifespan(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            aborted = await http.post("/tolerant/aborted")
            kept = await http.post("/tolerant/savepoint")
        assert aborted.status_code == 500  # not 200 with a MessageID that never existed
        assert not await _known(queue, ids["aborted"])
        assert kept.status_code == 200 and await _known(queue, ids["savepoint"])


async def test_an_own_session_whose_transaction_aborted_refuses_its_commit(pg_url: str) -> None:
    queue, topic, _ = make_queue(pg_url, [{"role": "a"}], enabled=False)
    async with queue.lifespan(None):
        async with queue.sessionmaker() as session:
            await session.execute(text("SELECT 1"))
            [result] = await queue.publish(topic, [PublishRequest(payload=1)], session=session)
            with pytest.raises(DBAPIError):
                await session.execute(text("SELECT 1 / 0"))
            with pytest.raises(TransactionAborted, match="inside a savepoint"):
                await session.commit()
            with pytest.raises(TransactionAborted):  # (a second commit of it too: never a silent rollback)
                await session.commit()
        assert result.message_id is not None and not await _known(queue, result.message_id)
        async with queue.sessionmaker() as session:  # the same session class afterwards: commits as before
            [later] = await queue.publish(topic, [PublishRequest(payload=2)], session=session)
            await session.commit()
        assert later.message_id is not None and await _known(queue, later.message_id)


async def test_a_handler_whose_follow_up_transaction_aborted_is_retried_not_completed(pg_url: str) -> None:
    queue, topic, subs = make_queue(pg_url, [{"role": "first", "max_attempts": 3, "backoff_base_seconds": 0},
                                             {"role": "after"}], concurrency=1)
    after_topic = topic  # (the follow-up goes to the same topic; "after" records what arrives)
    seen: list[Any] = []
    attempts: list[int] = []

    @queue.handler("first")
    async def first(message: WorkMessage[Any], context: WorkContext,
                    session: AsyncSession = queue.session) -> WorkOutcome:
        if message.payload.get("follow_up"):
            return Outcome.complete()
        attempts.append(context.attempt)
        await queue.publish(after_topic, [PublishRequest(payload={"follow_up": context.attempt})])
        if context.attempt == 1:
            with contextlib.suppress(DBAPIError):
                await session.execute(text("SELECT 1 / 0"))
        return Outcome.complete()

    @queue.handler("after")
    async def after(message: WorkMessage[Any]) -> WorkOutcome:
        if message.payload.get("follow_up"):
            seen.append(message.payload["follow_up"])
        return Outcome.complete()

    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload={"start": True})])
        await wait_for(lambda: seen, within=20)
        await wait_for(lambda: len(attempts) >= 2, within=20)
    assert attempts[:2] == [1, 2] and seen == [2]  # the first attempt's follow-up was never Accepted in silence
    assert subs["first"]


async def test_a_connection_whose_transaction_aborted_refuses_its_commit(pg_url: str) -> None:
    """The same with a bare ``AsyncConnection`` (``engine.begin()``): its commit raises
    ``TransactionAborted`` instead of rolling back the publish in silence; a failure inside a
    savepoint commits as usual."""
    from sqlalchemy.ext.asyncio import create_async_engine

    queue, topic, _ = make_queue(pg_url, [{"role": "a"}], enabled=False)
    engine = create_async_engine(pg_url)
    try:
        async with queue.lifespan(None):
            with pytest.raises(TransactionAborted, match="inside a savepoint"):
                async with engine.begin() as conn:
                    [lost] = await queue.publish(topic, [PublishRequest(payload=1)], session=conn)
                    with pytest.raises(DBAPIError):
                        await conn.execute(text("SELECT 1 / 0"))
            assert lost.message_id is not None and not await _known(queue, lost.message_id)
            async with engine.begin() as conn:  # a savepoint's failure leaves the transaction whole
                [kept] = await queue.publish(topic, [PublishRequest(payload=2)], session=conn)
                with contextlib.suppress(DBAPIError):
                    async with conn.begin_nested():
                        await conn.execute(text("SELECT 1 / 0"))
            assert kept.message_id is not None and await _known(queue, kept.message_id)
            async with engine.begin() as conn:  # (the same connection from the pool: commits as before)
                [later] = await queue.publish(topic, [PublishRequest(payload=3)], session=conn)
            assert later.message_id is not None and await _known(queue, later.message_id)
    finally:
        await engine.dispose()
