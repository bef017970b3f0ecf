"""The AWS commands of `workqueue`, run as a user runs them, against a moto server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue.aws.manifest import validate_manifest

from ..support import wait_for
from .moto import CREDENTIALS, REGION
from .provision import clients, provision
from .test_validate_bindings import manifest_for


@pytest.fixture
def endpoint(moto_url: str) -> str:
    return moto_url


def workqueue(
    *args: str, endpoint: str | None = None, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    environ.update(CREDENTIALS)
    if endpoint:
        environ["WORKQUEUE_AWS_ENDPOINT_URL"] = endpoint
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "fastapi_workqueue", *args], capture_output=True, text=True,
                          env=environ, cwd=cwd, check=False)


@pytest.fixture
def files(endpoint: str, tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    tag = uuid.uuid4().hex[:8]
    manifest = manifest_for(tag)
    bindings = provision(manifest, endpoint)
    manifest_file = tmp_path / "manifest.json"
    manifest_file.write_text(json.dumps(manifest), encoding="utf-8")
    # What `terraform output -json` writes: the bindings under binding_import.value.
    bindings_file = tmp_path / "tf-output.json"
    bindings_file.write_text(json.dumps({"binding_import": {"sensitive": False, "type": ["object", {}],
                                                            "value": bindings}}), encoding="utf-8")
    return manifest_file, bindings_file, bindings


def test_validate_bindings_on_aws_passes_for_what_the_manifest_made(
    files: tuple[Path, Path, dict[str, Any]], endpoint: str
) -> None:
    manifest_file, bindings_file, _ = files
    run = workqueue("validate-bindings", "--transport", "aws", "--manifest", str(manifest_file),
                    "--bindings", str(bindings_file), endpoint=endpoint)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("aws: ok")


def test_validate_bindings_on_aws_reports_drift_and_exits_1(
    files: tuple[Path, Path, dict[str, Any]], endpoint: str
) -> None:
    manifest_file, bindings_file, bindings = files
    [(name, sub)] = bindings["subscriptions"].items()
    clients(endpoint)[1].set_queue_attributes(
        QueueUrl=sub["queue_url"], Attributes={"VisibilityTimeout": "5"})
    run = workqueue("--json", "validate-bindings", "--transport", "aws", "--manifest", str(manifest_file),
                    "--bindings", str(bindings_file), endpoint=endpoint)
    assert run.returncode == 1, run.stderr
    report = json.loads(run.stdout)
    assert (report["Transport"], report["Ok"]) == ("aws", False)
    [issue] = report["Issues"]
    assert issue["Severity"] == "Error" and issue["Subject"] == f"subscription {name}"
    assert "visibility timeout of 5 s but the lease is 30 s" in issue["Message"]


def test_validate_bindings_on_aws_refuses_a_file_that_is_not_bindings(
    files: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    manifest_file, _, _ = files
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"outputs": {}}), encoding="utf-8")
    run = workqueue("validate-bindings", "--transport", "aws", "--manifest", str(manifest_file),
                    "--bindings", str(wrong))
    assert run.returncode == 1
    assert run.stderr.strip().endswith(
        "the bindings file is neither the module's binding_import nor `terraform output -json`: "
        "write it with `terraform output -json binding_import > bindings.json`"
    )


def test_validate_bindings_on_aws_without_an_app_says_what_to_pass() -> None:
    run = workqueue("validate-bindings", "--transport", "aws")
    assert run.returncode == 2
    assert "no app: pass --app MODULE:ATTR (your app or its WorkQueue) or set WORKQUEUE_APP" in run.stderr


def test_the_commands_are_listed() -> None:
    run = workqueue("--help")
    assert run.returncode == 0
    assert "export-topology" in run.stdout and "import-bindings" in run.stdout
    help_text = workqueue("validate-bindings", "--help").stdout
    assert "--transport [database|aws]" in help_text



APP = "tests.apps.aws_app:queue"
ROOT = Path(__file__).resolve().parents[2]


def app_env(tmp_path: Path, endpoint: str, *, database_url: str = "") -> dict[str, str]:
    return {"WORKQUEUE_AWS_REGION": REGION, "WORKQUEUE_AWS_ENDPOINT_URL": endpoint,
            "WORKQUEUE_AWS_RESOURCE_PREFIX": f"t{uuid.uuid4().hex[:6]}-",
            "WORKQUEUE_DATABASE_URL": database_url, "WORKQUEUE_AWS_BINDINGS_FILE": str(tmp_path / "bound.json")}


def test_export_import_validate_from_the_apps_topology(tmp_path: Path, endpoint: str) -> None:
    env = app_env(tmp_path, endpoint)
    manifest_file = tmp_path / "infra" / "manifest.json"
    run = workqueue("export-topology", "--transport", "aws", "--app", APP, "--output", str(manifest_file),
                    env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "2 subscription(s)" in run.stderr
    manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    validate_manifest(manifest)
    assert [t["name"] for t in manifest["topics"]] == ["orders.created"]  # the database topic is left out
    email = next(s for s in manifest["subscriptions"] if s["name"] == "orders.email")
    assert (email["max_attempts"], email["visibility_timeout_seconds"]) == (4, 45)
    assert email["filter_policy"] == {"region": ["eu"]}

    # Not bound yet: every item is an Error that says to import.
    before = workqueue("validate-bindings", "--transport", "aws", "--app", APP, env=env, cwd=ROOT)
    assert before.returncode == 1
    assert before.stdout.count("not bound") == 3

    output = tmp_path / "tf-output.json"
    output.write_text(json.dumps({"binding_import": {"value": provision(manifest, endpoint)}}), encoding="utf-8")
    imported = workqueue("import-bindings", str(output), "--app", APP, env=env, cwd=ROOT)
    assert imported.returncode == 0, imported.stderr
    assert "imported the bindings of 1 topic(s) and 2 subscription(s)" in imported.stdout
    assert json.loads((tmp_path / "bound.json").read_text(encoding="utf-8"))["subscriptions"].keys() == {
        "orders.email", "orders.archive"}

    after = workqueue("validate-bindings", "--transport", "aws", "--app", APP, env=env, cwd=ROOT)
    assert after.returncode == 0, after.stdout + after.stderr
    assert after.stdout.startswith("aws: ok")


def test_import_bindings_into_the_database(tmp_path: Path, endpoint: str) -> None:
    env = app_env(tmp_path, endpoint, database_url=f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    assert workqueue("migrate", env=env, cwd=ROOT).returncode == 0
    manifest_file = tmp_path / "manifest.json"
    assert workqueue("export-topology", "--transport", "aws", "--app", APP, "--output", str(manifest_file),
                     env=env, cwd=ROOT).returncode == 0
    bindings = provision(json.loads(manifest_file.read_text(encoding="utf-8")), endpoint)
    (tmp_path / "b.json").write_text(json.dumps(bindings), encoding="utf-8")
    assert workqueue("import-bindings", str(tmp_path / "b.json"), "--app", APP, env=env, cwd=ROOT).returncode == 0
    assert not (tmp_path / "bound.json").exists()
    run = workqueue("--json", "validate-bindings", "--transport", "aws", "--app", APP, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(run.stdout)["Ok"] is True


def test_export_refuses_ordered_naming_the_subscription(tmp_path: Path, endpoint: str) -> None:
    run = workqueue("export-topology", "--transport", "aws", "--app", "tests.apps.aws_app:ordered_queue",
                    env=app_env(tmp_path, endpoint), cwd=ROOT)
    assert run.returncode == 1
    assert "ledger.post" in run.stderr and "Ordered needs a database topic" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_export_refuses_a_lambda_timeout_longer_than_the_lease(tmp_path: Path, endpoint: str) -> None:
    env = {**app_env(tmp_path, endpoint), "WORKQUEUE_AWS_LAMBDA_SUBSCRIPTIONS": '["orders.email"]'}
    output = tmp_path / "manifest.json"
    run = workqueue("export-topology", "--transport", "aws", "--app", APP, "--output", str(output), env=env, cwd=ROOT)
    assert run.returncode == 1 and not output.exists()
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "subscription 'orders.email' is served by Lambda with a 60 s timeout" in run.stderr
    assert "raise lease_seconds to at least 60, or set max_processing_seconds to at most 45" in run.stderr


def test_import_refuses_a_file_that_is_not_bindings(tmp_path: Path, endpoint: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]", encoding="utf-8")
    run = workqueue("import-bindings", str(bad), "--app", APP, env=app_env(tmp_path, endpoint), cwd=ROOT)
    assert run.returncode == 1
    assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("Error: ")


@pytest.mark.parametrize("command", ["import-bindings", "validate-bindings"])
def test_an_unmigrated_database_says_to_run_migrate(
    fresh_url: str, tmp_path: Path, endpoint: str, command: str,
) -> None:
    env = app_env(tmp_path, endpoint, database_url=fresh_url)
    bindings = tmp_path / "b.json"
    bindings.write_text(json.dumps({"version": 1, "region": REGION, "topics": {}, "subscriptions": {}}),
                        encoding="utf-8")
    args = [command, str(bindings)] if command == "import-bindings" else [command, "--transport", "aws"]
    run = workqueue(*args, "--app", APP, env=env, cwd=ROOT)
    assert run.returncode == 1, run.stdout
    assert "Traceback" not in run.stderr
    [line] = run.stderr.strip().splitlines()
    assert line.startswith("Error: ") and "run `workqueue migrate`" in line


def column(stdout: str, header: str) -> list[str]:
    """The text of one table column, a wrapped cell joined back into one line per row."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if header in line and line.lstrip().startswith("Severity"))
    start = lines[head].index(header)
    rows: list[str] = []
    for line in lines[head + 1:]:
        if line[:start].strip():
            rows.append(line[start:].strip())
        elif rows:
            rows[-1] += " " + line[start:].strip()
    return rows


