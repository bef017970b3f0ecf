"""The soak and chaos run: ``python -m tests.soak.run`` (see docs/soak.md)."""
