"""The REST API of a real app, in-process over HTTP on the test databases (PostgreSQL and SQLite).

Keys are real (hashed in the database); every route is checked for 401 without a valid key, 403
without its scope and 2xx with it. Only the ``slow`` subscription runs under the host; the others
are driven with the transport (claim, settle) so their states are exact.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi import FastAPI, HTTPException, Request, status
from fastapi.routing import APIRoute
from fastapi.security import SecurityScopes

from fastapi_workqueue import (
    AbortReason,
    Outcome,
    PublishRequest,
    Subscription,
    SubscriptionPlan,
    Topic,
    WorkContext,
    WorkMessage,
    WorkOutcome,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.core.keys import (
    SCOPE_ADMIN,
    SCOPE_JOBS,
    SCOPE_OPERATE,
    SCOPE_PUBLISH,
    SCOPE_READ,
    SCOPES,
    Principal,
    create_key,
    generate_key,
)
from fastapi_workqueue.core.transport import ClaimedDelivery, SettleKind, Settlement
from fastapi_workqueue.web.auth import require_scopes

from .conftest import unique
from .support import FAST, ClaimWatch, wait_for

pytestmark = pytest.mark.timeout(60)

PREFIX = "/work-queue"
ROLES: dict[str, dict[str, Any]] = {
    "plain": {"max_attempts": 1},
    "dl": {"max_attempts": 1},
    "excl": {"partition_mode": "Exclusive", "max_attempts": 1},
    "ord": {"partition_mode": "Ordered", "max_attempts": 1},
    # The handler renews its own lease, so the cancel reaches it at once and a long lease cannot run out.
    "slow": {"lease_seconds": 60, "heartbeat_mode": "Manual"},
    "gone": {},  # retired and deleted by the lifecycle routes
}
LIFECYCLE = ("retire", "delete-subscription", "retire-topic")


@dataclass
class Api:
    queue: WorkQueue
    app: FastAPI
    http: httpx.AsyncClient
    subs: dict[str, str]
    topics: dict[str, str]
    keys: dict[str, str]
    sample_id: str
    started: asyncio.Event = field(default_factory=asyncio.Event)
    reasons: list[AbortReason | None] = field(default_factory=list)

    def bearer(self, label: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[label]}"}

    async def publish(self, role: str, *requests: PublishRequest) -> list[Any]:
        results = await self.queue.publish(self.topics[role], list(requests))
        assert all(r.ok for r in results), results
        return results

    async def claim(self, role: str) -> ClaimedDelivery:
        [claimed] = await self.queue.transport.claim(self.subs[role], 1)
        return claimed

    async def settle(self, delivery: ClaimedDelivery, kind: SettleKind, **extra: Any) -> str:
        [result] = await self.queue.transport.settle(
            [Settlement(delivery.delivery_id, delivery.lease_token, kind, **extra)]
        )
        return result

    async def dead_letter(self) -> str:
        """A fresh dead letter on ``dl`` (publish one, claim one, dead-letter it); its delivery id."""
        await self.publish("dl", PublishRequest(payload={"secret": "dl"}))
        claimed = await self.claim("dl")
        assert await self.settle(claimed, "DeadLetter", reason="poison") == "DeadLettered"
        return claimed.delivery_id


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api")


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
async def api(request: pytest.FixtureRequest, pg_url: str, sqlite_url: str) -> AsyncIterator[Api]:
    """The app on each database transport; everything below runs once per transport."""
    url = pg_url if request.param == "postgresql" else sqlite_url
    subs = {role: unique(f"rest-{role}") for role in ROLES}
    topics = {role: unique(f"rest-t-{role}") for role in ROLES}
    queue = WorkQueue(
        WorkQueueSettings(database_url=url, subscriptions=[SubscriptionPlan(name=subs["slow"])], **FAST),
        topics=[Topic(name=t) for t in topics.values()],
        subscriptions=[
            Subscription(name=subs[role], topic=topics[role], handler_key=role, **spec)
            for role, spec in ROLES.items()
        ],
    )
    started = asyncio.Event()
    reasons: list[AbortReason | None] = []

    @queue.handler("slow")
    async def slow(message: WorkMessage[Any], context: WorkContext) -> WorkOutcome:
        started.set()
        try:
            for _ in range(600):  # the heartbeat that reports the cancel aborts the handler
                if not await context.heartbeat():
                    break
                await asyncio.sleep(0.05)
        finally:
            reasons.append(context.signal.reason)
        return Outcome.complete()

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.router)
    async with queue.lifespan(app), client(app) as http:
        store: Any = queue.transport
        keys: dict[str, str] = {}
        for scope in SCOPES:
            keys[scope] = (await create_key(store, unique("key"), [scope])).key
        keys["read+admin"] = (await create_key(store, "auditor", [SCOPE_READ, SCOPE_ADMIN])).key
        keys["all"] = (await create_key(store, "operator", list(SCOPES))).key
        revoked = await create_key(store, unique("revoked"), list(SCOPES))
        assert await store.api_key_revoke(revoked.prefix) == 1
        keys["revoked"] = revoked.key
        expired = await create_key(store, unique("expired"), list(SCOPES), datetime.now(UTC) - timedelta(minutes=1))
        keys["expired"] = expired.key
        api = Api(queue=queue, app=app, http=http, subs=subs, topics=topics, keys=keys, sample_id="",
                  started=started, reasons=reasons)
        api.sample_id = await api.dead_letter()
        yield api


# -- every route: 401, 403, 2xx ------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    name: str
    method: str
    route: str
    scope: str
    query: str = ""
    body: Any = None
    fresh_dead_letter: bool = False

    async def url(self, api: Api, *, fresh: bool = False) -> str:
        delivery = await api.dead_letter() if fresh and self.fresh_dead_letter else api.sample_id
        role = "plain" if self.name in ("pause", "resume") else "gone" if self.name in LIFECYCLE else "dl"
        topic = api.topics["gone" if self.name in LIFECYCLE else "plain"]
        path = self.route.format(topic=topic, subscription=api.subs[role], delivery_id=delivery)
        return PREFIX + path + self.query


ENDPOINTS = [
    Endpoint("publish", "POST", "/topics/{topic}/messages", SCOPE_PUBLISH, body=[{"Payload": {"n": 1}}]),
    Endpoint("stats", "GET", "/stats", SCOPE_READ),
    Endpoint("backlog", "GET", "/subscriptions/{subscription}/backlog", SCOPE_READ),
    Endpoint("dead-letters", "GET", "/subscriptions/{subscription}/dead-letters", SCOPE_READ),
    Endpoint("deliveries", "GET", "/subscriptions/{subscription}/deliveries", SCOPE_READ, "?status=DeadLettered"),
    Endpoint("delivery", "GET", "/subscriptions/{subscription}/deliveries/{delivery_id}", SCOPE_READ),
    Endpoint("delivery-by-id", "GET", "/deliveries/{delivery_id}", SCOPE_READ),
    Endpoint("attempts", "GET", "/deliveries/{delivery_id}/attempts", SCOPE_READ),
    Endpoint("search", "GET", "/search", SCOPE_READ, "?q=nobody"),
    Endpoint("partitions", "GET", "/subscriptions/{subscription}/partitions", SCOPE_READ, "?condition=Blocked"),
    Endpoint("validate-bindings", "GET", "/validate-bindings", SCOPE_READ),
    Endpoint("processes", "GET", "/processes", SCOPE_READ),
    Endpoint("replay", "POST", "/subscriptions/{subscription}/deliveries/{delivery_id}/replay", SCOPE_OPERATE,
             body={"Note": "fixed"}, fresh_dead_letter=True),
    Endpoint("discard", "POST", "/subscriptions/{subscription}/deliveries/{delivery_id}/discard", SCOPE_OPERATE,
             body={"Reason": "not needed"}, fresh_dead_letter=True),
    Endpoint("pause", "POST", "/subscriptions/{subscription}/pause", SCOPE_OPERATE),
    Endpoint("resume", "POST", "/subscriptions/{subscription}/resume", SCOPE_OPERATE),
    Endpoint("retire", "POST", "/subscriptions/{subscription}/retire", SCOPE_OPERATE),
    Endpoint("delete-subscription", "DELETE", "/subscriptions/{subscription}", SCOPE_ADMIN),
    Endpoint("retire-topic", "POST", "/topics/{topic}/retire", SCOPE_OPERATE),
]


async def call(api: Api, endpoint: Endpoint, headers: dict[str, str], *, fresh: bool = False) -> httpx.Response:
    url = await endpoint.url(api, fresh=fresh)
    kwargs: dict[str, Any] = {"headers": headers}
    if endpoint.body is not None:
        kwargs["json"] = endpoint.body
    return await api.http.request(endpoint.method, url, **kwargs)


def test_the_table_covers_every_route_of_the_router(api: Api) -> None:
    routes = {
        (method, route.path)
        for route in api.queue.router.routes
        if isinstance(route, APIRoute)
        for method in route.methods or ()
    }
    table = {(e.method, PREFIX + e.route) for e in ENDPOINTS}
    assert routes == table


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=[e.name for e in ENDPOINTS])
async def test_401_without_a_valid_key(api: Api, endpoint: Endpoint) -> None:
    credentials = {
        "no key": {},
        "empty bearer": {"Authorization": "Bearer "},
        "not a bearer": {"Authorization": f"Basic {api.keys['all']}"},
        "malformed key": {"Authorization": "Bearer not-a-workqueue-key"},
        "unknown key": {"Authorization": f"Bearer {generate_key()[0]}"},
        "right prefix, wrong secret": {"Authorization": f"Bearer {api.keys['all'].rsplit('_', 1)[0]}_forged"},
        "revoked key": api.bearer("revoked"),
        "expired key": {"X-API-Key": api.keys["expired"]},
    }
    for label, headers in credentials.items():
        response = await call(api, endpoint, headers)
        assert response.status_code == 401, (label, response.text)
        assert response.headers["www-authenticate"] == "Bearer", label
        assert "API key" in response.json()["detail"], label


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=[e.name for e in ENDPOINTS])
async def test_403_without_the_scope(api: Api, endpoint: Endpoint) -> None:
    for scope in SCOPES:
        if scope == endpoint.scope:
            continue
        for headers in (api.bearer(scope), {"X-API-Key": api.keys[scope]}):
            response = await call(api, endpoint, headers)
            assert response.status_code == 403, (scope, response.text)
            assert endpoint.scope in response.json()["detail"]


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=[e.name for e in ENDPOINTS])
async def test_2xx_with_the_scope(api: Api, endpoint: Endpoint) -> None:
    for headers in (api.bearer(endpoint.scope), {"X-API-Key": api.keys[endpoint.scope]}):
        if endpoint.name == "delete-subscription":  # each delete needs a retired subscription to delete
            await api.queue.transport.sync_topology([], [api.queue.subscriptions[api.subs["gone"]]])
            await api.queue.retire(api.subs["gone"])
        response = await call(api, endpoint, headers, fresh=True)
        assert response.status_code == 200, response.text
        if endpoint.name == "pause":
            assert await api.queue.resume(api.subs["plain"])


# -- publish -------------------------------------------------------------------------------------


def pending_ids(infos: list[Any]) -> set[str]:
    return {str(i.message_id) for i in infos}


async def test_publish_answers_per_item_in_order_pascal_and_snake_case(api: Api) -> None:
    first, second, third = (str(uuid.uuid4()) for _ in range(3))
    url = f"{PREFIX}/topics/{api.topics['plain']}/messages"
    headers = api.bearer(SCOPE_PUBLISH)
    response = await api.http.post(url, headers=headers, json=[{"MessageID": first, "Payload": {"n": 1}}])
    assert response.status_code == 200
    assert response.json() == [{"Status": "Accepted", "MessageID": first, "Error": None}]

    body = [
        {"MessageID": second, "PartitionKey": "pk", "Attributes": {"kind": "pascal"}, "Payload": {"n": 2},
         "CorrelationID": "corr-1"},
        {"message_id": first, "payload": {"n": 1}},
        {"message_id": third, "partition_key": "pk", "attributes": {"kind": "snake"}, "payload": [3, "three"]},
        {"Payload": "no id given"},
    ]
    response = await api.http.post(url, headers=headers, json=body)
    assert response.status_code == 200, response.text
    results = response.json()
    assert [r["Status"] for r in results] == ["Accepted", "Duplicate", "Accepted", "Accepted"]
    assert [r["MessageID"] for r in results[:3]] == [second, first, third]
    assert uuid.UUID(results[3]["MessageID"])

    stored = {
        str(i.message_id): i
        for i in await api.queue.deliveries(api.subs["plain"], "Pending", limit=1000, include_payload=True)
    }
    assert stored[second].payload == {"n": 2} and stored[second].attributes == {"kind": "pascal"}
    assert stored[second].partition_key == "pk" and stored[second].correlation_id == "corr-1"
    assert stored[third].payload == [3, "three"] and stored[third].attributes == {"kind": "snake"}
    assert stored[results[3]["MessageID"]].payload == "no id given"


async def test_publish_to_an_unknown_topic_is_404(api: Api) -> None:
    response = await api.http.post(
        f"{PREFIX}/topics/{unique('nope')}/messages", headers=api.bearer(SCOPE_PUBLISH), json=[{"Payload": 1}]
    )
    assert response.status_code == 404
    # (and why, as the Python publish says it: it answered "does not exist" alone)
    assert "does not exist (neither the code declares it" in response.json()["detail"]
    assert response.json()["detail"].endswith("check the name)")
    empty = f"{PREFIX}/topics/{unique('nope')}/messages"
    assert (await api.http.post(empty, headers=api.bearer(SCOPE_PUBLISH), json=[])).status_code == 404
    known = f"{PREFIX}/topics/{api.topics['plain']}/messages"
    assert (await api.http.post(known, headers=api.bearer(SCOPE_PUBLISH), json=[])).json() == []


async def test_publish_body_and_batch_limits_are_413(api: Api) -> None:
    limited = FastAPI()
    limited.include_router(api.queue.create_router(prefix="/limited", max_body_bytes=2048, max_batch=3))
    headers = api.bearer(SCOPE_PUBLISH)
    url = f"/limited/topics/{api.topics['plain']}/messages"
    before = pending_ids(await api.queue.deliveries(api.subs["plain"], "Pending", limit=1000))
    async with client(limited) as http:
        # Declared by Content-Length ...
        big = [{"Payload": "x" * 3000}]
        response = await http.post(url, headers=headers, json=big)
        assert response.status_code == 413 and "2048 bytes" in response.json()["detail"]

        # ... or streamed without one (chunked).
        async def chunks() -> AsyncIterator[bytes]:
            yield b'[{"Payload": "'
            for _ in range(10):
                yield b"y" * 400
            yield b'"}]'

        response = await http.post(
            url, headers={**headers, "content-type": "application/json"}, content=chunks()
        )
        assert response.status_code == 413

        response = await http.post(url, headers=headers, json=[{"Payload": i} for i in range(4)])
        assert response.status_code == 413 and "at most 3" in response.json()["detail"]

        response = await http.post(url, headers=headers, json=[{"Payload": i} for i in range(3)])
        assert response.status_code == 200 and [r["Status"] for r in response.json()] == ["Accepted"] * 3
    after = pending_ids(await api.queue.deliveries(api.subs["plain"], "Pending", limit=1000))
    assert len(after - before) == 3  # only the call within both limits published


async def test_a_bad_item_is_422_with_index_and_field_and_nothing_is_published(api: Api) -> None:
    url = f"{PREFIX}/topics/{api.topics['plain']}/messages"
    headers = api.bearer(SCOPE_PUBLISH)
    [before] = await api.queue.stats(api.subs["plain"])
    good = [str(uuid.uuid4()) for _ in range(2)]
    # Every 422 below, in either shape, is what the OpenAPI schema says a 422 is (a generated client
    # parses it).
    openapi = (await api.http.get("/openapi.json")).json()
    declared = openapi["paths"][f"{PREFIX}/topics/{{topic}}/messages"]["post"]["responses"]["422"]
    schema = {**declared["content"]["application/json"]["schema"], "components": openapi["components"]}

    # Refused by the envelope rules: the library's shape, one problem per refused item.
    response = await api.http.post(url, headers=headers, json=[
        {"MessageID": good[0], "Payload": 1},
        {"Payload": 2, "Attributes": {"count": 5}},
        {"MessageID": good[1], "Payload": 3},
    ])
    assert response.status_code == 422, response.text
    body = response.json()
    jsonschema.validate(body, schema)
    assert body["detail"] == [{
        "Index": 1, "Code": "InvalidAttribute", "Field": "attributes",
        "Message": body["detail"][0]["Message"],
    }]
    assert "must be strings" in body["detail"][0]["Message"]
    assert [r["Status"] for r in body["results"]] == ["Rejected"] * 3
    assert [r["Error"]["Code"] for r in body["results"]] == ["BatchAborted", "InvalidAttribute", "BatchAborted"]

    # Refused by the request model: FastAPI's shape, the location names the index and the field.
    # (a true or a "5" for a number was read as 1 or 5)
    for bad, field_name in (({"Payload": 2, "MaxAttempts": 0}, "MaxAttempts"), ({"Payload": 2, "Bogus": 1}, "Bogus"),
                            ({"Payload": 2, "Priority": True}, "Priority"),
                            ({"Payload": 2, "DelaySeconds": "5"}, "DelaySeconds")):
        response = await api.http.post(url, headers=headers, json=[{"MessageID": good[0], "Payload": 1}, bad])
        assert response.status_code == 422, response.text
        jsonschema.validate(response.json(), schema)
        [problem] = response.json()["detail"]
        assert problem["loc"] == ["body", 1, field_name]

    # Over the envelope cap, and not a JSON array at all.
    response = await api.http.post(url, headers=headers, json=[{"Payload": 1}, {"Payload": "z" * (256 * 1024)}])
    assert response.status_code == 422 and response.json()["detail"][0]["Index"] == 1
    assert response.json()["detail"][0]["Code"] == "EnvelopeTooLarge"
    jsonschema.validate(response.json(), schema)
    response = await api.http.post(url, headers=headers, json={"Payload": 1})
    assert response.status_code == 422
    jsonschema.validate(response.json(), schema)

    [after] = await api.queue.stats(api.subs["plain"])
    assert after.pending == before.pending
    stored = pending_ids(await api.queue.deliveries(api.subs["plain"], "Pending", limit=1000))
    assert not stored & set(good)


async def test_message_id_conflict_is_409_and_the_call_publishes_nothing(api: Api) -> None:
    url = f"{PREFIX}/topics/{api.topics['plain']}/messages"
    headers = api.bearer(SCOPE_PUBLISH)
    reused, fresh = str(uuid.uuid4()), str(uuid.uuid4())
    assert (await api.http.post(url, headers=headers, json=[{"MessageID": reused, "Payload": 1}])).status_code == 200
    response = await api.http.post(
        url, headers=headers, json=[{"MessageID": fresh, "Payload": 1}, {"MessageID": reused, "Payload": 2}]
    )
    assert response.status_code == 409, response.text
    body = response.json()
    assert [(p["Index"], p["Code"]) for p in body["detail"]] == [(1, "MessageIDConflict")]
    assert [r["Status"] for r in body["results"]] == ["Rejected", "MessageIDConflict"]
    stored = pending_ids(await api.queue.deliveries(api.subs["plain"], "Pending", limit=1000))
    assert reused in stored and fresh not in stored


# -- operator reads ------------------------------------------------------------------------------


async def test_payloads_are_listed_only_with_the_admin_scope(api: Api) -> None:
    sub = api.subs["dl"]
    urls = [
        f"{PREFIX}/subscriptions/{sub}/dead-letters",
        f"{PREFIX}/subscriptions/{sub}/deliveries?status=DeadLettered",
    ]
    for url in urls:
        plain = (await api.http.get(url, headers=api.bearer(SCOPE_READ))).json()
        admin = (await api.http.get(url, headers=api.bearer("read+admin"))).json()
        assert plain and all(item["Payload"] is None for item in plain)
        assert admin and all(item["Payload"] == {"secret": "dl"} for item in admin)
        assert all(item["Reason"] == "poison" and item["Status"] == "DeadLettered" for item in admin)
    one = f"{PREFIX}/subscriptions/{sub}/deliveries/{api.sample_id}"
    assert (await api.http.get(one, headers=api.bearer(SCOPE_READ))).json()["Payload"] is None
    assert (await api.http.get(one, headers=api.bearer("read+admin"))).json()["Payload"] == {"secret": "dl"}
    # admin alone adds payloads; it does not grant reading.
    assert (await api.http.get(one, headers=api.bearer(SCOPE_ADMIN))).status_code == 403


async def test_one_delivery_by_its_id_whole_with_secrets_taken_out_of_its_errors(api: Api) -> None:
    [published] = await api.publish("dl", PublishRequest(payload={"secret": "by-id"}, attributes={"kind": "whole"}))
    batch = await api.queue.transport.claim(api.subs["dl"], 1000)
    [claimed] = [c for c in batch if c.message_id == published.message_id]
    for other in batch:  # others' deliveries go back as they were
        if other is not claimed:
            await api.settle(other, "Release")
    error = "Traceback (most recent call last):\n  ...\nOSError: cannot reach postgresql://app:hunter2@db/orders"
    await api.settle(claimed, "DeadLetter", reason="poison: password=hunter2", error=error)
    url = f"{PREFIX}/deliveries/{claimed.delivery_id}"
    info = (await api.http.get(url, headers=api.bearer(SCOPE_READ))).json()
    assert (info["DeliveryID"], info["Subscription"], info["Topic"]) == (
        claimed.delivery_id, api.subs["dl"], api.topics["dl"])
    assert (info["Status"], info["Attempt"], info["MaxAttempts"], info["Attributes"]) == (
        "DeadLettered", 1, 1, {"kind": "whole"})
    assert info["ClaimedAt"] and info["CreatedAt"] and info["SettledAt"] and "LeaseExpiresAt" in info
    assert "ProgressPercent" in info and "VisibleAt" in info and info["Payload"] is None
    assert info["Reason"] == "poison: password=***"
    assert info["LastError"].endswith("OSError: cannot reach postgresql://app:***@db/orders")
    admin = (await api.http.get(url, headers=api.bearer("read+admin"))).json()
    assert admin["Payload"] == {"secret": "by-id"}
    for listed in (
        f"{PREFIX}/subscriptions/{api.subs['dl']}/deliveries/{claimed.delivery_id}",
        f"{PREFIX}/subscriptions/{api.subs['dl']}/dead-letters?limit=1000",
        f"{PREFIX}/subscriptions/{api.subs['dl']}/deliveries?status=DeadLettered&limit=1000",
    ):
        assert "hunter2" not in (await api.http.get(listed, headers=api.bearer(SCOPE_READ))).text, listed
    for missing in ("999999999", "not-a-number"):
        response = await api.http.get(f"{PREFIX}/deliveries/{missing}", headers=api.bearer(SCOPE_READ))
        assert response.status_code == 404 and "does not exist" in response.json()["detail"]
    schema = (await api.http.get("/openapi.json")).json()
    assert "404" in schema["paths"][f"{PREFIX}/deliveries/{{delivery_id}}"]["get"]["responses"]


async def test_a_deliverys_attempts_and_the_search_with_secrets_taken_out(api: Api) -> None:
    """``GET /deliveries/{id}/attempts`` lists what the dashboard's delivery page shows of its
    attempts, and ``GET /search?q=`` finds deliveries as its search box does; both redact."""
    tag = unique("acct")
    [published] = await api.publish("dl", PublishRequest(payload={"n": 1}, partition_key=tag, correlation_id=tag))
    batch = await api.queue.transport.claim(api.subs["dl"], 1000)
    [claimed] = [c for c in batch if c.message_id == published.message_id]
    for other in batch:
        if other is not claimed:
            await api.settle(other, "Release")
    error = "Traceback (most recent call last):\n  ...\nOSError: cannot reach postgresql://app:hunter2@db/orders"
    await api.settle(claimed, "DeadLetter", reason="poison: password=hunter2", error=error)
    read = api.bearer(SCOPE_READ)
    attempts = await api.http.get(f"{PREFIX}/deliveries/{claimed.delivery_id}/attempts", headers=read)
    assert attempts.status_code == 200, attempts.text
    [attempt] = attempts.json()
    assert (attempt["Attempt"], attempt["Outcome"]) == (1, "DeadLettered")
    assert attempt["Reason"] == "poison: password=***" and attempt["StartedAt"] and attempt["EndedAt"]
    assert attempt["Error"].endswith("postgresql://app:***@db/orders") and "hunter2" not in attempts.text
    for missing in ("999999999", "not-a-number"):
        response = await api.http.get(f"{PREFIX}/deliveries/{missing}/attempts", headers=read)
        assert response.status_code == 404 and "does not exist" in response.json()["detail"]
    found = await api.http.get(f"{PREFIX}/search", params={"q": tag}, headers=read)
    assert found.status_code == 200, found.text
    rows = found.json()
    # Listed once, with the first way it matched (it was listed once per way on PostgreSQL).
    assert [(r["Matched"], r["Delivery"]["DeliveryID"]) for r in rows] == [("partition key", claimed.delivery_id)]
    assert "hunter2" not in found.text and rows[0]["Delivery"]["Payload"] is None
    by_id = (await api.http.get(f"{PREFIX}/search", params={"q": str(published.message_id)}, headers=read)).json()
    assert [(r["Matched"], r["Delivery"]["DeliveryID"]) for r in by_id] == [("MessageID", claimed.delivery_id)]
    assert (await api.http.get(f"{PREFIX}/search", params={"q": f"nobody-{tag}"}, headers=read)).json() == []
    for bad in ({"q": ""}, {"q": "x", "limit": "0"}, {"q": "x", "limit": "101"}):
        assert (await api.http.get(f"{PREFIX}/search", params=bad, headers=read)).status_code == 422, bad
    # The schema names the values a client can expect, as it does for every other closed set.
    models = (await api.http.get("/openapi.json")).json()["components"]["schemas"]
    assert set(models["AttemptInfo"]["properties"]["Outcome"]["enum"]) == {
        "Failed", "DeadLettered", "Discarded", "LeaseExpired", "Replayed"}
    assert set(models["FoundDelivery"]["properties"]["Matched"]["enum"]) == {
        "delivery id", "MessageID", "partition key", "correlation ID", "job"}


async def test_unknown_subscription_or_delivery_is_404(api: Api) -> None:
    headers = api.bearer("all")
    nope = unique("nope")
    for url in (
        f"{PREFIX}/stats?subscription={nope}",
        f"{PREFIX}/subscriptions/{nope}/backlog",
        f"{PREFIX}/subscriptions/{nope}/dead-letters",
        f"{PREFIX}/subscriptions/{nope}/deliveries",
        f"{PREFIX}/subscriptions/{nope}/partitions",
        f"{PREFIX}/subscriptions/{nope}/deliveries/{api.sample_id}",
        f"{PREFIX}/subscriptions/{api.subs['plain']}/deliveries/{api.sample_id}",  # another subscription's
        f"{PREFIX}/subscriptions/{api.subs['dl']}/deliveries/999999999",
        f"{PREFIX}/subscriptions/{api.subs['dl']}/deliveries/not-a-number",
    ):
        response = await api.http.get(url, headers=headers)
        assert response.status_code == 404, (url, response.text)
    for action in ("pause", "resume"):
        response = await api.http.post(f"{PREFIX}/subscriptions/{nope}/{action}", headers=headers)
        assert response.status_code == 404
    for action in ("replay", "discard"):  # the subscription is what is missing, and the answer says so
        response = await api.http.post(f"{PREFIX}/subscriptions/{nope}/deliveries/{api.sample_id}/{action}",
                                       headers=headers)
        assert response.status_code == 404 and response.json()["detail"] == f"subscription {nope!r} does not exist"
    for listing in ("dead-letters", "deliveries"):
        response = await api.http.get(f"{PREFIX}/subscriptions/{api.subs['dl']}/{listing}?after=abc", headers=headers)
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "after"]
        page = await api.http.get(f"{PREFIX}/subscriptions/{api.subs['dl']}/{listing}",
                                  params={"after": api.sample_id, "status": "DeadLettered"}, headers=headers)
        assert page.status_code == 200 and api.sample_id not in {d["DeliveryID"] for d in page.json()}


async def test_stats_backlog_and_validate_bindings(api: Api) -> None:
    await api.publish("excl", *(PublishRequest(partition_key="a", payload=n) for n in (1, 2)))
    await api.publish("excl", PublishRequest(partition_key="b", payload=3), PublishRequest(payload=4))
    running = await api.claim("excl")  # the oldest key, a: its delivery in flight holds the key
    headers = api.bearer(SCOPE_READ)
    sub = api.subs["excl"]
    backlog = (await api.http.get(f"{PREFIX}/subscriptions/{sub}/backlog", headers=headers)).json()
    assert backlog == {"Subscription": sub, "Claimable": 2, "InFlight": 1, "Backlog": 3}
    [stats] = (await api.http.get(f"{PREFIX}/stats", params={"subscription": sub}, headers=headers)).json()
    assert (stats["Pending"], stats["Claimable"], stats["InFlight"], stats["PartitionMode"]) == (3, 2, 1, "Exclusive")
    everything = (await api.http.get(f"{PREFIX}/stats", headers=headers)).json()
    assert {api.subs[r] for r in ROLES if r != "gone"} <= {s["Subscription"] for s in everything}

    assert await api.settle(running, "Complete") == "Completed"
    backlog = (await api.http.get(f"{PREFIX}/subscriptions/{sub}/backlog", headers=headers)).json()
    assert (backlog["Claimable"], backlog["InFlight"]) == (3, 0)

    report = (await api.http.get(f"{PREFIX}/validate-bindings", headers=headers)).json()
    assert report["Ok"] is True and report["Transport"]
    assert not [i for i in report["Issues"] if i["Severity"] == "Error"]


async def test_partitions_conditions_and_a_blocked_ordered_key(api: Api) -> None:
    sub = api.subs["ord"]
    headers = api.bearer(SCOPE_READ)
    first = await api.publish("ord", *(PublishRequest(partition_key="k1", payload=i) for i in range(3)))
    await api.publish("ord", PublishRequest(partition_key="k2", payload="other"))

    async def listed(condition: str | None = None) -> dict[str, dict[str, Any]]:
        params = {"condition": condition} if condition else {}
        response = await api.http.get(f"{PREFIX}/subscriptions/{sub}/partitions", params=params, headers=headers)
        assert response.status_code == 200, response.text
        return {p["PartitionKey"]: p for p in response.json()}

    head = await api.claim("ord")
    assert head.message_id == first[0].message_id
    in_flight = await listed("InFlight")
    assert list(in_flight) == ["k1"]
    assert in_flight["k1"]["HeadDeliveryID"] == head.delivery_id and in_flight["k1"]["WaitingItems"] == 2
    assert list(await listed("Idle")) == ["k2"]

    assert await api.settle(head, "DeadLetter", reason="bad data") == "DeadLettered"
    blocked = await listed("Blocked")
    assert list(blocked) == ["k1"]
    assert blocked["k1"]["HeadDeliveryID"] == head.delivery_id
    assert (blocked["k1"]["HeadStatus"], blocked["k1"]["WaitingItems"]) == ("DeadLettered", 2)
    assert list(await listed("InFlight")) == []
    assert set(await listed()) == {"k1", "k2"}
    backlog = (await api.http.get(f"{PREFIX}/subscriptions/{sub}/backlog", headers=headers)).json()
    assert (backlog["Claimable"], backlog["InFlight"]) == (1, 0)  # k2 only: the blocked key has no head to claim
    bad = await api.http.get(f"{PREFIX}/subscriptions/{sub}/partitions?condition=Stuck", headers=headers)
    assert bad.status_code == 422

    # Replay with a note: same MessageID, same place in the key; the key resumes in order.
    response = await api.http.post(
        f"{PREFIX}/subscriptions/{sub}/deliveries/{head.delivery_id}/replay",
        headers=api.bearer(SCOPE_OPERATE), json={"note": "source data corrected"},
    )
    assert response.status_code == 200 and response.json()["Result"] == "Replayed"
    assert list(await listed("Blocked")) == []
    order = []
    while claimed := await api.queue.transport.claim(sub, 1):
        order.append(claimed[0].message_id)
        assert await api.settle(claimed[0], "Complete") == "Completed"
    k1 = [r.message_id for r in first[:3]]
    assert [m for m in order if m in k1] == k1
    info = await api.queue.get_delivery(head.delivery_id)
    assert info is not None and info.note == "source data corrected" and info.attempt == 1
    assert await listed() == {}


# -- operator actions ----------------------------------------------------------------------------


async def test_replay_with_note_and_discard_with_reason(api: Api) -> None:
    sub = api.subs["dl"]
    operate = api.bearer(SCOPE_OPERATE)
    read = api.bearer(SCOPE_READ)
    dead = await api.dead_letter()
    before = await api.queue.get_delivery(dead)
    assert before is not None

    url = f"{PREFIX}/subscriptions/{sub}/deliveries/{dead}"
    response = await api.http.post(f"{url}/replay", headers=operate, json={"Note": "deployed 1.2.4"})
    assert response.status_code == 200
    assert response.json() == {"Result": "Replayed", "DeliveryID": dead, "Subscription": sub,
                               "CancelRequested": False, "Status": "Pending"}
    info = (await api.http.get(url, headers=read)).json()
    assert (info["Status"], info["Note"], info["Attempt"]) == ("Pending", "deployed 1.2.4", 0)
    assert info["MessageID"] == str(before.message_id)

    again = await api.http.post(f"{url}/replay", headers=operate)
    assert again.status_code == 409 and again.json()["Result"] == "NotDeadLettered"

    response = await api.http.post(f"{url}/discard", headers=operate, json={"reason": "duplicate order"})
    assert response.status_code == 200 and response.json()["Result"] == "Discarded"
    info = (await api.http.get(url, headers=read)).json()
    assert (info["Status"], info["Reason"]) == ("Discarded", "duplicate order")
    again = await api.http.post(f"{url}/discard", headers=operate, json={"Reason": "twice"})
    assert again.status_code == 409 and again.json()["Result"] == "AlreadyTerminal"
    assert (await api.http.post(f"{url}/replay", headers=operate)).status_code == 409

    for missing in ("999999999", "not-a-number"):
        for action in ("replay", "discard"):
            response = await api.http.post(
                f"{PREFIX}/subscriptions/{sub}/deliveries/{missing}/{action}", headers=operate
            )
            assert response.status_code == 404, (missing, action)
    # A delivery of another subscription is not found under this one.
    other = await api.http.post(f"{PREFIX}/subscriptions/{api.subs['plain']}/deliveries/{dead}/discard",
                                headers=operate)
    assert other.status_code == 404


async def test_pause_and_resume(api: Api) -> None:
    sub = api.subs["excl"]
    operate, read = api.bearer(SCOPE_OPERATE), api.bearer(SCOPE_READ)
    await api.publish("excl", PublishRequest(payload="while paused"))
    response = await api.http.post(f"{PREFIX}/subscriptions/{sub}/pause", headers=operate)
    assert response.json() == {"Subscription": sub, "Status": "Paused", "Changed": True}
    response = await api.http.post(f"{PREFIX}/subscriptions/{sub}/pause", headers=operate)
    assert response.json()["Changed"] is False
    [stats] = (await api.http.get(f"{PREFIX}/stats", params={"subscription": sub}, headers=read)).json()
    assert stats["Status"] == "Paused" and stats["Pending"] >= 1
    backlog = (await api.http.get(f"{PREFIX}/subscriptions/{sub}/backlog", headers=read)).json()
    assert backlog["Claimable"] == 0
    assert await api.queue.transport.claim(sub, 10) == []

    response = await api.http.post(f"{PREFIX}/subscriptions/{sub}/resume", headers=operate)
    assert response.json() == {"Subscription": sub, "Status": "Active", "Changed": True}
    backlog = (await api.http.get(f"{PREFIX}/subscriptions/{sub}/backlog", headers=read)).json()
    assert backlog["Claimable"] >= 1
    for claimed in await api.queue.transport.claim(sub, 100):
        await api.settle(claimed, "Complete")


async def test_discard_of_a_running_delivery_cancels_the_handler(api: Api) -> None:
    sub = api.subs["slow"]
    response = await api.http.post(
        f"{PREFIX}/topics/{api.topics['slow']}/messages", headers=api.bearer(SCOPE_PUBLISH), json=[{"Payload": 1}]
    )
    [published] = response.json()
    await asyncio.wait_for(api.started.wait(), 10)
    read = api.bearer(SCOPE_READ)
    [running] = (await api.http.get(f"{PREFIX}/subscriptions/{sub}/deliveries?status=InFlight", headers=read)).json()
    assert running["MessageID"] == published["MessageID"]

    url = f"{PREFIX}/subscriptions/{sub}/deliveries/{running['DeliveryID']}"
    response = await api.http.post(f"{url}/discard", headers=api.bearer(SCOPE_OPERATE),
                                   json={"Reason": "operator: hung"})
    assert response.status_code == 200
    assert response.json()["Result"] == "CancelRequested" and response.json()["CancelRequested"] is True

    async def discarded() -> dict[str, Any] | None:
        info = (await api.http.get(url, headers=read)).json()
        return info if info["Status"] == "Discarded" else None

    watch = ClaimWatch(api.queue.transport)
    info = await wait_for(discarded, within=10)
    assert api.reasons == [AbortReason.CANCELLED]
    assert info["Reason"] == "operator: hung"
    # Never retried: a claim of the subscription made after the discard finds nothing.
    watch.answers.clear()
    await watch.empty_claim(sub)
    assert api.reasons == [AbortReason.CANCELLED]
    assert (await api.queue.stats(sub))[0].pending == 0


async def test_a_503_while_checking_a_key_carries_no_driver_text(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The store goes away (connections refused for maintenance) while an unauthenticated caller
    sends a key: a generic 503 with Retry-After; the driver's text goes to the log only."""
    import asyncpg

    from .conftest import drop_database, recreate_database

    url = pg_url.rsplit("/", 1)[0] + "/" + unique("wq_away").replace("-", "_")
    name = url.rsplit("/", 1)[1]
    await recreate_database(url)
    queue = WorkQueue(WorkQueueSettings(database_url=url, enabled=False, auto_migrate=True, **FAST))
    app = FastAPI()
    app.include_router(queue.router)
    admin = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://").rsplit("/", 1)[0]
                                  + "/postgres")
    try:
        async with queue.lifespan(app), client(app) as http:
            key = (await create_key(queue.transport, "reader", [SCOPE_READ])).key
            assert (await http.get(f"{PREFIX}/stats", headers={"X-API-Key": key})).status_code == 200
            await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", name
            )
            with caplog.at_level("WARNING", logger="fastapi_workqueue.web"):
                response = await http.get(f"{PREFIX}/stats", headers={"X-API-Key": key})
            await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        assert response.json() == {
            "detail": "cannot check the API key now: the queue's store is unavailable; retry later"
        }
        [logged] = [r.getMessage() for r in caplog.records if "cannot check an API key" in r.getMessage()]
        assert name in logged or "accepting connections" in logged or "terminat" in logged, logged
    finally:
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await admin.close()
        await drop_database(url)


