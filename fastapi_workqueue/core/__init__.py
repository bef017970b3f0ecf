"""Transport-neutral contracts and the consumer runtime.

Nothing in this package imports FastAPI, SQLAlchemy or a database driver when it runs (the kernel,
``kernel.py``, names SQLAlchemy's session types for the type checker only), nor anything of the
package outside ``core`` (``tests/test_import_graph.py``).
"""
