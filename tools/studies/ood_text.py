"""Out-of-domain text found offline, for drift checks: docstrings of the Python standard library.

Not movie reviews, not even reviews: English prose about software. Rows are the first paragraph of
function and class docstrings of the running interpreter's stdlib modules (``ast``, no imports), 5 to 60
words, deduplicated, in a seeded random order.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

__all__ = ["stdlib_docstrings"]


def stdlib_docstrings(n: int = 500, *, seed: int = 0, min_words: int = 5, max_words: int = 60) -> list[str]:
    """``n`` docstring paragraphs from the standard library (fewer if the stdlib has fewer)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            para = " ".join(doc.strip().split("\n\n")[0].split())
            words = len(para.split())
            if min_words <= words <= max_words and para not in seen:
                seen.add(para)
                out.append(para)
    random.Random(seed).shuffle(out)
    return out[:n]
