"""The pytest plugin of fastapi-workqueue (registered through the ``pytest11`` entry point).

``workqueue_fake`` puts the jobs fake in place for one test and yields it::

    async def test_signup_queues_the_welcome_mail(client, workqueue_fake):
        client.post("/users", json={...})
        workqueue_fake.assert_dispatched(send_welcome_mail, times=1)
        assert (await workqueue_fake.work())["failed"] == 0

It fakes the queue that the ``workqueue_queue`` fixture returns: by default the one queue of the
test process that declares jobs (imported with your app). Where there are several, or to be
explicit, override that fixture in your ``conftest.py`` (``return app.state.queue``), or name the
queue in your pytest configuration: ``workqueue_queue = "myapp.main:queue"``
(``[tool.pytest.ini_options]`` or ``pytest.ini``).
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Iterator
from typing import Any

import pytest

INI_OPTION = "workqueue_queue"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(INI_OPTION, "MODULE:ATTR of the WorkQueue that the workqueue_fake fixture fakes", default="")


@pytest.fixture
def workqueue_queue(request: pytest.FixtureRequest) -> Any:
    """The WorkQueue under test: the ``workqueue_queue`` ini option's, or else the one queue of this
    process that declares jobs (override the fixture to choose)."""
    path = str(request.config.getini(INI_OPTION) or "")
    if not path:
        return _the_queue_with_jobs()
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise pytest.UsageError(
            f"{INI_OPTION} = {path!r} does not name a WorkQueue: write MODULE:ATTR, e.g. \"myapp.main:queue\""
        )
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


def _the_queue_with_jobs() -> Any:
    from ..jobs.layer import queues_with_jobs

    queues = queues_with_jobs()
    if len(queues) > 1:  # a queue and its jobs layer refer to each other: the dead ones wait for the collector
        gc.collect()
        queues = queues_with_jobs()
    if len(queues) == 1:
        return queues[0]
    found = "no WorkQueue that declares a job is" if not queues else f"{len(queues)} WorkQueues that declare jobs are"
    raise pytest.UsageError(
        f"workqueue_fake needs your WorkQueue, and {found} alive in this test process: define a fixture named "
        f"workqueue_queue that returns it, or set {INI_OPTION} = \"myapp.main:queue\" in your pytest configuration"
    )


@pytest.fixture
def workqueue_fake(workqueue_queue: Any) -> Iterator[Any]:
    """The jobs fake of ``workqueue_queue`` for this test: dispatches are checked and recorded."""
    with workqueue_queue.fake() as fake:
        yield fake
