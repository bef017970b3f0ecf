"""What an operator command runs on: the database alone (``--database-url``), or the app's queue
(``--app MODULE:ATTR``, or ``WORKQUEUE_APP``) with every transport its topics name, aws too.

The database alone cannot reach a subscription of an aws topic (its deliveries live in SQS): a
command naming one, or an ``aws:`` delivery, is refused with what to pass instead, never answered
with an empty list or a change that reaches nothing.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..core.errors import ConfigurationError
from ..core.routing import DATABASE

T = TypeVar("T")

APP_HELP = ("MODULE:ATTR of your app or its WorkQueue: the command reaches every transport of its topics "
            "(aws too). Default: WORKQUEUE_APP.")
PASS_APP = "pass --app MODULE:ATTR (your app or its WorkQueue) or set WORKQUEUE_APP"


BUSY_TIMEOUT_VARIABLE = "WORKQUEUE_SQLITE_BUSY_TIMEOUT_MS"


def sqlite_busy_timeout_ms() -> int | None:
    """``WORKQUEUE_SQLITE_BUSY_TIMEOUT_MS`` as the queue's settings read it (None: not set, the
    transport's default), for a command that builds a transport from the URL alone."""
    raw = os.environ.get(BUSY_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigurationError(
            f"{BUSY_TIMEOUT_VARIABLE}={raw!r}: give a whole number of milliseconds, at least 1 (default 30000)"
        )
    return value


def elsewhere(what: str, transport: str) -> ConfigurationError:
    """The refusal of a command the database alone cannot carry out."""
    return ConfigurationError(
        f"{what} is on the {transport} transport, which the database alone cannot reach: {PASS_APP}, "
        "so the command reaches it"
    )


async def check_in_database(
    url: str, transport: Any, subscription: str | None, delivery_id: str | None
) -> None:
    """Refuses, before the command runs on the database alone, a delivery or subscription of
    another transport: an ``aws:`` delivery id, a subscription whose topic the database records
    on aws, or one that only the stored aws bindings name."""
    if delivery_id is not None:
        prefix, sep, _ = delivery_id.partition(":")
        if sep and prefix.isalpha() and prefix != DATABASE:
            raise elsewhere(f"delivery {delivery_id!r}", prefix)
    if subscription is None:
        return
    state = next((s for s in await transport.list_subscriptions() if s.name == subscription), None)
    if state is None:
        if subscription in await bound_on_aws(url):
            raise elsewhere(f"subscription {subscription!r}", "aws")
        raise ConfigurationError(f"subscription {subscription!r} does not exist")
    if state.transport_name != DATABASE:
        raise elsewhere(f"subscription {subscription!r} (topic {state.topic!r})", state.transport_name)


async def bound_on_aws(url: str) -> set[str]:
    """The subscriptions the database's stored aws bindings name (none where there are none)."""
    from ..core.settings import settings_beside_invalid_variables
    from .app_loader import queue_of_its_own

    try:
        from ..aws.bindings import load_bindings
    except ImportError:  # pragma: no cover - the aws extra is missing
        return set()
    queue = queue_of_its_own(settings_beside_invalid_variables(database_url=url))
    try:
        return set((await load_bindings(queue.kernel)).subscriptions)
    except Exception:  # no bindings table (never migrated with it): nothing is bound
        return set()
    finally:
        await queue.kernel.sessions.dispose()


async def check_in_app(queue: Any, transport: Any, subscription: str | None) -> None:
    """Refuses a subscription neither the app declares nor its database knows."""
    if subscription is None or subscription in queue.subscriptions:
        return
    if subscription not in {s.name for s in await transport.list_subscriptions()}:
        raise ConfigurationError(
            f"subscription {subscription!r} does not exist: the app declares {sorted(queue.subscriptions)}"
        )


async def on_app(
    app_path: str, action: Callable[[Any], Awaitable[T]], subscription: str | None
) -> T:
    """Runs ``action`` on the transport of the app's queue (every transport of its topics)."""
    from .app_loader import load_target

    target = load_target(app_path)
    if target.queue is None:
        raise ConfigurationError(
            f"--app {app_path!r}: no WorkQueue found before the app starts; set app.state.queue = queue in the "
            "module, or point --app at the WorkQueue itself (MODULE:queue)"
        )
    async with target.queue.operator_transport() as transport:
        await check_in_app(target.queue, transport, subscription)
        return await action(transport)


async def on_database(
    url: str, action: Callable[[Any], Awaitable[T]], subscription: str | None, delivery_id: str | None
) -> T:
    """Runs ``action`` on the database transport alone, after :func:`check_in_database`."""
    from ..database import create_database_transport

    transport = create_database_transport(url, listen=False, pool_max_size=2,
                                          sqlite_busy_timeout_ms=sqlite_busy_timeout_ms())
    await transport.open()
    try:
        await check_in_database(url, transport, subscription, delivery_id)
        return await action(transport)
    finally:
        await transport.close()


async def database_subscriptions_elsewhere(transport: Any, url: str) -> set[str]:
    """The subscriptions on a topic of another transport that the database knows of: listed there
    (moved to aws) or named by its stored aws bindings (an app whose topics were on aws from the
    start, which the database's topology never held)."""
    listed = await transport.list_subscriptions()
    on_database = {s.name for s in listed if s.transport_name == DATABASE}
    return {s.name for s in listed if s.transport_name != DATABASE} | (await bound_on_aws(url) - on_database)


async def held_elsewhere_note(transport: Any, subscription: str) -> list[str]:
    """Why a broker's subscription lists no InFlight deliveries to this command (one line, or none
    on the database, which lists every process's): a broker lists what the asking process holds,
    and a command holds nothing; how many are in flight is its count."""
    from ..core.ports import Ports

    router = Ports.of(transport).router
    name = (transport if router is None else router.transport_for_subscription(subscription)).name
    if name == DATABASE:
        return []
    counts = await transport.stats(subscription)
    in_flight = counts[0].in_flight if counts else 0
    return [f"(the {name} transport lists the InFlight deliveries of the process that asks, and this command "
            f"holds none: {name} counts {in_flight} in flight (`workqueue stats`); the REST API of a process that "
            "runs the subscription lists the ones it holds)"]