# -- which topics a key reaches: job queues, topic lists --------------------------------------------


async def test_job_topics_need_the_jobs_scope_and_keys_may_be_limited_to_topics(database_url: str) -> None:
    """A publish key cannot post a job envelope (any job, any payload, a chain of further jobs) to a
    job queue's topic: that needs workqueue:jobs. A key made with a topic list reaches those topics
    only; a key made without one (as every key before) reaches every other topic as before."""
    job_queue = f"rest-jobs-{uuid.uuid4().hex[:8]}"
    orders, billing, other = unique("orders"), unique("billing.in"), unique("other")
    queue = WorkQueue(
        WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[], job_queues=job_queue,
                          **FAST),
        topics=[Topic(name=t) for t in (orders, billing, other)],
    )
    ran: list[Any] = []

    @queue.job(f"probe-{job_queue}", queue=job_queue)
    async def probe(payload: dict[str, Any]) -> None:
        ran.append(payload)

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.router)
    topic = f"jobs.{job_queue}"
    envelope = {"v": 1, "job": f"probe-{job_queue}", "payload": {"by": "rest"},
                "chain": [{"job": f"probe-{job_queue}", "id": str(uuid.uuid4()), "queue": job_queue, "tries": 1,
                           "payload": {"by": "chain"}}]}
    body = [{"Payload": envelope, "Attributes": {"job": f"probe-{job_queue}"}}]
    async with queue.lifespan(app), client(app) as http:
        store: Any = queue.transport

        async def make(*scopes: str, topics: list[str] | None = None) -> dict[str, str]:
            return {"X-API-Key": (await create_key(store, unique("key"), list(scopes), topics=topics)).key}

        publisher = await make(SCOPE_PUBLISH)
        runner = await make(SCOPE_PUBLISH, SCOPE_JOBS)
        jobs_only = await make(SCOPE_JOBS)
        limited = await make(SCOPE_PUBLISH, topics=[orders, "billing.*"])

        refused = await http.post(f"{PREFIX}/topics/{topic}/messages", json=body, headers=publisher)
        assert refused.status_code == 403, refused.text
        assert "workqueue:jobs" in refused.json()["detail"] and topic in refused.json()["detail"]
        assert await queue.size(job_queue) == 0  # nothing was published
        lacking = await http.post(f"{PREFIX}/topics/{topic}/messages", json=body, headers=jobs_only)
        assert lacking.status_code == 403 and "workqueue:publish" in lacking.json()["detail"]

        # The key that predates topic lists (none given) publishes to ordinary topics as before.
        assert (await http.post(f"{PREFIX}/topics/{other}/messages", json=[{"Payload": 1}],
                                headers=publisher)).status_code == 200

        assert (await http.post(f"{PREFIX}/topics/{orders}/messages", json=[{"Payload": 1}],
                                headers=limited)).status_code == 200
        assert (await http.post(f"{PREFIX}/topics/{billing}/messages", json=[{"Payload": 1}],
                                headers=limited)).status_code == 200
        outside = await http.post(f"{PREFIX}/topics/{other}/messages", json=[{"Payload": 1}], headers=limited)
        assert outside.status_code == 403 and other in outside.json()["detail"]
        assert orders in outside.json()["detail"] and "billing.*" in outside.json()["detail"]

        # workqueue:jobs is the explicit grant: the job and its chain run.
        allowed = await http.post(f"{PREFIX}/topics/{topic}/messages", json=body, headers=runner)
        assert allowed.status_code == 200, allowed.text
        await wait_for(lambda: len(ran) == 2, within=30)
        assert ran == [{"by": "rest"}, {"by": "chain"}]


