"""Task scopes: every background task of the library belongs to an owner that ends it.

A :class:`TaskScope` holds the tasks one owner starts (the host's loops, a consumer's claim loop,
heartbeat and handlers, the settler, a listener, a relay). The owner closes the scope when it
stops: what still runs is cancelled and awaited, so no task outlives the object that started it,
no task is collected while it runs, and no failure goes unseen (it is logged, and the owner's
``on_error`` hears of it).

Why not ``asyncio.TaskGroup`` (or anyio's, which the library therefore does not depend on): both
are the right tool for a block of code that waits for all of its children. A scope differs in four
ways the queue's rules need:

- **Bounded close.** A handler that swallows ``CancelledError`` must not hold shutdown: SPEC §4
  gives running work the drain time, then releases what ignored Shutdown and stops. A task group
  waits for such a child without end; :meth:`TaskScope.close` waits ``grace`` seconds, then leaves
  the task behind with a warning (its delivery was released by its owner).
- **A failure stays with its task.** A task group cancels every sibling, and the task that opened
  it (the app's lifespan), when one child fails. A scope logs the failure and tells the owner,
  which decides (a consumer restarts its claim loop; the host reports the subscription in Error).
- **The caller's exception stays itself.** A block inside ``async with asyncio.TaskGroup()`` that
  raises comes out as an ``ExceptionGroup``; a job's overlap lock keeps its renewal in a scope so
  that the job's own exception reaches the settle unchanged.
- **Starting from a callback.** Consumers start handlers from synchronous callbacks (a claim
  landing, a slot freed); :meth:`TaskScope.spawn` is synchronous and needs no ``async with`` around
  the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .redaction import redacting_logger

log = redacting_logger("fastapi_workqueue.tasks")

T = TypeVar("T")


class ScopeClosed(RuntimeError):
    """A task was started in a scope that its owner already closed."""


class TaskScope:
    """The tasks of one owner: started with :meth:`spawn`, ended together by :meth:`close`.

    ``on_error(task, exc)`` hears of a task that ended with an exception (after it was logged).
    """

    def __init__(self, name: str, *, on_error: Callable[[asyncio.Task[Any], BaseException], None] | None = None
                 ) -> None:
        self.name = name
        self._on_error = on_error
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def reopen(self) -> None:
        """Lets a stopped owner start again (a listener reconnecting, a host started twice)."""
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None, watch: bool = True
              ) -> asyncio.Task[T]:
        """Starts ``coro`` as a task of this scope. Raises :class:`ScopeClosed` after :meth:`close`.

        ``watch=False``: the caller awaits the task and takes its exception itself; the scope only
        owns it (cancels it at close) and does not log it."""
        if self._closed:
            coro.close()
            raise ScopeClosed(f"{self.name}: cannot start {name or 'a task'}: the scope is closed")
        task = asyncio.get_running_loop().create_task(coro, name=name or f"{self.name}-task")
        self._tasks.add(task)
        task.add_done_callback(self._done if watch else self._tasks.discard)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        log.error("%s: task %s failed", self.name, task.get_name(), exc_info=exc)
        if self._on_error is not None:
            self._on_error(task, exc)

    def cancel(self) -> None:
        """Asks every task of the scope to stop, without waiting (:meth:`close` waits)."""
        for task in self._tasks:
            task.cancel()

    async def close(self, grace: float | None = None, *, finish_within: float = 0.0) -> None:
        """Ends the scope: lets its tasks run ``finish_within`` seconds more to end on their own,
        then cancels what still runs and waits for it (at most ``grace`` seconds when given, after
        which tasks that ignore cancellation are left behind with a warning)."""
        self._closed = True
        if finish_within > 0 and self._tasks:
            await asyncio.wait(list(self._tasks), timeout=finish_within)
        await cancel_and_wait(list(self._tasks), grace=grace, owner=self.name)

    async def join(self) -> None:
        """Waits until every task of the scope ended on its own (no cancel)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))


async def cancel_and_wait(tasks: list[asyncio.Task[Any]], *, grace: float | None = None,
                          owner: str = "fastapi_workqueue") -> None:
    """Cancels ``tasks`` and waits for them (``grace`` seconds at most). The caller's own
    cancellation still reaches it: cancelling the wait does not wait for the tasks."""
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    _, still = await asyncio.wait(pending, timeout=grace)
    if still:
        log.warning("%s: %d task(s) ignored cancellation and were left behind: %s", owner, len(still),
                    ", ".join(sorted(t.get_name() for t in still)))
    for task in pending:
        if task.done() and not task.cancelled():
            with contextlib.suppress(BaseException):
                task.exception()  # seen: no "exception was never retrieved" at exit
