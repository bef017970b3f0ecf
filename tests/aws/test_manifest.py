"""The manifest: what it holds, its JSON Schema, and what it refuses."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from fastapi_workqueue import Subscription, Topic, WorkQueueSettings
from fastapi_workqueue.aws.manifest import build_manifest, manifest_schema, validate_manifest
from fastapi_workqueue.core.errors import ConfigurationError

SETTINGS = WorkQueueSettings(database_url=None, aws_region="us-east-1", aws_resource_prefix="app-",
                             aws_lambda_subscriptions=["orders.archive"])
TOPICS = [
    Topic(name="orders.created", transport="aws", is_fifo=True),
    Topic(name="audit", transport="aws"),
    Topic(name="local.only"),
]
SUBS = [
    Subscription(name="orders.email", topic="orders.created", handler_key="orders.email",
                 partition_mode="Exclusive", max_attempts=5, lease_seconds=30,
                 filter={"field": "region", "operator": "eq", "value": "eu"}),
    Subscription(name="orders.archive", topic="orders.created", handler_key="orders.archive",
                 lease_seconds=180, max_processing_seconds=120.5),
    Subscription(name="audit.log", topic="audit", handler_key="audit.log", lease_seconds=0.5),
    Subscription(name="local.work", topic="local.only", handler_key="local.work", partition_mode="Ordered"),
]


def manifest() -> dict[str, Any]:
    return build_manifest(TOPICS, SUBS, SETTINGS)


def test_the_manifest_holds_the_aws_topology_only() -> None:
    m = manifest()
    assert m["version"] == 1 and m["region"] == "us-east-1" and m["generator"].startswith("fastapi-workqueue")
    assert m["topics"] == [
        {"name": "audit", "sns_name": "app-audit", "is_fifo": False},
        {"name": "orders.created", "sns_name": "app-orders-created.fifo", "is_fifo": True},
    ]
    subs = {s["name"]: s for s in m["subscriptions"]}
    assert set(subs) == {"orders.email", "orders.archive", "audit.log"}
    email = subs["orders.email"]
    assert email == {
        "name": "orders.email", "topic": "orders.created", "handler_key": "orders.email",
        "queue_name": "app-orders-email.fifo", "dlq_name": "app-orders-email-dlq.fifo", "is_fifo": True,
        "partition_mode": "Exclusive", "max_attempts": 5, "max_receive_count": 15, "visibility_timeout_seconds": 30,
        "message_retention_seconds": 7 * 24 * 3600, "raw_message_delivery": True,
        "filter_policy": {"region": ["eu"]}, "filter_policy_scope": "MessageAttributes", "lambda": None,
    }
    assert subs["orders.archive"]["lambda"] == {"batch_size": 10, "maximum_batching_window_seconds": 0,
                                                "timeout_seconds": 121}
    assert subs["audit.log"]["visibility_timeout_seconds"] == 1
    assert subs["audit.log"]["queue_name"] == "app-audit-log" and subs["audit.log"]["dlq_name"] == "app-audit-log-dlq"


def test_the_schema_validates_exported_manifests() -> None:
    jsonschema.Draft202012Validator.check_schema(manifest_schema())
    validate_manifest(manifest())


@pytest.mark.parametrize(("path", "value"), [
    (("subscriptions", 0, "partition_mode"), "Ordered"),
    (("subscriptions", 0, "queue_name"), "has space"),
    (("topics", 0, "sns_name"), "x" * 81),
    (("subscriptions", 0, "raw_message_delivery"), False),
    (("region",), ""),
])
def test_the_schema_refuses_what_the_module_cannot_read(path: tuple[Any, ...], value: Any) -> None:
    m = manifest()
    target: Any = m
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    with pytest.raises(ConfigurationError, match="manifest is not valid at"):
        validate_manifest(m)


def test_long_names_are_cut_to_80_characters_with_their_suffixes() -> None:
    name = "n" * 150
    m = build_manifest([Topic(name=name, transport="aws", is_fifo=True)],
                       [Subscription(name=name + ".s", topic=name, handler_key="h")],
                       WorkQueueSettings(database_url=None, aws_region="us-east-1"))
    sub = m["subscriptions"][0]
    assert len(m["topics"][0]["sns_name"]) == 80 and m["topics"][0]["sns_name"].endswith(".fifo")
    assert len(sub["queue_name"]) == 80 and len(sub["dlq_name"]) == 80
    assert sub["dlq_name"].endswith("-dlq.fifo")
    validate_manifest(m)


def test_ordered_on_an_aws_topic_is_refused_naming_the_subscription() -> None:
    topics = [Topic(name="t", transport="aws", is_fifo=True)]
    with pytest.raises(ConfigurationError, match="subscription 'bad': Ordered needs a database topic"):
        build_manifest(topics, [Subscription(name="bad", topic="t", handler_key="h", partition_mode="Ordered")],
                       SETTINGS)


def test_exclusive_on_a_standard_aws_topic_is_refused() -> None:
    topics = [Topic(name="t", transport="aws")]
    with pytest.raises(ConfigurationError, match=r"subscription 'ex'.*needs a FIFO topic; set is_fifo=True"):
        build_manifest(topics, [Subscription(name="ex", topic="t", handler_key="h", partition_mode="Exclusive")],
                       SETTINGS)


def test_a_region_and_known_lambda_subscriptions_are_needed() -> None:
    with pytest.raises(ConfigurationError, match="WORKQUEUE_AWS_REGION"):
        build_manifest(TOPICS, SUBS, WorkQueueSettings(database_url=None))
    with pytest.raises(ConfigurationError, match="WORKQUEUE_AWS_LAMBDA_SUBSCRIPTIONS names \\['nope'\\]"):
        build_manifest(TOPICS, SUBS, WorkQueueSettings(database_url=None, aws_region="eu-west-1",
                                                       aws_lambda_subscriptions=["nope"]))


@pytest.mark.parametrize(("lease", "max_processing", "timeout", "where"), [
    (30, None, 60, "the default"),
    (100, 120.5, 121, "max_processing_seconds=120.5"),
])
def test_a_lambda_timeout_longer_than_the_lease_is_refused(
    lease: float, max_processing: float | None, timeout: int, where: str,
) -> None:
    topics = [Topic(name="t", transport="aws")]
    subs = [Subscription(name="slow", topic="t", handler_key="h", lease_seconds=lease,
                         max_processing_seconds=max_processing)]
    settings = WorkQueueSettings(database_url=None, aws_region="us-east-1", aws_lambda_subscriptions=["slow"])
    with pytest.raises(ConfigurationError) as raised:
        build_manifest(topics, subs, settings)
    text = str(raised.value)
    assert text.startswith(f"subscription 'slow' is served by Lambda with a {timeout} s timeout ({where})"), text
    assert f"is {lease} s" in text
    assert f"raise lease_seconds to at least {timeout}, or set max_processing_seconds to at most {lease}" in text
    # The same subscription served by a host needs no Lambda timeout; a lease as long as it is fine.
    build_manifest(topics, subs, WorkQueueSettings(database_url=None, aws_region="us-east-1"))
    fits = [subs[0].model_copy(update={"lease_seconds": timeout})]
    [sub] = build_manifest(topics, fits, settings)["subscriptions"]
    assert sub["lambda"]["timeout_seconds"] == sub["visibility_timeout_seconds"] == timeout
