"""``validate-bindings --transport aws``: compare what AWS holds with the manifest, read-only.

Each topic and subscription of the manifest is looked up through its bindings: the SNS topic
(exists, FIFO flag), the queue (exists, FIFO flag, visibility timeout = the lease, redrive to the
bound DLQ with the manifest's ``max_receive_count``, retention), the DLQ (exists, FIFO flag) and
the SNS subscription (topic and queue, raw delivery, filter policy and its scope). Every
difference is one issue naming the item and what to run; only Get* calls are made.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

from ..core.reports import BindingIssue, BindingReport
from .manifest import max_receive_count

REEXPORT = "run `workqueue export-topology --transport aws`, `terraform apply`, then `workqueue import-bindings`"
IMPORT = "apply the Terraform module, then run `workqueue import-bindings bindings.json`"

_MISSING = {"NotFound", "NotFoundException", "AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist",
            "InvalidParameter"}


class _Checker:
    def __init__(self, sns: Any, sqs: Any) -> None:
        self.sns = sns
        self.sqs = sqs
        self.issues: list[BindingIssue] = []

    def error(self, subject: str, message: str) -> None:
        self.issues.append(BindingIssue(severity="Error", subject=subject, message=message))

    def warning(self, subject: str, message: str) -> None:
        self.issues.append(BindingIssue(severity="Warning", subject=subject, message=message))

    async def _get(self, subject: str, what: str, call: Any, **kwargs: Any) -> dict[str, str] | None:
        """The ``Attributes`` a Get* call answers, or None after recording why there are none."""
        from .client_calls import AwsServiceBusy

        client_error = importlib.import_module("botocore.exceptions").ClientError
        try:
            answer = await call(**kwargs)
        except (client_error, AwsServiceBusy) as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _MISSING:
                self.error(subject, f"{what} does not exist: {REEXPORT}")
            else:
                self.error(subject, f"cannot read {what} ({code}): give this role the module's app_policy_json")
            return None
        attrs: dict[str, str] = answer.get("Attributes", {})
        return attrs

    async def topic(self, topic: Mapping[str, Any], bound: Mapping[str, Any] | None) -> None:
        subject = f"topic {topic['name']}"
        if bound is None:
            self.error(subject, f"not bound: {IMPORT}")
            return
        arn = bound["arn"]
        attrs = await self._get(subject, f"SNS topic {arn}", self.sns.get_topic_attributes, TopicArn=arn)
        if attrs is None:
            return
        fifo = attrs.get("FifoTopic", "false").lower() == "true"
        if fifo != bool(topic["is_fifo"]):
            self.error(subject, f"SNS topic {arn} is {'FIFO' if fifo else 'standard'} but the topic has "
                       f"is_fifo={topic['is_fifo']}: a FIFO change replaces the topic; {REEXPORT}")

    async def subscription(
        self, sub: Mapping[str, Any], bound: Mapping[str, Any] | None, topic_arn: str | None
    ) -> None:
        subject = f"subscription {sub['name']}"
        if bound is None:
            self.error(subject, f"not bound: {IMPORT}")
            return
        await self._queue(subject, sub, bound)
        await self._dlq(subject, sub, bound)
        await self._sns_subscription(subject, sub, bound, topic_arn)

    async def _queue(self, subject: str, sub: Mapping[str, Any], bound: Mapping[str, Any]) -> None:
        url = bound["queue_url"]
        attrs = await self._get(subject, f"queue {url}", self.sqs.get_queue_attributes, QueueUrl=url,
                                AttributeNames=["All"])
        if attrs is None:
            return
        fifo = attrs.get("FifoQueue", "false").lower() == "true"
        if fifo != bool(sub["is_fifo"]):
            self.error(subject, f"queue {url} is {'FIFO' if fifo else 'standard'} but the subscription's topic has "
                       f"is_fifo={sub['is_fifo']}: {REEXPORT}")
        visibility = int(attrs.get("VisibilityTimeout", "30"))
        if visibility != int(sub["visibility_timeout_seconds"]):
            self.error(subject, f"queue {url} has a visibility timeout of {visibility} s but the lease is "
                       f"{sub['visibility_timeout_seconds']} s: {REEXPORT}")
        redrive_text = attrs.get("RedrivePolicy")
        if not redrive_text:
            self.error(subject, f"queue {url} has no redrive policy to its dead-letter queue: {REEXPORT}")
        else:
            redrive = json.loads(redrive_text)
            if redrive.get("deadLetterTargetArn") != bound["dlq_arn"]:
                self.error(subject, f"queue {url} redrives to {redrive.get('deadLetterTargetArn')}, not the bound "
                           f"dead-letter queue {bound['dlq_arn']}: {REEXPORT}")
            count = int(redrive.get("maxReceiveCount", 0))
            wanted = int(sub.get("max_receive_count") or max_receive_count(int(sub["max_attempts"])))
            if count != wanted:
                self.error(subject, f"queue {url} redrives after {count} receives but the manifest's "
                           f"max_receive_count is {wanted} (max_attempts {sub['max_attempts']} and room for "
                           f"give-backs): {REEXPORT}")
        retention = int(attrs.get("MessageRetentionPeriod", "345600"))
        if retention != int(sub["message_retention_seconds"]):
            self.warning(subject, f"queue {url} keeps messages {retention} s but the subscription's retention is "
                         f"{sub['message_retention_seconds']} s: {REEXPORT}")

    async def _dlq(self, subject: str, sub: Mapping[str, Any], bound: Mapping[str, Any]) -> None:
        url = bound["dlq_url"]
        attrs = await self._get(subject, f"dead-letter queue {url}", self.sqs.get_queue_attributes, QueueUrl=url,
                                AttributeNames=["FifoQueue"])
        if attrs is None:
            return
        fifo = attrs.get("FifoQueue", "false").lower() == "true"
        if fifo != bool(sub["is_fifo"]):
            self.error(subject, f"dead-letter queue {url} is {'FIFO' if fifo else 'standard'} but the subscription "
                       f"has is_fifo={sub['is_fifo']}: {REEXPORT}")

    async def _sns_subscription(
        self, subject: str, sub: Mapping[str, Any], bound: Mapping[str, Any], topic_arn: str | None
    ) -> None:
        arn = bound["subscription_arn"]
        attrs = await self._get(subject, f"SNS subscription {arn}", self.sns.get_subscription_attributes,
                                SubscriptionArn=arn)
        if attrs is None:
            return
        if topic_arn is not None and attrs.get("TopicArn") != topic_arn:
            self.error(subject, f"SNS subscription {arn} is on {attrs.get('TopicArn')}, not the bound topic "
                       f"{topic_arn}: {REEXPORT}")
        if attrs.get("Endpoint") != bound["queue_arn"]:
            self.error(subject, f"SNS subscription {arn} delivers to {attrs.get('Endpoint')}, not the bound queue "
                       f"{bound['queue_arn']}: {REEXPORT}")
        raw = attrs.get("RawMessageDelivery", "false").lower() == "true"
        if raw != bool(sub.get("raw_message_delivery", True)):
            self.error(subject, f"SNS subscription {arn} has raw message delivery "
                       f"{'on' if raw else 'off'}; handlers need it on: {REEXPORT}")
        expected = sub.get("filter_policy")
        actual_text = attrs.get("FilterPolicy")
        actual = json.loads(actual_text) if actual_text else None
        if actual != expected:
            self.error(subject, f"SNS subscription {arn} has filter policy {json.dumps(actual)} but the filter renders "
                       f"{json.dumps(expected)}: {REEXPORT}")
        elif expected is not None:
            scope = attrs.get("FilterPolicyScope", "MessageAttributes")
            wanted = sub.get("filter_policy_scope") or "MessageAttributes"
            if scope != wanted:
                self.error(subject, f"SNS subscription {arn} applies its filter policy to {scope}, not {wanted}: "
                           f"{REEXPORT}")


async def check_bindings(manifest: Mapping[str, Any], bindings: Mapping[str, Any], sns: Any, sqs: Any) -> BindingReport:
    """Compares the resources ``bindings`` (the bindings format) name with ``manifest`` (the manifest
    format) through the aioboto3 clients ``sns`` and ``sqs``; read-only."""
    checker = _Checker(sns, sqs)
    if bindings.get("region") and bindings["region"] != manifest.get("region"):
        checker.error("bindings", f"the bindings are for region {bindings['region']} but the queue's aws_region is "
                      f"{manifest.get('region')}: set WORKQUEUE_AWS_REGION or import the bindings of that region")
    bound_topics: Mapping[str, Any] = bindings.get("topics") or {}
    bound_subs: Mapping[str, Any] = bindings.get("subscriptions") or {}
    for topic in manifest.get("topics", []):
        await checker.topic(topic, bound_topics.get(topic["name"]))
    for sub in manifest.get("subscriptions", []):
        topic_binding = bound_topics.get(sub["topic"])
        await checker.subscription(sub, bound_subs.get(sub["name"]),
                                   None if topic_binding is None else topic_binding["arn"])
    known_topics = {t["name"] for t in manifest.get("topics", [])}
    known_subs = {s["name"] for s in manifest.get("subscriptions", [])}
    for name in sorted(set(bound_topics) - known_topics):
        checker.warning(f"topic {name}", f"bound but not an aws topic of the queue (removed or moved?): {REEXPORT}")
    for name in sorted(set(bound_subs) - known_subs):
        checker.warning(f"subscription {name}", f"bound but not a subscription of an aws topic: {REEXPORT}")
    issues = checker.issues
    return BindingReport(transport="aws", ok=not any(i.severity == "Error" for i in issues), issues=issues)


async def validate_aws_bindings(
    manifest: Mapping[str, Any], bindings: Mapping[str, Any], *, region: str, endpoint_url: str | None = None
) -> BindingReport:
    """:func:`check_bindings` with clients from the SDK's default credential chain for ``region``."""
    aioboto3 = importlib.import_module("aioboto3")
    session = aioboto3.Session()
    async with (
        session.client("sns", region_name=region, endpoint_url=endpoint_url) as sns,
        session.client("sqs", region_name=region, endpoint_url=endpoint_url) as sqs,
    ):
        return await check_bindings(manifest, bindings, sns, sqs)