def test_validate_bindings_prints_each_message_whole(
    files: tuple[Path, Path, dict[str, Any]], endpoint: str
) -> None:
    manifest_file, bindings_file, bindings = files
    [(_, sub)] = bindings["subscriptions"].items()
    clients(endpoint)[1].set_queue_attributes(QueueUrl=sub["queue_url"], Attributes={"VisibilityTimeout": "5"})
    args = ["validate-bindings", "--transport", "aws", "--manifest", str(manifest_file), "--bindings",
            str(bindings_file)]
    [issue] = json.loads(workqueue("--json", *args, endpoint=endpoint).stdout)["Issues"]
    assert len(issue["Message"]) > 200
    run = workqueue(*args, endpoint=endpoint)
    assert run.returncode == 1
    assert column(run.stdout, "Message") == [issue["Message"]]
    assert "..." not in run.stdout
    assert max(len(line) for line in run.stdout.splitlines()) < 200


@pytest.mark.parametrize(("app", "resource"), [
    ("same_queue", "the same SQS queue 'orders-email'"),
    ("queue_is_a_dlq", "the same SQS queue 'orders-email-dlq'"),
])
def test_export_refuses_names_that_map_to_one_queue(tmp_path: Path, endpoint: str, app: str, resource: str) -> None:
    output = tmp_path / "manifest.json"
    env = {**app_env(tmp_path, endpoint), "WORKQUEUE_AWS_RESOURCE_PREFIX": ""}
    run = workqueue("export-topology", "--transport", "aws", "--app", f"tests.apps.aws_app:{app}", "--output",
                    str(output), env=env, cwd=ROOT)
    assert run.returncode == 1 and not output.exists()
    [line] = run.stderr.strip().splitlines()
    assert resource in line and "rename one of the subscriptions" in line
    assert "'orders.email'" in line and ("'orders-email'" in line or "'orders.email.dlq'" in line)


