"""The app the load benchmark serves: the example app, plus one route that stores without publishing.

    python bench/load/load_app.py                              # migrates and creates the tables, once
    uvicorn load_app:app --app-dir bench --workers 2      # what bench/load/load.py starts then

``app`` is ``example_app.main.create_app()`` as it is (``POST /orders`` stores an order and
publishes ``orders.created`` in the request's transaction; the host runs the two subscriptions
unless ``WORKQUEUE_DISABLE_HOST=1``), with ``POST /orders-without-queue`` added: the same order
row, written in the same kind of request transaction (``queue.session``), with no publish. Every
set-up of the benchmark serves this module, so the baseline differs from the others by its route
alone.

``python bench/load/load_app.py --fill N`` stores N orders and publishes their messages as ``POST /orders``
does (one transaction per 50 orders), with the host off: the backlog the benchmark's processing
measurement then lets the host drain with no HTTP load.

Run as a script, it runs the app's lifespan once with the host off and exits: the queue's
migrations and the example's tables are in place before uvicorn starts its workers. (Two workers
starting on an empty database both run ``Base.metadata.create_all``, and the one that loses the
race fails its start-up with 'relation "orders" already exists'.)
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import uuid
from pathlib import Path

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # example_app lives at the top of the repository

from example_app.main import TOPIC, NewOrder, OrderCreated, create_app  # noqa: E402
from example_app.models import Order  # noqa: E402
from fastapi_workqueue import PublishRequest, WorkQueue  # noqa: E402

BASELINE_PATH = "/orders-without-queue"


class OrderStored(BaseModel):
    """The baseline's answer: the order's id and the MessageID it would have published."""

    order_id: int
    message_id: uuid.UUID


app = create_app()
queue: WorkQueue = app.state.queue


@app.post(BASELINE_PATH, status_code=201)
async def create_order_without_queue(body: NewOrder, session: AsyncSession = queue.session) -> OrderStored:
    """Stores the order as ``POST /orders`` does, in the request's transaction, and publishes nothing."""
    order = Order(customer=body.customer, email=body.email, amount_cents=body.amount_cents,
                  message_id=uuid.uuid4())
    session.add(order)
    await session.flush()  # assigns order.id, as POST /orders does before its publish
    return OrderStored(order_id=order.id, message_id=order.message_id)


async def prepare() -> None:
    """Runs the app's lifespan once, with the host off: migrations and tables, nothing consumed."""
    os.environ["WORKQUEUE_DISABLE_HOST"] = "1"
    prepared = create_app()
    async with prepared.router.lifespan_context(prepared):
        pass


async def fill(orders: int, customers: int, batch: int = 50) -> None:
    """Stores ``orders`` orders with their messages, as ``POST /orders`` does, the host off; customers
    drawn at random from ``customers`` keys (seeded) as the benchmark's clients draw them, so the
    Ordered subscription meets as many orders per customer as after a load."""
    draw = random.Random(1)
    os.environ["WORKQUEUE_DISABLE_HOST"] = "1"
    filler = create_app()
    fill_queue: WorkQueue = filler.state.queue
    async with filler.router.lifespan_context(filler):
        for start in range(0, orders, batch):
            async with fill_queue.sessionmaker() as session, session.begin():
                rows = [Order(customer=f"customer-{draw.randrange(customers)}", email=f"c{start + i}@example.com",
                              amount_cents=100 + i, message_id=uuid.uuid4()) for i in range(min(batch, orders - start))]
                session.add_all(rows)
                await session.flush()
                results = await fill_queue.publish(TOPIC, [
                    PublishRequest(message_id=o.message_id, partition_key=o.customer,
                                   payload=OrderCreated(order_id=o.id, customer=o.customer,
                                                        amount_cents=o.amount_cents).model_dump(mode="json"))
                    for o in rows], session=session)
                failed = [r.error for r in results if not r.ok]
                if failed:
                    raise RuntimeError(f"publishing the backlog failed: {failed[0]}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--fill":
        asyncio.run(fill(int(sys.argv[2]), int(sys.argv[3])))
    else:
        asyncio.run(prepare())
