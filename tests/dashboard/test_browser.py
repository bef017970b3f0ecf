"""The dashboard in a real browser: headless Chromium (Debian's package, driven by Playwright) on
the app served by uvicorn, with the queue and its host on a PostgreSQL database of their own.

An operator signs in, sees a dead letter appear without reloading the page, replays it and watches
it complete, pauses and resumes a subscription; a person with a read-only key sees no actions and
is refused one sent anyway. Screenshots go to tests/dashboard/artifacts/ (one of them is the
docs' picture of the dashboard).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from fastapi import FastAPI

from fastapi_workqueue.core.keys import SCOPE_ADMIN, SCOPE_OPERATE, SCOPE_READ, create_key
from fastapi_workqueue.database.postgres import to_asyncpg_dsn

from ..conftest import drop_database, recreate_database, unique
from .shop import SECRET, Shop, free_port, wait_until

pytestmark = pytest.mark.timeout(120)

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
playwright_api = pytest.importorskip("playwright.async_api", reason="the browser tests need playwright")
if not CHROMIUM.exists():  # scripts/test installs Debian's chromium; never a downloaded browser
    pytest.skip("the browser tests need /usr/bin/chromium (apt-get install chromium)", allow_module_level=True)


class Served:
    def __init__(self, shop: Shop, base: str, url: str) -> None:
        self.shop, self.base, self.url = shop, base, url


@pytest.fixture(scope="module")
async def served(pg_url: str) -> AsyncIterator[Served]:
    """The shop app under uvicorn on a free port, on a database of its own (migrated at start-up)."""
    import uvicorn

    base, _, _ = pg_url.rpartition("/")
    url = f"{base}/wq_browser_{unique('db').split('-')[1]}"
    await recreate_database(url)
    shop = Shop(url)
    shop.queue.settings.auto_migrate = True
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(shop.app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started or task.done())
        assert server.started, "uvicorn did not start"
        await seed_an_hour_of_history(url)
        yield Served(shop, f"http://127.0.0.1:{port}/work-queue/ui", url)
    finally:
        shop.release.set()
        server.should_exit = True
        await task
        await drop_database(url)


async def seed_an_hour_of_history(url: str) -> None:
    """The points the sweeper would have written over the last hour (the chart in the screenshots):
    a morning's traffic with a burst of dead letters."""
    conn = await asyncpg.connect(to_asyncpg_dsn(url))
    try:
        await conn.execute("""
            INSERT INTO workqueue.stats_history (subscription_id, recorded_at, pending, in_flight, dead_lettered,
                                                 completed, window_seconds)
            SELECT s.id, date_trunc('minute', now()) - make_interval(mins => m),
                   (40 + 30 * sin(m / 6.0))::bigint, 3 + m % 4, CASE WHEN m BETWEEN 12 AND 20 THEN 2 ELSE 0 END,
                   (120 + 60 * cos(m / 9.0))::bigint, 60
            FROM workqueue.subscription s, generate_series(1, 60) m
            WHERE s.status = 'Active'
            """)
    finally:
        await conn.close()


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            await chromium.close()


async def signed_in_page(browser: Any, served: Served, *scopes: str) -> Any:
    key = await create_key(served.shop.queue.transport, unique("person"), list(scopes))
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    page = await context.new_page()
    page.set_default_timeout(15_000)
    await page.goto(f"{served.base}/")
    assert page.url.startswith(f"{served.base}/sign-in")
    await page.fill("#api_key", key.key)
    await page.click("form[action$='/sign-in'] button[type=submit]")
    await page.wait_for_url(f"{served.base}/")
    return page


async def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


