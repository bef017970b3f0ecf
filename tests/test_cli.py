"""The ``workqueue`` command, run for real in subprocesses against the test database.

``work`` runs the handlers of ``tests/apps/cli_app.py`` (one topic per subscription). The two
runbooks of the operating guide are followed step by step with the commands an operator types.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from fastapi_workqueue import PublishRequest, Subscription, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.cli.work import (
    EXIT_CONFIGURATION,
    EXIT_HANDLER_NOT_REGISTERED,
    EXIT_UNKNOWN_SUBSCRIPTION,
    EXIT_UNSUPPORTED,
)
from fastapi_workqueue.core.processes import ProcessRegistry

from .apps import cli_app, lifespan_app
from .support import wait_for

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[1]
APP = "tests.apps.cli_app:queue"
COMMANDS = (
    "migrate", "publish", "stats", "dead-letters", "deliveries", "delivery", "partitions", "replay", "discard",
    "backlog", "pause", "resume", "validate-bindings", "api-keys", "prune", "sql", "work", "subscriptions", "topics",
    "attempts", "search",
)


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


class Cli:
    """Runs ``python -m fastapi_workqueue`` in a scratch folder, with the test database and the
    repository on the import path."""

    def __init__(self, url: str, folder: Path, ops: WorkQueue) -> None:
        self.url = url
        self.folder = folder
        self.ops = ops
        self.record = folder / "record.jsonl"
        self.fixed = folder / "fix-deployed"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
        self.env.update(PYTHONPATH=str(ROOT), WORKQUEUE_DATABASE_URL=url)
        self.env.update(CLI_APP_RECORD=str(self.record), CLI_APP_FIXED=str(self.fixed))
        self._stderr_files: dict[int, Path] = {}

    async def start(self, *args: str, env: dict[str, str] | None = None,
                    stderr: Path | None = None) -> asyncio.subprocess.Process:
        """The command, running; its stderr goes to the file ``stderr`` (which a test can read while
        it runs: what the worker logs is how the test sees it act) when given, to a pipe otherwise."""
        err_to: Any = asyncio.subprocess.PIPE if stderr is None else stderr.open("wb")
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fastapi_workqueue", *args, cwd=self.folder, env=env or self.env,
                stdout=asyncio.subprocess.PIPE, stderr=err_to,
            )
        finally:
            if stderr is not None:
                err_to.close()  # the child has its own copy
        if stderr is not None:
            self._stderr_files[proc.pid] = stderr
        return proc

    def stderr_so_far(self, proc: asyncio.subprocess.Process) -> str:
        """What a command started with ``stderr=`` has written to its stderr so far."""
        return self._stderr_files[proc.pid].read_text()

    async def finish(self, proc: asyncio.subprocess.Process, within: float = 30) -> Result:
        try:
            out, err = await asyncio.wait_for(proc.communicate(), within)
        except TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
            raise AssertionError(f"the command did not end within {within} s: {out!r} {err!r}") from None
        assert proc.returncode is not None
        err_file = self._stderr_files.pop(proc.pid, None)
        return Result(proc.returncode, out.decode(), err.decode() if err_file is None else err_file.read_text())

    async def __call__(self, *args: str, expect: int | None = 0, within: float = 30,
                       env: dict[str, str] | None = None) -> Result:
        result = await self.finish(await self.start(*args, env=env), within)
        if expect is not None:
            assert result.code == expect, f"workqueue {' '.join(args)} exited {result.code}: {result.err or result.out}"
        return result

    async def json(self, *args: str, expect: int | None = 0) -> Any:
        """The command with ``--json`` after it (``workqueue --json <command>`` works too)."""
        return (await self(*args, "--json", expect=expect)).json()

    async def work(self, subscription: str, *args: str, expect: int | None = 0, within: float = 30) -> Result:
        return await self("work", "--app", APP, "--subscription", subscription, *args, expect=expect, within=within)

    async def publish(self, topic: str, payload: Any, *args: str) -> list[str]:
        results = await self.json("publish", "--topic", topic, "--payload", json.dumps(payload), *args)
        assert all(r["Status"] == "Accepted" for r in results), results
        return [r["MessageID"] for r in results]

    def records(self, subscription: str, event: str | None = None) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        rows = [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]
        return [r for r in rows if r["subscription"] == subscription and (event is None or r["event"] == event)]

    async def wait_record(self, subscription: str, event: str, count: int = 1, within: float = 20) -> None:
        await wait_for(lambda: len(self.records(subscription, event)) >= count, within=within, interval=0.05,
                       describe=lambda: f"{event!r} records for {subscription}: {self.records(subscription, event)}")


@pytest.fixture(scope="module")
async def cli(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cli]:
    """The CLI app's topology in the test database, and a queue of our own to look at it."""
    ops = WorkQueue(
        WorkQueueSettings(database_url=pg_url, enabled=False),
        topics=[*cli_app.queue.topics.values(), *lifespan_app.queue.topics.values()],
        subscriptions=[*cli_app.queue.subscriptions.values(), *lifespan_app.queue.subscriptions.values()],
    )
    async with ops.lifespan(None):
        yield Cli(pg_url, tmp_path_factory.mktemp("cli"), ops)


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got {text!r}"
    return lines[0]


def reason(err: str) -> str:
    """The one line ``workqueue work`` ends with on stderr, among its log lines."""
    lines = [line for line in err.splitlines() if line.startswith("workqueue work:")]
    assert len(lines) == 1, f"expected one reason line, got {err!r}"
    return lines[0]


def log_lines(err: str, level: str) -> list[str]:
    return [line for line in err.splitlines() if f" {level} " in line]


# -- the command, its database URL, migrate, validate-bindings -----------------------------------


async def test_entry_point_help_and_database_url(cli: Cli) -> None:
    entry = Path(sys.executable).parent / "workqueue"
    proc = await asyncio.create_subprocess_exec(
        str(entry), "--help", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli.env
    )
    help_text = (await cli.finish(proc)).out
    for command in COMMANDS:
        assert f"  {command} " in help_text or f"  {command}\n" in help_text, command

    no_url = {k: v for k, v in cli.env.items() if k != "WORKQUEUE_DATABASE_URL"}
    missing = await cli("stats", env=no_url, expect=2)
    assert "WORKQUEUE_DATABASE_URL" in missing.err and "--database-url" in missing.err
    # With nothing configured an app uses ./workqueue.db; the command finds that file too.
    await cli("--database-url", "sqlite+aiosqlite:///workqueue.db", "migrate", env=no_url)
    found = await cli("--json", "stats", env=no_url)
    assert found.json() == [] and "workqueue.db" in found.err
    # A misspelt database URL variable is named, with the one it meant, and the command refuses, as
    # the app does: it would read ./workqueue.db, not the database the operator meant.
    typo = await cli("--json", "stats", env={**no_url, "WORKQUEUE_DATABSE_URL": cli.url}, expect=2)
    assert ("Error: WORKQUEUE_DATABSE_URL is not a setting of fastapi-workqueue; did you mean "
            "WORKQUEUE_DATABASE_URL? No database URL is set") in typo.err, typo.err
    # So is a value an app would refuse to start with; the operator command still runs.
    bad_value = await cli("--json", "stats", env={**no_url, "WORKQUEUE_POOL_SIZE": "ten"})
    assert bad_value.json() == []
    assert ("warning: WORKQUEUE_POOL_SIZE (WorkQueueSettings.pool_size): Input should be a valid integer, unable "
            "to parse string as an integer; an app started with these variables would refuse to start"
            ) in bad_value.err.splitlines()
    (cli.folder / "workqueue.db").unlink()
    # A URL that cannot be read says what to change, without the password it holds: an operator
    # command exits 1, `work` 2 (bad configuration).
    malformed = "postgresql+asyncpg//app:s3cret-pw@127.0.0.1/db"
    bad = await cli("--database-url", malformed, "stats", env=no_url, expect=1)
    assert "the database URL does not start with a scheme and '://'" in bad.err and "s3cret" not in bad.err
    bad_work = await cli("work", "--app", APP, "--subscription", cli_app.IDLE, "--once",
                         env={**no_url, "WORKQUEUE_DATABASE_URL": malformed}, expect=2)
    assert "does not start with a scheme and '://'" in reason(bad_work.err) and "s3cret" not in bad_work.err
    # Before the command or after it.
    [stats] = (await cli("--database-url", cli.url, "--json", "stats", "--subscription", cli_app.IDLE,
                         env=no_url)).json()
    assert stats["Subscription"] == cli_app.IDLE
    after = await cli("backlog", "--subscription", cli_app.IDLE, "--database-url", cli.url, "--json", env=no_url)
    assert after.json() == {"Subscription": cli_app.IDLE, "Claimable": 0, "InFlight": 0, "Backlog": 0}
    worked = await cli("work", "--app", APP, "--subscription", cli_app.IDLE, "--once", "--database-url", cli.url,
                       env=no_url)
    assert worked.out.strip().endswith("ran 0 deliveries")