async def test_a_store_that_is_gone_answers_503_to_a_caller_not_yet_authenticated(pg_url: str) -> None:
    """The database is dropped under the running app (a restore, a wrong failover): the key check
    answers 503 with Retry-After and a generic detail (it answered 500), never the driver's text
    with the database's name."""
    import asyncpg

    from .conftest import drop_database, recreate_database

    url = pg_url.rsplit("/", 1)[0] + "/" + unique("wq_gone").replace("-", "_")
    name = url.rsplit("/", 1)[1]
    await recreate_database(url)
    queue = WorkQueue(WorkQueueSettings(database_url=url, enabled=False, auto_migrate=True, **FAST))
    app = FastAPI()
    app.include_router(queue.router)
    try:
        async with queue.lifespan(app), client(app) as http:
            key = (await create_key(queue.transport, "reader", [SCOPE_READ])).key
            assert (await http.get(f"{PREFIX}/stats", headers={"X-API-Key": key})).status_code == 200
            admin = await asyncpg.connect(pg_url.replace("postgresql+asyncpg://", "postgresql://").rsplit("/", 1)[0]
                                          + "/postgres")
            try:
                await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            finally:
                await admin.close()
            response = await http.get(f"{PREFIX}/stats", headers={"X-API-Key": key})
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1" and name not in response.text
        assert response.json() == {
            "detail": "cannot check the API key now: the queue's store is unavailable; retry later"
        }
    finally:
        await drop_database(url)


