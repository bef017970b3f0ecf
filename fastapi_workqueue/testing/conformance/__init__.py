"""The conformance suite: the cases every transport must pass (docs/testing.md, CONFORMANCE.md).

A transport's test file calls :func:`install` once, with a way to build its :class:`Harness`::

    # tests/test_conformance.py of a transport package
    from fastapi_workqueue.testing.conformance import ClockHarness, install

    @contextlib.asynccontextmanager
    async def my_harness():
        clock = ManualClock()
        transport = MyTransport(..., clock=clock)
        await transport.open()
        try:
            yield ClockHarness(transport, clock, "mine")
        finally:
            await transport.close()

    install(globals(), my_harness, skips={"test_c31_retention_purges_terminal_only": "why"})

Every case becomes a test of that file under its own name (``pytest -k test_c21`` picks one).
Cases skip themselves, saying why, where the transport's :class:`~fastapi_workqueue.core.transport.
Capabilities` rule them out (Ordered, Exclusive, a caller's transaction, cancel, exact backlog,
sweeps); ``skips`` names more, by case (``name`` or ``name[param]``) with the reason. The cases
are ``async def``: run them with pytest-asyncio in auto mode (``asyncio_mode = "auto"``).
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from .harness import ClockHarness, Harness, World, harness_now, make_world, memory_harness, require

__all__ = [
    "CASE_MODULES",
    "ClockHarness",
    "Harness",
    "World",
    "cases",
    "harness_now",
    "install",
    "make_world",
    "memory_harness",
    "require",
]

CASE_MODULES = (
    "publish", "lease", "outcomes", "discard_outcome", "partitions", "operator_actions", "housekeeping",
    "follow_ups", "claim_many", "job_store", "attempts", "search", "results", "flow",
)
"""The modules of cases, by area (C01-C08 publish, C09-C13 lease, ...)."""


def cases() -> dict[str, Callable[..., Any]]:
    """Every case by name (``test_c01_...``), in the order of :data:`CASE_MODULES`."""
    found: dict[str, Callable[..., Any]] = {}
    for name in CASE_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        found.update({key: value for key, value in vars(module).items()
                      if key.startswith("test_") and callable(value)})
    return found


def install(
    namespace: dict[str, Any],
    make_harness: Callable[[], AbstractAsyncContextManager[Harness]],
    *,
    skips: Mapping[str, str] | None = None,
) -> None:
    """Puts every case and a ``harness`` fixture built by ``make_harness()`` into a test module's
    ``namespace`` (pass ``globals()``). ``skips`` maps a case's name, or ``name[param]`` for one
    of its parameters, to the reason it does not apply to this transport."""
    reasons = dict(skips or {})
    found = cases()
    unknown = sorted(name for name in reasons if name.split("[", 1)[0] not in found)
    if unknown:  # (a misspelt or stale name would skip nothing, in silence)
        import difflib

        given = unknown[0].split("[", 1)[0]
        guess = [c for c in found if c.startswith(given)][:1] or difflib.get_close_matches(given, list(found), n=1,
                                                                                            cutoff=0.5)
        hint = f"; did you mean {guess[0]!r}?" if guess else "; the cases are the test_* names of cases()"
        raise ValueError(f"skips names {unknown[0]!r}, which is no conformance case{hint}")

    @pytest.fixture
    async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
        node = request.node
        for name in (getattr(node, "originalname", node.name), node.name):
            if name in reasons:
                pytest.skip(reasons[name])
        async with make_harness() as built:
            yield built

    namespace.update(found)
    namespace["harness"] = harness
