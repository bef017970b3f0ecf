"""Mistakes are loud: an unknown setting raises with the name it resembles, an unknown
``WORKQUEUE_*`` variable is a warning at start, and the database password stays out of reprs."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue import (
    ConfigurationError,
    PublishRequest,
    Subscription,
    Topic,
    TransportUnavailable,
    WorkMessage,
    WorkQueue,
    WorkQueueSettings,
)
from fastapi_workqueue.core.words import count
from fastapi_workqueue.settings import unknown_variables
from fastapi_workqueue.testing import MemoryTransport

ROOT = str(Path(__file__).resolve().parents[1])


def test_a_misspelt_setting_raises_with_the_name_it_resembles() -> None:
    with pytest.raises(ConfigurationError) as raised:
        WorkQueueSettings(databse_url="sqlite+aiosqlite:///x.db")
    assert str(raised.value) == "WorkQueueSettings has no setting 'databse_url'; did you mean 'database_url'?"
    with pytest.raises(ConfigurationError, match=r"has no setting 'colour'; see docs/configuration\.md"):
        WorkQueueSettings(colour="blue")


def test_the_database_password_is_masked_in_the_repr() -> None:
    settings = WorkQueueSettings(database_url="postgresql+asyncpg://app:s3cret-pw@db.internal:5432/orders")
    shown = repr(settings)
    assert "s3cret-pw" not in shown and "s3cret-pw" not in str(settings)
    assert "postgresql+asyncpg://app:***@db.internal:5432/orders" in shown
    # The value itself is what the code connects with.
    assert settings.database_url == "postgresql+asyncpg://app:s3cret-pw@db.internal:5432/orders"


MALFORMED_URLS = [
    ("postgresql+asyncpg//app:s3cret-pw@127.0.0.1/db", "does not start with a scheme and '://' (it begins "
     "'postgresql+asyncpg'); write it as postgresql+asyncpg://user:password@host:5432/db"),
    ("postgresql+asyncpg:/app:s3cret-pw@127.0.0.1/db", "does not start with a scheme and '://'"),
    # (only a scheme the library knows is repeated: the start of anything else may be the secret)
    ("app:s3cret-pw@127.0.0.1/db", "does not start with a scheme and '://'; write it as"),
    ("s3cret-pw", "does not start with a scheme and '://'; write it as"),
    # (only '@' needs it: '/', '?', '#' and ':' may stand in a password unencoded, docs/configuration.md)
    ("postgresql+asyncpg://app:s3cret@pw@127.0.0.1:5432/db", "has more than one '@' before its host: a password "
     "(or user name) with '@' in it must be percent-encoded ('@' as %40"),
]


@pytest.mark.parametrize(("url", "says"), MALFORMED_URLS,
                         ids=["no-colon", "one-slash", "no-scheme", "a-bare-secret", "two-at"])
def test_a_malformed_database_url_says_what_to_change_without_its_password(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        WorkQueueSettings(database_url=url)
    message = str(raised.value)
    assert message.startswith("WORKQUEUE_DATABASE_URL (WorkQueueSettings.database_url): ")
    assert says in message and "s3cret" not in message
    # Nor in the traceback a crashed app prints (the error's cause, pydantic's, included).
    assert "s3cret" not in "".join(traceback.format_exception(raised.value))
    # The transport's factory (the CLI's --database-url) checks the same, in its own words.
    from fastapi_workqueue.database import create_database_transport

    with pytest.raises(ConfigurationError) as raised:
        create_database_transport(url)
    assert str(raised.value).startswith("the database URL ") and says in str(raised.value)
    assert "s3cret" not in str(raised.value)


def test_unknown_variables_name_the_closest_setting() -> None:
    environ = {
        "WORKQUEUE_DATABSE_URL": "x", "WORKQUEUE_DATABASE_URL": "y", "WORKQUEUE_CONCURENCY": "2",
        "WORKQUEUE_APP": "app:app", "WORKQUEUE_SUBSCRIPTION_POLICY": "{}", "WORKQUEUE_XYZZY": "1", "HOME": "/",
        # the project's test suite's, exported by a contributor who also runs the example app
        "WORKQUEUE_TEST_DATABASE_URL": "postgresql+asyncpg://postgres@127.0.0.1/t", "WORKQUEUE_MSSQL_URL": "mssql://",
    }
    assert unknown_variables(environ) == [
        "WORKQUEUE_CONCURENCY is not a setting of fastapi-workqueue and is ignored; "
        "did you mean WORKQUEUE_JOB_CONCURRENCY?",
        "WORKQUEUE_DATABSE_URL is not a setting of fastapi-workqueue and is ignored; "
        "did you mean WORKQUEUE_DATABASE_URL?",
        "WORKQUEUE_XYZZY is not a setting of fastapi-workqueue and is ignored; see docs/configuration.md for "
        "the settings",
    ]


def test_a_variable_naming_a_subscription_field_says_where_that_field_is_set() -> None:
    """A flow limit is set per subscription in the code: the warning says so, and never offers
    a variable of the project's own benchmarks (which would do nothing for the app) as the fix."""
    said = unknown_variables({"WORKQUEUE_MAX_IN_FLIGHT": "1", "WORKQUEUE_MAXINFLIGHT": "1",
                              "WORKQUEUE_KEY_CONCURRENCY": "2", "WORKQUEUE_RATE_LIMIT": "5/s"})
    assert len(said) == 4
    for line, field in zip(said, ["key_concurrency", "max_in_flight", "max_in_flight", "rate_limit"], strict=True):
        assert f"is ignored; {field} is set per subscription, in the code: Subscription(..., {field}=...)" in line
        assert "BENCH" not in line
    assert "@queue.job(..., concurrency=...)" in said[1] and "@queue.job" not in said[0]
    [typo] = unknown_variables({"WORKQUEUE_BENCH_MAX_INFLIGHT": "1"})
    assert "BENCH_MAX_IN_FLIGHT" not in typo
    # (fields near a setting's name: a lease or an attempt count of a subscription is no job lease
    # and no cap on what a message may ask for, which "did you mean" would have offered)
    [lease] = unknown_variables({"WORKQUEUE_LEASE_SECONDS": "30"})
    assert ("lease_seconds is set per subscription, in the code: Subscription(..., lease_seconds=...) "
            "(a job queue's: WORKQUEUE_JOB_LEASE_SECONDS)") in lease, lease
    [attempts] = unknown_variables({"WORKQUEUE_MAX_ATTEMPTS": "3"})
    assert "max_attempts is set per subscription" in attempts and "did you mean" not in attempts, attempts


