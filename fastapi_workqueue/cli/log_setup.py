"""How ``workqueue work`` logs: it is a program, so it configures logging for its own process.

Embedded in an app the library never touches logging; the worker sends every record to stderr,
as text or as one JSON object per line, with the delivery's ids when the record has them
(``context.log`` adds them to a handler's records).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Literal

LogFormat = Literal["text", "json"]

DELIVERY_FIELDS = ("subscription", "delivery_id", "message_id", "attempt")


def _time(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _delivery_fields(record: logging.LogRecord) -> dict[str, object]:
    return {name: getattr(record, name) for name in DELIVERY_FIELDS if getattr(record, name, None) is not None}


def _exception(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """The record's traceback: the package's loggers keep it redacted as ``exc_text``."""
    if record.exc_info:
        return formatter.formatException(record.exc_info)
    return record.exc_text or None


class TextFormatter(logging.Formatter):
    """``2026-12-01T10:00:00.000Z INFO fastapi_workqueue.host: message [subscription=… attempt=2]``."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_time(record)} {record.levelname} {record.name}: {record.getMessage()}"
        fields = _delivery_fields(record)
        if fields:
            line += " [" + " ".join(f"{k}={v}" for k, v in fields.items()) + "]"
        exception = _exception(self, record)
        if exception:
            line += "\n" + exception
        return line


class JsonFormatter(logging.Formatter):
    """One object a line: time, level, logger, message, the delivery fields, the exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": _time(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_delivery_fields(record),
        }
        exception = _exception(self, record)
        if exception:
            entry["exception"] = exception
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: LogFormat) -> None:
    """Sends the process's log records at ``level`` and above to stderr in ``log_format``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())
