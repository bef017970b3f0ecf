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

``work()`` solves the jobs' dependencies with the app's ``dependency_overrides``: the app that the
``workqueue_app`` fixture returns (or the ``workqueue_app = "myapp.main:app"`` option names), else
the one app of the process that serves the queue, found whether its lifespan ran or not.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Iterator
from typing import Any

import pytest

# The conformance suite's cases are plain asserts in the package: rewritten like a test's, so a
# failing case shows its values.
pytest.register_assert_rewrite("fastapi_workqueue.testing.conformance")

INI_OPTION = "workqueue_queue"
APP_OPTION = "workqueue_app"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(INI_OPTION, "MODULE:ATTR of the WorkQueue that the workqueue_fake fixture fakes", default="")
    parser.addini(APP_OPTION, "MODULE:ATTR of the app whose dependency_overrides workqueue_fake.work() applies",
                  default="")


@pytest.fixture
def workqueue_queue(request: pytest.FixtureRequest) -> Any:
    """The WorkQueue under test: the ``workqueue_queue`` ini option's, or else the one queue of this
    process that declares jobs (override the fixture to choose)."""
    path = str(request.config.getini(INI_OPTION) or "")
    if not path:
        return _the_queue_with_jobs()
    return _load(INI_OPTION, path, "a WorkQueue", "myapp.main:queue")


@pytest.fixture
def workqueue_app(request: pytest.FixtureRequest) -> Any:
    """The app whose ``dependency_overrides`` the fake's ``work()`` applies: the ``workqueue_app`` ini
    option's, or None, and then the one app that serves the queue (override the fixture to choose)."""
    path = str(request.config.getini(APP_OPTION) or "")
    return _load(APP_OPTION, path, "an app", "myapp.main:app") if path else None


def _load(option: str, path: str, what: str, example: str) -> Any:
    # pytest.ini and setup.cfg keep quotes as part of the value; pyproject.toml's TOML strings do not.
    path = path.strip().strip("\"'")
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise pytest.UsageError(f"{option} = {path!r} does not name {what}: write MODULE:ATTR, e.g. \"{example}\"")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise pytest.UsageError(f"{option} = {path!r}: module {module_name!r} cannot be imported ({exc})") from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise pytest.UsageError(f"{option} = {path!r}: {module_name!r} has no {attr!r} ({part!r} is missing); "
                                    f"name {what}, e.g. \"{example}\"")
        target = getattr(target, part)
    if option == INI_OPTION and not hasattr(target, "fake"):
        raise pytest.UsageError(f"{option} = {path!r} is a {type(target).__name__}, not a WorkQueue; name the queue, "
                                f"e.g. \"{example}\" (the app goes in {APP_OPTION})")
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
def workqueue_fake(workqueue_queue: Any, workqueue_app: Any) -> Iterator[Any]:
    """The jobs fake of ``workqueue_queue`` for this test: dispatches are checked and recorded, and
    ``work()`` runs them with the dependency overrides of ``workqueue_app``."""
    with workqueue_queue.fake(app=workqueue_app) as fake:
        yield fake
