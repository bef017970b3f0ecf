"""Renders a subscription filter (core/filters.py's subset) as an SNS filter policy.

``eq`` → ``["v"]``, an OR of ``eq`` → ``["a", "b"]``, ``startswith`` → ``[{"prefix": "x"}]``,
``neq`` → ``[{"anything-but": "x"}]``, ``isnull`` → ``[{"exists": false}]``, ``isnotnull`` →
``[{"exists": true}]``; an AND is the keys of one object (SNS ANDs keys). The policy applies to
the message attributes (``FilterPolicyScope: MessageAttributes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.errors import ConfigurationError
from ..core.filters import validate_filter

FILTER_POLICY_SCOPE = "MessageAttributes"


def _leaf(leaf: Mapping[str, Any]) -> list[Any]:
    operator = leaf["operator"]
    if operator == "eq":
        return [leaf["value"]]
    if operator == "neq":
        return [{"anything-but": leaf["value"]}]
    if operator == "startswith":
        return [{"prefix": leaf["value"]}]
    if operator == "isnull":
        return [{"exists": False}]
    return [{"exists": True}]


def render_filter_policy(spec: Mapping[str, Any] | None, *, subscription: str = "?") -> dict[str, Any] | None:
    """The SNS filter policy of a filter, or None without one.

    Two conditions on one attribute in an AND cannot be written as one SNS policy (SNS ORs the
    entries of one key): that is a ConfigurationError naming the subscription.
    """
    if spec is None:
        return None
    normal = validate_filter(spec)
    if "filters" not in normal:
        return {normal["field"]: _leaf(normal)}
    if normal["logic"] == "or":
        leaves = normal["filters"]
        return {leaves[0]["field"]: [leaf["value"] for leaf in leaves]}
    policy: dict[str, Any] = {}
    for child in normal["filters"]:
        rendered = render_filter_policy(child, subscription=subscription)
        assert rendered is not None
        for field, condition in rendered.items():
            if field in policy:
                raise ConfigurationError(
                    f"subscription {subscription!r}: its filter sets two conditions on attribute {field!r}, "
                    "which an SNS filter policy cannot AND; keep one condition per attribute"
                )
            policy[field] = condition
    return policy