@pytest.mark.parametrize("field", ["max_in_flight", "rate_limit", "lease_seconds", "max_attempts"])
def test_a_keyword_naming_a_subscription_field_says_where_that_field_is_set(field: str) -> None:
    """``WorkQueueSettings(max_in_flight=...)`` said only "see docs/configuration.md", and
    ``lease_seconds=``/``max_attempts=`` offered a setting that does something else."""
    with pytest.raises(ConfigurationError) as raised:
        WorkQueueSettings(**{field: 3})
    assert f"{field} is set per subscription, in the code: Subscription(..., {field}=...)" in str(raised.value)
    assert "did you mean" not in str(raised.value)


def test_a_variable_whose_value_is_a_database_url_is_taken_for_the_database_url() -> None:
    """docs/configuration.md's own example, ``WORKQUEUE_POSTGRES_URL=postgresql://…``, was answered
    "did you mean WORKQUEUE_TRACE_URL?"."""
    [said] = unknown_variables({"WORKQUEUE_POSTGRES_URL": "postgresql+asyncpg://u@h/db"})
    assert said.endswith("did you mean WORKQUEUE_DATABASE_URL? (its value is a database URL)"), said


def test_a_rate_above_the_largest_names_the_largest() -> None:
    with pytest.raises(ValueError, match="from 1 to 999,999,999"):
        Subscription(name="s", topic="t", handler_key="h", rate_limit="1000000000/s")


