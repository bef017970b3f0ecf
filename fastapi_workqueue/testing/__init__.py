"""Test helpers that ship with the package: :class:`MemoryTransport` (the queue in memory; it lives
in :mod:`fastapi_workqueue.core.memory`, where the jobs' sync mode and fake run on it too), the
conformance suite a transport's tests run (:mod:`.conformance`), and the pytest plugin with the
``workqueue_fake`` fixture."""

from ..core.memory import MemoryTransport

__all__ = ["MemoryTransport"]
