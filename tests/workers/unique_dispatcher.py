"""Dispatches one unique job many times at once, for the test of unique keys across processes.

``python -m tests.workers.unique_dispatcher KEY N`` opens the queue of tests.apps.jobs_app on
``WORKQUEUE_DATABASE_URL``, prints ``READY``, waits for a line on its standard input, then dispatches
``app.slow`` N times at once with ``unique=KEY`` and prints the answers as a JSON list (null where
the key was held).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from fastapi_workqueue import WorkQueueSettings


async def main(key: str, n: int) -> None:
    from tests.apps import jobs_app

    queue = jobs_app.queue
    queue.settings = WorkQueueSettings(database_url=os.environ["WORKQUEUE_DATABASE_URL"], enabled=False,
                                       subscriptions=[], pool_size=n)
    async with queue.lifespan(None):
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        ids = await asyncio.gather(*(queue.dispatch(jobs_app.slow, {"n": i, "seconds": 0}, unique=key)
                                     for i in range(n)))
    print(json.dumps([None if job_id is None else str(job_id) for job_id in ids]), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
