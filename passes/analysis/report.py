"""The human-readable structure report printed by ``dyncompile inspect``."""

from __future__ import annotations

import re
from collections.abc import Sequence

from dyncompile.passes.analysis.structure import ModelStructure

__all__ = ["format_report"]


def _fmt_shape(shape: Sequence[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _group_io(entries: Sequence[tuple[str, str, Sequence[int | str]]], limit: int = 12) -> list[str]:
    """One line per input/output; names that differ only by numbers with the same type are grouped."""
    groups: dict[tuple, list[str]] = {}
    for name, dtype, shape in entries:
        key = (re.sub(r"\d+", "#", name), dtype, tuple(str(d) for d in shape))
        groups.setdefault(key, []).append(name)
    lines = []
    for (_, dtype, _), names in groups.items():
        shape = next(e[2] for e in entries if e[0] == names[0])
        label = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} tensors)"
        lines.append(f"{label}: {dtype} {_fmt_shape(shape)}")
    if len(lines) > limit:
        lines = [*lines[:limit], f"... and {len(lines) - limit} more"]
    return lines


def _fmt_count(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 1_000:
        return f"{n / 1e3:.1f}k"
    return str(n)


def format_report(s: ModelStructure, *, top_ops: int = 12, max_layers: int = 64) -> str:
    """A human-readable structure report (for ``dyncompile inspect``)."""
    lines: list[str] = []
    lines.append(f"Nodes: {s.num_nodes}    parameters: {s.param_count:,} ({_fmt_count(s.param_count)})")
    for title, entries in (("Inputs", s.inputs), ("Outputs", s.outputs)):
        lines.append(f"{title} ({len(entries)}):")
        lines.extend(f"  {text}" for text in _group_io(entries))
    ops = list(s.op_histogram.items())
    top = ", ".join(f"{op} {n}" for op, n in ops[:top_ops])
    rest = sum(n for _, n in ops[top_ops:])
    lines.append(
        f"Op histogram (top {min(top_ops, len(ops))} of {len(ops)} op types): {top}"
        + (f", other {rest}" if rest else "")
    )
    lines.append(f"Family guess: {s.family} ({s.family_reason})")
    lines.append(f"Task guess: {s.task}")
    if not s.has_layers:
        lines.append("Layers: none found (" + s.message + ")")
        if s.candidate_cuts:
            lines.append(
                f"  cut tensors found: {len(s.candidate_cuts)} ({', '.join(s.candidate_cuts[:8])}{', ...' if len(s.candidate_cuts) > 8 else ''})"
            )
        return "\n".join(lines)
    lines.append(f"Layers: {s.num_layers} found ({s.message})")
    if s.embedding_nodes:
        lines.append(
            f"  embeddings: {len(s.embedding_nodes)} compute nodes ({s.embedding_nodes[0]} .. {s.embedding_nodes[-1]})"
        )
    for layer in s.layers[:max_layers]:
        inner = f", inner cuts {', '.join(layer.inner_cuts)}" if layer.inner_cuts else ""
        lines.append(
            f"  layer {layer.index:>3}: {layer.num_nodes} nodes, {_fmt_count(layer.param_count)} params,"
            f" {layer.first_node} .. {layer.last_node}{inner}"
        )
    if len(s.layers) > max_layers:
        lines.append(f"  ... {len(s.layers) - max_layers} more layers")
    lines.append(f"Cut tensors (after layer k; 0 = after embeddings): {len(s.cuts)}")
    for cut in s.cuts:
        lines.append(f"  after layer {cut.after_layer:>3}: {cut.name}  {cut.dtype} {_fmt_shape(cut.shape)}")
    lines.append(f"Head: pooling={s.head.pooling}; {len(s.head.nodes)} compute nodes: {s.head.description}")
    return "\n".join(lines)
