"""The error text kept of a handler's exception: a Python traceback, innermost frames, bounded, redacted."""

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
