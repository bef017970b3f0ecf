"""Settings typed wrong are loud: an unknown keyword raises with the name it resembles, an unknown
``WORKQUEUE_*`` variable is a warning at start, and the database password stays out of reprs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fastapi_workqueue import ConfigurationError, WorkQueue, WorkQueueSettings
from fastapi_workqueue.settings import unknown_variables


def test_a_misspelt_setting_raises_with_the_name_it_resembles() -> None:
    with pytest.raises(ConfigurationError) as raised:
        WorkQueueSettings(databse_url="sqlite+aiosqlite:///x.db")  # type: ignore[call-arg]
    assert str(raised.value) == "WorkQueueSettings has no setting 'databse_url'; did you mean 'database_url'?"
    with pytest.raises(ConfigurationError, match=r"has no setting 'colour'; see docs/configuration\.md"):
        WorkQueueSettings(colour="blue")  # type: ignore[call-arg]


def test_the_database_password_is_masked_in_the_repr() -> None:
    settings = WorkQueueSettings(database_url="postgresql+asyncpg://app:s3cret-pw@db.internal:5432/orders")
    shown = repr(settings)
    assert "s3cret-pw" not in shown and "s3cret-pw" not in str(settings)
    assert "postgresql+asyncpg://app:***@db.internal:5432/orders" in shown
    # The value itself is what the code connects with.
    assert settings.database_url == "postgresql+asyncpg://app:s3cret-pw@db.internal:5432/orders"


def test_unknown_variables_name_the_closest_setting() -> None:
    environ = {
        "WORKQUEUE_DATABSE_URL": "x", "WORKQUEUE_DATABASE_URL": "y", "WORKQUEUE_CONCURENCY": "2",
        "WORKQUEUE_APP": "app:app", "WORKQUEUE_SUBSCRIPTION_POLICY": "{}", "WORKQUEUE_XYZZY": "1", "HOME": "/",
    }
    assert unknown_variables(environ) == [
        "WORKQUEUE_CONCURENCY is not a setting of fastapi-workqueue and is ignored; "
        "did you mean WORKQUEUE_JOB_CONCURRENCY?",
        "WORKQUEUE_DATABSE_URL is not a setting of fastapi-workqueue and is ignored; "
        "did you mean WORKQUEUE_DATABASE_URL?",
        "WORKQUEUE_XYZZY is not a setting of fastapi-workqueue and is ignored; see docs/configuration.md for "
        "the settings",
    ]


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
