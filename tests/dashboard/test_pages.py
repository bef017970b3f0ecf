"""The dashboard over HTTP: a real app with the queue on the test PostgreSQL database, its
lifespan running, requests through httpx's ASGI transport. Sign-in, sessions, scopes, CSRF, every
page and every action; the deliveries a case inspects belong to a subscription no host runs, so
their states are what the case made them."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import HTTPException, Request
from fastapi.security import SecurityScopes

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.errors import ConfigurationError
from fastapi_workqueue.core.keys import SCOPE_ADMIN, SCOPE_OPERATE, SCOPE_READ, Principal, create_key, hash_key
from fastapi_workqueue.core.processes import current_process
from fastapi_workqueue.core.transport import Settlement
from fastapi_workqueue.dashboard import views
from fastapi_workqueue.dashboard.session import MAX_SESSION_SECONDS, SESSION_COOKIE, SessionCodec, session_key
from fastapi_workqueue.web.auth import require_scopes

from ..conftest import unique
from .shop import SECRET, Shop

pytestmark = pytest.mark.timeout(60)

UI = "/work-queue/ui"
EVERYTHING = [SCOPE_READ, SCOPE_OPERATE, SCOPE_ADMIN]


@pytest.fixture
async def shop(pg_url: str) -> AsyncIterator[Shop]:
    shop = Shop(pg_url)
    async with shop.queue.lifespan(shop.app):
        yield shop
        shop.release.set()


def client_for(shop: Shop) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=shop.app), base_url="http://dashboard.test")


def token_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "the page has no form token"
    return found.group(1)


async def sign_in(client: httpx.AsyncClient, key: str) -> httpx.Response:
    page = await client.get(f"{UI}/sign-in")
    return await client.post(f"{UI}/sign-in", data={"csrf": token_of(page.text), "api_key": key, "next": f"{UI}/"})


async def post(client: httpx.AsyncClient, page_path: str, action: str, **fields: str) -> httpx.Response:
    """Sends a form of ``page_path`` as a browser would: with the page's token."""
    page = await client.get(page_path)
    assert page.status_code == 200, page.text
    return await client.post(action, data={"csrf": token_of(page.text), **fields})


async def key(shop: Shop, *scopes: str) -> str:
    return (await create_key(shop.queue.transport, f"person-{time.monotonic_ns()}", list(scopes))).key


async def dead_letters_on_idle(shop: Shop, count: int, *, error: str = "boom") -> list[str]:
    """``count`` dead letters on the subscription no host runs (claimed and settled here)."""
    transport = shop.queue.transport
    await shop.queue.resume(shop.idle)
    try:
        await transport.publish(shop.topic, [prepare(PublishRequest(payload={"n": i})) for i in range(count)])
        ids: list[str] = []
        while len(ids) < count:
            claimed = await transport.claim(shop.idle, 100)
            assert claimed
            await transport.settle([Settlement(c.delivery_id, c.lease_token, "DeadLetter", reason="refused",
                                               error=error) for c in claimed])
            ids += [c.delivery_id for c in claimed]
    finally:
        await shop.queue.pause(shop.idle)
    # The publish also reached the host's subscriptions; they are not looked at here.
    return ids


async def test_signing_in_keeps_a_signed_httponly_samesite_cookie(shop: Shop) -> None:
    async with client_for(shop) as client:
        first = await client.get(f"{UI}/")
        assert first.status_code == 303 and first.headers["location"] == f"{UI}/sign-in?next=%2Fwork-queue%2Fui%2F"

        refused = await sign_in(client, "wq_0123456789ab_not-a-real-secret")
        assert refused.status_code == 401 and "not valid" in refused.text
        assert SESSION_COOKIE not in client.cookies

        publisher = await key(shop, "workqueue:publish")
        lacking = await sign_in(client, publisher)
        assert lacking.status_code == 403 and "lacks the scope workqueue:read" in lacking.text

        reader = await key(shop, SCOPE_READ)
        answer = await sign_in(client, reader)
        assert answer.status_code == 303 and answer.headers["location"] == f"{UI}/"
        cookie = next(c for c in answer.headers.get_list("set-cookie") if c.startswith(SESSION_COOKIE))
        assert "HttpOnly" in cookie and "SameSite=lax" in cookie and f"Path={UI}" in cookie
        value = client.cookies[SESSION_COOKIE]
        secret = reader.split("_", 2)[2]  # token_urlsafe: it may hold (or start with) "_" itself
        assert secret not in value and value.count(".") == 3  # prefix.generation.expiry.signature
        overview = await client.get(f"{UI}/")
        assert overview.status_code == 200
        assert shop.mail in overview.text and shop.ledger in overview.text and shop.idle in overview.text


