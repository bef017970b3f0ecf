"""The operator commands reach aws subscriptions with ``--app`` (or ``WORKQUEUE_APP``), and refuse
them on the database alone with what to pass: never an empty list or a change that reaches nothing."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue.aws.body import dead_letter_body

from .provision import clients, provision
from .test_cli_aws import APP, ROOT, app_env, workqueue


@pytest.fixture
def deployed(tmp_path: Path, moto_url: str) -> tuple[dict[str, str], dict[str, Any]]:
    """tests.apps.aws_app deployed on moto with a database: migrated, exported, provisioned,
    its bindings imported, two dead letters on the DLQ of orders.email."""
    env = app_env(tmp_path, moto_url, database_url=f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    assert workqueue("migrate", env=env, cwd=ROOT).returncode == 0
    manifest_file = tmp_path / "manifest.json"
    assert workqueue("export-topology", "--transport", "aws", "--app", APP, "--output", str(manifest_file),
                     env=env, cwd=ROOT).returncode == 0
    bindings = provision(json.loads(manifest_file.read_text(encoding="utf-8")), moto_url)
    (tmp_path / "bindings.json").write_text(json.dumps(bindings), encoding="utf-8")
    imported = workqueue("import-bindings", str(tmp_path / "bindings.json"), "--app", APP, env=env, cwd=ROOT)
    assert imported.returncode == 0, imported.stderr
    dlq = bindings["subscriptions"]["orders.email"]["dlq_url"]
    sqs = clients(moto_url)[1]
    for n in range(2):
        message_id = str(uuid.uuid4())
        body = dead_letter_body({"message_id": message_id, "topic": "orders.created", "partition_key": "c1",
                                 "payload": {"n": n}}, origin_id=str(uuid.uuid4()), subscription="orders.email",
                                reason="poison", error=f"ValueError: bad {n}", attempts=4)
        sqs.send_message(QueueUrl=dlq, MessageBody=body, MessageGroupId="c1", MessageDeduplicationId=message_id)
    return env, bindings


def test_the_operator_commands_reach_aws_subscriptions_with_the_app(
    deployed: tuple[dict[str, str], dict[str, Any]], moto_url: str,
) -> None:
    env, bindings = deployed
    listed = workqueue("--json", "dead-letters", "--subscription", "orders.email", "--app", APP, env=env, cwd=ROOT)
    assert listed.returncode == 0, listed.stderr
    letters = json.loads(listed.stdout)
    assert sorted(letter["LastError"] for letter in letters) == ["ValueError: bad 0", "ValueError: bad 1"]
    first, second = (letter["DeliveryID"] for letter in letters)
    assert first.startswith("aws:orders.email:")

    # WORKQUEUE_APP does what --app does.
    shown = workqueue("delivery", first, env={**env, "WORKQUEUE_APP": APP}, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr
    assert "DeadLettered" in shown.stdout

    replayed = workqueue("replay", "--subscription", "orders.email", "--delivery", first, "--note", "fixed",
                         "--app", APP, env=env, cwd=ROOT)
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout.startswith(f"Replayed: delivery {first}")
    discarded = workqueue("discard", "--subscription", "orders.email", "--delivery", second, "--app", APP,
                          env=env, cwd=ROOT)
    assert discarded.returncode == 0, discarded.stderr
    assert discarded.stdout.startswith(f"Discarded: delivery {second}")

    queue_url = bindings["subscriptions"]["orders.email"]["queue_url"]
    paused = workqueue("pause", "--subscription", "orders.email", "--app", APP, env=env, cwd=ROOT)
    assert (paused.returncode, paused.stdout.strip()) == (0, "orders.email: Paused"), paused.stderr
    sqs = clients(moto_url)[1]
    assert sqs.list_queue_tags(QueueUrl=queue_url)["Tags"]["workqueue:status"] == "Paused"
    resumed = workqueue("resume", "--subscription", "orders.email", "--app", APP, env=env, cwd=ROOT)
    assert resumed.returncode == 0 and resumed.stdout.strip() == "orders.email: Active"
    assert sqs.list_queue_tags(QueueUrl=queue_url)["Tags"]["workqueue:status"] == "Active"

    stats = workqueue("--json", "stats", "--app", APP, env=env, cwd=ROOT)
    assert stats.returncode == 0, stats.stderr
    rows = {row["Subscription"]: row for row in json.loads(stats.stdout)}
    assert {"orders.email", "orders.archive"} <= set(rows)  # audit.store: once the app synced it
    assert rows["orders.email"]["Pending"] == 1  # the replayed one, back on its queue


@pytest.mark.parametrize("command", [
    ["dead-letters", "--subscription", "orders.email"],
    ["deliveries", "--subscription", "orders.email", "--status", "Pending"],
    ["stats", "--subscription", "orders.email"],
    ["backlog", "--subscription", "orders.email"],
    ["pause", "--subscription", "orders.email"],
    ["resume", "--subscription", "orders.email"],
    ["replay", "--subscription", "orders.email", "--delivery", "aws:orders.email:x"],
    ["discard", "--subscription", "audit.store", "--delivery", "aws:orders.email:x"],
    ["delivery", "aws:orders.email:x"],
])
def test_without_the_app_an_aws_subscription_is_refused_with_what_to_pass(
    deployed: tuple[dict[str, str], dict[str, Any]], command: list[str],
) -> None:
    env, _ = deployed
    run = workqueue(*command, env=env, cwd=ROOT)
    assert run.returncode == 1, run.stdout
    assert run.stdout == ""
    [line] = run.stderr.strip().splitlines()
    assert "is on the aws transport, which the database alone cannot reach" in line
    assert "pass --app MODULE:ATTR (your app or its WorkQueue) or set WORKQUEUE_APP" in line


def test_what_the_commands_cannot_list_on_aws_they_say_instead_of_answering_nothing(
    deployed: tuple[dict[str, str], dict[str, Any]],
) -> None:
    """docs/cli.md: "`stats` notes on stderr the aws subscriptions it leaves out"; it answered an
    empty table in silence for an app whose topics were on aws from the start (the database's
    topology never held them, only its bindings). docs/runbooks.md's first step for a stuck
    delivery (`deliveries --status InFlight`) answered "(none)" while stats counted some in flight;
    and a search by an aws delivery id found nothing, though `delivery` shows it."""
    env, _ = deployed
    stats = workqueue("stats", env=env, cwd=ROOT)
    assert stats.returncode == 0, stats.stderr
    assert "subscription(s) of aws topics are not listed" in stats.stderr and "orders.email" in stats.stderr

    held = workqueue("deliveries", "--subscription", "orders.email", "--status", "InFlight", "--app", APP,
                     env=env, cwd=ROOT)
    assert held.returncode == 0, held.stderr
    assert "lists the InFlight deliveries of the process that asks" in held.stderr
    assert "in flight (`workqueue stats`)" in held.stderr

    listed = workqueue("--json", "dead-letters", "--subscription", "orders.email", "--app", APP, env=env, cwd=ROOT)
    first = json.loads(listed.stdout)[0]["DeliveryID"]
    found = workqueue("--json", "search", first, "--app", APP, env=env, cwd=ROOT)
    assert found.returncode == 0, found.stderr
    [hit] = json.loads(found.stdout)
    assert (hit["Matched"], hit["Delivery"]["DeliveryID"], hit["Delivery"]["Status"]) == (
        "delivery id", first, "DeadLettered")
