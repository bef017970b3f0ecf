"""Reading a dead-letter queue without hiding it from the other readers.

SQS cannot list a queue: the operator views read a DLQ by receiving its messages (each with a
short visibility timeout) and making them visible again at once. While one read holds them, they
are hidden from every other receive. So, per subscription, this process reads one at a time:
listings that overlap share one read, and a replay or discard reads afresh under the same lock
(two replays of one dead letter must not both find it). A read that finds messages still held
by another process's read, after its own are visible again, waits for them a little and reads
once more, for up to :data:`HIDDEN_WAIT_SECONDS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from .naming import BATCH

READ_VISIBILITY_SECONDS = 2
"""How long a read hides what it received, should it fail to make it visible again."""
HIDDEN_WAIT_SECONDS = 3.0
"""How long a read waits for dead letters another reader holds (beyond its visibility timeout)."""
HIDDEN_POLL_SECONDS = 0.2

Message = dict[str, Any]


class _ReadAbandoned(Exception):
    """The read a listing waited for ended with its caller's cancellation: read again."""


class DeadLetterReads:
    """The reads of each subscription's DLQ in this process: one at a time, shared by listings."""

    def __init__(self, sqs: Callable[[], Any], dlq_url: Callable[[str], str]) -> None:
        self._sqs = sqs
        self._dlq_url = dlq_url
        self._locks: dict[str, asyncio.Lock] = {}
        self._shared: dict[str, asyncio.Future[list[Message]]] = {}

    def lock(self, subscription: str) -> asyncio.Lock:
        """Held by every read and every replay or discard of ``subscription``'s dead letters."""
        lock = self._locks.get(subscription)
        if lock is None:
            lock = self._locks[subscription] = asyncio.Lock()
        return lock

    async def listed(self, subscription: str) -> list[Message]:
        """The DLQ's messages (up to 1,000), for a listing or a lookup: a read already under way
        for the subscription is shared (one whose caller was cancelled is not: the next reads)."""
        while (shared := self._shared.get(subscription)) is not None:
            try:
                return list(await asyncio.shield(shared))
            except _ReadAbandoned:
                continue
        shared = self._shared[subscription] = asyncio.get_running_loop().create_future()
        try:
            found = await self._locked_read(subscription)
        except asyncio.CancelledError:
            shared.set_exception(_ReadAbandoned())
            raise
        except Exception as exc:
            shared.set_exception(exc)
            raise
        finally:
            if self._shared.get(subscription) is shared:
                del self._shared[subscription]
            if shared.done():
                shared.exception()  # (read by its waiters, or by none: never "not retrieved")
        shared.set_result(found)
        return list(found)

    async def _locked_read(self, subscription: str) -> list[Message]:
        async with self.lock(subscription):
            return await self.read(subscription, 1000)

    async def read(self, subscription: str, limit: int) -> list[Message]:
        """Up to ``limit`` DLQ messages, each received and made visible again, with the newest
        receipt handle of each (call it holding :meth:`lock`)."""
        url = self._dlq_url(subscription)
        sqs = self._sqs()
        seen: dict[str, Message] = {}
        deadline = time.monotonic() + HIDDEN_WAIT_SECONDS
        while True:
            received = await self._pass(sqs, url, seen, limit)
            for message in received:
                with contextlib.suppress(Exception):
                    await sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"],
                                                        VisibilityTimeout=0)
            if len(seen) >= limit or time.monotonic() >= deadline or not await self._hidden(sqs, url):
                return list(seen.values())[:limit]
            await asyncio.sleep(HIDDEN_POLL_SECONDS)

    @staticmethod
    async def _pass(sqs: Any, url: str, seen: dict[str, Message], limit: int) -> list[Message]:
        """Receives until two rounds bring nothing new; what it received stays hidden until the
        caller makes it visible again."""
        received: list[Message] = []
        new_ids: set[str] = set()
        empty_rounds = 0
        while len(seen) < limit and empty_rounds < 2:
            answer = await sqs.receive_message(
                QueueUrl=url, MaxNumberOfMessages=BATCH, WaitTimeSeconds=0,
                VisibilityTimeout=READ_VISIBILITY_SECONDS,
                MessageSystemAttributeNames=["All"], MessageAttributeNames=["All"],
            )
            messages = answer.get("Messages", [])
            received.extend(messages)
            fresh = [m for m in messages if m["MessageId"] not in new_ids]
            for message in messages:
                seen[message["MessageId"]] = message  # (the newest receipt handle)
            new_ids.update(m["MessageId"] for m in fresh)
            empty_rounds = 0 if fresh else empty_rounds + 1
        return received

    @staticmethod
    async def _hidden(sqs: Any, url: str) -> bool:
        """Whether the DLQ holds messages that some receive keeps hidden (another reader's, or a
        replay under way elsewhere)."""
        answer = await sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessagesNotVisible"])
        return int(answer.get("Attributes", {}).get("ApproximateNumberOfMessagesNotVisible", 0)) > 0

