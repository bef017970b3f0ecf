"""Priority (issue 31): a message's priority orders the claims of a subscription's deliveries.

The conformance suite (``testing/conformance/flow.py``) holds every transport to the order; these
cases add what needs a real store and volume: a priority-9 message published behind 20,000 others
is claimed first, and the REST API takes ``Priority``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from fastapi_workqueue import PublishRequest, Subscription, Topic
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.database import create_database_transport
from fastapi_workqueue.database.routines import RoutineTransport

from .conftest import unique

pytestmark = pytest.mark.timeout(120)

BACKLOG = 20_000


@pytest.fixture
async def transport(database_url: str) -> AsyncIterator[RoutineTransport]:
    transport = create_database_transport(database_url)
    await transport.open()
    await transport.migrate()
    yield transport
    await transport.close()


@pytest.mark.parametrize("value", [-1, 10, 99])
def test_a_priority_outside_0_to_9_is_refused(value: int) -> None:
    with pytest.raises(ValidationError, match="priority") as caught:
        PublishRequest(payload={}, priority=value)
    assert "9" in str(caught.value) or "0" in str(caught.value)


def test_priority_travels_as_priority_on_the_wire() -> None:
    request = PublishRequest.model_validate({"Payload": {}, "Priority": 7})
    assert request.priority == 7 and prepare(request).priority == 7
    assert PublishRequest(payload=1).model_dump(by_alias=True)["Priority"] == 0


def test_priority_is_not_part_of_the_content() -> None:
    """A retried publish that changed only the priority is the same message (Duplicate), as one
    that changed only its delay: the priority is how its deliveries are claimed, not what it says."""
    a = prepare(PublishRequest(payload={"x": 1}, priority=9))
    b = prepare(PublishRequest(payload={"x": 1}))
    assert a.content_hash == b.content_hash


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["None", "Exclusive"])
async def test_priority_nine_overtakes_a_backlog_of_20000(transport: RoutineTransport, mode: str) -> None:
    topic, name = unique("prio"), unique("prio-sub")
    await transport.sync_topology([Topic(name=topic)], [
        Subscription(name=name, topic=topic, handler_key="h", partition_mode=mode)])
    for start in range(0, BACKLOG, 2000):
        await transport.publish(topic, [
            prepare(PublishRequest(payload=i, partition_key=f"k{i % 500}")) for i in range(start, start + 2000)])
    [urgent] = await transport.publish(topic, [prepare(PublishRequest(payload="urgent", partition_key="k7",
                                                                      priority=9))])
    if mode == "Exclusive":
        # Its key k7 has older deliveries: within a key the order stays the key's own; the
        # priority counts between keys. A key of its own makes it the next key to run.
        [urgent] = await transport.publish(topic, [prepare(PublishRequest(payload="urgent", partition_key="vip",
                                                                          priority=9))])
    claimed = await transport.claim(name, 10)
    assert claimed[0].message_id == urgent.message_id
    assert len(claimed) == 10
