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

The verdict is computed here, never by the code under check: the sandboxed program only reports the values
the calls returned (plain builtin types, as tagged JSON after a per-run nonce); this process parses that one
line strictly and compares with type-checked equality. A missing, repeated or malformed line fails. When the
sandbox cannot run (:attr:`CheckOutcome.unavailable`) there is no verdict and the check returns ``False``:
a cascade escalates. Threat model: SECURITY.md.

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
import math
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


# The program run in the sandbox. It captures what it needs before any code under check runs, executes
# prompt + completion in a namespace of their own, calls each example and writes, after a per-run nonce, one
# JSON line of the *values* (a tagged tree of plain builtin types; never a verdict). The parent parses that line
# strictly and compares with the expected values itself (:func:`_decode`, :func:`_same`): an object whose
# ``__eq__`` is always true has no JSON form, a patched ``json``/``print``/``repr`` only changes what the program
# reports, and reporting the expected values is no more than returning them (hard-coding the examples, which no
# example-based check can tell from a right answer).
_PROGRAM = r"""
import json as _j, os as _o
_S = (type, isinstance, len, str, repr, float.__repr__, int.__repr__, _j.JSONEncoder(allow_nan=False).encode,
      _o.write, BaseException, Exception, list, tuple, set, frozenset, dict, bool, int, float, complex, bytes,
      sorted, eval, exec, compile, bytes.hex)
del _j, _o

def _run(src, calls, nonce, cap, S=_S):
    (T, I, L, STR, R, FR, IR, enc, write, BE, EX, LI, TU, SE, FS, DI, BO, IN, FL, CO, BY,
     SORT, EV, EXE, COMP, HEX) = S

    def tree(v, depth):
        t = T(v)
        if depth > 64:
            raise EX("nested too deep")
        if v is None:
            return ["none"]
        if t is BO:
            return ["bool", v]
        if t is IN:
            return ["int", IR(v)]
        if t is FL:
            return ["float", FR(v)]
        if t is CO:
            return ["complex", FR(v.real), FR(v.imag)]
        if t is STR:
            return ["str", STR.__str__(v)]
        if t is BY:
            return ["bytes", HEX(v)]
        if t is LI or t is TU or t is SE or t is FS:
            return [{LI: "list", TU: "tuple", SE: "set", FS: "frozenset"}[t], [tree(x, depth + 1) for x in v]]
        if t is DI:
            return ["dict", [[tree(k, depth + 1), tree(x, depth + 1)] for k, x in DI.items(v)]]
        raise EX("not a plain value: " + t.__name__)

    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    EXE(COMP(src, "candidate.py", "exec"), ns)
    out = []
    for c in calls:
        try:
            v = EV(c, ns)
        except BE as e:
            out.append(["raised", STR.__str__(T(e).__name__)[:100]])
            continue
        try:
            out.append(["value", tree(v, 0)])
        except BE as e:
            out.append(["unusable", STR.__str__(T(v).__name__)[:100]])
    line = enc(out)
    if L(line) > cap:
        line = enc([["unusable", "too large"] for _ in calls])
    write(1, (nonce + line + "\n").encode())

_run(%(src)r, %(calls)r, %(nonce)r, %(cap)d)
"""

#: the longest result line read back (characters); longer values are reported as unusable
MAX_RESULT_CHARS = 100_000


def build_example_program(prompt: str, completion: str, examples: list[Example], nonce: str) -> str:
    """The program that runs ``prompt + completion``, calls every example and prints their values (one JSON line after ``nonce``)."""
    return _PROGRAM % {"src": prompt + completion + "\n", "calls": tuple(e.call for e in examples), "nonce": nonce,
                       "cap": MAX_RESULT_CHARS}


_ATOMS: dict[str, tuple[type, ...]] = {"bool": (bool,), "str": (str,)}


def _decode(node: Any, depth: int = 0) -> Any:
    """A value from its tagged JSON tree; raises ``ValueError`` on anything but the exact shapes ``_PROGRAM`` writes."""
    if depth > 64 or type(node) is not list or not node or type(node[0]) is not str:
        raise ValueError("malformed value")
    tag, args = node[0], node[1:]
    if tag == "none" and not args:
        return None
    if len(args) == 1 and tag in _ATOMS:
        if type(args[0]) not in _ATOMS[tag]:
            raise ValueError(f"malformed {tag}")
        return args[0]
    if len(args) == 1 and type(args[0]) is str and tag in ("int", "float", "bytes"):
        conv = {"int": int, "float": float, "bytes": bytes.fromhex}[tag]
        if tag == "int" and len(args[0]) > 4300:
            raise ValueError("int too long")
        return conv(args[0])
    if tag == "complex" and len(args) == 2 and all(type(a) is str for a in args):
        return complex(float(args[0]), float(args[1]))
    if len(args) == 1 and type(args[0]) is list and tag in ("list", "tuple", "set", "frozenset"):
        items = [_decode(x, depth + 1) for x in args[0]]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict" and len(args) == 1 and type(args[0]) is list:
        pairs = args[0]
        if not all(type(p) is list and len(p) == 2 for p in pairs):
            raise ValueError("malformed dict")
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in pairs}
    raise ValueError(f"malformed value (tag {tag!r})")


