"""The ``WORKQUEUE_SUBSCRIPTION_POLICY`` of a Lambda that serves a subscription: what the Terraform
module sets on the function (``infrastructure/terraform/aws/lambda.tf``), built from the app's own
subscription and its bindings. ``workqueue lambda-policy SUBSCRIPTION`` prints it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigurationError
from .manifest import check_subscription, visibility_timeout

if TYPE_CHECKING:
    from ..core.topology import Subscription, Topic
    from .bindings import Bindings

POLICY_VERSION = 1


def lambda_policy(
    subscription: Subscription, topic: Topic, bindings: Bindings, *, region: str | None
) -> dict[str, Any]:
    """The policy a Lambda serving ``subscription`` reads (checked by the adapter's own model)."""
    from .lambda_handler import SubscriptionPolicy

    if topic.transport != "aws":
        raise ConfigurationError(
            f"subscription {subscription.name!r} is on topic {topic.name!r} of the {topic.transport} transport; "
            "only a subscription of an aws topic can be served by Lambda"
        )
    check_subscription(subscription, topic)
    bound = bindings.subscriptions.get(subscription.name)
    if bound is None:
        raise ConfigurationError(
            f"subscription {subscription.name!r} is not bound: apply the Terraform module, run "
            "`workqueue import-bindings bindings.json`, or pass --bindings bindings.json"
        )
    policy = {
        "version": POLICY_VERSION,
        "name": subscription.name,
        "topic": topic.name,
        "handler_key": subscription.handler_key,
        "partition_mode": subscription.partition_mode,
        "is_fifo": topic.is_fifo,
        "max_attempts": subscription.max_attempts,
        "lease_seconds": visibility_timeout(subscription),
        "backoff_base_seconds": subscription.backoff_base_seconds,
        "backoff_max_seconds": subscription.backoff_max_seconds,
        "max_processing_seconds": subscription.max_processing_seconds,
        "queue_url": bound.queue_url,
        "dlq_url": bound.dlq_url,
        "region": region,
    }
    SubscriptionPolicy.model_validate(policy)
    return policy