# -- another authorizer, and the schema ----------------------------------------------------------


async def test_a_custom_authorize_dependency_replaces_api_keys(api: Api) -> None:
    users = {"alice": frozenset({SCOPE_READ}), "bob": frozenset({SCOPE_READ, SCOPE_OPERATE})}

    async def by_user_header(request: Request, security_scopes: SecurityScopes) -> Principal:
        user = request.headers.get("x-user")
        if user not in users:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail="who are you?")
        return require_scopes(Principal(name=user, scopes=users[user]), security_scopes)

    custom = FastAPI()
    custom.include_router(api.queue.create_router(authorize=by_user_header, prefix="/ops"))
    sub = api.subs["excl"]
    async with client(custom) as http:
        assert (await http.get("/ops/stats", headers=api.bearer("all"))).status_code == 401  # keys mean nothing here
        assert (await http.get("/ops/stats", headers={"X-User": "mallory"})).status_code == 401
        assert (await http.get("/ops/stats", headers={"X-User": "alice"})).status_code == 200
        assert (await http.post(f"/ops/subscriptions/{sub}/pause", headers={"X-User": "alice"})).status_code == 403
        assert (await http.post(f"/ops/subscriptions/{sub}/pause", headers={"X-User": "bob"})).status_code == 200
        assert (await http.post(f"/ops/subscriptions/{sub}/resume", headers={"X-User": "bob"})).status_code == 200
        schema = (await http.get("/openapi.json")).json()
    assert "/ops/stats" in schema["paths"]


