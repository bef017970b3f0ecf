"""The Lambda adapter: ``handler = sqs_handler(func)`` serves a subscription from an SQS event source.

Each record of the event becomes one call of ``func`` with the same :class:`WorkMessage` and
:class:`WorkContext` a host consumer gives it. The answer lists in ``batchItemFailures`` the messages
that must come back; before one is listed for a retry, its visibility is set to the backoff delay
(ChangeMessageVisibility), so it returns when the delay is over. A dead letter (an exhausted retry,
``Outcome.dead_letter``, :class:`FatalWorkError`, a payload that does not validate) is sent to the
subscription's dead-letter queue with the reason and the error, and then left for Lambda to delete.

The subscription's policy comes from the environment variable ``WORKQUEUE_SUBSCRIPTION_POLICY``
(JSON) that the Terraform module sets on the function. The context's signal aborts (reason
``MaxProcessingSeconds``) ``deadline_margin_seconds`` before the function's own deadline
(``context.get_remaining_time_in_millis()``), or at the policy's ``max_processing_seconds``.

This module imports the core only (pydantic, the standard library) and boto3 when it first calls
SQS: neither FastAPI, Starlette, SQLAlchemy nor a database driver, so a bundle stays small.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..core.context import AbortReason, AbortSignal, Progress, WorkContext
from ..core.errors import ConfigurationError
from ..core.failures import error_text
from ..core.handlers import HandlerSpec, PayloadInvalid, call_plain, inspect_handler
from ..core.lifecycle import BackoffPolicy, backoff_seconds, clamp_delay, settle_transition, settlement_for
from ..core.outcomes import WorkOutcome
from ..core.redaction import redact, redacting_logger
from ..core.tasks import TaskScope
from .sqs_records import SqsRecord, dead_letter_entry, decode_record

log = redacting_logger("fastapi_workqueue.aws.lambda")

POLICY_ENV = "WORKQUEUE_SUBSCRIPTION_POLICY"
ENDPOINT_ENV = "WORKQUEUE_AWS_ENDPOINT_URL"
MAX_VISIBILITY_SECONDS = 43200
ABORT_GRACE_SECONDS = 1.0
"""How long an aborted handler gets to end before the record is reported (it is left behind after)."""
"""SQS's cap on a message's visibility timeout (12 hours)."""


class SubscriptionPolicy(BaseModel):
    """What the function knows of its subscription (the JSON of ``WORKQUEUE_SUBSCRIPTION_POLICY``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: int = 1
    name: str
    topic: str
    handler_key: str
    partition_mode: Literal["None", "Exclusive", "Ordered"] = "None"
    is_fifo: bool = False
    max_attempts: int = Field(default=5, ge=1)
    lease_seconds: float = Field(default=60, gt=0)
    backoff_base_seconds: float = Field(default=1, ge=0)
    backoff_max_seconds: float = Field(default=300, ge=0)
    max_processing_seconds: float | None = Field(default=None, gt=0)
    queue_url: str
    dlq_url: str
    region: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SubscriptionPolicy:
        """Reads the policy from ``WORKQUEUE_SUBSCRIPTION_POLICY``; one-line errors say what to set."""
        env = os.environ if environ is None else environ
        text = env.get(POLICY_ENV)
        if not text:
            raise ConfigurationError(
                f"{POLICY_ENV} is not set: the Terraform module sets it on the function; elsewhere set it to "
                "the subscription's policy JSON (name, topic, handler_key, queue_url, dlq_url, ...)"
            )
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"{POLICY_ENV} is not JSON ({exc.msg} at character {exc.pos})") from exc
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "policy"
            raise ConfigurationError(f"{POLICY_ENV} is not a subscription policy: {where}: {first['msg']}") from exc

    def backoff_seconds(self, attempt: int, draw: float) -> float:
        """Full-jitter exponential backoff after ``attempt`` (from 1), as the database transport draws it."""
        return backoff_seconds(attempt, BackoffPolicy(self.backoff_base_seconds, self.backoff_max_seconds), draw)


class SqsClient(Protocol):
    """The calls the adapter makes (a boto3 SQS client has them)."""

    def change_message_visibility(self, **kwargs: Any) -> Any: ...

    def change_message_visibility_batch(self, **kwargs: Any) -> Any: ...

    def send_message(self, **kwargs: Any) -> Any: ...


