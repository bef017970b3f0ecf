"""Declaring jobs: names, policies, payload types, what a job function may take."""

from __future__ import annotations

import datetime as dt
import re
import threading
from typing import Any

import pytest
from fastapi import Depends, Request
from pydantic import BaseModel, Field, SecretStr, computed_field, field_serializer

from fastapi_workqueue import ConfigurationError, JobContext, WorkQueue, WorkQueueSettings
from fastapi_workqueue.jobs import JobPayloadInvalid, UnknownJob


class Reminder(BaseModel):
    user_id: int


def make() -> WorkQueue:
    return WorkQueue(WorkQueueSettings(database_url="sqlite+aiosqlite:///unused.db"))


def test_a_job_declares_its_queue_as_a_topic_and_subscription_of_the_core() -> None:
    queue = make()

    @queue.job("billing.send-invoice-reminder", tries=5, backoff=[10, 60, 300], timeout=30, queue="mail")
    async def send(payload: Reminder, job: JobContext) -> None:
        return None

    assert "jobs.mail" in queue.topics
    sub = queue.subscriptions["jobs.mail"]
    assert (sub.topic, sub.handler_key, sub.partition_mode) == ("jobs.mail", "workqueue.jobs", "None")
    job = queue.jobs.registry.resolve(send)
    policy = job.policy
    assert (policy.tries, policy.backoff, policy.timeout, policy.queue) == (5, (10, 60, 300), 30, "mail")
    assert (job.payload_param, job.context_param, job.payload_type) == ("payload", "job", Reminder)


def test_two_jobs_with_one_name_are_refused_naming_both() -> None:
    queue = make()

    @queue.job("stats.rebuild")
    async def first(payload: dict[str, Any]) -> None:
        return None

    with pytest.raises(ConfigurationError, match=r"declared twice.*first.*second"):
        @queue.job("stats.rebuild")
        async def second(payload: dict[str, Any]) -> None:
            return None


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"tries": 0}, "tries"),
        ({"backoff": [-1]}, "backoff"),
        ({"backoff": []}, "backoff"),
        ({"timeout": 0}, "timeout"),
        ({"queue": "bad queue"}, "queue name"),
        ({"middleware": [42]}, "not callable"),
    ],
)
def test_a_bad_policy_says_what_to_change(options: dict[str, Any], match: str) -> None:
    queue = make()
    with pytest.raises(ConfigurationError, match=match):
        @queue.job("x.y", **options)
        async def job(payload: dict[str, Any]) -> None:
            return None


def test_names_sync_functions_and_library_names_are_refused() -> None:
    queue = make()
    with pytest.raises(ConfigurationError, match="not valid"):
        queue.job("has space")
    with pytest.raises(ConfigurationError, match="belong to the library"):
        @queue.job("workqueue.internal")
        async def mine(payload: dict[str, Any]) -> None:
            return None
    with pytest.raises(ConfigurationError, match="async function"):
        @queue.job("sync.job")  # type: ignore[type-var]  # a sync function, on purpose
        def sync(payload: dict[str, Any]) -> None:
            return None


def test_a_payload_type_that_cannot_round_trip_through_json_is_refused_with_the_reason() -> None:
    queue = make()
    with pytest.raises(ConfigurationError, match=r"cannot be stored as JSON.*pass IDs"):
        @queue.job("lock.job")
        async def job(payload: threading.Lock) -> None:
            return None

    @queue.job("dates.job")  # a datetime is written as an ISO string and read back: allowed
    async def dates(payload: dt.datetime) -> None:
        return None


class Card(BaseModel):
    number: str
    cvv: SecretStr


class Charge(BaseModel):
    amount: int
    card: Card


class Audited(BaseModel):
    amount: int
    internal: int = Field(exclude=True)


class Doubled(BaseModel, extra="forbid"):
    amount: int

    @computed_field  # type: ignore[prop-decorator]
    @property
    def doubled(self) -> int:
        return self.amount * 2


@pytest.mark.parametrize(("payload_type", "says"), [
    (Charge, "a SecretStr is written as '**********' (keep the secret out of the payload, or use a plain str "
             "field with encrypted=True)"),
    (list[Card], "a SecretStr is written as '**********'"),
    (Audited, "Audited.internal is required but left out of the JSON (exclude=True); give it a default"),
    (Doubled, "Doubled writes its computed fields (doubled) into the JSON and forbids extra fields"),
])
def test_a_payload_type_whose_json_does_not_read_back_as_given_is_refused(payload_type: Any, says: str) -> None:
    """Accepted at dispatch, such a payload would reach the job changed (a secret as its mask) or
    fail at run time, without a retry."""
    queue = make()

    async def job(payload: Any) -> None:
        return None

    job.__annotations__["payload"] = payload_type
    with pytest.raises(ConfigurationError, match=re.escape(says)):
        queue.job("lossy.job")(job)