async def test_signing_out_ends_the_session_on_the_server(shop: Shop) -> None:
    """The cookie of a signed-out session no longer works, wherever it was copied: so does every
    other session of the key made before (a second browser), while the key signs in again."""
    reader = await key(shop, SCOPE_READ)
    async with client_for(shop) as client, client_for(shop) as other:
        await sign_in(client, reader)
        await sign_in(other, reader)
        value = client.cookies[SESSION_COOKIE]
        assert (await other.get(f"{UI}/")).status_code == 200

        out = await post(client, f"{UI}/", f"{UI}/sign-out")
        assert out.status_code == 303 and out.headers["location"] == f"{UI}/sign-in"
        assert (await client.get(f"{UI}/")).status_code == 303
        client.cookies.set(SESSION_COOKIE, value, domain="dashboard.test", path=UI)  # the copied cookie
        assert (await client.get(f"{UI}/")).status_code == 303
        assert (await other.get(f"{UI}/")).status_code == 303

        assert (await sign_in(client, reader)).status_code == 303
        assert (await client.get(f"{UI}/")).status_code == 200


async def test_a_session_ends_when_forged_expired_or_its_key_is_revoked(shop: Shop) -> None:
    async with client_for(shop) as client:
        secret = await key(shop, SCOPE_READ)
        await sign_in(client, secret)
        value = client.cookies[SESSION_COOKIE]
        prefix, generation, expires, signature = value.split(".")
        assert (await client.get(f"{UI}/")).status_code == 200

        keys = shop.queue.ports.api_keys
        assert keys is not None
        record = await keys.api_key_session(prefix)
        assert record is not None
        # Signed as the app signs, but claiming to last ten years: refused, whatever its signature.
        ten_years = SessionCodec(key=session_key(SECRET, shop.queue.settings), max_age=MAX_SESSION_SECONDS).issue(
            record, prefix, now=time.time() + 10 * 365 * 86400)
        # Signed with what a copy of the database holds (the key's stored hash) instead of the secret.
        stored_hash = hash_key(secret)
        from_the_database = SessionCodec(key=session_key(stored_hash, shop.queue.settings)).issue(record, prefix)
        for forged in (f"{prefix}.{generation}.{int(expires) + 3600}.{signature}",
                       f"{prefix}.{int(generation) + 1}.{expires}.{signature}",
                       f"{prefix}.{generation}.{expires}.{signature[:-2]}xx",
                       f"{prefix}.{generation}.{int(time.time()) - 1}.{signature}", "garbage",
                       f"{prefix}.{generation}.{expires}", f"{prefix}.{expires}.{signature}", ten_years,
                       from_the_database):
            client.cookies.set(SESSION_COOKIE, forged, domain="dashboard.test", path=UI)
            assert (await client.get(f"{UI}/")).status_code == 303, forged

        client.cookies.set(SESSION_COOKIE, value, domain="dashboard.test", path=UI)
        assert (await client.get(f"{UI}/")).status_code == 200
        await keys.api_key_revoke(secret.split("_")[1])
        assert (await client.get(f"{UI}/")).status_code == 303