async def test_the_queue_warns_of_an_unknown_variable_when_it_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WORKQUEUE_SWEEPER_INTERVALL_MS", "500")
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", enabled=False))
    caplog.set_level(logging.WARNING, logger="fastapi_workqueue")
    async with queue.lifespan(None):
        pass
    [warning] = [r for r in caplog.records if "WORKQUEUE_SWEEPER_INTERVALL_MS" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert warning.getMessage().endswith("did you mean WORKQUEUE_SWEEPER_INTERVAL_MS?")


async def test_a_misspelt_database_url_with_none_set_stops_the_queue_and_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no database URL set, a variable that resembles WORKQUEUE_DATABASE_URL is a mis-deployed
    process: it fails at start instead of running on a default SQLite file of its own (a warning
    alone let a worker drain nothing and exit 0). With a URL set, the variable is only a warning."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORKQUEUE_DATABASE_URL", raising=False)
    monkeypatch.setenv("WORKQUEUE_DATABSE_URL", "postgresql+asyncpg://app@db.internal/orders")
    queue = WorkQueue(WorkQueueSettings(enabled=False))
    with pytest.raises(ConfigurationError) as raised:
        async with queue.lifespan(None):
            pass
    assert str(raised.value) == (
        "WORKQUEUE_DATABSE_URL is not a setting of fastapi-workqueue; did you mean WORKQUEUE_DATABASE_URL? No "
        f"database URL is set, so the queue would live in the default SQLite file {tmp_path / 'workqueue.db'}: "
        "name the variable WORKQUEUE_DATABASE_URL")
    assert not (tmp_path / "workqueue.db").exists()
    # An app's own lifespan that creates its tables before the queue's (docs/getting-started.md) is
    # refused too, before it writes them to a file nobody meant.
    with pytest.raises(ConfigurationError, match=r"did you mean WORKQUEUE_DATABASE_URL\? .* the app's sessions"):
        async with WorkQueue(WorkQueueSettings(enabled=False)).engine.begin():
            pass
    assert not (tmp_path / "workqueue.db").exists()
    env = {k: v for k, v in os.environ.items() if k != "WORKQUEUE_DATABASE_URL"}
    env["PYTHONPATH"] = ROOT
    worker = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "fastapi_workqueue", "work", "--app", "tests.apps.cli_app:queue",
                         "--subscription", "cli.basic", "--once"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert worker.returncode == 2, (worker.returncode, worker.stderr)
    assert "did you mean WORKQUEUE_DATABASE_URL?" in worker.stderr and "Traceback" not in worker.stderr
    # A name that does not resemble it, but a database URL for a value, is meant as it too.
    monkeypatch.delenv("WORKQUEUE_DATABSE_URL")
    monkeypatch.setenv("WORKQUEUE_POSTGRES_URL", "postgresql://app@db.internal/orders")
    with pytest.raises(ConfigurationError, match=r"^WORKQUEUE_POSTGRES_URL is not a setting .* name the variable"):
        async with WorkQueue(WorkQueueSettings(enabled=False)).lifespan(None):
            pass
    # A URL given: the stray variable only warns.
    async with WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}",
                                           enabled=False)).lifespan(None):
        pass


async def test_a_command_with_a_misspelt_database_url_refuses_instead_of_reading_the_default_file(
    tmp_path: Path,
) -> None:
    """``WORKQUEUE_POSTGRES_URL=postgresql://…`` with a ``workqueue.db`` in the folder: the app
    refuses, and a command answered from that file, which nobody meant."""
    (tmp_path / "workqueue.db").write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if k != "WORKQUEUE_DATABASE_URL"}
    env.update(PYTHONPATH=ROOT, WORKQUEUE_POSTGRES_URL="postgresql+asyncpg://app@db.internal/orders")
    command = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fastapi_workqueue", "stats"],
                                      env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert command.returncode == 2, (command.returncode, command.stderr)
    assert ("WORKQUEUE_POSTGRES_URL is not a setting of fastapi-workqueue; did you mean WORKQUEUE_DATABASE_URL?"
            in command.stderr), command.stderr
    assert "Traceback" not in command.stderr
    # An empty WORKQUEUE_DATABASE_URL: the app refuses it, and so does a command (it read the file).
    env = {k: v for k, v in env.items() if k != "WORKQUEUE_POSTGRES_URL"}
    env["WORKQUEUE_DATABASE_URL"] = ""
    command = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fastapi_workqueue", "stats"],
                                      env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert command.returncode == 2 and "WORKQUEUE_DATABASE_URL is set, but empty" in command.stderr, command.stderr


