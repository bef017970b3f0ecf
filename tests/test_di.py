"""Handler dependencies: the whole graph is checked at registration, and what runs sees the app.

This module also runs on the lowest FastAPI the project supports (``scripts/test`` makes
``.venv-fastapi-min`` for it), so it needs only SQLite: keep it quick and free of PostgreSQL.
"""

# No ``from __future__ import annotations``: the handlers below name local dependencies in Annotated.

from collections.abc import AsyncIterator
from typing import Annotated, Any

import pytest
from fastapi import BackgroundTasks, Body, Depends, FastAPI, Header, Request
from fastapi.security import SecurityScopes

from fastapi_workqueue import (
    ConfigurationError,
    FatalWorkError,
    Outcome,
    PublishRequest,
    WorkContext,
    WorkMessage,
    WorkOutcome,
    current_context,
    current_message,
)

from .support import make_queue, wait_for

pytestmark = pytest.mark.timeout(60)


async def get_token(token: str) -> str:  # `token` would be a query parameter of a route
    return token


async def get_user(token: str = Depends(get_token)) -> str:
    return f"user of {token}"


async def get_settings(request: Request) -> Any:
    return request.app.state.settings


def test_a_nested_dependency_that_needs_a_query_parameter_is_refused_at_registration(sqlite_url: str) -> None:
    queue, _, _ = make_queue(sqlite_url, [{"role": "a"}])
    with pytest.raises(ConfigurationError) as raised:

        @queue.handler("x")
        async def handle(message: WorkMessage[Any], user: str = Depends(get_user)) -> WorkOutcome:
            return Outcome.complete()

    text = str(raised.value)
    assert text.startswith("handler 'x' -> get_user -> get_token -> token: a query parameter;"), text
    assert "may take only other dependencies, Request" in text
    assert "x" not in queue.handlers


@pytest.mark.parametrize(
    ("make_dependency", "path", "kind"),
    [
        (lambda: load, "load -> order", "a request body"),
        (lambda: agent, "agent -> user_agent", "a header"),
        (lambda: later, "later -> tasks", "BackgroundTasks"),
    ],
    ids=["body", "header", "background-tasks"],
)
def test_every_request_only_parameter_is_named_with_its_path(
    sqlite_url: str, make_dependency: Any, path: str, kind: str
) -> None:
    queue, _, _ = make_queue(sqlite_url, [{"role": "a"}])
    dependency = make_dependency()

    async def outer(value: Any = Depends(dependency)) -> Any:
        return value

    with pytest.raises(ConfigurationError, match=rf"^handler 'k' -> outer -> {path}: {kind}"):

        @queue.handler("k")
        async def handle(message: WorkMessage[Any], value: Any = Depends(outer)) -> None:
            return None


async def load(order: Annotated[dict[str, Any], Body()]) -> Any:
    return order


async def agent(user_agent: Annotated[str, Header()]) -> str:
    return user_agent


async def later(tasks: BackgroundTasks) -> BackgroundTasks:
    return tasks


def test_what_a_handler_may_take_and_which_handlers_need_an_app(sqlite_url: str) -> None:
    queue, _, _ = make_queue(sqlite_url, [{"role": "a"}])

    async def scoped(scopes: SecurityScopes, message: WorkMessage[Any] = Depends(current_message),
                     context: WorkContext = Depends(current_context)) -> str:
        return f"{message.message_id} {context.attempt} {scopes.scopes}"

    @queue.handler("plain")
    async def plain(message: WorkMessage[Any], note: str = Depends(scoped)) -> None:
        return None

    @queue.handler("app")
    async def with_app(message: WorkMessage[Any], settings: Any = Depends(get_settings)) -> None:
        return None

    invoker: Any = queue.kernel.injector
    assert invoker.app_needed_by(queue.handlers.get("plain")) is None
    assert invoker.app_needed_by(queue.handlers.get("app")) == "handler 'app' -> get_settings -> request"


async def test_handlers_see_the_app_state_and_its_dependency_overrides(sqlite_url: str) -> None:
    queue, topic, subs = make_queue(sqlite_url, [{"role": "a"}])
    seen: list[tuple[str, str, int]] = []
    events: list[str] = []

    async def real_mailer() -> AsyncIterator[str]:
        events.append("real")
        yield "smtp"

    async def fake_mailer() -> AsyncIterator[str]:
        events.append("fake opened")
        try:
            yield "fake"
        finally:
            events.append("fake closed")

    async def tagged(context: WorkContext = Depends(current_context)) -> int:
        return context.attempt

    @queue.handler("a")
    async def handle(
        message: WorkMessage[Any],
        mailer: Annotated[str, Depends(real_mailer)],
        settings: Any = Depends(get_settings),
        attempt: int = Depends(tagged),
    ) -> WorkOutcome:
        seen.append((mailer, settings, attempt))
        return Outcome.complete()

    app = FastAPI(lifespan=queue.lifespan)
    app.state.settings = "from the app"
    app.dependency_overrides[real_mailer] = fake_mailer
    async with queue.lifespan(app):
        await queue.publish(topic, [PublishRequest(payload=1)])
        await wait_for(lambda: seen)
        app.dependency_overrides.clear()
        await queue.publish(topic, [PublishRequest(payload=2)])
        await wait_for(lambda: len(seen) == 2)

        async def completed() -> bool:
            [stats] = await queue.stats(subs["a"])
            return stats.completed == 2

        await wait_for(completed)
    assert seen == [("fake", "from the app", 1), ("smtp", "from the app", 1)]
    assert events == ["fake opened", "fake closed", "real"]


