"""Job workers as real ``workqueue work`` processes: exit 70 for a job that ignores its timeout,
the lease check at start, ``without_overlapping`` across two workers, steps and once across a
SIGKILL, and the jobs commands."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from fastapi_workqueue import WorkQueue, WorkQueueSettings

from .support import LoggedProcess, wait_for

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


async def run_cli(env: dict[str, str], *args: str, **more_env: str) -> tuple[int, str]:
    """``workqueue ARGS`` in a process of its own: its exit code and its output (stderr included)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fastapi_workqueue", *args, env={**env, **more_env}, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


class Jobs:
    def __init__(self, url: str, tmp_path: Path, **env: str) -> None:
        self.queue_name = f"app-{uuid.uuid4().hex[:8]}"
        self.tmp_path = tmp_path
        self.record = tmp_path / "record.jsonl"
        self.record.touch()
        self.env = {**os.environ, "WORKQUEUE_DATABASE_URL": url, "JOBS_APP_QUEUE": self.queue_name,
                    "JOBS_APP_RECORD": str(self.record), "PYTHONPATH": str(ROOT), **env}
        os.environ["JOBS_APP_QUEUE"] = self.queue_name  # the module below names its queue from it
        sys.modules.pop("tests.apps.jobs_app", None)  # a fresh module: a queue of its own, on this store
        jobs_app = importlib.import_module("tests.apps.jobs_app")

        self.app = jobs_app
        self.producer: WorkQueue = jobs_app.queue
        self.producer.settings = WorkQueueSettings(database_url=url, auto_migrate=True, enabled=False,
                                                   subscriptions=[])

    async def start(self, *args: str, **env: str) -> LoggedProcess:
        return await LoggedProcess.start(
            sys.executable, "-m", "fastapi_workqueue", "work", "--app", "tests.apps.jobs_app:queue", *args,
            logs=self.tmp_path, env={**self.env, **env}, cwd=ROOT,
        )

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    async def until(self, check: Any, within: float = 60) -> None:
        await wait_for(check, within=within, interval=0.05, describe=lambda: f"record: {self.events()}")


async def test_a_job_that_ignores_its_timeout_ends_the_worker_with_70(database_url: str, tmp_path: Path) -> None:
    jobs = Jobs(database_url, tmp_path)
    async with jobs.producer.lifespan(None):
        await jobs.producer.dispatch(jobs.app.stuck, {})
    worker = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "0.5")
    _, stderr = await asyncio.wait_for(worker.communicate(), 60)
    assert worker.returncode == 70, stderr.decode()
    assert "ignored its timeout" in stderr.decode()
    assert [e["event"] for e in jobs.events()][:2] == ["stuck-start", "stuck-cancelled"]


async def test_a_job_that_blocks_the_event_loop_ends_the_worker_with_70_before_another_runs_it(
    database_url: str, tmp_path: Path
) -> None:
    """``time.sleep(25)`` in a job with a timeout of 1 s: the watchdog thread ends the worker with 70
    once the stop timeout has passed after the timeout (the loop is blocked, so nothing on it can).
    The job comes back when the lease runs out; the second worker runs it only once the first
    process is gone, and the blocked attempt is never reported processed."""
    jobs = Jobs(database_url, tmp_path, JOBS_APP_LEASE="5", JOBS_APP_RECORD_PROCESSED="1")
    async with jobs.producer.lifespan(None):
        job_id = str(await jobs.producer.dispatch(jobs.app.blocks, {"seconds": 25}))
    first = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "1")
    try:
        await jobs.until(lambda: any(e["event"] == "block-start" for e in jobs.events()))
        second = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "1")
        try:
            _, stderr = await asyncio.wait_for(first.communicate(), 20)  # (well within the 25 s sleep)
            assert first.returncode == 70, stderr.decode()
            assert "ignored its timeout of 1 s and is still running 1 s later" in stderr.decode()
            await jobs.until(lambda: any(e["event"] == "processed" for e in jobs.events()))
        finally:
            second.send_signal(signal.SIGTERM)
            await asyncio.wait_for(second.communicate(), 30)
    finally:
        if first.returncode is None:
            first.kill()
            await first.wait()
    events = jobs.events()
    [again] = [e for e in events if e["event"] == "after-block"]
    assert (again["id"], again["attempt"], again["pid"]) == (job_id, 2, second.pid)
    assert again["first_running"] is False  # the blocked worker was gone before another ran the job
    assert not any(e["event"] == "block-end" for e in events)
    assert [(e["id"], e["attempt"]) for e in events if e["event"] == "processed"] == [(job_id, 2)]


