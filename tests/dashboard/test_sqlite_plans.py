"""SQLite runs the dashboard's statements through indexes: ``EXPLAIN QUERY PLAN`` of each names a
search, never a scan, of the tables that grow (deliveries, messages, keys, the stats history)."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from fastapi_workqueue.database.sqlite import SqliteTransport, load_queries

GROWING = {"d": "delivery", "w": "delivery", "m": "message", "p": "partition", "a": "delivery_attempt",
           "b": "delivery_attempt", "delivery_attempt": "delivery_attempt"}
STATEMENTS: dict[str, dict[str, object]] = {
    "live_counts": {"subscription": "s", "cap": 1000, "stuck_before": 0.0},
    "search_partition_key": {"q": "customer-1", "limit": 50},
    "search_correlation_id": {"q": "req-1", "limit": 50},
    "search_job": {"q": "send_mail", "limit": 50},
    "search_message_deliveries": {"ids": '["a"]', "limit": 50},
    "delivery_attempts": {"id": 1},
    "attempt_trim": {"id": 1},
    "blocked_keys": {"subscription": "s", "limit": 25, "cap": 100, "now": 0.0},
    # SQLite plans a statement again with its bound values where they decide which partial index
    # applies, so the one listing statement serves each state through its own index.
    "delivery_list DeadLettered": {"subscription": "s", "status": "DeadLettered", "after_id": 0, "limit": 26},
    "delivery_list InFlight": {"subscription": "s", "status": "InFlight", "after_id": 0, "limit": 50},
    "delivery_get": {"id": 1},
    "stats_history": {"since": 0.0, "subscription": "s"},
    "stats_history_insert": {"now": 0.0, "counted_from": 0.0, "counted_to": 1.0, "window_seconds": 1.0},
    "stats_history_last": {},
}


@pytest.fixture(scope="module")
async def database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "plans.db"
    transport = SqliteTransport(f"sqlite+aiosqlite:///{path}")
    await transport.open()
    try:
        await transport.migrate()
    finally:
        await transport.close()
    return path


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_the_statement_searches_an_index(database: Path, name: str) -> None:
    queries = load_queries()
    conn = sqlite3.connect(database)
    try:
        statement = queries[name.split()[0]]
        plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {statement}", STATEMENTS[name])]
    finally:
        conn.close()
    growing = dict(GROWING, h="stats_history") if name.startswith("stats_history") else GROWING
    scans = [line for line in plan if (m := re.match(r"SCAN (\w+)", line)) and m.group(1) in growing]
    assert plan and not scans, "\n".join(plan)
    searches = " ".join(plan)
    if name in ("delivery_list DeadLettered", "live_counts", "blocked_keys"):
        assert "delivery_dead_letters" in searches, "\n".join(plan)
    for statement, index in (("search_partition_key", "message_partition_key"),
                             ("search_correlation_id", "message_correlation_id"), ("search_job", "message_job"),
                             ("search_message_deliveries", "delivery_message"),
                             ("delivery_attempts", "delivery_attempt_delivery"),
                             ("attempt_trim", "delivery_attempt_delivery")):
        if name == statement:
            assert index in searches, "\n".join(plan)
    if name == "live_counts":
        assert "delivery_claim" in searches and "partition_ready" in searches, "\n".join(plan)
    if name == "delivery_list InFlight":
        assert "delivery_in_flight" in searches, "\n".join(plan)
