#!/usr/bin/env python3
"""The load benchmark's HTTP client: N concurrent clients posting orders for a fixed time.

    python bench/load/load_client.py --url http://127.0.0.1:8000 --path /orders --clients 8 \\
        --duration 10 --output client.json

It runs in a process of its own so that its CPU is not the app's. With ``--handshake`` it prints
``READY`` and waits for a line on stdin before it starts (bench/load/load.py takes its "before" readings
then), prints ``END`` when the time is up (no new request starts after it) and ``DONE`` when every
request has been answered or has timed out. Each client has an HTTP client and a connection of its
own (aiohttp by default: it costs the client about a sixth of httpx's CPU per request, CPU the app
and the database then have; ``--library httpx`` for the other) and posts valid orders one after
another, for customers spread over ``--customers`` keys. A request that takes longer than
``--request-timeout`` is an error of kind ``timeout``; the other kinds are the HTTP status (``201``,
``500`` …), ``connection_refused``, ``connection_reset``, ``disconnected`` (the server closed the
connection without an answer) and ``error:<type>``. After a connection error a client pauses 50 ms,
so a server that refuses connections is not hammered in a loop.

The output JSON holds one record per request: ``[start (epoch s), latency (s), kind, order_id,
message_id, client index]``, the start being ``time.time()`` just before the request was sent (bench/load/load.py
compares it with the deliveries' ``settled_at``: same machine, same clock), and the client's own
CPU seconds while it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx

REFUSED = "503_retry_after"
CONNECTION_PAUSE = 0.05

Record = tuple[float, float, str, int | None, str | None, int]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def error_kind(exc: BaseException) -> str:
    """The kind of a failed request, for the report's errors by kind."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        text = str(exc).lower()
        return "connection_refused" if "refused" in text or "errno 111" in text else "connect_error"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return "disconnected"
    if isinstance(exc, (aiohttp.ClientOSError, ConnectionResetError)):
        return "connection_reset"
    if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        text = str(exc).lower()
        return "connection_refused" if "refused" in text or "errno 111" in text else "connect_error"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "disconnected"
    if isinstance(exc, (httpx.ReadError, httpx.WriteError)):
        return "connection_reset"
    return f"error:{type(exc).__name__}"


def ids_of(body: Any) -> tuple[int | None, str | None]:
    """order_id and MessageID of an answer of POST /orders or of the baseline route."""
    if not isinstance(body, dict):
        return None, None
    order_id = body.get("order_id")
    message_id = body.get("message_id")
    publish = body.get("publish")
    if isinstance(publish, dict):
        message_id = publish.get("MessageID", publish.get("message_id"))
    return (order_id if isinstance(order_id, int) else None, message_id if isinstance(message_id, str) else None)


class Orders:
    """Valid order bodies for customers spread over ``customers`` keys, from a seeded random source."""

    def __init__(self, seed: int, customers: int) -> None:
        self.rng = random.Random(seed)
        self.customers = customers

    def next(self) -> dict[str, Any]:
        customer = f"customer-{self.rng.randrange(self.customers):05d}"
        return {"customer": customer, "email": f"{customer}@example.com",
                "amount_cents": self.rng.randint(100, 100_000)}


Answer = tuple[int, str | None, bytes]
"""What a post gives back: the status, the Retry-After header (or None) and the body."""
Post = Callable[[dict[str, Any]], Awaitable[Answer]]


async def one_client(post: Post, orders: Orders, deadline: float, request_timeout: float,
                     records: list[Record], index: int) -> None:
    while time.monotonic() < deadline:
        body = orders.next()
        started_wall = time.time()
        started = time.perf_counter()
        order_id: int | None = None
        message_id: str | None = None
        retry_after: str | None = None
        try:
            async with asyncio.timeout(request_timeout):
                status, retry_after, data = await post(body)
        except Exception as exc:
            kind = error_kind(exc)
        else:
            kind = str(status)
            if status == 201:
                with contextlib.suppress(ValueError):
                    order_id, message_id = ids_of(json.loads(data))
            elif status == 503 and retry_after is not None:
                kind = REFUSED  # refused with Retry-After, as issue 16 allows: honoured, as a client should
        records.append((started_wall, time.perf_counter() - started, kind, order_id, message_id, index))
        if kind == REFUSED and retry_after is not None:
            with contextlib.suppress(ValueError):
                await asyncio.sleep(max(0.0, min(float(retry_after), deadline - time.monotonic())))
        if kind in ("connection_refused", "connect_error", "connection_reset", "disconnected"):
            await asyncio.sleep(CONNECTION_PAUSE)


