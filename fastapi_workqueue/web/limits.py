"""The REST API's default request limits, apart from the routes so that ``WorkQueue`` can name
them without importing FastAPI."""

from __future__ import annotations

DEFAULT_MAX_BODY_BYTES = 5 * 1024 * 1024
"""The largest request body the REST API reads (a larger one gets 413)."""
DEFAULT_MAX_BATCH = 1000
"""The most messages one publish request may carry."""
