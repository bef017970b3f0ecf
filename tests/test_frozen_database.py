"""A stop while the database stops answering (frozen: connections stay open, nothing comes back).

A refused connection fails at once; a frozen server leaves every call waiting. The test puts a TCP
relay between the queue and PostgreSQL and, mid-run, stops relaying bytes either way (what a
SIGSTOPped server or a network partition looks like to the client). The stop must keep to its
documented bound (docs/production.md: 2 x the drain plus 5 s), whatever still waits on the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncIterator

import asyncpg
import pytest

from .support import stop_time_in_an_outage


class FreezableRelay:
    """Relays TCP between clients and PostgreSQL until :meth:`freeze`; then holds every connection
    open and passes nothing on, in either direction."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.frozen = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    def freeze(self) -> None:
        self.frozen.set()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.writers += [writer, up_writer]
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self.tasks.add(task)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while chunk := await source.read(65536):
                if self.frozen.is_set():
                    await asyncio.Event().wait()  # (held open, never answered)
                sink.write(chunk)
                await sink.drain()


@pytest.fixture
async def relay(pg_url: str) -> AsyncIterator[tuple[FreezableRelay, str]]:
    parts = urllib.parse.urlsplit(pg_url)
    relay = FreezableRelay(parts.hostname or "127.0.0.1", parts.port or 5432)
    port = await relay.start()
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    url = urllib.parse.urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))
    try:
        yield relay, url
    finally:
        await relay.close()


async def test_a_stop_while_the_database_is_frozen_keeps_to_its_bound(relay: tuple[FreezableRelay, str]) -> None:
    freezer, url = relay

    async def freeze() -> None:
        freezer.freeze()

    stopped_in = await stop_time_in_an_outage(url, freeze, drain=0.5)
    assert stopped_in < 2 * 0.5 + 5, f"the stop took {stopped_in:.1f} s"


async def test_a_pool_closed_while_the_server_is_frozen_leaves_no_connection_open(
    relay: tuple[FreezableRelay, str],
) -> None:
    """Idle connections are seen off together, within the bound; those the frozen server never
    answers are terminated, not left open (a bound on the whole close cancelled it midway)."""
    from fastapi_workqueue.database.pool import ConnectionPool
    from fastapi_workqueue.database.postgres import to_asyncpg_dsn

    freezer, url = relay
    pool = ConnectionPool(lambda: asyncpg.connect(to_asyncpg_dsn(url)), min_size=0, max_size=5)
    held = [await pool.get() for _ in range(5)]
    for conn in held:
        pool.put(conn)
    freezer.freeze()
    started = asyncio.get_running_loop().time()
    await pool.close(within=1.0)
    assert asyncio.get_running_loop().time() - started < 2.0
    assert [conn.is_closed() for conn in held] == [True] * 5
