"""A retry comes due on time on an idle worker.

The store draws a retry's delay and no wake-up is sent when it comes due, while an idle consumer's
poll doubles up to ``idle_poll_max_ms``. The consumer looks up when what it gave back is due and
cuts its sleep to that moment, so the next attempt does not wait for the next idle poll.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import Outcome, PublishRequest, WorkMessage, WorkOutcome

from .support import make_queue, wait_for

DELAY = 4.0


@pytest.mark.parametrize("store", ["postgresql", "sqlite"])
async def test_a_retry_starts_when_it_comes_due_not_at_the_next_idle_poll(
    store: str, pg_url: str, tmp_path: Path
) -> None:
    url = pg_url if store == "postgresql" else f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    # Polls at 0.25, 0.75, 1.75, 3.75 and 7.75 s after the last claim that found work: without the
    # look-up, a retry due 4 s after the first attempt started 3.75 s late.
    queue, topic, _ = make_queue(url, [{"role": "flaky", "max_attempts": 3}], concurrency=1,
                                 idle_poll_min_ms=250, idle_poll_max_ms=20_000)
    attempts: list[tuple[float, float]] = []

    @queue.handler("flaky")
    async def flaky(message: WorkMessage[Any]) -> WorkOutcome:
        started = time.monotonic()
        if not attempts:
            attempts.append((started, time.monotonic()))
            return Outcome.retry("not yet", delay_seconds=DELAY)
        attempts.append((started, time.monotonic()))
        return Outcome.complete()

    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload={"n": 1})])
        await wait_for(lambda: len(attempts) == 2, within=20)
    (_, first_ended), (second_started, _) = attempts
    late = second_started - (first_ended + DELAY)
    assert -0.1 < late < 1.5, f"the retry started {late:.2f} s after it came due"
