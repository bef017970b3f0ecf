"""Creates the resources of an exported manifest with boto3, as the Terraform module would, and
returns the bindings document the module outputs as ``binding_import``.

Used by the AWS tests and by tests outside this package: ``provision(manifest, endpoint_url)``.
"""

from __future__ import annotations

import json
from typing import Any

import boto3

from .moto import CREDENTIALS, REGION


def clients(endpoint_url: str | None, region: str = REGION) -> tuple[Any, Any]:
    """An SNS and an SQS boto3 client on ``endpoint_url`` (moto's test credentials)."""
    keys = {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "aws_session_token": CREDENTIALS["AWS_SESSION_TOKEN"],
    } if endpoint_url else {}
    sns = boto3.client("sns", region_name=region, endpoint_url=endpoint_url, **keys)
    sqs = boto3.client("sqs", region_name=region, endpoint_url=endpoint_url, **keys)
    return sns, sqs


def _queue(sqs: Any, name: str, fifo: bool, attributes: dict[str, str]) -> tuple[str, str]:
    attrs = dict(attributes)
    if fifo:
        attrs["FifoQueue"] = "true"
        attrs["ContentBasedDeduplication"] = "false"
    url: str = sqs.create_queue(QueueName=name, Attributes=attrs)["QueueUrl"]
    arn: str = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    return url, arn


def provision(manifest: dict[str, Any], endpoint_url: str | None, *, region: str | None = None) -> dict[str, Any]:
    """Creates the manifest's topics, queues, DLQs (redrive with the manifest's max_receive_count) and
    raw subscriptions with their filter policies; returns the ``binding_import`` document."""
    region = region or manifest["region"]
    sns, sqs = clients(endpoint_url, region)
    topics: dict[str, dict[str, str]] = {}
    for topic in manifest["topics"]:
        attributes = {"FifoTopic": "true", "ContentBasedDeduplication": "false"} if topic["is_fifo"] else {}
        arn = sns.create_topic(Name=topic["sns_name"], Attributes=attributes)["TopicArn"]
        topics[topic["name"]] = {"arn": arn}
    subscriptions: dict[str, dict[str, str]] = {}
    for sub in manifest["subscriptions"]:
        fifo = sub["is_fifo"]
        retention = str(sub["message_retention_seconds"])
        dlq_url, dlq_arn = _queue(sqs, sub["dlq_name"], fifo, {"MessageRetentionPeriod": "1209600"})
        queue_url, queue_arn = _queue(sqs, sub["queue_name"], fifo, {
            "VisibilityTimeout": str(sub["visibility_timeout_seconds"]),
            "MessageRetentionPeriod": retention,
            "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": sub["max_receive_count"]}),
        })
        topic_arn = topics[sub["topic"]]["arn"]
        sqs.set_queue_attributes(QueueUrl=queue_url, Attributes={"Policy": json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Principal": {"Service": "sns.amazonaws.com"},
                           "Action": "sqs:SendMessage", "Resource": queue_arn,
                           "Condition": {"ArnEquals": {"aws:SourceArn": topic_arn}}}],
        })})
        attributes = {"RawMessageDelivery": "true"}
        if sub["filter_policy"] is not None:
            attributes["FilterPolicy"] = json.dumps(sub["filter_policy"])
            attributes["FilterPolicyScope"] = sub["filter_policy_scope"]
        subscription_arn = sns.subscribe(
            TopicArn=topic_arn, Protocol="sqs", Endpoint=queue_arn, Attributes=attributes, ReturnSubscriptionArn=True
        )["SubscriptionArn"]
        subscriptions[sub["name"]] = {
            "queue_url": queue_url, "queue_arn": queue_arn, "dlq_url": dlq_url, "dlq_arn": dlq_arn,
            "subscription_arn": subscription_arn,
        }
    return {"version": 1, "region": region, "topics": topics, "subscriptions": subscriptions}
