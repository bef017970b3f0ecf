"""Names of the OpenTelemetry messaging semantic conventions (v1.44) the queue emits.

They are marked Development upstream. As other instrumentations do, the queue reads
``OTEL_SEMCONV_STABILITY_OPT_IN``: ``messaging`` (or nothing, since this library never emitted an
older form) gives the v1.44 names only; ``messaging/dup`` adds the pre-1.26 ``messaging.operation``
beside ``messaging.operation.type``, for dashboards built on the old name.
"""

from __future__ import annotations

import os

SYSTEM = "fastapi_workqueue"
"""The value of ``messaging.system``."""

MESSAGING_SYSTEM = "messaging.system"
OPERATION_NAME = "messaging.operation.name"
OPERATION_TYPE = "messaging.operation.type"
LEGACY_OPERATION = "messaging.operation"
DESTINATION_NAME = "messaging.destination.name"
SUBSCRIPTION_NAME = "messaging.destination.subscription.name"
CONSUMER_GROUP = "messaging.consumer.group.name"
MESSAGE_ID = "messaging.message.id"
CONVERSATION_ID = "messaging.message.conversation_id"
BATCH_COUNT = "messaging.batch.message_count"
DELIVERY_ATTEMPT = "messaging.workqueue.attempt"
ERROR_TYPE = "error.type"
EXCEPTION_TYPE = "exception.type"
EXCEPTION_MESSAGE = "exception.message"
EXCEPTION_STACKTRACE = "exception.stacktrace"
EXCEPTION_ESCAPED = "exception.escaped"

CLIENT_OPERATION_DURATION = "messaging.client.operation.duration"
PROCESS_DURATION = "messaging.process.duration"
SENT_MESSAGES = "messaging.client.sent.messages"
CONSUMED_MESSAGES = "messaging.client.consumed.messages"

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
"""The bucket boundaries the conventions advise for these durations (seconds)."""


def emit_legacy(environ: dict[str, str] | None = None) -> bool:
    """True when ``OTEL_SEMCONV_STABILITY_OPT_IN`` asks for the old names too (``messaging/dup``)."""
    value = (environ if environ is not None else os.environ).get("OTEL_SEMCONV_STABILITY_OPT_IN", "")
    return "messaging/dup" in {part.strip() for part in value.split(",")}


def operation(name: str, kind: str, legacy: bool) -> dict[str, str]:
    """The system and operation attributes of one operation."""
    attributes = {MESSAGING_SYSTEM: SYSTEM, OPERATION_NAME: name, OPERATION_TYPE: kind}
    if legacy:
        attributes[LEGACY_OPERATION] = kind
    return attributes
