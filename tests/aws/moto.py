"""A moto server on a free port of 127.0.0.1, for the AWS transport's tests (moto's in-process
mock does not patch aiobotocore, so the transport talks HTTP to a real server process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.private_cluster import free_port

REGION = "us-east-1"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}
ROOT = Path(__file__).resolve().parents[2]


def _server_command(port: int) -> list[str]:
    """moto_server with SQS's FIFO group rule kept across concurrent receives (:mod:`.serve_moto`)."""
    if importlib.util.find_spec("moto.server") is None:
        raise RuntimeError("moto_server is not installed: pip install 'moto[server]'")
    return [sys.executable, "-m", "tests.aws.serve_moto", "-H", "127.0.0.1", "-p", str(port)]


@contextmanager
def moto_server() -> Iterator[str]:
    """Starts moto_server (:mod:`.serve_moto`), waits until it answers and yields its endpoint URL;
    stops it after."""
    port = free_port()
    process = subprocess.Popen(
        _server_command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, **CREDENTIALS}, cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            if process.poll() is not None:
                raise RuntimeError(f"moto_server exited with {process.returncode}")
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=1):
                    break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError("moto_server did not answer within 10 s")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def reset(url: str) -> None:
    """Deletes every resource of the server (between tests that must not see each other's)."""
    request = urllib.request.Request(f"{url}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=10):
        pass
