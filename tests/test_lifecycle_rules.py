"""The delivery lifecycle's rules (``core/lifecycle.py``) as pure functions: backoff, the settle
and expiry transitions, outcome or exception → settlement, and claimability per partition mode.
(``test_lifecycle.py`` is about the subscription and topic lifecycle on a real store.)"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from fastapi_workqueue.core.lifecycle import (
    LEASE_EXPIRED_ERROR,
    BackoffPolicy,
    BatchItem,
    backoff_seconds,
    batch_refusals,
    clamp_delay,
    classify_batch,
    dead_letters,
    expire_transition,
    next_claimable,
    settle_transition,
    settlement_for,
    topic_refusal,
)
from fastapi_workqueue.core.outcomes import FatalWorkError, Outcome, TransientWorkError

NOW = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = BackoffPolicy(base=2.0, maximum=30.0)


@pytest.mark.parametrize(("attempt", "draw", "expected"), [
    (0, 0.5, 1.0),  # attempt 0 counts as 1
    (1, 0.5, 1.0),
    (2, 1.0, 4.0),
    (3, 0.25, 2.0),
    (10, 1.0, 30.0),  # the ceiling
    (4, 0.0, 0.0),
])
def test_full_jitter_is_the_draw_times_the_capped_exponential(attempt: int, draw: float, expected: float) -> None:
    assert backoff_seconds(attempt, POLICY, draw) == expected


def test_a_schedule_gives_the_attempts_step_and_then_its_last() -> None:
    policy = BackoffPolicy(schedule=[10, 60, 300])
    assert [backoff_seconds(n, policy, 0.99) for n in (0, 1, 2, 3, 4, 9)] == [10, 10, 60, 300, 300, 300]


def test_an_empty_schedule_falls_back_to_the_subscriptions_backoff() -> None:
    assert backoff_seconds(2, BackoffPolicy(1.0, 10.0, []), 0.5) == 1.0


def test_clamp_delay_keeps_a_delay_between_zero_and_the_ceiling() -> None:
    assert [clamp_delay(s, 100.0) for s in (-5.0, 0.0, 42.5, 1e9)] == [0.0, 0.0, 42.5, 100.0]


def settle(kind: str, attempt: int = 1, max_attempts: int = 3, **extra: object):  # type: ignore[no-untyped-def]
    return settle_transition(kind, attempt=attempt, max_attempts=max_attempts, now=NOW,  # type: ignore[arg-type]
                             backoff=POLICY, draw=0.5, **extra)  # type: ignore[arg-type]


def test_complete_completes_and_clears_the_reason() -> None:
    t = settle("Complete", current_reason="earlier", current_error="boom")
    assert (t.status, t.attempt, t.reason, t.last_error, t.visible_at, t.terminal) == (
        "Completed", 1, None, "boom", None, True)


def test_retry_before_the_last_attempt_is_pending_after_the_backoff_or_its_delay() -> None:
    t = settle("Retry", attempt=2, reason="busy", error="E")
    assert (t.status, t.attempt, t.reason, t.last_error, t.wait_seconds) == ("Pending", 2, "busy", "E", 2.0)
    assert t.visible_at == NOW + timedelta(seconds=2.0) and not t.terminal
    assert settle("Fail", delay=7.0).visible_at == NOW + timedelta(seconds=7.0)


@pytest.mark.parametrize("kind", ["Retry", "Fail"])
def test_the_last_attempt_dead_letters_with_max_attempts_reached(kind: str) -> None:
    assert settle(kind, attempt=3, reason="busy").reason == "max attempts reached: busy"
    assert settle(kind, attempt=3, error="E").reason == "max attempts reached: E"
    t = settle(kind, attempt=4)
    assert (t.status, t.reason, t.visible_at) == ("DeadLettered", "max attempts reached", None)


def test_dead_letter_dead_letters_at_once_with_its_reason() -> None:
    t = settle("DeadLetter", attempt=1, reason="bad input")
    assert (t.status, t.reason) == ("DeadLettered", "bad input")
    assert settle("DeadLetter", current_reason="kept").reason == "kept"


def test_release_gives_the_attempt_back_and_waits_its_delay_only() -> None:
    t = settle("Release", attempt=2, reason="shutdown")
    assert (t.status, t.attempt, t.wait_seconds) == ("Pending", 1, 0.0)
    assert settle("Release", attempt=0, delay=5.0).attempt == 0
    assert settle("Release", attempt=3, delay=5.0).wait_seconds == 5.0  # never dead-letters


def test_discard_discards_and_cancel_discards_whatever_the_outcome_keeping_its_reason() -> None:
    assert settle("Discard", reason="stale").status == "Discarded"
    for kind in ("Complete", "Retry", "Fail", "DeadLetter", "Release"):
        t = settle(kind, cancel_requested=True, reason="theirs", current_reason="cancelled by operator")
        assert (t.status, t.reason) == ("Discarded", "cancelled by operator"), kind


def test_backoff_is_drawn_only_when_needed() -> None:
    draws: list[int] = []

    def draw() -> float:
        draws.append(1)
        return 1.0

    settle_transition("Retry", attempt=1, max_attempts=3, now=NOW, backoff=POLICY, draw=draw, delay=3.0)
    settle_transition("Retry", attempt=1, max_attempts=3, now=NOW, backoff=BackoffPolicy(schedule=[4]), draw=draw)
    assert draws == []
    t = settle_transition("Retry", attempt=2, max_attempts=3, now=NOW, backoff=POLICY, draw=draw)
    assert draws == [1] and t.wait_seconds == 4.0
    assert settle_transition("Retry", attempt=1, max_attempts=3, now=NOW, backoff=lambda: 9.0).wait_seconds == 9.0


def test_dead_letters_names_the_settles_that_end_dead_lettered() -> None:
    assert dead_letters("DeadLetter", 1, 5) and dead_letters("Retry", 5, 5) and dead_letters("Fail", 6, 5)
    assert not dead_letters("Retry", 4, 5) and not dead_letters("Release", 5, 5)
    assert not dead_letters("Complete", 5, 5) and not dead_letters("Discard", 5, 5)


def test_an_expired_lease_retries_dead_letters_on_the_final_attempt_or_discards_if_cancelled() -> None:
    t = expire_transition(attempt=1, max_attempts=2, now=NOW, backoff=POLICY, draw=1.0)
    assert (t.status, t.reason, t.last_error, t.wait_seconds) == ("Pending", "lease expired", LEASE_EXPIRED_ERROR, 2.0)
    t = expire_transition(attempt=2, max_attempts=2, now=NOW, backoff=POLICY)
    assert (t.status, t.reason) == ("DeadLettered", "lease expired on the final attempt")
    t = expire_transition(attempt=2, max_attempts=2, now=NOW, backoff=POLICY, cancel_requested=True,
                          current_reason="stop", current_error="E")
    assert (t.status, t.reason, t.last_error) == ("Discarded", "stop", "E")


def test_outcomes_and_exceptions_map_to_settlements() -> None:
    def of(result: object) -> tuple[object, ...]:
        s = settlement_for("d1", "tok", result)
        assert (s.delivery_id, s.lease_token) == ("d1", "tok")
        return (s.kind, s.delay_seconds, s.reason, s.error is not None)

    assert of(None) == ("Complete", None, None, False)
    assert of(Outcome.complete()) == ("Complete", None, None, False)
    assert of(Outcome.retry("later", delay_seconds=3)) == ("Retry", 3, "later", False)
    assert of(Outcome.dead_letter("never")) == ("DeadLetter", None, "never", False)
    assert of(Outcome.discard("unwanted")) == ("Discard", None, "unwanted", False)
    assert of(FatalWorkError("broken")) == ("DeadLetter", None, "broken", True)
    assert of(TransientWorkError("flaky", delay_seconds=2)) == ("Retry", 2, "flaky", True)
    assert of(KeyError("x")) == ("Fail", None, "KeyError", True)
    kind, _, reason, _ = of(42)
    assert (kind, reason) == ("Fail", "invalid outcome")
    assert "returned 42" in (settlement_for("d", "t", 42).error or "")


@dataclass
class D:
    status: str
    visible_at: datetime


PAST, FUTURE = NOW - timedelta(seconds=1), NOW + timedelta(seconds=60)


def test_exclusive_takes_the_earliest_visible_pending_unless_one_is_in_flight() -> None:
    waiting, later, sooner = D("Pending", FUTURE), D("Pending", NOW), D("Pending", PAST)
    assert next_claimable("Exclusive", [waiting, later, sooner], NOW) is sooner
    assert next_claimable("Exclusive", [waiting], NOW) is None  # backoff does not hold the key, nor free it early
    assert next_claimable("Exclusive", [D("InFlight", PAST), sooner], NOW) is None
    assert next_claimable("Exclusive", [D("DeadLettered", PAST), later], NOW) is later


def test_ordered_takes_only_a_visible_pending_head() -> None:
    head, second = D("Pending", PAST), D("Pending", PAST)
    assert next_claimable("Ordered", [D("Completed", PAST), D("Discarded", PAST), head, second], NOW) is head
    assert next_claimable("Ordered", [D("Pending", FUTURE), second], NOW) is None  # a retrying head blocks
    assert next_claimable("Ordered", [D("DeadLettered", PAST), second], NOW) is None
    assert next_claimable("Ordered", [D("InFlight", PAST), second], NOW) is None
    assert next_claimable("Ordered", [D("Completed", PAST)], NOW) is None


def test_none_mode_takes_any_visible_pending() -> None:
    visible = D("Pending", PAST)
    assert next_claimable("None", [D("InFlight", PAST), D("Pending", FUTURE), visible], NOW) is visible


# -- publish: all or nothing ---------------------------------------------------------------------


def _item(mid: str, content: str = "h", key: str | None = None, size: int = 10) -> BatchItem:
    return BatchItem(mid, content, key, size)


def test_a_batch_is_classified_before_anything_is_written() -> None:
    stored = {"old": ("t", "h"), "other": ("t", "x"), "elsewhere": ("another-topic", "h")}
    live = {"held": "holder-id"}
    items = [_item("a"), _item("a"), _item("a", "changed"), _item("old"), _item("other"), _item("elsewhere"),
             _item("b", key="held"), _item("c", key="k"), _item("d", key="k"), _item("big", size=101)]
    verdicts = classify_batch(items, 100, topic="t", stored=stored.get, live_holder=live.get)
    assert verdicts == [
        ("Accepted", "a"), ("Duplicate", "a"), ("MessageIDConflict", "a"), ("Duplicate", "old"),
        ("MessageIDConflict", "other"), ("MessageIDConflict", "elsewhere"), ("Duplicate", "holder-id"),
        ("Accepted", "c"), ("Duplicate", "c"), ("Rejected", "big"),
    ]


def test_a_refused_item_aborts_the_call_naming_it_from_0() -> None:
    items = [_item("a"), _item("b", size=500), _item("c")]
    verdicts = classify_batch(items, 100, topic="orders", stored=lambda _: None, live_holder=lambda _: None)
    refusals = batch_refusals(verdicts, items, topic="orders", cap=100)
    assert refusals is not None
    assert [(r.status, r.code) for r in refusals] == [
        ("Rejected", "BatchAborted"), ("Rejected", "EnvelopeTooLarge"), ("Rejected", "BatchAborted")]
    assert refusals[0].text == ("not published: item 1 of this call was refused (EnvelopeTooLarge) and a publish "
                                "call is all-or-nothing")
    assert "the envelope is 500 bytes; topic 'orders' accepts at most 100 bytes" in refusals[1].text


def test_a_call_without_refusals_is_written() -> None:
    items = [_item("a"), _item("a")]
    verdicts = classify_batch(items, None, topic="t", stored=lambda _: None, live_holder=lambda _: None)
    assert batch_refusals(verdicts, items, topic="t", cap=None) is None


def test_a_topic_that_is_missing_or_retired_refuses_the_call_saying_what_to_do() -> None:
    assert topic_refusal("orders", exists=False) == (
        "UnknownTopic", "topic 'orders' does not exist; declare it in the WorkQueue topics or create it first")
    code, text = topic_refusal("orders", exists=True)
    assert code == "TopicRetired" and "workqueue topics resume orders" in text


@pytest.mark.parametrize(("room", "keys", "share"), [
    (4, 0, 4), (4, 6, 2), (4, 4, 2), (4, 1, 3), (5, 5, 2), (1, 0, 1), (1, 1, 1), (1, 3, 1), (2, 2, 1),
])
def test_a_claim_leaves_the_deliveries_without_a_key_at_least_half_its_room(room: int, keys: int, share: int) -> None:
    from fastapi_workqueue.core.lifecycle import unkeyed_share

    assert unkeyed_share(room, min(keys, room)) == share


def test_split_claim_gives_the_keys_what_the_others_leave_and_a_claim_of_one_to_the_first() -> None:
    from fastapi_workqueue.core.lifecycle import split_claim

    def order(d: tuple[int, int]) -> tuple[int, int]:
        return d

    keys, others = [(0, 1), (0, 3), (0, 5), (0, 7)], [(0, 2), (0, 4)]
    assert split_claim(4, keys, others, order, order) == ([(0, 1), (0, 3)], others)  # 2 + 2
    assert split_claim(6, keys, others, order, order) == (keys, others)  # room for all
    assert split_claim(1, keys[:1], others[:1], order, order) == (keys[:1], [])  # the key comes first
    assert split_claim(1, [(0, 3)], [(0, 2)], order, order) == ([], [(0, 2)])
    assert split_claim(1, [(-9, 3)], [(0, 2)], order, order) == ([(-9, 3)], [])  # a higher priority first
    assert split_claim(3, [], others, order, order) == ([], others)
