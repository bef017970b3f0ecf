"""An order service that shows fastapi_workqueue the way an application uses it (see ``main.py``)."""
