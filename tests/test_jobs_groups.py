"""Groups on a real store (PostgreSQL and an SQLite file): ``then`` runs once after the last
member ended, also when members fail or are discarded, and sees each member's status and result;
with members finishing at once in two worker processes, each group's ``then`` runs once."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import JobContext, WorkQueue, WorkQueueSettings
from fastapi_workqueue.jobs import JobStatus

from .support import FAST, wait_for

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


def make_queue(url: str) -> tuple[str, WorkQueue]:
    name = f"group-{uuid.uuid4().hex[:8]}"
    return name, WorkQueue(WorkQueueSettings(database_url=url, auto_migrate=True, subscriptions=[],
                                             job_queues=name, job_concurrency=8, **FAST))


async def test_then_runs_once_after_the_last_member_whatever_became_of_the_members(database_url: str) -> None:
    name, queue = make_queue(database_url)
    suffix = name.removeprefix("group-")
    gate = asyncio.Event()
    seen: list[tuple[uuid.UUID | None, list[JobStatus]]] = []

    @queue.job(f"resize-{suffix}", queue=name, store_result=True, backoff=[0])
    async def resize(payload: dict[str, Any], job: JobContext) -> Any:
        if payload["kind"] == "slow":
            await gate.wait()
        if payload["kind"] == "broken":
            raise RuntimeError("the image is corrupt")
        if payload["kind"] == "unwanted":
            return job.discard("the image was deleted meanwhile")
        return {"size": payload["size"]}

    @queue.job(f"done-{suffix}", queue=name)
    async def done(payload: dict[str, str], job: JobContext) -> None:
        seen.append((job.group_id, list(job.group_results or [])))

    async with queue.lifespan(None):
        group = await queue.group([
            (resize, {"kind": "plain", "size": 64}),
            (resize, {"kind": "broken", "size": 0}),
            (resize, {"kind": "unwanted", "size": 0}),
            (resize, {"kind": "slow", "size": 256}),
        ], then=(done, {"album": "summer"}))
        assert len(group.member_ids) == 4 and group.then_id not in group.member_ids
        broken, unwanted, slow = group.member_ids[1], group.member_ids[2], group.member_ids[3]
        await wait_for(lambda: _state(queue, broken, "Failed"), within=30)
        await wait_for(lambda: _state(queue, unwanted, "Discarded"), within=30)
        await wait_for(lambda: _state(queue, slow, "Running"), within=30)
        held = await queue.job_status(group.then_id)
        # The last member still runs: then waits for it (Pending, due at no time), not for a clock.
        assert held is not None and held.state == "Pending" and held.run_at is None and held.attempt == 0
        assert seen == []
        gate.set()
        await queue.wait(group.then_id, timeout=30)
        after = await queue.job_status(group.then_id)

    assert after is not None and after.state == "Completed" and after.attempt == 1
    [(group_id, results)] = seen  # once
    assert group_id == group.id
    assert [(r.id, r.state, r.result) for r in results] == [
        (group.member_ids[0], "Completed", {"size": 64}), (broken, "Failed", None), (unwanted, "Discarded", None),
        (slow, "Completed", {"size": 256})]
    assert results[1].error is not None and "the image is corrupt" in results[1].error
    assert results[2].reason == "the image was deleted meanwhile"


async def _state(queue: WorkQueue, job_id: uuid.UUID, state: str) -> bool:
    status = await queue.job_status(job_id)
    return status is not None and status.state == state


async def test_a_group_is_checked_before_anything_is_queued(database_url: str) -> None:
    name, queue = make_queue(database_url)

    @queue.job(f"member-{name}", queue=name)
    async def member(payload: dict[str, int]) -> None:
        return None

    async with queue.lifespan(None):
        with pytest.raises(ValueError, match="at least one member"):
            await queue.group([], then=(member, {"n": 0}))
        with pytest.raises(ValueError, match="invalid"):
            await queue.group([(member, {"n": 1}), (member, {"n": "not a number"})], then=(member, {"n": 0}))
        with pytest.raises(TypeError, match="take queue only"):
            await queue.group([(member, {"n": 1}, {"delay": 5})], then=(member, {"n": 0}))
        assert await queue.size(name) == 0


class GroupWorkers:
    """``workqueue work`` processes on tests.apps.group_app, and the test's own producer queue."""

    def __init__(self, url: str, tmp_path: Path) -> None:
        self.queue_name = f"groups-{uuid.uuid4().hex[:8]}"
        self.tmp_path = tmp_path
        self.logs: dict[int, Path] = {}
        self.record = tmp_path / "record.jsonl"
        self.record.touch()
        self.release = tmp_path / "release"
        self.env = {**os.environ, "WORKQUEUE_DATABASE_URL": url, "GROUP_APP_QUEUE": self.queue_name,
                    "GROUP_APP_RECORD": str(self.record), "GROUP_APP_RELEASE": str(self.release),
                    "PYTHONPATH": str(ROOT)}
        os.environ["GROUP_APP_QUEUE"] = self.queue_name
        sys.modules.pop("tests.apps.group_app", None)  # a fresh module: a queue of its own, on this store
        self.app = importlib.import_module("tests.apps.group_app")
        self.producer: WorkQueue = self.app.queue
        self.producer.settings = WorkQueueSettings(database_url=url, auto_migrate=True, enabled=False,
                                                   subscriptions=[])

    async def start(self, concurrency: int) -> asyncio.subprocess.Process:
        """A worker process; what it logs goes to ``log_of(process)`` (a pipe nobody reads while it
        runs would fill and stop it)."""
        log = self.tmp_path / f"worker-{len(self.logs)}.err"
        with log.open("wb") as err:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fastapi_workqueue", "work", "--app", "tests.apps.group_app:queue",
                "--queue", self.queue_name, "--concurrency", str(concurrency), env=self.env, cwd=ROOT,
                stdout=asyncio.subprocess.DEVNULL, stderr=err,
            )
        self.logs[process.pid] = log
        return process

    def log_of(self, process: asyncio.subprocess.Process) -> str:
        return self.logs[process.pid].read_text()[-3000:]

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.record.read_text().splitlines()]