async def test_a_cookie_authorize_is_not_open_to_another_sites_forms(api: Api) -> None:
    """With an ``authorize`` that reads a session cookie, a page of another site that makes the
    browser post a form (or a fetch without headers of its own) cannot change the queue; the app's
    own pages, clients that are not browsers, and requests a browser preflights can."""

    async def by_session(request: Request, security_scopes: SecurityScopes) -> Principal:
        if request.cookies.get("session") != "staff-session":
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail="sign in")
        return require_scopes(Principal(name="staff", scopes=frozenset({SCOPE_READ, SCOPE_OPERATE})), security_scopes)

    custom = FastAPI()
    custom.include_router(api.queue.create_router(authorize=by_session, prefix="/ops"))
    sub = api.subs["excl"]

    async def status_of() -> str:
        [stats] = await api.queue.stats(sub)
        return stats.status

    form = {"content-type": "application/x-www-form-urlencoded"}
    async with client(custom) as http:
        http.cookies.set("session", "staff-session")
        for sent_from in ({"sec-fetch-site": "cross-site", "origin": "https://evil.example"},
                          {"sec-fetch-site": "same-site", "origin": "https://evil.t"},
                          {"origin": "https://evil.example"}, {"origin": "null"}):
            for route in ("pause", "retire"):
                refused = await http.post(f"/ops/subscriptions/{sub}/{route}", headers={**sent_from, **form},
                                          content=b"")
                assert refused.status_code == 403, (sent_from, refused.text)
                assert "cross-site request forgery" in refused.json()["detail"]
            assert (await http.post(f"/ops/subscriptions/{sub}/pause", headers=sent_from)).status_code == 403
            assert await status_of() == "Active"
        # Reading is not refused: another site's page cannot read the answer.
        assert (await http.get("/ops/stats", headers={"sec-fetch-site": "cross-site"})).status_code == 200
        # The app's own page, and a client that is not a browser.
        own = await http.post(f"/ops/subscriptions/{sub}/pause", headers={"sec-fetch-site": "same-origin", **form})
        assert own.status_code == 200 and await status_of() == "Paused"
        assert (await http.post(f"/ops/subscriptions/{sub}/resume")).status_code == 200
        # A request a browser sends across sites only after the app's CORS answered its preflight.
        preflighted = await http.post(f"/ops/subscriptions/{sub}/pause", json={},
                                      headers={"sec-fetch-site": "cross-site", "origin": "https://partner.example"})
        assert preflighted.status_code == 200
        assert (await http.post(f"/ops/subscriptions/{sub}/resume")).status_code == 200
    # With API keys (the default router) a key in a header is what a form cannot send.
    key = api.keys["all"]
    across = await api.http.post(f"{PREFIX}/subscriptions/{sub}/pause", headers={
        "X-API-Key": key, "sec-fetch-site": "cross-site", **form})
    assert across.status_code == 200
    assert (await api.http.post(f"{PREFIX}/subscriptions/{sub}/resume", headers={"X-API-Key": key})).status_code == 200