async def test_the_pages_show_counts_dead_letters_in_flight_blocked_keys_and_a_delivery_whole(shop: Shop) -> None:
    traceback = ('Traceback (most recent call last):\n  File "mail.py", line 3, in send\n'
                 "ConnectionError: the relay answered 554 password=hunter2\n")
    [dead] = await dead_letters_on_idle(shop, 1, error=traceback)
    await shop.queue.publish(shop.topic, [{"payload": {"hold": True}, "PartitionKey": "acct-7",
                                           "Attributes": {"kind": "invoice"}}])
    await shop.queue.publish(shop.topic, [{"payload": {}, "PartitionKey": "acct-7"}])  # waits behind it on ledger
    await shop.queue.publish(shop.topic, [{"payload": {"fail": True}, "PartitionKey": "acct-9"},
                                          {"payload": {}, "PartitionKey": "acct-9"}])
    running = await views_wait_in_flight(shop)

    async with client_for(shop) as client:
        await sign_in(client, await key(shop, SCOPE_READ))
        overview = (await client.get(f"{UI}/")).text
        row = re.search(rf'<tr data-subscription="{re.escape(shop.idle)}">(.*?)</tr>', overview, re.S)
        # The four messages published since accrue on the paused subscription.
        assert row and "Paused" in row.group(1) and re.findall(r'class="num[^"]*">([^<]*)<', row.group(1))[:3] == [
            "4", "0", "1"]
        assert '<svg class="chart"' in overview

        page = (await client.get(f"{UI}/subscriptions/{shop.idle}")).text
        assert f'data-delivery="{dead}"' in page
        assert "ConnectionError: the relay answered 554 password=***" in page  # the last line, redacted
        assert "hunter2" not in page
        assert "Replay" not in page and "/replay" not in page  # a reader gets no actions

        mail = (await client.get(f"{UI}/subscriptions/{shop.mail}")).text
        assert f'data-delivery="{running}"' in mail and "rendering the invoice" in mail
        # The in-flight row names the process that holds it: this one (the app's own host).
        me = current_process()
        held = re.search(rf'<tr data-delivery="{running}">.*?<td class="holder">(.*?)</td>', mail, re.S)
        assert held and f"{me.hostname} pid {me.pid}" in held.group(1) and str(me.id) in held.group(1)
        assert 'progress max="100" value="40"' in mail

        ledger = (await client.get(f"{UI}/subscriptions/{shop.ledger}")).text
        blocked = re.search(r'<tr data-key="acct-9">(.*?)</tr>', ledger, re.S)
        assert blocked and "DeadLettered" in blocked.group(1) and "the ledger refused the entry" in blocked.group(1)

        one = await client.get(f"{UI}/deliveries/{dead}")
        assert one.status_code == 200 and "Traceback (most recent call last)" in one.text
        assert "Shown to keys that also hold" in one.text and '"n": 0' not in one.text
        assert (await client.get(f"{UI}/deliveries/999999999")).status_code == 404
        assert (await client.get(f"{UI}/subscriptions/no-such-thing")).status_code == 404
        assert (await client.get(f"{UI}/subscriptions/{shop.idle}?after=x")).status_code == 400

    async with client_for(shop) as admin:
        await sign_in(admin, await key(shop, SCOPE_READ, SCOPE_ADMIN))
        whole = (await admin.get(f"{UI}/deliveries/{dead}")).text
        assert '<pre class="payload">{\n  &#34;n&#34;: 0\n}</pre>' in whole


async def views_wait_in_flight(shop: Shop) -> str:
    from .shop import wait_until

    async def held() -> str | None:
        running = await shop.queue.deliveries(shop.mail, "InFlight")
        return running[0].delivery_id if running and running[0].progress_percent == 40 else None

    result: str = await wait_until(held)
    return result


async def test_operators_replay_discard_cancel_pause_and_resume(shop: Shop) -> None:
    first, second = await dead_letters_on_idle(shop, 2)
    async with client_for(shop) as client:
        await sign_in(client, await key(shop, SCOPE_READ, SCOPE_OPERATE))
        sub_page = f"{UI}/subscriptions/{shop.idle}"

        answer = await post(client, sub_page, f"{UI}/deliveries/{first}/replay", back=sub_page, note="fixed the relay")
        assert answer.status_code == 303 and answer.headers["location"] == f"{sub_page}?notice=Replayed"
        replayed = await shop.queue.get_delivery(first)
        assert replayed is not None and replayed.status == "Pending" and replayed.note == "fixed the relay"
        assert "Replayed: the delivery was queued again with its attempts reset" in (
            await client.get(answer.headers["location"])).text

        again = await post(client, sub_page, f"{UI}/deliveries/{first}/replay")
        assert again.headers["location"].endswith("notice=NotDeadLettered")

        await post(client, sub_page, f"{UI}/deliveries/{second}/discard", reason="duplicate order")
        dropped = await shop.queue.get_delivery(second)
        assert dropped is not None and dropped.status == "Discarded" and dropped.reason == "duplicate order"

        # A cancel applies only while the delivery runs.
        refused = await post(client, sub_page, f"{UI}/deliveries/{first}/cancel")
        assert refused.headers["location"].endswith("notice=NotRunning")
        waiting = await shop.queue.get_delivery(first)
        assert waiting is not None and waiting.status == "Pending"
        await shop.queue.publish(shop.topic, [{"payload": {"hold": True}}])
        running = await views_wait_in_flight(shop)
        cancelled = await post(client, f"{UI}/deliveries/{running}", f"{UI}/deliveries/{running}/cancel")
        assert cancelled.headers["location"] == f"{UI}/deliveries/{running}?notice=CancelRequested"
        asked = await shop.queue.get_delivery(running)
        assert asked is not None and asked.cancel_requested

        paused = await post(client, f"{UI}/subscriptions/{shop.mail}", f"{UI}/subscriptions/{shop.mail}/pause")
        assert paused.headers["location"] == f"{UI}/subscriptions/{shop.mail}?notice=Paused"
        assert {s.name: s.status for s in await shop.queue.transport.list_subscriptions()}[shop.mail] == "Paused"
        resumed = await post(client, f"{UI}/subscriptions/{shop.mail}", f"{UI}/subscriptions/{shop.mail}/resume")
        assert resumed.headers["location"].endswith("notice=Resumed")
        assert {s.name: s.status for s in await shop.queue.transport.list_subscriptions()}[shop.mail] == "Active"

        # The form may send the browser back only within the dashboard.
        elsewhere = await post(client, sub_page, f"{UI}/subscriptions/{shop.idle}/pause", back="https://evil.example/")
        assert elsewhere.headers["location"] == f"{sub_page}?notice=Unchanged"


