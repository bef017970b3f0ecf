"""The JSON shape on the wire: PascalCase names, snake_case accepted too."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

_ACRONYMS = {"id": "ID", "ttl": "TTL", "url": "URL"}


def to_wire_name(name: str) -> str:
    """``message_id`` → ``MessageID``, ``deduplication_ttl_seconds`` → ``DeduplicationTTLSeconds``."""
    return "".join(_ACRONYMS.get(part, part.capitalize()) for part in name.split("_"))


class WireModel(BaseModel):
    """Base of every model that travels as JSON: PascalCase aliases, snake_case accepted."""

    model_config = ConfigDict(
        alias_generator=to_wire_name,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
        # Validators are built when a model is first used, not at import: a worker loads the
        # operator reports, the REST bodies and the health views it never builds (bench/README.md,
        # memory).
        defer_build=True,
    )


def unknown_keys_named(model: type[BaseModel], data: Any) -> Any:
    """For a ``model_validator(mode="before")``: refuses a key the model does not have with the
    field it most resembles (``max_attempt`` → ``max_attempts``), where pydantic says only "Extra
    inputs are not permitted"."""
    if not isinstance(data, dict):
        return data
    known = {name: name for name in model.model_fields}
    known.update({to_wire_name(name): name for name in model.model_fields})
    unknown = [key for key in data if isinstance(key, str) and key not in known]
    if not unknown:
        return data
    from .words import closest

    said = []
    for key in unknown:
        guess = closest(key, known)
        hint = f"did you mean {known[guess]!r}?" if guess else f"its fields: {', '.join(model.model_fields)}"
        said.append(f"{model.__name__} has no field {key!r}; {hint}")
    raise ValueError("; ".join(said))