async def test_sigterm_takes_no_new_job_and_sends_the_running_one_back_without_using_a_try(
    database_url: str, tmp_path: Path
) -> None:
    jobs = Jobs(database_url, tmp_path)
    async with jobs.producer.lifespan(None):
        first = await jobs.producer.dispatch(jobs.app.slow, {"n": 1, "seconds": 60})
        await asyncio.sleep(0.01)  # (due after the first: strict order takes the first one first)
        second = await jobs.producer.dispatch(jobs.app.slow, {"n": 2, "seconds": 60})
    worker = await jobs.start("--queue", jobs.queue_name, "--concurrency", "1", "--stop-timeout", "0.5")
    await jobs.until(lambda: any(e["event"] == "slow-start" for e in jobs.events()))
    worker.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(worker.communicate(), 30)
    assert worker.returncode == 0, stderr.decode()
    began = [e for e in jobs.events() if e["event"] == "slow-start"]
    assert [(e["id"], e["attempt"]) for e in began] == [(str(first), 1)]  # no new job once SIGTERM came
    assert [(e["id"], e["reason"]) for e in jobs.events() if e["event"] == "released"] == [(str(first), "shutdown")]
    # Both come back; each has its one try left (a try spent on the shutdown would have failed the first).
    again = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "0.5", JOBS_APP_SLOW_SECONDS="0.05")
    try:
        await jobs.until(lambda: sum(e["event"] == "slow-end" for e in jobs.events()) == 2)
    finally:
        again.send_signal(signal.SIGTERM)
        await asyncio.wait_for(again.communicate(), 30)
    ended = {e["id"]: e["attempt"] for e in jobs.events() if e["event"] == "slow-end"}
    assert ended == {str(first): 1, str(second): 1}
    async with jobs.producer.lifespan(None):
        assert await jobs.producer.failed_jobs(jobs.queue_name) == []


async def test_a_worker_whose_jobs_do_not_fit_the_lease_refuses_to_start(database_url: str, tmp_path: Path) -> None:
    jobs = Jobs(database_url, tmp_path)
    worker = await jobs.start("--queue", f"{jobs.queue_name}-long", "--stop-timeout", "8")
    _, stderr = await asyncio.wait_for(worker.communicate(), 60)
    assert worker.returncode == 2
    assert "'app.long' (timeout 100 s)" in stderr.decode() and "WORKQUEUE_JOB_LEASE_SECONDS" in stderr.decode()


async def test_a_worker_on_a_queue_nothing_uses_says_so_and_exits_3(database_url: str, tmp_path: Path) -> None:
    """A misspelt --queue is refused, as a misspelt --subscription is: a worker on it would wait for
    nothing. A queue a job declares, or that the store holds, is taken."""
    jobs = Jobs(database_url, tmp_path)
    worker = await jobs.start("--queue", f"{jobs.queue_name},{jobs.queue_name}-typo", "--once")
    _, stderr = await asyncio.wait_for(worker.communicate(), 60)
    assert worker.returncode == 3, stderr.decode()
    assert f"job queue(s) '{jobs.queue_name}-typo' do not exist" in stderr.decode()
    assert f"the app's job queues are {jobs.queue_name}, {jobs.queue_name}-long" in stderr.decode()
    fine = await jobs.start("--queue", jobs.queue_name, "--once")
    _, stderr = await asyncio.wait_for(fine.communicate(), 60)
    assert fine.returncode == 0, stderr.decode()


