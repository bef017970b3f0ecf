"""Ports: a transport's optional parts resolved once, so no part of the library probes for them."""

from __future__ import annotations

import ast
from pathlib import Path

from fastapi_workqueue.core.ports import Ports
from fastapi_workqueue.database import create_database_transport

PACKAGE = Path(__file__).resolve().parent.parent / "fastapi_workqueue"
CONFORMANCE = PACKAGE / "testing" / "conformance"


async def test_a_database_transport_has_every_optional_part_but_the_interrupter(tmp_path: Path) -> None:
    transport = create_database_transport(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}")
    ports = Ports.of(transport)
    assert ports.transport is transport
    assert ports.processes is transport
    assert ports.live_work is transport
    assert ports.history is transport
    assert ports.attempts is transport
    assert ports.search is transport
    assert ports.lifecycle is transport
    assert ports.api_keys is transport
    assert ports.interrupter is None  # its claims never wait for work
    assert ports.router is None
    assert ports.for_topic("anything") is transport
    assert ports.for_subscription("anything") is transport


def test_no_module_probes_a_transport_with_hasattr_or_getattr() -> None:
    """Optional parts are resolved in core/ports.py, not found by name at each use."""
    probes: dict[str, list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if CONFORMANCE in path.parents:
            continue  # the shipped suite asks an outside transport for its test hooks (clock, url, sweep lock)
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and node.args
                    and ("transport" in ast.unparse(node.args[0]) or ast.unparse(node.args[0]) == "store")):
                probes.setdefault(str(path.relative_to(PACKAGE)), []).append(node.lineno)
    assert probes == {}, f"resolve the optional part in core/ports.py (Ports.of) instead: {probes}"


OPTIONAL_PORTS = {"ProcessRegistry", "LiveWorkReader", "StatsHistoryReader", "TopologyLifecycle", "ApiKeyStore",
                  "ClaimInterrupter", "TopicRouter", "AttemptHistoryReader", "DeliverySearch"}


def test_only_the_ports_module_asks_whether_a_transport_has_an_optional_part() -> None:
    asked: dict[str, list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "core" / "ports.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                    and len(node.args) == 2 and OPTIONAL_PORTS & {n.id for n in ast.walk(node.args[1])
                                                                   if isinstance(n, ast.Name)}):
                asked.setdefault(str(path.relative_to(PACKAGE)), []).append(node.lineno)
    assert asked == {}, f"use queue.ports / Ports.of (core/ports.py) instead: {asked}"
