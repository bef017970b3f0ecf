"""Jobs on a real store (PostgreSQL and an SQLite file): dispatch in transactions, bulk, unique keys
with concurrent dispatchers, running them in the host, chains, once, steps, events, failed jobs."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from fastapi_workqueue import JobContext, TransientWorkError, WorkQueue, WorkQueueSettings
from fastapi_workqueue.jobs import JobEvent, JobFailed, JobPayloadInvalid

from .support import FAST, wait_for

pytestmark = pytest.mark.timeout(90)


class Reminder(BaseModel):
    user_id: int


class App:
    """A queue with a few jobs on queues of their own (names unique to the test)."""

    def __init__(self, url: str, *, listen: bool = True, **settings: Any) -> None:
        self.suffix = uuid.uuid4().hex[:8]
        # Job queues are named in the whole database: this test's worker takes its own queues only.
        options = {**FAST, "job_concurrency": 4, "job_queues": f"mail-{self.suffix},work-{self.suffix}", **settings}
        self.queue = WorkQueue(WorkQueueSettings(database_url=url, auto_migrate=True, subscriptions=[], **options))
        self.ran: list[Any] = []
        self.events: list[JobEvent] = []
        if listen:
            self.queue.listen(JobEvent, self.events.append)
        self.steps_run: list[str] = []
        q = self.queue

        @q.job(f"remind-{self.suffix}", tries=3, backoff=[0], queue=f"mail-{self.suffix}")
        async def remind(payload: Reminder, job: JobContext) -> Any:
            if payload.user_id == 0:
                return job.discard("gone")
            if payload.user_id < 0 and job.attempt == 1:
                raise TransientWorkError("flaky", delay_seconds=0)
            self.ran.append(("remind", payload.user_id, job.attempt, job.id))
            return None

        @q.job(f"fail-{self.suffix}", tries=2, backoff=[0], queue=f"mail-{self.suffix}")
        async def fail(payload: dict[str, Any], job: JobContext) -> None:
            raise ValueError(f"boom on attempt {job.attempt}")

        @q.job(f"steps-{self.suffix}", tries=3, backoff=[0], queue=f"work-{self.suffix}")
        async def steps(payload: dict[str, Any], job: JobContext) -> None:
            async def charge() -> dict[str, Any]:
                self.steps_run.append("charge")
                return {"charge": "ch_1"}

            async def mail() -> None:
                self.steps_run.append("mail")

            charged = await job.step("charge", charge)
            await job.once(f"mail-{job.id}", mail)
            if job.attempt == 1:
                raise TransientWorkError("crm down", delay_seconds=0)
            self.ran.append(("steps", charged["charge"], job.attempt))

        self.remind, self.fail, self.steps = remind, fail, steps

    async def dispatch_each_outcome(self) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID, uuid.UUID]:
        """One job of each outcome: done, flaky (done on its second try), gone (it discards
        itself) and failed (on both its tries); their ids."""
        return (await self.queue.dispatch(self.remind, {"user_id": 1}),
                await self.queue.dispatch(self.remind, {"user_id": -1}),
                await self.queue.dispatch(self.remind, {"user_id": 0}),
                await self.queue.dispatch(self.fail, {}))

    @property
    def mail(self) -> str:
        return f"mail-{self.suffix}"


async def wait_events(app: App, kind: str, count: int) -> None:
    await wait_for(lambda: sum(type(e).__name__ == kind for e in app.events) >= count, within=30)


async def test_a_dispatch_joins_the_callers_transaction_and_bulk_is_all_or_nothing(database_url: str) -> None:
    app = App(database_url, enabled=False)
    queue = app.queue
    async with queue.lifespan(None):
        async with queue.sessionmaker() as session, session.begin():
            await queue.dispatch(app.remind, {"user_id": 1}, session=session)
            await session.rollback()
        assert await queue.size(app.mail) == 0
        async with queue.sessionmaker() as session, session.begin():
            job_id = await queue.dispatch(app.remind, {"user_id": 2}, session=session)
            assert await queue.size(app.mail) == 0 or database_url.startswith("sqlite")  # not visible yet
        assert job_id is not None and await queue.size(app.mail) == 1
        with pytest.raises(JobPayloadInvalid):
            await queue.bulk([(app.remind, {"user_id": 3}), (app.steps, {}), (app.remind, {"user_id": "x"})])
        assert await queue.size(app.mail) + await queue.size(f"work-{app.suffix}") == 1
        ids = await queue.bulk([(app.remind, {"user_id": 3}), (app.steps, {})])
        assert len(set(ids)) == 2
        assert await queue.size(app.mail) == 2 and await queue.size(f"work-{app.suffix}") == 1
        [info] = await queue.transport.message_deliveries(job_id, include_payload=True)
        assert info.subscription == f"jobs.{app.mail}" and info.attributes == {"job": f"remind-{app.suffix}"}
        assert info.max_attempts == 3 and info.payload["payload"] == {"user_id": 2}


async def test_jobs_run_in_the_host_with_their_outcomes_and_events(database_url: str) -> None:
    app = App(database_url)
    queue = app.queue
    async with queue.lifespan(None):
        done, flaky, gone, failed = await app.dispatch_each_outcome()
        await wait_events(app, "JobFailed", 1)
        await wait_for(lambda: len(app.ran) == 2, within=30)
        assert sorted(r[1] for r in app.ran) == [-1, 1]
        assert {r[3] for r in app.ran} == {done, flaky}  # job.id is the id dispatch answered
        by_job: dict[Any, list[str]] = {}
        for event in app.events:
            by_job.setdefault(event.job_id, []).append(type(event).__name__)
        assert by_job[done] == ["JobProcessing", "JobProcessed"]
        assert by_job[flaky] == ["JobProcessing", "JobReleased", "JobProcessing", "JobProcessed"]
        assert by_job[gone] == ["JobProcessing", "JobDiscarded"]
        assert by_job[failed] == ["JobProcessing", "JobReleased", "JobProcessing", "JobFailed"]
        [gone_info] = await queue.transport.message_deliveries(gone)
        assert (gone_info.status, gone_info.reason) == ("Discarded", "gone")
        [failed_job] = await queue.failed_jobs(app.mail)
        assert failed_job.id == failed and failed_job.job == f"fail-{app.suffix}" and failed_job.attempts == 2
        assert (failed_job.error or "").splitlines()[-1] == "ValueError: boom on attempt 2"
        # Retry keeps the id and counts the tries afresh; it fails again, then is forgotten.
        assert (await queue.retry_job(failed)).result == "Replayed"
        await wait_events(app, "JobFailed", 2)
        assert (await queue.forget_job(failed)).result == "Discarded"
        assert await queue.failed_jobs(app.mail) == []


async def test_without_listeners_plain_jobs_end_as_they_do_with_them(database_url: str) -> None:
    # A queue nobody listens to runs its plain jobs (no timeout, unique key, chain, middleware or
    # dependencies) on a path of its own: the same outcomes, and a stored payload that no longer
    # validates still fails its job at once with the reason.
    app = App(database_url, listen=False)
    queue = app.queue
    async with queue.lifespan(None):
        done, flaky, gone, failed = await app.dispatch_each_outcome()
        envelope = {"v": 1, "job": f"remind-{app.suffix}", "payload": {"user_id": "not a number"}}
        [invalid] = await queue.publish(f"jobs.{app.mail}", [{"payload": envelope}])
        assert invalid.status == "Accepted" and invalid.message_id is not None
        invalid_id = invalid.message_id

        async def statuses() -> dict[uuid.UUID, str]:
            out: dict[uuid.UUID, str] = {}
            for job_id in (done, flaky, gone, failed, invalid_id):
                [info] = await queue.transport.message_deliveries(job_id)
                out[job_id] = info.status
            return out

        await wait_for(lambda: len(app.ran) == 2, within=30)

        async def settled() -> dict[uuid.UUID, str] | None:
            found = await statuses()
            return None if {"Pending", "InFlight"} & set(found.values()) else found

        found = await wait_for(settled, within=15, interval=0.05)
        assert found == {done: "Completed", flaky: "Completed", gone: "Discarded", failed: "DeadLettered",
                         invalid.message_id: "DeadLettered"}
        assert sorted((r[1], r[2]) for r in app.ran) == [(-1, 2), (1, 1)]
        records = {r.id: r for r in await queue.failed_jobs(app.mail)}
        assert records[failed].attempts == 2
        assert (records[failed].error or "").splitlines()[-1] == "ValueError: boom on attempt 2"
        assert "user_id" in (records[invalid.message_id].error or "")
        assert records[invalid.message_id].attempts == 1
    assert app.events == []


async def test_a_step_runs_once_across_attempts_and_a_chain_goes_on_in_order(database_url: str) -> None:
    app = App(database_url)
    queue = app.queue
    async with queue.lifespan(None):
        ids = await queue.chain([(app.steps, {}), (app.remind, {"user_id": 5}), (app.remind, {"user_id": 6})])
        await wait_for(lambda: len(app.ran) == 3, within=30)
    assert app.steps_run == ["charge", "mail"]  # attempt 2 got the stored result and the marker
    assert [r[:2] for r in app.ran] == [("steps", "ch_1"), ("remind", 5), ("remind", 6)]
    assert [r[3] for r in app.ran[1:]] == ids[1:]  # the chained jobs have the ids chain() answered


async def test_a_job_that_fails_for_good_ends_its_chain(database_url: str) -> None:
    app = App(database_url)
    queue = app.queue
    async with queue.lifespan(None):
        ids = await queue.chain([(app.fail, {}), (app.remind, {"user_id": 9})])
        # JobFailed is heard once the failure is settled; a chain's next job is queued only in the
        # transaction of its predecessor's completion, so whether it was queued is known now.
        await wait_events(app, "JobFailed", 1)
        [failed] = [e for e in app.events if type(e).__name__ == "JobFailed"]
        assert isinstance(failed, JobFailed) and failed.chain_ended is True
        assert await queue.transport.known_messages(ids) == {ids[0]}  # the second was never queued
        [record] = await queue.failed_jobs(app.mail)
        assert "the chain ends here" in (record.error or "")
    assert app.ran == []


async def test_a_unique_key_lets_one_of_many_concurrent_dispatchers_queue(database_url: str) -> None:
    app = App(database_url, enabled=False)
    queue = app.queue
    async with queue.lifespan(None):
        async def dispatch_in_a_transaction() -> uuid.UUID | None:
            async with queue.sessionmaker() as session, session.begin():
                return await queue.dispatch(app.remind, {"user_id": 1}, unique="members", session=session)

        results = await asyncio.gather(*(dispatch_in_a_transaction() for _ in range(8)))
        queued = [r for r in results if r is not None]
        assert len(queued) == 1 and await queue.size(app.mail) == 1
        # A rolled-back dispatch frees the key it took.
        other = App(database_url, enabled=False)
        async with queue.sessionmaker() as session, session.begin():
            assert await queue.dispatch(app.steps, {}, unique="k", session=session) is not None
            await session.rollback()
        assert await queue.dispatch(app.steps, {}, unique="k") is not None
        assert await queue.dispatch(app.steps, {}, unique="k") is None
        del other


async def test_a_unique_key_is_released_when_the_job_is_done(database_url: str) -> None:
    app = App(database_url)
    queue = app.queue
    async with queue.lifespan(None):
        first = await queue.dispatch(app.remind, {"user_id": 1}, unique="u")
        assert await queue.dispatch(app.remind, {"user_id": 2}, unique="u") is None
        await wait_events(app, "JobProcessed", 1)
        await wait_for(lambda: _dispatched_again(queue, app), within=10)
    assert first is not None


async def _dispatched_again(queue: WorkQueue, app: App) -> bool:
    return await queue.dispatch(app.remind, {"user_id": 3}, unique="u") is not None


async def test_an_encrypted_payload_never_reaches_the_store_in_the_clear(database_url: str) -> None:
    from cryptography.fernet import Fernet

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    secret = f"reset-link-{uuid.uuid4().hex}"
    seen: list[str] = []
    queue_name = f"sec{uuid.uuid4().hex[:8]}"
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        enabled=False, app_key=old, **FAST))

    @queue.job(f"secret-{uuid.uuid4().hex[:6]}", encrypted=True, queue=queue_name)
    async def send_reset(payload: dict[str, str]) -> None:
        seen.append(payload["link"])

    async with queue.lifespan(None):
        job_id = await queue.dispatch(send_reset, {"link": secret})
        assert job_id is not None
        [info] = await queue.transport.message_deliveries(job_id, include_payload=True)
        assert secret not in json.dumps(info.payload)
        assert "encrypted" in info.payload and "payload" not in info.payload
        token = info.payload["encrypted"]
    # The key rotates: the new key encrypts, the old one still decrypts; reencrypt moves the job over.
    name = queue.jobs.registry.resolve(send_reset).name
    rotated = WorkQueue(WorkQueueSettings(database_url=database_url, subscriptions=[], app_key=new,
                                          previous_keys=old, enabled=False, **FAST))
    async with rotated.lifespan(None):
        assert await rotated.reencrypt_jobs() == 1
        [info] = await rotated.transport.message_deliveries(job_id, include_payload=True)
        assert info.payload["encrypted"] != token
        assert Fernet(new.encode()).decrypt(info.payload["encrypted"].encode())
        assert await rotated.reencrypt_jobs() == 0  # already on the current key
    # The old key can go now: a worker with the new key alone runs the job.
    after = WorkQueue(WorkQueueSettings(database_url=database_url, subscriptions=[], app_key=new,
                                        job_queues=queue_name, **FAST))

    @after.job(name, encrypted=True, queue=queue_name)
    async def send_reset_again(payload: dict[str, str]) -> None:
        seen.append(payload["link"])

    async with after.lifespan(None):
        await wait_for(lambda: seen == [secret], within=30)


async def test_an_encrypted_jobs_steps_and_once_keys_never_reach_the_store_in_the_clear(database_url: str) -> None:
    """``job.step`` results of an ``encrypted=True`` job are stored encrypted and its ``job.once``
    keys as keyed hashes: the next attempt still reads the step back and skips the once."""
    from cryptography.fernet import Fernet

    secret = f"alice-{uuid.uuid4().hex}@example.com"
    queue_name = f"sec{uuid.uuid4().hex[:8]}"
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        app_key=Fernet.generate_key().decode(), job_queues=queue_name, **FAST))
    ran: list[tuple[int, str, bool]] = []
    steps: list[str] = []

    async def look_up() -> dict[str, str]:
        steps.append("ran")
        return {"address": secret}

    @queue.job(f"mail-{uuid.uuid4().hex[:6]}", encrypted=True, queue=queue_name, tries=2, backoff=0)
    async def mail(payload: dict[str, str], job: JobContext) -> None:
        found = await job.step("look-up", look_up)
        sent = await job.once(f"welcome:{payload['to']}", lambda: None)
        ran.append((job.attempt, found["address"], sent))
        if job.attempt == 1:
            raise RuntimeError("the mail server is busy")

    async with queue.lifespan(None):
        job_id = await queue.dispatch(mail, {"to": secret})
        assert job_id is not None
        await wait_for(lambda: len(ran) == 2, within=30)
        found, stored = await queue.transport.step_get(job_id, "look-up")
        state, token = await queue.transport.once_begin(f"welcome:{secret}", 5)
        if token is not None:
            await queue.transport.once_abort(f"welcome:{secret}", token)
    assert ran == [(1, secret, True), (2, secret, False)] and steps == ["ran"]
    assert found and stored is not None and secret not in stored and "encrypted" in stored
    assert state != "Done"  # the once key in the clear was never stored


async def test_an_encrypted_jobs_once_is_not_run_again_after_a_key_rotation(database_url: str) -> None:
    """The first attempt ran ``job.once`` under the old key and failed; a worker on the new key
    (the old one among WORKQUEUE_PREVIOUS_KEYS) retries it: the marker is found under the old key's
    hash, and the side effect is not run a second time."""
    from cryptography.fernet import Fernet

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    name, queue_name = f"rot-{uuid.uuid4().hex[:6]}", f"rot{uuid.uuid4().hex[:8]}"
    sent: list[int] = []
    attempts: list[int] = []

    def release(**keys: Any) -> WorkQueue:
        queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                            job_queues=queue_name, **keys, **FAST))

        @queue.job(name, encrypted=True, queue=queue_name, tries=1)
        async def charge(payload: dict[str, int], job: JobContext) -> None:
            attempts.append(job.attempt)
            await job.once(f"charge:{payload['order']}", lambda: sent.append(payload["order"]))
            if len(attempts) == 1:
                raise RuntimeError("the receipt mail failed after the charge")

        return queue

    first = release(app_key=old)
    async with first.lifespan(None):
        job_id = await first.dispatch(name, {"order": 7})
        assert job_id is not None
        await wait_for(lambda: _job_state(first, job_id, "Failed"), within=30)
    rotated = release(app_key=new, previous_keys=old)
    async with rotated.lifespan(None):
        await rotated.retry_job(job_id)
        await wait_for(lambda: _job_state(rotated, job_id, "Completed"), within=30)
    assert sent == [7] and len(attempts) == 2


async def _job_state(queue: WorkQueue, job_id: uuid.UUID, state: str) -> bool:
    status = await queue.job_status(job_id)
    return status is not None and status.state == state


async def test_an_encrypted_jobs_unique_key_is_stored_as_a_keyed_hash_and_still_unique(database_url: str) -> None:
    """The unique key of an encrypted job (an e-mail address, say) is not stored in clear, in the
    envelope nor in the deduplication table: it is an HMAC under the app key, so a second process
    with the same WORKQUEUE_APP_KEY still finds it held, and the job frees it when it is done."""
    from cryptography.fernet import Fernet
    from sqlalchemy.ext.asyncio import create_async_engine

    app_key = Fernet.generate_key().decode()
    secret_key = "ada.lovelace@example.com"
    name, queue_name = f"enc-unique-{uuid.uuid4().hex[:6]}", f"encu{uuid.uuid4().hex[:6]}"
    ran: list[Any] = []

    def make(**options: Any) -> WorkQueue:
        queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                            app_key=app_key, **FAST, **options))

        @queue.job(name, encrypted=True, queue=queue_name)
        async def send(payload: dict[str, str]) -> None:
            ran.append(payload)

        return queue

    dispatcher, other = make(enabled=False), make(enabled=False)
    async with dispatcher.lifespan(None), other.lifespan(None):
        first = await dispatcher.dispatch(name, {"to": secret_key}, unique=secret_key)
        assert first is not None
        assert await other.dispatch(name, {"to": secret_key}, unique=secret_key) is None  # held, seen from elsewhere
        assert await other.dispatch(name, {"to": "x"}, unique="another key") is not None
        [info] = await dispatcher.transport.message_deliveries(first, include_payload=True)
        stored_key = info.payload["unique"]["key"]
        assert stored_key.startswith(f"{name}:hmac-sha256:") and secret_key not in json.dumps(info.payload)
        table = "deduplication" if database_url.startswith("sqlite") else "workqueue.deduplication"
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                keys = [row[0] for row in await conn.execute(text(f"SELECT deduplication_key FROM {table}"))]
        finally:
            await engine.dispose()
        assert stored_key in keys and not [k for k in keys if secret_key in k]
    worker = make(job_queues=queue_name)
    async with worker.lifespan(None):
        await wait_for(lambda: len(ran) == 2, within=30)
        await wait_for(lambda: _dispatched(worker, name, secret_key), within=10)  # done: the key is free again


async def _dispatched(queue: WorkQueue, name: str, unique: str) -> bool:
    return await queue.dispatch(name, {"to": unique}, unique=unique) is not None


async def test_a_plain_payload_for_an_encrypted_job_fails_at_once(database_url: str) -> None:
    from cryptography.fernet import Fernet

    app_key = Fernet.generate_key().decode()
    name, queue_name = f"enc-{uuid.uuid4().hex[:6]}", f"enc{uuid.uuid4().hex[:6]}"
    events: list[JobEvent] = []
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        app_key=app_key, job_queues=queue_name, **FAST))
    queue.listen(JobEvent, events.append)

    @queue.job(name, encrypted=True, queue=queue_name, tries=5)
    async def job(payload: dict[str, str]) -> None:
        raise AssertionError("never runs")

    async with queue.lifespan(None):
        from fastapi_workqueue import PublishRequest

        [result] = await queue.publish(f"jobs.{queue_name}", [PublishRequest(
            attributes={"job": name}, payload={"v": 1, "job": name, "payload": {"x": "plain"}})])
        await wait_for(lambda: any(type(e).__name__ == "JobFailed" for e in events), within=30)
        assert result.message_id is not None
        [info] = await queue.transport.message_deliveries(result.message_id)
        assert info.status == "DeadLettered" and info.attempt == 1
        assert "not encrypted" in (info.reason or "")


async def test_an_encrypted_job_without_a_key_stops_the_app_at_start(database_url: str) -> None:
    from fastapi_workqueue import ConfigurationError

    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[],
                                        job_queues="nokey"))

    @queue.job("needs.a.key", encrypted=True, queue="nokey")
    async def job(payload: dict[str, str]) -> None:
        return None

    with pytest.raises(ConfigurationError, match="WORKQUEUE_APP_KEY"):
        async with queue.lifespan(None):
            pass


async def test_requests_dispatch_in_their_transaction(database_url: str) -> None:
    import httpx
    from fastapi import FastAPI, HTTPException

    app = App(database_url, enabled=False)
    queue = app.queue
    web = FastAPI(lifespan=queue.lifespan)

    @web.post("/remind/{user_id}")
    async def remind(user_id: int, fail: bool = False, session: AsyncSession = queue.session) -> dict[str, str]:
        await session.execute(text("SELECT 1"))
        job_id = await queue.dispatch(app.remind, {"user_id": user_id})
        if fail:
            raise HTTPException(409, "refused after dispatching")
        return {"job_id": str(job_id)}

    async with queue.lifespan(web), httpx.AsyncClient(transport=httpx.ASGITransport(app=web),
                                                      base_url="http://test") as http:
        assert (await http.post("/remind/1", params={"fail": True})).status_code == 409
        assert await queue.size(app.mail) == 0
        assert (await http.post("/remind/2")).status_code == 200
        assert await queue.size(app.mail) == 1


async def test_an_overlap_lock_is_renewed_by_its_holder_only_and_expires_without_it(database_url: str) -> None:
    queue = WorkQueue(WorkQueueSettings(database_url=database_url, auto_migrate=True, subscriptions=[], enabled=False))
    key = f"overlap:renew-{uuid.uuid4().hex[:8]}"
    async with queue.lifespan(None):
        locks = queue.jobs.locks
        token = await locks.acquire(key, 0.5)
        assert token is not None and await locks.acquire(key, 0.5) is None
        assert await locks.renew(key, token, 60)  # held for a minute from now
        assert not await locks.renew(key, "00000000-0000-0000-0000-000000000000", 60)  # not its holder
        await asyncio.sleep(0.6)  # past the first expiry: the renewal holds it
        assert await locks.acquire(key, 0.5) is None
        assert await locks.renew(key, token, 0.2)
        taken = await wait_for(lambda: locks.acquire(key, 60), within=10)  # not renewed: it expires
        assert taken is not None and taken != token
        assert not await locks.renew(key, token, 60)  # the old holder lost it
        await locks.release(key, taken)