def _same(got: Any, want: Any) -> bool:
    """Type-checked equality of two plain values: numbers (bool apart) with a float tolerance, containers of the same type."""
    num = (int, float)
    if type(got) in num and type(want) in num and (type(got) is float or type(want) is float):
        return math.isclose(float(got), float(want), rel_tol=1e-6, abs_tol=1e-9)
    if type(got) is not type(want):
        return False
    if type(got) in (list, tuple):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    if type(got) is dict:
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in got)
    return bool(got == want)  # plain builtins only (rebuilt here, in this process)


def _judge(entry: Any, ex: Example) -> list[Any]:
    """``[ok, description]`` for one example's reported ``entry``; raises ``ValueError`` when malformed."""
    if type(entry) is not list or not entry or type(entry[0]) is not str:
        raise ValueError("malformed entry")
    kind = entry[0]
    if kind in ("raised", "unusable") and len(entry) == 2 and type(entry[1]) is str:
        return [False, ("raised " if kind == "raised" else "not a plain value: ") + entry[1][:200]]
    if kind != "value" or len(entry) != 2:
        raise ValueError("malformed entry")
    got = _decode(entry[1])
    if ex.literal:
        ok = _same(got, ast.literal_eval(ex.expected))
    else:
        ok = repr(got) == ex.expected or (type(got) is str and got == ex.expected)
    return [bool(ok), repr(got)[:200]]


def _read_results(stdout: str, nonce: str, exs: list[Example]) -> tuple[list[list[Any]], str]:
    """The per-example ``[ok, description]`` from the program's output, or ``([], why)`` if there is no valid one."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(nonce)]
    if len(lines) != 1:
        return [], f"{len(lines)} result lines (want exactly 1)"
    body = lines[0][len(nonce):]
    if len(body) > MAX_RESULT_CHARS + 100:
        return [], "result line too long"
    try:
        entries = json.loads(body, parse_constant=_reject_constant)
        if type(entries) is not list or len(entries) != len(exs):
            raise ValueError("wrong number of results")
        return [_judge(en, ex) for en, ex in zip(entries, exs)], ""
    except (ValueError, TypeError, RecursionError, MemoryError, SyntaxError, OverflowError) as e:
        return [], f"malformed result line: {str(e)[:200]}"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a result line")


@dataclasses.dataclass
class CheckOutcome:
    """Result of checking one completion against its prompt's examples.

    ``unavailable`` is non-empty when the sandbox could not run the code (it was not run at all): the check
    has no verdict (:attr:`verdict` is ``None``) and ``passed`` is ``False``, so a cascade escalates.
    """

    passed: bool
    n_examples: int
    n_passed: int
    per_example: list[list[Any]]
    seconds: float
    returncode: int | None
    timed_out: bool
    error: str = ""
    unavailable: str = ""

    @property
    def verdict(self) -> bool | None:
        """``passed``, or ``None`` when the code could not be run isolated (no verdict)."""
        return None if self.unavailable else self.passed

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict."""
        return dataclasses.asdict(self)


DEFAULT_LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=10, memory_mb=1024, max_output_chars=MAX_RESULT_CHARS + 20_000)


def check_examples(prompt: str, entry_point: str, completion: str, *, limits: SandboxLimits | None = None,
                   examples: list[Example] | None = None) -> CheckOutcome:
    """Run ``prompt + completion`` against the prompt's own examples in the sandbox; the verdict is computed here."""
    t0 = time.perf_counter()
    exs = extract_examples(prompt, entry_point) if examples is None else examples
    if not exs:
        return CheckOutcome(False, 0, 0, [], time.perf_counter() - t0, None, False, "no examples in the prompt")
    nonce = "@@dyncompile-check-" + secrets.token_hex(8) + "@@"
    res: SandboxResult = run_python(build_example_program(prompt, completion, exs, nonce), limits or DEFAULT_LIMITS)
    if res.unavailable:
        return CheckOutcome(False, len(exs), 0, [], time.perf_counter() - t0, None, False,
                            "no verdict: the sandbox is unavailable", unavailable=res.unavailable)
    per, why = _read_results(res.stdout, nonce, exs)
    n_passed = sum(1 for ok, _ in per if ok)
    passed = bool(per) and n_passed == len(exs) and res.ok
    err = ""
    if not per:
        err = ("timed out" if res.timed_out else why + f"; exit {res.returncode}: " + res.stderr.strip()[-300:])
    elif res.oom_kills:
        err = "hit the memory limit"
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
    outcome = check_examples(prompt, entry, completion)
    if outcome.unavailable:  # no verdict: never keep an answer nothing vouched for
        logger.warning("python-doctest: no verdict, escalating (%s)", outcome.unavailable)
    return outcome.passed


#: the answers this check reads end at the function: a routed decoder cascade generates with these stop strings
python_doctest.stop_sequences = STOP_SEQUENCES