async def test_without_overlapping_holds_across_two_worker_processes(database_url: str, tmp_path: Path) -> None:
    jobs = Jobs(database_url, tmp_path)
    async with jobs.producer.lifespan(None):
        await jobs.producer.bulk([(jobs.app.overlap, {"n": n}) for n in range(4)])
    workers = [await jobs.start("--queue", jobs.queue_name, "--concurrency", "2") for _ in range(2)]
    try:
        await jobs.until(lambda: sum(e["event"] == "end" for e in jobs.events()) == 4)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            await asyncio.wait_for(worker.communicate(), 60)
    spans = []
    starts = {}
    for event in jobs.events():
        if event["event"] == "start":
            starts[event["n"]] = event
        elif event["event"] == "end":
            spans.append((starts[event["n"]]["at"], event["at"], starts[event["n"]]["pid"]))
    spans.sort()
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(spans)), spans
    assert len({pid for _, _, pid in spans}) >= 1


def long_spans(events: list[dict[str, Any]]) -> list[tuple[float, float, int, int]]:
    """The runs of app.overlap-long that ended: (start, end, n, pid), by start."""
    starts = {(e["n"], e["attempt"]): e for e in events if e["event"] == "long-start"}
    return sorted((starts[e["n"], e["attempt"]]["at"], e["at"], e["n"], e["pid"])
                  for e in events if e["event"] == "long-end")


async def test_without_overlapping_holds_while_an_attempt_outlives_the_job_lease(
    database_url: str, tmp_path: Path
) -> None:
    """Two 7 s jobs of one key, a 5 s lease, two workers of one job at a time: the lock is renewed
    while its attempt runs, so the second job starts only after the first ended."""
    jobs = Jobs(database_url, tmp_path, JOBS_APP_LEASE="5")
    key = f"key-{uuid.uuid4().hex[:8]}"
    async with jobs.producer.lifespan(None):
        await jobs.producer.bulk([(jobs.app.overlap_long, {"n": n, "key": key, "seconds": 7}) for n in range(2)])
    workers = [await jobs.start("--queue", jobs.queue_name, "--concurrency", "1", "--stop-timeout", "1")
               for _ in range(2)]
    try:
        await jobs.until(lambda: sum(e["event"] == "long-end" for e in jobs.events()) == 2, within=90)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            await asyncio.wait_for(worker.communicate(), 60)
    spans = long_spans(jobs.events())
    assert len(spans) == 2 and spans[1][0] >= spans[0][1], spans  # no overlap
    # While the first ran (its worker takes one job at a time), the other worker found the key taken.
    holder = spans[0][3]
    waited = [e for e in jobs.events() if e["event"] == "released" and e["reason"] == "overlap"]
    assert any(e["pid"] != holder for e in waited), waited


async def test_the_overlap_lock_of_a_killed_worker_still_expires(database_url: str, tmp_path: Path) -> None:
    jobs = Jobs(database_url, tmp_path, JOBS_APP_LEASE="3")
    key = f"key-{uuid.uuid4().hex[:8]}"
    async with jobs.producer.lifespan(None):
        await jobs.producer.dispatch(jobs.app.overlap_long, {"n": 1, "key": key, "seconds": 60})
    first = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "0.5")
    await jobs.until(lambda: any(e["event"] == "long-start" for e in jobs.events()))
    first.kill()  # it held the lock, renewing it: now nobody does
    await first.wait()
    async with jobs.producer.lifespan(None):
        await jobs.producer.dispatch(jobs.app.overlap_long, {"n": 2, "key": key, "seconds": 0.1})
    second = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "0.5")
    try:
        await jobs.until(lambda: {s[2] for s in long_spans(jobs.events())} == {1, 2}, within=60)
    finally:
        second.send_signal(signal.SIGTERM)
        await asyncio.wait_for(second.communicate(), 60)
    assert all(pid == second.pid for *_, pid in long_spans(jobs.events()))