@pytest.mark.parametrize("store", ["file", "database"])
def test_lambda_policy_prints_what_the_function_reads(tmp_path: Path, endpoint: str, store: str) -> None:
    """The bindings read from where ``import-bindings`` stored them: the bindings file of a queue
    without a database, or the queue's database."""
    from fastapi_workqueue.aws.lambda_handler import POLICY_ENV, SubscriptionPolicy

    env = app_env(tmp_path, endpoint,
                  database_url=f"sqlite+aiosqlite:///{tmp_path / 'queue.db'}" if store == "database" else "")
    if store == "database":
        assert workqueue("migrate", env=env, cwd=ROOT).returncode == 0
    manifest_file = tmp_path / "manifest.json"
    assert workqueue("export-topology", "--transport", "aws", "--app", APP, "--output", str(manifest_file),
                     env=env, cwd=ROOT).returncode == 0
    bindings = provision(json.loads(manifest_file.read_text(encoding="utf-8")), endpoint)
    (tmp_path / "b.json").write_text(json.dumps(bindings), encoding="utf-8")

    unbound = workqueue("lambda-policy", "orders.email", "--app", APP, env=env, cwd=ROOT)
    assert unbound.returncode == 1 and "is not bound" in unbound.stderr and "import-bindings" in unbound.stderr
    given = workqueue("lambda-policy", "orders.email", "--app", APP, "--bindings", str(tmp_path / "b.json"),
                      env=env, cwd=ROOT)
    assert workqueue("import-bindings", str(tmp_path / "b.json"), "--app", APP, env=env, cwd=ROOT).returncode == 0
    stored = workqueue("lambda-policy", "orders.email", "--app", APP, env=env, cwd=ROOT)
    assert (given.returncode, stored.returncode) == (0, 0), given.stderr + stored.stderr
    assert given.stdout == stored.stdout and len(stored.stdout.strip().splitlines()) == 1
    policy = SubscriptionPolicy.from_env({POLICY_ENV: stored.stdout.strip()})
    bound = bindings["subscriptions"]["orders.email"]
    assert (policy.queue_url, policy.dlq_url) == (bound["queue_url"], bound["dlq_url"])
    assert (policy.name, policy.topic, policy.handler_key, policy.partition_mode) == (
        "orders.email", "orders.created", "orders.email", "Exclusive")
    assert (policy.is_fifo, policy.max_attempts, policy.lease_seconds) == (True, 4, 45)

    database = workqueue("lambda-policy", "audit.store", "--app", APP, env=env, cwd=ROOT)
    assert database.returncode == 1 and "only a subscription of an aws topic" in database.stderr
    unknown = workqueue("lambda-policy", "nope", "--app", APP, env=env, cwd=ROOT)
    assert unknown.returncode == 1 and "is not declared by the app" in unknown.stderr