async def test_publishing_without_the_lifespan_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An app without the queue's lifespan answered publishes Accepted and logged nothing: its
    messages waited, and only health told. The first publish of such a process says so (a process
    that only publishes turns its host off and hears nothing); after the lifespan ended, health says
    it ended instead of telling to add it."""
    caplog.set_level(logging.WARNING, logger="fastapi_workqueue")
    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    topics, subs = [Topic(name="t")], [Subscription(name="s", topic="t", handler_key="h")]
    async with WorkQueue(WorkQueueSettings(database_url=url, enabled=False), topics=topics,
                         subscriptions=subs).lifespan(None):
        pass  # (the schema and the topic)
    queue = WorkQueue(WorkQueueSettings(database_url=url), topics=topics, subscriptions=subs)

    @queue.handler("h")
    async def handle(message: WorkMessage[Any]) -> None:
        pass

    for n in range(2):  # (as a request of the app does: in its session)
        async with queue.sessionmaker() as session, session.begin():
            [result] = await queue.publish("t", [PublishRequest(payload=n)], session=session)
        assert result.ok
    said = [r.getMessage() for r in caplog.records if "while the queue is not open" in r.getMessage()]
    assert len(said) == 1 and "the app's lifespan has not started it" in said[0], said
    assert "run the app with lifespan=queue.lifespan" in said[0]
    quiet = WorkQueue(WorkQueueSettings(database_url=url, disable_host=True), topics=topics, subscriptions=subs)
    caplog.clear()
    async with quiet.sessionmaker() as session, session.begin():
        await quiet.publish("t", [PublishRequest(payload="only publishes")], session=session)
    assert not [r for r in caplog.records if "while the queue is not open" in r.getMessage()]
    await quiet.engine.dispose()
    async with queue.lifespan(None):
        pass
    health = queue.health()
    assert health.status == "Stopped" and "has ended in this process" in (health.reason or ""), health
    assert [s.reason for s in health.subscriptions] == [
        "not served: the queue's lifespan has ended in this process (the app is stopping or has stopped)"]


@pytest.mark.parametrize("given", [PublishRequest(payload=1), {"Payload": 1}, "payload"])
async def test_a_publish_of_one_request_not_in_a_list_says_to_pass_a_list(tmp_path: Path, given: Any) -> None:
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", enabled=False))
    with pytest.raises(TypeError, match=r"publish takes a list of requests, got \w+: queue.publish\('t', "
                                        r"\[PublishRequest\(payload=...\)\]\)"):
        await queue.publish("t", given)


async def test_a_handler_no_subscription_names_is_a_warning_with_the_closest_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    queue = WorkQueue(
        WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", reconcile_interval_ms=0),
        topics=[Topic(name="orders")],
        subscriptions=[Subscription(name="orders.email", topic="orders", handler_key="orders.send-email")],
    )

    @queue.handler("orders.send-emial")
    async def send(message: WorkMessage[dict[str, str]]) -> None: ...

    caplog.set_level(logging.INFO, logger="fastapi_workqueue")
    async with queue.lifespan(None):
        health = queue.health()
    assert [s.state for s in health.subscriptions] == ["HandlerNotRegistered"]
    [warning] = [r for r in caplog.records if "is registered, but no subscription names it" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert warning.getMessage() == (
        "handler 'orders.send-emial' is registered, but no subscription names it; did you mean "
        "'orders.send-email' (subscription 'orders.email')?")


BLOCKED_EXTRAS = [
    ("prometheus_client",
     "from fastapi_workqueue import WorkQueue, WorkQueueSettings\n"
     "WorkQueue(WorkQueueSettings(database_url='sqlite+aiosqlite:///x.db')).metrics_router",
     "queue.metrics_router (/metrics) needs prometheus-client: install the prometheus extra, "
     "pip install 'fastapi-workqueue[prometheus]'"),
    ("opentelemetry",
     "import fastapi_workqueue.observability.otel",
     "tracing through OpenTelemetry needs opentelemetry-api: install the otel extra, "
     "pip install 'fastapi-workqueue[otel]'"),
    ("croniter",
     "from fastapi_workqueue import WorkQueue, WorkQueueSettings\n"
     "q = WorkQueue(WorkQueueSettings(database_url='sqlite+aiosqlite:///x.db'))\n"
     "@q.job('tidy')\n"
     "async def tidy(payload: dict) -> None: ...\n"
     "q.schedule(tidy, payload={}, cron='*/5 * * * *')",
     "schedule 'tidy' (a cron expression) needs croniter: install the jobs extra, "
     "pip install 'fastapi-workqueue[jobs]'"),
    ("jinja2",
     "from fastapi_workqueue import WorkQueue, WorkQueueSettings\n"
     "WorkQueue(WorkQueueSettings(database_url='sqlite+aiosqlite:///x.db')).dashboard()",
     "the dashboard needs jinja2: install the dashboard extra, pip install 'fastapi-workqueue[dashboard]'"),
    ("asyncpg",
     "from fastapi_workqueue import WorkQueue, WorkQueueSettings\n"
     "WorkQueue(WorkQueueSettings(database_url='postgresql+asyncpg://app@127.0.0.1/app')).engine",
     "PostgreSQL needs asyncpg: pip install 'fastapi-workqueue[postgres]'"),
    ("asyncpg",
     "from fastapi_workqueue.database import create_database_transport\n"
     "create_database_transport('postgres://app@127.0.0.1/app')",
     "PostgreSQL needs asyncpg: pip install 'fastapi-workqueue[postgres]'"),
]


@pytest.mark.parametrize(("module", "code", "message"), BLOCKED_EXTRAS, ids=[m for m, _, _ in BLOCKED_EXTRAS])
def test_a_missing_extra_is_named(tmp_path: Path, module: str, code: str, message: str) -> None:
    """Without an optional dependency, the feature that needs it says which extra to install."""
    script = f"import sys\nsys.modules[{module!r}] = None\n{code}\n"
    ran = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert ran.returncode == 1
    last = ran.stderr.strip().splitlines()[-1]
    assert last == f"fastapi_workqueue.core.errors.ConfigurationError: {message}"


async def test_a_host_name_that_does_not_resolve_says_to_check_the_url() -> None:
    queue = WorkQueue(WorkQueueSettings(database_url="postgresql+asyncpg://postgres@no-such-host.invalid:5432/x"))
    with pytest.raises(TransportUnavailable) as raised:
        async with queue.lifespan(None):
            pass
    message = str(raised.value)
    assert "the database host name does not resolve" in message
    assert message.endswith("check the host in WORKQUEUE_DATABASE_URL") and "retry later" not in message


async def test_health_names_the_switch_that_turned_the_host_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKQUEUE_DISABLE_HOST", "1")
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"))
    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.health_router)
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://test") as http:
        answer = await http.get("/health/extensions")
    assert answer.status_code == 200
    [body] = answer.json()["Extensions"]
    assert body["Status"] == "Disabled"
    assert body["Reason"] == "the host is off in this process: WORKQUEUE_DISABLE_HOST is on (disable_host=True)"


@pytest.mark.parametrize(("n", "text"), [(0, "0 deliveries"), (1, "1 delivery"), (2, "2 deliveries")])
def test_counts_read_as_english(n: int, text: str) -> None:
    assert count(n, "delivery") == text
    assert count(n, "handler") == text.replace("deliveries", "handlers").replace("delivery", "handler")


async def test_a_dispatch_delay_of_the_wrong_type_names_the_parameter_and_its_forms(tmp_path: Path) -> None:
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", enabled=False))

    @queue.job("reports.mail")
    async def mail(payload: dict[str, int]) -> None: ...

    async with queue.lifespan(None):
        for wrong in ("5m", True, [5]):
            with pytest.raises(TypeError) as raised:
                await queue.dispatch(mail, {"n": 1}, delay=wrong)  # type: ignore[arg-type]  # wrong on purpose
            assert str(raised.value) == (
                "delay must be a number of seconds (delay=300) or a timedelta (delay=timedelta(minutes=5)); "
                f"got {wrong!r}")
        for too_far in (float("nan"), 1e12):
            with pytest.raises(ValueError, match=r"delay must be a number of seconds from 0 to 3153600000 "
                                                 r"\(100 years\), got (nan|1000000000000.0); for a later run"):
                await queue.dispatch(mail, {"n": 1}, delay=too_far)
        assert await queue.size("default") == 0
        await queue.dispatch(mail, {"n": 1}, delay=300)
        assert await queue.size("default") == 1


async def test_the_apps_host_refuses_a_job_whose_timeout_does_not_fit_the_lease(tmp_path: Path) -> None:
    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}",
                                        job_lease_seconds=30, shutdown_drain_ms=8000))

    @queue.job("exports.build", timeout=25)
    async def build(payload: dict[str, int]) -> None: ...

    with pytest.raises(ConfigurationError) as raised:
        async with queue.lifespan(None):
            pass
    assert str(raised.value) == (
        "job(s) 'exports.build' (timeout 25 s): the timeout plus the stop timeout (8 s) does not fit in the job "
        "lease (30 s); lower the timeout or WORKQUEUE_SHUTDOWN_DRAIN_MS, or raise WORKQUEUE_JOB_LEASE_SECONDS")


async def test_a_password_with_a_slash_connects_and_never_shows(pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """SQLAlchemy reads a URL's password up to the ``@``, so ``/`` may stand in it unencoded (as in a
    generated base64 password); the queue's own connections read it the same way instead of taking
    its head for the port, and an error never repeats it."""
    secret = "Head99/tail+x"
    url = pg_url.replace("://postgres@", f"://postgres:{secret}@")
    assert url != pg_url
    queue = WorkQueue(WorkQueueSettings(database_url=url), topics=[Topic(name="slash.t")],
                      subscriptions=[Subscription(name="slash.s", topic="slash.t", handler_key="h")])
    await queue.open()
    try:
        [result] = await queue.publish("slash.t", [PublishRequest(payload={"n": 1})])
        assert result.status == "Accepted", result
        async with queue.sessionmaker() as session, session.begin():  # the request sessions read it alike
            [joined] = await queue.publish("slash.t", [PublishRequest(payload={"n": 2})], session=session)
        assert joined.status == "Accepted"
        assert len(await queue.deliveries("slash.s", "Pending")) == 2
    finally:
        await queue.close()
    missing = url.rsplit("/", 1)[0] + "/workqueue_no_such_database"
    with pytest.raises(ConfigurationError) as raised:
        await WorkQueue(WorkQueueSettings(database_url=missing)).open()
    assert "does not exist" in str(raised.value) and "Head99" not in str(raised.value)
    assert "Head99" not in caplog.text


def test_the_app_keys_are_masked_once_the_settings_are_read() -> None:
    """The app key, the earlier keys and the dashboard secret are masked in every redacted text as
    soon as settings hold them, whether or not an encrypted job or the dashboard ever uses them."""
    from cryptography.fernet import Fernet

    from fastapi_workqueue.core.redaction import redact

    key, old_one, old_two = (Fernet.generate_key().decode() for _ in range(3))
    secret = "dashboard-secret-" + Fernet.generate_key().decode()[:12]
    text = f"boom: {key} / {old_one} / {old_two} / {secret}"
    assert redact(text) == text
    WorkQueueSettings(app_key=key, previous_keys=f"{old_one}, {old_two}", dashboard_secret=secret)
    assert redact(text) == "boom: *** / *** / *** / ***"


async def test_libpqs_connect_timeout_in_the_url_is_the_connect_timeout(pg_url: str) -> None:
    """``?connect_timeout=5`` (libpq's parameter) is taken as the connection timeout by the queue's
    pool and by the request sessions, not sent to the server as a setting it does not know; a value
    that is no number of seconds is refused with how to write it."""
    queue = WorkQueue(WorkQueueSettings(database_url=f"{pg_url}?connect_timeout=5"),
                      topics=[Topic(name="timeout.t")])
    async with queue.lifespan(None):
        [own] = await queue.publish("timeout.t", [PublishRequest(payload=1)])
        async with queue.sessionmaker() as session, session.begin():
            [joined] = await queue.publish("timeout.t", [PublishRequest(payload=2)], session=session)
    await queue.engine.dispose()
    assert (own.status, joined.status) == ("Accepted", "Accepted")
    with pytest.raises(ConfigurationError, match=r"connect_timeout='soon' is not a number of seconds above 0"):
        await WorkQueue(WorkQueueSettings(database_url=f"{pg_url}?connect_timeout=soon")).open()


@pytest.mark.parametrize(("url", "says"), [
    ("mysql://app@127.0.0.1/app", "database URL scheme 'mysql' is not supported; use"),
    ("sqlite+aiosqlite:///:memory:", "SQLite needs a file that every connection and process of the queue shares"),
    ("sqlite+aiosqlite:///no/such/dir/app.db", "of the SQLite file 'no/such/dir/app.db' does not exist; create it"),
])
def test_the_request_sessions_engine_checks_its_url_as_the_queue_does(url: str, says: str) -> None:
    """``queue.engine`` (which an app's lifespan may use before the queue opens) refuses what the
    queue refuses, with the same words, instead of a driver's error."""
    with pytest.raises(ConfigurationError, match=says):
        WorkQueue(WorkQueueSettings(database_url=url)).engine  # noqa: B018 (made on first use)


def test_the_request_sessions_use_the_queues_async_driver_whatever_the_url_names(tmp_path: Path) -> None:
    engine = WorkQueue(WorkQueueSettings(database_url=f"sqlite+pysqlite:///{tmp_path / 'app.db'}")).engine
    assert engine.url.drivername == "sqlite+aiosqlite"
    engine = WorkQueue(WorkQueueSettings(database_url="postgresql+psycopg2://app@127.0.0.1/app")).engine
    assert engine.url.drivername == "postgresql+asyncpg"
    engine = WorkQueue(WorkQueueSettings(database_url="postgres://app@127.0.0.1/app")).engine
    assert engine.url.drivername == "postgresql+asyncpg"


async def test_health_names_what_the_host_would_run_while_it_cannot_read_the_store(
    database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SPEC §6: health answers 503 when a planned subscription is in Error. A host whose first
    reconcile cannot read the store's subscriptions (a login without EXECUTE on them, say) planned
    nothing: it reports what its plan and the code say it would run, in Error, until a reconcile
    reads them; then it runs them. No false "no subscription names it" warning meanwhile."""
    name = f"mc-{os.getpid()}-{id(caplog)}"
    queue = WorkQueue(
        WorkQueueSettings(database_url=database_url, auto_migrate=True, reconcile_interval_ms=200,
                          idle_poll_min_ms=20, idle_poll_max_ms=100),
        topics=[Topic(name=name)],
        subscriptions=[Subscription(name=f"{name}.s", topic=name, handler_key=f"{name}.work")],
    )
    done: list[int] = []

    @queue.handler(f"{name}.work")
    async def work(message: WorkMessage[dict[str, int]]) -> None:
        done.append(message.payload["n"])

    app = FastAPI(lifespan=queue.lifespan)
    app.include_router(queue.health_router)
    refused = True
    transport_class = type(queue.transport)
    real = transport_class.list_subscriptions

    async def list_subscriptions(self: Any, *args: Any, **kwargs: Any) -> Any:
        if refused:
            raise TransportUnavailable("permission denied for function list_subscriptions")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(transport_class, "list_subscriptions", list_subscriptions)
    caplog.set_level(logging.WARNING, logger="fastapi_workqueue")
    async with queue.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                      base_url="http://test") as http:
        answer = await http.get("/health/extensions")
        assert answer.status_code == 503, answer.text
        [body] = answer.json()["Extensions"]
        assert body["Status"] == "Degraded"
        assert [(s["Subscription"], s["State"]) for s in body["Subscriptions"]] == [(f"{name}.s", "Error")]
        assert "permission denied" not in answer.text  # (the driver's words stay in the log)
        await queue.publish(name, [PublishRequest(payload={"n": 1})])
        refused = False
        for _ in range(200):
            if done == [1]:
                break
            await asyncio.sleep(0.05)
        assert done == [1]
        assert (await http.get("/health/extensions")).status_code == 200
    assert not [r for r in caplog.records if "no subscription names it" in r.getMessage()]


def test_a_queue_left_open_in_another_event_loop_is_refused_at_the_next_open() -> None:
    """A queue opened at import time (``asyncio.run(queue.open())``) and never closed holds
    connections of a loop that no longer runs; the lifespan's open in the server's loop says so,
    instead of a host that stalls while health says Running."""
    from fastapi_workqueue.testing import MemoryTransport

    # (an in-memory store: nothing of it waits on a thread after the test, as an SQLite connection would)
    queue = WorkQueue(WorkQueueSettings(enabled=False), transport=MemoryTransport())
    asyncio.run(queue.open())

    async def lifespan() -> None:
        async with queue.lifespan(None):
            pass

    with pytest.raises(ConfigurationError, match=r"opened in an event loop that no longer runs .* and never closed"):
        asyncio.run(lifespan())


def test_a_queue_left_open_before_a_fork_is_refused_in_the_child() -> None:
    """The same, for a queue opened in a parent process that then forked (gunicorn's --preload)."""
    script = """
import asyncio, os, sys
from fastapi_workqueue import ConfigurationError, WorkQueue, WorkQueueSettings
from fastapi_workqueue.testing import MemoryTransport
queue = WorkQueue(WorkQueueSettings(enabled=False), transport=MemoryTransport())
asyncio.run(queue.open())
pid = os.fork()
if pid == 0:
    async def lifespan():
        async with queue.lifespan(None):
            pass
    try:
        asyncio.run(lifespan())
    except ConfigurationError as exc:
        print("refused:", exc, flush=True)
        os._exit(0)
    os._exit(1)
_, status = os.waitpid(pid, 0)
os._exit(os.waitstatus_to_exitcode(status))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused: the queue is open already, but it was opened in the parent process, before this one was " \
           "forked" in done.stdout


def test_a_queue_left_open_in_a_loop_that_stopped_but_was_not_closed_is_refused_too() -> None:
    """The older idiom, ``loop.run_until_complete(queue.open())`` on a loop that is never closed:
    that loop runs no more, so its connections serve nothing either."""
    from fastapi_workqueue.testing import MemoryTransport

    queue = WorkQueue(WorkQueueSettings(enabled=False), transport=MemoryTransport())
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(queue.open())

        async def lifespan() -> None:
            async with queue.lifespan(None):
                pass

        with pytest.raises(ConfigurationError, match=r"opened in an event loop that no longer runs"):
            asyncio.run(lifespan())
        loop.run_until_complete(queue.close())
    finally:
        loop.close()


def test_two_test_clients_at_once_share_the_queue(tmp_path: Path) -> None:
    """A queue another loop holds open while that loop still runs (a first TestClient's) is shared
    by a second TestClient's lifespan, as before: only an ended loop's, or a parent's, is refused."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # starlette's notice about httpx2, not what is tested
        from fastapi.testclient import TestClient

    queue = WorkQueue(WorkQueueSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", auto_migrate=True,
                                        enabled=False), topics=[Topic(name="t")])
    app = FastAPI(lifespan=queue.lifespan)

    @app.post("/p")
    async def publish() -> str:
        [result] = await queue.publish("t", [PublishRequest(payload={"n": 1})])
        return str(result.status.value)

    with TestClient(app) as first:
        assert first.post("/p").json() == "Accepted"
        with TestClient(app) as second:
            assert second.post("/p").json() == "Accepted"
            assert first.post("/p").json() == "Accepted"


async def test_an_empty_database_url_variable_is_named_as_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """It said "no database is configured: set WORKQUEUE_DATABASE_URL" to a process that had set it."""
    monkeypatch.setenv("WORKQUEUE_DATABASE_URL", "")
    queue = WorkQueue(WorkQueueSettings(enabled=False))
    with pytest.raises(ConfigurationError, match=r"^WORKQUEUE_DATABASE_URL is set, but empty: set "):
        async with queue.lifespan(None):
            pass


@pytest.mark.parametrize(("build", "says"), [
    (lambda: Subscription(name="s", topic="t", handler_key="h", max_attempt=3),  # type: ignore[call-arg]
     "Subscription has no field 'max_attempt'; did you mean 'max_attempts'?"),
    (lambda: Subscription(name="s", topic="t", handler_key="h", LeaseSecond=3),  # type: ignore[call-arg]
     "Subscription has no field 'LeaseSecond'; did you mean 'lease_seconds'?"),
    (lambda: Topic(name="t", transprt="aws"),  # type: ignore[call-arg]
     "Topic has no field 'transprt'; did you mean 'transport'?"),
    (lambda: Topic(name="t", xyzzy=1),  # type: ignore[call-arg]
     "Topic has no field 'xyzzy'; its fields: name, transport"),
])
def test_a_misspelt_argument_of_a_topic_or_subscription_names_the_field_it_resembles(build: Any, says: str) -> None:
    """pydantic said only "Extra inputs are not permitted"."""
    with pytest.raises(ValueError, match=re.escape(says)):
        build()
    assert Subscription(name="s", topic="t", handler_key="h", MaxAttempts=3).max_attempts == 3  # type: ignore[call-arg]


@pytest.mark.parametrize("database_url", [None, "unset", "memory://"])
async def test_a_request_session_on_the_memory_transport_says_to_test_on_sqlite(database_url: str | None) -> None:
    """docs/testing.md: an app whose endpoints take ``queue.session`` is tested on an SQLite file,
    not on MemoryTransport. Its first request there said the settings named another database, and
    each fix it offered (leave database_url unset, give the transport's URL) raised that the
    scheme 'memory' is not supported; now every way says what to do instead."""
    settings = WorkQueueSettings() if database_url == "unset" else WorkQueueSettings(database_url=database_url)
    queue = WorkQueue(settings, transport=MemoryTransport())
    app = FastAPI(lifespan=queue.lifespan)

    @app.post("/orders")
    async def create(session: AsyncSession = queue.session) -> dict[str, str]:
        return {"ok": "yes"}

    async with queue.lifespan(app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")
        async with http:
            with pytest.raises(ConfigurationError) as raised:
                await http.post("/orders")
    assert "MemoryTransport" in str(raised.value) and "sqlite+aiosqlite" in str(raised.value)
    assert "docs/testing.md" in str(raised.value) and "not supported" not in str(raised.value)