async def test_an_operator_sees_a_dead_letter_appear_replays_it_and_watches_it_complete(
    browser: Any, served: Served
) -> None:
    shop = served.shop
    page = await signed_in_page(browser, served, SCOPE_READ, SCOPE_OPERATE, SCOPE_ADMIN)
    try:
        assert await page.locator(f'tr[data-subscription="{shop.mail}"]').count() == 1
        await shot(page, "overview")
        await page.click(f'a[href$="/subscriptions/{shop.mail}"]')
        await page.wait_for_selector("#dead-letters")
        assert await page.locator("#dead-letters tr[data-delivery]").count() == 0
        await page.evaluate("window.notReloaded = true")

        [result] = await shop.queue.publish(shop.topic, [{"payload": {"fail": "once", "to": "ada@example.com"}}])
        row = page.locator("#dead-letters tr[data-delivery]")
        await row.first.wait_for()  # the page polls: the dead letter appears without a reload
        assert await page.evaluate("window.notReloaded === true")
        delivery_id = await row.first.get_attribute("data-delivery")
        info = await shop.queue.get_delivery(str(delivery_id))
        assert info is not None and info.message_id == result.message_id and info.status == "DeadLettered"
        assert "the mail server refused ada@example.com" in await row.first.inner_text()
        await shot(page, "dead-letter")

        await row.first.locator("form[action$='/replay'] button").click()
        await page.wait_for_selector(".notice")
        assert "Replayed" in await page.locator(".notice").inner_text()
        await page.goto(f"{served.base}/deliveries/{delivery_id}")
        await page.wait_for_selector("#delivery .status-completed")  # the handler completes it on its replay
        assert "replayed by" in await page.locator("dl.fields").inner_text()
        await shot(page, "completed")
    finally:
        await page.context.close()


async def test_an_operator_pauses_and_resumes_a_subscription(browser: Any, served: Served) -> None:
    shop = served.shop
    page = await signed_in_page(browser, served, SCOPE_READ, SCOPE_OPERATE)
    try:
        await page.goto(f"{served.base}/subscriptions/{shop.mail}")
        await page.click("#state form[action$='/pause'] button")
        await page.wait_for_selector("#state .status-paused")
        assert "Paused" in await page.locator(".notice").inner_text()
        assert {s.name: s.status for s in await shop.queue.transport.list_subscriptions()}[shop.mail] == "Paused"
        await page.click("#state form[action$='/resume'] button")
        await page.wait_for_selector("#state form[action$='/pause']")
        assert {s.name: s.status for s in await shop.queue.transport.list_subscriptions()}[shop.mail] == "Active"
    finally:
        await page.context.close()


async def test_a_read_only_key_sees_no_actions_and_is_refused_one(browser: Any, served: Served) -> None:
    shop = served.shop
    [result] = await shop.queue.publish(shop.topic, [{"payload": {"fail": "once", "to": "bob@example.com"}}])

    async def dead_letter() -> str | None:
        found = [d for d in await shop.queue.dead_letters(shop.mail, limit=100) if d.message_id == result.message_id]
        return found[0].delivery_id if found else None

    delivery_id: str = await wait_until(dead_letter)
    page = await signed_in_page(browser, served, SCOPE_READ)
    try:
        await page.goto(f"{served.base}/subscriptions/{shop.mail}")
        await page.wait_for_selector(f'#dead-letters tr[data-delivery="{delivery_id}"]')
        assert await page.locator("form[action$='/replay'], form[action$='/pause']").count() == 0
        # The same form an operator's page has, sent anyway from this page.
        await page.evaluate(
            """([action, token]) => {
                const form = document.createElement("form");
                form.method = "post"; form.action = action;
                const field = document.createElement("input");
                field.type = "hidden"; field.name = "csrf"; field.value = token;
                form.appendChild(field); document.body.appendChild(form); form.submit();
            }""",
            [f"{served.base}/deliveries/{delivery_id}/replay",
             await page.locator("input[name=csrf]").first.get_attribute("value")],
        )
        await page.wait_for_selector(".error-page")
        assert "lacks the scope workqueue:operate" in await page.locator(".error-page").inner_text()
        await shot(page, "refused")
        info = await shop.queue.get_delivery(delivery_id)
        assert info is not None and info.status == "DeadLettered"
    finally:
        await page.context.close()



async def test_a_phone_reads_every_page_without_scrolling_sideways(browser: Any, served: Served) -> None:
    """At 390 px wide no page is wider than the screen: tables keep to their cards."""
    shop = served.shop
    key = await create_key(shop.queue.transport, unique("phone"), [SCOPE_READ, SCOPE_OPERATE])
    context = await browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2,
                                        is_mobile=True, has_touch=True)
    page = await context.new_page()
    page.set_default_timeout(15_000)
    try:
        await page.goto(f"{served.base}/sign-in")
        await page.fill("#api_key", key.key)
        await page.click("form[action$='/sign-in'] button[type=submit]")
        await page.wait_for_url(f"{served.base}/")
        for path, name in (("/", "phone-overview"), (f"/subscriptions/{shop.mail}", "phone-subscription"),
                           ("/processes", "phone-processes")):
            await page.goto(served.base + path)
            await page.wait_for_selector("main h1")
            width = await page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, (path, width)
            await shot(page, name)
    finally:
        await context.close()