async def test_a_step_and_once_are_not_repeated_after_a_sigkilled_worker(database_url: str, tmp_path: Path) -> None:
    jobs = Jobs(database_url, tmp_path, JOBS_APP_LEASE="2")
    async with jobs.producer.lifespan(None):
        job_id = await jobs.producer.dispatch(jobs.app.steps, {})
    first = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "0.2")
    await jobs.until(lambda: any(e["event"] == "waiting" for e in jobs.events()))
    first.kill()
    await first.wait()
    second = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "0.2")
    try:
        await jobs.until(lambda: any(e["event"] == "done" for e in jobs.events()))
    finally:
        second.send_signal(signal.SIGTERM)
        await asyncio.wait_for(second.communicate(), 60)
    kinds = [(e["event"], e.get("attempt")) for e in jobs.events()]
    # (the killed attempt's end is heard from the sweeper of the worker that took its lease back)
    assert kinds == [("charge", 1), ("mail", 1), ("waiting", 1), ("released", 1), ("done", 2)], kinds
    released = jobs.events()[3]
    assert (released["reason"], released["pid"]) == ("lease-lost", second.pid)
    assert jobs.events()[-1]["charge"] == f"ch-{job_id}"


async def test_a_job_whose_worker_is_killed_on_its_last_try_is_heard_failed_once(
    database_url: str, tmp_path: Path
) -> None:
    """SPEC §8 "events: ... failed": a job whose worker was SIGKILLed in its last try is failed by
    the sweeper of another worker, which hears JobFailed for it, once."""
    jobs = Jobs(database_url, tmp_path, JOBS_APP_LEASE="2", JOBS_APP_RECORD_ENDS="1")
    async with jobs.producer.lifespan(None):
        job_id = await jobs.producer.dispatch(jobs.app.slow, {"n": 1, "seconds": 60})
    first = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "0.2")
    await jobs.until(lambda: any(e["event"] == "slow-start" for e in jobs.events()))
    first.kill()
    await first.wait()
    second = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "0.2")
    try:
        await jobs.until(lambda: any(e["event"] == "failed" for e in jobs.events()))
        await asyncio.sleep(1.0)  # (time for a second event, were there one)
    finally:
        second.send_signal(signal.SIGTERM)
        await asyncio.wait_for(second.communicate(), 60)
    ends = [e for e in jobs.events() if e["event"] in ("failed", "discarded", "released")]
    assert len(ends) == 1, ends
    [failed] = ends
    assert (failed["id"], failed["job"], failed["attempt"], failed["tries"], failed["pid"]) == (
        str(job_id), "app.slow", 1, 1, second.pid)
    assert "lease ran out on its last try" in failed["reason"]
    async with jobs.producer.lifespan(None):
        status = await jobs.producer.job_status(job_id)
    assert status is not None and status.state == "Failed"


async def test_a_job_that_blocks_its_loop_past_its_lease_on_its_last_try_is_heard_failed_once(
    database_url: str, tmp_path: Path
) -> None:
    """The worker that blocked comes back after a sweeper (the other worker's, or its own as its
    loop comes back) took its lease back and failed the job: the sweeper's JobFailed is heard, and
    no second event for the attempt from the worker that ran it."""
    jobs = Jobs(database_url, tmp_path, JOBS_APP_LEASE="2", JOBS_APP_RECORD_ENDS="1")
    async with jobs.producer.lifespan(None):
        job_id = await jobs.producer.dispatch(jobs.app.hogs, {"seconds": 6})
    first = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "0.2")
    await jobs.until(lambda: any(e["event"] == "hog-start" for e in jobs.events()))
    second = await jobs.start("--queue", jobs.queue_name, "--stop-timeout", "0.2")
    try:
        await jobs.until(lambda: any(e["event"] == "hog-end" for e in jobs.events()))
        await asyncio.sleep(1.5)  # (the blocked worker settles what it returned, and would emit)
    finally:
        for worker in (first, second):
            worker.send_signal(signal.SIGTERM)
        for worker in (first, second):
            await asyncio.wait_for(worker.communicate(), 60)
    ends = [e for e in jobs.events() if e["event"] in ("failed", "discarded", "released", "processed")]
    assert [(e["event"], e["id"]) for e in ends] == [("failed", str(job_id))], jobs.events()
    assert "lease ran out on its last try" in ends[0]["reason"]
    async with jobs.producer.lifespan(None):
        status = await jobs.producer.job_status(job_id)
    assert status is not None and status.state == "Failed"


