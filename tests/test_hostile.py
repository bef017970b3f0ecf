"""Hostile input and hostile conditions, on PostgreSQL and SQLite.

* The REST API fuzzed from its own OpenAPI schema (schemathesis, in-process over ASGI, with a key
  holding every scope): no operation answers a server error.
* The REST API fed by hand: malformed JSON, wrong types, huge bodies and arrays, deep nesting,
  unicode and NUL bytes, SQL-looking strings, huge attributes, hostile ids. Every answer is a 2xx
  or a 4xx whose message says what is wrong; never a 500. After each batch every message accepted
  so far is read back (payload, attributes, key, correlation ID) with its deliveries, and the
  handler got each one exactly as it was published.
* Bad configuration fails at start with the exception type and a message that says what to change.
* A database that goes away while the app runs (a database this module owns: its connections are
  terminated, then it refuses connections for a while): publishers get a retryable error or a 503
  with Retry-After, never a 500; afterwards every message is processed, and LISTEN is back.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from pydantic import ValidationError
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.generation.modes import GenerationMode
from schemathesis.python import asgi as schemathesis_asgi
from sqlalchemy import text as sql_text
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue import (
    ConfigurationError,
    FilterError,
    PublishRequest,
    Subscription,
    SubscriptionPlan,
    Topic,
    TransportUnavailable,
    WorkMessage,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.core.envelope import MAX_PAYLOAD_DEPTH, prepare
from fastapi_workqueue.core.filters import validate_filter
from fastapi_workqueue.core.keys import SCOPES, create_key
from fastapi_workqueue.core.reports import DeliveryInfo
from fastapi_workqueue.database import create_database_transport
from fastapi_workqueue.database.postgres import to_asyncpg_dsn

from .conftest import PG_URL, drop_database, recreate_database, unique
from .support import FAST, delivery_status, stop_time_in_an_outage, wait_for

pytestmark = pytest.mark.timeout(120)

PREFIX = "/work-queue"
JSON = {"content-type": "application/json"}
SQLISH = [
    "'; DROP TABLE workqueue.delivery; --",
    "%",
    "_",
    "\\",
    "' OR '1'='1",
    '"; DELETE FROM message; --',
    "%' --",
    "Robert'); DROP TABLE topic;--",
]
Sent = tuple[Any, dict[str, str], str | None, str | None]
"""What a message was published with: payload, attributes, partition key, correlation ID."""


def nested(depth: int, leaf: Any = "bottom") -> Any:
    """``[[[...leaf...]]]``: ``depth`` arrays, one inside the other."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api")


