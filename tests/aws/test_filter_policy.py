"""Filters rendered as SNS filter policies."""

from __future__ import annotations

from typing import Any

import pytest

from fastapi_workqueue.aws.filter_policy import render_filter_policy
from fastapi_workqueue.core.errors import ConfigurationError


def leaf(field: str, operator: str, value: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"field": field, "operator": operator}
    if value is not None:
        spec["value"] = value
    return spec


@pytest.mark.parametrize(("spec", "policy"), [
    (None, None),
    (leaf("region", "eq", "eu"), {"region": ["eu"]}),
    (leaf("region", "neq", "eu"), {"region": [{"anything-but": "eu"}]}),
    (leaf("sku", "startswith", "A-"), {"sku": [{"prefix": "A-"}]}),
    (leaf("tenant", "isnull"), {"tenant": [{"exists": False}]}),
    (leaf("tenant", "isnotnull"), {"tenant": [{"exists": True}]}),
    ({"logic": "or", "filters": [leaf("region", "eq", "eu"), leaf("region", "eq", "us")]},
     {"region": ["eu", "us"]}),
    ({"logic": "and", "filters": [leaf("region", "eq", "eu"), leaf("sku", "startswith", "A"),
                                  {"logic": "or", "filters": [leaf("kind", "eq", "a"), leaf("kind", "eq", "b")]}]},
     {"region": ["eu"], "sku": [{"prefix": "A"}], "kind": ["a", "b"]}),
])
def test_rendering(spec: dict[str, Any] | None, policy: dict[str, Any] | None) -> None:
    assert render_filter_policy(spec) == policy


def test_two_conditions_on_one_attribute_cannot_be_anded() -> None:
    spec = {"logic": "and", "filters": [leaf("sku", "startswith", "A"), leaf("sku", "neq", "AB")]}
    with pytest.raises(ConfigurationError, match=r"subscription 's': .* two conditions on attribute 'sku'"):
        render_filter_policy(spec, subscription="s")