async def test_a_replayed_delivery_that_completed_shows_its_old_error_as_a_past_attempt(shop: Shop) -> None:
    from .shop import wait_until

    [result] = await shop.queue.publish(shop.topic, [{"payload": {"fail": "once", "to": "ann@example.com"}}])
    message_id = result.message_id
    assert message_id is not None

    async def mail_delivery(status: str) -> str | None:
        deliveries = await shop.queue.transport.message_deliveries(message_id)
        [info] = [d for d in deliveries if d.subscription == shop.mail]
        return info.delivery_id if info.status == status else None

    dead = await wait_until(lambda: mail_delivery("DeadLettered"))
    async with client_for(shop) as client:
        await sign_in(client, await key(shop, SCOPE_READ, SCOPE_OPERATE))
        page = f"{UI}/deliveries/{dead}"
        before = (await client.get(page)).text
        assert "<h2>Last error</h2>" in before and "the mail server refused ann@example.com" in before
        answer = await post(client, page, f"{page}/replay", back=page, note="address fixed")
        assert answer.headers["location"] == f"{page}?notice=Replayed"
        await wait_until(lambda: mail_delivery("Completed"))
        after = (await client.get(answer.headers["location"])).text
    assert 'status-completed">Completed' in after
    # The error belongs to the attempt before the replay, not to the Completed state.
    assert "<h2>Last error</h2>" not in after
    assert "<h2>Error of an earlier attempt</h2>" in after and "(replayed since)" in after
    assert "the mail server refused ann@example.com" in after
    assert "is Pending again" not in after
    # The attempts in order: the failure (dead-lettered), the replay with its note, then now.
    history = after[after.index('<h2 id="attempts">'):after.index("<h2>Payload</h2>")]
    rows = [history.index(f'class="attempt attempt-{kind}"') for kind in ("deadlettered", "replayed", "now")]
    assert rows == sorted(rows)
    assert "address fixed" in history and "the mail server refused ann@example.com" in history
    me = current_process()
    assert f"Last held by</dt><dd class=\"holder\"><a href=\"{UI}/processes#process-{me.id}\"" in after
    assert f"{me.hostname} pid {me.pid}" in after


async def test_a_read_only_key_is_refused_every_action(shop: Shop) -> None:
    [dead] = await dead_letters_on_idle(shop, 1)
    async with client_for(shop) as client:
        await sign_in(client, await key(shop, SCOPE_READ, SCOPE_ADMIN))
        page = f"{UI}/deliveries/{dead}"
        for action in ("replay", "discard", "cancel"):
            answer = await post(client, page, f"{page}/{action}")
            assert answer.status_code == 403 and "lacks the scope workqueue:operate" in answer.text
        for action in ("pause", "resume", "replay-all"):
            answer = await post(client, page, f"{UI}/subscriptions/{shop.idle}/{action}", confirm="yes")
            assert answer.status_code == 403
        assert (await client.get(f"{UI}/subscriptions/{shop.idle}/replay-all")).status_code == 403
    info = await shop.queue.get_delivery(dead)
    assert info is not None and info.status == "DeadLettered"


async def test_forms_without_their_token_or_from_another_site_are_refused(shop: Shop) -> None:
    [dead] = await dead_letters_on_idle(shop, 1)
    async with client_for(shop) as client:
        await sign_in(client, await key(shop, *EVERYTHING))
        token = token_of((await client.get(f"{UI}/")).text)
        replay = f"{UI}/deliveries/{dead}/replay"
        for fields, headers in (
            ({"note": "no token"}, {}),
            ({"csrf": "x" * 43}, {}),
            ({"csrf": token}, {"origin": "https://evil.example"}),
            ({"csrf": token}, {"sec-fetch-site": "cross-site"}),
        ):
            answer = await client.post(replay, data=fields, headers=headers)
            assert answer.status_code == 403 and "The form was refused" in answer.text, (fields, headers)
        assert (await client.post(replay, content=b'{"csrf": 1}', headers={"content-type": "application/json"})
                ).status_code == 400
        info = await shop.queue.get_delivery(dead)
        assert info is not None and info.status == "DeadLettered"
        ok = await client.post(replay, data={"csrf": token}, headers={"origin": "http://dashboard.test"})
        assert ok.status_code == 303


