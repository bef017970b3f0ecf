"""The destructive-change gate (infrastructure/terraform/aws/gate.py) on plan files, run as users run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GATE = Path(__file__).resolve().parents[2] / "infrastructure" / "terraform" / "aws" / "gate.py"
PLANS = Path(__file__).resolve().parent / "plans"

QUEUE = 'module.workqueue.aws_sqs_queue.queue["orders.email"]'
DLQ = 'module.workqueue.aws_sqs_queue.dlq["orders.email"]'
TOPIC = 'module.workqueue.aws_sns_topic.topic["orders.legacy"]'


def gate(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "WORKQUEUE_ALLOW_DESTRUCTIVE"}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, str(GATE), *args], capture_output=True, text=True, env=environ, input=stdin, check=False
    )


def test_a_plan_that_updates_and_creates_passes() -> None:
    run = gate(str(PLANS / "safe.json"))
    assert run.returncode == 0, run.stderr
    assert "no queue, topic or key is deleted or replaced" in run.stdout


def test_a_plan_without_changes_passes() -> None:
    run = gate(str(PLANS / "empty.json"))
    assert run.returncode == 0, run.stderr


def test_replacing_queues_and_deleting_a_topic_is_blocked() -> None:
    run = gate(str(PLANS / "destructive.json"))
    assert run.returncode == 1
    lines = run.stdout.splitlines()
    assert f"BLOCKED: {QUEUE} would be replaced (forced by a change of fifo_queue, name)" in lines
    assert f"BLOCKED: {DLQ} would be replaced (forced by a change of name)" in lines
    assert f"BLOCKED: {TOPIC} would be deleted (delete_because_each_key)" in lines
    # A subscription's deletion loses no stored message: it is not gated.
    assert not any("aws_sns_topic_subscription" in line for line in lines)
    assert "3 destructive change(s)" in run.stderr and "--allow" in run.stderr


def test_deleting_the_kms_key_is_blocked() -> None:
    run = gate(str(PLANS / "kms_key_deleted.json"))
    assert run.returncode == 1
    assert "BLOCKED: aws_kms_key.queue[0] would be deleted" in run.stdout


def test_allowing_some_addresses_still_blocks_the_others() -> None:
    run = gate(str(PLANS / "destructive.json"), "--allow", QUEUE, "--allow", DLQ)
    assert run.returncode == 1
    assert f"allowed: {QUEUE} would be replaced" in run.stdout
    assert f"BLOCKED: {TOPIC} would be deleted" in run.stdout
    assert "1 destructive change(s)" in run.stderr


def test_allowing_every_address_passes() -> None:
    run = gate(str(PLANS / "destructive.json"), "--allow", QUEUE, "--allow", DLQ, "--allow", TOPIC)
    assert run.returncode == 0, run.stderr
    assert "every destructive change is allowed" in run.stdout


def test_allow_all_flag_passes() -> None:
    assert gate(str(PLANS / "destructive.json"), "--allow-all").returncode == 0


@pytest.mark.parametrize("value", ["1", "true", "all"])
def test_the_environment_allows_everything(value: str) -> None:
    assert gate(str(PLANS / "destructive.json"), env={"WORKQUEUE_ALLOW_DESTRUCTIVE": value}).returncode == 0


def test_the_environment_allows_a_list_of_addresses() -> None:
    run = gate(str(PLANS / "destructive.json"), env={"WORKQUEUE_ALLOW_DESTRUCTIVE": f"{QUEUE}, {DLQ}"})
    assert run.returncode == 1
    assert f"BLOCKED: {TOPIC}" in run.stdout and f"allowed: {QUEUE}" in run.stdout
    both = f"{QUEUE},{DLQ},{TOPIC}"
    assert gate(str(PLANS / "destructive.json"), env={"WORKQUEUE_ALLOW_DESTRUCTIVE": both}).returncode == 0


def test_the_plan_is_read_from_stdin() -> None:
    run = gate("-", stdin=(PLANS / "destructive.json").read_text(encoding="utf-8"))
    assert run.returncode == 1
    assert f"BLOCKED: {TOPIC}" in run.stdout


def test_a_state_file_is_refused_with_what_to_pass() -> None:
    run = gate(str(PLANS / "state_not_plan.json"))
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "gate: the input is not a plan in JSON: pass the output of `terraform show -json <planfile>`"
    )


def test_a_binary_plan_file_is_refused(tmp_path: Path) -> None:
    binary = tmp_path / "tfplan"
    binary.write_bytes(b"PK\x03\x04\xff\xfe not json")
    run = gate(str(binary))
    assert run.returncode == 2
    assert "is not JSON" in run.stderr and "terraform show -json" in run.stderr


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    run = gate(str(tmp_path / "absent.json"))
    assert run.returncode == 2
    assert "cannot read" in run.stderr
