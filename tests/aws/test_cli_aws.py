"""The AWS commands of `workqueue`, run as a user runs them, against a moto server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from .moto_server import credentials_env, moto_server
from .resources import REGION, manifest_for, provision


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in credentials_env().items():
        monkeypatch.setenv(key, value)


def workqueue(*args: str, endpoint: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **credentials_env()}
    env.pop("WORKQUEUE_APP", None)
    if endpoint:
        env["WORKQUEUE_AWS_ENDPOINT_URL"] = endpoint
    return subprocess.run([sys.executable, "-m", "fastapi_workqueue", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, check=False)


@pytest.fixture
def files(endpoint: str, tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    tag = uuid.uuid4().hex[:8]
    manifest = manifest_for(tag)
    bindings = provision(endpoint, manifest)
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
    boto3.client("sqs", region_name=REGION, endpoint_url=endpoint, **_keys()).set_queue_attributes(
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


def _keys() -> dict[str, str]:
    env = credentials_env()
    return {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}
