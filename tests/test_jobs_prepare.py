"""A job's message, built without a PublishRequest, is what ``prepare()`` of the job's request gives."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from pydantic import BaseModel
from typing_extensions import TypedDict

from fastapi_workqueue import JobContext, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.envelope import (
    MAX_DELAY_SECONDS,
    PreparedMessage,
    PublishResult,
    PublishStatus,
    RequestRejected,
    prepare,
)
from fastapi_workqueue.jobs import JobDispatchError, JobPayloadInvalid


class Note(BaseModel):
    text: str
    n: int = 0


class Recording:
    """A transport that keeps what it is asked to publish and accepts it."""

    name = "recording"

    def __init__(self) -> None:
        self.published: list[tuple[str, list[PreparedMessage]]] = []

    async def publish(self, topic: str, messages: Sequence[PreparedMessage], *, session: Any = None) -> list[Any]:
        self.published.append((topic, list(messages)))
        return [PublishResult(status=PublishStatus.ACCEPTED, message_id=m.message_id) for m in messages]

    async def sync_topology(self, topics: Any, subscriptions: Any) -> None:
        return None


def make(**settings: Any) -> tuple[WorkQueue, Recording]:
    transport = Recording()
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db", enabled=False, **settings),
                      transport=transport)  # type: ignore[arg-type]  # a recording stand-in, not a whole transport
    return queue, transport


def same_but_id(a: PreparedMessage, b: PreparedMessage) -> None:
    left, right = dataclasses.asdict(a), dataclasses.asdict(b)
    left.pop("message_id")
    right.pop("message_id")
    assert left == right


@pytest.mark.parametrize(
    ("declared", "options"),
    [
        ({}, {}),
        ({"tries": 7, "backoff": [1, 2.5], "timeout": 30}, {}),
        ({}, {"delay": 12.5}),
        ({"timeout": 5}, {"unique": "ü-1", "unique_until": "processing", "unique_for": 60}),
        ({}, {"unique": "k", "unique_for": 10}),
    ],
)
def test_a_jobs_message_is_byte_for_byte_prepare_of_its_request(declared: dict[str, Any],
                                                                   options: dict[str, Any]) -> None:
    queue, _ = make()

    @queue.job("notes.write", **declared)
    async def write(payload: Note) -> None:
        return None

    job = queue.jobs.registry.resolve(write)
    data = job.validate({"text": "héllo", "n": "3"})
    unique = options.get("unique")
    expected = prepare(queue.jobs.request(job, data, delay=options.get("delay"), unique=unique,
                                          unique_until=options.get("unique_until", "done"),
                                          unique_for=options.get("unique_for", 3600)))
    sealed, encrypted = queue.jobs.seal(job, data)
    got = queue.jobs.message(job, sealed, encrypted, max_envelope_bytes=256 * 1024, delay=options.get("delay"),
                             unique=unique, unique_until=options.get("unique_until", "done"),
                             ttl=None if unique is None else float(options["unique_for"]))
    same_but_id(got, expected)


@pytest.mark.parametrize("payload", [{}, {"b": {"z": 1, "a": [1, "ü", None]}, "a": None, "é": 1.5}, [3, "x"], "text",
                                     None])
def test_a_plain_jobs_envelope_is_the_canonical_json_of_the_envelope(payload: Any) -> None:
    queue, _ = make()

    @queue.job("notes.any-thing_1:2")
    async def anything(payload: Any) -> None:
        return None

    job = queue.jobs.registry.resolve(anything)
    got = queue.jobs.message(job, payload, None, max_envelope_bytes=256 * 1024)
    expected = prepare(queue.jobs.request(job, payload))
    same_but_id(got, expected)
    assert json.loads(got.payload_json) == {"v": 1, "job": "notes.any-thing_1:2", "payload": payload}
    assert got.envelope_bytes == len(got.payload_json.encode()) + len(got.attributes_json.encode())


async def test_bulk_publishes_what_the_requests_would_and_checks_every_payload_first() -> None:
    queue, transport = make()

    @queue.job("notes.write", timeout=9, backoff=[3])
    async def write(payload: Note, job: JobContext) -> None:
        return None

    job = queue.jobs.registry.resolve(write)
    with pytest.raises(JobPayloadInvalid, match=r"notes\.write"):
        await queue.bulk([(write, {"text": "a"}), (write, {"n": 1})])
    assert transport.published == []
    ids = await queue.bulk([(write, {"text": "a"}), (write, Note(text="b")), (write, {"text": "c"}, {"delay": 4})])
    [(topic, messages)] = transport.published
    assert topic == "jobs.default"
    assert ids == [m.message_id for m in messages]
    assert [json.loads(m.payload_json)["payload"]["text"] for m in messages] == ["a", "b", "c"]
    for message, (data, delay) in zip(messages, [({"text": "a", "n": 0}, None), ({"text": "b", "n": 0}, None),
                                                 ({"text": "c", "n": 0}, 4.0)], strict=True):
        same_but_id(message, prepare(queue.jobs.request(job, data, delay=delay)))


async def test_a_bulk_with_one_envelope_too_large_queues_none() -> None:
    queue, transport = make()
    queue.add_topic(Topic(name="jobs.small", max_payload_bytes=200))

    @queue.job("notes.write", queue="small")
    async def write(payload: Note) -> None:
        return None

    with pytest.raises(JobDispatchError) as caught:
        await queue.bulk([(write, {"text": "a"}), (write, {"text": "x" * 300})])
    assert transport.published == []
    assert caught.value.result.error is not None  # (the item refused, not item 0 that was aborted with it)
    assert (caught.value.result.error.code, caught.value.item) == ("EnvelopeTooLarge", 1)
    with pytest.raises(JobDispatchError, match=r"is \d+ bytes"):
        await queue.dispatch(write, {"text": "x" * 300})
    assert transport.published == []
    with pytest.raises(RequestRejected):
        prepare(queue.jobs.request(queue.jobs.registry.resolve(write), {"text": "x" * 300, "n": 0}),
                max_envelope_bytes=200)


async def test_a_delay_or_unique_for_beyond_the_limit_is_refused_as_the_request_refuses_it() -> None:
    queue, transport = make()

    @queue.job("notes.write")
    async def write(payload: Note) -> None:
        return None

    with pytest.raises(ValueError, match="delay must be a number of seconds from 0 to 3153600000"):
        await queue.bulk([(write, {"text": "a"}), (write, {"text": "b"}, {"delay": MAX_DELAY_SECONDS * 2})])
    with pytest.raises(ValueError, match="delay must be a number of seconds from 0 to 3153600000"):
        await queue.dispatch(write, {"text": "a"}, delay=float("nan"))
    with pytest.raises(ValueError, match="unique_for must be a number of seconds above 0 and at most 3153600000"):
        await queue.dispatch(write, {"text": "a"}, unique="k", unique_for=MAX_DELAY_SECONDS * 2)
    assert transport.published == []
    assert isinstance(await queue.dispatch(write, {"text": "a"}, unique="k", unique_for=5), uuid.UUID)
    [(_, [message])] = transport.published
    assert (message.deduplication_key, message.deduplication_ttl_seconds) == ("notes.write:k", 5.0)


async def test_an_encrypted_job_carries_its_token_not_its_payload() -> None:
    from cryptography.fernet import Fernet

    key = Fernet.generate_key().decode()
    queue, transport = make(app_key=key)

    @queue.job("notes.secret", encrypted=True)
    async def secret(payload: Note) -> None:
        return None

    await queue.bulk([(secret, {"text": "plaintext"})])
    [(_, [message])] = transport.published
    envelope = json.loads(message.payload_json)
    assert "payload" not in envelope
    assert json.loads(Fernet(key.encode()).decrypt(envelope["encrypted"].encode())) == {"text": "plaintext", "n": 0}
    assert "plaintext" not in message.payload_json


class Blob(BaseModel):
    data: bytes


async def test_a_payload_json_cannot_carry_is_refused_not_changed(tmp_path: Any) -> None:
    """NaN and infinities, which JSON has no numbers for, are refused as any payload's are: they
    reached the job as None. Bytes that are not UTF-8 raise JobPayloadInvalid naming the cure."""
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", auto_migrate=True,
                                        enabled=False))

    @queue.job("notes.any")
    async def anything(payload: dict[str, Any]) -> None:
        return None

    @queue.job("notes.blob")
    async def blob(payload: Blob) -> None:
        return None

    async with queue.lifespan(None):
        for bad in ({"f": float("nan")}, {"nested": [1.0, float("inf")]}, {"f": float("-inf")}):
            with pytest.raises(JobDispatchError, match="the Payload is not JSON: Out of range float values"):
                await queue.dispatch(anything, bad)
        with pytest.raises(JobPayloadInvalid, match=r"bytes that are not UTF-8 .* send them as base64"):
            await queue.dispatch(blob, {"data": b"\xff\xfe"})
        assert await queue.size() == 0
        await queue.dispatch(anything, {"f": 1.5})
        await queue.dispatch(blob, {"data": b"text"})
        assert await queue.size() == 2


@dataclasses.dataclass
class Point:
    x: float


class Pair(TypedDict):
    left: int
    right: int


async def test_dataclass_and_typeddict_payloads_keep_their_own_configuration(tmp_path: Any) -> None:
    """Payload types that carry their own pydantic configuration (a dataclass, a TypedDict) are
    declared and dispatched as before; NaN inside them is refused by the publish all the same."""
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", auto_migrate=True,
                                        enabled=False))

    @queue.job("notes.point")
    async def point(payload: Point) -> None:
        return None

    @queue.job("notes.pair")
    async def pair(payload: Pair) -> None:
        return None

    async with queue.lifespan(None):
        await queue.dispatch(point, {"x": 1.5})
        await queue.dispatch(pair, {"left": 1, "right": 2})
        with pytest.raises((JobDispatchError, JobPayloadInvalid)):
            await queue.dispatch(point, {"x": float("nan")})
        assert await queue.size() == 2
