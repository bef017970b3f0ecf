"""The provisioning helper builds what the manifest asks for on a moto server."""

from __future__ import annotations

import json

from fastapi_workqueue import Subscription, Topic, WorkQueueSettings
from fastapi_workqueue.aws.bindings import Bindings
from fastapi_workqueue.aws.manifest import build_manifest

from ..conftest import unique
from .provision import clients, provision


def test_provision_returns_bindings_of_what_it_made(moto_url: str) -> None:
    name = unique("prov")
    settings = WorkQueueSettings(database_url=None, aws_region="us-east-1")
    manifest = build_manifest(
        [Topic(name=name, transport="aws", is_fifo=True)],
        [Subscription(name=f"{name}.s", topic=name, handler_key="h", partition_mode="Exclusive", max_attempts=3,
                      filter={"field": "region", "operator": "eq", "value": "eu"})],
        settings,
    )
    bindings = Bindings.parse(provision(manifest, moto_url))
    sub = bindings.subscriptions[f"{name}.s"]
    sns, sqs = clients(moto_url)
    attrs = sqs.get_queue_attributes(QueueUrl=sub.queue_url, AttributeNames=["All"])["Attributes"]
    assert attrs["FifoQueue"] == "true"
    assert json.loads(attrs["RedrivePolicy"]) == {"deadLetterTargetArn": sub.dlq_arn, "maxReceiveCount": 13}
    assert attrs["VisibilityTimeout"] == "60"
    sub_attrs = sns.get_subscription_attributes(SubscriptionArn=sub.subscription_arn)["Attributes"]
    assert sub_attrs["RawMessageDelivery"] == "true"
    assert json.loads(sub_attrs["FilterPolicy"]) == {"region": ["eu"]}
    assert bindings.topics[name].arn.endswith(".fifo")
