"""AWS resource names from topic and subscription names (the manifest's naming rule)."""

from __future__ import annotations

import re

NAME = "aws"
"""The transport's name: a topic's ``transport`` and the prefix of its delivery ids."""
BATCH = 10
"""The most entries one SQS or SNS batch call takes."""
MAX_NAME = 80
FIFO_SUFFIX = ".fifo"
DLQ_SUFFIX = "-dlq"
_OUTSIDE = re.compile(r"[^A-Za-z0-9_-]")


def resource_name(prefix: str, name: str, *, fifo: bool, extra: str = "") -> str:
    """``prefix`` + ``name`` with every character outside ``[A-Za-z0-9_-]`` made ``-``, cut so the
    whole name (with ``extra`` and ``.fifo`` for FIFO) is at most 80 characters."""
    suffix = extra + (FIFO_SUFFIX if fifo else "")
    base = _OUTSIDE.sub("-", prefix + name)
    return base[: MAX_NAME - len(suffix)] + suffix


def topic_name(prefix: str, topic: str, *, fifo: bool) -> str:
    """The SNS topic's name."""
    return resource_name(prefix, topic, fifo=fifo)


def queue_name(prefix: str, subscription: str, *, fifo: bool) -> str:
    """The subscription's SQS queue name."""
    return resource_name(prefix, subscription, fifo=fifo)


def dlq_name(prefix: str, subscription: str, *, fifo: bool) -> str:
    """The subscription's dead-letter queue name: ``<queue>-dlq[.fifo]``."""
    return resource_name(prefix, subscription, fifo=fifo, extra=DLQ_SUFFIX)
