"""The topology manifest the infrastructure code reads (``export-topology --transport aws``).

:func:`build_manifest` renders the ``aws`` topics and their subscriptions with their resource
names, FIFO flags, filter policies and policies; :func:`validate_manifest` checks a manifest
against the JSON Schema shipped beside this module (``manifest.schema.json``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigurationError
from ..core.topology import Subscription, Topic
from . import naming
from .filter_policy import FILTER_POLICY_SCOPE, render_filter_policy

if TYPE_CHECKING:
    from ..core.settings import WorkQueueSettings

MANIFEST_VERSION = 1
TRANSPORT = "aws"
MAX_VISIBILITY_SECONDS = 12 * 3600
MIN_RETENTION_SECONDS, MAX_RETENTION_SECONDS = 60, 14 * 24 * 3600
MAX_LAMBDA_TIMEOUT_SECONDS = 900
MAX_RECEIVE_COUNT = 1000
GIVE_BACK_ALLOWANCE = 10
"""Receives the redrive allows beyond max_attempts: SQS counts a give-back (a shutdown, a pause) as a
receive, and another process cannot know of one; the library's own dead letter comes first."""
LAMBDA_DEFAULTS = {"batch_size": 10, "maximum_batching_window_seconds": 0, "timeout_seconds": 60}


def _generator() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"fastapi-workqueue {version('fastapi-workqueue')}"
    except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
        return "fastapi-workqueue"


def check_subscription(subscription: Subscription, topic: Topic) -> None:
    """Refuses what SNS and SQS cannot honour, naming the subscription."""
    if subscription.partition_mode == "Ordered":
        raise ConfigurationError(
            f"subscription {subscription.name!r}: Ordered needs a database topic; topic {topic.name!r} has "
            "transport='aws' (use partition_mode='Exclusive' on a FIFO topic, or keep the topic on 'database')"
        )
    if subscription.max_attempts + GIVE_BACK_ALLOWANCE > MAX_RECEIVE_COUNT:
        raise ConfigurationError(
            f"subscription {subscription.name!r}: max_attempts {subscription.max_attempts} leaves no room under "
            f"SQS's maxReceiveCount limit of {MAX_RECEIVE_COUNT} for {GIVE_BACK_ALLOWANCE} give-backs; lower it "
            f"to at most {MAX_RECEIVE_COUNT - GIVE_BACK_ALLOWANCE}"
        )
    if subscription.flow_limited:
        limits = ", ".join(f"{k}={v!r}" for k, v in subscription.flow_limits().items())
        raise ConfigurationError(
            f"subscription {subscription.name!r}: {limits} needs a database topic; topic {topic.name!r} has "
            "transport='aws', where SQS can neither count what runs across processes nor meter claims (remove "
            "the limits, or keep the topic on 'database')"
        )
    if subscription.partition_mode == "Exclusive" and not topic.is_fifo:
        raise ConfigurationError(
            f"subscription {subscription.name!r}: Exclusive on an aws topic needs a FIFO topic; "
            f"set is_fifo=True on topic {topic.name!r}"
        )


def max_receive_count(max_attempts: int) -> int:
    """The redrive's ``maxReceiveCount``: ``max_attempts`` plus :data:`GIVE_BACK_ALLOWANCE`. The
    receive that reaches it is the delivery's last attempt (the library dead-letters a failure
    itself, with its reason and last error), so SQS's redrive, which keeps neither, only takes a
    message that more than that many give-backs or crashes brought back."""
    return min(MAX_RECEIVE_COUNT, max_attempts + GIVE_BACK_ALLOWANCE)


def visibility_timeout(subscription: Subscription) -> int:
    """The queue's visibility timeout: the lease in whole seconds (1 s to 12 h)."""
    return max(1, min(MAX_VISIBILITY_SECONDS, math.ceil(subscription.lease_seconds)))


def retention(subscription: Subscription) -> int:
    """The queue's message retention: the subscription's, within SQS's 60 s to 14 days."""
    return max(MIN_RETENTION_SECONDS, min(MAX_RETENTION_SECONDS, math.ceil(subscription.retention_seconds)))


def lambda_block(subscription: Subscription) -> dict[str, Any]:
    """The Lambda consumer's settings of a subscription served by Lambda. A function timeout longer
    than the lease is refused: the message would become visible again, and run a second time, while
    the first invocation still works on it."""
    block = dict(LAMBDA_DEFAULTS)
    if subscription.max_processing_seconds is not None:
        block["timeout_seconds"] = min(MAX_LAMBDA_TIMEOUT_SECONDS, math.ceil(subscription.max_processing_seconds))
    timeout, lease = block["timeout_seconds"], visibility_timeout(subscription)
    if timeout > lease:
        where = (
            f"max_processing_seconds={subscription.max_processing_seconds:g}"
            if subscription.max_processing_seconds is not None
            else "the default"
        )
        raise ConfigurationError(
            f"subscription {subscription.name!r} is served by Lambda with a {timeout} s timeout ({where}) but "
            f"its lease, the queue's visibility timeout, is {lease} s: a message would come back to a second "
            f"invocation while the first still runs; raise lease_seconds to at least {timeout}, or set "
            f"max_processing_seconds to at most {lease}"
        )
    return block


