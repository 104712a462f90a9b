"""The head of an analysed model: what happens after the last layer output, and how it pools."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from dyncompile.passes._graph import const_array
from dyncompile.passes.analysis._values import SHAPE_ONLY_OPS, attr_int, node_label
from dyncompile.passes.analysis.structure import HeadInfo

if TYPE_CHECKING:
    from dyncompile.passes.analysis.layers import _Analyzer

__all__ = ["describe_head", "pooling_of"]

#: shape arithmetic reads small constants only (Slice bounds, Gather indices), never a weight
SMALL = 64


def describe_head(a: _Analyzer, order: list[ir.Node], boundary: int, cut: ir.Value | None) -> HeadInfo:
    """What the compute nodes after ``order[boundary]`` (the last layer output ``cut``) do with it.

    Follows the data from ``cut`` in order, skipping shape arithmetic; the first node that reduces the
    sequence axis (see :func:`pooling_of`) decides the pooling.
    """
    nodes = [(i, order[i]) for i in range(boundary + 1, len(order)) if order[i] in a.tainted_nodes]
    names = [node_label(n, i) for i, n in nodes]
    if cut is None:
        return HeadInfo("none", names, "")
    rank = len(cut.shape) if cut.shape is not None else 3
    seq_axis = 1
    pooling = "none"
    parts: list[str] = []
    # follow the data from the cut in order; the first node that reduces the sequence axis decides
    reach: set[ir.Value] = {cut}
    shape_derived: set[ir.Value] = set()
    pooled = False
    for _, node in nodes:
        ins = a.inputs_of[node]
        if not any(v in reach for v in ins):
            continue
        reach.update(node.outputs)
        if (
            node.op_type in SHAPE_ONLY_OPS
            or all(v in shape_derived or v in a.const or v not in a.tainted for v in ins)
            or all(o.dtype is not None and not o.dtype.is_floating_point() for o in node.outputs)
        ):
            shape_derived.update(node.outputs)
            continue  # shape arithmetic on the hidden state, not part of the head's math
        desc = node.op_type
        if not pooled:
            src = next(v for v in ins if v in reach)
            src_rank = len(src.shape) if src.shape is not None else rank
            kind, desc = pooling_of(node, src_rank, seq_axis)
            if kind is not None:
                pooling, pooled = kind, True
        parts.append(desc)
    outs = [o.name for o in a.graph.outputs if o in reach and o is not cut]
    if not parts and not outs and cut.is_graph_output():
        return HeadInfo("none", names, f"none: the last layer output {cut.name!r} is a graph output")
    description = " -> ".join(_compress(parts))
    if outs:
        description = (
            f"{description} -> {', '.join(outs[:3])}{', ...' if len(outs) > 3 else ''}"
            if description
            else ", ".join(outs[:3])
        )
    return HeadInfo(pooling, names, description)


def pooling_of(node: ir.Node, rank: int, seq_axis: int) -> tuple[str | None, str]:
    """``(pooling, description)`` of one node reading a rank-``rank`` tensor.

    ``pooling`` is ``"cls"``, ``"last"``, ``"mean"``, or ``None`` when the node does not reduce ``seq_axis``.
    """
    op = node.op_type
    if op == "GlobalAveragePool":
        return "mean", op
    rules = {"Gather": _gather_pooling, "Slice": _slice_pooling, "ReduceMean": _reduce_pooling,
             "ReduceSum": _reduce_pooling}
    found = rules[op](node, rank, seq_axis) if op in rules and rank >= 3 else None
    return found or (None, op)


def _norm_axis(a: int, rank: int) -> int:
    return a + rank if a < 0 else a


def _gather_pooling(node: ir.Node, rank: int, seq_axis: int) -> tuple[str, str] | None:
    axis = _norm_axis(attr_int(node, "axis", 0) or 0, rank)
    if axis != seq_axis:
        return None
    idx = const_array(node.inputs[1], SMALL)
    if idx is None:
        return "last", f"Gather on axis {axis} (index computed from the inputs)"
    if idx.size != 1:
        return None
    k = int(idx.reshape(-1)[0])
    return ("last" if k == -1 else "cls"), f"Gather index {k} on axis {axis}"


def _slice_pooling(node: ir.Node, rank: int, seq_axis: int) -> tuple[str, str] | None:
    starts = const_array(node.inputs[1], SMALL)
    ends = const_array(node.inputs[2], SMALL)
    axes = const_array(node.inputs[3], SMALL) if len(node.inputs) > 3 else None
    if starts is None or ends is None:
        return None
    axes_l = [_norm_axis(int(a), rank) for a in axes.reshape(-1)] if axes is not None else list(range(starts.size))
    for a, s, e in zip(axes_l, starts.reshape(-1), ends.reshape(-1), strict=False):
        if a != seq_axis:
            continue
        s, e = int(s), int(e)
        if s == 0 and e == 1:
            return "cls", f"Slice [0:1] on axis {a}"
        if s == -1:
            return "last", f"Slice [-1:] on axis {a}"
    return None


def _reduce_pooling(node: ir.Node, rank: int, seq_axis: int) -> tuple[str, str] | None:
    axes = const_array(node.inputs[1], SMALL) if len(node.inputs) > 1 else None
    if axes is None and "axes" in node.attributes:
        axes = np.asarray(node.attributes["axes"].value)
    if axes is not None and seq_axis in [_norm_axis(int(a), rank) for a in axes.reshape(-1)]:
        return "mean", f"{node.op_type} over axis {seq_axis}"
    return None


def _compress(parts: list[str], limit: int = 12) -> list[str]:
    """Collapse runs of the same op (``Mul x3``) and cap the length."""
    out: list[str] = []
    for p in parts:
        if out and (out[-1] == p or out[-1].startswith(p + " x")):
            if out[-1] == p:
                out[-1] = f"{p} x2"
            else:
                n = int(out[-1].rsplit("x", 1)[1]) + 1
                out[-1] = f"{p} x{n}"
        else:
            out.append(p)
    if len(out) > limit:
        out = [*out[: limit // 2], f"... ({len(out) - limit} more)", *out[-(limit // 2) :]]
    return out
