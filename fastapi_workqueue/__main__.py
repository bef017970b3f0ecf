"""``python -m fastapi_workqueue``: the ``workqueue`` command."""

from .cli import main

main()
