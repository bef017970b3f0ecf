"""The JSON shape on the wire: PascalCase names, snake_case accepted too."""

from __future__ import annotations

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