class LambdaContext(Protocol):
    """The part of AWS Lambda's context object the adapter reads."""

    def get_remaining_time_in_millis(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _Verdict:
    """What became of one record: done (Lambda deletes it) or failed (it comes back)."""

    message_id: str
    failed: bool


LambdaHandler = Callable[[Mapping[str, Any], Any], dict[str, Any]]


class SqsBatchHandler:
    """The callable ``sqs_handler`` returns: ``handler(event, context)`` for the Lambda runtime,
    ``await handler.process(event, context)`` inside a running event loop."""

    def __init__(
        self,
        func: Callable[..., Awaitable[WorkOutcome | None]],
        *,
        policy: SubscriptionPolicy | None,
        sqs_client: SqsClient | None,
        rng: Callable[[], float],
        clock: Callable[[], float],
        deadline_margin_seconds: float,
    ) -> None:
        self._policy = policy or SubscriptionPolicy.from_env()
        self._spec = _inspect(self._policy.handler_key, func)
        self._client = sqs_client
        self._rng = rng
        self._clock = clock
        self._margin = deadline_margin_seconds
        self._max_attempts: dict[str, int] = {}
        self.__wrapped__ = func

    @property
    def policy(self) -> SubscriptionPolicy:
        """The subscription's policy this handler runs with."""
        return self._policy

    def __call__(self, event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
        return asyncio.run(self.process(event, context))

    async def process(self, event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
        """Runs every record of ``event`` and answers ``{"batchItemFailures": [...]}``."""
        records = [decode_record(r) for r in _records(event)]
        deadline = self._deadline(context)
        if self._policy.is_fifo:
            groups: dict[str, list[SqsRecord]] = {}
            for record in records:
                groups.setdefault(record.group_id or "", []).append(record)
            results = await asyncio.gather(*(self._run_in_order(g, deadline) for g in groups.values()))
            verdicts = [v for group in results for v in group]
        else:
            verdicts = list(await asyncio.gather(*(self._run(r, deadline) for r in records)))
        return {"batchItemFailures": [{"itemIdentifier": v.message_id} for v in verdicts if v.failed]}

    def _deadline(self, context: Any) -> float | None:
        remaining = getattr(context, "get_remaining_time_in_millis", None)
        deadlines = []
        if callable(remaining):
            deadlines.append(self._clock() + remaining() / 1000.0 - self._margin)
        if self._policy.max_processing_seconds is not None:
            deadlines.append(self._clock() + self._policy.max_processing_seconds)
        return min(deadlines) if deadlines else None

    async def _run_in_order(self, records: Sequence[SqsRecord], deadline: float | None) -> list[_Verdict]:
        """A FIFO group's records one after the other; after a failure the rest come back untouched,
        so the group keeps its order."""
        verdicts: list[_Verdict] = []
        unrun: list[SqsRecord] = []
        for record in records:
            if verdicts and verdicts[-1].failed:
                verdicts.append(_Verdict(record.message_id, failed=True))
                unrun.append(record)
                continue
            verdicts.append(await self._run(record, deadline))
        if unrun:
            await self._give_back(unrun)
        return verdicts

    async def _give_back(self, records: Sequence[SqsRecord]) -> None:
        """Makes the records behind a failed one visible again at once. Listed as failures they
        would stay in flight for the whole visibility timeout, and SQS hands out nothing of a FIFO
        group while one of its messages is in flight: the failed head would wait that long, not its
        backoff delay. Visible, they wait only for the head (in flight for its delay), then follow it."""
        for start in range(0, len(records), 10):  # (SQS's batch limit)
            chunk = records[start:start + 10]
            try:
                await self._sqs("change_message_visibility_batch", QueueUrl=self._policy.queue_url, Entries=[
                    {"Id": str(i), "ReceiptHandle": r.receipt_handle, "VisibilityTimeout": 0}
                    for i, r in enumerate(chunk)
                ])
            except Exception as exc:  # (they still come back, after the timeout they were received with)
                log.warning("could not give back %d message(s) behind a failed one: %s", len(chunk), exc)

    async def _run(self, record: SqsRecord, deadline: float | None) -> _Verdict:
        try:
            return await self._attempt(record, deadline)
        finally:
            self._max_attempts.pop(record.message_id, None)

    async def _attempt(self, record: SqsRecord, deadline: float | None) -> _Verdict:
        policy = self._policy
        logger = _RecordLog(redacting_logger(f"fastapi_workqueue.handler.{policy.handler_key}"), policy.name, record)
        try:
            delivery = record.claimed(policy.name, policy.topic, policy.max_attempts)
            self._max_attempts[record.message_id] = delivery.max_attempts
            message = self._spec.build_message(delivery, policy.name)
        except PayloadInvalid as exc:
            return await self._dead_letter(record, redact(str(exc)), error_text(exc), logger)
        except ValueError as exc:
            return await self._dead_letter(record, f"the message cannot be read: {exc}", error_text(exc), logger)
        signal = AbortSignal()
        context = WorkContext(
            subscription=policy.name,
            delivery_id=delivery.delivery_id,
            attempt=record.attempt,
            max_attempts=delivery.max_attempts,
            signal=signal,
            heartbeat=lambda progress: self._heartbeat(record, progress),
            log=logger,
        )
        scope = TaskScope(f"workqueue-lambda:{record.message_id}")
        task = scope.spawn(call_plain(self._spec, message, context), name="workqueue-lambda-handler", watch=False)
        signal.add_listener(lambda _reason: task.cancel())
        timer = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            timer = loop.call_later(max(deadline - self._clock(), 0.0), signal.abort,
                                    AbortReason.MAX_PROCESSING_SECONDS)
        try:
            outcome: WorkOutcome | BaseException | None = await task
        except asyncio.CancelledError:
            if not signal.aborted:
                raise
            outcome = None
        except Exception as exc:
            outcome = exc
        finally:
            if timer is not None:
                timer.cancel()
            await scope.close(grace=ABORT_GRACE_SECONDS)
        if signal.aborted:
            return await self._failure(
                record, "MaxProcessingSeconds", None,
                "the handler was aborted before the function's deadline (or max_processing_seconds)", logger,
            )
        return await self._settle(record, outcome, logger)

    async def _settle(
        self, record: SqsRecord, outcome: WorkOutcome | BaseException | None, logger: logging.LoggerAdapter[Any]
    ) -> _Verdict:
        settlement = settlement_for(record.message_id, record.receipt_handle, outcome)
        reason = settlement.reason or ""
        if settlement.kind == "Complete":
            if settlement.follow_ups:
                return await self._failure(
                    record, "follow-ups", None,
                    "the Lambda adapter cannot publish follow-ups in the completion's transaction; "
                    "publish them from the handler or serve this subscription with a host consumer", logger,
                )
            return _Verdict(record.message_id, failed=False)
        if settlement.kind == "Discard":
            logger.info("discarded: %s", reason)
            return _Verdict(record.message_id, failed=False)
        if settlement.kind == "DeadLetter":
            return await self._dead_letter(record, reason, settlement.error, logger)
        return await self._failure(record, reason, settlement.delay_seconds, settlement.error, logger,
                                   exc=outcome if isinstance(outcome, BaseException) else None)

    async def _failure(
        self, record: SqsRecord, reason: str, delay: float | None, error: str | None,
        logger: logging.LoggerAdapter[Any], *, exc: BaseException | None = None,
    ) -> _Verdict:
        """A failed attempt: dead-lettered when it was the last, else back after its delay."""
        policy = self._policy
        max_attempts = self._max_attempts.get(record.message_id, policy.max_attempts)
        transition = settle_transition(
            "Retry", attempt=record.attempt, max_attempts=max_attempts, now=datetime.fromtimestamp(self._clock(), UTC),
            backoff=BackoffPolicy(policy.backoff_base_seconds, policy.backoff_max_seconds, record.backoff_schedule()),
            draw=self._rng, delay=delay,
        )
        if transition.status == "DeadLettered":
            return await self._dead_letter(
                record, f"{reason} (attempt {record.attempt} of {max_attempts})", error, logger, exc=exc
            )
        assert transition.wait_seconds is not None
        seconds = clamp_delay(transition.wait_seconds, MAX_VISIBILITY_SECONDS)
        logger.warning("attempt %d of %d failed (%s); back in %.1f s", record.attempt, max_attempts,
                       reason, seconds, exc_info=exc)
        try:
            await self._sqs("change_message_visibility", QueueUrl=policy.queue_url,
                            ReceiptHandle=record.receipt_handle, VisibilityTimeout=int(seconds))
        except Exception as sqs_exc:
            # It still comes back, after the visibility timeout it was received with.
            logger.warning("could not set the visibility of %s to the backoff delay: %s", record.message_id, sqs_exc)
        return _Verdict(record.message_id, failed=True)

    async def _dead_letter(
        self, record: SqsRecord, reason: str, error: str | None, logger: logging.LoggerAdapter[Any],
        *, exc: BaseException | None = None,
    ) -> _Verdict:
        """Sends the message to the dead-letter queue; Lambda deletes it from the queue once the
        send succeeded. A failed send lists it as a failure, so the redrive policy catches it."""
        logger.error("dead-lettering %s: %s", record.delivery_id(self._policy.name), reason, exc_info=exc)
        try:
            await self._sqs("send_message", **dead_letter_entry(record, self._policy, reason, error))
        except Exception as sqs_exc:
            logger.error("could not send %s to the dead-letter queue: %s", record.message_id, sqs_exc)
            return _Verdict(record.message_id, failed=True)
        return _Verdict(record.message_id, failed=False)

    async def _heartbeat(self, record: SqsRecord, progress: Progress | None) -> bool:
        """Renews the lease: the message stays invisible for another lease (progress is not stored)."""
        try:
            await self._sqs("change_message_visibility", QueueUrl=self._policy.queue_url,
                            ReceiptHandle=record.receipt_handle,
                            VisibilityTimeout=int(min(self._policy.lease_seconds, MAX_VISIBILITY_SECONDS)))
        except Exception as exc:
            log.warning("heartbeat of %s failed: %s", record.message_id, exc)
            return False
        return True

    async def _sqs(self, operation: str, **kwargs: Any) -> Any:
        client = self._client
        if client is None:
            client = self._client = _default_client(self._policy)
        return await asyncio.to_thread(getattr(client, operation), **kwargs)


def sqs_handler(
    func: Callable[..., Awaitable[WorkOutcome | None]],
    *,
    policy: SubscriptionPolicy | None = None,
    sqs_client: SqsClient | None = None,
    rng: Callable[[], float] = random.random,
    clock: Callable[[], float] = time.monotonic,
    deadline_margin_seconds: float = 2.0,
) -> SqsBatchHandler:
    """Turns an async handler into an AWS Lambda SQS entry point: ``handler = sqs_handler(func)``.

    ``func`` takes the same ``WorkMessage[T]`` and ``WorkContext`` as on a host; it may not ask for
    dependencies (there is no app in a Lambda). The policy is read from
    ``WORKQUEUE_SUBSCRIPTION_POLICY`` unless given; ``sqs_client`` defaults to a boto3 client for the
    policy's region (``WORKQUEUE_AWS_ENDPOINT_URL`` points it at an emulator); ``rng`` draws the
    backoff's jitter.
    """
    return SqsBatchHandler(func, policy=policy, sqs_client=sqs_client, rng=rng, clock=clock,
                           deadline_margin_seconds=deadline_margin_seconds)


def _inspect(key: str, func: Callable[..., Awaitable[WorkOutcome | None]]) -> HandlerSpec:
    spec = inspect_handler(key, func)
    params = inspect.signature(func).parameters
    for name in spec.other_params:
        default = params[name].default
        if default is inspect.Parameter.empty or hasattr(default, "dependency"):
            raise ConfigurationError(
                f"handler {key!r}: parameter {name!r} is a dependency, which the Lambda adapter cannot resolve; "
                "build what it needs inside the handler (or at module level) instead"
            )
    return spec


def _records(event: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    if not isinstance(event, Mapping) or not isinstance(event.get("Records"), list):
        raise ValueError("the event is not an SQS event: it has no 'Records' list (is the function's trigger SQS?)")
    records: list[Mapping[str, Any]] = event["Records"]
    return records


def _default_client(policy: SubscriptionPolicy) -> SqsClient:
    boto3 = importlib.import_module("boto3")  # the Lambda runtime ships it; imported on the first call

    region = policy.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    client: SqsClient = boto3.client("sqs", region_name=region, endpoint_url=os.environ.get(ENDPOINT_ENV) or None)
    return client


class _RecordLog(logging.LoggerAdapter[logging.Logger]):
    """A logger whose records carry the subscription, message and attempt."""

    def __init__(self, logger: logging.Logger, subscription: str, record: SqsRecord) -> None:
        super().__init__(logger, {})
        self._fields = {"subscription": subscription, "delivery_id": record.delivery_id(subscription),
                        "attempt": record.attempt}

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        kwargs["extra"] = {**self._fields, **(kwargs.get("extra") or {})}
        return msg, kwargs
