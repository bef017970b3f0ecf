"""Publishing at its edges, on every store and through the REST publisher: deduplication keys within
a call, payloads the REST publisher must send as queue.publish stores them, filters on the trace
headers, NotBefore past the stores' range, topic names no topic can have, and payload models with
aliases."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from fastapi_workqueue import Outcome, PublishRequest, WorkMessage, WorkOutcome

from .support import make_queue

pytestmark = pytest.mark.timeout(60)


async def test_a_duplicate_by_message_id_does_not_make_its_deduplication_key_live(database_url: str) -> None:
    """SPEC §2: Duplicate is "same MessageID and same content, or a live deduplication key: the
    existing MessageID is returned". An item that is a Duplicate of a stored message (published
    without a key) registers no key, so a later item of the call with that key and a new MessageID
    holds no live key and must be Accepted (as SQLite and memory answer), and be stored."""
    queue, topic, subs = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True)
    stored, fresh = uuid.uuid4(), uuid.uuid4()
    key = f"k-{uuid.uuid4().hex[:8]}"
    async with queue.lifespan(None):
        assert (await queue.publish(topic, [PublishRequest(message_id=stored, payload="s")])).ok
        results = await queue.publish(topic, [
            PublishRequest(message_id=stored, payload="s", deduplication_key=key),
            PublishRequest(message_id=fresh, payload="t", deduplication_key=key),
        ])
        assert [(r.status.value, r.message_id) for r in results] == [("Duplicate", stored), ("Accepted", fresh)]
        pending = await queue.deliveries(subs["a"], "Pending", limit=10)
        assert {d.message_id for d in pending} == {stored, fresh}


# -- the REST publisher client (docs/publishing.md "From other services") ----------------------------

from collections.abc import AsyncIterator  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402

import httpx  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.security import SecurityScopes  # noqa: E402
from pydantic import BaseModel, Field, ValidationError  # noqa: E402

from fastapi_workqueue.client import PublishApiError, WorkQueueApiPublisher  # noqa: E402
from fastapi_workqueue.core.keys import SCOPES, Principal  # noqa: E402
from fastapi_workqueue.web.auth import require_scopes  # noqa: E402


async def _anyone(request: Request, security_scopes: SecurityScopes) -> Principal:
    return require_scopes(Principal(name="test", scopes=frozenset(SCOPES)), security_scopes)


@asynccontextmanager
async def _publisher(database_url: str) -> AsyncIterator[tuple[object, str, dict[str, str], WorkQueueApiPublisher]]:
    queue, topic, subs = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True)
    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.create_router(authorize=_anyone))
    async with queue.lifespan(app):
        transport = httpx.ASGITransport(app=app)
        async with (httpx.AsyncClient(transport=transport, base_url="http://test") as http,
                    WorkQueueApiPublisher("http://test", "unused", client=http, retries=0) as publisher):
            yield queue, topic, subs, publisher


async def test_the_rest_publisher_refuses_a_nan_payload_instead_of_publishing_null(database_url: str) -> None:
    """SPEC §2: a non-JSON payload is Rejected; the REST API answers 422 for NaN/Infinity
    (docs/rest-api.md) and queue.publish answers Rejected/InvalidPayload. WorkQueueApiPublisher
    turns NaN and Infinity into null (pydantic's model_dump(mode="json")) and the message is
    published with other data than the producer gave."""
    async with _publisher(database_url) as (queue, topic, subs, publisher):
        [direct] = await queue.publish(topic, [PublishRequest(payload={"price": float("nan")})])  # type: ignore[attr-defined]
        assert direct.error is not None and direct.error.code == "InvalidPayload"
        with pytest.raises(PublishApiError) as raised:
            await publisher.publish(topic, [PublishRequest(payload={"price": float("nan"), "limit": float("inf")})])
        assert raised.value.status_code == 422
        assert await queue.deliveries(subs["a"], "Pending", limit=10) == []  # type: ignore[attr-defined]


class _Order(BaseModel):
    order_id: int = Field(alias="orderId")
    note: str | None = None


async def test_the_rest_publisher_sends_a_model_payload_as_queue_publish_does(database_url: str) -> None:
    """docs/publishing.md: "the payload is JSON or a pydantic model (sent as
    `model.model_dump(mode="json")`)". queue.publish stores {"note": null, "order_id": 7}; the
    REST publisher sends the model by alias and without its None fields ({"orderId": 7}), so the
    same message retried through it with the same MessageID answers MessageIDConflict (409)."""
    async with _publisher(database_url) as (queue, topic, _subs, publisher):
        message_id = uuid.uuid4()
        order = _Order(orderId=7)
        [first] = await queue.publish(topic, [PublishRequest(message_id=message_id, payload=order)])  # type: ignore[attr-defined]
        assert first.status.value == "Accepted"
        [again] = await publisher.publish(topic, [PublishRequest(message_id=message_id, payload=order)])
        assert again.status.value == "Duplicate"


# -- the trace headers (docs/observability.md "How the trace travels") ----------------------------

from fastapi_workqueue.core.observe import HEADERS_KEY, Observer, PublishScope  # noqa: E402


class _TraceScope(PublishScope):
    def headers(self) -> dict[str, str]:
        return {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


class _Tracing(Observer):
    def publish_started(self, topic: str, count: int, *, message_id: str | None = None,
                        correlation_id: str | None = None) -> PublishScope | None:
        return _TraceScope()


@pytest.mark.parametrize("operator", ["isnull", "startswith"])
def test_a_filter_on_the_carried_trace_headers_is_refused(operator: str) -> None:
    """docs/observability.md: the trace context "is stored with each message, beside its attributes
    under the reserved name `$workqueue`: it never counts toward the 10 attributes, never reaches a
    filter". A filter that names it is refused when the subscription is declared, saying why (the
    stores would otherwise read the stored headers as an attribute)."""
    from pydantic import ValidationError

    from fastapi_workqueue import Subscription

    leaf: dict[str, str] = {"field": HEADERS_KEY, "operator": operator}
    if operator == "startswith":
        leaf["value"] = "{"
    with pytest.raises(ValidationError, match="the library's own"):
        Subscription(name="s", topic="t", handler_key="h", filter=leaf)


# -- NotBefore beyond what the stores can hold ------------------------------------------------------

from datetime import UTC, datetime, timedelta, timezone  # noqa: E402


async def test_a_not_before_past_the_stores_range_is_rejected_not_raised_or_stored(database_url: str) -> None:
    """SPEC §2: a request that breaks the rules is `Rejected` with a clear error. A NotBefore past
    what the stores hold, 9999-12-31T23:59:59-05:00 (year 10000 in UTC), is refused before any store
    sees it (PostgreSQL would raise, SQLite keep it and then fail every listing that reads it)."""
    queue, topic, subs = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True)
    never = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-5)))
    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload=1, not_before=never)])
        assert result.status.value == "Rejected" and result.error is not None
        assert result.error.code == "InvalidField"
        assert await queue.deliveries(subs["a"], "Pending", limit=10) == []
        # a NotBefore a century ahead is fine on every store
        soon = datetime.now(UTC) + timedelta(days=365 * 99)
        assert (await queue.publish(topic, [PublishRequest(payload=2, not_before=soon)])).ok
        assert len(await queue.deliveries(subs["a"], "Pending", limit=10)) == 1


def test_a_not_before_before_the_first_time_says_to_give_a_later_one() -> None:
    """0001-01-01T00:00:00+05:00 is in the year 0 in UTC: it was refused with "past
    9999-12-31T23:59:59Z ... give an earlier time", the opposite of the fix."""
    from fastapi_workqueue.core.envelope import RequestRejected, prepare

    with pytest.raises(RequestRejected, match=r"before 0001-01-01T00:00:00Z, the first time .* give a later time"):
        prepare(PublishRequest(payload=1, not_before=datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5)))))


