"""AWS resources made from a manifest with boto3, as the Terraform module would make them."""

from __future__ import annotations

import json
from typing import Any

import boto3

REGION = "us-east-1"


def manifest_for(tag: str) -> dict[str, Any]:
    """A manifest in the format export-topology writes: one FIFO topic with a filtered subscription."""
    return {
        "version": 1, "generator": "fastapi-workqueue 0.1.0", "region": REGION,
        "topics": [{"name": f"orders.{tag}", "sns_name": f"orders-{tag}.fifo", "is_fifo": True}],
        "subscriptions": [{
            "name": f"orders.email.{tag}", "topic": f"orders.{tag}", "handler_key": "orders.email",
            "queue_name": f"orders-email-{tag}.fifo", "dlq_name": f"orders-email-{tag}-dlq.fifo", "is_fifo": True,
            "partition_mode": "Exclusive", "max_attempts": 5, "visibility_timeout_seconds": 30,
            "message_retention_seconds": 1209600, "raw_message_delivery": True,
            "filter_policy": {"region": ["eu"]}, "filter_policy_scope": "MessageAttributes", "lambda": None,
        }],
    }


def provision(endpoint: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Makes the manifest's resources as the Terraform module would, and answers its binding_import."""
    sns = boto3.client("sns", region_name=REGION, endpoint_url=endpoint)
    sqs = boto3.client("sqs", region_name=REGION, endpoint_url=endpoint)
    bindings: dict[str, Any] = {"version": 1, "region": REGION, "topics": {}, "subscriptions": {}}
    for t in manifest["topics"]:
        attrs = {"FifoTopic": "true", "ContentBasedDeduplication": "false"} if t["is_fifo"] else {}
        bindings["topics"][t["name"]] = {"arn": sns.create_topic(Name=t["sns_name"], Attributes=attrs)["TopicArn"]}
    for s in manifest["subscriptions"]:
        fifo = {"FifoQueue": "true"} if s["is_fifo"] else {}
        dlq_url = sqs.create_queue(QueueName=s["dlq_name"], Attributes=fifo)["QueueUrl"]
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        url = sqs.create_queue(QueueName=s["queue_name"], Attributes={
            **fifo, "VisibilityTimeout": str(s["visibility_timeout_seconds"]),
            "MessageRetentionPeriod": str(s["message_retention_seconds"]),
            "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": s["max_attempts"]}),
        })["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        sub_attrs = {"RawMessageDelivery": "true"}
        if s["filter_policy"] is not None:
            sub_attrs |= {"FilterPolicy": json.dumps(s["filter_policy"]), "FilterPolicyScope": s["filter_policy_scope"]}
        sub_arn = sns.subscribe(TopicArn=bindings["topics"][s["topic"]]["arn"], Protocol="sqs", Endpoint=arn,
                                Attributes=sub_attrs, ReturnSubscriptionArn=True)["SubscriptionArn"]
        bindings["subscriptions"][s["name"]] = {"queue_url": url, "queue_arn": arn, "dlq_url": dlq_url,
                                                "dlq_arn": dlq_arn, "subscription_arn": sub_arn}
    return bindings