async def test_the_jobs_commands_list_retry_forget_and_prune(fresh_url: str, tmp_path: Path) -> None:
    jobs = Jobs(fresh_url, tmp_path)
    queue = WorkQueue(WorkQueueSettings(database_url=fresh_url, auto_migrate=True, enabled=False,
                                        subscriptions=[]))
    name = f"cli-fail-{uuid.uuid4().hex[:6]}"

    @queue.job(name, tries=1, queue=jobs.queue_name)
    async def fail(payload: dict[str, Any]) -> None:
        raise RuntimeError("token=abc123 was refused")

    async with queue.lifespan(None):
        retried, forgotten, pruned = [await queue.dispatch(fail, {"n": n}) for n in range(3)]
        host = await queue._start_host()
        assert host is not None

        async def all_failed() -> bool:
            return len(await queue.failed_jobs(jobs.queue_name)) == 3

        await wait_for(all_failed, within=10, interval=0.05)
        await queue._stop_host()

    async def cli(*args: str) -> tuple[int, str]:
        return await run_cli(jobs.env, *args)

    code, out = await cli("--json", "jobs", "failed", "--queue", jobs.queue_name)
    listed = {row["ID"]: row for row in json.loads(out)}
    assert code == 0 and set(listed) == {str(retried), str(forgotten), str(pruned)}
    assert listed[str(retried)]["Job"] == name
    assert listed[str(retried)]["Error"].splitlines()[-1] == "RuntimeError: token=*** was refused"
    # For people, the table shows the exception's last line (what failed), as dead-letters does.
    code, out = await cli("jobs", "failed", "--queue", jobs.queue_name)
    assert code == 0 and out.count("RuntimeError: token=*** was refused") == 3 and "Traceback" not in out
    code, out = await cli("jobs", "retry", str(retried))
    assert code == 0 and out.startswith("Replayed")
    code, out = await cli("jobs", "forget", str(uuid.uuid4()))
    assert code == 1 and "no failed job has the id" in out
    code, out = await cli("jobs", "forget", str(forgotten))
    assert code == 0, out
    code, out = await cli("jobs", "cancel", str(pruned))  # failed: it runs no more
    assert code == 1 and f"job {pruned} has failed, so it runs no more; drop it with forget_job" in out
    async with queue.lifespan(None):
        waiting = await queue.dispatch(fail, {"n": 3}, delay=3600)
    code, out = await cli("--json", "jobs", "cancel", str(waiting), "--reason", "not needed")
    assert code == 0 and json.loads(out)["Result"] == "Discarded", out
    # --older-than counts days: a job that failed seconds ago is younger than one day, older than none.
    code, out = await cli("--json", "jobs", "prune", "--older-than", "1", "--queue", jobs.queue_name)
    assert code == 0 and json.loads(out) == {"Pruned": 0}, out
    code, out = await cli("--json", "jobs", "prune", "--older-than", "0", "--queue", jobs.queue_name)
    assert code == 0 and json.loads(out) == {"Pruned": 1}, out  # the retried job is not failed any more
    code, out = await cli("--json", "jobs", "failed", "--queue", jobs.queue_name)
    assert code == 0 and json.loads(out) == []


