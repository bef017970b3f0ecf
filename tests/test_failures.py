"""The error text kept of a handler's exception: a Python traceback, innermost frames, bounded, redacted."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from fastapi_workqueue import PublishRequest, WorkMessage
from fastapi_workqueue.core.failures import MAX_ERROR_TEXT, error_text

from .support import make_queue, wait_for


def _recurse(n: int) -> None:
    if n == 0:
        raise KeyError("token=abc123 missing")
    _recurse(n - 1)


def _caught(n: int) -> BaseException:
    try:
        _recurse(n)
    except KeyError as exc:
        return exc
    raise AssertionError("unreachable")


def test_a_deep_traceback_keeps_its_innermost_frames_and_ends_with_what_failed() -> None:
    text = error_text(_caught(30))
    lines = text.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "KeyError: 'token=*** missing'"
    assert lines[-3].endswith(", in _recurse") and lines[-2].strip().startswith("raise KeyError")
    assert "in _caught" not in text  # an outer frame, beyond the eight kept
    assert "abc123" not in text


def test_a_cause_comes_first_as_python_prints_it() -> None:
    try:
        try:
            _recurse(0)
        except KeyError as exc:
            raise RuntimeError("lookup failed") from exc
    except RuntimeError as exc:
        lines = error_text(exc).splitlines()
    assert "KeyError: 'token=*** missing'" in lines
    assert "The above exception was the direct cause of the following exception:" in lines
    assert lines[-1] == "RuntimeError: lookup failed"


def test_the_text_is_bounded_and_still_says_what_failed() -> None:
    huge = ValueError("x" * 10_000 + " the end")
    text = error_text(huge, limit=200)
    assert len(text) == 200 and text.startswith("ValueError: xxx") and text.endswith(" the end")
    deep = error_text(_caught(30), limit=300)
    assert len(deep) <= 300 and deep.endswith("KeyError: 'token=*** missing'")
    assert len(error_text(_caught(500))) <= MAX_ERROR_TEXT


def test_an_exception_without_message_or_traceback_is_its_type() -> None:
    assert error_text(TimeoutError()) == "TimeoutError"


def test_the_input_a_validation_error_quotes_is_left_out() -> None:
    class Card(BaseModel):
        card_number: str

    payload = {"cardNumber": "4111", "cvv": "CVV-" + "SECRET-987"}  # (the traceback quotes this line)
    try:
        Card.model_validate(payload)
    except ValidationError as exc:
        text = error_text(exc)
    assert "CVV-SECRET-987" not in text and "4111" not in text
    assert "card_number" in text and "Field required [type=missing, input_value=..., input_type=dict]" in text


class Payment(BaseModel):
    amount: int
    card_number: str


async def test_a_payload_that_does_not_validate_is_not_quoted_in_the_stored_error(database_url: str) -> None:
    queue, topic, subs = make_queue(database_url, [{"role": "pay", "max_attempts": 1}], auto_migrate=True)

    @queue.handler("pay")
    async def pay(message: WorkMessage[Payment]) -> None:
        raise AssertionError("never called: the payload does not validate")

    async with queue.lifespan(None):
        await queue.publish(topic, [PublishRequest(payload={"amount": 5, "cardNumber": "4111",
                                                            "cvv": "CVV-SECRET-987"})])

        async def dead() -> list[Any]:
            return list(await queue.deliveries(subs["pay"], "DeadLettered"))

        await wait_for(dead, within=30)
        [letter] = await dead()
    stored = f"{letter.reason} {letter.last_error}"
    assert "card_number: Field required" in stored
    assert "CVV-SECRET-987" not in stored and "4111" not in stored


def test_a_handlers_reason_is_kept_bounded_and_redacted() -> None:
    from fastapi_workqueue import FatalWorkError, Outcome
    from fastapi_workqueue.core.lifecycle import settlement_for

    for outcome in (Outcome.retry("x" * 250_000 + " token=abc123"), Outcome.dead_letter("y" * 250_000),
                    FatalWorkError("z" * 250_000)):
        reason = settlement_for("1", "t", outcome).reason
        assert reason is not None and len(reason) == MAX_ERROR_TEXT and " ... " in reason
    assert settlement_for("1", "t", Outcome.discard("password=hunter2 gone")).reason == "password=*** gone"


@pytest.mark.parametrize("delay", [-5, float("nan"), float("inf"), 1e12])
def test_a_retry_delay_that_is_no_number_of_seconds_is_refused_where_it_is_asked_for(delay: float) -> None:
    from fastapi_workqueue import Outcome, TransientWorkError

    for ask in (lambda: Outcome.retry("later", delay_seconds=delay), lambda: TransientWorkError("later", delay)):
        with pytest.raises(ValueError, match="delay_seconds must be a number of seconds from 0 to 3153600000"):
            ask()
    assert Outcome.retry("later", delay_seconds=0).delay_seconds == 0
    assert TransientWorkError("later", 2.5).delay_seconds == 2.5
    assert TransientWorkError("later").delay_seconds is None


def test_a_kept_reason_is_redacted_again_once_a_secret_is_registered() -> None:
    from fastapi_workqueue.core.failures import stored_reason
    from fastapi_workqueue.core.redaction import _REGISTERED, register_secrets

    secret = "k3y-" + uuid.uuid4().hex
    reason = f"upstream refused {secret}"
    assert stored_reason(reason) == reason  # (kept for the next time)
    try:
        register_secrets([secret])
        assert stored_reason(reason) == "upstream refused ***"
    finally:
        _REGISTERED.discard(secret)