async def test_migrate_and_validate_bindings(cli: Cli) -> None:
    assert (await cli("migrate")).out.strip() == "the schema is up to date"
    assert await cli.json("migrate") == {"Applied": []}
    report = await cli.json("validate-bindings")
    assert report["Ok"] is True and report["Issues"] == []
    assert "ok" in (await cli("validate-bindings")).out


# -- publish, stats, backlog, dead letters, replay, discard, prune ------------------------------


async def test_publish_stats_backlog_dead_letters_replay_discard(cli: Cli) -> None:
    sub = cli_app.BASIC
    ids = await cli.publish(sub, {"n": 1}, "--count", "3")
    assert len(set(ids)) == 3
    [failing] = await cli.publish(sub, {"fail": True}, "--attribute", "kind=bad", "--correlation-id", "c-1")
    table = await cli("publish", "--topic", sub, "--payload", '{"n": 4}')
    assert "Accepted" in table.out and "MessageID" in table.out

    [stats] = await cli.json("stats", "--subscription", sub)
    assert (stats["Pending"], stats["Claimable"], stats["InFlight"], stats["DeadLettered"]) == (5, 5, 0, 0)
    assert await cli.json("backlog", "--subscription", sub) == {
        "Subscription": sub, "Claimable": 5, "InFlight": 0, "Backlog": 5,
    }
    assert sub in (await cli("stats")).out and "Claimable" in (await cli("backlog", "--subscription", sub)).out
    # docs/production.md: `workqueue stats` shows "the oldest Pending delivery's time" (the table too)
    header, row = (await cli("stats", "--subscription", sub)).out.splitlines()
    assert header.split()[-1] == "OldestPendingAt"
    assert row.split()[-1] == stats["OldestPendingAt"][:19] + "+00:00", (row, stats)

    ran = await cli.work(sub, "--once", "--max", "10")
    assert one_line(ran.out) == f"workqueue work: {sub}: ran 5 deliveries"
    [stats] = await cli.json("stats", "--subscription", sub)
    assert (stats["Pending"], stats["Completed"], stats["DeadLettered"]) == (0, 4, 1)

    [dead] = await cli.json("dead-letters", "--subscription", sub)
    assert dead["MessageID"] == failing and "cannot handle" in dead["Reason"] and dead["Payload"] is None
    assert dead["Attributes"] == {"kind": "bad"} and dead["CorrelationID"] == "c-1"
    [with_payload] = await cli.json("dead-letters", "--subscription", sub, "--payload")
    assert with_payload["Payload"] == {"fail": True}
    assert dead["DeliveryID"] in (await cli("dead-letters", "--subscription", sub)).out
    completed = await cli.json("deliveries", "--subscription", sub, "--status", "Completed")
    assert {d["MessageID"] for d in completed} >= set(ids)

    replayed = await cli.json("replay", "--subscription", sub, "--delivery", dead["DeliveryID"], "--note", "retry")
    assert replayed == {"Result": "Replayed", "DeliveryID": dead["DeliveryID"], "Subscription": sub,
                        "CancelRequested": False, "Status": "Pending"}
    again = await cli("replay", "--subscription", sub, "--delivery", dead["DeliveryID"], expect=1)
    assert "NotDeadLettered" in again.out
    [pending] = await cli.json("deliveries", "--subscription", sub, "--status", "Pending")
    assert (pending["MessageID"], pending["Note"], pending["Attempt"]) == (failing, "retry", 0)

    discarded = await cli.json("discard", "--subscription", sub, "--delivery", dead["DeliveryID"],
                               "--reason", "not needed")
    assert (discarded["Result"], discarded["CancelRequested"]) == ("Discarded", False)
    again = await cli("discard", "--subscription", sub, "--delivery", dead["DeliveryID"], "--reason", "x", expect=1)
    assert "AlreadyTerminal" in again.out
    missing = await cli.json("replay", "--subscription", sub, "--delivery", "999999999", expect=1)
    assert missing["Result"] == "NotFound"
    message_id = str(uuid.uuid4())  # a MessageID (or a job's id) where a DeliveryID goes
    by_message = await cli("discard", "--subscription", sub, "--delivery", message_id, expect=1)
    assert f"`workqueue search {message_id}` lists its deliveries" in by_message.err
    assert f"`workqueue jobs cancel {message_id}`" in by_message.err
    unknown = await cli("dead-letters", "--subscription", "cli.nope", expect=1)
    assert "does not exist" in one_line(unknown.err)
    refused = await cli("publish", "--topic", "cli.nope", "--payload", "1", expect=1)
    assert "does not exist" in refused.err

    # prune: terminal deliveries settled longer ago than --older-than.
    assert (await cli("prune", "--older-than", "7d")).out.startswith("removed 0 deliveries")
    removed = await cli.json("prune", "--older-than", "0")
    assert removed["Removed"] >= 5
    [stats] = await cli.json("stats", "--subscription", sub)
    assert (stats["Completed"], stats["Discarded"]) == (0, 0)
    assert "is not a duration" in (await cli("prune", "--older-than", "soon", expect=2)).err


