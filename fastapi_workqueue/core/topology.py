"""Topics and subscriptions: the topology a queue runs, and the policy of each subscription."""

from __future__ import annotations

import functools
import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .envelope import MAX_ATTEMPTS_LIMIT, MAX_DELAY_SECONDS
from .filters import validate_filter
from .flow import parse_rate
from .wire import WireModel, unknown_keys_named

PartitionMode = Literal["None", "Exclusive", "Ordered"]
HeartbeatMode = Literal["Auto", "Manual"]
SubscriptionStatus = Literal["Active", "Paused"]
"""The status a subscription is declared with, and that pause and resume set."""
StoredStatus = Literal["Active", "Paused", "Retired"]
"""A subscription's (or topic's) status as the store reports it: Retired once an operator retired it."""
HostType = Literal["worker", "external"]

DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600
MIN_LEASE_SECONDS = 0.5
"""The shortest lease a subscription (or a job queue) takes: one shorter ran out before its handler
could start, so every delivery went back unrun and was dead-lettered."""
JOB_TOPIC_PREFIX = "jobs."
"""The topics (and subscriptions) of the jobs layer's queues: job queue ``Q`` is topic ``jobs.Q``."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,199}$")


def is_job_topic(topic: str) -> bool:
    """Whether ``topic`` is a job queue's (``jobs.*``), whose messages the job runner runs as jobs."""
    return topic.startswith(JOB_TOPIC_PREFIX)


@functools.lru_cache(maxsize=256)
def is_name(value: str) -> bool:
    """Whether ``value`` can name a topic or subscription at all (one that cannot names none; checked
    once per name a process meets)."""
    return bool(_NAME.match(value))


def check_name(kind: str, value: str) -> str:
    """Topic and subscription names: 1-200 letters, digits, ``.``, ``_``, ``:`` or ``-``."""
    if not _NAME.match(value):
        raise ValueError(
            f"{kind} name {value!r} is not valid: use 1 to 200 letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit"
        )
    return value


def topic_move_refused(subscription: str, stored: str, declared: str) -> str:
    """Why a stored subscription does not move to another topic (the words of every store)."""
    return (
        f"subscription {subscription} is on topic {stored} in the store, and the code puts it on topic {declared}: "
        f"a subscription does not move between topics (what processes still running the code before publish to "
        f"{stored} would reach it no more); declare a new subscription on {declared} and retire {subscription} "
        f"(`workqueue subscriptions retire {subscription}`), or retire and delete {subscription} first"
    )


class Topic(WireModel):
    """A named stream that producers publish to."""

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        return unknown_keys_named(cls, data)

    name: str
    transport: str = "database"
    max_payload_bytes: int | None = Field(default=None, gt=0)
    is_fifo: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name("topic", value)


class TopicState(Topic):
    """A topic as the store lists it, with its status."""

    status: StoredStatus = "Active"


class Subscription(WireModel):
    """A named consumer of a topic: every matching message gives it one delivery."""

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        return unknown_keys_named(cls, data)

    name: str
    topic: str
    handler_key: str
    partition_mode: PartitionMode = "None"
    # Durations at most MAX_DELAY_SECONDS: the stores add them to timestamps, and one that overflows
    # would fail every claim, settle or sweep pass that uses it.
    lease_seconds: float = Field(default=60, gt=0, le=MAX_DELAY_SECONDS)
    max_attempts: int = Field(default=5, ge=1, le=MAX_ATTEMPTS_LIMIT)
    backoff_base_seconds: float = Field(default=1, ge=0, le=MAX_DELAY_SECONDS)
    backoff_max_seconds: float = Field(default=300, ge=0, le=MAX_DELAY_SECONDS)
    max_processing_seconds: float | None = Field(default=None, gt=0, le=MAX_DELAY_SECONDS)
    heartbeat_mode: HeartbeatMode = "Auto"
    filter: dict[str, Any] | None = None
    status: SubscriptionStatus = "Active"
    host_type: HostType = "worker"
    retention_seconds: float = Field(default=DEFAULT_RETENTION_SECONDS, ge=0, le=MAX_DELAY_SECONDS)
    # Flow limits, held across every process (docs/design/flow-control.md); None: no limit.
    max_in_flight: int | None = Field(default=None, ge=1, le=MAX_ATTEMPTS_LIMIT)
    """At most this many deliveries InFlight at once, in all processes together."""
    key_concurrency: int | None = Field(default=None, ge=1, le=MAX_ATTEMPTS_LIMIT)
    """At most this many InFlight per partition key (None mode; Exclusive and Ordered keys have 1)."""
    rate_limit: str | None = None
    """At most this many claims per second, minute or hour (``"50/s"``, ``"600/m"``, ``"1000/h"``)."""
    key_rate_limit: str | None = None
    """The same per partition key (each key its own bucket)."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name("subscription", value)

    @field_validator("rate_limit", "key_rate_limit")
    @classmethod
    def _rate(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else str(parse_rate(value, info.field_name or "rate_limit"))

    @field_validator("topic")
    @classmethod
    def _topic(cls, value: str) -> str:
        return check_name("topic", value)

    @field_validator("filter")
    @classmethod
    def _filter(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else validate_filter(value)

    @model_validator(mode="after")
    def _backoff(self) -> Subscription:
        if self.lease_seconds < MIN_LEASE_SECONDS and type(self) is Subscription:
            # (at declaration: a subscription an earlier release stored with a shorter lease still reads)
            raise ValueError(
                f"lease_seconds is {self.lease_seconds:g}; at least {MIN_LEASE_SECONDS:g} s is needed (a shorter lease "
                "runs out before a handler can start: every delivery would go back unrun until it is dead-lettered)"
            )
        if self.backoff_max_seconds < self.backoff_base_seconds:
            raise ValueError(
                f"backoff_max_seconds ({self.backoff_max_seconds}) is below backoff_base_seconds "
                f"({self.backoff_base_seconds}); raise the maximum or lower the base"
            )
        if self.key_concurrency not in (None, 1) and self.partition_mode != "None":
            raise ValueError(
                f"key_concurrency={self.key_concurrency} does not fit partition_mode {self.partition_mode!r}: its keys "
                "run one delivery at a time already (key_concurrency 1); use partition_mode 'None' to run several "
                "of a key at once, or leave key_concurrency out"
            )
        return self

    @property
    def flow_limited(self) -> bool:
        """Whether a claim must count or meter anything: a limit other than what the partition
        mode already gives (``key_concurrency`` 1 on an Exclusive or Ordered subscription)."""
        return (self.max_in_flight is not None or self.rate_limit is not None or self.key_rate_limit is not None
                or (self.key_concurrency is not None and self.partition_mode == "None"))

    def flow_limits(self) -> dict[str, int | str]:
        """The limits that are set, by field name (what listings and the dashboard show)."""
        limits = {"max_in_flight": self.max_in_flight, "key_concurrency": self.key_concurrency,
                  "rate_limit": self.rate_limit, "key_rate_limit": self.key_rate_limit}
        return {name: value for name, value in limits.items() if value is not None}

    @property
    def heartbeat_interval_seconds(self) -> float:
        """How often the runtime renews an Auto lease: min(lease / 3, 30 s)."""
        return min(self.lease_seconds / 3, 30.0)


class SubscriptionState(Subscription):
    """A subscription as the transport stores it, with the state of its topic."""

    id: int | str
    status: StoredStatus = "Active"  # type: ignore[assignment]
    topic_status: StoredStatus = "Active"
    transport_name: str = "database"
    is_fifo: bool = False