async def test_jobs_reencrypt_moves_waiting_jobs_to_the_current_key(fresh_url: str, tmp_path: Path) -> None:
    from cryptography.fernet import Fernet

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    jobs = Jobs(fresh_url, tmp_path)
    queue = WorkQueue(WorkQueueSettings(database_url=fresh_url, auto_migrate=True, enabled=False,
                                        subscriptions=[], app_key=old))

    @queue.job(f"cli-secret-{uuid.uuid4().hex[:6]}", encrypted=True, queue=jobs.queue_name)
    async def secret(payload: dict[str, str]) -> None:
        return None

    async with queue.lifespan(None):
        job_id = await queue.dispatch(secret, {"card": "4242 4242 4242 4242"})
        [before] = await queue.transport.message_deliveries(job_id, include_payload=True)
    code, out = await run_cli(jobs.env, "--json", "jobs", "reencrypt", WORKQUEUE_APP_KEY=new,
                              WORKQUEUE_PREVIOUS_KEYS=old)
    assert code == 0 and json.loads(out) == {"Reencrypted": 1}, out
    async with queue.lifespan(None):
        [after] = await queue.transport.message_deliveries(job_id, include_payload=True)
    assert after.payload["encrypted"] != before.payload["encrypted"] and "4242" not in json.dumps(after.payload)
    assert json.loads(Fernet(new.encode()).decrypt(after.payload["encrypted"].encode())) == {
        "card": "4242 4242 4242 4242"}
    code, out = await run_cli(jobs.env, "jobs", "reencrypt")  # no key set: it says what to set
    assert code != 0 and "WORKQUEUE_APP_KEY" in out, out


async def test_two_worker_processes_dispatch_each_tick_of_a_schedule_once(fresh_url: str, tmp_path: Path) -> None:
    jobs = Jobs(fresh_url, tmp_path, JOBS_APP_SCHEDULE="1")
    code, out = await run_cli(jobs.env, "--json", "schedules", "--app", "tests.apps.jobs_app:queue")
    [listed] = json.loads(out)
    assert code == 0 and listed["Name"] == "app.every-second" and listed["Job"] == "app.tick", out
    assert listed["When"] == "every 0:00:01" and listed["NextRun"]
    async with jobs.producer.lifespan(None):
        pass  # the store's tables
    workers = [await jobs.start("--queue", jobs.queue_name) for _ in range(2)]
    try:
        await jobs.until(lambda: sum(e["event"] == "tick" for e in jobs.events()) >= 4, within=60)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        codes = [await asyncio.wait_for(worker.wait(), 60) for worker in workers]
    assert codes == [0, 0]
    ticks = [e for e in jobs.events() if e["event"] == "tick"]
    ids = [e["id"] for e in ticks]
    assert len(ids) == len(set(ids)), ids  # no tick ran twice
    # One job a second between the first tick and the last, not one per process: at most one per
    # second the runs spanned, one for each end, and the tick that came due while the workers
    # started, which runs late, at the start of the span (seen: 4 ticks in 1.99 s). Two processes
    # each dispatching their own would give twice as many.
    span = ticks[-1]["at"] - ticks[0]["at"]
    assert len(ticks) <= span + 3, (len(ticks), span)
    async with jobs.producer.lifespan(None):
        stats = {s.subscription: s for s in await jobs.producer.stats()}
    in_store = stats[f"jobs.{jobs.queue_name}"]
    assert in_store.completed == len(ticks) and in_store.pending + in_store.in_flight <= 2, in_store


async def test_dispatchers_in_several_processes_queue_a_unique_job_once(database_url: str, tmp_path: Path) -> None:
    jobs = Jobs(database_url, tmp_path)
    async with jobs.producer.lifespan(None):
        await jobs.producer.jobs.ensure_queue(jobs.queue_name)  # its topic and subscription
    key = f"rebuild-{uuid.uuid4().hex[:6]}"
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.workers.unique_dispatcher", key, "5", env=jobs.env, cwd=ROOT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        for _ in range(4)]
    for proc in procs:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.strip() == b"READY", line
    for proc in procs:  # all four at once
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
    answers: list[str | None] = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        answers += json.loads(out.decode().splitlines()[-1])
    assert len(answers) == 20 and len([a for a in answers if a is not None]) == 1, answers
    async with jobs.producer.lifespan(None):
        assert await jobs.producer.size(jobs.queue_name) == 1
