"""The cases of ``fastapi_workqueue.testing.conformance.results`` on each transport (conftest.py)."""

from __future__ import annotations

import pytest

from fastapi_workqueue.testing.conformance.results import *  # noqa: F403

pytestmark = pytest.mark.timeout(60)
