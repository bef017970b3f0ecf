"""The subscription filter: the subset of a composite filter descriptor every transport can express.

A filter is a leaf ``{"field": "eventType", "operator": "eq", "value": "signup"}`` or a
composite ``{"logic": "and", "filters": [...]}``. Allowed: ``eq``, ``neq``, ``startswith``,
``isnull``, ``isnotnull`` leaves; AND across fields; OR of ``eq`` leaves on one field. Matching is
case-sensitive. An attribute that is absent matches only ``isnull``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .observe import HEADERS_KEY

OPERATORS = ("eq", "neq", "startswith", "isnull", "isnotnull")
_VALUE_OPERATORS = {"eq", "neq", "startswith"}

ALLOWED = (
    "allowed: leaves {field, operator, value} with operator eq, neq, startswith, isnull or isnotnull; "
    '{"logic": "and", "filters": [...]} across fields; {"logic": "or", "filters": [...]} of eq '
    "leaves on one field"
)


class FilterError(ValueError):
    """A filter outside the supported subset."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"filter refused: {problem}; {ALLOWED}")


def validate_filter(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Checks a filter against the supported subset and returns it normalised.

    Raises :class:`FilterError` naming what is allowed when the filter is richer.
    """
    if not isinstance(spec, Mapping):
        raise FilterError(f"a filter must be a JSON object, got {type(spec).__name__}")
    if "filters" in spec or "logic" in spec:
        return _composite(spec, nested=False)
    return _leaf(spec)


def _leaf(spec: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(spec) - {"field", "operator", "value"}
    if unknown:
        raise FilterError(f"unsupported keys {sorted(unknown)} (matching is always case-sensitive)")
    field, operator = spec.get("field"), spec.get("operator")
    if not isinstance(field, str) or not field:
        raise FilterError("every leaf needs a non-empty string 'field' naming an attribute")
    if field == HEADERS_KEY:
        raise FilterError(f"{HEADERS_KEY!r} is the library's own (the trace context a message carries), not an "
                          "attribute a filter can read; filter on an attribute the publisher sets")
    if operator not in OPERATORS:
        raise FilterError(f"operator {operator!r} is not supported")
    if operator in _VALUE_OPERATORS:
        value = spec.get("value")
        if not isinstance(value, str):
            raise FilterError(f"operator {operator} on {field!r} needs a string 'value' (attributes are strings)")
        return {"field": field, "operator": operator, "value": value}
    if spec.get("value") is not None:
        raise FilterError(f"operator {operator} on {field!r} takes no value")
    return {"field": field, "operator": operator}


def _composite(spec: Mapping[str, Any], *, nested: bool) -> dict[str, Any]:
    unknown = set(spec) - {"logic", "filters"}
    if unknown:
        raise FilterError(f"unsupported keys {sorted(unknown)} in a composite")
    logic = spec.get("logic", "and")
    children = spec.get("filters")
    if logic not in ("and", "or"):
        raise FilterError(f"logic {logic!r} is not supported")
    if not isinstance(children, list) or not children:
        raise FilterError("a composite needs a non-empty 'filters' list")
    if logic == "or":
        leaves = [_leaf(c) if isinstance(c, Mapping) and "filters" not in c else None for c in children]
        if any(leaf is None or leaf["operator"] != "eq" for leaf in leaves):
            raise FilterError("'or' may only combine eq leaves")
        fields = {leaf["field"] for leaf in leaves if leaf is not None}
        if len(fields) != 1:
            raise FilterError(f"'or' may only combine eq leaves on one field, got {sorted(fields)}")
        return {"logic": "or", "filters": leaves}
    normalised: list[dict[str, Any]] = []
    for child in children:
        if not isinstance(child, Mapping):
            raise FilterError("every entry of 'filters' must be a JSON object")
        if "filters" in child or "logic" in child:
            inner = _composite(child, nested=True)
            if inner["logic"] == "and":
                normalised.extend(inner["filters"])
            else:
                normalised.append(inner)
        else:
            normalised.append(_leaf(child))
    return {"logic": "and", "filters": normalised}


def matches(spec: Mapping[str, Any] | None, attributes: Mapping[str, str]) -> bool:
    """Evaluates a validated filter against message attributes (case-sensitive)."""
    if spec is None:
        return True
    if "filters" in spec:
        results = (matches(child, attributes) for child in spec["filters"])
        return any(results) if spec.get("logic") == "or" else all(results)
    value = attributes.get(spec["field"])
    operator = spec["operator"]
    if operator == "isnull":
        return value is None
    if operator == "isnotnull":
        return value is not None
    if value is None:
        return False
    expected: str = spec["value"]
    if operator == "eq":
        return value == expected
    if operator == "neq":
        return value != expected
    return value.startswith(expected)


def filter_fields(spec: Mapping[str, Any] | None) -> set[str]:
    """The attribute names a filter reads."""
    if spec is None:
        return set()
    if "filters" in spec:
        return set().union(*(filter_fields(child) for child in spec["filters"]))
    return {spec["field"]}
