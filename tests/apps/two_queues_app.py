"""An app module with two WorkQueues and no ``app.state.queue``: ``workqueue work`` cannot choose."""

from __future__ import annotations

from fastapi import FastAPI

from fastapi_workqueue import WorkQueue

orders = WorkQueue()
billing = WorkQueue()
app = FastAPI()
