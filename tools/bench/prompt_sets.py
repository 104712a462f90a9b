"""Prompt sets for the speculative-decoding benchmark, from real text available offline (Python's stdlib).

``python -m dyncompile.tools.bench.prompt_sets --out DIR`` writes

* ``code.jsonl`` — code completion: a Python standard-library file cut after a function's signature and
  docstring (no chat template);
* ``grounded.jsonl`` — a passage or function given in the prompt, then asked to be repeated, corrected,
  edited or mined (chat template on): the case prompt lookup is made for;
* ``all.jsonl`` — both.

``--split calib`` writes ``calib-code.jsonl`` / ``calib-grounded.jsonl`` instead, the same kinds of prompt from
other standard-library files (:data:`CALIB_CODE_FILES`, :data:`CALIB_DOC_FILES`, disjoint from the report files):
tune a draft policy there, report on the default split.

:func:`read_prompts` reads such a file (``prompt`` or ``text``; optional ``chat``, ``kind``, ``id``,
``max_new_tokens``) for ``dyncompile bench generate|peers PLAN --prompts FILE``.
"""

from __future__ import annotations

import argparse
import json
import re
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError

__all__ = ["build_prompt_sets", "main", "read_prompts"]

STDLIB = Path(sysconfig.get_paths()["stdlib"])
#: files whose functions become code-completion prompts (calibrate split drafters on *other* files)
CODE_FILES = ("bisect.py", "heapq.py", "textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py", "base64.py",
              "csv.py", "calendar.py", "statistics.py", "difflib.py", "ipaddress.py")
GROUNDED_DOC_FILES = ("json/__init__.py", "argparse.py", "textwrap.py", "string.py", "heapq.py", "csv.py",
                      "shlex.py", "difflib.py", "calendar.py", "fractions.py")
#: the calibration split's files (``--split calib``): none is a report-split file
CALIB_CODE_FILES = ("shutil.py", "pickle.py", "locale.py", "trace.py", "mimetypes.py", "plistlib.py", "codecs.py",
                    "hmac.py", "optparse.py", "smtplib.py", "cmd.py", "uuid.py")
CALIB_DOC_FILES = ("tempfile.py", "optparse.py", "configparser.py", "smtplib.py", "ast.py", "inspect.py", "copy.py",
                   "timeit.py", "uuid.py", "cmd.py")


def _functions(src: str) -> list[tuple[int, int, str]]:
    """(start, end of docstring line, name) of top-level/method defs with a docstring."""
    out = []
    for m in re.finditer(r"^( *)def (\w+)\(.*?\):\n(\1    )(\"\"\"|''')", src, re.M | re.S):
        start = m.start()
        q = m.group(4)
        close = src.find(q, m.end())
        if close < 0:
            continue
        line_end = src.find("\n", close) + 1
        if 0 < line_end - start < 1200:
            out.append((start, line_end, m.group(2)))
    return out