async def test_bulk_replay_asks_first_and_replays_in_bounded_batches(
    shop: Shop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(views, "BULK_BATCH", 10)
    monkeypatch.setattr(views, "BULK_BATCHES", 3)
    ids = await dead_letters_on_idle(shop, 35)
    async with client_for(shop) as client:
        await sign_in(client, await key(shop, SCOPE_READ, SCOPE_OPERATE))
        confirm_page = f"{UI}/subscriptions/{shop.idle}/replay-all"
        confirm = await client.get(confirm_page)
        assert confirm.status_code == 200 and "<strong>35</strong> dead letters" in confirm.text
        assert "batches of 10, at most 30 at a time" in confirm.text

        # Without the confirmation nothing happens.
        unconfirmed = await post(client, confirm_page, confirm_page)
        assert unconfirmed.status_code == 303 and unconfirmed.headers["location"] == confirm_page
        assert len(await shop.queue.dead_letters(shop.idle, limit=100)) == 35

        first = await post(client, confirm_page, confirm_page, confirm="yes", note="relay fixed")
        assert first.headers["location"] == f"{UI}/subscriptions/{shop.idle}?notice=ReplayedAll&n=30"
        assert [d.delivery_id for d in await shop.queue.dead_letters(shop.idle, limit=100)] == ids[30:]
        second = await post(client, confirm_page, confirm_page, confirm="yes")
        assert second.headers["location"].endswith("notice=ReplayedAll&n=5")
        assert await shop.queue.dead_letters(shop.idle, limit=100) == []
        pending = await shop.queue.deliveries(shop.idle, "Pending", limit=100)
        assert {d.delivery_id for d in pending} == set(ids)
        assert {d.note for d in pending if d.delivery_id in ids[:30]} == {"relay fixed"}


async def test_the_app_may_pass_its_own_authorize_dependency(pg_url: str) -> None:
    async def staff(request: Request, security_scopes: SecurityScopes) -> Principal:
        user = request.headers.get("x-staff")
        if user is None:
            raise HTTPException(401, detail="sign in to the shop first")
        scopes = {"reader": {SCOPE_READ}, "ops": {SCOPE_READ, SCOPE_OPERATE}}[user]
        return require_scopes(Principal(name=user, scopes=frozenset(scopes)), security_scopes)

    shop = Shop(pg_url, authorize=staff)
    async with shop.queue.lifespan(shop.app), client_for(shop) as client:
        anonymous = await client.get(f"{UI}/")
        assert anonymous.status_code == 401 and "sign in to the shop first" in anonymous.text
        assert (await client.get(f"{UI}/sign-in")).status_code == 404
        reader = await client.get(f"{UI}/", headers={"x-staff": "reader"})
        assert reader.status_code == 200 and "Sign out" not in reader.text and shop.mail in reader.text
        [dead] = await dead_letters_on_idle(shop, 1)
        page = await client.get(f"{UI}/deliveries/{dead}", headers={"x-staff": "reader"})
        assert page.status_code == 200 and "/replay" not in page.text
        token = client.cookies["workqueue_csrf"]  # the overview, without forms, set it too
        refused = await client.post(f"{UI}/deliveries/{dead}/replay", headers={"x-staff": "reader"},
                                    data={"csrf": token})
        assert refused.status_code == 403
        done = await client.post(f"{UI}/deliveries/{dead}/replay", headers={"x-staff": "ops"},
                                 data={"csrf": token})
        assert done.status_code == 303
        info = await shop.queue.get_delivery(dead)
        assert info is not None and info.status == "Pending" and info.note == "replayed by ops from the dashboard"


async def test_answers_carry_strict_security_headers(shop: Shop) -> None:
    async with client_for(shop) as client:
        page = await client.get(f"{UI}/sign-in")
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe" not in policy
        assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"
        assert "<script>" not in page.text and " style=" not in page.text  # nothing inline for the policy to refuse
        script = await client.get(f"{UI}/static/dashboard.js")
        assert script.status_code == 200 and "DOMParser" in script.text
        assert (await client.get(f"{UI}/static/dashboard.css")).status_code == 200

        # Sign-in sends the browser back only within the dashboard.
        await client.get(f"{UI}/sign-in")
        token = client.cookies["workqueue_csrf"]
        answer = await client.post(f"{UI}/sign-in", data={"csrf": token, "api_key": await key(shop, SCOPE_READ),
                                                          "next": "https://evil.example/"})
        assert answer.status_code == 303 and answer.headers["location"] == f"{UI}/"


LEAVING = ("/work-queue/ui/../../x", "/work-queue/ui/%2e%2e/%2E%2E/x", "/work-queue/ui/./../x",
           "/work-queue/ui/deliveries/..%2f..%2f..%2fx", "/work-queue/ui/%2f%2fevil.example/", "//evil.example/x",
           "/work-queue/ui\\..\\..\\x", "/work-queue/uix")


async def test_forms_send_the_browser_back_only_inside_the_dashboard(shop: Shop) -> None:
    """``next=`` and ``back=`` are followed only to paths that stay in the dashboard once the
    browser normalises them; anything else falls back to the overview (or the form's own page)."""
    [dead] = await dead_letters_on_idle(shop, 1)
    reader = await key(shop, SCOPE_READ, SCOPE_OPERATE)
    async with client_for(shop) as client:
        for leaving in LEAVING:
            page = await client.get(f"{UI}/sign-in", params={"next": leaving})
            assert f'name="next" value="{UI}/"' in page.text, leaving
            answer = await client.post(f"{UI}/sign-in", data={"csrf": token_of(page.text), "api_key": reader,
                                                               "next": leaving})
            assert answer.status_code == 303 and answer.headers["location"] == f"{UI}/", leaving
        kept = await client.post(f"{UI}/sign-in", data={"csrf": client.cookies["workqueue_csrf"], "api_key": reader,
                                                         "next": f"{UI}/deliveries/{dead}"})
        assert kept.headers["location"] == f"{UI}/deliveries/{dead}"
        for leaving in LEAVING[:3]:
            answer = await post(client, f"{UI}/deliveries/{dead}", f"{UI}/subscriptions/{shop.idle}/pause",
                                back=leaving)
            assert answer.headers["location"].startswith(f"{UI}/subscriptions/{shop.idle}?"), leaving


async def test_a_dashboard_whose_queue_is_not_open_says_so(pg_url: str) -> None:
    queue = WorkQueue(WorkQueueSettings(database_url=pg_url))
    from fastapi import FastAPI

    app = FastAPI()
    app.mount(UI, queue.dashboard(secret=SECRET))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        answer = await client.get(f"{UI}/")
    assert answer.status_code == 503 and "queue.lifespan" in answer.text


async def test_while_the_store_is_away_a_caller_not_signed_in_sees_no_driver_text(pg_url: str) -> None:
    """Connections refused (maintenance), then the database dropped: the session check, the sign-in
    and ``/health/extensions`` answer with a generic reason, never the driver's text with the
    database's name (the process itself still has it: ``queue.health()``, and its log)."""
    import asyncpg

    from fastapi_workqueue.database.postgres import PostgresTransport, to_asyncpg_dsn

    from ..conftest import drop_database, recreate_database, unique

    url = pg_url.rsplit("/", 1)[0] + "/" + unique("wq_ui_away").replace("-", "_")
    name = url.rsplit("/", 1)[1]
    await recreate_database(url)
    migrating = PostgresTransport(url, listen=False)
    await migrating.open()
    await migrating.migrate()
    await migrating.close()
    shop = Shop(url)
    shop.app.include_router(shop.queue.health_router)
    admin = await asyncpg.connect(to_asyncpg_dsn(pg_url).rsplit("/", 1)[0] + "/postgres")
    try:
        async with shop.queue.lifespan(shop.app), client_for(shop) as client:
            reader = await key(shop, SCOPE_READ)
            await sign_in(client, reader)
            assert (await client.get(f"{UI}/")).status_code == 200
            form = await client.get(f"{UI}/sign-in")

            await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", name)
            answers = [await client.get(f"{UI}/")]

            def failing() -> list[Any]:
                return [s for s in shop.queue.health().subscriptions if s.state == "Error"]

            from .shop import wait_until

            [*errors] = await wait_until(failing)
            assert any(name in (e.reason or "") for e in errors)  # the process's own report keeps the detail
            health = await client.get("/health/extensions")
            assert health.status_code == 503 and name not in health.text, health.text
            reasons = {s["Reason"] for s in health.json()["Extensions"][0]["Subscriptions"] if s["State"] == "Error"}
            assert reasons == {"the queue's store is unavailable or refused a call; the details are in this "
                               "process's log"}
            await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            answers.append(await client.get(f"{UI}/"))
            answers.append(await client.post(f"{UI}/sign-in", data={"csrf": token_of(form.text), "api_key": reader,
                                                                      "next": f"{UI}/"}))
            shop.release.set()
        for answer in answers:
            assert answer.status_code == 503, answer.text
            assert name not in answer.text and "unavailable" in answer.text
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        await drop_database(url)


def test_the_sign_in_needs_a_server_secret_and_caps_the_session(pg_url: str) -> None:
    """Sessions are signed with a secret that never sits in the database: without one the mount
    says what to set; WORKQUEUE_APP_KEY serves when no dashboard secret is set; a session lasts at
    most 12 hours. An app with its own authorize needs none."""
    from cryptography.fernet import Fernet

    bare = WorkQueue(WorkQueueSettings(database_url=pg_url))
    with pytest.raises(ConfigurationError) as refused:
        bare.dashboard()
    assert "WORKQUEUE_DASHBOARD_SECRET" in str(refused.value) and "WORKQUEUE_APP_KEY" in str(refused.value)
    with pytest.raises(ConfigurationError, match="at least 16"):
        bare.dashboard(secret="short")

    async def the_apps_own(security_scopes: SecurityScopes) -> Principal:
        return Principal(name="someone")

    bare.dashboard(authorize=the_apps_own)  # the app's own authentication: no session to sign

    with_app_key = WorkQueue(WorkQueueSettings(database_url=pg_url, app_key=Fernet.generate_key().decode()))
    with_app_key.dashboard()
    with pytest.raises(ConfigurationError, match="at most 43200"):
        with_app_key.dashboard(session_seconds=10 * 365 * 86400)


def test_the_history_chart_draws_the_last_hour() -> None:
    from fastapi_workqueue.core.history import StatsPoint
    from fastapi_workqueue.dashboard.chart import render_chart

    now = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
    points: list[Any] = [
        StatsPoint(subscription=s, recorded_at=now - timedelta(minutes=m), pending=p, in_flight=1, dead_lettered=d,
                   completed=c, window_seconds=60.0)
        for m, c, p, d in ((90, 999, 1, 0), (30, 30, 5, 0), (15, 120, 50, 2), (0, 60, 10, 3)) for s in ("a", "b")
    ]
    svg = str(render_chart(points, now, label="All"))
    assert "All: 120 completed a minute, depth 22, 6 dead-lettered" in svg  # the latest sample, both summed
    throughput = re.search(r'class="chart-line chart-throughput" points="([^"]+)"', svg)
    assert throughput and len(throughput.group(1).split()) == 3  # the point 90 minutes back is left out
    assert ">500<" in svg  # 240 a minute at the top: the axis is a round 500
    assert "No history yet" in str(render_chart([], now))


async def test_the_pages_render_on_sqlite(sqlite_url: str) -> None:
    shop = Shop(sqlite_url)
    async with shop.queue.lifespan(shop.app), client_for(shop) as client:
        [dead] = await dead_letters_on_idle(shop, 1)
        await shop.queue.publish(shop.topic, [{"payload": {"fail": True}, "PartitionKey": "acct-1"},
                                              {"payload": {}, "PartitionKey": "acct-1"}])
        await shop.queue.sweep()
        await sign_in(client, await key(shop, *EVERYTHING))

        async def blocked() -> bool:
            page = await client.get(f"{UI}/subscriptions/{shop.ledger}")
            return page.status_code == 200 and '<tr data-key="acct-1">' in page.text

        from .shop import wait_until

        await wait_until(blocked)
        for path in ("/", f"/subscriptions/{shop.idle}", f"/deliveries/{dead}",
                     f"/subscriptions/{shop.idle}/replay-all"):
            page = await client.get(UI + path)
            assert page.status_code == 200, (path, page.text[:300])
        overview = (await client.get(f"{UI}/")).text
        assert '<svg class="chart"' in overview and shop.ledger in overview
        # Search by the key finds the ledger's deliveries; the dead-lettered head lists its attempt.
        found = (await client.get(f"{UI}/search", params={"q": "acct-1"})).text
        assert found.count("<td>partition key</td>") >= 2 and shop.ledger in found
        [head] = [d for d in await shop.queue.dead_letters(shop.ledger) if d.partition_key == "acct-1"]
        assert f'href="{UI}/deliveries/{head.delivery_id}"' in found
        head_page = (await client.get(f"{UI}/deliveries/{head.delivery_id}")).text
        assert 'class="attempt attempt-deadlettered"' in head_page and "the ledger refused the entry" in head_page
        replayed = await post(client, f"{UI}/deliveries/{dead}", f"{UI}/deliveries/{dead}/replay")
        assert replayed.headers["location"].endswith("notice=Replayed")
        shop.release.set()


async def test_the_search_box_finds_a_delivery_by_message_id_key_correlation_and_id(shop: Shop) -> None:
    tag = str(time.time_ns())
    [published] = await shop.queue.publish(shop.topic, [PublishRequest(
        payload={"to": "bob@example.com"}, partition_key=f"customer-{tag}", correlation_id=f"req-{tag}")])
    assert published.message_id is not None
    deliveries = await shop.queue.transport.message_deliveries(published.message_id)
    async with client_for(shop) as client:
        await sign_in(client, await key(shop, SCOPE_READ))
        overview = (await client.get(f"{UI}/")).text
        assert f'action="{UI}/search"' in overview and 'name="q"' in overview
        pages = {q: (await client.get(f"{UI}/search", params={"q": q})).text
                 for q in (str(published.message_id), f"customer-{tag}", f"req-{tag}", deliveries[0].delivery_id,
                           f"nobody-{tag}", "<script>", f"customer-{tag}\x00")}
    for q, what in ((str(published.message_id), "MessageID"), (f"customer-{tag}", "partition key"),
                    (f"req-{tag}", "correlation ID")):
        page = pages[q]
        assert page.count('<tr data-delivery="') == len(deliveries) == 3, q
        for info in deliveries:
            assert f'href="{UI}/deliveries/{info.delivery_id}"' in page
        assert f"<td>{what}</td>" in page
    assert pages[deliveries[0].delivery_id].count("<td>delivery id</td>") == 1
    assert "Nothing matches <code>nobody-" in pages[f"nobody-{tag}"]
    assert "<script>" not in pages["<script>"].split("<main>")[1] and "&lt;script&gt;" in pages["<script>"]
    # No stored name holds a NUL or a lone surrogate: such a query finds nothing (it was a 503
    # with the driver's words).
    odd = pages[f"customer-{tag}\x00"]
    assert "Nothing matches" in odd and '<tr data-delivery="' not in odd
    assert await shop.queue.transport.search_deliveries("\ud800") == []  # type: ignore[attr-defined]


async def test_stuck_in_flight_and_the_oldest_pending_wait_are_flagged(pg_url: str) -> None:
    from .shop import wait_until

    shop = Shop(pg_url, stuck_after_seconds=0.5)
    async with shop.queue.lifespan(shop.app):
        try:
            await shop.queue.publish(shop.topic, [{"payload": {"hold": True}}])
            async with client_for(shop) as client:
                await sign_in(client, await key(shop, SCOPE_READ))

                mine = re.compile(rf'<li class="attention-warn" data-attention="{re.escape(shop.mail)}">(.*?)</li>',
                                  re.S)

                async def flagged() -> str | None:
                    page = (await client.get(f"{UI}/")).text
                    return page if any("in flight for over" in m for m in mine.findall(page)) else None

                overview = await wait_until(flagged)
                [item] = [m for m in mine.findall(overview) if "in flight for over" in m]
                assert f'href="{UI}/subscriptions/{shop.mail}#in-flight"' in item
                assert "1 delivery in flight for over 0.5 s" in item
                # The paused subscription's delivery waits to be claimed: its wait is shown.
                row = overview[overview.index(f'<tr data-subscription="{shop.idle}">'):]
                row = row[:row.index("</tr>")]
                assert re.search(r'class="optional oldest-pending"><time datetime="[^"]+" title="claimable since ', row)
                page = (await client.get(f"{UI}/subscriptions/{shop.mail}")).text
                assert 'class="status status-stuck"' in page and "Stuck in flight" in page
        finally:
            shop.release.set()


async def test_a_subscription_page_shows_its_flow_limits_how_full_and_what_waits(shop: Shop) -> None:
    """Issue 31: a limited subscription's page lists its limits, how full they are (in flight
    against max_in_flight, the rate limit's tokens) and the claimable work they hold back."""
    limited = unique("orders.limited")
    transport = shop.queue.transport
    await transport.sync_topology([Topic(name=shop.topic)], [Subscription(
        name=limited, topic=shop.topic, handler_key="nobody", max_in_flight=2, rate_limit="5/s", key_concurrency=3)])
    await transport.publish(shop.topic, [prepare(PublishRequest(payload={"n": i})) for i in range(5)])
    claimed = await transport.claim(limited, 10)
    assert len(claimed) == 2
    async with client_for(shop) as client:
        await sign_in(client, await key(shop, SCOPE_READ))
        page = (await client.get(f"{UI}/subscriptions/{limited}")).text
        flow = re.search(r'<div class="flow" data-flow>(.*?)</div>', page, re.S)
        assert flow, "the page shows no limits"
        text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", flow.group(1)))
        assert "at most 2 in flight: 2 now, full" in text
        assert "at most 3 in flight per key" in text
        assert re.search(r"rate 5/s: [345]\.\d tokens", text), text  # 3 left, refilling at 5 a second
        assert "3 claimable waiting on a limit" in text
        mail = (await client.get(f"{UI}/subscriptions/{shop.mail}")).text
        assert "data-flow" not in mail  # no limits, nothing shown