def build_manifest(
    topics: Iterable[Topic], subscriptions: Iterable[Subscription], settings: WorkQueueSettings
) -> dict[str, Any]:
    """The manifest of the ``aws`` topics and their subscriptions (others are left out)."""
    prefix = settings.aws_resource_prefix
    if not settings.aws_region:
        raise ConfigurationError("the manifest needs a region: set WORKQUEUE_AWS_REGION (WorkQueueSettings.aws_region)")
    aws_topics = {t.name: t for t in topics if t.transport == TRANSPORT}
    lambdas = set(settings.aws_lambda_subscriptions)
    topic_items = [
        {"name": t.name, "sns_name": naming.topic_name(prefix, t.name, fifo=t.is_fifo), "is_fifo": t.is_fifo}
        for t in sorted(aws_topics.values(), key=lambda t: t.name)
    ]
    sub_items: list[dict[str, Any]] = []
    for sub in sorted(subscriptions, key=lambda s: s.name):
        topic = aws_topics.get(sub.topic)
        if topic is None:
            continue
        check_subscription(sub, topic)
        policy = render_filter_policy(sub.filter, subscription=sub.name)
        sub_items.append({
            "name": sub.name,
            "topic": topic.name,
            "handler_key": sub.handler_key,
            "queue_name": naming.queue_name(prefix, sub.name, fifo=topic.is_fifo),
            "dlq_name": naming.dlq_name(prefix, sub.name, fifo=topic.is_fifo),
            "is_fifo": topic.is_fifo,
            "partition_mode": sub.partition_mode,
            "max_attempts": sub.max_attempts,
            "max_receive_count": max_receive_count(sub.max_attempts),
            "visibility_timeout_seconds": visibility_timeout(sub),
            "message_retention_seconds": retention(sub),
            "raw_message_delivery": True,
            "filter_policy": policy,
            "filter_policy_scope": FILTER_POLICY_SCOPE,
            "lambda": lambda_block(sub) if sub.name in lambdas else None,
        })
    check_names(topic_items, sub_items)
    unknown = lambdas - {s["name"] for s in sub_items}
    if unknown:
        raise ConfigurationError(
            f"WORKQUEUE_AWS_LAMBDA_SUBSCRIPTIONS names {sorted(unknown)}, which are not subscriptions of aws topics; "
            "remove them or declare them"
        )
    return {
        "version": MANIFEST_VERSION,
        "generator": _generator(),
        "region": settings.aws_region,
        "topics": topic_items,
        "subscriptions": sub_items,
    }


def check_names(topics: list[dict[str, Any]], subscriptions: list[dict[str, Any]]) -> None:
    """Refuses names that map to one resource: two topics to one SNS topic, two subscriptions to
    one SQS queue, or a subscription's queue to another's dead-letter queue (``orders.email``,
    ``orders-email`` and ``orders.email.dlq`` do), naming both and what to do."""
    owners: dict[str, str] = {}
    for topic in topics:
        what = f"topic {topic['name']!r}"
        other = owners.setdefault(f"sns:{topic['sns_name']}", what)
        if other != what:
            raise ConfigurationError(
                f"{other} and {what} map to the same SNS topic {topic['sns_name']!r} (every character outside "
                "[A-Za-z0-9_-] becomes '-'): rename one of them"
            )
    for sub in subscriptions:
        for kind, resource in (("queue", sub["queue_name"]), ("dead-letter queue", sub["dlq_name"])):
            what = f"the {kind} of subscription {sub['name']!r}"
            other = owners.setdefault(f"sqs:{resource}", what)
            if other != what:
                raise ConfigurationError(
                    f"{other} and {what} are the same SQS queue {resource!r} (every character outside "
                    "[A-Za-z0-9_-] becomes '-', and a dead-letter queue is the queue's name with '-dlq'): "
                    "rename one of the subscriptions"
                )


@cache
def manifest_schema() -> dict[str, Any]:
    """The manifest's JSON Schema (draft 2020-12)."""
    text = resources.files("fastapi_workqueue.aws").joinpath("manifest.schema.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def validate_manifest(manifest: Any) -> None:
    """Raises ConfigurationError with the first place the manifest breaks its schema."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(manifest_schema())
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.absolute_path) or "(top)"
        raise ConfigurationError(f"manifest is not valid at {where}: {first.message}")