def _function_source(src: str, start: int, max_lines: int = 40) -> str | None:
    """The whole def starting at ``start`` (up to the next line indented no deeper), or None if longer."""
    lines = src[start:].split("\n")
    indent = len(lines[0]) - len(lines[0].lstrip())
    out = [lines[0]]
    for line in lines[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        out.append(line)
        if len(out) > max_lines:
            return None
    text = "\n".join(out).rstrip()
    return "\n".join(line[indent:] for line in text.split("\n"))


def _code_prompts(n: int, context_chars: int = 1500, files=CODE_FILES) -> list[dict[str, Any]]:
    rows = []
    for fname in files:
        path = STDLIB / fname
        if not path.is_file():
            continue
        src = path.read_text(encoding="utf-8")
        funcs = [f for f in _functions(src) if f[0] > context_chars]
        if not funcs:
            continue
        start, end, name = funcs[len(funcs) // 2]
        begin = src.rfind("\n", 0, start - context_chars) + 1
        rows.append({"id": f"code:{fname}:{name}", "kind": "code", "chat": False, "prompt": src[begin:end]})
        if len(rows) >= n:
            break
    return rows


def _typos(text: str, rng: np.random.Generator, every: int = 9) -> str:
    words = text.split(" ")
    for i in range(3, len(words), every):
        w = words[i]
        if len(w) > 4 and w.isalpha():
            j = int(rng.integers(1, len(w) - 2))
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def _grounded_prompts(n: int, doc_files=GROUNDED_DOC_FILES, code_files=CODE_FILES) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows = []
    docs = []
    for fname in doc_files:
        path = STDLIB / fname
        if not path.is_file():
            continue
        src = path.read_text(encoding="utf-8")
        m = re.search(r'^(?:r?"""|\'\'\')(.*?)(?:"""|\'\'\')', src, re.S | re.M)
        if m and len(m.group(1).strip()) > 300:
            docs.append((fname, m.group(1).strip()[:700]))
    funcs = []
    for fname in code_files[::-1]:
        path = STDLIB / fname
        if path.is_file():
            src = path.read_text(encoding="utf-8")
            for s, _, name in _functions(src):
                body = _function_source(src, s)
                if body is not None:
                    funcs.append((fname, name, body))
                    break
    tasks = []
    for i, (fname, doc) in enumerate(docs):
        if i % 2 == 0:
            tasks.append((f"repeat:{fname}", f"Repeat the following text exactly.\n\n{doc}"))
        else:
            tasks.append((f"typos:{fname}", "Correct the spelling mistakes in the following text and write out the "
                          f"corrected text in full.\n\n{_typos(doc, rng)}"))
    for i, (fname, name, body) in enumerate(funcs):
        if i % 2 == 0:
            tasks.append((f"hints:{fname}:{name}", "Rewrite the following Python function, adding type hints. Keep "
                          f"everything else exactly the same.\n\n```python\n{body}\n```"))
        else:
            tasks.append((f"rename:{fname}:{name}", f"Rewrite the following Python function, renaming `{name}` to "
                          f"`{name}_v2`. Keep everything else exactly the same.\n\n```python\n{body}\n```"))
    order = [t for pair in zip(tasks[: len(docs)], tasks[len(docs) :]) for t in pair] + tasks[2 * min(len(docs), len(funcs)) :]
    for tid, prompt in order[:n]:
        rows.append({"id": tid, "kind": "grounded", "chat": True, "prompt": prompt})
    return rows


def build_prompt_sets(out_dir: str | Path, n_code: int = 8, n_grounded: int = 8, split: str = "report") -> dict[str, Path]:
    """Write ``code.jsonl`` and ``grounded.jsonl`` (and ``all.jsonl``) into ``out_dir``; ``split="calib"``:
    ``calib-code.jsonl`` / ``calib-grounded.jsonl`` from the calibration files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if split == "calib":
        sets = {"calib-code": _code_prompts(n_code, files=CALIB_CODE_FILES),
                "calib-grounded": _grounded_prompts(n_grounded, CALIB_DOC_FILES, CALIB_CODE_FILES)}
    elif split == "report":
        sets = {"code": _code_prompts(n_code), "grounded": _grounded_prompts(n_grounded)}
        sets["all"] = sets["code"] + sets["grounded"]
    else:
        raise DataError(f"split must be 'report' or 'calib', got {split!r}")
    paths = {}
    for name, rows in sets.items():
        p = out / f"{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        paths[name] = p
    return paths


def read_prompts(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The prompts of a JSONL file (``prompt`` or ``text``; optional ``chat``, ``kind``, ``id``, ``max_new_tokens``)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"prompts file not found: {p} (make one with `python -m dyncompile.tools.bench.prompt_sets --out DIR`)")
    rows = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
        text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{p}:{lineno}: each line needs a non-empty string field 'prompt' (or 'text')")
        rows.append({"id": row.get("id", f"{p.stem}:{lineno}"), "kind": row.get("kind", p.stem),
                     "chat": bool(row.get("chat", False)), "prompt": text, "max_new_tokens": row.get("max_new_tokens")})
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise DataError(f"{p} holds no prompts")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dyncompile.tools.bench.prompt_sets",
                                description="Write code.jsonl / grounded.jsonl / all.jsonl prompt sets.")
    p.add_argument("--out", required=True)
    p.add_argument("--code", type=int, default=8)
    p.add_argument("--grounded", type=int, default=8)
    p.add_argument("--split", choices=("report", "calib"), default="report",
                   help="report: the benchmark sets; calib: the same kinds from other files, for tuning")
    args = p.parse_args(argv)
    for name, path in build_prompt_sets(args.out, args.code, args.grounded, args.split).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