class Price(BaseModel):
    cents: int

    @field_serializer("cents")
    def as_text(self, cents: int) -> str:
        return f"{cents / 100:.2f} EUR"


class Labelled(BaseModel):
    name: str
    label: str = Field(default="none", exclude=True)


class Stamped(BaseModel):
    at: dt.datetime

    @field_serializer("at")
    def iso(self, at: dt.datetime) -> str:
        return at.isoformat()


async def test_a_payload_whose_json_does_not_read_back_as_given_is_refused_at_dispatch() -> None:
    """A custom serializer, or a field left out of the JSON, is checked at each dispatch: the job
    would get another value, or fail at run time without a retry."""
    queue = make()

    @queue.job("billing.charge")
    async def charge(payload: Price) -> None:
        return None

    @queue.job("labels.print")
    async def label(payload: Labelled) -> None:
        return None

    @queue.job("events.stamp")
    async def stamp(payload: Stamped) -> None:
        return None

    with pytest.raises(JobPayloadInvalid, match=r"its JSON does not read back .cents: Input should be a valid integer"):
        await queue.dispatch(charge, Price(cents=1250))
    with pytest.raises(JobPayloadInvalid, match=r"it reads back from its JSON as .*label='none'.*not as given"):
        await queue.dispatch(label, Labelled(name="a", label="fragile"))
    assert not queue.is_open  # refused before anything was opened
    stamped = queue.jobs.registry.find("events.stamp")
    assert stamped is not None and stamped.validate(Stamped(at=dt.datetime(2026, 1, 2, tzinfo=dt.UTC)))


async def test_a_job_without_a_payload_parameter_refuses_a_payload() -> None:
    queue = make()

    @queue.job("stats.rebuild-all")
    async def rebuild_all() -> None:
        return None

    with pytest.raises(JobPayloadInvalid, match="the job takes no payload"):
        await queue.dispatch(rebuild_all, {"user_id": 7})
    assert not queue.is_open


def test_a_nested_request_only_dependency_is_refused_with_its_path() -> None:
    queue = make()

    def token(t: str) -> str:  # a query parameter: only a real request has it
        return t

    def user(tok: str = Depends(token)) -> str:
        return tok

    with pytest.raises(ConfigurationError, match=r"job 'auth.job' -> user -> token -> t"):
        @queue.job("auth.job")
        async def job(payload: dict[str, Any], who: str = Depends(user)) -> None:
            return None
    assert queue.jobs.registry.find("auth.job") is None  # refused, not half-declared


def test_extra_parameters_must_be_dependencies() -> None:
    queue = make()
    with pytest.raises(ConfigurationError, match="neither the payload"):
        @queue.job("extra.job")
        async def job(payload: dict[str, Any], other: int) -> None:
            return None

    def app_name(request: Request) -> str:
        return str(request.app)

    @queue.job("with.request")  # Request is allowed: a job sees the app
    async def fine(payload: dict[str, Any], name: str = Depends(app_name)) -> None:
        return None


async def test_an_undeclared_job_or_a_bad_payload_is_refused_before_anything_is_written() -> None:
    queue = make()

    @queue.job("billing.remind")
    async def remind(payload: Reminder) -> None:
        return None

    async def stranger(payload: Reminder) -> None:
        return None

    with pytest.raises(UnknownJob, match=r"declare it with @queue.job"):
        await queue.dispatch(stranger, {"user_id": 1})
    with pytest.raises(UnknownJob):
        await queue.dispatch("no.such.job", {})
    with pytest.raises(JobPayloadInvalid, match=r"user_id"):
        await queue.dispatch(remind, {"user_id": "not a number"})
    assert not queue.is_open  # nothing was opened, let alone written


def test_a_dependency_that_takes_the_job_context_is_refused_with_what_to_use() -> None:
    queue = make()

    async def report_name(job: JobContext) -> str:
        return job.name

    with pytest.raises(ConfigurationError, match=re.escape(
            "job 'reports.build': one of its dependencies takes a parameter typed JobContext "
            "(job 'reports.build' -> report_name -> job), which FastAPI can only read from a request")) as refused:
        @queue.job("reports.build")
        async def build(payload: dict[str, Any], name: str = Depends(report_name)) -> None:
            return None
    assert "Depends(current_context)" in str(refused.value)
