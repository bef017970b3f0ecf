"""The cases of ``fastapi_workqueue.testing.conformance.operator_actions`` on each transport (conftest.py)."""

from __future__ import annotations

import pytest

from fastapi_workqueue.testing.conformance.operator_actions import *  # noqa: F403

pytestmark = pytest.mark.timeout(60)