async def aiohttp_posters(stack: contextlib.AsyncExitStack, args: argparse.Namespace) -> list[Post]:
    """One session with a connector of one connection per simulated client."""
    timeout = aiohttp.ClientTimeout(total=args.request_timeout + 5)
    url = args.url.rstrip("/") + args.path

    def poster(session: aiohttp.ClientSession) -> Post:
        async def post(body: dict[str, Any]) -> Answer:
            async with session.post(url, json=body) as response:
                return response.status, response.headers.get("retry-after"), await response.read()
        return post

    return [poster(await stack.enter_async_context(aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1), timeout=timeout)))
            for _ in range(args.clients)]


async def httpx_posters(stack: contextlib.AsyncExitStack, args: argparse.Namespace) -> list[Post]:
    """One httpx client (and connection) per simulated client: a shared pool of N connections
    costs the client CPU that grows with N on every request (0.5 of a core at 50 clients)."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    # httpx's own timeouts sit above --request-timeout: the bound that counts is the client's.
    timeout = httpx.Timeout(args.request_timeout + 5)

    def poster(client: httpx.AsyncClient) -> Post:
        async def post(body: dict[str, Any]) -> Answer:
            response = await client.post(args.path, json=body)
            return response.status_code, response.headers.get("retry-after"), response.content
        return post

    return [poster(await stack.enter_async_context(httpx.AsyncClient(base_url=args.url, limits=limits,
                                                                      timeout=timeout)))
            for _ in range(args.clients)]


LIBRARIES = {"aiohttp": (aiohttp_posters, lambda: f"aiohttp {aiohttp.__version__}"),
             "httpx": (httpx_posters, lambda: f"httpx {httpx.__version__}")}


async def drive(args: argparse.Namespace) -> dict[str, Any]:
    make_posters, version = LIBRARIES[args.library]
    async with contextlib.AsyncExitStack() as stack:
        posters = await make_posters(stack, args)
        if args.handshake:
            print("READY", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        records: list[Record] = []
        cpu_start = cpu_seconds()
        started_wall = time.time()
        started = time.monotonic()
        deadline = started + args.duration
        tasks = [asyncio.create_task(one_client(post, Orders(args.seed * 100_003 + i, args.customers),
                                                deadline, args.request_timeout, records, i))
                 for i, post in enumerate(posters)]
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        ended_wall = time.time()
        if args.handshake:
            print("END", flush=True)
        await asyncio.gather(*tasks)
        done_wall = time.time()
        cpu = cpu_seconds() - cpu_start
    if args.handshake:
        print("DONE", flush=True)
    return {
        "url": args.url, "path": args.path, "clients": args.clients, "duration": args.duration,
        "request_timeout": args.request_timeout, "customers": args.customers, "seed": args.seed,
        "started_at": started_wall, "ended_at": ended_wall, "done_at": done_wall,
        "cpu_seconds": cpu, "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "library": version(), "records": records,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the app's base URL")
    ap.add_argument("--path", default="/orders", help="the route to post to")
    ap.add_argument("--clients", type=int, required=True, help="concurrent clients")
    ap.add_argument("--duration", type=float, required=True, help="seconds during which requests start")
    ap.add_argument("--request-timeout", type=float, default=30.0, help="a request slower than this is a timeout")
    ap.add_argument("--customers", type=int, default=1000, help="distinct customers (partition keys)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random bodies")
    ap.add_argument("--output", required=True, help="where to write the JSON")
    ap.add_argument("--library", choices=("aiohttp", "httpx"), default="aiohttp",
                    help="the HTTP client library (aiohttp costs the client about a sixth of httpx's CPU)")
    ap.add_argument("--handshake", action="store_true", help="print READY, wait for a stdin line, print END, DONE")
    args = ap.parse_args()
    if args.clients < 1 or args.duration <= 0 or args.request_timeout <= 0 or args.customers < 1:
        ap.error("--clients and --customers must be at least 1, --duration and --request-timeout above 0")
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(drive(args))
    else:
        result = uvloop.run(drive(args))
    Path(args.output).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
