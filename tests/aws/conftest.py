"""Fixtures of the AWS tests: one moto server per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .moto import CREDENTIALS, moto_server


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    """The endpoint of a moto server started for this session (the AWS SDKs get test credentials)."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    try:
        with moto_server() as url:
            yield url
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