async def test_tables_and_one_delivery_show_the_cause_of_an_error_and_no_secret(cli: Cli) -> None:
    sub = cli_app.BASIC
    cause = "caused by: SMTP 554 for postgresql://mailer:hunter2@smtp.internal/out, mailbox full"
    error = "while sending the receipt\n" + "  a frame of the traceback\n" * 5 + cause
    [message] = await cli.publish(sub, {"fail": error, "order": 7}, "--partition-key", "customer-7")
    await cli.work(sub, "--once", "--max", "10")
    dead = next(d for d in await cli.json("dead-letters", "--subscription", sub) if d["MessageID"] == message)
    assert "hunter2" not in json.dumps(dead) and dead["LastError"].endswith(cause.replace("hunter2", "***"))

    listing = (await cli("dead-letters", "--subscription", sub, "--payload")).out
    header = listing.splitlines()[0].split()
    assert {"Topic", "ClaimedAt", "LeaseExpiresAt", "VisibleAt", "LastError", "Payload"} <= set(header), header
    lines = listing.splitlines()
    [at] = [i for i, line in enumerate(lines) if dead["DeliveryID"] in line]
    # A long cell wraps onto the next lines of its row (their first column is blank).
    row = " ".join([lines[at], *itertools.takewhile(lambda line: line.startswith(" "), lines[at + 1:])])
    assert '{"fail":' in row, row  # the payload column, with --payload
    assert "mailbox full" in row and "hunter2" not in listing  # the cause, at the end of a long last line
    assert "Payload" not in (await cli("dead-letters", "--subscription", sub)).out.splitlines()[0]
    columns = (await cli("deliveries", "--subscription", sub, "--status", "DeadLettered")).out.splitlines()[0]
    assert {"Topic", "Status", "ClaimedAt", "LeaseExpiresAt", "VisibleAt", "LastError"} <= set(columns.split())

    whole = await cli("delivery", dead["DeliveryID"])
    fields = {line.split()[0]: line for line in whole.out.splitlines() if line and not line.startswith(" ")}
    for name in ("Status", "Attempt", "MaxAttempts", "LeaseExpiresAt", "ProgressPercent", "Reason", "LastError",
                 "CreatedAt", "ClaimedAt", "SettledAt", "Attributes", "Topic", "Payload"):
        assert name in fields, name
    assert fields["Topic"].split()[1] == cli_app.BASIC and fields["Status"].split()[1] == "DeadLettered"
    assert fields["PartitionKey"].split()[1] == "customer-7" and fields["Payload"].split()[1] == "-"
    assert cause.replace("hunter2", "***") in whole.out and "hunter2" not in whole.out  # every line of it
    with_payload = await cli.json("delivery", dead["DeliveryID"], "--payload")
    assert with_payload["Payload"] == {"fail": error, "order": 7} and with_payload["Subscription"] == sub
    assert "hunter2" not in with_payload["LastError"] + with_payload["Reason"]
    missing = await cli("delivery", "999999999", expect=1)
    assert "does not exist" in one_line(missing.err)

    # Its attempts, and finding it by what an operator has at hand.
    attempts = await cli.json("attempts", dead["DeliveryID"])
    assert [a["Outcome"] for a in attempts][-1] == "DeadLettered" and attempts[-1]["Attempt"] == dead["Attempt"]
    assert attempts[-1]["Error"].endswith(cause.replace("hunter2", "***")) and "hunter2" not in json.dumps(attempts)
    shown = (await cli("attempts", dead["DeliveryID"])).out
    assert shown.splitlines()[0].split() == ["Attempt", "Outcome", "StartedAt", "EndedAt", "Reason", "Error"]
    assert "mailbox full" in shown and "hunter2" not in shown
    assert "does not exist" in one_line((await cli("attempts", "999999999", expect=1)).err)
    found = await cli.json("search", message)
    assert [(f["Matched"], f["Delivery"]["DeliveryID"]) for f in found] == [("MessageID", dead["DeliveryID"])]
    by_key = (await cli("search", "customer-7", "--limit", "100")).out
    assert by_key.splitlines()[0].split()[:3] == ["Matched", "Subscription", "DeliveryID"]
    assert any(dead["DeliveryID"] in line and "partition key" in line for line in by_key.splitlines())
    assert (await cli("search", f"nobody-{uuid.uuid4().hex}")).out.startswith("nothing matches")
    await cli("discard", "--subscription", sub, "--delivery", dead["DeliveryID"])


async def test_pause_resume_and_work_on_a_paused_subscription(cli: Cli) -> None:
    sub = cli_app.PAUSED
    assert await cli.json("pause", "--subscription", sub) == {"Subscription": sub, "Status": "Paused", "Changed": True}
    assert "(it already was)" in (await cli("pause", "--subscription", sub)).out
    await cli.publish(sub, {"n": 1})
    assert (await cli.json("backlog", "--subscription", sub))["Claimable"] == 0

    paused = await cli.work(sub, "--once")
    assert "paused" in one_line(paused.out)
    [stats] = await cli.json("stats", "--subscription", sub)
    assert (stats["Status"], stats["Pending"]) == ("Paused", 1)

    assert (await cli.json("resume", "--subscription", sub))["Changed"] is True
    assert (await cli("resume", "--subscription", sub)).out.strip() == f"{sub}: Active (it already was)"
    ran = await cli.work(sub, "--once")
    assert one_line(ran.out).endswith("ran 1 delivery")
    assert (await cli("pause", "--subscription", "cli.nope", expect=1)).err.strip().endswith("does not exist")


async def test_a_long_running_worker_waits_through_a_pause_and_resumes(cli: Cli, tmp_path: Path) -> None:
    sub = cli_app.PAUSED
    await cli("pause", "--subscription", sub)
    # The app re-plans every second; what the worker logs says what it did.
    proc = await cli.start("work", "--app", APP, "--subscription", sub, stderr=tmp_path / "worker.err")

    async def logged(line: str, times: int = 1) -> None:
        """Until the worker has logged ``line`` ``times`` times; fails at once if it exited."""
        def seen() -> bool:
            assert proc.returncode is None, f"the worker exited: {cli.stderr_so_far(proc)}"
            return cli.stderr_so_far(proc).count(line) >= times

        await wait_for(seen, within=20, describe=lambda: cli.stderr_so_far(proc))

    try:
        await logged("waiting for resume")  # it stays up
        await cli("resume", "--subscription", sub)
        await logged(f"{sub}: running")  # the next plan starts its consumer
        [first] = await cli.publish(sub, {"n": "first"})
        await wait_for(lambda: delivery_done(cli, sub, first))
        await cli("pause", "--subscription", sub)  # paused mid-run: the worker stays up
        await logged(f"{sub}: pausing")  # and its consumer has stopped claiming (it logs, then pauses it)
        [second] = await cli.publish(sub, {"n": "second"})
        assert not await delivery_done(cli, sub, second)
        await cli("resume", "--subscription", sub)
        await logged(f"{sub}: resumed")
        await wait_for(lambda: delivery_done(cli, sub, second))
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        result = await cli.finish(proc, within=20)
        await cli("resume", "--subscription", sub)
    assert result.code == 0, result.err
    assert "waiting for resume" in result.err
    assert one_line(result.out).endswith("ran 2 deliveries")


async def delivery_done(cli: Cli, subscription: str, message_id: str) -> bool:
    completed = await cli.ops.deliveries(subscription, "Completed", limit=1000)
    return any(str(d.message_id) == message_id for d in completed)


# -- work: exit codes and budgets ----------------------------------------------------------------


async def test_work_exit_codes(cli: Cli) -> None:
    empty = await cli.work(cli_app.IDLE, "--once")
    assert one_line(empty.out) == f"workqueue work: {cli_app.IDLE}: ran 0 deliveries"
    assert not log_lines(empty.err, "WARNING") and not log_lines(empty.err, "ERROR"), empty.err

    # The rest are independent of each other: run them at once.
    bad_apps = ("tests.apps.nothing_here:queue", "tests.apps.cli_app:missing", "tests.apps.cli_app", "json:loads")
    unknown, orphan, external, unsupported, no_db, *bad = await asyncio.gather(
        cli.work("cli.nope", "--once", expect=EXIT_UNKNOWN_SUBSCRIPTION),
        cli.work(cli_app.ORPHAN, "--once", expect=EXIT_HANDLER_NOT_REGISTERED),
        cli.work(cli_app.EXTERNAL, "--once", expect=EXIT_UNSUPPORTED),
        cli.work(cli_app.IDLE, "--once", "--database-url", "mysql://nobody@127.0.0.1/app", expect=EXIT_CONFIGURATION),
        cli("--database-url", "postgresql+asyncpg://postgres@127.0.0.1:5432/no_such_database_here",
            "work", "--app", APP, "--subscription", cli_app.IDLE, "--once", expect=None),
        *(cli("work", "--app", app, "--subscription", cli_app.IDLE, "--once", expect=EXIT_CONFIGURATION)
          for app in bad_apps),
    )
    assert "does not exist" in reason(unknown.err) and unknown.out == ""
    assert "HandlerNotRegistered" in reason(orphan.err)
    assert "served outside this host" in reason(external.err)
    assert "not supported" in reason(unsupported.err)
    assert no_db.code != 0 and "no_such_database_here" in reason(no_db.err)
    assert all(reason(b.err).startswith("workqueue work: --app") for b in bad)


