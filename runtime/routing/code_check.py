"""The ``python-doctest`` check: does generated code pass the examples written in its own prompt?

A code-completion prompt (HumanEval style: a signature and a docstring) often shows examples of the function
it asks for. This module extracts them and runs prompt + completion + examples in the sandbox
(:mod:`dyncompile.runtime.routing.sandbox`). It never sees hidden tests: only the prompt text is read.

Example forms recognised (the call must name the entry point and have literal arguments; the expected
value must be a Python literal):

* doctest: ``>>> f(1, 2)`` followed by the expected output on the next line(s) (compared as values when the
  output is a literal, else as ``repr`` text, like doctest);
* one-liners: ``f(x) == v``, ``f(x) ➞ v``, ``f(x) => v``, ``f(x) ==> v``, ``f(x) -> v``, ``f(x) = v``,
  ``f(x) returns v``, ``f(x) should return v``, ``f(x) # returns v``, ``f(x) # => v``, optionally led by
  ``*``, ``-`` or ``for`` and trailed by a full stop or a comment; ``true``/``false`` read as ``True``/``False``;
  an arithmetic chain ``f(x) -> 19 - 5 - 6 = 8`` keeps the last value.

Floats compare with a relative tolerance of 1e-6 (``6.00`` matches ``6.0``).

The check is registered as ``python-doctest`` in the route framework's check registry
(:func:`dyncompile.runtime.routing.route.register_check`) and has its signature ``check(input_record, output) -> bool``:
``input_record`` has ``prompt`` and ``entry_point`` (a HumanEval problem, hidden tests ignored),
``output`` has ``completion`` (the generated text after the prompt). A prompt without examples gives
``no_examples_policy``'s answer (default ``False``: escalate, since nothing vouches for the code).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import re
import secrets
import time
from typing import Any

from dyncompile.errors import DataError
from dyncompile.runtime.routing.route import register_check
from dyncompile.runtime.routing.sandbox import SandboxLimits, SandboxResult, run_python

logger = logging.getLogger(__name__)

__all__ = [
    "STOP_SEQUENCES",
    "CheckOutcome",
    "Example",
    "check_examples",
    "extract_examples",
    "python_doctest",
    "build_example_program",
    "truncate_completion",
]

#: column-0 stop sequences of completion mode (the HumanEval paper's five, plus evalplus's module-level starts)
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nif ", "\nprint(", "\n#", "\nassert ", "\nimport ",
                  "\nfrom ", '\n"""', "\n```", "\n@")


