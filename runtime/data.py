"""Reading the JSONL data files (sentiment splits, calibration sets, prompts) with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

from dyncompile.errors import DataError

__all__ = ["read_jsonl", "texts_and_labels"]


def read_jsonl(path: str | Path, *, limit: int | None = None, text_field: str = "text") -> list[dict]:
    """Rows of a JSONL file; each must be an object with a string ``text_field``."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file not found: {p}")
    rows = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg}); expected one JSON object per line") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise DataError(f"{p}:{lineno}: each line needs a string field {text_field!r}; got {str(row)[:80]}")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise DataError(f"{p} holds no rows; expected JSONL with a {text_field!r} field per line")
    return rows


def texts_and_labels(rows: list[dict], labels: list[str] | None = None):
    """``(texts, labels or None)``; labels may be ints or label names (mapped through ``labels``)."""
    texts = [r["text"] for r in rows]
    if not all("label" in r for r in rows):
        return texts, None
    out = []
    for r in rows:
        lab = r["label"]
        if isinstance(lab, str) and labels and lab in labels:
            lab = labels.index(lab)
        try:
            out.append(int(lab))
        except (TypeError, ValueError):
            raise DataError(f"label {lab!r} is neither a class index nor one of {labels}") from None
    return texts, out