async def test_work_max_receives_exactly_n_and_max_duration_stops(cli: Cli) -> None:
    sub = cli_app.SLOW
    await cli.publish(sub, {"n": 1}, "--count", "5")
    three = await cli.work(sub, "--once", "--max", "3", "--concurrency", "1")
    assert one_line(three.out).endswith("ran 3 deliveries")
    assert len(cli.records(sub, "done")) == 3
    [stats] = await cli.json("stats", "--subscription", sub)
    assert (stats["Pending"], stats["Completed"]) == (2, 3)

    two = await cli.work(sub, "--max", "2")  # long-running mode: ends when its budget is spent
    assert one_line(two.out).endswith("ran 2 deliveries")
    [stats] = await cli.json("stats", "--subscription", sub)
    assert (stats["Pending"], stats["Completed"]) == (0, 5)

    started = time.monotonic()
    idle = await cli.work(cli_app.IDLE, "--max-duration-ms", "1500")
    took = time.monotonic() - started
    assert one_line(idle.out).endswith("ran 0 deliveries")
    assert 1.5 <= took < 15


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_drains_the_running_handler_and_exits_0(cli: Cli, sig: signal.Signals) -> None:
    sub = cli_app.SLOW
    done = len(cli.records(sub, "done"))
    started = len(cli.records(sub, "started"))
    [message] = await cli.publish(sub, {"sleep": 1.5})
    proc = await cli.start("work", "--app", APP, "--subscription", sub, "--shutdown-drain-ms", "5000")
    await cli.wait_record(sub, "started", started + 1)
    proc.send_signal(sig)
    result = await cli.finish(proc, within=20)
    assert result.code == 0, result.err
    assert one_line(result.out).endswith("ran 1 delivery")
    assert len(cli.records(sub, "done")) == done + 1
    completed = await cli.json("deliveries", "--subscription", sub, "--status", "Completed", "--limit", "1000")
    assert message in {d["MessageID"] for d in completed}


async def test_a_handler_longer_than_the_drain_is_released_without_spending_its_attempt(cli: Cli) -> None:
    sub = cli_app.SLOW
    started = len(cli.records(sub, "started"))
    [message] = await cli.publish(sub, {"sleep": 30})
    proc = await cli.start("work", "--app", APP, "--subscription", sub, "--shutdown-drain-ms", "300")
    await cli.wait_record(sub, "started", started + 1)
    proc.send_signal(signal.SIGTERM)
    result = await cli.finish(proc, within=20)
    assert result.code == 0, result.err
    assert cli.records(sub, "aborted")[-1]["reason"] == "Shutdown"
    [pending] = await cli.json("deliveries", "--subscription", sub, "--status", "Pending")
    assert (pending["MessageID"], pending["Attempt"]) == (message, 0)
    dropped = await cli.json("discard", "--subscription", sub, "--delivery", pending["DeliveryID"], "--reason", "test")
    assert dropped["Result"] == "Discarded"


async def test_a_handler_that_ignores_the_stop_is_left_behind_and_the_worker_exits(cli: Cli) -> None:
    """After the drain the delivery goes back to Pending (SPEC 4), so another worker may take it: a
    handler that ignores the stop must not go on beside that one, nor keep the worker up for it."""
    sub = cli_app.SLOW
    started = len(cli.records(sub, "started"))
    [message] = await cli.publish(sub, {"stubborn": 120})
    proc = await cli.start("work", "--app", APP, "--subscription", sub, "--shutdown-drain-ms", "300")
    await cli.wait_record(sub, "started", started + 1)
    proc.send_signal(signal.SIGTERM)
    result = await cli.finish(proc, within=30)  # not the 120 s the handler would take
    assert result.code == 0, result.err
    assert cli.records(sub, "ignored")[-1]["reason"] == "Shutdown"
    assert "1 handler still run after the stop; their deliveries were released (back to Pending" in result.err
    [pending] = await cli.json("deliveries", "--subscription", sub, "--status", "Pending")
    assert (pending["MessageID"], pending["Attempt"]) == (message, 0)
    assert (await cli.json("discard", "--subscription", sub, "--delivery", pending["DeliveryID"], "--reason", "test")
            )["Result"] == "Discarded"


# -- work --app MODULE:app: the app's lifespan, its state and its overrides ---------------------

LIFESPAN_APP = "tests.apps.lifespan_app:app"


async def test_work_runs_the_apps_lifespan_and_its_handlers_see_the_app(cli: Cli) -> None:
    sub = lifespan_app.SUBSCRIPTION
    [message] = await cli.publish(sub, {"n": 1})
    ran = await cli("work", "--app", LIFESPAN_APP, "--subscription", sub, "--once")
    assert one_line(ran.out) == f"workqueue work: {sub}: ran 1 delivery"
    events = cli.records(sub)
    assert [e["event"] for e in events] == ["startup", "started", "done", "shutdown"]
    assert events[0]["host_running"] is False  # the lifespan started no host of its own
    assert (events[2]["greeting"], events[2]["mailer"]) == ("set by the lifespan", "the overridden mailer")
    [completed] = await cli.json("deliveries", "--subscription", sub, "--status", "Completed")
    assert completed["MessageID"] == message
    # What an operator sees: the database (no password here to mask), the plan, the delivery's ids.
    [starting] = [line for line in ran.err.splitlines() if "worker starting" in line]
    assert cli.url in starting and f"subscription {sub}, concurrency 4" in starting
    [handled] = [line for line in ran.err.splitlines() if "handled with" in line]
    assert f"[subscription={sub} delivery_id={completed['DeliveryID']} message_id={message} attempt=1]" in handled


async def test_sigterm_drains_the_worker_before_the_apps_lifespan_shuts_down(cli: Cli) -> None:
    sub = lifespan_app.SUBSCRIPTION
    before = len(cli.records(sub))
    await cli.publish(sub, {"sleep": 1.5})
    proc = await cli.start("work", "--app", LIFESPAN_APP, "--subscription", sub, "--shutdown-drain-ms", "5000")
    await cli.wait_record(sub, "started", len(cli.records(sub, "started")) + 1)
    proc.send_signal(signal.SIGTERM)
    result = await cli.finish(proc, within=20)
    assert result.code == 0, result.err
    assert one_line(result.out).endswith("ran 1 delivery")
    assert [e["event"] for e in cli.records(sub)[before:]] == ["startup", "started", "done", "shutdown"]


async def test_a_handler_that_needs_the_app_refuses_to_start_without_it(cli: Cli) -> None:
    sub = lifespan_app.SUBSCRIPTION
    await cli.publish(sub, {"n": "waits"})
    [before] = await cli.json("stats", "--subscription", sub)
    refused = await cli("work", "--app", "tests.apps.lifespan_app:queue", "--subscription", sub, "--once",
                        expect=EXIT_CONFIGURATION)
    line = reason(refused.err)
    assert "handler 'cli.lifespan' -> greeting -> request takes a Request" in line
    assert "point --app at the FastAPI or Starlette app" in line
    [after] = await cli.json("stats", "--subscription", sub)
    assert (after["Pending"], after["DeadLettered"]) == (before["Pending"], before["DeadLettered"])  # none ran
    await cli("work", "--app", LIFESPAN_APP, "--subscription", sub, "--once", "--max", "100")