def assert_4xx(response: httpx.Response, *phrases: str, status: int | None = None) -> None:
    """A client error with a message (``detail``) that contains each of ``phrases``."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if status is not None:
        assert response.status_code == status, (response.status_code, response.text[:500])
    assert "detail" in response.json(), response.text[:500]
    for phrase in phrases:
        assert phrase in response.text, (phrase, response.text[:500])


# -- the app under attack ----------------------------------------------------------------------


@dataclass
class Target:
    """The app on one database: ``worked`` runs under the host, ``held`` (None) and ``excl``
    (Exclusive) are never claimed, so their deliveries stay Pending and can be read back."""

    queue: WorkQueue
    http: httpx.AsyncClient
    topic: str
    subs: dict[str, str]
    headers: dict[str, str]
    handled: dict[str, Sent] = field(default_factory=dict)
    ledger: dict[str, Sent] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{PREFIX}/topics/{self.topic}/messages"

    async def post(self, body: Any = None, *, content: bytes | None = None, path: str | None = None,
                   headers: dict[str, str] | None = None) -> httpx.Response:
        merged = {**self.headers, **(headers or {})}
        if content is not None:
            return await self.http.post(path or self.url, content=content, headers={**JSON, **merged})
        return await self.http.post(path or self.url, json=body, headers=merged)

    async def accept(self, *items: dict[str, Any], content: bytes | None = None) -> list[str]:
        """Publishes ``items`` (or the raw JSON ``content``), which must all be Accepted; remembers them."""
        response = await self.post(list(items), content=content)
        assert response.status_code == 200, response.text[:500]
        results = response.json()
        sent = json.loads(content) if content is not None else list(items)
        assert [r["Status"] for r in results] == ["Accepted"] * len(sent), results
        for result, item in zip(results, sent, strict=True):
            self.ledger[result["MessageID"]] = (
                item.get("Payload"), item.get("Attributes", {}), item.get("PartitionKey"), item.get("CorrelationID")
            )
        return [r["MessageID"] for r in results]

    async def listing(self, role: str) -> dict[str, DeliveryInfo]:
        """Every Pending delivery of ``role``, with payloads, by MessageID."""
        out: dict[str, DeliveryInfo] = {}
        after = None
        while True:
            page = await self.queue.deliveries(self.subs[role], "Pending", limit=1000, after=after,
                                               include_payload=True)
            out.update((str(d.message_id), d) for d in page)
            if len(page) < 1000:
                return out
            after = page[-1].delivery_id

    async def check(self) -> None:
        """Nothing accepted so far is lost or altered; the handler got each message as it was sent."""
        for role in ("held", "excl"):
            stored = await self.listing(role)
            for message_id, sent in self.ledger.items():
                info = stored.get(message_id)
                assert info is not None, f"{role}: the delivery of accepted message {message_id} is gone"
                kept = (info.payload, info.attributes or {}, info.partition_key, info.correlation_id)
                assert kept == sent, f"{role}: message {message_id} changed: {kept!r} != {sent!r}"
        await wait_for(lambda: all(m in self.handled for m in self.ledger), within=20)
        for message_id, sent in self.ledger.items():
            assert self.handled[message_id] == sent, f"the handler got {message_id} altered"

        async def settled() -> bool:
            [stats] = await self.queue.stats(self.subs["worked"])
            assert stats.dead_lettered == 0 and stats.discarded == 0, stats
            return stats.completed == len(self.ledger) and stats.pending == stats.in_flight == 0

        await wait_for(settled, within=20)


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
async def target(request: pytest.FixtureRequest, pg_url: str, sqlite_url: str) -> AsyncIterator[Target]:
    url = pg_url if request.param == "postgresql" else sqlite_url
    topic = unique("hostile")
    subs = {role: unique(f"hostile-{role}") for role in ("worked", "held", "excl")}
    queue = WorkQueue(
        WorkQueueSettings(database_url=url, subscriptions=[SubscriptionPlan(name=subs["worked"])], **FAST),
        topics=[Topic(name=topic)],
        subscriptions=[
            Subscription(name=subs["worked"], topic=topic, handler_key="hostile.record", max_attempts=1),
            Subscription(name=subs["held"], topic=topic, handler_key="hostile.never"),
            Subscription(name=subs["excl"], topic=topic, handler_key="hostile.never", partition_mode="Exclusive"),
        ],
    )
    handled: dict[str, Sent] = {}

    @queue.handler("hostile.record")
    async def record(message: WorkMessage[Any]) -> None:
        handled[str(message.message_id)] = (
            message.payload, dict(message.attributes), message.partition_key, message.correlation_id
        )

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.router)
    app.include_router(queue.health_router)
    async with queue.lifespan(app), client(app) as http:
        key = (await create_key(queue.transport, unique("hostile"), list(SCOPES))).key
        target = Target(queue=queue, http=http, topic=topic, subs=subs, headers={"Authorization": f"Bearer {key}"},
                        handled=handled)
        await target.accept(
            {"Payload": {"order": 1, "items": [1, 2, 3]}, "Attributes": {"kind": "baseline"}, "PartitionKey": "k1"},
            {"Payload": "plain text", "CorrelationID": "corr-baseline"},
            {"Payload": None},
        )
        yield target


# -- by hand -----------------------------------------------------------------------------------


MALFORMED: list[tuple[bytes, tuple[str, ...]]] = [
    (b"{not json", ("JSON decode error",)),
    (b"[", ("JSON decode error",)),
    (b"\xff\xfe\x00[", ()),
    (b"", ("Field required",)),
    (b"null", ()),
    (b'{"Payload": 1}', ("list",)),
    (b"[1, 2]", ("dictionary",)),
    (b'["text"]', ("dictionary",)),
    (b'[{"MaxAttempts": "three"}]', ("MaxAttempts",)),
    (b'[{"MaxAttempts": 0}]', ("MaxAttempts",)),
    (b'[{"MaxAttempts": 10000000000000}]', ("MaxAttempts", "2147483647")),
    (b'[{"DelaySeconds": -1}]', ("DelaySeconds",)),
    (b'[{"DelaySeconds": "soon"}]', ("DelaySeconds",)),
    (b'[{"DelaySeconds": 1e308}]', ("DelaySeconds", "less than or equal")),
    (b'[{"DeduplicationKey": "d", "DeduplicationTTLSeconds": 1e300}]', ("DeduplicationTTLSeconds",)),
    (b'[{"BackoffSeconds": [1e308]}]', ("BackoffSeconds",)),
    (b'[{"BackoffSeconds": []}]', ("BackoffSeconds",)),
    (b'[{"BackoffSeconds": "fast"}]', ("BackoffSeconds",)),
    (b'[{"NotBefore": "tomorrow"}]', ("NotBefore",)),
    (b'[{"NotBefore": "2030-01-01T00:00:00"}]', ("NotBefore", "time zone")),
    (b'[{"DelaySeconds": 5, "NotBefore": "2030-01-01T00:00:00Z"}]', ("DelaySeconds or NotBefore",)),
    (b'[{"MessageID": "not-a-uuid"}]', ("MessageID",)),
    (b'[{"Attributes": "x"}]', ("Attributes",)),
    (b'[{"Attributes": {"n": 1}}]', ("must be strings",)),
    (b'[{"Attributes": {"n": null}}]', ("must be strings",)),
    (b'[{"PartitionKey": 5}]', ("PartitionKey",)),
    (b'[{"Bogus": 1}]', ("Bogus",)),
    (b'[{"Payload": NaN}]', ("not JSON",)),
    (b'[{"Payload": 1e999}]', ("not JSON",)),
    (b'[{"Payload": "\\ud800"}]', ("Payload", "not valid Unicode")),
    (b'[{"MaxAttempts": "\\ud800"}]', ("MaxAttempts",)),  # the 422 cannot echo this input back
    (b'[{"Bogus\\udc00": 1}]', ("valid string",)),
    (b'[{"Payload": 1}, {"Payload": 2, "MaxAttempts": -5}]', ("MaxAttempts",)),
]


async def test_malformed_json_and_wrong_types_are_4xx_saying_what_is_wrong(target: Target) -> None:
    for body, phrases in MALFORMED:
        assert_4xx(await target.post(content=body), *phrases)
    # Not JSON at all, or declared as something else.
    assert_4xx(await target.post(content=b'[{"Payload": 1}]', headers={"content-type": "text/plain"}))
    assert_4xx(await target.post(content=b"Payload=1", headers={"content-type": "application/x-www-form-urlencoded"}))
    # A refused item refuses the call: the good items of it are not published either.
    response = await target.post([{"Payload": "good"}, {"Payload": 1, "Attributes": {"n": 2}}])
    assert_4xx(response, "must be strings", status=422)
    assert [r["Error"]["Code"] for r in response.json()["results"]] == ["BatchAborted", "InvalidAttribute"]
    await target.check()


NON_FINITE: list[tuple[bytes, tuple[str, ...]]] = [
    (b'[{"DelaySeconds": NaN}]', ("DelaySeconds", "finite")),
    (b'[{"DelaySeconds": Infinity}]', ("DelaySeconds",)),
    (b'[{"DelaySeconds": -Infinity}]', ("DelaySeconds",)),
    (b'[{"DeduplicationKey": "d", "DeduplicationTTLSeconds": NaN}]', ("DeduplicationTTLSeconds", "finite")),
    (b'[{"DeduplicationKey": "d", "DeduplicationTTLSeconds": Infinity}]', ("DeduplicationTTLSeconds",)),
    (b'[{"MaxAttempts": NaN}]', ("MaxAttempts",)),
    (b'[{"MaxAttempts": Infinity}]', ("MaxAttempts",)),
    (b'[{"MessageID": NaN}]', ("MessageID",)),
    (b'[{"PartitionKey": Infinity}]', ("PartitionKey",)),
    (b'[{"BackoffSeconds": [NaN]}]', ("BackoffSeconds",)),
    (b'[{"BackoffSeconds": [1, Infinity]}]', ("BackoffSeconds",)),
]


async def test_nan_and_infinity_in_a_validated_field_are_422_not_500(target: Target) -> None:
    """Python's JSON parser reads NaN and Infinity; the 422 that refuses them echoes the input,
    which strict JSON cannot write: the answer must still be a 422 that names the field."""
    for body, phrases in NON_FINITE:
        response = await target.post(content=body)
        assert_4xx(response, *phrases, status=422)
    [held] = await target.queue.deliveries(target.subs["held"], "Pending", limit=1)
    base = f"{PREFIX}/subscriptions/{target.subs['held']}/deliveries/{held.delivery_id}"
    for body in (b'{"Note": NaN}', b'{"Note": Infinity}', b'{"Note": [NaN]}'):
        assert_4xx(await target.post(content=body, path=f"{base}/replay"), "Note", status=422)
    assert_4xx(await target.post(content=b'{"Reason": -Infinity}', path=f"{base}/discard"), "Reason", status=422)
    await target.check()


async def test_attempts_and_backoff_schedules_are_bounded(target: Target) -> None:
    """A message cannot ask for attempts without end (MaxAttempts up to 2**31 - 1 with a zero
    backoff never dead-lettered), nor carry a backoff schedule of any length outside the envelope
    cap (a 560,000-entry list was 4.3 MB a delivery)."""
    response = await target.post([{"Payload": 1, "MaxAttempts": 2**31 - 1, "BackoffSeconds": [0]}])
    assert_4xx(response, "MaxAttempts is 2147483647", "at most 100", "WORKQUEUE_MAX_MESSAGE_ATTEMPTS", status=422)
    assert response.json()["detail"][0]["Field"] == "max_attempts"
    assert_4xx(await target.post([{"Payload": 1, "MaxAttempts": 101}]), "at most 100", status=422)
    await target.accept({"Payload": {"attempts": 100}, "MaxAttempts": 100, "BackoffSeconds": [0.5] * 100})

    huge = b'[{"Payload": 1, "BackoffSeconds": [' + b",".join([b"0"] * 560_000) + b"]}]"
    response = await target.post(content=huge)
    assert_4xx(response, "BackoffSeconds has 560000 entries", "at most 100", status=422)
    # The schedule counts in the envelope cap: a payload that fits alone does not fit with it.
    payload = "z" * (256 * 1024 - 64)
    await target.accept({"Payload": payload})
    response = await target.post([{"Payload": payload, "BackoffSeconds": [3_000_000_000.5] * 100}])
    assert_4xx(response, "EnvelopeTooLarge", status=422)
    await target.check()


async def test_size_limits_are_413_with_the_limit(target: Target) -> None:
    response = await target.post([{"Payload": i} for i in range(10_000)])
    assert_4xx(response, "10000 messages in one call", "at most 1000", status=413)
    response = await target.post([{"Payload": i} for i in range(1001)])
    assert_4xx(response, "at most 1000", status=413)

    # Over the byte limit (5 MiB), declared ...
    response = await target.post([{"Payload": "x" * (6 * 1024 * 1024)}])
    assert_4xx(response, "larger than 5242880 bytes", status=413)

    # ... or streamed without a length.
    async def chunks() -> AsyncIterator[bytes]:
        yield b'[{"Payload": "'
        for _ in range(6):
            yield b"y" * (1024 * 1024)
        yield b'"}]'

    response = await target.http.post(target.url, content=chunks(), headers={**JSON, **target.headers})
    assert_4xx(response, "larger than", status=413)
    # An operator's action over the limit is told what to shorten, not to publish less.
    discard = f"{PREFIX}/subscriptions/{target.subs['held']}/deliveries/1/discard"
    response = await target.post({"Reason": "r" * (6 * 1024 * 1024)}, path=discard)
    assert_4xx(response, "larger than 5242880 bytes; send a shorter note or reason", status=413)
    replay = f"{PREFIX}/subscriptions/{target.subs['held']}/deliveries/1/replay"
    response = await target.post({"Note": "n" * 2001}, path=replay)
    assert_4xx(response, "Note", "is 2001 characters; at most 2000 are allowed", status=422)

    # Under the byte limit, over the envelope cap: the item is named.
    response = await target.post([{"Payload": 1}, {"Payload": "z" * (256 * 1024)}])
    assert_4xx(response, "EnvelopeTooLarge", "PayloadRef", status=422)
    assert response.json()["detail"][0]["Index"] == 1
    await target.check()


async def test_deep_nesting_is_accepted_to_a_limit_and_never_a_500(target: Target) -> None:
    # 200 levels: accepted, stored, listed over REST and handed to the handler as they were sent.
    [deep] = await target.accept({"Payload": nested(MAX_PAYLOAD_DEPTH), "PartitionKey": "deep"})
    [objects] = await target.accept({"Payload": {"a": json.loads('{"a": ' * 150 + "1" + "}" * 150)}})
    listed = await target.http.get(
        f"{PREFIX}/subscriptions/{target.subs['held']}/deliveries", params={"status": "Pending", "limit": 1000},
        headers=target.headers,
    )
    assert listed.status_code == 200, listed.text[:300]
    payloads = {d["MessageID"]: d["Payload"] for d in listed.json()}
    assert payloads[deep] == nested(MAX_PAYLOAD_DEPTH) and payloads[objects] == target.ledger[objects][0]

    # One level more: refused with the limit (a deeper payload could be stored but not listed).
    response = await target.post([{"Payload": nested(MAX_PAYLOAD_DEPTH + 1)}])
    assert_4xx(response, f"more than {MAX_PAYLOAD_DEPTH} levels", status=422)

    # Deeper than the parser goes, in the payload, the attributes or the body itself: a 400 that says so.
    for depth in (5_000, 100_000):
        for body in (
            b"[" * depth + b"]" * depth,
            b'[{"Payload": ' + b"[" * depth + b"]" * depth + b"}]",
            b'[{"Attributes": {"a": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}}]",
            b'[{"Payload": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}]",
        ):
            assert_4xx(await target.post(content=body), "nested too deeply", status=400)
    await target.check()


async def test_a_body_that_is_not_utf8_is_refused_with_a_reason(target: Target) -> None:
    # Latin-1 from a client that did not encode its JSON: a 400 that names the byte, not a bare one.
    for body, offset in ((b'[{"Payload": "caf\xe9"}]', 17), (b"\xff[]", 0)):
        response = await target.post(content=body)
        assert_4xx(response, "not UTF-8", status=400)
        assert f"at offset {offset}" in response.json()["detail"], response.text
    await target.check()


async def test_an_integer_too_long_to_read_is_a_400_that_says_to_send_a_string(target: Target) -> None:
    # Python reads at most 4,300 digits of an integer: a bare "error parsing the body" said nothing.
    for body in (b'[{"Payload": {"n": ' + b"9" * 5000 + b"}}]", b'[{"Payload": ' + b"1" * 4301 + b"}]"):
        assert_4xx(await target.post(content=body), "more than 4,300 digits", "as a string", status=400)
    await target.accept({"Payload": {"n": int("9" * 4000)}})  # (within the limit: kept)
    await target.check()


async def test_the_job_routes_bound_and_explain_their_bodies_as_the_operator_routes_do(target: Target) -> None:
    # POST /jobs/{id}/cancel takes a body: it is bounded (413) and an unreadable one says why.
    path = f"{PREFIX}/jobs/{uuid.uuid4()}/cancel"
    too_large = await target.post(content=b'{"Reason": "' + b"x" * (6 * 1024 * 1024) + b'"}', path=path)
    assert_4xx(too_large, "larger than", status=413)
    for body, phrase in ((b'{"Reason": ' + b"9" * 5000 + b"}", "as a string"),
                         (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
                         (b'{"Reason": "caf\xe9"}', "not UTF-8")):
        assert_4xx(await target.post(content=body, path=path), phrase, status=400)


async def test_unicode_and_nul(target: Target) -> None:
    # Unicode everywhere a string goes, NUL in payload strings (and keys of payload objects): accepted,
    # stored verbatim, and handed to the handler as sent.
    await target.accept(
        {
            "Payload": {"text": "NUL:\x00 here", "nul\x00key": 1, "emoji": "😀🏳️‍🌈", "combining": "e\u0301",
                        "rtl": "\u202eevil", "zero-width": "a\u200bb", "cjk": "漢字", "pair": "\U0001f600"},
            "PartitionKey": "clé-🔑-مفتاح-ключ",
            "Attributes": {"name-ü": "värde-💡", "rtl": "\u202egnp.exe", "empty": "", "space ": " "},
            "CorrelationID": "corr-✓-\u00a0",
        },
        {"Payload": "\x00", "PartitionKey": "\u0001\u001f\u007f"},
    )
    # The raw escapes as a client sends them.
    await target.accept(content=b'[{"Payload": "\\u0000\\ud83d\\ude00", "Attributes": {"k": "\\u00e9"}}]')

    # NUL in a key, an attribute or an id: refused with a message naming the field.
    for item, name in (
        ({"PartitionKey": "a\x00b"}, "PartitionKey"),
        ({"Attributes": {"k\x00": "v"}}, "Attributes"),
        ({"Attributes": {"k": "v\x00"}}, "Attributes"),
        ({"CorrelationID": "\x00"}, "CorrelationID"),
        ({"DeduplicationKey": "d\x00"}, "DeduplicationKey"),
        ({"PayloadRef": "s3://bucket/\x00"}, "PayloadRef"),
    ):
        response = await target.post([{"Payload": 1, **item}])
        assert_4xx(response, name, "NUL", status=422)
    # A lone surrogate is not text: refused, naming the field.
    for body, name in (
        (b'[{"PartitionKey": "\\udc00"}]', "PartitionKey"),
        (b'[{"Attributes": {"k": "\\ud800"}}]', "Attributes"),
        (b'[{"CorrelationID": "x\\udfff"}]', "CorrelationID"),
        (b'[{"Payload": {"k": ["\\ud800"]}}]', "Payload"),
    ):
        assert_4xx(await target.post(content=body), name, "not valid Unicode", status=422)

    # Names no topic or subscription can have: 404, whatever the bytes.
    for name in ("a\x00b", "tópico-✓", "😀", "\u202e", "a b"):
        quoted = urllib.parse.quote(name, safe="")
        assert_4xx(await target.post([{"Payload": 1}], path=f"{PREFIX}/topics/{quoted}/messages"), status=404)
        for action in ("pause", "resume", "backlog", "partitions", "deliveries/1/replay", "deliveries/1/discard"):
            method = "GET" if action in ("backlog", "partitions") else "POST"
            response = await target.http.request(method, f"{PREFIX}/subscriptions/{quoted}/{action}",
                                                  headers=target.headers)
            assert_4xx(response, "not", status=404)
        response = await target.http.get(f"{PREFIX}/stats", params={"subscription": name}, headers=target.headers)
        assert_4xx(response, "does not exist", status=404)

    # Operator text with NUL or a lone surrogate: refused, naming the field; the delivery is untouched.
    [dead] = await target.queue.deliveries(target.subs["held"], "Pending", limit=1)
    base = f"{PREFIX}/subscriptions/{target.subs['held']}/deliveries/{dead.delivery_id}"
    assert_4xx(await target.post({"Reason": "why\x00"}, path=f"{base}/discard"), "Reason", "NUL", status=422)
    assert_4xx(await target.post(content=b'{"Note": "\\ud800"}', path=f"{base}/replay"), "Note", "Unicode", status=422)
    after = await target.queue.get_delivery(dead.delivery_id)
    assert after is not None and after.status == "Pending"
    await target.check()


async def test_sql_looking_strings_are_names_of_nothing_and_data_kept_verbatim(target: Target) -> None:
    for text in SQLISH:
        quoted = urllib.parse.quote(text, safe="")
        response = await target.post([{"Payload": text}], path=f"{PREFIX}/topics/{quoted}/messages")
        assert_4xx(response, "does not exist", status=404)
        for action in ("pause", "resume"):
            response = await target.http.post(f"{PREFIX}/subscriptions/{quoted}/{action}", headers=target.headers)
            assert_4xx(response, "does not exist", status=404)
        for read in ("backlog", "partitions", "dead-letters"):
            response = await target.http.get(f"{PREFIX}/subscriptions/{quoted}/{read}", headers=target.headers)
            assert_4xx(response, "does not exist", status=404)
        response = await target.http.get(f"{PREFIX}/stats", params={"subscription": text}, headers=target.headers)
        assert_4xx(response, "does not exist", status=404)

    # As keys, attributes, correlation IDs and payloads they are data: accepted and kept verbatim.
    await target.accept(*(
        {"Payload": {"sql": text}, "PartitionKey": text, "Attributes": {text: text, "q": text}, "CorrelationID": text}
        for text in SQLISH
    ))
    # `%` and `_` are not wildcards anywhere: each key is a key of its own on the Exclusive subscription.
    response = await target.http.get(f"{PREFIX}/subscriptions/{target.subs['excl']}/partitions",
                                     params={"limit": 1000}, headers=target.headers)
    assert response.status_code == 200
    keys = Counter(p["PartitionKey"] for p in response.json())
    assert all(keys[text] == 1 for text in SQLISH), keys
    await target.check()  # the delivery table is still there, and everything in it


async def test_huge_and_too_many_attributes(target: Target) -> None:
    await target.accept(
        {"Payload": 1, "Attributes": {"big": "x" * 1024, "wide": "é" * 1024, "n" * 256: "name at the limit"}},
        {"Payload": 2, "Attributes": {f"a{i}": str(i) for i in range(10)}},
    )
    for attributes, phrases in (
        ({"big": "x" * 1025}, ("Attributes['big']: its value is 1025 characters; at most 1024",)),
        ({"big": "x" * (1024 * 1024)}, ("at most 1024",)),
        ({"n" * 257: "v"}, (f"Attributes['{'n' * 40}…']: its name is 257 characters; at most 256",)),
        ({f"a{i}": str(i) for i in range(11)}, ("11 attributes", "at most 10")),
    ):
        assert_4xx(await target.post([{"Payload": 1, "Attributes": attributes}]), *phrases, status=422)
    await target.check()


async def test_hostile_ids_and_query_parameters(target: Target) -> None:
    sub = target.subs["held"]
    for delivery_id in ("99999999999999999999999", "9223372036854775808", "-1", "0", "1e3", "abc", "%00", "1;DROP"):
        quoted = urllib.parse.quote(delivery_id, safe="%")
        base = f"{PREFIX}/subscriptions/{sub}/deliveries/{quoted}"
        assert_4xx(await target.http.get(base, headers=target.headers), "not found", status=404)
        for action in ("replay", "discard"):
            assert_4xx(await target.post({}, path=f"{base}/{action}"), "not found", status=404)
    response = await target.http.get(f"{PREFIX}/subscriptions/{sub}/deliveries",
                                     params={"after": "99999999999999999999999", "status": "Pending"},
                                     headers=target.headers)
    assert response.status_code == 200 and response.json() == []
    # An aws subscription's cursor (aws:<subscription>:<MessageId>) pages its listings; a database
    # subscription gave no such id, so nothing comes after it.
    for listing in ("dead-letters", "deliveries?status=Pending"):
        path, _, query = listing.partition("?")
        response = await target.http.get(f"{PREFIX}/subscriptions/{sub}/{path}",
                                         params={**dict([query.split("=")] if query else []),
                                                 "after": "aws:orders.mail:9b2c-41aa"}, headers=target.headers)
        assert response.status_code == 200 and response.json() == [], response.text
    for params in ({"limit": "0"}, {"limit": str(10**9)}, {"limit": "abc"}, {"status": "Bogus"},
                   {"after": "-1"}, {"after": "1 OR 1=1"}):
        response = await target.http.get(f"{PREFIX}/subscriptions/{sub}/deliveries", params=params,
                                         headers=target.headers)
        assert_4xx(response, status=422)
    response = await target.http.get(f"{PREFIX}/subscriptions/{sub}/partitions", params={"condition": "'; --"},
                                     headers=target.headers)
    assert_4xx(response, status=422)

    # Hostile credentials are no credentials: 401, never a question the store fails on.
    for key in (b"wq_a\x00b_secret", b"wq_%_x", b"wq_' OR '1'='1_x", b"wq_" + b"a" * 100_000 + b"_s", b"wq_\\_\\",
                "wq_é_x".encode(), b"wq_\xff\xfe_x"):
        for headers in ({b"X-API-Key": key}, {b"Authorization": b"Bearer " + key}):
            response = await target.http.get(f"{PREFIX}/stats", headers=headers)
            assert_4xx(response, "API key", status=401)
    await target.check()


# -- fuzzed from the OpenAPI schema ------------------------------------------------------------

FUZZ_EXAMPLES = int(os.environ.get("WORKQUEUE_FUZZ_EXAMPLES", "12"))


def fuzz_operation(strategy: Any, tried: Counter[str]) -> None:
    """Calls the app with cases drawn from ``strategy``; none may be answered with a server error."""

    @given(case=strategy)
    @settings(
        max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    def no_server_error(case: Any) -> None:
        response = case.call()
        tried[case.operation.label] += 1
        case.validate_response(response, checks=[not_a_server_error])

    no_server_error()


def run(coro: Any) -> Any:
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        return runner.run(coro)


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")  # schemathesis' own draws
@pytest.mark.parametrize("database", ["postgresql", "sqlite"])
def test_the_openapi_schema_fuzzed_gets_no_server_error(database: str, pg_url: str, tmp_path: Path) -> None:
    """Every operation, with random and with real topic and subscription names, with data that fits
    the schema and data that does not: no answer is a server error. The app (with its host) runs in
    schemathesis' ASGI event loop; the key and the messages read back use connections of their own.
    (SQLite: a file of its own, see ``db_url``.)"""
    url = pg_url if database == "postgresql" else own_sqlite_file(tmp_path)
    topic, worked, ordered = unique("fuzz"), unique("fuzz-worked"), unique("fuzz-ordered")
    queue = WorkQueue(
        WorkQueueSettings(database_url=url, subscriptions=[SubscriptionPlan(name=worked)], **FAST),
        topics=[Topic(name=topic)],
        subscriptions=[
            Subscription(name=worked, topic=topic, handler_key="fuzz", max_attempts=1),
            Subscription(name=ordered, topic=topic, handler_key="fuzz.never", partition_mode="Ordered"),
        ],
    )

    @queue.handler("fuzz")
    async def fuzz(message: WorkMessage[Any]) -> None:
        return None

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.router)
    app.include_router(queue.health_router)

    async def prepare_store() -> tuple[str, dict[str, Sent]]:
        store = create_database_transport(url, listen=False)
        await store.open()
        try:
            await store.migrate()
            await store.sync_topology(list(queue.topics.values()), list(queue.subscriptions.values()))
            key = (await create_key(store, unique("fuzz"), list(SCOPES))).key
            kept: dict[str, Sent] = {}
            for n in range(3):
                request = PublishRequest(payload={"n": n, "s": "sentinel\x00"}, attributes={"n": str(n)},
                                         partition_key=f"k{n % 2}", correlation_id=f"c{n}")
                [result] = await store.publish(topic, [prepare(request)])
                kept[str(result.message_id)] = (request.payload, request.attributes, request.partition_key,
                                                request.correlation_id)
            return key, kept
        finally:
            await store.close()

    key, sentinels = run(prepare_store())
    auth = {"Authorization": f"Bearer {key}"}
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    known = {"topic": topic, "subscription": ordered}
    tried: Counter[str] = Counter()
    try:
        for result in schema.get_all_operations():
            assert isinstance(result, Ok)
            operation = result.ok()
            names = {p.name for p in operation.path_parameters}
            variants: list[dict[str, Any]] = [{}]
            # The real names go to every operation but a delete: deleting the retired subscription
            # removes its deliveries by design (its own tests prove it), and the read-back below
            # checks that nothing else a fuzzed call can do loses or changes a stored message.
            if names & set(known) and operation.method.upper() != "DELETE":
                variants.append({name: value for name, value in known.items() if name in names})
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                for path_parameters in variants:
                    strategy = operation.as_strategy(
                        generation_mode=mode, headers=auth, path_parameters=path_parameters or None
                    )

                    try:
                        fuzz_operation(strategy, tried)
                    except Unsatisfiable:
                        assert mode is GenerationMode.NEGATIVE  # nothing to get wrong in this operation
    finally:
        schemathesis_asgi.shutdown_lifespans()
    assert len(tried) >= 13, tried  # every operation of both routers was called

    async def read_back() -> None:
        store = create_database_transport(url, listen=False)
        await store.open()
        try:
            stored = {}
            for status in ("Pending", "InFlight", "Completed", "DeadLettered", "Discarded"):
                for info in await store.list_deliveries(ordered, status, limit=1000, include_payload=True):
                    stored[str(info.message_id)] = info
            for message_id, sent in sentinels.items():
                info = stored[message_id]  # fuzzed operators may have discarded it: it is still there
                assert (info.payload, info.attributes, info.partition_key, info.correlation_id) == sent
        finally:
            await store.close()

    run(read_back())


# -- bad configuration -------------------------------------------------------------------------


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest, pg_url: str, tmp_path: Path) -> str:
    # A SQLite file of its own: the module's sqlite target keeps its app open between its tests,
    # and its host may hold the file's write lock when its event loop is not running.
    return pg_url if request.param == "postgresql" else own_sqlite_file(tmp_path)


def own_sqlite_file(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'workqueue.db'}"


def declared(url: str, *, plan: list[SubscriptionPlan] | None = None, mode: Any = "None",
             topic: str = "", sub: str = "", **settings: Any) -> WorkQueue:
    topic, sub = topic or unique("cfg"), sub or unique("cfg-sub")
    return WorkQueue(
        WorkQueueSettings(database_url=url, subscriptions=plan or [SubscriptionPlan(name=sub)], **{**FAST, **settings}),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=sub, topic=topic, handler_key="cfg", partition_mode=mode)],
    )


async def test_an_unknown_subscription_in_the_plan_is_an_error_naming_it(db_url: str) -> None:
    missing = unique("nosuchsub")
    queue = declared(db_url, plan=[SubscriptionPlan(name=missing)])
    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.health_router)
    async with queue.lifespan(app), client(app) as http:
        report = queue.health()
        assert report.status == "Degraded"
        assert report.reason == f"1 subscription in Error ({missing}); each says why"
        [entry] = [s for s in report.subscriptions if s.subscription == missing]
        assert entry.state == "Error" and entry.reason is not None
        assert missing in entry.reason and "does not exist" in entry.reason and "declare it" in entry.reason
        response = await http.get("/health/extensions")
        assert response.status_code == 503 and missing in response.text


RICHER_FILTERS: list[tuple[dict[str, Any], str]] = [
    ({"field": "kind", "operator": "contains", "value": "x"}, "operator 'contains' is not supported"),
    ({"field": "kind", "operator": "eq", "value": 5}, "needs a string 'value'"),
    ({"field": "kind", "operator": "eq", "value": "x", "ignoreCase": True}, "unsupported keys"),
    ({"logic": "not", "filters": [{"field": "a", "operator": "eq", "value": "x"}]}, "logic 'not'"),
    ({"logic": "or", "filters": [{"field": "a", "operator": "eq", "value": "x"},
                                 {"field": "b", "operator": "eq", "value": "y"}]}, "one field"),
    ({"logic": "or", "filters": [{"field": "a", "operator": "neq", "value": "x"}]}, "may only combine eq"),
    ({"logic": "and", "filters": []}, "non-empty 'filters'"),
    ({"field": "", "operator": "eq", "value": "x"}, "non-empty string 'field'"),
]


@pytest.mark.parametrize(("spec", "problem"), RICHER_FILTERS)
def test_a_richer_filter_is_refused_naming_what_is_allowed(spec: dict[str, Any], problem: str) -> None:
    with pytest.raises(FilterError) as direct:
        validate_filter(spec)
    assert problem in str(direct.value) and "allowed: leaves {field, operator, value}" in str(direct.value)
    with pytest.raises(ValidationError) as declared_with_it:
        Subscription(name="s", topic="t", handler_key="h", filter=spec)
    [error] = declared_with_it.value.errors()
    assert error["loc"] == ("filter",) and isinstance(error["ctx"]["error"], FilterError)
    assert problem in str(declared_with_it.value) and "eq, neq, startswith, isnull or isnotnull" in str(
        declared_with_it.value
    )


async def test_a_missing_database_fails_at_start_saying_what_to_change(tmp_path: Any) -> None:
    name = f"workqueue_missing_{os.getpid()}"
    queue = declared(PG_URL.rsplit("/", 1)[0] + f"/{name}")
    with pytest.raises(ConfigurationError) as info:
        async with queue.lifespan(None):
            pass
    assert name in str(info.value) and "does not exist" in str(info.value)
    assert "create the database" in str(info.value) and "WORKQUEUE_DATABASE_URL" in str(info.value)

    directory = tmp_path / "no" / "such" / "directory"
    queue = declared(f"sqlite+aiosqlite:///{directory / 'queue.db'}")
    with pytest.raises(ConfigurationError) as info:
        async with queue.lifespan(None):
            pass
    assert str(directory) in str(info.value) and "does not exist; create it" in str(info.value)
    assert not directory.exists()


async def test_wrong_credentials_or_nothing_listening_fail_at_start_saying_what_to_change() -> None:
    queue = declared("postgresql+asyncpg://nosuchuser@127.0.0.1:5432/postgres")
    with pytest.raises(ConfigurationError) as info:
        async with queue.lifespan(None):
            pass
    assert "refused the credentials" in str(info.value) and "nosuchuser" in str(info.value)
    assert "check WORKQUEUE_DATABASE_URL" in str(info.value)

    queue = declared("postgresql+asyncpg://postgres@127.0.0.1:1/postgres")
    with pytest.raises(TransportUnavailable) as unavailable:
        async with queue.lifespan(None):
            pass
    assert unavailable.value.retryable and "unavailable" in str(unavailable.value)


def test_a_handler_key_registered_twice_or_an_undeclared_topic_fails_at_declaration() -> None:
    queue = WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))

    @queue.handler("orders.ship")
    async def ship(message: WorkMessage[Any]) -> None:
        return None

    queue.handler("orders.ship")(ship)  # the same function again is harmless

    async def ship_again(message: WorkMessage[Any]) -> None:
        return None

    with pytest.raises(ConfigurationError) as info:
        queue.handler("orders.ship")(ship_again)
    assert "'orders.ship' is already registered" in str(info.value) and "another key" in str(info.value)
    assert "ship_again" in str(info.value)

    with pytest.raises(ConfigurationError) as undeclared:
        queue.add_subscription(Subscription(name="orders.ship", topic="orders.placed", handler_key="orders.ship"))
    assert "Topic(name='orders.placed')" in str(undeclared.value)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"lease_seconds": 1e308}, "lease_seconds"),
        ({"backoff_max_seconds": 1e308}, "backoff_max_seconds"),
        ({"retention_seconds": float("inf")}, "retention_seconds"),
        ({"max_attempts": 2**40}, "max_attempts"),
        ({"backoff_base_seconds": 10, "backoff_max_seconds": 1}, "raise the maximum or lower the base"),
    ],
)
def test_durations_and_counts_a_store_cannot_hold_fail_at_declaration(fields: dict[str, Any], name: str) -> None:
    with pytest.raises(ValidationError) as info:
        Subscription(name="s", topic="t", handler_key="h", **fields)
    assert name in str(info.value)


async def test_a_partition_mode_change_with_live_deliveries_fails_at_start(db_url: str) -> None:
    topic, sub = unique("cfg-mode"), unique("cfg-mode-sub")
    first = declared(db_url, topic=topic, sub=sub, enabled=False)
    async with first.lifespan(None):
        [result] = await first.publish(topic, [PublishRequest(payload=1)])
        assert result.ok
    changed = declared(db_url, topic=topic, sub=sub, mode="Ordered", enabled=False)
    with pytest.raises(ConfigurationError) as info:
        async with changed.lifespan(None):
            pass
    message = str(info.value)
    assert sub in message and "live deliveries" in message and "partition mode None" in message
    assert "once they are settled or discarded, or create a new subscription" in message

    async with first.lifespan(None):
        [live] = await first.deliveries(sub, "Pending")
        assert (await first.discard(sub, live.delivery_id, "mode change")).ok
    async with changed.lifespan(None):
        [stats] = await changed.stats(sub)
        assert stats.partition_mode == "Ordered"


# -- the database goes away --------------------------------------------------------------------


@pytest.fixture
async def own_database() -> AsyncIterator[tuple[str, str]]:
    """A PostgreSQL database of this test alone (its connections are cut and refused)."""
    name = f"workqueue_outage_{os.getpid()}"
    url = PG_URL.rsplit("/", 1)[0] + f"/{name}"
    await recreate_database(url)
    try:
        yield url, name
    finally:
        await admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await drop_database(url)


async def admin(sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(to_asyncpg_dsn(PG_URL.rsplit("/", 1)[0] + "/postgres"))
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def terminate(name: str) -> int:
    return int(await admin(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
        name,
    ))


async def listening(name: str) -> int:
    """Sessions on database ``name`` whose last statement was a LISTEN: the queue's wake-up connection."""
    return int(await admin(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND query ILIKE 'LISTEN%'", name
    ))


