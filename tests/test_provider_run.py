"""CI's OpenVINO subset runs again only the tests that run on the provider under test (they take the ``provider``
fixture, directly or through another fixture) or need the OpenVINO environment (marker ``openvino``); the others
would repeat the CPU suite exactly and are deselected there. The CPU suite runs every test."""

from __future__ import annotations

from pathlib import Path

import pytest

INNER_TESTS = """
import pytest

@pytest.fixture
def on_provider(provider):
    return provider

def test_takes_provider(provider):
    assert provider in ("cpu", "openvino")

def test_takes_it_through_a_fixture(on_provider):
    assert on_provider in ("cpu", "openvino")

@pytest.mark.openvino
def test_marked():
    pass

def test_ignores_the_provider():
    pass
"""


@pytest.mark.parametrize("provider_env, passed, deselected", [("openvino", 3, 1), ("cpu", 4, 0)])
def test_provider_run_deselects_the_tests_that_ignore_the_provider(pytester, monkeypatch, provider_env, passed,
                                                                   deselected):
    monkeypatch.setenv("DYNCOMPILE_TEST_PROVIDER", provider_env)
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=passed, deselected=deselected)
    if deselected:
        assert "test_ignores_the_provider" not in result.stdout.str()
