"""The suite as an outside transport runs it: ``install(globals(), make_harness)`` on the memory
transport (docs/testing.md). Every case is a test of this file, with the module's own fixture."""

from __future__ import annotations

import pytest

from fastapi_workqueue.testing.conformance import install, memory_harness

pytestmark = pytest.mark.timeout(60)

install(globals(), memory_harness)
