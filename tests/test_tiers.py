"""The test tiers (tests/tiers.py): every test collected has exactly one kind, so no new test
escapes them, and the kinds and ``slow`` follow what a test uses."""

from __future__ import annotations

import textwrap

import pytest

from . import tiers
from .tiers import KINDS, TIERS


def test_every_collected_test_carries_exactly_one_kind(request: pytest.FixtureRequest) -> None:
    record = request.config.stash[TIERS]
    assert record[request.node.nodeid] == (("unit",), False)
    assert all(len(kinds) == 1 for kinds, _ in record.values())
    assert all(
        tuple(k for k in KINDS if item.get_closest_marker(k)) == record[item.nodeid][0]
        for item in request.session.items
    )


def test_the_tier_markers_are_registered_and_unknown_markers_refused(pytestconfig: pytest.Config) -> None:
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert {*KINDS, "slow"} <= registered
    assert pytestconfig.option.strict_markers


def make_tiered(pytester: pytest.Pytester) -> None:
    """A project whose conftest applies tests/tiers.py, with a ``pg_url`` and a fixture that connects."""
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makeconftest("""
        import pytest

        from tests import tiers


        def pytest_configure(config):
            for name in (*tiers.KINDS, "slow"):
                config.addinivalue_line("markers", f"{name}: a tier")


        @pytest.hookimpl(tryfirst=True)
        def pytest_collection_modifyitems(config, items):
            tiers.apply(config, items)


        @pytest.fixture
        def pg_url():
            return "the session's database"


        @pytest.fixture
        def own_connection():
            return asyncpg.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    """)


def test_the_kind_and_slow_follow_what_a_test_uses(pytester: pytest.Pytester) -> None:
    make_tiered(pytester)
    pytester.makepyfile(test_sample=textwrap.dedent("""
        import subprocess
        import sys

        import pytest


        def start_worker():
            return subprocess.run([sys.executable, "-c", "pass"], check=True)


        def test_pure():
            assert 1 + 1 == 2


        def test_on_the_session_database(pg_url):
            assert pg_url


        def test_on_a_file_of_its_own(tmp_path):
            assert f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"


        def test_through_a_fixture(own_connection):
            assert own_connection


        def test_with_a_worker():
            start_worker()


        @pytest.mark.integration
        def test_said_integration():
            pass


        @pytest.mark.slow
        def test_said_slow():
            pass

    """))
    items, _ = pytester.inline_genitems()
    got = {
        item.name: (tuple(k for k in KINDS if item.get_closest_marker(k)), item.get_closest_marker("slow") is not None)
        for item in items
    }
    assert got == {
        "test_pure": (("unit",), False),
        "test_on_the_session_database": (("integration",), False),
        "test_on_a_file_of_its_own": (("integration",), False),
        "test_through_a_fixture": (("integration",), False),
        "test_with_a_worker": (("unit",), True),
        "test_said_integration": (("integration",), False),
        "test_said_slow": (("unit",), True),
    }


def test_a_kind_marker_that_contradicts_what_the_test_uses_stops_the_collection(pytester: pytest.Pytester) -> None:
    make_tiered(pytester)
    pytester.makepyfile(test_sample="""
        import pytest


        def test_fine():
            pass


        @pytest.mark.unit
        def test_said_unit_but_on_a_database(pg_url):
            pass
    """)
    result = pytester.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*each test needs exactly one of unit, integration, aws, browser*"
         "test_sample.py::test_said_unit_but_on_a_database has unit and integration"]
    )


def test_a_slow_helper_of_another_module_makes_slow_every_test_that_calls_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SLOW_DEFINITIONS names a helper where it is defined; a test of another file that imports it
    # (under its name or another) and names it, itself or through a fixture, is slow; the file's
    # other tests are not.
    make_tiered(pytester)
    monkeypatch.setattr(tiers, "TESTS", pytester.path)
    monkeypatch.setattr(tiers, "SLOW_DEFINITIONS", frozenset({"sample/helpers.py::start_worker"}))
    package = pytester.mkpydir("sample")
    (package / "helpers.py").write_text(textwrap.dedent("""
        def start_worker():
            return "a process, out of sight"
    """))
    (package / "test_calls.py").write_text(textwrap.dedent("""
        import pytest

        from .helpers import start_worker
        from .helpers import start_worker as other_name


        @pytest.fixture
        def worker():
            return other_name()


        def test_calls_it():
            start_worker()


        def test_through_a_fixture(worker):
            assert worker


        def test_without_it():
            assert 1 + 1 == 2
    """))
    items, _ = pytester.inline_genitems()
    assert {item.name: item.get_closest_marker("slow") is not None for item in items} == {
        "test_calls_it": True, "test_through_a_fixture": True, "test_without_it": False,
    }