async def test_every_route_is_in_the_openapi_schema_with_its_security_scheme(api: Api) -> None:
    schema = (await api.http.get("/openapi.json")).json()
    schemes = schema["components"]["securitySchemes"]
    assert schemes["HTTPBearer"]["scheme"] == "bearer"
    assert schemes["APIKeyHeader"] == {**schemes["APIKeyHeader"], "type": "apiKey", "in": "header", "name": "X-API-Key"}
    for endpoint in ENDPOINTS:
        operation = schema["paths"][PREFIX + endpoint.route][endpoint.method.lower()]
        names = {name for requirement in operation["security"] for name in requirement}
        assert names == {"HTTPBearer", "APIKeyHeader"}, endpoint.name
        assert operation["summary"] and {"200", "401", "403", "503"} <= set(operation["responses"]), endpoint.name
        assert operation["x-required-scopes"] == [endpoint.scope], endpoint.name
        assert f"Requires the scope `{endpoint.scope}`" in operation["description"], endpoint.name
        if "{subscription}" in endpoint.route or "{topic}" in endpoint.route:
            assert "404" in operation["responses"], endpoint.name
        if endpoint.name in ("replay", "discard"):
            assert "ActionResult" in json.dumps(operation["responses"]["409"]), endpoint.name
        if "requestBody" in operation:  # (read before the key is checked: unreadable or too large)
            assert {"400", "413"} <= set(operation["responses"]), endpoint.name
    publish = schema["paths"][f"{PREFIX}/topics/{{topic}}/messages"]["post"]
    assert {"404", "409", "413", "422"} <= set(publish["responses"])
    assert publish["requestBody"]["content"]["application/json"]["schema"]["type"] == "array"
    assert "PublishRequest" in json.dumps(publish["requestBody"])
