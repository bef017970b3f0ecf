"""Secrets are taken out of error text before it is stored or shown."""

from __future__ import annotations

import importlib
import json
import logging
import re
from pathlib import Path

import pytest

import fastapi_workqueue
from fastapi_workqueue.cli.log_setup import JsonFormatter, TextFormatter
from fastapi_workqueue.core.redaction import MASK, RedactingFilter, redact, redacting_logger


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("connect postgresql://app:s3cret@db:5432/x failed", "connect postgresql://app:***@db:5432/x failed"),
        ("connect postgresql://app:s3/cr?t#@db:5432/x failed", "connect postgresql://app:***@db:5432/x failed"),
        ("connect postgresql://app:p@ssSECRETword@db.internal/app failed",
         "connect postgresql://app:***@db.internal/app failed"),
        ("password='SECRET words here' refused", "password='***' refused"),
        ('config {"password": "SECRET words here", "user": "bob"}', 'config {"password": "***", "user": "bob"}'),
        ("Authorization: Bearer abc.def-ghi", "Authorization: Bearer ***"),
        ('headers={"authorization": "Bearer xyz"}', 'headers={"authorization": "Bearer ***"}'),
        ("sent bearer eyJhbGciOi.J9 upstream", "sent bearer *** upstream"),
        ("Cookie: session=abc; other=1", "Cookie: ***"),
        ("Set-Cookie: a=b", "Set-Cookie: ***"),
        ("key wq_abc123_SECRETSECRET used", "key wq_abc123_*** used"),
        ("password=hunter2 user=bob", "password=*** user=bob"),
        ('api_key: "k-123"', 'api_key: "***"'),
        ("aws_secret_access_key=ABCD/efgh", "aws_secret_access_key=***"),
        ("token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjMifQ.SflKxwRJSMeKKF2QT4 refused",
         "token *** refused"),
        ("signing failed with -----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0B\n-----END PRIVATE KEY----- here",
         "signing failed with -----BEGIN PRIVATE KEY-----*** here"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\n-----END RSA PRIVATE KEY-----",
         "-----BEGIN RSA PRIVATE KEY-----***"),
    ],
)
def test_credentials_are_masked(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(
    "text",
    ["ValueError: boom at line 3", "https://example.com/path?x=1", 'File "/app/jobs.py", line 12, in send'],
)
def test_ordinary_text_is_kept(text: str) -> None:
    assert redact(text) == text


def test_literal_secrets_are_masked_and_redaction_is_idempotent() -> None:
    text = redact("my key is FERNETKEY123 ok, password=x", ["FERNETKEY123"])
    assert text == f"my key is {MASK} ok, password={MASK}"
    assert redact(text) == text


def _raise_with_secrets() -> None:
    try:
        raise ConnectionError("connect postgresql://app:s3cret@db:5432/x failed")
    except ConnectionError as exc:
        raise RuntimeError("upstream said Authorization: Bearer tok-42") from exc


def test_a_package_logger_redacts_message_and_traceback(caplog: pytest.LogCaptureFixture) -> None:
    logger = redacting_logger("fastapi_workqueue.test-redaction")
    caplog.set_level(logging.INFO, logger="fastapi_workqueue.test-redaction")
    try:
        _raise_with_secrets()
    except RuntimeError:
        logger.exception("calling %s failed", "https://bob:pa55word@api.example/x")
    logger.info("plain %s line", "ordinary")
    [failed, plain] = caplog.records
    assert failed.getMessage() == "calling https://bob:***@api.example/x failed"
    assert failed.exc_info is None
    assert failed.exc_text is not None
    assert failed.exc_text.startswith("Traceback (most recent call last):")
    assert "in _raise_with_secrets" in failed.exc_text
    assert failed.exc_text.splitlines()[-1] == "RuntimeError: upstream said Authorization: Bearer ***"
    assert "postgresql://app:***@db:5432/x" in failed.exc_text
    # A line with nothing to hide keeps its template and arguments (log tools group by them).
    assert (plain.msg, plain.args) == ("plain %s line", ("ordinary",))
    for secret in ("s3cret", "tok-42", "pa55word"):
        assert secret not in caplog.text


def test_every_logger_of_the_package_redacts() -> None:
    package = Path(fastapi_workqueue.__file__).parent
    names: set[str] = set()
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        if module == "fastapi_workqueue.__main__":
            continue
        importlib.import_module(module)
        source = path.read_text(encoding="utf-8")
        if module != "fastapi_workqueue.core.redaction":
            # A logger of the package is made by redacting_logger; only the root is touched by name
            # (the CLI's log set-up).
            assert not re.search(r'getLogger\(f?"fastapi_workqueue', source), module
        names.update(re.findall(r'redacting_logger\("([^"]+)"\)', source))
    assert len(names) >= 10
    for name in names:
        assert any(isinstance(f, RedactingFilter) for f in logging.getLogger(name).filters), name


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()])
def test_the_workers_formatters_print_the_redacted_traceback(formatter: logging.Formatter) -> None:
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    logger = redacting_logger("fastapi_workqueue.test-formatters")
    handler = Collect()
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    try:
        _raise_with_secrets()
    except RuntimeError:
        logger.exception("attempt failed")
    finally:
        logger.removeHandler(handler)
    [line] = lines
    text = json.loads(line)["exception"] if isinstance(formatter, JsonFormatter) else line
    assert "RuntimeError: upstream said Authorization: Bearer ***" in text
    assert "in _raise_with_secrets" in text
    assert "s3cret" not in line and "tok-42" not in line
