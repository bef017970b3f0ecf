"""What a dispatch or a bulk refuses names what to change: the item, the field, the key the caller
gave; and nothing of the call is queued."""

import math
from typing import Any

import pytest
from pydantic import BaseModel

from fastapi_workqueue import WorkQueue, WorkQueueSettings
from fastapi_workqueue.jobs import JobPayloadInvalid
from fastapi_workqueue.jobs.layer import JobDispatchError


class Order(BaseModel):
    order_id: int
    note: Any = None


def make(sqlite_url: str) -> tuple[WorkQueue, Any, Any]:
    queue = WorkQueue(WorkQueueSettings(database_url=sqlite_url, auto_migrate=True, enabled=False))

    @queue.job("orders.ship")
    async def ship(payload: Order) -> None:
        return None

    @queue.job("docs.index")
    async def index(payload: dict[str, Any]) -> None:
        return None

    return queue, ship, index


async def test_a_model_that_no_longer_validates_is_refused_at_dispatch_naming_the_field(sqlite_url: str) -> None:
    """A model changed after it was built, or built with model_construct, was queued and failed at
    the worker ("Input should be a valid integer"), though dispatch promises to validate first."""
    queue, ship, _ = make(sqlite_url)
    changed = Order(order_id=1)
    changed.order_id = "A-17"  # type: ignore[assignment]
    async with queue.lifespan(None):
        for payload in (changed, Order.model_construct(order_id="B-2")):  # type: ignore[arg-type]
            with pytest.raises(JobPayloadInvalid, match=r"order_id: Input should be a valid integer.*model_validate"):
                await queue.dispatch(ship, payload)
        with pytest.raises(JobPayloadInvalid, match=r"a value of type object cannot be stored as JSON"):
            await queue.dispatch(ship, Order(order_id=1, note=object()))
        assert await queue.size() == 0


async def test_a_bulk_names_the_item_that_was_refused(sqlite_url: str) -> None:
    queue, ship, index = make(sqlite_url)
    async with queue.lifespan(None):
        items: list[tuple[Any, Any]] = [(ship, {"order_id": n}) for n in range(100)]
        items[57] = (ship, {"order_id": "x"})
        with pytest.raises(JobPayloadInvalid, match=r"'orders.ship' is invalid: bulk item 57: order_id"):
            await queue.bulk(items)
        # The store's refusal of item 57 (NaN is not JSON), not item 0's "aborted with it", with item 57's job.
        items = [(ship, {"order_id": n}) for n in range(100)]
        items[57] = (index, {"v": math.nan})
        with pytest.raises(JobDispatchError, match=r"job 'docs.index' \(bulk item 57\) was not queued: the Payload "
                                                   r"is not JSON") as refused:
            await queue.bulk(items)
        assert refused.value.item == 57
        assert await queue.size() == 0


async def test_a_payload_too_deep_and_a_unique_key_too_long_say_what_to_change(sqlite_url: str) -> None:
    queue, _, index = make(sqlite_url)
    deep: Any = 1
    for _ in range(300):
        deep = {"a": deep}
    async with queue.lifespan(None):
        with pytest.raises(JobPayloadInvalid, match=r"nests deeper than a payload may \(200 levels\); flatten it"):
            await queue.dispatch(index, deep)
        with pytest.raises(ValueError, match=r"^unique is 600 characters; for job 'docs.index' at most 501 are "
                                             r"allowed"):
            await queue.dispatch(index, {}, unique="k" * 600)
        assert await queue.dispatch(index, {}, unique="k" * 501) is not None
