"""Search: a delivery found by its id, its MessageID, its partition key, its correlation ID or its
job name, newest first and bounded; anything else finds nothing."""

from __future__ import annotations

import uuid

import pytest

from fastapi_workqueue.core.envelope import PublishRequest
from fastapi_workqueue.core.ports import Ports
from fastapi_workqueue.core.search import DeliverySearch

from .harness import Harness, make_world


def searcher(harness: Harness) -> DeliverySearch:
    found = Ports.of(harness.transport).search
    if found is None:
        pytest.skip(f"{harness.name}: the transport does not search")
    return found


async def test_a_delivery_is_found_by_each_of_its_handles(harness: Harness) -> None:
    search = searcher(harness)
    world = await make_world(harness.transport, [{"role": "a"}, {"role": "b"}])
    tag = uuid.uuid4().hex[:8]
    [one, two, other] = await world.publish(
        PublishRequest(payload=1, partition_key=f"customer-{tag}", correlation_id=f"req-{tag}",
                       attributes={"job": f"send_mail_{tag}"}),
        PublishRequest(payload=2, partition_key=f"customer-{tag}"),
        PublishRequest(payload=3, partition_key=f"other-{tag}"),
    )

    async def found(query: str, limit: int = 25) -> list[tuple[str, str, str]]:
        return [(f.matched, str(f.delivery.message_id), f.delivery.subscription)
                for f in await search.search_deliveries(query, limit=limit)]

    by_message = await found(str(one.message_id))
    assert sorted(by_message) == sorted(("MessageID", str(one.message_id), world[r]) for r in ("a", "b"))
    by_key = await found(f"customer-{tag}")
    assert {m for m, _, _ in by_key} == {"partition key"} and len(by_key) == 4
    assert {i for _, i, _ in by_key} == {str(one.message_id), str(two.message_id)}
    assert [i for _, i, _ in by_key][:2] == [str(two.message_id)] * 2  # newest first
    assert len(await found(f"customer-{tag}", limit=3)) == 3
    assert {(m, i) for m, i, _ in await found(f"req-{tag}")} == {("correlation ID", str(one.message_id))}
    assert {(m, i) for m, i, _ in await found(f"send_mail_{tag}")} == {("job", str(one.message_id))}

    found_other = await search.search_deliveries(str(other.message_id))
    [first] = [f for f in found_other if f.delivery.subscription == world["a"]]
    by_id = await search.search_deliveries(first.delivery.delivery_id)
    assert [(f.matched, f.delivery.delivery_id) for f in by_id if f.matched == "delivery id"] == [
        ("delivery id", first.delivery.delivery_id)]
    assert by_id[0].delivery.payload is None

    wide = "".join(chr(ord(c) + 0xFEE0) for c in first.delivery.delivery_id)  # (its id in full-width digits)
    for nothing in ("", "   ", f"customer-{tag}-x", str(uuid.uuid4()), "x" * 600, wide, "³", "٣"):
        assert await found(nothing) == [], nothing  # (int() reads other scripts' digits: an id is ASCII)