async def test_a_lifespan_entered_without_the_app_still_sees_its_overrides() -> None:
    """docs/testing.md enters ``queue.lifespan()`` with no app; docs/handlers.md says
    ``app.dependency_overrides`` applies to handlers. The app whose lifespan is the queue's had its
    overrides ignored there, in silence, and the test ran the real mailer. Two apps that serve the
    queue leave it with none (whose overrides would it be?)."""
    from fastapi_workqueue import Subscription, Topic, WorkQueue, WorkQueueSettings
    from fastapi_workqueue.testing import MemoryTransport

    def real_mailer() -> str:
        return "real"

    async def sent_with(apps: int) -> list[str]:
        queue = WorkQueue(WorkQueueSettings(database_url=None), transport=MemoryTransport(),
                          topics=[Topic(name="signups")],
                          subscriptions=[Subscription(name="signups.welcome", topic="signups", handler_key="welcome")])
        sent: list[str] = []

        @queue.handler("welcome")
        async def welcome(message: WorkMessage[Any], mailer: str = Depends(real_mailer)) -> None:
            sent.append(mailer)

        made = [FastAPI(lifespan=queue.lifespan) for _ in range(apps)]
        for app in made:
            app.dependency_overrides[real_mailer] = lambda: "fake"
        async with queue.lifespan():
            await queue.publish("signups", [PublishRequest(payload={"email": "a@example.com"})])
            await wait_for(lambda: sent)
        return sent

    assert await sent_with(1) == ["fake"]
    assert await sent_with(2) == ["real"]


async def test_a_plain_starlette_app_runs_handlers_with_dependencies(sqlite_url: str) -> None:
    """A Starlette app (no ``dependency_overrides``) hosts handlers that take dependencies: they see
    its state, and nothing is overridden."""
    from starlette.applications import Starlette

    queue, topic, subs = make_queue(sqlite_url, [{"role": "a"}])
    seen: list[tuple[str, Any]] = []

    async def mailer() -> AsyncIterator[str]:
        yield "smtp"

    @queue.handler("a")
    async def handle(message: WorkMessage[Any], m: str = Depends(mailer),
                     settings: Any = Depends(get_settings)) -> WorkOutcome:
        seen.append((m, settings))
        return Outcome.complete()

    app = Starlette(lifespan=queue.lifespan)
    app.state.settings = "from the starlette app"
    async with queue.lifespan(app):
        await queue.publish(topic, [PublishRequest(payload=1)])
        await wait_for(lambda: seen)

        async def completed() -> bool:
            [stats] = await queue.stats(subs["a"])
            return stats.completed == 1

        await wait_for(completed)
    assert seen == [("smtp", "from the starlette app")]


async def test_a_yield_dependency_that_swallows_the_handlers_exception_does_not_turn_it_into_a_success(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``try: yield … except Exception: rollback()`` without raising again: FastAPI answers such a
    request 500. The attempt ends as the handler's exception says (a FatalWorkError dead-letters
    at once), the dependency's cleanup ran, and a warning says what to change."""
    queue, topic, subs = make_queue(sqlite_url, [{"role": "a"}])
    events: list[str] = []

    async def unit_of_work() -> AsyncIterator[str]:
        try:
            yield "uow"
        except Exception as exc:
            events.append(f"rolled back after {type(exc).__name__}")  # and no raise

    @queue.handler("a")
    async def handle(message: WorkMessage[Any], uow: Annotated[str, Depends(unit_of_work)]) -> WorkOutcome:
        raise FatalWorkError("the order does not exist")

    caplog.set_level("WARNING", logger="fastapi_workqueue.handlers")
    async with queue.lifespan(FastAPI(lifespan=queue.lifespan)):
        await queue.publish(topic, [PublishRequest(payload=1)])

        async def settled() -> Any:
            [stats] = await queue.stats(subs["a"])
            return stats if stats.dead_lettered + stats.completed else None

        stats = await wait_for(settled)
    assert (stats.dead_lettered, stats.completed) == (1, 0)
    assert events == ["rolled back after FatalWorkError"]
    [warning] = [r.getMessage() for r in caplog.records if "did not raise it again" in r.getMessage()]
    assert warning.startswith("'a") and "caught the FatalWorkError raised under it" in warning


