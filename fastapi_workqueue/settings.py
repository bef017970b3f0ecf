"""Settings of a WorkQueue, read from ``WORKQUEUE_*`` environment variables (pydantic-settings).

The public import path of :class:`WorkQueueSettings`. The class lives in
:mod:`fastapi_workqueue.core.settings`, below every layer it configures, so the kernel that the
layers receive can hold it without importing anything above ``core``.
"""

from __future__ import annotations

from .core.settings import (
    DEFAULT_DATABASE_URL,
    ENV_PREFIX,
    WorkQueueSettings,
    default_database_file,
    setting_names,
    unknown_variables,
)

__all__ = [
    "DEFAULT_DATABASE_URL",
    "ENV_PREFIX",
    "WorkQueueSettings",
    "default_database_file",
    "setting_names",
    "unknown_variables",
]