async def test_a_stop_while_the_database_is_away_ends_within_its_drains(own_database: tuple[str, str]) -> None:
    """SIGTERM in an outage: the settles that cannot be written are given up at the stop's deadline
    (2 x the drain and a moment), not retried for a minute each; the leases bring the work back."""
    url, name = own_database

    async def refuse() -> None:
        await admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        await terminate(name)

    stopped_in = await stop_time_in_an_outage(url, refuse, drain=0.5)
    assert stopped_in < 2 * 0.5 + 5, f"the stop took {stopped_in:.1f} s"


async def test_a_database_that_goes_away_mid_run(own_database: tuple[str, str]) -> None:
    url, name = own_database
    topic, sub = unique("outage"), unique("outage-sub")
    handled: Counter[str] = Counter()
    queue = WorkQueue(
        WorkQueueSettings(
            database_url=url, auto_migrate=True, subscriptions=[SubscriptionPlan(name=sub, concurrency=4)],
            # Idle consumers poll every 20 s at the soonest: they learn of new work through LISTEN, so after
            # the outage only a wake-up connection that came back by itself gets the work done in time.
            idle_poll_min_ms=20_000, idle_poll_max_ms=60_000, sweeper_interval_ms=200, reconcile_interval_ms=500,
            shutdown_drain_ms=500,
        ),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=sub, topic=topic, handler_key="outage", lease_seconds=2, max_attempts=100,
                                    backoff_base_seconds=0.05, backoff_max_seconds=0.2)],
    )

    @queue.handler("outage")
    async def work(message: WorkMessage[Any]) -> None:
        handled[str(message.message_id)] += 1

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.router)
    accepted: set[str] = set()
    outcomes: Counter[str] = Counter()
    unexpected: list[str] = []
    stop = asyncio.Event()

    async with queue.lifespan(app), client(app) as http:
        key = (await create_key(queue.transport, unique("outage"), list(SCOPES))).key

        async def publish_directly() -> None:
            while not stop.is_set():
                try:
                    [result] = await queue.publish(topic, [PublishRequest(payload={"via": "library"})])
                except TransportUnavailable as exc:
                    outcomes[f"library: TransportUnavailable, retryable={exc.retryable}"] += 1
                except Exception as exc:
                    unexpected.append(f"library publish raised {type(exc).__name__}: {exc}")
                else:
                    assert result.status.value == "Accepted", result
                    accepted.add(str(result.message_id))
                    outcomes["library: Accepted"] += 1
                await asyncio.sleep(0.02)

        async def publish_over_rest() -> None:
            while not stop.is_set():
                response = await http.post(f"{PREFIX}/topics/{topic}/messages", json=[{"Payload": {"via": "rest"}}],
                                           headers={"X-API-Key": key})
                if response.status_code == 200:
                    accepted.add(response.json()[0]["MessageID"])
                    outcomes["REST: 200"] += 1
                elif response.status_code == 503 and response.headers.get("retry-after") and "unavailable" in (
                    response.text
                ):
                    outcomes["REST: 503"] += 1
                else:
                    unexpected.append(
                        f"REST publish answered {response.status_code} (Retry-After "
                        f"{response.headers.get('retry-after')}): {response.text[:300]}"
                    )
                await asyncio.sleep(0.05)

        publishers = [asyncio.create_task(publish_directly()), asyncio.create_task(publish_over_rest())]
        try:
            await wait_for(lambda: len(handled) >= 10, within=10)
            # Connections cut under the running app, again and again: each time it publishes again.
            for _ in range(5):
                await terminate(name)
                before = outcomes["library: Accepted"]
                await wait_for(lambda: outcomes["library: Accepted"] > before, within=10,  # noqa: B023 (awaited here)
                               describe=lambda: outcomes)
            # Then no connections at all for a while; consumers that look for work meanwhile fail and back off.
            await admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            await terminate(name)
            at_outage = Counter(outcomes)
            consumer = queue.host.consumers[sub] if queue.host else None
            assert consumer is not None
            errors_seen: list[str | None] = []

            def refused_everywhere() -> bool:
                """Until, in the outage, a claim failed (the subscription in Error) and both ways of
                publishing were refused."""
                consumer.wake()
                errors_seen.extend(s.reason for s in queue.health().subscriptions if s.state == "Error")
                return bool(errors_seen) and all(outcomes[k] > at_outage[k] for k in (
                    "library: TransportUnavailable, retryable=True", "REST: 503"))

            await wait_for(refused_everywhere, within=20, interval=0.1, describe=lambda: (outcomes, errors_seen))
            refused = Counter(outcomes)
            await admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            # Publishing goes on against the database that came back, both ways.
            await wait_for(lambda: outcomes["library: Accepted"] > refused["library: Accepted"]
                           and outcomes["REST: 200"] > refused["REST: 200"], within=20, describe=lambda: outcomes)
        finally:
            stop.set()
            await asyncio.gather(*publishers)

        assert not unexpected, unexpected[:5]
        assert refused["library: TransportUnavailable, retryable=True"] > 0 and refused["REST: 503"] > 0, refused
        assert not outcomes["library: TransportUnavailable, retryable=False"], outcomes
        assert errors_seen and all("unavailable" in (reason or "") for reason in errors_seen), errors_seen
        assert outcomes["library: Accepted"] > refused["library: Accepted"], outcomes
        assert outcomes["REST: 200"] > refused["REST: 200"], outcomes

        # Nothing accepted is lost: every message is handled and every delivery is terminal.
        await wait_for(lambda: accepted <= handled.keys(), within=30)

        async def all_completed() -> bool:
            [stats] = await queue.stats(sub)
            assert stats.dead_lettered == stats.discarded == 0, stats
            return stats.pending == stats.in_flight == 0 and stats.completed >= len(accepted)

        await wait_for(all_completed, within=20)

        # LISTEN is back by itself, and a publish now is handled at once (consumers poll every 20 s).
        await wait_for(lambda: listening(name), within=20)
        started = time.monotonic()
        [probe] = await queue.publish(topic, [PublishRequest(payload={"via": "probe"})])
        await wait_for(lambda: str(probe.message_id) in handled, within=5)
        assert time.monotonic() - started < 3
        health = queue.health()
        assert health.status == "Running" and all(s.state == "Running" for s in health.subscriptions), health


