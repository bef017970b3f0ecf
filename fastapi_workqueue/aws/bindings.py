"""Bindings: the ARNs and queue URLs the infrastructure created for the aws topology.

``workqueue import-bindings bindings.json`` reads what the Terraform module outputs as
``binding_import`` (that object, or the whole ``terraform output -json`` document) with
:meth:`Bindings.parse` and stores it with :func:`store_bindings`: in the table
``workqueue.aws_binding`` when the queue has a database, else in the JSON file named by
``WORKQUEUE_AWS_BINDINGS_FILE``. :func:`load_bindings` reads them back. The table is read and
replaced through the database's routines (:mod:`.outbox_store`): ``aws_binding_list`` and
``aws_binding_replace``, the latter the schema owner's (a deployment step).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..core.errors import ConfigurationError
from .outbox_store import store_for

if TYPE_CHECKING:
    from ..core.kernel import Kernel

BINDINGS_VERSION = 1


class TopicBinding(BaseModel):
    """An aws topic's SNS topic."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    arn: str = Field(min_length=1)


class SubscriptionBinding(BaseModel):
    """A subscription's SQS queue, its dead-letter queue and its SNS subscription."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    queue_url: str = Field(min_length=1)
    queue_arn: str = Field(min_length=1)
    dlq_url: str = Field(min_length=1)
    dlq_arn: str = Field(min_length=1)
    subscription_arn: str | None = None


class Bindings(BaseModel):
    """Every binding of the aws topology, keyed by topic and subscription name."""

    model_config = ConfigDict(extra="ignore")
    version: int = BINDINGS_VERSION
    region: str
    topics: dict[str, TopicBinding] = Field(default_factory=dict)
    subscriptions: dict[str, SubscriptionBinding] = Field(default_factory=dict)

    @classmethod
    def parse(cls, data: Any) -> Bindings:
        """Reads the ``binding_import`` object or a whole ``terraform output -json`` document (the
        object then at ``["binding_import"]["value"]``); bad input is a one-line ConfigurationError."""
        if isinstance(data, (str, bytes)):
            try:
                data = json.loads(data)
            except ValueError as exc:
                raise ConfigurationError(
                    f"bindings are not valid JSON ({exc}); pass the module's binding_import output"
                ) from exc
        if not isinstance(data, dict):
            raise ConfigurationError(
                f"bindings must be a JSON object, got {type(data).__name__}; "
                "write them with `terraform output -json binding_import > bindings.json`"
            )
        if "binding_import" in data:
            output = data["binding_import"]
            data = output.get("value") if isinstance(output, dict) and "value" in output else output
            if not isinstance(data, dict):
                raise ConfigurationError(
                    "binding_import in the terraform output has no object value; re-run terraform apply"
                )
        version = data.get("version", BINDINGS_VERSION)
        if version != BINDINGS_VERSION:
            raise ConfigurationError(f"bindings version {version!r} is not supported; this library reads version 1")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(top)"
            raise ConfigurationError(f"bindings are not valid at {where}: {first['msg']}") from exc

    def document(self) -> dict[str, Any]:
        """The bindings as the JSON object they were read from."""
        return self.model_dump(mode="json", exclude_none=True)


def _read_file(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _write_file(path: str, document: dict[str, Any]) -> None:
    fd, scratch = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".bindings-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2, sort_keys=True)
    os.replace(scratch, path)


def _bindings_file(kernel: Kernel) -> str:
    path = kernel.settings.aws_bindings_file
    if not path:
        raise ConfigurationError(
            "the queue has no database to store bindings in: set WORKQUEUE_AWS_BINDINGS_FILE "
            "(WorkQueueSettings.aws_bindings_file) to a JSON file path"
        )
    return path


async def load_bindings(kernel: Kernel) -> Bindings:
    """The stored bindings (none stored: an empty set in the settings' region)."""
    empty = Bindings(region=kernel.settings.aws_region or "")
    if not kernel.settings.database_url:
        text = await asyncio.to_thread(_read_file, _bindings_file(kernel))
        return empty if text is None else Bindings.parse(text)
    rows = await store_for(kernel.sessions.engine).list_bindings(kernel.sessions.engine)
    if not rows:
        return empty
    document: dict[str, Any] = {"version": BINDINGS_VERSION, "region": rows[0].region, "topics": {},
                                "subscriptions": {}}
    for row in rows:
        value = json.loads(row.binding) if isinstance(row.binding, (str, bytes)) else row.binding
        document["topics" if row.kind == "topic" else "subscriptions"][row.name] = value
    return Bindings.parse(document)


async def store_bindings(kernel: Kernel, bindings: Bindings) -> None:
    """Replaces the stored bindings with ``bindings`` (one transaction, or one atomic file write)."""
    if not kernel.settings.database_url:
        await asyncio.to_thread(_write_file, _bindings_file(kernel), bindings.document())
        return
    items: list[tuple[str, str, BaseModel]] = [("topic", n, b) for n, b in bindings.topics.items()]
    items += [("subscription", n, b) for n, b in bindings.subscriptions.items()]
    rows = [(kind, name, json.dumps(b.model_dump(exclude_none=True))) for kind, name, b in items]
    await store_for(kernel.sessions.engine).replace_bindings(kernel.sessions.engine, bindings.region, rows)