async def test_the_holder_of_a_running_delivery_links_to_its_process(browser: Any, served: Served) -> None:
    shop = served.shop
    [result] = await shop.queue.publish(shop.topic, [{"payload": {"hold": True}}])

    async def running() -> str | None:
        held = [d for d in await shop.queue.deliveries(shop.mail, "InFlight") if d.message_id == result.message_id]
        return held[0].delivery_id if held else None

    delivery_id: str = await wait_until(running)
    page = await signed_in_page(browser, served, SCOPE_READ)
    try:
        await page.goto(f"{served.base}/subscriptions/{shop.mail}")
        holder = page.locator(f'tr[data-delivery="{delivery_id}"] td.holder a')
        await holder.wait_for()
        await holder.click()
        await page.wait_for_selector("#processes")
        process_id = page.url.rpartition("#process-")[2]
        row = page.locator(f'tr[data-process="{process_id}"]')
        assert "Running" in await row.inner_text() and shop.mail in await row.inner_text()
        await shot(page, "processes")
    finally:
        shop.release.set()
        await page.context.close()


async def test_an_operator_replays_fourteen_alike_dead_letters_with_one_click(browser: Any, served: Served) -> None:
    """Fourteen dead letters that failed alike (only the address differs) are one cause; one click
    on its replay, confirmed, replays all fourteen and leaves the other cause alone."""
    shop = served.shop
    alike = await shop.queue.publish(
        shop.topic, [{"payload": {"fail": "once", "to": f"customer-{i}@example.com"}} for i in range(14)])
    [other] = await shop.queue.publish(shop.topic, [{"payload": {"fail": "once"}}])
    ids = {str(r.message_id) for r in alike}

    async def dead_lettered() -> bool:
        dead = await shop.queue.dead_letters(shop.mail, limit=100)
        return len({str(d.message_id) for d in dead} & (ids | {str(other.message_id)})) == 15

    await wait_until(dead_lettered)
    page = await signed_in_page(browser, served, SCOPE_READ, SCOPE_OPERATE)
    try:
        await page.goto(f"{served.base}/subscriptions/{shop.mail}")
        group = page.locator("#causes tr[data-cause]", has_text="customer-<n>@example.com")
        await group.wait_for()
        assert "14" in await group.locator("td.num").first.inner_text()
        assert await page.locator("#causes tr[data-cause]", has_text="refused the address").count() == 1
        await shot(page, "causes")
        questions: list[str] = []

        async def accept(dialog: Any) -> None:
            questions.append(dialog.message)
            await dialog.accept()

        page.on("dialog", accept)
        await group.locator("form[action$='/replay'] button").click()
        await page.wait_for_selector(".notice")
        assert "14" in await page.locator(".notice").inner_text()
        assert questions and "14 dead letters" in questions[0]

        async def completed() -> bool:
            done = await shop.queue.deliveries(shop.mail, "Completed", limit=1000)
            return ids <= {str(d.message_id) for d in done}

        await wait_until(completed)
        left = [d for d in await shop.queue.dead_letters(shop.mail, limit=100) if str(d.message_id) in ids | {
            str(other.message_id)}]
        assert [str(d.message_id) for d in left] == [str(other.message_id)]
    finally:
        await page.context.close()


