"""A module that fails to import, for ``workqueue work --app tests.apps.broken_app:app``."""

from __future__ import annotations

raise RuntimeError("the settings file /etc/orders.toml is missing")
