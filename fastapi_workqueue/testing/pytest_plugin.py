"""The pytest plugin of fastapi-workqueue (registered through the ``pytest11`` entry point).

``workqueue_fake`` puts the jobs fake in place for one test and yields it::

    async def test_signup_queues_the_welcome_mail(client, workqueue_fake):
        client.post("/users", json={...})
        workqueue_fake.assert_dispatched(send_welcome_mail, times=1)
        assert (await workqueue_fake.work())["failed"] == 0

It fakes the queue that the ``workqueue_queue`` fixture returns. Override that fixture in your
``conftest.py`` (``return app.state.queue``), or name the queue in your pytest configuration:
``workqueue_queue = "myapp.main:queue"`` (``[tool.pytest.ini_options]`` or ``pytest.ini``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest

INI_OPTION = "workqueue_queue"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(INI_OPTION, "MODULE:ATTR of the WorkQueue that the workqueue_fake fixture fakes", default="")


@pytest.fixture
def workqueue_queue(request: pytest.FixtureRequest) -> Any:
    """The WorkQueue under test, from the ``workqueue_queue`` ini option (override the fixture to choose)."""
    path = str(request.config.getini(INI_OPTION) or "")
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise pytest.UsageError(
            "workqueue_fake needs your WorkQueue: define a fixture named workqueue_queue that returns it, or set "
            f"{INI_OPTION} = \"myapp.main:queue\" in your pytest configuration"
        )
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


@pytest.fixture
def workqueue_fake(workqueue_queue: Any) -> Iterator[Any]:
    """The jobs fake of ``workqueue_queue`` for this test: dispatches are checked and recorded."""
    with workqueue_queue.fake() as fake:
        yield fake
