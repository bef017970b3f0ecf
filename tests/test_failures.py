"""The error text kept of a handler's exception: cause first, innermost frames, bounded, redacted."""

from __future__ import annotations

from fastapi_workqueue.core.failures import MAX_ERROR_TEXT, error_text


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


def test_a_deep_traceback_keeps_its_innermost_frames_and_says_how_many_were_left_out() -> None:
    text = error_text(_caught(30))
    lines = text.splitlines()
    assert lines[0] == "KeyError: 'token=*** missing'"
    assert any("outer frames left out" in line for line in lines)
    assert "  ... 24 outer frames left out" in lines  # 32 frames, the innermost 8 kept
    assert lines[-2].endswith("line 10, in _recurse") and lines[-1].strip().startswith("raise KeyError")
    assert "abc123" not in text


def test_the_text_is_bounded_and_still_starts_with_the_cause() -> None:
    huge = ValueError("x" * 10_000)
    text = error_text(huge, limit=200)
    assert len(text) == 200 and text.startswith("ValueError: xxx") and text.endswith("...")
    deep = error_text(_caught(30), limit=300)
    assert len(deep) <= 300 and deep.startswith("KeyError")
    assert len(error_text(_caught(500))) <= MAX_ERROR_TEXT


def test_an_exception_without_message_or_traceback_is_its_type() -> None:
    assert error_text(TimeoutError()) == "TimeoutError"


def test_a_chain_that_loops_ends() -> None:
    first, second = ValueError("first"), ValueError("second")
    first.__cause__, second.__cause__ = second, first
    assert error_text(first).splitlines() == ["ValueError: first", "Caused by: ValueError: second"]