async def test_work_finds_the_queue_of_an_app_or_says_how_to_point_at_it(cli: Cli) -> None:
    hidden, none, several = await asyncio.gather(
        cli("work", "--app", "tests.apps.hidden_queue_app:app", "--subscription", "cli.hidden", "--once"),
        cli("work", "--app", "tests.apps.hidden_queue_app:plain", "--subscription", "cli.hidden", "--once",
            expect=EXIT_CONFIGURATION),
        cli("work", "--app", "tests.apps.two_queues_app:app", "--subscription", "cli.hidden", "--once",
            expect=EXIT_CONFIGURATION),
    )
    assert one_line(hidden.out) == "workqueue work: cli.hidden: ran 0 deliveries"  # from the lifespan's state
    assert "no WorkQueue found" in reason(none.err) and "app.state.queue = queue" in reason(none.err)
    several_line = reason(several.err)
    assert "several WorkQueues (tests.apps.two_queues_app.billing, tests.apps.two_queues_app.orders)" in several_line
    assert "app.state.queue = queue" in several_line


async def test_an_app_that_fails_to_import_is_one_line_and_its_traceback_is_verbose(cli: Cli) -> None:
    args = ("work", "--app", "tests.apps.broken_app:app", "--subscription", "cli.hidden", "--once")
    broken, verbose = await asyncio.gather(
        cli(*args, expect=EXIT_CONFIGURATION), cli("--verbose", *args, expect=EXIT_CONFIGURATION),
    )
    assert one_line(broken.err) == (
        "workqueue work: --app 'tests.apps.broken_app:app': importing 'tests.apps.broken_app' raised RuntimeError: "
        "the settings file /etc/orders.toml is missing (--verbose shows the traceback)"
    )
    assert "Traceback (most recent call last)" in verbose.err and 'broken_app.py", line' in verbose.err


async def test_malformed_subscriptions_stop_the_worker_in_one_line(cli: Cli) -> None:
    results = await asyncio.gather(*(
        cli("work", "--app", LIFESPAN_APP, "--subscription", lifespan_app.SUBSCRIPTION, "--once",
            expect=EXIT_CONFIGURATION, env={**cli.env, "WORKQUEUE_SUBSCRIPTIONS": value})
        for value in ("[{name: '*'}]", '{"name": "*", "concurrency": 2}')
    ))
    for result in results:
        line = one_line(result.err)
        assert "raised ConfigurationError: WORKQUEUE_SUBSCRIPTIONS" in line, line
        assert "for example WORKQUEUE_SUBSCRIPTIONS=" in line


async def test_the_start_up_line_masks_the_database_password(cli: Cli) -> None:
    with_password = cli.url.replace("postgres@", "postgres:s3cret-pw@")
    ran = await cli("--database-url", with_password, "work", "--app", APP, "--subscription", cli_app.IDLE, "--once")
    [starting] = [line for line in ran.err.splitlines() if "worker starting" in line]
    assert "s3cret-pw" not in ran.err and "postgres:***@127.0.0.1" in starting


async def test_work_prints_a_json_summary_and_logs_json_lines(cli: Cli) -> None:
    sub = lifespan_app.SUBSCRIPTION
    await cli.publish(sub, {"n": "json"})
    ran = await cli("work", "--app", LIFESPAN_APP, "--subscription", sub, "--once", "--json", "--log-format", "json")
    assert json.loads(one_line(ran.out)) == {
        "ExitCode": 0, "Reason": f"{sub}: ran 1 delivery", "Subscription": sub,
        "Claimed": 1, "Settled": 1, "Completed": 1,
    }
    records = [json.loads(line) for line in ran.err.splitlines()]
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    [handled] = [r for r in records if r["message"].startswith("handled with")]
    assert (handled["level"], handled["logger"], handled["subscription"], handled["attempt"]) == (
        "INFO", "fastapi_workqueue.handler.cli.lifespan", sub, 1)
    assert handled["delivery_id"] and handled["message_id"]
    quiet = await cli("--json", "work", "--app", APP, "--subscription", "cli.nope", "--once", "--log-level", "error",
                      expect=EXIT_UNKNOWN_SUBSCRIPTION)
    summary = json.loads(one_line(quiet.out))
    assert (summary["ExitCode"], summary["Claimed"]) == (EXIT_UNKNOWN_SUBSCRIPTION, 0)
    assert "does not exist" in summary["Reason"] and one_line(quiet.err) == f"workqueue work: {summary['Reason']}"


# -- API keys ------------------------------------------------------------------------------------


async def test_api_keys_create_list_revoke(cli: Cli) -> None:
    created = await cli.json("api-keys", "create", "--name", "ci-producer", "--scopes",
                             "workqueue:read, workqueue:publish", "--expires-in", "1h")
    key = created["Key"]
    assert key.startswith(f"wq_{created['Prefix']}_")
    assert created["Scopes"] == ["workqueue:publish", "workqueue:read"] and created["ExpiresAt"]
    plain = await cli("api-keys", "create", "--name", "ops", "--scopes", "workqueue:operate")
    ops_key = one_line(plain.out)
    assert ops_key.startswith("wq_") and "not shown again" in plain.err

    listed = await cli.json("api-keys", "list")
    mine = {k["Prefix"]: k for k in listed}
    assert mine[created["Prefix"]]["Name"] == "ci-producer" and mine[created["Prefix"]]["RevokedAt"] is None
    assert "Key" not in mine[created["Prefix"]]
    listing = await cli("api-keys", "list")
    assert key not in listing.out + json.dumps(listed) and ops_key not in listing.out
    assert created["Prefix"] in listing.out

    # The keys the CLI made open the REST API.
    app = FastAPI()
    app.include_router(cli.ops.router)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cli") as http:
        assert (await http.get("/work-queue/stats", headers={"X-API-Key": key})).status_code == 200
        paused = await http.post(f"/work-queue/subscriptions/{cli_app.IDLE}/pause", headers={"X-API-Key": key})
        assert paused.status_code == 403

        assert await cli.json("api-keys", "revoke", created["Prefix"]) == {"Revoked": 1}
        assert (await http.get("/work-queue/stats", headers={"X-API-Key": key})).status_code == 401
    again = await cli("api-keys", "revoke", created["Prefix"], expect=1)
    assert "no active key" in again.err
    assert "revoked 1 key(s)" in (await cli("api-keys", "revoke", "ops")).out

    # A scope that does not exist, or none, is a usage error (exit 2) that lists the scopes.
    bad = await cli("api-keys", "create", "--name", "x", "--scopes", "workqueue:everything", expect=2)
    assert "unknown scope(s) 'workqueue:everything'; use one or more of workqueue:publish" in bad.err
    assert "no scope given" in (await cli("api-keys", "create", "--name", "x", "--scopes", " , ", expect=2)).err
    assert "a name" in (await cli("api-keys", "create", "--name", " ", "--scopes", "workqueue:read", expect=1)).err


async def test_api_keys_limited_to_topics(cli: Cli) -> None:
    """``--topic`` (repeated; ``*`` patterns) limits what a key may publish to over REST. (Topics
    that do not exist answer 404 once the key may reach them, 403 before: nothing is published.)"""
    limited = await cli.json("api-keys", "create", "--name", "limited-bot", "--scopes", "workqueue:publish",
                             "--topic", "cli.none", "--topic", "cli.o*")
    assert limited["Topics"] == ["cli.none", "cli.o*"]
    listing = await cli("api-keys", "list")
    assert "cli.none,cli.o*" in listing.out
    everywhere = await cli.json("api-keys", "create", "--name", "any-bot", "--scopes", "workqueue:publish")
    assert everywhere["Topics"] is None

    app = FastAPI()
    app.include_router(cli.ops.router)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cli") as http:
        async def publish(topic: str, key: str) -> httpx.Response:
            return await http.post(f"/work-queue/topics/{topic}/messages", json=[{"Payload": 1}],
                                   headers={"X-API-Key": key})

        assert (await publish("cli.none", limited["Key"])).status_code == 404
        assert (await publish("cli.other", limited["Key"])).status_code == 404  # cli.o*
        refused = await publish(cli_app.IDLE, limited["Key"])
        assert refused.status_code == 403 and cli_app.IDLE in refused.json()["detail"]
        assert "cli.none, cli.o*" in refused.json()["detail"]
        assert (await publish("cli.zzz", everywhere["Key"])).status_code == 404
        jobs = await publish("jobs.default", everywhere["Key"])
        assert jobs.status_code == 403 and "workqueue:jobs" in jobs.json()["detail"]
    for name in ("limited-bot", "any-bot"):
        await cli("api-keys", "revoke", name)

    bad = await cli("api-keys", "create", "--name", "x", "--scopes", "workqueue:publish", "--topic", "no spaces",
                    expect=1)
    assert "'no spaces' is not a topic name or pattern" in bad.err