@pytest.mark.parametrize("backoff", [["1"], [True], ["2.5", False]])
def test_backoff_seconds_take_numbers_only(backoff: list[object]) -> None:
    """Rest-api.md: a wrong type is a 422. ``BackoffSeconds: ["1"]`` or ``[true]`` were taken as 1, where
    ``DelaySeconds: "5"`` and ``MaxAttempts: true`` are refused."""
    with pytest.raises(ValidationError, match="Input should be a valid number"):
        PublishRequest.model_validate({"Payload": 1, "BackoffSeconds": backoff})
    assert PublishRequest.model_validate({"Payload": 1, "BackoffSeconds": [1, 2.5]}).backoff_seconds == [1.0, 2.5]


# -- a topic name no topic can have -----------------------------------------------------------------

from fastapi_workqueue import UnknownTopic  # noqa: E402


@pytest.mark.parametrize("name", ["orders\x00created", "orders\ud800"])
async def test_publishing_to_a_topic_name_no_topic_can_have_raises_unknown_topic(database_url: str, name: str) -> None:
    """docs/publishing.md: "A topic that neither the code declares nor the database holds is a
    programming error: `publish` raises `UnknownTopic` (a `ConfigurationError`) and publishes
    nothing" (REST answers 404 for these names). SQLite raises UnknownTopic for a NUL in the name
    and a bare ConfigurationError (UnicodeEncodeError text) for a lone surrogate; PostgreSQL raises
    TransportError ("invalid byte sequence for encoding UTF8" / "invalid input for query argument"),
    the error that means the store is unavailable."""
    queue, _, _ = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True)
    async with queue.lifespan(None):
        with pytest.raises(UnknownTopic):
            await queue.publish(name, [PublishRequest(payload=1)])


