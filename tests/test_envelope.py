"""The envelope rules and identifiers, without a database."""

from __future__ import annotations

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
