"""Terminal-safe text for everything the CLI prints from a plan, a model or a user's data."""

from __future__ import annotations

__all__ = ["safe_text"]


def safe_text(text: object, *, keep_newlines: bool = True) -> str:
    """``text`` with control and other non-printable characters escaped (``\\x1b``), so that strings from
    a plan or a model (labels, task, generated text) cannot drive the terminal (escape-sequence injection)."""
    out = []
    for ch in str(text):
        if ch == "\n" and keep_newlines or ch == "\t" or ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii") if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return "".join(out)