# -- the runbooks --------------------------------------------------------------------------------


async def test_runbook_an_ordered_key_is_blocked(cli: Cli) -> None:
    sub = cli_app.ORDERED
    key = "customer-42"
    published = await cli.publish(sub, {"step": 1}, "--partition-key", key)
    published += await cli.publish(sub, {"step": 2, "fail": True}, "--partition-key", key)
    published += await cli.publish(sub, {"step": 3}, "--partition-key", key, "--count", "3")
    [idle] = await cli.json("partitions", "--subscription", sub, "--condition", "Idle")
    assert (idle["PartitionKey"], idle["WaitingItems"]) == (key, 4)
    first = await cli.work(sub, "--once", "--max", "10")
    assert one_line(first.out).endswith("ran 2 deliveries")  # step 1 done, step 2 dead-lettered, key blocked

    # 1. Which key is blocked, by which delivery, and how much waits behind it.
    [blocked] = await cli.json("partitions", "--subscription", sub, "--condition", "Blocked")
    assert (blocked["PartitionKey"], blocked["HeadStatus"], blocked["WaitingItems"]) == (key, "DeadLettered", 3)
    head = blocked["HeadDeliveryID"]
    table = await cli("partitions", "--subscription", sub, "--condition", "Blocked")
    assert "HeadDeliveryID" in table.out and head in table.out and "Blocked" in table.out
    assert (await cli.json("backlog", "--subscription", sub))["Claimable"] == 0

    # 2. Why it failed.
    [dead] = await cli.json("dead-letters", "--subscription", sub)
    assert dead["DeliveryID"] == head and dead["MessageID"] == published[1]
    assert "cannot handle" in dead["Reason"] and "FatalWorkError" in dead["LastError"]

    # 3. Fix the cause (here: "deploy" the fix the handler looks for).
    cli.fixed.write_text("1.2.4")

    # 4. Replay the head with a note: same MessageID, same place in the key.
    replayed = await cli.json("replay", "--subscription", sub, "--delivery", head, "--note", "deployed 1.2.4")
    assert replayed["Result"] == "Replayed"
    second = await cli.work(sub, "--once", "--max", "10")
    assert one_line(second.out).endswith("ran 4 deliveries")

    # 5. The key no longer appears; its messages completed in publish order.
    assert await cli.json("partitions", "--subscription", sub, "--condition", "Blocked") == []
    assert (await cli("partitions", "--subscription", sub, "--condition", "Blocked")).out.strip() == "(none)"
    assert await cli.json("partitions", "--subscription", sub) == []
    done = [r["message_id"] for r in cli.records(sub, "done")]
    assert done == published
    completed = {d["DeliveryID"]: d for d in await cli.json("deliveries", "--subscription", sub, "--status",
                                                               "Completed")}
    assert (completed[head]["MessageID"], completed[head]["Note"]) == (published[1], "deployed 1.2.4")


