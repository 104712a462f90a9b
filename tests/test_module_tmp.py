"""The suite's ``module_tmp`` fixture frees a module's folders when the module is done (CI's disk filled up when
a dozen real-model plans stayed until the session's end) and keeps them when one of its tests failed."""

from __future__ import annotations

import textwrap
from pathlib import Path

INNER_CONFTEST = "from helpers import module_tmp  # noqa: F401\n"

INNER_TESTS = textwrap.dedent("""
    from pathlib import Path

    import pytest

    @pytest.fixture(scope="module")
    def built(module_tmp):
        d = module_tmp("{name}")
        (d / "weights.bin").write_bytes(b"x" * 1024)
        Path("made.txt").write_text(str(d))  # the cwd is pytester's folder
        return d

    def test_uses_it(built):
        assert (built / "weights.bin").stat().st_size == 1024

    def test_outcome(built):
        assert {passes}
""")

LATER = textwrap.dedent("""
    from pathlib import Path

    def test_later():
        assert Path(Path("made.txt").read_text()).exists() is not {gone}
""")


def _run(pytester, name: str, passes: bool):
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(**{f"test_{name}": INNER_TESTS.format(name=name, passes=passes),
                           # runs after the first module's teardown, while the session is still on
                           "test_zz_later": LATER.format(gone=passes)})
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    return result, _made(pytester)


def _made(pytester) -> Path:
    made = Path((pytester.path / "made.txt").read_text())
    assert made.parent.is_dir()  # the session's basetemp is still there: only the module's folder may have gone
    return made


def test_folders_go_when_the_module_passes(pytester):
    result, made = _run(pytester, "freed", passes=True)
    result.assert_outcomes(passed=3)
    assert made.name == "freed0" and not made.exists()


def test_folders_stay_when_a_test_of_the_module_fails(pytester):
    result, made = _run(pytester, "kept", passes=False)
    result.assert_outcomes(passed=2, failed=1)
    assert (made / "weights.bin").is_file()


def test_a_plain_tmp_path_factory_folder_stays_until_the_session_ends(pytester):
    """Negative control: the same module with ``tmp_path_factory.mktemp`` leaves its folder behind."""
    pytester.makepyfile(test_plain=INNER_TESTS.format(name="plain", passes=True)
                        .replace("module_tmp(", "tmp_path_factory.mktemp(").replace("(module_tmp)", "(tmp_path_factory)"))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert (_made(pytester) / "weights.bin").is_file()
