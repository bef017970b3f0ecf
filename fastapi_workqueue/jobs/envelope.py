"""How a job travels as a queue message.

A job queue ``Q`` is the topic ``jobs.Q`` with one subscription of the same name. A job is one
message on it: the job id is the MessageID, ``tries`` its ``max_attempts``, ``backoff`` its
``backoff_seconds``, and the payload is the job envelope below (the job's name is also the message's
``job`` attribute, so listings and filters show it):

    {"v": 1, "job": "billing.send-invoice-reminder", "payload": {...}, "timeout": 30,
     "unique": {"key": "...", "until": "done"}, "chain": [{next job}, ...], "group": "<id>"}

An encrypted job carries ``"encrypted": "<token>"`` instead of ``"payload"``. A chained job carries
what comes after it, each entry with its own id, queue and policy, so the chain goes on with the
policy it was dispatched with. The ``then`` job of a group names the group it waits for.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from ..core.envelope import canonical_json
from ..core.topology import JOB_TOPIC_PREFIX

TOPIC_PREFIX = JOB_TOPIC_PREFIX
VERSION = 1
JOB_ATTRIBUTE = "job"
UniqueUntil = Literal["done", "processing"]
PLAIN_KEYS = frozenset(("v", "job", "payload"))
"""The keys of the envelope of a job without a timeout, a unique key, a chain or encryption."""


def topic_of(queue: str) -> str:
    """The topic (and subscription) of a job queue."""
    return f"{TOPIC_PREFIX}{queue}"


def queue_of(topic_or_subscription: str) -> str | None:
    """The job queue of a topic or subscription name, or None when it is not a job queue."""
    if topic_or_subscription.startswith(TOPIC_PREFIX):
        return topic_or_subscription[len(TOPIC_PREFIX):]
    return None


class EnvelopeInvalid(ValueError):
    """A message on a job queue that is not a job envelope."""


@dataclass(frozen=True, slots=True)
class ChainLink:
    """A job queued after the one that carries it, once that one succeeded."""

    job: str
    id: uuid.UUID
    queue: str
    tries: int
    backoff: tuple[float, ...] | None
    timeout: float | None
    payload: Any = None
    encrypted: str | None = None
    priority: int = 0
    delay: float | None = None
    """Seconds it waits once queued (after the job before it succeeded)."""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"job": self.job, "id": str(self.id), "queue": self.queue, "tries": self.tries}
        if self.priority:
            data["priority"] = self.priority
        if self.delay:
            data["delay"] = self.delay
        if self.backoff is not None:
            data["backoff"] = list(self.backoff)
        if self.timeout is not None:
            data["timeout"] = self.timeout
        if self.encrypted is not None:
            data["encrypted"] = self.encrypted
        else:
            data["payload"] = self.payload
        return data

    @classmethod
    def from_json(cls, data: Any) -> ChainLink:
        if not isinstance(data, dict) or not isinstance(data.get("job"), str):
            raise EnvelopeInvalid("a chain entry is not an object with a job name")
        try:
            backoff = data.get("backoff")
            return cls(
                job=data["job"], id=uuid.UUID(str(data["id"])), queue=str(data["queue"]), tries=int(data["tries"]),
                backoff=None if backoff is None else tuple(float(b) for b in backoff),
                timeout=None if data.get("timeout") is None else float(data["timeout"]),
                payload=data.get("payload"), encrypted=data.get("encrypted"),
                priority=int(data.get("priority") or 0),
                delay=None if data.get("delay") is None else float(data["delay"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvelopeInvalid(f"a chain entry is malformed ({exc})") from None


def plain_envelope_json(job: str, payload: Any) -> tuple[str, int]:
    """The canonical JSON and size of the envelope ``{"v": 1, "job": job, "payload": payload}`` (a
    job without encryption, timeout or unique key), as ``canonical_json`` of it gives, built
    around the payload's own JSON: its keys sorted are job, payload, v, and a job's name is ASCII
    that JSON writes as it is (:func:`~.definition.check_job_name`)."""
    inner, size = canonical_json(payload)
    text = f'{{"job":"{job}","payload":{inner},"v":{VERSION}}}'
    return text, size + len(text) - len(inner)


def envelope_json(job: str, payload: Any, encrypted: str | None = None, timeout: float | None = None,
                  unique_key: str | None = None, unique_until: UniqueUntil | None = None,
                  group: uuid.UUID | None = None) -> dict[str, Any]:
    """The JSON of a job envelope without a chain (what :meth:`JobEnvelope.to_json` gives), built
    without the envelope object: the jobs layer's dispatch and bulk, once per job."""
    data: dict[str, Any] = {"v": VERSION, "job": job}
    if encrypted is not None:
        data["encrypted"] = encrypted
    else:
        data["payload"] = payload
    if timeout is not None:
        data["timeout"] = timeout
    if unique_key is not None:
        data["unique"] = {"key": unique_key, "until": unique_until or "done"}
    if group is not None:
        data["group"] = str(group)
    return data


@dataclass(frozen=True, slots=True)
class JobEnvelope:
    """The payload of a job message."""

    job: str
    payload: Any = None
    encrypted: str | None = None
    timeout: float | None = None
    unique_key: str | None = None
    unique_until: UniqueUntil | None = None
    chain: tuple[ChainLink, ...] = field(default=())
    group: uuid.UUID | None = None
    """The group whose end this job waits for (the ``then`` job of ``queue.group``)."""

    def to_json(self) -> dict[str, Any]:
        data = envelope_json(self.job, self.payload, self.encrypted, self.timeout, self.unique_key, self.unique_until,
                             self.group)
        if self.chain:
            data["chain"] = [link.to_json() for link in self.chain]
        return data

    @classmethod
    def from_json(cls, data: Any) -> JobEnvelope:
        if isinstance(data, dict) and data.keys() == PLAIN_KEYS and data["v"] == VERSION \
                and type(job := data["job"]) is str:
            return cls(job, data["payload"])  # the common job: a name and a payload, nothing else to read
        if not isinstance(data, dict) or not isinstance(job := data.get("job"), str) or data.get("v") != VERSION:
            raise EnvelopeInvalid(
                "the message is not a job (a job queue's messages are published by dispatch(), "
                "not by publish())"
            )
        unique = data.get("unique")
        timeout = data.get("timeout")
        group = data.get("group")
        chain = data.get("chain") or ()
        if not isinstance(chain, list | tuple):
            raise EnvelopeInvalid("the job's chain is not a list")
        try:
            if isinstance(unique, dict):
                unique_key, unique_until = unique.get("key"), unique.get("until")
            else:
                unique_key = unique_until = None
            return cls(
                job,
                data.get("payload"),
                data.get("encrypted"),
                None if timeout is None else float(timeout),
                unique_key,
                unique_until,
                tuple(ChainLink.from_json(link) for link in chain) if chain else (),
                None if group is None else uuid.UUID(str(group)),
            )
        except (TypeError, ValueError) as exc:
            raise EnvelopeInvalid(f"the job envelope is malformed ({exc})") from None

    @property
    def is_encrypted(self) -> bool:
        return self.encrypted is not None
