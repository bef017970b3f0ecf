"""The envelope rules and identifiers, without a database."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from pydantic import BaseModel

from fastapi_workqueue import PublishRequest
from fastapi_workqueue.core.envelope import RequestRejected, prepare, uuid7


def test_generated_message_ids_are_time_ordered_version_7() -> None:
    first = [uuid7() for _ in range(100)]
    time.sleep(0.002)
    later = uuid7()
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in [*first, later])
    assert all(u < later for u in first)
    assert len(set(first)) == 100
    assert prepare(PublishRequest(payload=1)).message_id.version == 7


def test_generated_ids_increase_within_a_millisecond() -> None:
    """The counter of RFC 9562 (uuid_utils, or the standard library's from Python 3.14): IDs drawn
    in one millisecond keep the millisecond and still increase."""
    batch = [uuid7() for _ in range(2000)]  # many share a millisecond
    assert batch == sorted(batch) and len(set(batch)) == len(batch)
    assert len({u.int >> 80 for u in batch}) < len(batch)
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in batch)
    assert abs((batch[-1].int >> 80) - time.time_ns() // 1_000_000) < 1_000  # the clock's, not counted ahead


def test_generated_ids_behave_as_uuids_and_stay_unique_across_threads_and_forks() -> None:
    u = uuid7()
    assert uuid.UUID(str(u)) == u and uuid.UUID(bytes=u.bytes) == u and hash(uuid.UUID(str(u))) == hash(u)
    assert str(u)[14] == "7" and u.is_safe is uuid.SafeUUID.unknown

    import threading

    seen: list[uuid.UUID] = []

    def many() -> None:
        seen.extend(uuid7() for _ in range(5000))

    threads = [threading.Thread(target=many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 20000

    import os

    uuid7()  # the parent's generator has state a child could continue
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its IDs must not be the ones the parent hands out next
        os.close(read)
        os.write(write, b"".join(uuid7().bytes for _ in range(50)))
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child_bytes = b""
    while chunk := os.read(read, 65536):
        child_bytes += chunk
    os.close(read)
    parent = [uuid7() for _ in range(50)]
    child = [uuid.UUID(bytes=child_bytes[i:i + 16]) for i in range(0, len(child_bytes), 16)]
    assert len(child) == 50
    # Same millisecond is likely, so only the random part tells them apart.
    assert not {c.int & (2**74 - 1) for c in child} & {p.int & (2**74 - 1) for p in parent}


def test_a_given_message_id_is_kept() -> None:
    mine = uuid.uuid4()
    assert prepare(PublishRequest(message_id=mine, payload=1)).message_id == mine


def test_equal_content_hashes_equally_whatever_the_key_order() -> None:
    a = prepare(PublishRequest(payload={"a": 1, "b": [1, 2]}, attributes={"x": "1", "y": "2"}))
    b = prepare(PublishRequest(payload={"b": [1, 2], "a": 1}, attributes={"y": "2", "x": "1"}))
    c = prepare(PublishRequest(payload={"a": 1, "b": [2, 1]}, attributes={"x": "1", "y": "2"}))
    assert a.content_hash == b.content_hash != c.content_hash
    assert a.payload_json == b.payload_json


def test_pydantic_models_are_published_as_json() -> None:
    class Order(BaseModel):
        id: int
        note: str

    prepared = prepare(PublishRequest(payload=Order(id=3, note="ü")))
    assert prepared.payload_json == '{"id":3,"note":"ü"}'
    assert prepared.envelope_bytes == len(prepared.payload_json.encode()) + 2


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (PublishRequest(partition_key="a\x00b"), "InvalidField", "partition_key"),
        (PublishRequest(attributes={"k": "v\x00"}), "InvalidField", "attributes"),
        (PublishRequest(attributes={"k": 1}), "InvalidAttribute", "attributes"),
        (PublishRequest(payload={1, 2}), "InvalidPayload", "payload"),
        (PublishRequest(payload=float("nan")), "InvalidPayload", "payload"),
        (PublishRequest(delay_seconds=1, not_before=None, backoff_seconds=[]), "InvalidField", "backoff_seconds"),
    ],
)
def test_bad_requests_are_refused_with_the_field_to_change(request_: PublishRequest, code: str, field: str) -> None:
    with pytest.raises(RequestRejected) as info:
        prepare(request_)
    assert info.value.error.code == code
    assert info.value.error.field == field


def test_nul_in_payload_strings_is_escaped_not_refused() -> None:
    prepared = prepare(PublishRequest(payload={"text": "a\x00b"}))
    assert "\\u0000" in prepared.payload_json


def test_canonical_json_matches_the_standard_encoder() -> None:
    from fastapi_workqueue.core.envelope import _encode

    reference = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False)
    values = [
        None, True, 0, -1, 2**70, 1.5, 1e-300, "", "héllo \u2028 \"q\" \\ \x00", [], {}, [1, [2, [3]]],
        {"b": 1, "a": {"d": [None, False], "c": "x"}}, {"ü": "ö", "1": 2}, ("t", 1),
    ]
    for value in values:
        assert _encode(value) == reference.encode(value)
    for bad in (float("nan"), float("inf"), {1: 2, "a": 1}, object(), {"x": {1, 2}}):
        with pytest.raises((TypeError, ValueError)):
            _encode(bad)


def test_circular_and_too_deep_payloads_are_refused_with_their_own_reason() -> None:
    looped: dict[str, object] = {"a": 1}
    looped["self"] = [looped]
    with pytest.raises(RequestRejected, match="circular reference"):
        prepare(PublishRequest.model_construct(payload=looped, attributes={}))
    deep: list[object] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(RequestRejected, match="levels deep"):
        prepare(PublishRequest.model_construct(payload=deep, attributes={}))


def test_a_message_asks_for_at_most_the_queues_attempts_and_a_bounded_schedule() -> None:
    from fastapi_workqueue import WorkQueueSettings
    from fastapi_workqueue.core.envelope import DEFAULT_MAX_MESSAGE_ATTEMPTS, MAX_BACKOFF_ENTRIES

    settings = WorkQueueSettings(database_url="sqlite+aiosqlite:///x.db")
    assert settings.max_message_attempts == DEFAULT_MAX_MESSAGE_ATTEMPTS == 100
    assert prepare(PublishRequest(max_attempts=100), max_attempts=100).max_attempts == 100
    with pytest.raises(RequestRejected) as refused:
        prepare(PublishRequest(max_attempts=101), max_attempts=100)
    assert refused.value.error.field == "max_attempts" and "at most 100" in refused.value.error.message

    with pytest.raises(RequestRejected, match=f"at most {MAX_BACKOFF_ENTRIES}"):
        prepare(PublishRequest(backoff_seconds=[1.0] * (MAX_BACKOFF_ENTRIES + 1)))
    plain = prepare(PublishRequest(payload="x"))
    scheduled = prepare(PublishRequest(payload="x", backoff_seconds=[1.5, 60.0]))
    assert scheduled.envelope_bytes == plain.envelope_bytes + len("[1.5,60.0]")
