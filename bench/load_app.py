"""The app the load benchmark serves: the example app, plus one route that stores without publishing.

    python bench/load_app.py                              # migrates and creates the tables, once
    uvicorn load_app:app --app-dir bench --workers 2      # what bench/load.py starts then

``app`` is ``example_app.main.create_app()`` as it is (``POST /orders`` stores an order and
publishes ``orders.created`` in the request's transaction; the host runs the two subscriptions
unless ``WORKQUEUE_DISABLE_HOST=1``), with ``POST /orders-without-queue`` added: the same order
row, written in the same kind of request transaction (``queue.session``), with no publish. Every
set-up of the benchmark serves this module, so the baseline differs from the others by its route
alone.

Run as a script, it runs the app's lifespan once with the host off and exits: the queue's
migrations and the example's tables are in place before uvicorn starts its workers. (Two workers
starting on an empty database both run ``Base.metadata.create_all``, and the one that loses the
race fails its start-up with 'relation "orders" already exists'.)
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # example_app lives at the top of the repository

from example_app.main import NewOrder, create_app  # noqa: E402
from example_app.models import Order  # noqa: E402
from fastapi_workqueue import WorkQueue  # noqa: E402

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


if __name__ == "__main__":
    asyncio.run(prepare())
