"""Test helpers that ship with the package: :class:`MemoryTransport` (the queue in memory), the
conformance suite a transport's tests run (:mod:`.conformance`), and the pytest plugin with the
``workqueue_fake`` fixture."""

from .memory import MemoryTransport

__all__ = ["MemoryTransport"]