async def test_runbook_a_delivery_is_stuck_in_flight_and_its_handler_is_alive(cli: Cli) -> None:
    sub = cli_app.HANG
    [message] = await cli.publish(sub, {"hang": True})
    proc = await cli.start("work", "--app", APP, "--subscription", sub, "--once")
    try:
        await cli.wait_record(sub, "started")

        # 1. InFlight that never falls.
        [stats] = await cli.json("stats", "--subscription", sub)
        assert stats["InFlight"] == 1
        [running] = await cli.json("deliveries", "--subscription", sub, "--status", "InFlight")
        assert running["MessageID"] == message
        # The table, as the runbook runs it, names the holder: the worker's host and pid.
        header, row = (await cli("deliveries", "--subscription", sub, "--status", "InFlight")).out.splitlines()
        assert header.split()[:4] == ["DeliveryID", "MessageID", "Topic", "PartitionKey"] and "Holder" in header
        assert f"{socket.gethostname()} pid {proc.pid}" in row
        whole = (await cli("delivery", running["DeliveryID"])).out.splitlines()
        assert [line.split(None, 1)[1] for line in whole if line.startswith("Holder ")] == [
            f"{socket.gethostname()} pid {proc.pid}"]  # (as the table shows it; it printed snake_case keys)

        # 2. Cancel it: cancel requested; the handler is told Cancelled at its next heartbeat.
        cancelled = await cli.json("discard", "--subscription", sub, "--delivery", running["DeliveryID"],
                                   "--reason", "hung on a remote call")
        assert (cancelled["Result"], cancelled["CancelRequested"]) == ("CancelRequested", True)
        result = await cli.finish(proc, within=20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert result.code == 0, result.err
    [aborted] = cli.records(sub, "aborted")
    assert aborted["reason"] == "Cancelled"
    [discarded] = await cli.json("deliveries", "--subscription", sub, "--status", "Discarded")
    assert (discarded["DeliveryID"], discarded["Reason"]) == (running["DeliveryID"], "hung on a remote call")
    [stats] = await cli.json("stats", "--subscription", sub)
    assert (stats["InFlight"], stats["Pending"], stats["Discarded"]) == (0, 0, 1)  # never retried


async def test_runbook_a_delivery_is_stuck_in_flight_and_its_holder_is_dead(cli: Cli) -> None:
    sub = cli_app.CRASH
    [message] = await cli.publish(sub, {"hang": "first"})
    proc = await cli.start("work", "--app", APP, "--subscription", sub, "--once")
    await cli.wait_record(sub, "started")
    proc.kill()  # the holder dies mid-handler
    await proc.wait()

    # 1. InFlight that never falls ...
    [stats] = await cli.json("stats", "--subscription", sub)
    assert stats["InFlight"] == 1
    # 2. ... held by the killed worker, as the delivery says; the process registry soon calls it Gone.
    [held] = await cli.ops.deliveries(sub, "InFlight")
    assert held.holder is not None and (held.holder.pid, held.holder.hostname) == (proc.pid, socket.gethostname())
    registry = cli.ops.transport
    assert isinstance(registry, ProcessRegistry)

    holder = held.holder

    async def state_of_killed() -> str | None:
        found = [p for p in await registry.list_processes() if p.process_id == holder.process_id]
        return found[0].state if found and found[0].state == "Gone" else None

    assert await wait_for(state_of_killed, within=15) == "Gone"
    # 3. ... and no process holds it: do nothing. Any instance's sweeper expires the lease (lease
    # 1 s + sweeper interval) and the delivery retries; this worker picks the retry up.
    rescued = await cli.work(sub, "--max", "1", "--max-duration-ms", "20000", within=40)
    assert one_line(rescued.out).endswith("ran 1 delivery")
    [completed] = await cli.json("deliveries", "--subscription", sub, "--status", "Completed")
    assert (completed["MessageID"], completed["Attempt"]) == (message, 2)
    assert completed["Holder"]["Pid"] not in (None, proc.pid)  # the worker that completed it
    assert [r["attempt"] for r in cli.records(sub, "done")] == [2]


async def test_the_role_scripts_are_reachable_from_a_wheel_install(tmp_path: Path) -> None:
    """``workqueue sql list`` and ``sql print`` read the SQL the wheel carries (fastapi_workqueue/_sql),
    not the checkout's sql/ folder."""
    build = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(build.communicate(), 80)
    assert build.returncode == 0, err.decode()
    [wheel] = (tmp_path / "dist").glob("fastapi_workqueue-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}, "PYTHONPATH": str(site)}

    async def command(*args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import sys, fastapi_workqueue.cli as c; print(c.__file__, file=sys.stderr); "
            "c.main()", *args, cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()
        assert err.decode().startswith(str(site)), err.decode()  # the wheel's package, not the checkout
        return out.decode()

    listed = json.loads(await command("sql", "list", "--json"))
    assert {"Dialect": "postgresql", "Path": "roles/runtime_role.sql"} in listed
    assert {"Dialect": "mssql", "Path": "roles/runtime_role.sql"} in listed
    assert {"Dialect": "postgresql", "Path": "roles/aws_role.sql"} in listed
    assert {"Dialect": "mssql", "Path": "roles/aws_role.sql"} in listed
    assert not [e for e in listed if e["Path"][:4].isdigit()]  # migrations are not scripts to run by hand
    printed = await command("sql", "print", "roles/runtime_role.sql")
    assert printed == (ROOT / "sql" / "postgresql" / "roles" / "runtime_role.sql").read_text()
    mssql = json.loads(await command("sql", "print", "roles/runtime_role.sql", "--dialect", "mssql", "--json"))
    assert mssql == {"Dialect": "mssql", "Path": "roles/runtime_role.sql",
                     "SQL": (ROOT / "sql" / "mssql" / "roles" / "runtime_role.sql").read_text()}


def test_the_worker_runs_outside_the_probe_for_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without uvloop, an error inside the worker carries no ImportError as its context (every
    traceback the worker logged used to show "No module named 'uvloop'")."""
    import importlib

    from fastapi_workqueue.cli import work as work_module

    real_import = importlib.import_module

    def no_uvloop(name: str, package: str | None = None) -> Any:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, package)

    monkeypatch.setattr("fastapi_workqueue.cli.work.importlib.import_module", no_uvloop)

    async def fails() -> BaseException:
        try:
            raise ValueError("inside the worker")
        except ValueError as exc:
            return exc

    error = work_module.run_on_fastest_loop(fails())
    assert isinstance(error, ValueError) and error.__context__ is None


# -- the subscription and topic lifecycle -----------------------------------------------------------


async def test_subscriptions_and_topics_are_listed_retired_and_deleted(cli: Cli) -> None:
    topic, name = f"cli.life-{uuid.uuid4().hex[:8]}", f"cli.life.mail-{uuid.uuid4().hex[:8]}"
    declaring = WorkQueue(WorkQueueSettings(database_url=cli.url, enabled=False), topics=[Topic(name=topic)],
                          subscriptions=[Subscription(name=name, topic=topic, handler_key="life")])
    async with declaring.lifespan(None):
        await declaring.publish(topic, [PublishRequest(payload={"n": n}) for n in range(3)])

    listed = {row["Name"]: row for row in await cli.json("subscriptions", "list")}
    assert listed[name] | {"ServedBy": 0} == {"Name": name, "Topic": topic, "Status": "Active", "Declared": "?",
                                              "ServedBy": 0, "Pending": 3, "InFlight": 0, "DeadLettered": 0,
                                              "Completed": 0, "Limits": ""}
    with_app = {row["Name"]: row for row in await cli.json("subscriptions", "list", "--app", APP)}
    assert (with_app[name]["Declared"], with_app[cli_app.BASIC]["Declared"]) == ("no", "yes")
    by_variable = await cli("--json", "subscriptions", "list", env={**cli.env, "WORKQUEUE_APP": APP})
    assert {row["Name"]: row["Declared"] for row in by_variable.json()}[cli_app.BASIC] == "yes"
    table_text = (await cli("subscriptions", "list")).out
    assert name in table_text and "Declared" in table_text

    refused = await cli("subscriptions", "delete", name, expect=1)
    assert f"subscription {name!r} is not retired; retire it first" in refused.err
    usage = await cli("subscriptions", "retire", name, "--reason", "moved", expect=2)
    assert "--reason goes with --discard-pending" in usage.err
    retired = await cli.json("subscriptions", "retire", name, "--discard-pending", "--reason", "moved to notify")
    assert retired == {"Subscription": name, "Status": "Retired", "Changed": True, "Discarded": 3}
    again = await cli("subscriptions", "retire", name)
    assert one_line(again.out) == f"{name}: Retired (it already was)"
    assert (await cli("subscriptions", "delete", name)).out.strip() == f"{name}: deleted"
    missing = await cli("subscriptions", "delete", name, expect=1)
    assert f"there is no subscription {name!r}" in missing.err

    assert one_line((await cli("topics", "retire", topic)).out) == f"{topic}: Retired"
    [row] = [t for t in await cli.json("topics", "list") if t["Name"] == topic]
    assert (row["Status"], row["Subscriptions"], row["Declared"]) == ("Retired", 0, "?")
    assert one_line((await cli("topics", "resume", topic)).out) == f"{topic}: Active"
    not_retired = await cli("topics", "delete", topic, expect=1)
    assert "is not retired" in not_retired.err
    await cli("topics", "retire", topic)
    assert (await cli("topics", "delete", topic)).out.strip() == f"{topic}: deleted"
    unknown = await cli("subscriptions", "retire", "cli.no-such-thing", expect=1)
    assert "does not exist" in unknown.err


async def test_the_lifecycle_commands_warn_of_a_malformed_variable_and_go_on(cli: Cli) -> None:
    """docs/configuration.md: the operator commands warn of a value an app would refuse "and go on
    (the command may be what repairs the app)". The runbook's own retire, delete and the jobs
    commands ended in a traceback and did nothing with WORKQUEUE_SUBSCRIPTIONS malformed."""
    topic, name = f"cli.bad-{uuid.uuid4().hex[:8]}", f"cli.bad.mail-{uuid.uuid4().hex[:8]}"
    declaring = WorkQueue(WorkQueueSettings(database_url=cli.url, enabled=False), topics=[Topic(name=topic)],
                          subscriptions=[Subscription(name=name, topic=topic, handler_key="life")])
    async with declaring.lifespan(None):
        pass
    env = {**cli.env, "WORKQUEUE_SUBSCRIPTIONS": '[{"name": "s.work"', "WORKQUEUE_IDLE_POLL_MAX_MS": "abc"}
    for args, out in ((("subscriptions", "retire", name), f"{name}: Retired"),
                      (("subscriptions", "delete", name), f"{name}: deleted"),
                      (("topics", "retire", topic), f"{topic}: Retired"),
                      (("topics", "delete", topic), f"{topic}: deleted"),
                      (("jobs", "failed"), "")):
        done = await cli(*args, env=env)
        assert "Traceback" not in done.err and "WORKQUEUE_SUBSCRIPTIONS is not valid JSON" in done.err, done.err
        assert out in done.out, (args, done.out)


async def test_the_lists_read_the_database_the_app_names(cli: Cli) -> None:
    """``subscriptions list --app`` and ``topics list --app`` with no ``--database-url`` read the
    app's own database, as ``stats --app`` does, instead of asking for a URL."""
    (cli.folder / "own_url_app.py").write_text(
        "from fastapi_workqueue import WorkMessage, WorkQueue, WorkQueueSettings\n"
        "from tests.apps import cli_app\n"
        f"queue = WorkQueue(WorkQueueSettings(database_url={cli.url!r}, enabled=False),\n"
        "                  topics=list(cli_app.queue.topics.values()),\n"
        "                  subscriptions=list(cli_app.queue.subscriptions.values()))\n"
    )
    no_url = {k: v for k, v in cli.env.items() if k != "WORKQUEUE_DATABASE_URL"}
    subscriptions = await cli("--json", "subscriptions", "list", "--app", "own_url_app:queue", env=no_url)
    assert {row["Name"]: row["Declared"] for row in subscriptions.json()}[cli_app.BASIC] == "yes"
    topics = await cli("--json", "topics", "list", "--app", "own_url_app:queue", env=no_url)
    [basic] = [row for row in topics.json() if row["Name"] == cli_app.queue.subscriptions[cli_app.BASIC].topic]
    assert (basic["Declared"], basic["Subscriptions"]) == ("yes", 1)

    # WORKQUEUE_DATABASE_URL naming another database does not pull --app away from its own, as for
    # stats --app; a --database-url on the command line does (the app then says what it declares).
    other = f"sqlite+aiosqlite:///{cli.folder / 'other.db'}"
    await cli("--database-url", other, "migrate", env=no_url)
    elsewhere = {**no_url, "WORKQUEUE_DATABASE_URL": other}
    listed = await cli("--json", "subscriptions", "list", "--app", "own_url_app:queue", env=elsewhere)
    assert cli_app.BASIC in {row["Name"] for row in listed.json()}
    stats = await cli("--json", "stats", "--app", "own_url_app:queue", env=elsewhere)
    assert cli_app.BASIC in {row["Subscription"] for row in stats.json()}
    given = await cli("--json", "subscriptions", "list", "--app", "own_url_app:queue", "--database-url", other,
                      env=no_url)
    assert given.json() == []  # (that database holds no subscription)


async def test_an_operators_reason_has_the_same_limit_on_every_path(cli: Cli) -> None:
    """2,000 characters, as the REST API and the dashboard's forms allow: the CLI refused nothing
    (a 120,000-character reason was stored, and widened every table that listed it)."""
    refused = await cli("discard", "--subscription", cli_app.IDLE, "--delivery", "1", "--reason", "x" * 2001,
                        expect=2)
    assert "Invalid value for '--reason': it is 2001 characters; at most 2000 are allowed" in refused.err
    # ... and is redacted as on every other path (the CLI wrote it raw)
    [message_id] = await cli.publish(cli_app.IDLE, {"n": 1})
    [pending] = [d for d in await cli.json("deliveries", "--subscription", cli_app.IDLE, "--status", "Pending",
                                           "--limit", "10000") if d["MessageID"] == message_id]
    await cli("discard", "--subscription", cli_app.IDLE, "--delivery", pending["DeliveryID"], "--reason",
              "moved: postgresql://ops:s3cret@db/app")
    shown = await cli.json("delivery", pending["DeliveryID"])
    assert shown["Status"] == "Discarded" and "moved" in shown["Reason"] and "s3cret" not in shown["Reason"]


async def test_app_and_database_url_both_on_the_command_line_are_refused(cli: Cli) -> None:
    """Both name a place to act on: an action lands in one of them only if the operator says which."""
    refused = await cli("pause", "--subscription", cli_app.IDLE, "--app", APP, "--database-url", cli.url, expect=2)
    assert "--app and --database-url name two places to act on; pass one of them" in refused.err
    by_variable = await cli("--json", "stats", "--subscription", cli_app.IDLE, "--database-url", cli.url,
                            env={**cli.env, "WORKQUEUE_APP": APP})
    assert [row["Subscription"] for row in by_variable.json()] == [cli_app.IDLE]  # (the given database)


async def test_a_worker_of_one_subscription_keeps_the_apps_schedules(cli: Cli) -> None:
    """Web processes with WORKQUEUE_DISABLE_HOST=1 and ``workqueue work --subscription`` (the split
    Getting started recommends): the worker is the only host, so it keeps the schedules."""
    job_queue = f"ticks{uuid.uuid4().hex[:8]}"
    (cli.folder / "schedule_app.py").write_text(
        "from typing import Any\n"
        "from fastapi_workqueue import WorkMessage, WorkQueue, WorkQueueSettings\n"
        "from tests.apps import cli_app\n"
        "queue = WorkQueue(WorkQueueSettings(), topics=list(cli_app.queue.topics.values()),\n"
        "                  subscriptions=list(cli_app.queue.subscriptions.values()))\n"
        "@queue.handler('cli.record')\n"
        "async def idle(message: WorkMessage[Any]) -> None: ...\n"
        f"@queue.job('tick', queue={job_queue!r})\n"
        "async def tick(payload: dict[str, Any]) -> None: ...\n"
        "queue.schedule(tick, every=1, payload={})\n"
    )
    worker = await cli.start("work", "--app", "schedule_app:queue", "--subscription", cli_app.IDLE)
    try:
        await wait_for(lambda: cli.ops.size(job_queue), within=20)  # a tick queued (no worker takes it)
    finally:
        worker.send_signal(signal.SIGTERM)
        assert (await cli.finish(worker)).code == 0


async def test_processes_lists_the_workers_that_ran(cli: Cli) -> None:
    proc = await cli.start("work", "--app", APP, "--subscription", cli_app.IDLE, "--once")
    assert (await cli.finish(proc)).code == 0
    rows = await cli.json("processes")
    [mine] = [r for r in rows if r["Pid"] == proc.pid and r["Hostname"] == socket.gethostname()]
    assert mine["State"] == "Stopped" and mine["Subscriptions"] == [cli_app.IDLE] and mine["InFlight"] == 0
    text = (await cli("processes")).out
    assert f" {proc.pid} " in text and "Stopped" in text


async def test_the_summary_counts_only_the_settlements_the_store_took(cli: Cli) -> None:
    """A worker frozen past its lease (SIGSTOP) while another process's sweeper takes the delivery
    back: its late settlement changes nothing (LeaseLost), and the summary says 0 settled."""
    sub = cli_app.HANG  # (a lease of 1.5 s)
    before = len(cli.records(sub, "started"))  # (other tests of the module ran handlers here too)
    [message_id] = await cli.publish(sub, {"sleep": 2})
    worker = await cli.start("work", "--app", APP, "--subscription", sub, "--once", "--json")
    await cli.wait_record(sub, "started", count=before + 1)
    assert cli.records(sub, "started")[-1]["message_id"] == message_id
    worker.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(2.5)  # past the lease, and no heartbeat went out
        assert (await cli.ops.transport.sweep()).retried >= 1
    finally:
        worker.send_signal(signal.SIGCONT)
    ran = await cli.finish(worker)
    summary = json.loads(one_line(ran.out))
    assert (summary["Claimed"], summary["Settled"], summary["Completed"]) == (1, 0, 0), (summary, ran.err)


def test_publishing_with_the_app_to_a_topic_it_declares_before_it_ever_started_says_to_start_it(
    tmp_path: Path,
) -> None:
    """``--app`` syncs no topology: a topic the app declares is not in a store the app never
    started on, and the refusal says how it gets there (there is no command that creates it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env.update(PYTHONPATH=str(ROOT), WORKQUEUE_DATABASE_URL=f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}")

    def workqueue(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fastapi_workqueue", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)

    assert workqueue("migrate").returncode == 0
    refused = workqueue("publish", "--app", APP, "--topic", cli_app.BASIC, "--payload", "{}")
    assert refused.returncode == 1
    assert f"topic '{cli_app.BASIC}' does not exist" in refused.stderr
    assert "a topic the app declares is written to the store when the app, or `workqueue work --app`, starts: " \
           "start it once, then publish" in refused.stderr


async def test_work_without_a_subscription_on_an_app_without_jobs_names_the_app(cli: Cli) -> None:
    ran = await cli("work", "--app", APP, "--once", expect=2)
    assert f"--app {APP} declares no jobs: declare them with @queue.job(...)" in ran.err
    assert "--subscription NAME" in ran.err and "object at 0x" not in ran.err
