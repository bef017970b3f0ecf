"""Secrets are taken out of error text before it is stored or shown."""

from __future__ import annotations

import pytest

from fastapi_workqueue.core.redaction import MASK, redact


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("connect postgresql://app:s3cret@db:5432/x failed", "connect postgresql://app:***@db:5432/x failed"),
        ("Authorization: Bearer abc.def-ghi", "Authorization: Bearer ***"),
        ('headers={"authorization": "Bearer xyz"}', 'headers={"authorization": "Bearer ***"}'),
        ("sent bearer eyJhbGciOi.J9 upstream", "sent bearer *** upstream"),
        ("Cookie: session=abc; other=1", "Cookie: ***"),
        ("Set-Cookie: a=b", "Set-Cookie: ***"),
        ("key wq_abc123_SECRETSECRET used", "key wq_abc123_*** used"),
        ("password=hunter2 user=bob", "password=*** user=bob"),
        ('api_key: "k-123"', 'api_key: "***"'),
        ("aws_secret_access_key=ABCD/efgh", "aws_secret_access_key=***"),
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