async def test_a_swallowed_exception_rolls_back_the_request_session_and_one_raised_by_a_dependency_fails_too(
    sqlite_url: str,
) -> None:
    """A unit of work over ``queue.session`` (declared ``scope="function"``, as it must be) that
    catches the handler's exception: the session's dependency sees none, yet what the handler wrote
    is rolled back, not committed before the attempt fails. And a dependency that raises while the
    others are solved, caught by one entered before it, fails the attempt with its own error."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession

    queue, topic, subs = make_queue(sqlite_url, [{"role": "a"}, {"role": "b", "max_attempts": 1}])

    async def unit_of_work(session: AsyncSession = queue.session) -> AsyncIterator[AsyncSession]:
        try:  # noqa: SIM105 (the pattern under test: caught, and no raise)
            yield session
        except Exception:
            pass

    @queue.handler("a")
    async def handle(message: WorkMessage[Any],
                     session: AsyncSession = Depends(unit_of_work, scope="function")) -> WorkOutcome:
        await session.execute(text("INSERT INTO di_rows (n) VALUES (1)"))
        raise FatalWorkError("after the write")

    async def lenient() -> AsyncIterator[str]:
        try:  # noqa: SIM105 (caught, and no raise)
            yield "lenient"
        except Exception:
            pass

    async def broken(first: str = Depends(lenient)) -> str:
        raise LookupError("the account service is down")

    @queue.handler("b")
    async def needs_broken(message: WorkMessage[Any], value: str = Depends(broken)) -> WorkOutcome:
        return Outcome.complete()

    async with queue.lifespan(FastAPI(lifespan=queue.lifespan)):
        async with queue.engine.begin() as conn:
            await conn.execute(text("CREATE TABLE di_rows (n INTEGER)"))
        await queue.publish(topic, [PublishRequest(payload=1)])

        async def dead(role: str) -> Any:
            [stats] = await queue.stats(subs[role])
            return stats if stats.dead_lettered + stats.completed else None

        a = await wait_for(lambda: dead("a"))
        assert (a.dead_lettered, a.completed) == (1, 0)
        async with queue.engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM di_rows"))).scalar_one() == 0
        b = await wait_for(lambda: dead("b"))
        assert b.completed == 0 and b.dead_lettered == 1
        [letter] = await queue.dead_letters(subs["b"])
        assert letter.last_error is not None and "LookupError: the account service is down" in letter.last_error



async def test_depends_of_queue_session_is_the_request_session_committed_before_the_response(
    sqlite_url: str,
) -> None:
    """``Depends(queue.session)``, the spelling FastAPI users reach for, is the same dependency as
    ``= queue.session``: one session a request, its publish committed with the row before the
    response, both rolled back when the endpoint raises; and a handler may take it the same way."""
    import warnings

    import httpx
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession

    queue, topic, subs = make_queue(sqlite_url, [{"role": "a"}])
    seen: list[bool] = []

    @queue.handler("a")
    async def handle(message: WorkMessage[Any], session: AsyncSession = Depends(queue.session)) -> WorkOutcome:
        seen.append(session.in_transaction())
        return Outcome.complete()

    app = FastAPI(lifespan=queue.lifespan)

    @app.post("/rows/{n}")
    async def add(n: int, same: Annotated[AsyncSession, queue.session],
                  session: AsyncSession = Depends(queue.session),
                  plain: AsyncSession = queue.session) -> dict[str, Any]:
        await session.execute(text("INSERT INTO dep_rows (n) VALUES (:n)"), {"n": n})
        await queue.publish(topic, [PublishRequest(payload=n)])
        if n < 0:
            raise LookupError("after the write and the publish")
        return {"one_session": session is same is plain}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with queue.lifespan(app):
        async with queue.engine.begin() as conn:
            await conn.execute(text("CREATE TABLE dep_rows (n INTEGER)"))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            ok = await client.post("/rows/1")
            assert ok.status_code == 200 and ok.json() == {"one_session": True}
            # (committed before the response: the row is there as soon as the answer is)
            async with queue.engine.connect() as conn:
                assert (await conn.execute(text("SELECT count(*) FROM dep_rows"))).scalar_one() == 1
            failed = await client.post("/rows/-1")
            assert failed.status_code == 500

        async def done() -> Any:
            [stats] = await queue.stats(subs["a"])
            return stats if stats.completed else None

        stats = await wait_for(done)
        assert stats.completed == 1 and seen == [True]
        async with queue.engine.connect() as conn:
            assert (await conn.execute(text("SELECT n FROM dep_rows"))).scalars().all() == [1]
        [stats] = await queue.stats(subs["a"])
        assert stats.completed == 1 and stats.pending == 0