async def test_a_delivery_held_by_a_worker_process_and_its_attempts_after_a_failure(
    browser: Any, pg_url: str, tmp_path: Path
) -> None:
    """A second process (``workqueue work``) holds a delivery: its page names that process, not
    this one; a delivery that failed twice, was replayed and completed lists those attempts in
    order, the failures held by the worker."""
    import os
    import signal
    import sys

    import uvicorn

    root = ARTIFACTS.parents[2]
    base, _, _ = pg_url.rpartition("/")
    url = f"{base}/wq_worker_{unique('db').split('-')[1]}"
    await recreate_database(url)
    topic, subscription, gate = unique("held"), unique("held.sub"), tmp_path / "gate"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")},
           "WORKQUEUE_DATABASE_URL": url, "WORKQUEUE_AUTO_MIGRATE": "1", "HELD_APP_TOPIC": topic,
           "HELD_APP_SUBSCRIPTION": subscription, "HELD_APP_GATE": str(gate), "PYTHONPATH": str(root)}
    saved = {k: os.environ.get(k) for k in ("HELD_APP_TOPIC", "HELD_APP_SUBSCRIPTION", "HELD_APP_GATE")}
    os.environ.update({k: env[k] for k in saved})
    try:
        import importlib

        from ..apps import held_app

        importlib.reload(held_app)  # the names above
        queue = held_app.make_queue(url, host=False)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    queue.settings.auto_migrate = True
    app = FastAPI(lifespan=queue.lifespan)
    app.mount("/work-queue/ui", queue.dashboard(secret=SECRET))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    worker: asyncio.subprocess.Process | None = None
    ui = f"http://127.0.0.1:{port}/work-queue/ui"
    try:
        await wait_until(lambda: server.started or task.done())
        assert server.started, "uvicorn did not start"
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fastapi_workqueue", "work", "--app", "tests.apps.held_app:queue",
            "--subscription", subscription, env=env, cwd=root,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        [held] = await queue.publish(topic, [{"payload": {"hold": True}}])
        [failing] = await queue.publish(topic, [{"payload": {"fail": True}}])

        async def delivery_of(message_id: Any, status: str) -> Any:
            infos = await queue.transport.message_deliveries(message_id)
            return infos[0] if infos and infos[0].status == status else None

        running = await wait_until(lambda: delivery_of(held.message_id, "InFlight"), within=60)
        dead = await wait_until(lambda: delivery_of(failing.message_id, "DeadLettered"), within=60)
        assert running.holder is not None and running.holder.pid == worker.pid

        key = await create_key(queue.transport, unique("ops"), [SCOPE_READ, SCOPE_OPERATE])
        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        page = await context.new_page()
        page.set_default_timeout(15_000)
        try:
            await page.goto(f"{ui}/sign-in")
            await page.fill("#api_key", key.key)
            await page.click("form[action$='/sign-in'] button[type=submit]")
            await page.wait_for_url(f"{ui}/")
            # The subscription's in-flight row: held by the worker, another process.
            await page.goto(f"{ui}/subscriptions/{subscription}")
            holder = page.locator(f'tr[data-delivery="{running.delivery_id}"] td.holder')
            await holder.wait_for()
            text = await holder.inner_text()
            assert f"pid {worker.pid}" in text and "another process" in text and "this process" not in text, text
            await shot(page, "held-elsewhere")
            await holder.locator("a").click()
            await page.wait_for_selector("#processes")
            row = page.locator(f'tr[data-process="{running.holder.process_id}"]')
            assert f"pid {worker.pid}" in await row.inner_text() and "Running" in await row.inner_text()
            assert "(this process)" not in await row.inner_text()

            # The dead letter, replayed once the cause is gone, completes; its page lists the attempts.
            gate.touch()
            await page.goto(f"{ui}/deliveries/{dead.delivery_id}")
            await page.fill("#delivery form[action$='/replay'] input[name=note]", "the warehouse is back")
            await page.click("#delivery form[action$='/replay'] button[type=submit]")
            await wait_until(lambda: delivery_of(failing.message_id, "Completed"), within=60)
            await page.goto(f"{ui}/deliveries/{dead.delivery_id}")
            rows = page.locator("table.attempts tbody tr")
            await page.wait_for_selector("table.attempts")
            texts = [await rows.nth(i).inner_text() for i in range(await rows.count())]
            outcomes = [await rows.nth(i).locator("span.status").first.inner_text() for i in range(len(texts))]
            assert outcomes == ["Failed", "DeadLettered", "Replayed", "Completed"], texts
            assert "503 on attempt 1" in await rows.nth(0).inner_html()
            assert "503 on attempt 2" in await rows.nth(1).inner_html()
            for i in (0, 1):
                assert f"pid {worker.pid}" in texts[i] and "another process" in texts[i], texts[i]
            assert "the warehouse is back" in texts[2]
            await shot(page, "attempt-history")
        finally:
            await context.close()
    finally:
        gate.touch()
        if worker is not None and worker.returncode is None:
            worker.send_signal(signal.SIGTERM)
            await asyncio.wait_for(worker.wait(), 30)
        server.should_exit = True
        await task
        await drop_database(url)
