"""The follow-ups of settle_with_follow_ups wake consumers as a publish does: PostgreSQL notifies at
the commit (the publish routine's pg_notify), SQLite wakes the process's own listeners after it. A
follow-up that rolled back wakes nobody."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest

from fastapi_workqueue import PublishRequest, Subscription, Topic, TransportError
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.outcomes import FollowUp
from fastapi_workqueue.core.transport import Settlement
from fastapi_workqueue.database.postgres import PostgresTransport
from fastapi_workqueue.database.routines import RoutineTransport
from fastapi_workqueue.database.sqlite import SqliteTransport

from .conftest import unique
from .support import wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["postgresql", "sqlite"])
async def transport(request: pytest.FixtureRequest, pg_url: str, tmp_path: Path) -> AsyncIterator[RoutineTransport]:
    opened: RoutineTransport
    if request.param == "postgresql":
        opened = PostgresTransport(pg_url, listen=True, pool_max_size=2)
    else:
        opened = SqliteTransport(f"sqlite+aiosqlite:///{tmp_path / 'wakeups.db'}")
    await opened.open()
    try:
        await opened.migrate()
        yield opened
    finally:
        await opened.close()


async def woken_for(woken: list[str], subscription_id: str) -> None:
    await wait_for(lambda: subscription_id in woken, within=5,
                   describe=lambda: f"no wake-up for subscription {subscription_id}: {woken}")


async def test_follow_ups_wake_their_consumers_and_a_rolled_back_one_does_not(transport: RoutineTransport) -> None:
    first, then, sentinel = unique("first"), unique("then"), unique("sentinel")
    await transport.sync_topology(
        [Topic(name=first), Topic(name=then), Topic(name=sentinel)],
        [Subscription(name=first, topic=first, handler_key="h"), Subscription(name=then, topic=then, handler_key="h"),
         Subscription(name=sentinel, topic=sentinel, handler_key="h")],
    )
    ids = {s.name: cast(str, s.id) for s in await transport.list_subscriptions()}  # as wake-ups name them
    await transport.publish(first, [prepare(PublishRequest(payload=i)) for i in range(2)])
    one, two = await transport.claim(first, 2)
    woken: list[str] = []
    await transport.add_wakeup_listener(woken.append)

    # A follow-up to an unknown topic rolls the first settle back: nothing to wake for.
    with pytest.raises(TransportError, match="UnknownTopic"):
        await transport.settle_with_follow_ups(Settlement(
            one.delivery_id, one.lease_token, "Complete",
            follow_ups=(FollowUp(then, [prepare(PublishRequest(payload="a"))]),
                        FollowUp(unique("missing"), [prepare(PublishRequest(payload="b"))]))))
    # Wake-ups arrive in commit order: once the sentinel's has come, one for ``then`` would have too.
    await transport.publish(sentinel, [prepare(PublishRequest(payload="after"))])
    await woken_for(woken, ids[sentinel])
    assert ids[then] not in woken

    follow_up = prepare(PublishRequest(message_id=uuid.uuid4(), payload="next"))
    result = await transport.settle_with_follow_ups(
        Settlement(two.delivery_id, two.lease_token, "Complete", follow_ups=(FollowUp(then, [follow_up]),)))
    assert result == "Completed"
    await woken_for(woken, ids[then])
    [claimed] = await transport.claim(then, 5)
    assert claimed.message_id == follow_up.message_id
