"""The operator surface (REST, CLI, keys) at its edges: credentials in a URL's query, text the
stores cannot keep, durations and cursors out of range, and answers that must agree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .apps import cli_app

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3cretPassw0rd"


def workqueue(*args: str, url: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env["PYTHONPATH"] = str(ROOT)
    if url is not None:
        env["WORKQUEUE_DATABASE_URL"] = url
    return subprocess.run([sys.executable, "-m", "fastapi_workqueue", *args], env=env, cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=90)


def test_work_exit_reason_does_not_print_a_password_given_in_the_url_query() -> None:
    """docs/cli.md: "The first line names the database (its password masked)" and
    docs/observability.md: "One redaction ... serves every place an error leaves the process".
    The start-up line masks ``?password=``, but the exit-6 reason line right after it prints the
    password in clear (PostgresTransport._safe_url keeps the query string)."""
    url = f"postgresql+asyncpg://postgres@127.0.0.1:1/app?password={SECRET}"
    result = workqueue("work", "--app", "tests.apps.cli_app:queue", "--subscription", cli_app.BASIC, "--once",
                       url=url)
    assert result.returncode == 6, result.stderr
    assert "password=***" in result.stderr  # the start-up line masks it ...
    assert SECRET not in result.stderr, result.stderr  # ... the reason line must too


def test_operator_command_error_does_not_print_a_password_given_in_the_url_query() -> None:
    """The same leak in every operator command's one-line error (`workqueue stats`)."""
    url = f"postgresql+asyncpg://postgres@127.0.0.1:1/app?password={SECRET}"
    result = workqueue("stats", url=url)
    assert result.returncode == 1
    assert SECRET not in result.stderr + result.stdout, result.stderr


# -- REST ----------------------------------------------------------------------------------------

import httpx  # noqa: E402
from fastapi import FastAPI  # noqa: E402

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkQueue, WorkQueueSettings  # noqa: E402
from fastapi_workqueue.core.keys import SCOPES, create_key  # noqa: E402

from .conftest import unique  # noqa: E402


async def _app(url: str) -> tuple[WorkQueue, FastAPI, str, str]:
    topic, sub = unique("rvw-t"), unique("rvw-s")
    queue = WorkQueue(WorkQueueSettings(database_url=url, subscriptions=[]), topics=[Topic(name=topic)],
                      subscriptions=[Subscription(name=sub, topic=topic, handler_key="h")])
    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.router)
    return queue, app, topic, sub


async def test_retire_with_a_nul_in_the_reason_is_422_and_changes_nothing(database_url: str) -> None:
    """Replay's Note and discard's Reason refuse a NUL (or a lone surrogate) with 422 naming the
    field (ReplayBody/DiscardBody use _storable_text; tests/test_hostile.py: "never a 500", "the
    delivery is untouched"). RetireBody.reason has no such check: on PostgreSQL the retire answers
    500 with the driver's text ("invalid byte sequence for encoding UTF8: 0x00") after the
    subscription was already retired and none of its Pending deliveries discarded; on SQLite the
    NUL is stored."""
    queue, app, topic, sub = await _app(database_url)
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://api") as http:
        key = (await create_key(queue.transport, unique("rvw"), list(SCOPES))).key
        await queue.publish(topic, [PublishRequest(payload=n) for n in range(2)])
        response = await http.post(f"/work-queue/subscriptions/{sub}/retire",
                                   json={"DiscardPending": True, "Reason": "moved\x00away"},
                                   headers={"Authorization": f"Bearer {key}"})
        [stats] = await queue.stats(sub)
        assert response.status_code == 422, (response.status_code, response.text)
        assert "Reason" in response.text
        assert (stats.status, stats.pending) == ("Active", 2)


def test_api_keys_create_with_an_expiry_past_the_calendar_is_a_usage_error_not_a_traceback(
    database_url: str,
) -> None:
    """docs/cli.md: commands exit "2 on a usage error", and "`--verbose` adds the traceback behind an
    error" (so without it there is none). ``api-keys create --expires-in 100000000d`` (someone
    asking for a key that "never" expires) once crashed with an unhandled OverflowError and a Python
    traceback, exit 1: cli/api_keys.py adds the duration to now() outside ``run`` and unchecked
    (``--expires-in -1d`` is likewise accepted and prints a key that is already expired)."""
    result = workqueue("api-keys", "create", "--name", unique("rvw-forever"), "--scopes", "workqueue:read",
                       "--expires-in", "100000000d", url=database_url)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)


async def test_retiring_a_paused_topic_twice_reports_changed_only_once(database_url: str) -> None:
    """docs/rest-api.md: `POST /topics/{t}/retire` answers `{"Topic", "Status": "Retired", "Changed"}`;
    like pause/resume and the subscription's retire (schema: "changed is false when it was retired
    already"), Changed says whether this call changed anything. For a topic an operator paused
    (`queue.set_topic_status(t, "Paused")`, taken back by `workqueue topics resume`), every retire
    answered Changed: true, because set_topic_status computed the old status as Retired only when
    the topic is Active (sql/postgresql/0001_schema.sql set_topic_status, sqlite_routines
    _shown_status); `workqueue topics list` shows it Paused while a publish is refused TopicRetired."""
    queue, app, topic, _ = await _app(database_url)
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://api") as http:
        key = (await create_key(queue.transport, unique("rvw"), list(SCOPES))).key
        headers = {"Authorization": f"Bearer {key}"}
        await queue.set_topic_status(topic, "Paused")
        first = await http.post(f"/work-queue/topics/{topic}/retire", headers=headers)
        second = await http.post(f"/work-queue/topics/{topic}/retire", headers=headers)
        assert first.status_code == second.status_code == 200
        assert first.json()["Changed"] is True
        assert second.json()["Changed"] is False, second.json()