def truncate_completion(text: str) -> tuple[str, bool]:
    """``text`` cut before its first stop sequence; and whether one was found."""
    cut = min((i for i in (text.find(s) for s in STOP_SEQUENCES) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


@dataclasses.dataclass(frozen=True)
class Example:
    """One example: ``call`` (source of a call of the entry point) should give ``expected`` (source).

    ``kind`` is ``"doctest"`` (from ``>>>``) or ``"inline"``; ``literal`` says whether ``expected`` is a
    Python literal (compared as a value) or doctest output text (compared with ``repr`` of the result).
    """

    call: str
    expected: str
    kind: str
    literal: bool


_SEPARATORS = (
    r"should\s+return", r"#\s*returns", r"#\s*=>", r"returns", r"==>", r"==", r"➞", r"=>", r"->", r"(?<![=!<>])=(?!=)",
)
_SEP_RE = re.compile(r"\s*(?:" + "|".join(_SEPARATORS) + r")\s*")


def _is_literal(src: str) -> bool:
    try:
        ast.literal_eval(src)
        return True
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False


def _literal_call(src: str, entry_point: str) -> bool:
    """``src`` is exactly ``entry_point(<literal args>)``."""
    try:
        node = ast.parse(src.strip(), mode="eval").body
    except SyntaxError:
        return False
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == entry_point):
        return False
    try:
        for a in node.args:
            ast.literal_eval(a)
        for k in node.keywords:
            if k.arg is None:
                return False
            ast.literal_eval(k.value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return True


def _matching_paren(s: str, start: int) -> int:
    """Index just past the ``)`` that closes the ``(`` at ``start`` (brackets and strings respected); -1 if none."""
    depth = 0
    quote = None
    i = start
    while i < len(s):
        c = s[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _clean_expected(text: str) -> str | None:
    text = text.strip()
    for cand in (text.rstrip("."), text, re.split(r"\s+#", text)[0].strip().rstrip("."),
                 re.split(r"\s*\(", text)[0].strip().rstrip(".") if not text.startswith("(") else text):
        if not cand:
            continue
        low = {"true": "True", "false": "False", "none": "None"}.get(cand.lower(), cand)
        if _is_literal(low):
            return low
    if "=" in text:  # an arithmetic chain: keep what follows the last '='
        return _clean_expected(text.rsplit("=", 1)[1])
    return None


def extract_examples(prompt: str, entry_point: str) -> list[Example]:
    """The examples ``prompt`` shows for ``entry_point`` (see the module docstring for the forms)."""
    lines = prompt.splitlines()
    examples: list[Example] = []
    seen: set[tuple[str, str]] = set()

    def add(call: str, expected: str, kind: str, literal: bool) -> None:
        if (call, expected) not in seen:
            seen.add((call, expected))
            examples.append(Example(call, expected, kind, literal))

    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith(">>>"):
            call = stripped[3:].strip()
            out_lines = []
            j = i + 1
            while j < len(lines) and lines[j].strip() and not lines[j].strip().startswith(">>>") \
                    and not lines[j].strip().startswith('"""'):
                out_lines.append(lines[j].strip())
                j += 1
            i = j
            if not _literal_call(call, entry_point):
                continue
            expected = " ".join(out_lines).strip()
            if not expected:
                continue  # doctest expects no output (None): too weak to count, skip
            add(call, expected, "doctest", _is_literal(expected))
            continue
        i += 1
        if stripped.startswith("def "):
            continue
        m = re.search(re.escape(entry_point) + r"\s*\(", stripped)
        if not m:
            continue
        end = _matching_paren(stripped, m.end() - 1)
        if end < 0:
            continue
        call = stripped[m.start():end].replace(entry_point + " (", entry_point + "(")
        if not _literal_call(call, entry_point):
            continue
        rest = stripped[end:]
        sep = _SEP_RE.match(rest)
        if not sep:
            continue
        expected = _clean_expected(rest[sep.end():])
        if expected is None:
            continue
        add(call, expected, "inline", True)
    return examples


# The harness appended to prompt + completion. Each example runs under try/except; results go to stdout as
# one JSON line after a per-run nonce, so an early exit(0) in the completion never reads as a pass.
_HARNESS = '''

def __dyncompile_check():
    import json as _json, math as _math
    def _eq(a, b):
        if isinstance(a, float) or isinstance(b, float):
            try:
                return _math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
            except (TypeError, ValueError):
                return False
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
        try:
            return bool(a == b)
        except Exception:
            return False
    _results = []
    for _call, _expected, _literal in {cases}:
        try:
            _got = eval(_call)
            if _literal:
                _ok = _eq(_got, eval(_expected))
            else:
                _ok = repr(_got) == _expected or str(_got) == _expected
            _results.append([bool(_ok), repr(_got)[:200]])
        except BaseException as _e:
            _results.append([False, "raised " + type(_e).__name__ + ": " + str(_e)[:200]])
    print({nonce!r} + _json.dumps(_results))

__dyncompile_check()
'''


def build_example_program(prompt: str, completion: str, examples: list[Example], nonce: str) -> str:
    """The program that runs ``prompt + completion``, then every example, and prints the results as one JSON line after ``nonce``."""
    cases = [(e.call, e.expected, e.literal) for e in examples]
    return prompt + completion + "\n" + _HARNESS.format(cases=repr(cases), nonce=nonce)


@dataclasses.dataclass
class CheckOutcome:
    """Result of checking one completion against its prompt's examples."""

    passed: bool
    n_examples: int
    n_passed: int
    per_example: list[list[Any]]
    seconds: float
    returncode: int | None
    timed_out: bool
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict."""
        return dataclasses.asdict(self)


DEFAULT_LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=10, memory_mb=1024)


def check_examples(prompt: str, entry_point: str, completion: str, *, limits: SandboxLimits | None = None,
                   examples: list[Example] | None = None) -> CheckOutcome:
    """Run ``prompt + completion`` against the prompt's own examples in the sandbox."""
    t0 = time.perf_counter()
    exs = extract_examples(prompt, entry_point) if examples is None else examples
    if not exs:
        return CheckOutcome(False, 0, 0, [], time.perf_counter() - t0, None, False, "no examples in the prompt")
    nonce = "@@dyncompile-check-" + secrets.token_hex(8) + "@@"
    res: SandboxResult = run_python(build_example_program(prompt, completion, exs, nonce), limits or DEFAULT_LIMITS)
    per: list[list[Any]] = []
    for line in res.stdout.splitlines():
        if line.startswith(nonce):
            try:
                per = json.loads(line[len(nonce):])
            except ValueError:
                per = []
    n_passed = sum(1 for ok, _ in per if ok)
    passed = bool(per) and len(per) == len(exs) and n_passed == len(exs) and res.ok
    err = ""
    if not per:
        err = ("timed out" if res.timed_out else f"exit {res.returncode}: " + res.stderr.strip()[-300:])
    return CheckOutcome(passed, len(exs), n_passed, per, time.perf_counter() - t0, res.returncode, res.timed_out, err)


@register_check("python-doctest")
def python_doctest(input_record: dict[str, Any], output: dict[str, Any], *, no_examples_policy: bool = False) -> bool:
    """The ``python-doctest`` check (route framework signature): ``True`` = trust this output.

    ``input_record``: ``prompt`` and ``entry_point``; ``output``: ``completion`` (the code after the prompt),
    or ``text`` (a raw continuation, cut at the first column-0 stop sequence, :func:`truncate_completion`).
    A prompt with no examples returns ``no_examples_policy`` (``False`` by default: escalate).
    """
    prompt = input_record["prompt"]
    entry = input_record.get("entry_point")
    if not entry:
        raise DataError("the python-doctest check needs the record's 'entry_point' (the function's name); "
                        "pass record={'entry_point': ...} with the prompt")
    if not extract_examples(prompt, entry):
        return bool(no_examples_policy)
    completion = output["completion"] if "completion" in output else truncate_completion(output.get("text") or "")[0]
    return check_examples(prompt, entry, completion).passed


#: the answers this check reads end at the function: a routed decoder cascade generates with these stop strings
python_doctest.stop_sequences = STOP_SEQUENCES