async def test_members_ending_at_once_in_two_processes_run_then_once(database_url: str, tmp_path: Path) -> None:
    groups = 6
    workers = GroupWorkers(database_url, tmp_path)
    app = workers.app
    async with workers.producer.lifespan(None):
        made = [await workers.producer.group([(app.member, {"n": 2 * g}), (app.member, {"n": 2 * g + 1})],
                                             then=(app.then, {"group": str(g)})) for g in range(groups)]
        # Each process holds at most `groups` members: the two between them hold every member, so
        # each group's members are settled by whichever process ran them, all at once.
        processes = [await workers.start(concurrency=groups) for _ in range(2)]
        try:
            await wait_for(lambda: len([e for e in workers.events() if e["event"] == "member-start"]) == 2 * groups,
                           within=60, describe=workers.events)
            assert len({e["pid"] for e in workers.events()}) == 2  # members run in both processes
            workers.release.touch()  # every member returns at once
            for group in made:
                await workers.producer.wait(group.then_id, timeout=60)
        finally:
            for process in processes:
                process.send_signal(signal.SIGTERM)
            for process in processes:
                await asyncio.wait_for(process.wait(), 30)
                assert process.returncode == 0, workers.log_of(process)
    thens = [e for e in workers.events() if e["event"] == "then"]
    assert sorted(int(e["group"]) for e in thens) == list(range(groups))  # each group's then ran once
    for event in thens:
        g = int(event["group"])
        group = made[g]
        assert event["group_id"] == str(group.id)
        assert event["members"] == [[str(group.member_ids[0]), "Completed", 2 * g],
                                    [str(group.member_ids[1]), "Completed", 2 * g + 1]]
