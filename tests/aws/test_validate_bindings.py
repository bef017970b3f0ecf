"""validate-bindings on AWS: resources made from a manifest on a moto server, then drifted one at a time."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from fastapi_workqueue.aws.validate import validate_aws_bindings

from .moto import REGION
from .provision import clients, provision


@pytest.fixture
def endpoint(moto_url: str) -> str:
    return moto_url


def manifest_for(tag: str) -> dict[str, Any]:
    """A manifest in the format export-topology writes: one FIFO topic with a filtered subscription."""
    return {
        "version": 1, "generator": "fastapi-workqueue 0.1.0", "region": REGION,
        "topics": [{"name": f"orders.{tag}", "sns_name": f"orders-{tag}.fifo", "is_fifo": True}],
        "subscriptions": [{
            "name": f"orders.email.{tag}", "topic": f"orders.{tag}", "handler_key": "orders.email",
            "queue_name": f"orders-email-{tag}.fifo", "dlq_name": f"orders-email-{tag}-dlq.fifo", "is_fifo": True,
            "partition_mode": "Exclusive", "max_attempts": 5, "max_receive_count": 15, "visibility_timeout_seconds": 30,
            "message_retention_seconds": 1209600, "raw_message_delivery": True,
            "filter_policy": {"region": ["eu"]}, "filter_policy_scope": "MessageAttributes", "lambda": None,
        }],
    }


@pytest.fixture
def bound(endpoint: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    tag = uuid.uuid4().hex[:8]
    manifest = manifest_for(tag)
    return manifest, provision(manifest, endpoint), f"orders.email.{tag}"


async def messages(manifest: dict[str, Any], bindings: dict[str, Any], endpoint: str) -> list[str]:
    report = await validate_aws_bindings(manifest, bindings, region=REGION, endpoint_url=endpoint)
    return [f"{i.severity} {i.subject}: {i.message}" for i in report.issues]


async def test_resources_made_from_the_manifest_validate(
    bound: tuple[dict[str, Any], dict[str, Any], str], endpoint: str
) -> None:
    manifest, bindings, _ = bound
    report = await validate_aws_bindings(manifest, bindings, region=REGION, endpoint_url=endpoint)
    assert report.transport == "aws"
    assert report.issues == []
    assert report.ok


async def test_each_drift_is_one_error_naming_the_item_and_what_to_run(
    bound: tuple[dict[str, Any], dict[str, Any], str], endpoint: str
) -> None:
    manifest, bindings, name = bound
    sns, sqs = clients(endpoint)
    b = bindings["subscriptions"][name]
    sqs.set_queue_attributes(QueueUrl=b["queue_url"], Attributes={
        "VisibilityTimeout": "10",
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": b["dlq_arn"], "maxReceiveCount": 3}),
    })
    sns.set_subscription_attributes(SubscriptionArn=b["subscription_arn"], AttributeName="RawMessageDelivery",
                                    AttributeValue="false")
    sns.set_subscription_attributes(SubscriptionArn=b["subscription_arn"], AttributeName="FilterPolicy",
                                    AttributeValue=json.dumps({"region": ["us"]}))
    found = await messages(manifest, bindings, endpoint)
    subject = f"Error subscription {name}"
    assert len(found) == 4, found
    assert all(m.startswith(subject) and m.endswith("then `workqueue import-bindings`") for m in found), found
    text = "\n".join(found)
    assert "visibility timeout of 10 s but the lease is 30 s" in text
    assert "redrives after 3 receives but the manifest's max_receive_count is 15" in text
    assert "raw message delivery off; handlers need it on" in text
    assert 'filter policy {"region": ["us"]} but the filter renders {"region": ["eu"]}' in text


async def test_missing_resources_and_bindings_are_errors(
    bound: tuple[dict[str, Any], dict[str, Any], str], endpoint: str
) -> None:
    manifest, bindings, name = bound
    sqs = clients(endpoint)[1]
    sqs.delete_queue(QueueUrl=bindings["subscriptions"][name]["dlq_url"])
    found = await messages(manifest, bindings, endpoint)
    assert found == [f"Error subscription {name}: dead-letter queue {bindings['subscriptions'][name]['dlq_url']} "
                     "does not exist: run `workqueue export-topology --transport aws`, `terraform apply`, then "
                     "`workqueue import-bindings`"]

    topic = manifest["topics"][0]["name"]
    unbound = {**bindings, "topics": {}, "subscriptions": {"old.sub": bindings["subscriptions"][name]}}
    found = await messages(manifest, unbound, endpoint)
    assert f"Error topic {topic}: not bound: apply the Terraform module, then run `workqueue import-bindings " \
           "bindings.json`" in found
    assert f"Error subscription {name}: not bound: apply the Terraform module, then run `workqueue " \
           "import-bindings bindings.json`" in found
    assert any(m.startswith("Warning subscription old.sub: bound but not a subscription") for m in found)


async def test_a_fifo_flag_that_differs_is_an_error(
    bound: tuple[dict[str, Any], dict[str, Any], str], endpoint: str
) -> None:
    manifest, bindings, name = bound
    manifest["topics"][0]["is_fifo"] = False
    manifest["subscriptions"][0]["is_fifo"] = False
    found = await messages(manifest, bindings, endpoint)
    text = "\n".join(found)
    assert "is FIFO but the topic has is_fifo=False: a FIFO change replaces the topic" in text
    assert f"Error subscription {name}: queue" in text and "dead-letter queue" in text
    assert len(found) == 3, found


async def test_other_region_bindings_are_an_error(
    bound: tuple[dict[str, Any], dict[str, Any], str], endpoint: str
) -> None:
    manifest, bindings, _ = bound
    found = await messages(manifest, {**bindings, "region": "eu-west-1"}, endpoint)
    assert found[0].startswith("Error bindings: the bindings are for region eu-west-1 but the queue's aws_region")
