"""Task scopes: every background task has an owner that ends it, and the host is an async context
manager that owns its loops and its consumers."""

from __future__ import annotations

import ast
import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import PublishRequest, WorkMessage
from fastapi_workqueue.core.tasks import ScopeClosed, TaskScope, cancel_and_wait

from .support import make_queue, wait_for

PACKAGE = Path(__file__).resolve().parent.parent / "fastapi_workqueue"


async def test_close_cancels_what_runs_and_waits_for_it() -> None:
    scope = TaskScope("test")
    ended: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(name)

    scope.spawn(forever("a"), name="a")
    scope.spawn(forever("b"), name="b")
    await asyncio.sleep(0)
    assert len(scope) == 2
    await scope.close()
    assert sorted(ended) == ["a", "b"]
    assert len(scope) == 0


async def test_a_finished_task_leaves_the_scope_and_its_failure_is_logged_and_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heard: list[tuple[str, str]] = []
    scope = TaskScope("owner", on_error=lambda task, exc: heard.append((task.get_name(), str(exc))))

    async def fails() -> None:
        raise RuntimeError("boom")

    async def sibling() -> None:
        await asyncio.Event().wait()

    other = scope.spawn(sibling(), name="sibling")
    task = scope.spawn(fails(), name="failing")
    with caplog.at_level(logging.ERROR, logger="fastapi_workqueue.tasks"):
        await asyncio.wait([task])
        await asyncio.sleep(0)
    assert heard == [("failing", "boom")]
    assert "owner: task failing failed" in caplog.text
    # A failure stays with its task: the sibling still runs, and only it is left in the scope.
    assert not other.done()
    assert len(scope) == 1
    await scope.close()
    assert other.cancelled()


async def test_an_unwatched_task_is_owned_but_its_exception_is_the_callers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scope = TaskScope("owner")

    async def fails() -> None:
        raise ValueError("the caller's")

    with caplog.at_level(logging.ERROR, logger="fastapi_workqueue.tasks"):
        task = scope.spawn(fails(), watch=False)
        with pytest.raises(ValueError, match="the caller's"):
            await task
    assert "failed" not in caplog.text
    assert len(scope) == 0


async def test_a_closed_scope_refuses_new_tasks_until_it_is_reopened() -> None:
    scope = TaskScope("owner")
    await scope.close()

    async def work() -> int:
        return 7

    with pytest.raises(ScopeClosed, match="owner: cannot start job: the scope is closed"):
        scope.spawn(work(), name="job")
    scope.reopen()
    assert await scope.spawn(work()) == 7


async def test_close_leaves_behind_a_task_that_ignores_cancellation_after_its_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()
    cancels = 0

    async def stubborn() -> None:
        nonlocal cancels
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancels += 1  # swallowed: a handler that ignores Shutdown

    scope = TaskScope("owner")
    task = scope.spawn(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="fastapi_workqueue.tasks"):
        await scope.close(grace=0.05)
    assert cancels == 1
    assert not task.done()
    assert "owner: 1 task(s) ignored cancellation and were left behind: stubborn" in caplog.text
    release.set()
    await task


async def test_finish_within_lets_tasks_end_on_their_own_before_cancelling() -> None:
    scope = TaskScope("owner")
    step = asyncio.Event()
    results: list[str] = []

    async def quick() -> None:
        await step.wait()
        results.append("finished")

    async def slow() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            results.append("cancelled")
            raise

    scope.spawn(quick())
    scope.spawn(slow())
    asyncio.get_running_loop().call_soon(step.set)
    await scope.close(finish_within=0.2)
    assert results == ["finished", "cancelled"]


async def test_join_waits_for_tasks_to_end_without_cancelling_them() -> None:
    scope = TaskScope("owner")
    done: list[int] = []

    async def work(n: int) -> None:
        for _ in range(n):
            await asyncio.sleep(0)
        done.append(n)

    for n in (3, 1, 2):
        scope.spawn(work(n))
    await scope.join()
    assert sorted(done) == [1, 2, 3]


async def test_cancelling_the_waiter_does_not_wait_for_the_tasks() -> None:
    inner_started, cancel_ignored = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        inner_started.set()
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancel_ignored.set()
                continue

    scope = TaskScope("owner")
    task = scope.spawn(stubborn(), watch=False)
    await inner_started.wait()
    waiter = asyncio.get_running_loop().create_task(cancel_and_wait([task]))
    await asyncio.wait_for(cancel_ignored.wait(), 5)  # the waiter cancelled it and now waits for its end
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not task.done()
    # End it for good: a coroutine's close() raises GeneratorExit inside it.
    task.get_coro().close()
    await asyncio.sleep(0)


def _task_starts(tree: ast.AST) -> list[int]:
    """Lines that start a task outside a scope: create_task or ensure_future called by any name."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("create_task", "ensure_future"):
                lines.append(node.lineno)
    return lines


def test_no_task_is_started_outside_a_scope() -> None:
    loose = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "tasks.py" and (lines := _task_starts(ast.parse(path.read_text())))
    }
    assert loose == {}, f"start tasks through a TaskScope (core/tasks.py), not create_task/ensure_future: {loose}"


def test_the_scope_is_the_one_place_that_starts_a_task() -> None:
    assert _task_starts(ast.parse((PACKAGE / "core" / "tasks.py").read_text())), (
        "the structural test above must see the scope's own create_task, or it checks nothing"
    )


async def test_the_host_is_an_async_context_manager_that_ends_its_loops(tmp_path: Path) -> None:
    queue, topic, names = make_queue(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", [{"role": "mail"}])
    seen: list[Any] = []

    @queue.handler("mail")
    async def mail(message: WorkMessage[Any]) -> None:
        seen.append(message.payload)

    await queue.open()
    try:
        await queue.publish(topic, [PublishRequest(payload={"n": 1})])
        before = {t.get_name() for t in asyncio.all_tasks()}
        async with queue.build_host() as host:
            assert [h.state for h in host.health()] == ["Running"]
            started = {t.get_name() for t in asyncio.all_tasks()} - before
            assert "workqueue-reconcile" in started
            assert f"workqueue-claim:{names['mail']}" in started
            await wait_for(lambda: bool(seen))
        assert seen == [{"n": 1}]
        left = {t.get_name() for t in asyncio.all_tasks() if not t.done()} - before
        assert {n for n in left if n.startswith("workqueue-")} <= {"workqueue-notify"}
        assert not host.consumers
    finally:
        await queue.close()