async def test_an_empty_publish_to_an_unknown_topic_raises_as_rest_answers_404(database_url: str) -> None:
    """docs/publishing.md: "A topic that neither the code declares nor the database holds is a
    programming error: `publish` raises `UnknownTopic` ... over REST the topic's URL answers 404."
    REST answers 404 for an empty array to an unknown topic (routes.py checks list_topics); the
    Python API returns [] without a word, so a typo'd topic goes unnoticed until a call has items."""
    queue, topic, _ = make_queue(database_url, [{"role": "a"}], enabled=False, auto_migrate=True)
    async with queue.lifespan(None):
        assert await queue.publish(topic, []) == []  # a known topic: nothing to do
        with pytest.raises(UnknownTopic):
            await queue.publish(topic + ".typo", [])


async def test_a_model_payload_with_aliases_reaches_a_handler_typed_with_that_model(database_url: str) -> None:
    """docs/publishing.md: the payload is "JSON or a pydantic model"; docs/handlers.md /
    WorkMessage: "``payload`` is validated against ``T``". queue.publish stores
    model_dump(mode="json") (field names, not aliases), which the same model does not validate
    (it takes its aliases), so the handler's attempt fails with PayloadInvalid every time."""
    queue, topic, subs = make_queue(database_url, [{"role": "orders", "max_attempts": 1}], auto_migrate=True)
    seen: list[int] = []
    done = asyncio.Event()

    @queue.handler("orders")
    async def handle(message: WorkMessage[_Order]) -> WorkOutcome:
        seen.append(message.payload.order_id)
        done.set()
        return Outcome.complete()

    async with queue.lifespan(None):
        assert (await queue.publish(topic, [PublishRequest(payload=_Order(orderId=7))])).ok
        try:
            await asyncio.wait_for(done.wait(), 5)
        except TimeoutError:
            dead = await queue.dead_letters(subs["orders"])
            raise AssertionError(f"the handler never got the model; dead letters: {dead}") from None
    assert seen == [7]
