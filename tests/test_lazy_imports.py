"""A worker loads only what it runs: a process that builds a WorkQueue, registers a handler, starts
its host and handles a message never imports the web framework, SQLAlchemy, the dashboard, the
jobs layer, the AWS transport, the OpenTelemetry API or prometheus-client (bench/README.md, memory:
these cost a worker about 11 MB). It still counts for Prometheus, in plain Python
(``observability.tally``), for whatever serves the counts later. A handler that declares a
dependency brings FastAPI in, and only then.

Each case runs in a fresh interpreter, since the test session itself has imported everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

NOT_IN_A_WORKER = (
    "fastapi",
    "starlette",
    "sqlalchemy",
    "jinja2",
    "opentelemetry.trace",
    "opentelemetry.metrics",
    "prometheus_client",
    "fastapi_workqueue.aws",
    "fastapi_workqueue.dashboard",
    "fastapi_workqueue.jobs",
    "fastapi_workqueue.core.routing",
    "fastapi_workqueue.observability.otel",
    "fastapi_workqueue.observability.metrics_router",
    "fastapi_workqueue.observability.prometheus",
    "fastapi_workqueue.web.auth",
    "fastapi_workqueue.web.current",
    "fastapi_workqueue.web.fastapi_internals",
    "fastapi_workqueue.web.health",
    "fastapi_workqueue.web.routes",
)
"""What a worker on the database transport, with no job declared and no dependency in its handlers,
does not import (a module or any of its submodules). Of the observability package only its
``__init__``, the small deferred OpenTelemetry observer and the plain counts of :mod:`.tally` load
(docs/observability.md)."""

WORKER = textwrap.dedent("""
    import asyncio, json, sys
    from typing import Annotated
    from pydantic import BaseModel
    from fastapi_workqueue import (
        PublishRequest, Subscription, Topic, WorkContext, WorkMessage, WorkQueue, WorkQueueSettings,
    )

    class Order(BaseModel):
        number: int

    queue = WorkQueue(
        WorkQueueSettings(database_url=sys.argv[1], auto_migrate=True),
        topics=[Topic(name="orders.placed")],
        subscriptions=[Subscription(name="orders-email", topic="orders.placed", handler_key="email")],
    )
    handled = asyncio.Event()
    seen = {}

    if sys.argv[2] == "plain":
        @queue.handler("email")
        async def email(message: WorkMessage[Order], context: WorkContext) -> None:
            seen["number"] = message.payload.number
            handled.set()
    else:
        from fastapi import Depends

        def greeting() -> str:
            return "hello"

        @queue.handler("email")
        async def email(message: WorkMessage[Order], word: Annotated[str, Depends(greeting)]) -> None:
            seen["number"], seen["word"] = message.payload.number, word
            handled.set()

    async def main() -> None:
        async with queue.lifespan(None):
            assert queue.host is not None
            await queue.publish("orders.placed", [PublishRequest(payload={"number": 7})])
            await asyncio.wait_for(handled.wait(), 60)

    asyncio.run(main())
    print(json.dumps({"seen": seen, "modules": sorted(sys.modules)}))
""")


def run_worker(tmp_path: Path, handler: str) -> dict[str, object]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'worker.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_")}  # (multiprocess mode loads it)
    done = subprocess.run([sys.executable, "-c", WORKER, url, handler], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def loaded(modules: object, names: tuple[str, ...]) -> list[str]:
    assert isinstance(modules, list)
    return sorted(m for m in modules if any(m == name or m.startswith(name + ".") for name in names))


def test_a_worker_with_plain_handlers_imports_no_web_framework_and_no_unused_layer(tmp_path: Path) -> None:
    result = run_worker(tmp_path, "plain")
    assert result["seen"] == {"number": 7}
    assert loaded(result["modules"], NOT_IN_A_WORKER) == []


def test_a_handler_that_declares_a_dependency_brings_fastapi_in(tmp_path: Path) -> None:
    result = run_worker(tmp_path, "dependency")
    assert result["seen"] == {"number": 7, "word": "hello"}
    assert loaded(result["modules"], ("fastapi", "fastapi_workqueue.web.fastapi_internals")) != []
    # The layers that serve HTTP stay out all the same.
    assert loaded(result["modules"], ("sqlalchemy", "jinja2", "fastapi_workqueue.dashboard",
                                      "fastapi_workqueue.jobs", "fastapi_workqueue.web.routes")) == []


def test_the_process_registry_reads_the_installed_version_from_the_metadata_headers() -> None:
    """``package_version`` reads only METADATA's headers (the email parser would keep about 0.5 MB
    of the README in every process) and agrees with ``importlib.metadata``."""
    from importlib.metadata import version

    from fastapi_workqueue.core.processes import package_version

    assert package_version() == version("fastapi-workqueue")


def test_workqueue_work_loads_none_of_the_other_commands(tmp_path: Path) -> None:
    """The ``workqueue`` group imports a command's module when the command is run or listed, so a
    ``workqueue work`` process holds none of the operator's commands (about 0.5 MB, bench/README.md)."""
    script = textwrap.dedent("""
        import json, sys
        from fastapi_workqueue.cli import main
        sys.argv = ["workqueue", "work", "--help"]
        try:
            main()
        except SystemExit as exit:
            assert exit.code == 0, exit.code
        print(json.dumps(sorted(sys.modules)))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Run subscriptions' handlers" in done.stdout
    modules = json.loads(done.stdout.splitlines()[-1])
    assert "fastapi_workqueue.cli.work" in modules
    others = ("api_keys", "aws", "jobs", "operations", "processes", "sql_scripts", "topology")
    assert loaded(modules, tuple(f"fastapi_workqueue.cli.{name}" for name in others)) == []
