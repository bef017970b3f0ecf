"""Bindings: parsing both shapes, one-line errors, storing in the database or a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import WorkQueue, WorkQueueSettings
from fastapi_workqueue.aws.bindings import Bindings, load_bindings, store_bindings
from fastapi_workqueue.core.errors import ConfigurationError

DOC: dict[str, Any] = {
    "version": 1,
    "region": "us-east-1",
    "topics": {"orders.created": {"arn": "arn:aws:sns:us-east-1:123456789012:orders-created.fifo"}},
    "subscriptions": {"orders.email": {
        "queue_url": "https://sqs.us-east-1.amazonaws.com/123456789012/orders-email.fifo",
        "queue_arn": "arn:aws:sqs:us-east-1:123456789012:orders-email.fifo",
        "dlq_url": "https://sqs.us-east-1.amazonaws.com/123456789012/orders-email-dlq.fifo",
        "dlq_arn": "arn:aws:sqs:us-east-1:123456789012:orders-email-dlq.fifo",
        "subscription_arn": "arn:aws:sns:us-east-1:123456789012:orders-created.fifo:uuid"}},
}


def test_parse_reads_the_object_and_the_terraform_output_document() -> None:
    direct = Bindings.parse(DOC)
    wrapped = Bindings.parse({"binding_import": {"sensitive": False, "type": "object", "value": DOC},
                              "app_policy_json": {"value": "{}"}})
    assert direct == wrapped == Bindings.parse(json.dumps(DOC))
    assert direct.topics["orders.created"].arn.endswith("orders-created.fifo")
    assert direct.subscriptions["orders.email"].dlq_url.endswith("orders-email-dlq.fifo")
    assert direct.document() == DOC


@pytest.mark.parametrize(("data", "message"), [
    ("{not json", "bindings are not valid JSON"),
    ([], "bindings must be a JSON object, got list"),
    ({"binding_import": {"value": None}}, "binding_import in the terraform output has no object value"),
    ({**DOC, "version": 2}, "bindings version 2 is not supported"),
    ({"topics": {}}, "bindings are not valid at region: Field required"),
    ({**DOC, "subscriptions": {"s": {"queue_url": "u"}}}, "bindings are not valid at subscriptions.s.queue_arn"),
])
def test_bad_input_is_one_line(data: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        Bindings.parse(data)
    assert "\n" not in str(caught.value)


async def test_stored_in_a_file_without_a_database(tmp_path: Path) -> None:
    path = tmp_path / "bindings.json"
    queue = WorkQueue(WorkQueueSettings(database_url=None, aws_region="us-east-1", aws_bindings_file=str(path)))
    assert (await load_bindings(queue.kernel)).topics == {}
    await store_bindings(queue.kernel, Bindings.parse(DOC))
    assert json.loads(path.read_text()) == DOC
    assert await load_bindings(queue.kernel) == Bindings.parse(DOC)


async def test_without_a_database_or_a_file_it_says_what_to_set() -> None:
    queue = WorkQueue(WorkQueueSettings(database_url=None))
    with pytest.raises(ConfigurationError, match="WORKQUEUE_AWS_BINDINGS_FILE"):
        await load_bindings(queue.kernel)


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
async def test_stored_in_the_database(dialect: str, tmp_path: Path, pg_url: str) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}" if dialect == "sqlite" else pg_url
    queue = WorkQueue(WorkQueueSettings(database_url=url, auto_migrate=True, aws_region="us-east-1"))
    await queue.open()
    try:
        await store_bindings(queue.kernel, Bindings.parse(DOC))
        assert await load_bindings(queue.kernel) == Bindings.parse(DOC)
        smaller = Bindings.parse({**DOC, "subscriptions": {}})
        await store_bindings(queue.kernel, smaller)
        assert await load_bindings(queue.kernel) == smaller
        await store_bindings(queue.kernel, Bindings(region="us-east-1"))
    finally:
        await queue.close()
