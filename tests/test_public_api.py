"""The public surface: the names users import, kept sorted, resolvable and documented."""

from __future__ import annotations

import inspect

import pytest

import fastapi_workqueue

ISSUE_NAMES = [
    "WorkQueue", "WorkQueueSettings", "Topic", "Subscription", "PublishRequest", "PublishResult", "WorkMessage",
    "WorkContext", "Outcome", "WorkOutcome", "TransientWorkError", "FatalWorkError",
]


def test_the_documented_names_are_exported() -> None:
    exported = set(fastapi_workqueue.__all__)
    assert set(ISSUE_NAMES) <= exported


def test_all_is_sorted_unique_and_resolvable() -> None:
    names = fastapi_workqueue.__all__
    # Constants, then classes, then functions, each alphabetical (the order ruff keeps).
    assert list(names) == sorted(names, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper() else 2, n))
    assert len(set(names)) == len(names)
    for name in names:
        assert hasattr(fastapi_workqueue, name), name


def test_exported_classes_and_functions_have_docstrings() -> None:
    missing = [
        name for name in fastapi_workqueue.__all__
        if (inspect.isclass(getattr(fastapi_workqueue, name)) or inspect.isfunction(getattr(fastapi_workqueue, name)))
        and not inspect.getdoc(getattr(fastapi_workqueue, name))
    ]
    assert missing == []


def test_the_readme_shows_every_name_of_the_quick_start() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    for name in ISSUE_NAMES:
        assert name in readme, name


def test_a_conformance_skip_that_names_no_case_is_refused() -> None:
    """A misspelt or stale case name in ``install(skips=...)`` would skip nothing, in silence."""
    from fastapi_workqueue.testing.conformance import install, memory_harness

    with pytest.raises(ValueError, match="skips names 'test_c04_dedup', which is no conformance case; did you mean "
                                         "'test_c04_"):
        install({}, memory_harness, skips={"test_c04_dedup": "no keys here"})
    namespace: dict[str, object] = {}
    install(namespace, memory_harness, skips={"test_c27_discard_in_flight_requests_cancel_then_discarded_never_retried"
                                              "[Complete]": "one parameter"})
    assert "harness" in namespace and "test_c27_discard_in_flight_requests_cancel_then_discarded_never_retried" in (
        namespace)
