"""The first app of docs/getting-started.md runs as the page says, copied from the page.

The page's Python block is saved as ``app.py`` in an empty folder and started with ``uvicorn
app:app`` (nothing configured: the queue and the app's ``users`` table live in ``workqueue.db``
there); a sign-up is welcomed by the app's own host, with the handler's log line on stderr. Then,
as the page's "worker process" says, the web process runs with ``WORKQUEUE_DISABLE_HOST=1`` and
``workqueue work --app app:app --subscription users.welcome --once`` handles the next sign-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import support

from .conftest import private_database

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "getting-started.md"


def first_app() -> str:
    section = PAGE.read_text(encoding="utf-8").split("## A first app", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "no Python block under 'A first app'"
    return match.group(1)


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def text_of(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKQUEUE_")}
    env.update(extra)
    return env


@pytest.fixture
def app_folder(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text(first_app(), encoding="utf-8")
    return tmp_path


@contextlib.asynccontextmanager
async def uvicorn(folder: Path, log: Path, **env: str) -> AsyncIterator[httpx.AsyncClient]:
    """``uvicorn app:app`` in ``folder``, serving once its health answers; stopped with SIGTERM."""
    port = free_port()
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "uvicorn", "app:app", "--host", "127.0.0.1", "--port", str(port),
            cwd=folder, env=clean_env(**env), stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
        )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:

            async def serving() -> bool:
                assert proc.returncode is None, text_of(log)
                try:
                    return (await client.get("/health/extensions")).status_code == 200
                except httpx.TransportError:
                    return False

            await support.wait_for(serving, within=30, interval=0.1)
            yield client
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    assert proc.returncode in (0, -signal.SIGTERM), text_of(log)


async def sign_up(client: httpx.AsyncClient, email: str) -> str:
    response = await client.post("/users", json={"email": email})
    assert response.status_code == 200, response.text
    body: dict[str, str] = response.json()
    assert body["message_id"]
    return body["user_id"]


async def welcomed(client: httpx.AsyncClient, user_id: str) -> Any:
    body = (await client.get(f"/users/{user_id}")).json()
    return body if body["welcomed_at"] else None


async def test_the_first_app_welcomes_a_user_in_its_own_process(app_folder: Path) -> None:
    log = app_folder / "uvicorn.log"
    async with uvicorn(app_folder, log) as client:
        health = (await client.get("/health/extensions")).json()["Extensions"][0]
        assert health["Status"] == "Running" and health["Subscriptions"][0]["Subscription"] == "users.welcome"
        user_id = await sign_up(client, "ada@example.com")

        async def done() -> Any:
            return await welcomed(client, user_id)

        body = await support.wait_for(done, within=20, interval=0.1)
        assert body["email"] == "ada@example.com"
    text = text_of(log)
    assert "INFO fastapi_workqueue" in text and "welcome mail sent to ada@example.com" in text, text
    assert "Traceback" not in text, text
    assert (app_folder / "workqueue.db").is_file()


async def test_a_worker_process_handles_what_the_web_process_publishes(app_folder: Path) -> None:
    async with uvicorn(app_folder, app_folder / "web.log", WORKQUEUE_DISABLE_HOST="1") as client:
        user_id = await sign_up(client, "grace@example.com")
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fastapi_workqueue", "work", "--app", "app:app",
            "--subscription", "users.welcome", "--once", cwd=app_folder, env=clean_env(PYTHONPATH=str(app_folder)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(worker.communicate(), 60)
        assert worker.returncode == 0, err.decode()
        assert out.decode().startswith("workqueue work: users.welcome: ran 1 delivery"), out.decode()
        assert await welcomed(client, user_id), "the worker did not welcome the user"
    assert "welcome mail sent to grace@example.com" in err.decode()


async def test_the_first_app_runs_on_postgresql_too(app_folder: Path) -> None:
    """The page says production runs on PostgreSQL: the same file, pointed at it, welcomes a user
    (its timestamp column takes the aware time the handler writes)."""
    log = app_folder / "uvicorn.log"
    async with private_database("getting_started") as url, \
            uvicorn(app_folder, log, WORKQUEUE_DATABASE_URL=url) as client:
        user_id = await sign_up(client, "ada@example.com")

        async def done() -> Any:
            return await welcomed(client, user_id)

        body = await support.wait_for(done, within=20, interval=0.1)
        assert body["welcomed_at"].endswith("+00:00"), body
    text = text_of(log)
    assert "welcome mail sent to ada@example.com" in text and "Traceback" not in text, text
