"""The pages an operator reads first: what needs attention, where each subscription runs, the
processes and who holds what, the trace of a delivery, and the chart's live end and tooltips; over
HTTP on PostgreSQL and SQLite."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import httpx
import pytest

from fastapi_workqueue import PublishRequest
from fastapi_workqueue.core.envelope import prepare
from fastapi_workqueue.core.keys import SCOPE_READ, create_key
from fastapi_workqueue.core.observe import carry_headers
from fastapi_workqueue.core.processes import ProcessBeat, ProcessIdentity, ProcessRegistry, current_process
from fastapi_workqueue.core.transport import ClaimedDelivery, Settlement

from .shop import Shop, wait_until
from .test_pages import UI, client_for, sign_in

pytestmark = pytest.mark.timeout(60)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(params=["postgresql", "sqlite"])
async def shop(request: pytest.FixtureRequest, pg_url: str, sqlite_url: str) -> AsyncIterator[Shop]:
    shop = Shop(pg_url if request.param == "postgresql" else sqlite_url,
                trace_url="https://tempo.example/trace/{trace_id}")
    async with shop.queue.lifespan(shop.app):
        yield shop
        shop.release.set()


@asynccontextmanager
async def reader(shop: Shop) -> AsyncIterator[httpx.AsyncClient]:
    """A client signed in with a read key."""
    async with client_for(shop) as http:
        await sign_in(http, (await create_key(shop.queue.transport, f"r-{time.monotonic_ns()}", [SCOPE_READ])).key)
        yield http


async def test_the_overview_puts_what_needs_attention_first(shop: Shop) -> None:
    # A dead letter on mail, a blocked key on ledger, work on the paused idle subscription.
    await shop.queue.publish(shop.topic, [{"payload": {"fail": "once", "to": "x@example.com"}, "PartitionKey": "k9"}])
    await shop.queue.publish(shop.topic, [{"payload": {"fail": True}, "PartitionKey": "k1"},
                                          {"payload": {}, "PartitionKey": "k1"}])

    async def settled() -> bool:  # the mail's dead letter and both of the ledger's
        mail, ledger = await shop.queue.dead_letters(shop.mail), await shop.queue.dead_letters(shop.ledger)
        return len(mail) >= 1 and len(ledger) >= 2

    await wait_until(settled)
    async with reader(shop) as http:
        page = (await http.get(f"{UI}/")).text
    attention = re.search(r'<section class="panel attention" id="attention" data-live>(.*?)</section>', page, re.S)
    assert attention
    items = re.findall(r'<li class="attention-(\w+)" data-attention="([^"]+)">(.*?)</li>', attention.group(1), re.S)
    found = {(severity, name, re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", text)).strip())
             for severity, name, text in items}
    assert any(s == "alert" and n == shop.mail and ": 1 dead letter " in t for s, n, t in found), sorted(found)
    # The ledger (Ordered) refused both messages: both keys are blocked behind their dead letters.
    assert any(s == "alert" and n == shop.ledger and ": 2 dead letters " in t for s, n, t in found), sorted(found)
    assert any(s == "alert" and n == shop.ledger and "2 blocked keys" in t and "k1" in t and "k9" in t
               for s, n, t in found), sorted(found)
    assert any(s == "warn" and n == shop.idle and "paused with 3 deliveries pending" in t for s, n, t in found), found
    severities = [s for s, _, _ in items]
    assert severities == sorted(severities, key=lambda s: s != "alert")  # alerts first
    # "Anywhere": the subscriptions this app runs have a live process; the paused one none.
    row = re.search(rf'<tr data-subscription="{re.escape(shop.mail)}">(.*?)</tr>', page, re.S)
    assert row and ">1 process</a>" in row.group(1)


async def test_pending_work_that_no_live_process_runs_is_flagged(shop: Shop) -> None:
    transport = shop.queue.transport
    await shop.queue.resume(shop.idle)  # active, and no process plans it
    await transport.publish(shop.topic, [prepare(PublishRequest(payload={"n": 1}))])
    async with reader(shop) as http:
        page = (await http.get(f"{UI}/")).text
    assert re.search(rf'<li class="attention-alert" data-attention="{re.escape(shop.idle)}">.*?pending, '
                     r"no consumer\s+anywhere", page, re.S)
    row = re.search(rf'<tr data-subscription="{re.escape(shop.idle)}">(.*?)</tr>', page, re.S)
    assert row and '<span class="alert">none</span>' in row.group(1)


async def test_the_processes_page_lists_live_stopped_and_gone_processes(shop: Shop) -> None:
    transport = shop.queue.transport
    assert isinstance(transport, ProcessRegistry)
    gone = ProcessIdentity(uuid.uuid4(), "old-host", 4242, datetime.now(UTC))
    await transport.process_beat(ProcessBeat(gone, (shop.mail,), slots=2, busy=1, interval_seconds=0.05))
    me = current_process()
    async with reader(shop) as http:
        async def page() -> str | None:
            text = (await http.get(f"{UI}/processes")).text
            return text if re.search(rf'data-process="{gone.id}".*?status-gone', text, re.S) else None

        html = await wait_until(page)
        api = await http.get("/work-queue/processes")
    mine = re.search(rf'<tr id="process-{me.id}" data-process="{me.id}"[^>]*>(.*?)</tr>', html, re.S)
    assert mine and f"{me.hostname}</strong> pid {me.pid}" in mine.group(1) and "(this process)" in mine.group(1)
    assert "status-running" in mine.group(1) and shop.mail in mine.group(1)
    old = re.search(rf'data-process="{gone.id}"[^>]*>(.*?)</tr>', html, re.S)
    assert old and "old-host</strong> pid 4242" in old.group(1)
    assert api.status_code == 404  # the REST API is not mounted by the shop: the page is the dashboard's


async def test_a_delivery_links_to_its_trace(shop: Shop) -> None:
    message = prepare(PublishRequest(payload={"n": 1}))
    carry_headers(message, {"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"})
    transport = shop.queue.transport
    await shop.queue.resume(shop.idle)
    await transport.publish(shop.topic, [message])
    [claimed] = await transport.claim(shop.idle, 1)
    await transport.settle([Settlement(claimed.delivery_id, claimed.lease_token, "DeadLetter", reason="x")])
    info = await shop.queue.get_delivery(claimed.delivery_id)
    assert info is not None and info.trace_id == TRACE and info.attributes == {}
    async with reader(shop) as http:
        page = (await http.get(f"{UI}/deliveries/{claimed.delivery_id}")).text
    assert (f'<code>{TRACE}</code> <a href="https://tempo.example/trace/{TRACE}" rel="noopener noreferrer" '
            'target="_blank">open the trace</a>') in page


async def test_the_chart_ends_at_the_live_counts_and_shows_values_on_hover(shop: Shop) -> None:
    from fastapi_workqueue.core.history import StatsPoint
    from fastapi_workqueue.dashboard.chart import render_chart

    now = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
    points = [StatsPoint(subscription="s", recorded_at=datetime(2026, 12, 4, 11, 58, tzinfo=UTC), pending=5,
                         in_flight=1, dead_lettered=0, completed=120, window_seconds=60)]
    svg = str(render_chart(points, now, live=(9, 2)))
    tips = re.findall(r"<title>([^<]*)</title></rect>", svg)
    assert tips == ["11:58 UTC: 120 completed a minute, depth 6, 0 dead-lettered",
                    "12:00 UTC: 120 completed a minute, depth 9, 2 dead-lettered"]


def test_a_cause_sets_aside_what_varies_between_messages() -> None:
    from fastapi_workqueue.core.reports import DeliveryInfo
    from fastapi_workqueue.dashboard.causes import fingerprint

    def dead(error: str | None, reason: str | None = "poison") -> DeliveryInfo:
        return DeliveryInfo(delivery_id="1", subscription="s", message_id=uuid.uuid4(), status="DeadLettered",
                            attempt=1, max_attempts=1, reason=reason, last_error=error)

    first = dead(f"Traceback (most recent call last):\n  File \"a.py\", line 3\nKeyError: order 17 of {uuid.uuid4()}")
    second = dead(f"Traceback:\nKeyError: order 9023 of {uuid.uuid4()}")
    assert fingerprint(first) == fingerprint(second) == "KeyError: order <n> of <uuid>"
    assert fingerprint(dead("ValueError: token deadbeef42 refused")) == "ValueError: token <id> refused"
    assert fingerprint(dead(None, reason="handler said no")) == "handler said no"
    assert fingerprint(dead("KeyError: order 17")) != fingerprint(dead("ValueError: order 17"))


async def poison(shop: Shop, errors: list[str]) -> list[str]:
    """Dead letters on the idle subscription (no host runs it), one per error text."""
    transport = shop.queue.transport
    await shop.queue.resume(shop.idle)
    await transport.publish(shop.topic, [prepare(PublishRequest(payload={"n": i})) for i in range(len(errors))])
    claimed: list[ClaimedDelivery] = []
    while len(claimed) < len(errors):
        claimed += await transport.claim(shop.idle, 100)
    await transport.settle([Settlement(c.delivery_id, c.lease_token, "DeadLetter", reason="poison", error=e)
                            for c, e in zip(claimed, errors, strict=True)])
    await shop.queue.pause(shop.idle)  # nothing runs the replays: they stay Pending to be counted
    return [c.delivery_id for c in claimed]


async def test_fourteen_identical_dead_letters_are_one_cause_replayed_in_one_action(shop: Shop) -> None:
    from fastapi_workqueue.core.keys import SCOPE_OPERATE

    from .test_pages import post

    same = [f"Traceback (most recent call last):\nValueError: order {1000 + i} has no address" for i in range(14)]
    ids = await poison(shop, [*same, "RuntimeError: the printer is on fire", "RuntimeError: the printer is on fire"])
    page_path = f"{UI}/subscriptions/{shop.idle}"
    async with client_for(shop) as http:
        await sign_in(http, (await create_key(shop.queue.transport, f"o-{time.monotonic_ns()}",
                                              [SCOPE_READ, SCOPE_OPERATE])).key)
        page = (await http.get(page_path)).text
        rows = re.findall(r'<tr data-cause="(\w+)">\s*<td class="num"><strong>(\d+)</strong></td>\s*'
                          r'<td class="error-cell"><code>([^<]*)</code>', page)
        assert [(count, cause) for _, count, cause in rows] == [
            ("14", "ValueError: order &lt;n&gt; has no address"), ("2", "RuntimeError: the printer is on fire")]
        key = rows[0][0]
        answer = await post(http, page_path, f"{page_path}/causes/{key}/replay", back=page_path, note="address fixed")
        assert answer.status_code == 303 and answer.headers["location"].endswith("notice=ReplayedGroup&n=14")
        replayed = [await shop.queue.get_delivery(i) for i in ids[:14]]
        assert {(r.status, r.note) for r in replayed if r} == {("Pending", "address fixed")}
        # Two ticked on the list, discarded in one action; the rest of their cause stays.
        chosen = ids[14:15]
        form_page = await http.get(page_path)
        token = re.search(r'name="csrf" value="([^"]+)"', form_page.text)
        assert token
        discarded = await http.post(f"{page_path}/selected/discard",
                                    data={"csrf": token.group(1), "back": page_path, "delivery": chosen})
        assert discarded.headers["location"].endswith("notice=DiscardedSelected&n=1")
    infos = {i: await shop.queue.get_delivery(i) for i in ids[14:]}
    statuses = {i: info.status if info is not None else None for i, info in infos.items()}
    assert statuses == {ids[14]: "Discarded", ids[15]: "DeadLettered"}