async def test_stats_and_backlog_agree_on_claimable_for_a_paused_subscription(database_url: str) -> None:
    """docs/scaling.md defines claimable: "Pending deliveries that a claim could take now ... It is 0
    while the subscription or its topic is Paused", and docs/observability.md lists `GET /stats`
    (and `workqueue stats`) as giving "Pending, claimable, InFlight, ...". For a paused
    subscription `GET /subscriptions/S/backlog` answers Claimable 0 but `GET /stats` answers
    Claimable = every visible Pending delivery (the stats query, unlike backlog, ignores the
    subscription's and the topic's status)."""
    queue, app, topic, sub = await _app(database_url)
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://api") as http:
        key = (await create_key(queue.transport, unique("rvw"), list(SCOPES))).key
        headers = {"Authorization": f"Bearer {key}"}
        await queue.publish(topic, [PublishRequest(payload=n) for n in range(3)])
        assert (await http.post(f"/work-queue/subscriptions/{sub}/pause", headers=headers)).status_code == 200
        backlog = (await http.get(f"/work-queue/subscriptions/{sub}/backlog", headers=headers)).json()
        [stats] = (await http.get("/work-queue/stats", params={"subscription": sub}, headers=headers)).json()
        assert backlog["Claimable"] == 0
        assert (stats["Status"], stats["Pending"]) == ("Paused", 3)
        assert stats["Claimable"] == backlog["Claimable"], (stats, backlog)


@pytest.mark.parametrize("command", ["deliveries", "dead-letters"])
async def test_a_non_numeric_after_cursor_is_a_usage_error(pg_url: str, command: str) -> None:
    """docs/cli.md: the commands exit "2 on a usage error"; REST refuses the same cursor with 422
    (`after` must match ^[0-9]+$). `workqueue deliveries --after abc` (a MessageID pasted instead of
    the DeliveryID, say) once exited 1 with Python's "invalid literal for int() with base 10: 'abc'"
    (routines.list_deliveries calls int(after); the option has no type)."""
    queue, app, _, sub = await _app(pg_url)
    async with queue.lifespan(app):
        pass  # the topology is stored
    result = workqueue(command, "--subscription", sub, "--after", "abc", url=pg_url)
    assert "invalid literal" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)


@pytest.mark.parametrize("lifetime", ["-1d", "0", "nan", "inf"])
def test_api_keys_create_refuses_a_lifetime_that_is_not_one(database_url: str, lifetime: str) -> None:
    """A key that would be born expired (or never), asked for by mistake, is a usage error naming
    the option; no key is created."""
    result = workqueue("api-keys", "create", "--name", unique("rvw-odd"), "--scopes", "workqueue:read",
                       "--expires-in", lifetime, url=database_url)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "--expires-in" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not result.stdout.strip()


async def test_an_operators_note_and_reason_are_kept_redacted_wherever_they_show(database_url: str) -> None:
    """A replay's note and a discard's reason are stored redacted, like a handler's error: a key
    or password pasted into them never shows in the delivery's page, its attempts or the listings."""
    from fastapi_workqueue.core.transport import Settlement

    queue, app, topic, sub = await _app(database_url)
    secret = "wq_abc123_NOTEDSECRETNOTEDSECRET"
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://api") as http:
        key = (await create_key(queue.transport, unique("rvw"), list(SCOPES))).key
        await queue.publish(topic, [PublishRequest(payload=n) for n in range(2)])
        claimed = await queue.transport.claim(sub, 2)
        assert len(claimed) == 2
        for delivery in claimed:
            await queue.transport.settle([Settlement(delivery.delivery_id, delivery.lease_token, "DeadLetter")])
        replayed, discarded = (d.delivery_id for d in claimed)
        auth = {"Authorization": f"Bearer {key}"}
        assert (await http.post(f"/work-queue/subscriptions/{sub}/deliveries/{replayed}/replay", headers=auth,
                                json={"Note": f"retry with {secret} and password=hunter2"})).status_code == 200
        assert (await http.post(f"/work-queue/subscriptions/{sub}/deliveries/{discarded}/discard", headers=auth,
                                json={"Reason": f"dropped, {secret}"})).status_code == 200
        shown = [(await http.get(path, headers=auth)).text for path in (
            f"/work-queue/deliveries/{replayed}", f"/work-queue/deliveries/{replayed}/attempts",
            f"/work-queue/deliveries/{discarded}", f"/work-queue/subscriptions/{sub}/deliveries?status=Discarded")]
    assert all("NOTEDSECRET" not in text and "hunter2" not in text for text in shown), shown
    assert "retry with wq_abc123_*** and password=***" in shown[0]
    assert "dropped, wq_abc123_***" in shown[2]
