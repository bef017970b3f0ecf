"""The conformance suite's harness for the AWS transport on a moto server.

Each case declares its own topic and subscriptions with ``sync_topology``; here that provisions
them on moto from their manifest (as the Terraform module would) and binds them. A delivery's
clock moves through SQS itself: ChangeMessageVisibility with the last receipt handle the transport
holds. What SQS cannot do (a clock for a message never received here, no sweep lock, no caller's
transaction without a database) skips the case with the reason; :data:`AWS_SKIPS` lists the cases
skipped up front and :data:`MOTO_CANNOT_EMULATE` what only real AWS can check (docs/aws.md names both).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

import pytest

from fastapi_workqueue import Subscription, Topic, WorkQueue, WorkQueueSettings
from fastapi_workqueue.aws.bindings import Bindings
from fastapi_workqueue.aws.manifest import build_manifest
from fastapi_workqueue.aws.transport import AwsTransport
from fastapi_workqueue.core.kernel import Kernel

from .moto import REGION
from .provision import provision

MOTO_CANNOT_EMULATE: dict[str, str] = {
    "stale receipt handle": "moto still deletes or changes the visibility with a receipt handle of an earlier receive",
    "FIFO deduplication after a delete": "moto does not keep a deleted message's deduplication id for 5 minutes",
    "Lambda partial batch failure": "moto runs no Lambda event source mapping with ReportBatchItemFailures",
    "visibility timeout expiry": "the harness moves a message's visibility through the last receipt handle this "
                                 "process holds; a message it never received (a publish's delay, a dead letter's "
                                 "send time, a waiting message's age) has no clock to move",
    "sweeper and its lock": "SQS expires leases and retention itself; there is no sweep pass to hold",
}
"""Behaviours the moto tests cannot check: verified only against real AWS (docs/aws.md quotes it)."""

NO_CLOCK = MOTO_CANNOT_EMULATE["visibility timeout expiry"]


class ProvisioningAwsTransport(AwsTransport):
    """The AWS transport whose ``sync_topology`` provisions and binds what it is given (tests only)."""

    def __init__(self, kernel: Kernel, moto_url: str) -> None:
        super().__init__(kernel, bindings=Bindings(region=REGION))
        self.moto_url = moto_url

    async def sync_topology(self, topics: Sequence[Topic], subscriptions: Sequence[Subscription]) -> None:
        fifo = {s.topic for s in subscriptions if s.partition_mode != "None"}
        aws_topics = [t.model_copy(update={"transport": "aws", "is_fifo": t.is_fifo or t.name in fifo}) for t in topics]
        if any(s.partition_mode == "Ordered" for s in subscriptions):
            pytest.skip("Ordered needs a database topic (capability ordered=False on the aws transport)")
        manifest = build_manifest(aws_topics, subscriptions, self.settings)
        document = await asyncio.to_thread(provision, manifest, self.moto_url)
        bound = Bindings.parse(document)
        assert self.bindings is not None
        self.bindings = Bindings(region=REGION, topics={**self.bindings.topics, **bound.topics},
                                 subscriptions={**self.bindings.subscriptions, **bound.subscriptions})
        await super().sync_topology(aws_topics, subscriptions)


class AwsHarness:
    """What the suite needs beyond the transport; the clock, lock and session cases skip."""

    name = "aws"

    def __init__(self, transport: ProvisioningAwsTransport) -> None:
        self.transport = transport

    def _skip(self, reason: str) -> NoReturn:
        pytest.skip(f"aws: {reason}")

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Any]:
        self._skip("a caller's transaction is the outbox's, which needs a database (tests/aws/test_outbox.py)")
        yield None  # pragma: no cover

    @asynccontextmanager
    async def hold_sweep_lock(self) -> AsyncIterator[None]:
        self._skip(MOTO_CANNOT_EMULATE["sweeper and its lock"])
        yield  # pragma: no cover

    async def advance(self, delivery_id: str, seconds: float) -> None:
        """Lets ``seconds`` pass for a message this process received: ChangeMessageVisibility with
        its last receipt handle (as SQS allows until the next receive) shortens a lease or a retry's
        delay by that much; a settled one is made visible at once, which SQS refuses (or ignores) for
        a deleted message. Whole seconds, rounded up, as SQS counts them."""
        transport = self.transport
        now = datetime.now(UTC)
        lease = transport._leases.get(delivery_id)
        if lease is not None and lease.lease_expires_at > now:
            until = lease.lease_expires_at - timedelta(seconds=seconds)
            await self._visible_in(lease.queue_url, lease.receipt, (until - now).total_seconds())
            lease.lease_expires_at = until
            return
        info, receipt = transport.records.get(delivery_id), transport.records.receipt(delivery_id)
        if info is None or receipt is None:
            self._skip(NO_CLOCK)
        if info.status == "Pending" and info.visible_at is not None:
            until = info.visible_at - timedelta(seconds=seconds)
            await self._visible_in(receipt.queue_url, receipt.receipt, (until - now).total_seconds())
            transport.records.update(delivery_id, visible_at=until)
            return
        with contextlib.suppress(Exception):  # deleted: SQS refuses the receipt
            await self._visible_in(receipt.queue_url, receipt.receipt, 0)
        moved = {k: getattr(info, k) - timedelta(seconds=seconds) for k in ("settled_at", "claimed_at")
                 if getattr(info, k) is not None}
        transport.records.update(delivery_id, **moved)

    async def _visible_in(self, queue_url: str, receipt: str, seconds: float) -> None:
        await self.transport.sqs.change_message_visibility(
            QueueUrl=queue_url, ReceiptHandle=receipt, VisibilityTimeout=max(0, math.ceil(seconds))
        )

    async def expire_lease(self, delivery_id: str) -> None:
        lease = self.transport._leases.get(delivery_id)
        assert lease is not None and lease.lease_expires_at > datetime.now(UTC), f"{delivery_id} is not in flight"
        await self.advance(delivery_id, (lease.lease_expires_at - datetime.now(UTC)).total_seconds() + 1.0)

    async def advance_deduplication(self, topic: str, key: str, seconds: float) -> None:
        self._skip(NO_CLOCK)


@asynccontextmanager
async def aws_harness(moto_url: str) -> AsyncIterator[AwsHarness]:
    queue = WorkQueue(WorkQueueSettings(database_url=None, aws_region=REGION, aws_endpoint_url=moto_url,
                                        aws_wait_time_seconds=0, aws_relay=False))
    transport = ProvisioningAwsTransport(queue.kernel, moto_url)
    await transport.open()
    try:
        yield AwsHarness(transport)
    finally:
        await transport.close()


# Capabilities the aws transport does not have (Ordered is refused in sync_topology above).
CANCEL = "cancel is not available on SQS (capability cancel=False)"
EXACT_BACKLOG = "SQS counts are approximate (capability exact_backlog=False)"
# What SQS and SNS cannot do, on moto as on AWS.
NO_LISTING = ("SQS cannot list or address a waiting message: list_deliveries(Pending) and a waiting delivery's age "
              "are the database's")
TERMINAL_COUNTS = ("SQS keeps no count of deleted messages: stats on the aws transport report completed and "
                   "discarded as 0 (capability terminal_counts=False)")
WHOLE_SECONDS = ("SQS sets a visibility timeout in whole seconds: the transport rounds the drawn backoff, which the "
                 "case checks to 0.05 s (the draw itself is the same full jitter)")
LEASE_REDRIVE = ("SQS hands a message whose last lease ran out back at the next receive, and a receive count above "
                 "max_attempts may come from give-backs in other processes: the transport cannot tell a lease that "
                 "ran out on the final attempt from a message that never ran, so it runs it once more (as its last "
                 "attempt) instead of dead-lettering it")
SNS_PUBLISH = "SNS answers no Duplicate or MessageIDConflict (a FIFO topic drops a repeat silently) and has no " \
              "per-message delay"
FOLLOW_UPS = "follow-ups are published before the delete (at-least-once, checked in tests/aws/test_follow_ups.py), " \
             "not in one transaction with it: a follow-up published already is published again, and SNS answers " \
             "no Duplicate (a standard topic delivers it twice)"
# What the routing transport sends to the database transport beside the aws topics.
DATABASE_STORE = "deduplication keys, steps, known messages and payload rewrites live in the database transport " \
                 "(the routing transport sends them there)"

AWS_SKIPS: dict[str, str] = {
    # capability
    "test_listings_fill_every_field_a_single_delivery_has": CANCEL + "; " + NO_LISTING,
    "test_c33_stats_and_backlog_agree_with_deliveries": EXACT_BACKLOG,
    # SQS and SNS
    "test_the_oldest_due_delivery_comes_first_across_subscriptions": NO_LISTING + "; SQS has no order across queues",
    "test_a_completion_without_follow_ups_is_a_plain_settle": NO_LISTING,
    "test_c26_discard_pending_or_dead_lettered_keeps_reason": "SQS cannot address a waiting message by id; "
                                                              "dead letters are discarded from the DLQ",
    "test_c33_terminal_counts_stay_exact_through_discard_expiry_purge_and_prune": TERMINAL_COUNTS,
    "test_c16_retry_without_delay_uses_full_jitter_backoff": WHOLE_SECONDS,
    "test_c16_full_jitter_is_spread_over_the_whole_range": WHOLE_SECONDS,
    "test_c13_lease_expiring_on_final_attempt_dead_letters": LEASE_REDRIVE,
    "test_publish_delay_and_not_before_hold_the_message_back": SNS_PUBLISH,
    "test_c02_same_message_id_and_content_is_duplicate": SNS_PUBLISH,
    "test_c03_same_message_id_different_content_is_conflict": SNS_PUBLISH,
    "test_c03_same_message_id_on_another_topic_is_conflict": SNS_PUBLISH,
    "test_c04_deduplication_key_within_ttl_is_duplicate_then_accepted_after": SNS_PUBLISH,
    "test_c04_deduplication_key_repeated_within_one_call": SNS_PUBLISH,
    "test_a_completion_frees_the_deduplication_keys_it_names_and_nothing_else_does": SNS_PUBLISH,
    "test_completions_settled_together_free_their_keys": SNS_PUBLISH,
    "test_c06_conflict_in_a_batch_publishes_nothing": SNS_PUBLISH,
    "test_c02_batch_repeating_stored_and_own_items_answers_duplicate_for_them": SNS_PUBLISH,
    "test_a_refused_follow_up_rolls_the_completion_back[conflict]": SNS_PUBLISH,
    "test_a_follow_up_stored_already_with_the_same_content_is_a_duplicate_and_still_completes": FOLLOW_UPS,
    # only real AWS
    "test_c31_retention_purges_terminal_only": MOTO_CANNOT_EMULATE["sweeper and its lock"],
    "test_c31_retention_purges_messages_nothing_refers_to_by_their_topic": MOTO_CANNOT_EMULATE["sweeper and its lock"],
    # the database's
    "test_the_holder_frees_its_deduplication_key_and_no_one_else_can": DATABASE_STORE,
    "test_an_expired_deduplication_key_was_not_held": DATABASE_STORE,
    "test_a_step_result_is_stored_once_and_read_back": DATABASE_STORE,
    "test_a_step_of_a_message_the_store_does_not_have_is_refused": DATABASE_STORE,
    "test_the_purge_of_a_message_removes_its_steps": DATABASE_STORE,
    "test_known_messages_answers_which_ids_are_stored": DATABASE_STORE,
    "test_message_deliveries_lists_each_subscriptions_delivery": DATABASE_STORE,
    "test_rewrite_payload_replaces_a_payload_no_delivery_has_finished_with": DATABASE_STORE,
    "test_rewrite_payload_refuses_a_discarded_delivery_and_an_envelope_over_the_cap": DATABASE_STORE,
}
"""Conformance cases the aws transport skips, by test function (or ``function[param]`` for one of its
parameters), with the reason."""