async def test_a_settle_that_meets_a_statement_timeout_is_tried_again_not_given_up(
    own_database: tuple[str, str],
) -> None:
    """An operator's lock on the deliveries for 2 s with a statement_timeout of 0.5 s on the
    database: the settle of a handler that completed then was given up at once ("not retryable";
    its lease would expire and the handler run again). It is tried again until it is written, and
    the handler runs once."""
    url, name = own_database
    topic, sub = unique("locked"), unique("locked-sub")
    runs: Counter[str] = Counter()
    entered, release = asyncio.Event(), asyncio.Event()
    queue = WorkQueue(
        WorkQueueSettings(database_url=url, auto_migrate=True, sweeper_interval_ms=200, shutdown_drain_ms=500,
                          subscriptions=[SubscriptionPlan(name=sub, concurrency=1)]),
        topics=[Topic(name=topic)],
        subscriptions=[Subscription(name=sub, topic=topic, handler_key="locked", lease_seconds=4)],
    )

    @queue.handler("locked")
    async def work(message: WorkMessage[Any]) -> None:
        runs[str(message.message_id)] += 1
        entered.set()
        await release.wait()

    async with queue.lifespan(None):
        [result] = await queue.publish(topic, [PublishRequest(payload={})])
        await asyncio.wait_for(entered.wait(), 10)
        await admin(f"ALTER DATABASE \"{name}\" SET statement_timeout = '500ms'")
        await terminate(name)  # (the pooled connections come back with the setting)
        locker = await asyncpg.connect(to_asyncpg_dsn(url))
        try:
            tx = locker.transaction()
            await tx.start()
            await locker.execute("SET statement_timeout = 0")
            await locker.execute("LOCK TABLE workqueue.delivery IN ACCESS EXCLUSIVE MODE")
            release.set()  # (the handler completes while the table is locked)
            await asyncio.sleep(2.0)
            await tx.rollback()
        finally:
            await locker.close()

        async def settled() -> Any:
            info = await delivery_status(queue, sub, result.message_id)
            return info if info.status == "Completed" else None

        info = await wait_for(settled, within=30)
        await asyncio.sleep(5.0)  # (past the lease: a lost settle would have brought a second run by now)
    assert info.attempt == 1 and runs[str(result.message_id)] == 1, (info, runs)