async def test_an_idle_worker_stops_at_once_on_sigterm(tmp_path: Path, endpoint: str) -> None:
    """The default 20 s long poll is cancelled, not waited out. The worker logs at DEBUG to a file the
    test reads while it runs: the SDK's line for the request that sends the long poll says it is in flight."""
    env = app_env(tmp_path, endpoint, database_url=f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    assert workqueue("migrate", env=env, cwd=ROOT).returncode == 0
    manifest_file = tmp_path / "manifest.json"
    assert workqueue("export-topology", "--transport", "aws", "--app", APP, "--output", str(manifest_file),
                     env=env, cwd=ROOT).returncode == 0
    (tmp_path / "b.json").write_text(
        json.dumps(provision(json.loads(manifest_file.read_text(encoding="utf-8")), endpoint)), encoding="utf-8")
    assert workqueue("import-bindings", str(tmp_path / "b.json"), "--app", APP, env=env, cwd=ROOT).returncode == 0
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    environ.update(CREDENTIALS)
    environ.update(env)
    log = tmp_path / "worker.err"

    def long_poll_sent() -> bool:
        """Its first long poll (20 s: the default, half of the 45 s lease fits it) is on its way: the
        SDK made the request (its body says the wait) and then sent it."""
        assert proc.returncode is None, f"the worker ended before it ran: {log.read_text()[-2000:]}"
        lines = log.read_text().splitlines()
        made = next((i for i, line in enumerate(lines) if "OperationModel(name=ReceiveMessage)" in line
                     and '"WaitTimeSeconds": 20' in line), None)
        return made is not None and any("Sending http request" in line and "AmazonSQS.ReceiveMessage" in line
                                        for line in lines[made:])

    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fastapi_workqueue", "work", "--app", APP, "--subscription", "orders.archive",
            "--log-level", "DEBUG", cwd=ROOT, env=environ, stdout=asyncio.subprocess.DEVNULL, stderr=err,
        )
    try:
        await wait_for(long_poll_sent, within=30, describe=lambda: log.read_text()[-2000:])
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0, log.read_text()[-2000:]
        assert time.monotonic() - started < 5
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
