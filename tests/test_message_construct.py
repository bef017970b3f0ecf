"""The WorkMessage a handler gets, and the Accepted result a publish answers, are the ones
``model_construct`` builds, field for field. Both are built by writing pydantic's instance fields
directly (for speed, see ``core/handlers.py``). The payload in the message reads as ``json.loads``
reads it (pydantic's JSON parser and JSON-mode validation, ``json`` for what that parser refuses).
``scripts/test`` runs this file on the lowest pydantic that pyproject.toml allows as well as on the
newest, so a release that changes any of them fails here."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from fastapi_workqueue.core.envelope import PublishRequest, PublishResult, PublishStatus, WorkMessage, prepare
from fastapi_workqueue.core.handlers import HandlerSpec, PayloadInvalid, _construct_message
from fastapi_workqueue.database.routines import accepted, claimed


def values() -> dict[str, Any]:
    return {
        "message_id": uuid.UUID(int=7), "topic": "orders", "subscription": "orders.audit", "delivery_id": "42",
        "attempt": 2, "partition_key": "customer-1", "attributes": {"kind": "order"},
        "payload": {"order_id": 7, "lines": [1, 2]}, "payload_ref": None, "correlation_id": "c-1",
        "published_at": datetime(2026, 12, 2, 6, 0, tzinfo=UTC),
    }


def test_it_equals_what_model_construct_builds() -> None:
    built, constructed = _construct_message(values()), WorkMessage[Any].model_construct(**values())
    assert type(built) is type(constructed)
    assert built == constructed
    assert built.model_dump() == constructed.model_dump()
    assert built.model_dump_json() == constructed.model_dump_json()  # by alias, as the wire has it
    assert built.model_fields_set == constructed.model_fields_set == set(values())
    assert built.model_copy(update={"attempt": 3}).attempt == 3
    assert built.attempt == 2 and built.payload == {"order_id": 7, "lines": [1, 2]}


def test_it_stays_frozen() -> None:
    built = _construct_message(values())
    with pytest.raises(ValidationError):
        built.attempt = 5  # type: ignore[misc]  # frozen: the assignment is the point


def test_values_that_do_not_name_every_field_take_model_construct() -> None:
    partial = values()
    del partial["correlation_id"]
    built = _construct_message(partial)
    assert built.correlation_id is None
    assert built.model_fields_set == set(partial)


def _row(attributes: Any) -> dict[str, Any]:
    return {"delivery_id": 1, "lease_token": "t", "attempt": 1, "max_attempts": 3, "lease_expires_at": None,
            "message_id": uuid.UUID(int=1), "topic": "jobs.default", "partition_key": None, "attributes": attributes,
            "payload": "{}", "payload_ref": None, "correlation_id": None, "published_at": None}


def test_deliveries_with_the_same_attributes_text_get_dicts_of_their_own() -> None:
    text = '{"job": "billing.remind"}'
    first, second = claimed(_row(text)), claimed(_row(text))  # the second from the parsed text kept
    assert first.attributes == second.attributes == {"job": "billing.remind"}
    first.attributes["job"] = "changed"
    assert second.attributes == {"job": "billing.remind"}
    assert claimed(_row(text)).attributes == {"job": "billing.remind"}


def test_headers_still_come_apart_from_the_attributes() -> None:
    text = '{"$workqueue": {"traceparent": "00-1-2-01"}, "kind": "order"}'
    for _ in range(2):
        delivery = claimed(_row(text))
        assert delivery.attributes == {"kind": "order"}
        assert delivery.headers == {"traceparent": "00-1-2-01"}
    assert claimed(_row(None)).attributes == {} and claimed(_row({"a": "b"})).attributes == {"a": "b"}


def test_an_accepted_result_equals_what_model_construct_builds() -> None:
    message = prepare(PublishRequest(payload={"order_id": 7}))
    built = accepted(message)
    constructed = PublishResult.model_construct(status=PublishStatus.ACCEPTED, message_id=message.message_id,
                                                error=None)
    assert type(built) is type(constructed) and built == constructed
    assert built.model_dump_json() == constructed.model_dump_json()
    assert built.model_fields_set == constructed.model_fields_set
    assert built.ok and built.model_copy(update={"error": None}).message_id == message.message_id


class Line(BaseModel):
    sku: str
    qty: int
    price: float


@pytest.mark.parametrize("text", [
    '{"order_id":7,"lines":[1,2.5,-0.0,1e300,123456789012345678901234567890],"note":"caf\u00e9 \\u2603"}',
    '"\\ud800 a lone surrogate escape"',  # pydantic's parser refuses it: json.loads reads it
    "null", "[]", "true", '{"a":{"b":[{"c":null}]}}',
])
def test_a_payload_reads_as_json_loads_reads_it(text: str) -> None:
    delivery = claimed({**_row(None), "payload": text})
    assert HandlerSpec(key="k", func=noop).build_message(delivery, "s").payload == json.loads(text)


def test_a_typed_payload_is_validated_from_its_json_text() -> None:
    spec = HandlerSpec(key="k", func=noop, payload_type=list[Line])
    text = '[{"sku":"a-1","qty":2,"price":9.5},{"sku":"\\ud800","qty":"3","price":1}]'
    payload = spec.build_message(claimed({**_row(None), "payload": text}), "s").payload
    assert payload == [Line(sku="a-1", qty=2, price=9.5), Line(sku="\ud800", qty=3, price=1.0)]
    with pytest.raises(PayloadInvalid, match=r"1\.qty"):
        spec.build_message(claimed({**_row(None), "payload": '[{"sku":"a","qty":1,"price":1},{"sku":"b"}]'}), "s")


@pytest.mark.parametrize("payload_type", [Any, dict[str, int]], ids=["any", "typed"])
def test_a_payload_this_process_cannot_read_is_invalid_not_a_crash(payload_type: Any) -> None:
    """A publisher that raised its int_max_str_digits stored an integer of 5,000 digits: reading it
    raised ValueError out of the attempt's task, which then lost its lease on every try and was
    dead-lettered as "lease expired", its error never kept. It is an invalid payload now
    (dead-lettered at once, saying why)."""
    text = '{"n":' + "9" * 5000 + "}"
    spec = HandlerSpec(key="k", func=noop, payload_type=payload_type)
    with pytest.raises(PayloadInvalid, match=r"cannot be read as JSON in this process: ValueError: .*4300"):
        spec.build_message(claimed({**_row(None), "payload": text}), "s")


def test_an_integer_over_4300_digits_is_refused_without_the_advice_to_raise_the_limit() -> None:
    from fastapi_workqueue.core.envelope import RequestRejected, prepare

    with pytest.raises(RequestRejected, match=r"more than 4,300 digits.*send it as a string") as refused:
        prepare(PublishRequest(payload={"n": 10**5000}))
    assert "set_int_max_str_digits" not in str(refused.value)


async def noop(message: WorkMessage[Any]) -> None:
    return None