async def test_a_request_session_answers_503_when_the_server_has_no_connection_left(
    own_database: tuple[str, str],
) -> None:
    """The app's login at its connection limit (SQLSTATE 53300, as a full max_connections): an
    endpoint that takes ``queue.session`` answered 500 with the driver's traceback; it answers 503
    with Retry-After, as for a database out of reach, and 200 once a connection is free again."""
    url, name = own_database
    role = f"wq_limited_{os.getpid()}"
    await admin(f'DROP ROLE IF EXISTS "{role}"')
    await admin(f"CREATE ROLE \"{role}\" LOGIN PASSWORD 'pw'")
    await admin(f'ALTER DATABASE "{name}" OWNER TO "{role}"')
    limited = url.replace("postgres@", f"{role}:pw@", 1)
    assert limited != url
    queue = WorkQueue(WorkQueueSettings(database_url=limited, auto_migrate=True, enabled=False))
    app = FastAPI(lifespan=queue.lifespan)

    @app.get("/count")
    async def count(session: AsyncSession = queue.session) -> dict[str, int]:
        return {"one": (await session.execute(sql_text("SELECT 1"))).scalar_one()}

    try:
        async with queue.lifespan(app), client(app) as http:
            held = int(await admin("SELECT count(*) FROM pg_stat_activity WHERE usename = $1", role))
            await admin(f'ALTER ROLE "{role}" CONNECTION LIMIT {held}')  # (none more for the request)
            try:
                refused = await http.get("/count")
            finally:
                await admin(f'ALTER ROLE "{role}" CONNECTION LIMIT -1')
            assert refused.status_code == 503, refused.text
            assert refused.headers.get("retry-after") is not None
            served = await http.get("/count")
            assert served.status_code == 200 and served.json() == {"one": 1}
    finally:
        await terminate(name)
        await admin(f'ALTER DATABASE "{name}" OWNER TO postgres')
        inside = await asyncpg.connect(to_asyncpg_dsn(url))
        try:
            await inside.execute(f'REASSIGN OWNED BY "{role}" TO postgres; DROP OWNED BY "{role}"')
        finally:
            await inside.close()
        await admin(f'DROP ROLE IF EXISTS "{role}"')
