"""Test helpers that ship with the package: the pytest plugin with the ``workqueue_fake`` fixture."""
