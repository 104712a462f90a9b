"""Builders for early-exit graph pieces (exit heads, exit conditions) with an onnx-ir Tape.

Shared by :mod:`dyncompile.passes.early_exit.attach_exit_heads` (attaches heads) and
:mod:`dyncompile.passes.early_exit.insert_early_exit` (builds the conditions of the If lowering). The math is
exactly the numpy one: heads as :mod:`dyncompile.passes.early_exit.heads` (pooling, dense stack), the exit test
as :mod:`dyncompile.runtime.rules.exit_rule` (criteria); ``tests/test_exit_rule.py`` checks that both give the same
decisions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from dyncompile.passes.early_exit.heads import ATTN_MASK_BIAS, ExitHead

__all__ = ["NEVER_THRESHOLD", "GraphBuilder", "MaskParts", "margin_threshold"]

#: Thresholds that can never fire, per criterion (entropy >= 0; probabilities <= 1).
NEVER_THRESHOLD = {"entropy": -1.0, "maxprob": 2.0, "patience": 2.0, "learned": float("inf")}


@dataclasses.dataclass(frozen=True)
class MaskParts:
    """Mask-derived ``[B, 1, S]`` rows every exit head of a graph reads (:meth:`GraphBuilder.mask_parts`)."""

    mean_weights: ir.Value | None  # mask / max(number of tokens, 1)
    attn_bias: ir.Value | None  # 0 for kept tokens, ATTN_MASK_BIAS for padding


def _binary_entropy(d: float) -> float:
    """Entropy (nats) of ``softmax([d, 0])``, ``d >= 0``: ``p softplus(-d) + (1 - p) softplus(d)``, ``p = sigmoid(d)``."""
    p = 1.0 / (1.0 + math.exp(-d))
    return p * math.log1p(math.exp(-d)) + (1.0 - p) * (d + math.log1p(math.exp(-d)))


def margin_threshold(criterion: str, threshold: float) -> float:
    """The logit margin ``m``: two-class ``|l0 - l1| > m`` exactly when ``entropy < threshold`` (``maxprob > threshold``).

    ``-1`` where every row fires, ``inf`` where none does (``NEVER_THRESHOLD``).
    """
    t = float(threshold)
    if criterion == "maxprob":
        if t < 0.5:
            return -1.0
        return math.inf if t >= 1.0 else math.log(t / (1.0 - t))
    if criterion != "entropy":
        raise ValueError(f"no margin form for criterion {criterion!r} (entropy, maxprob)")
    if t > math.log(2.0):
        return -1.0
    if t <= 0.0:
        return math.inf
    lo, hi = 0.0, 1.0
    while _binary_entropy(hi) >= t:  # entropy falls with the margin: bracket the crossing
        hi *= 2.0
        if hi > 1e4:  # below float64's entropy resolution: no float32 logits get there
            return math.inf
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _binary_entropy(mid) >= t else (lo, mid)
    return hi


class GraphBuilder:
    """A Tape plus initializer bookkeeping, aware of the model's default opset (Reduce* axes form)."""

    def __init__(self, opset: int, prefix: str) -> None:
        self.tape = ir.tape.Tape()
        self.opset = opset
        self.prefix = prefix
        self.initializers: list[ir.Value] = []

    def const(self, arr, name: str) -> ir.Value:
        """A new initializer ``<prefix><name>`` holding ``arr``."""
        full = f"{self.prefix}{name}"
        v = ir.val(full, const_value=ir.tensor(np.asarray(arr), name=full))
        self.initializers.append(v)
        return v

    def op(self, op_type: str, inputs: Sequence[ir.Value | None], attributes=None) -> ir.Value:
        """Record one node on the tape; its output."""
        return self.tape.op(op_type, list(inputs), attributes or {})

    def reduce(self, op_type: str, x: ir.Value, axes: list[int], keepdims: int, tag: str) -> ir.Value:
        """A Reduce op with ``axes`` as an input or an attribute, as the opset wants."""
        input_axes = op_type == "ReduceSum" and self.opset >= 13 or self.opset >= 18
        if input_axes:
            return self.op(op_type, [x, self.const(np.array(axes, np.int64), f"axes_{tag}")], {"keepdims": keepdims})
        return self.op(op_type, [x], {"axes": axes, "keepdims": keepdims})

    # --- exit head ---------------------------------------------------------------------------

    def mask_parts(self, attention_mask: ir.Value | None, poolings: Sequence[str]) -> MaskParts | None:
        """The mask-derived values the heads of one graph share, built once (``None`` without a mask).

        ``[B, 1, S]`` rows: ``mean_weights`` = mask / max(tokens, 1) (for ``mean`` pooling) and ``attn_bias``
        = 0 for a kept token, :data:`ATTN_MASK_BIAS` for padding (for ``attn`` pooling); only those some head
        in ``poolings`` reads. Computed per head they cost 7 small kernels each, a quarter of a head's time.
        """
        if attention_mask is None:
            return None
        m = self.op("Cast", [attention_mask], {"to": ir.DataType.FLOAT})
        m = self.op("Unsqueeze", [m, self.const(np.array([1], np.int64), "row_axes")])  # [B, 1, S]
        mean_w = bias = None
        if any("mean" in p for p in poolings):
            n = self.reduce("ReduceSum", m, [-1], 1, "tokens")
            n = self.op("Max", [n, self.const(np.array(1.0, np.float32), "one")])
            mean_w = self.op("Div", [m, n])
        if any("attn" in p for p in poolings):
            bias = self.op("Mul", [self.op("Sub", [m, self.const(np.float32(1.0), "attn_one")]),
                                   self.const(np.float32(-ATTN_MASK_BIAS), "attn_big")])
        return MaskParts(mean_w, bias)

    def pool(self, hidden: ir.Value, mask: MaskParts | None, pooling: str, query: np.ndarray | None = None) -> ir.Value:
        """Pool ``hidden`` ``[B, S, H]`` to ``[B, F]`` the way the exit head was fitted.

        ``cls``, ``mean``, ``cls+mean``, or ``cls+mean+attn`` with the attention ``query`` ``[H]`` (as
        :func:`~dyncompile.passes.early_exit.heads.pool_features`). The token-weighted poolings are one
        ``MatMul`` of their ``[B, k, S]`` weight rows with the states (the masked mean's row from ``mask``;
        the attention row a ``Softmax`` over the tokens), not ``Mul`` + ``ReduceSum`` over the token axis.
        """
        # features in the order cls, mean, attn; the token-weighted ones (weight rows) always come after the
        # [B, H] ones (cls; the unmasked mean), so they pool together as the last part
        parts: list[ir.Value] = []  # [B, H] each
        rows: list[ir.Value] = []  # [B, 1, S] each
        if pooling in ("cls", "cls+mean", "cls+mean+attn"):
            parts.append(self.op("Gather", [hidden, self.const(np.array(0, np.int64), "cls_index")], {"axis": 1}))
        if pooling in ("mean", "cls+mean", "cls+mean+attn"):
            if mask is None or mask.mean_weights is None:
                parts.append(self.reduce("ReduceMean", hidden, [1], 0, "mean"))
            else:
                rows.append(mask.mean_weights)
        if pooling == "cls+mean+attn":
            q = np.asarray(query, np.float32).reshape(-1, 1)
            scores = self.op("MatMul", [hidden, self.const(q, "attn_query")])  # [B, S, 1]
            scores = self.op("Reshape", [scores, self.const(np.array([0, 1, -1], np.int64), "attn_row")])  # [B, 1, S]
            if mask is not None and mask.attn_bias is not None:
                scores = self.op("Add", [scores, mask.attn_bias])
            rows.append(self.op("Softmax", [scores], {"axis": -1}))
        if rows:
            w = rows[0] if len(rows) == 1 else self.op("Concat", rows, {"axis": 1})  # [B, k, S]
            pooled = self.op("MatMul", [w, hidden])  # [B, k, H]
            parts.append(self.op("Reshape", [pooled, self.const(np.array([0, -1], np.int64), "flat")]))  # [B, k*H]
        return parts[0] if len(parts) == 1 else self.op("Concat", parts, {"axis": -1})

    def head(self, head: ExitHead, hidden: ir.Value, mask: MaskParts | None) -> ir.Value:
        """Logits ``[B, C]`` of ``head`` on layer states ``hidden`` ``[B, S, H]`` (``mask``: :meth:`mask_parts`)."""
        x = self.pool(hidden, mask, head.pooling, head.attn_query)
        for i, (w, b, act) in enumerate(head.layers):
            x = self.op("Add", [self.op("MatMul", [x, self.const(w, f"W{i}")]), self.const(b, f"b{i}")])
            if act == "tanh":
                x = self.op("Tanh", [x])
            elif act == "relu":
                x = self.op("Relu", [x])
            elif act == "gelu":
                erf = self.op("Erf", [self.op("Div", [x, self.const(np.float32(math.sqrt(2.0)), f"sqrt2_{i}")])])
                one = self.const(np.float32(1.0), f"one_{i}")
                half = self.const(np.float32(0.5), f"half_{i}")
                x = self.op("Mul", [self.op("Mul", [x, half]), self.op("Add", [erf, one])])
        return x

    # --- exit condition ------------------------------------------------------------------------

    def fires(
        self,
        logits: ir.Value,
        criterion: str,
        threshold: float,
        window: Sequence[ir.Value] = (),
    ) -> ir.Value:
        """Per-row bool ``[B]``: does this exit's test fire (:func:`dyncompile.runtime.rules.exit_rule.exit_fires`)."""
        thr = self.const(np.array(threshold, np.float32), "threshold")
        if criterion == "entropy":
            return self.op("Less", [self.op("Neg", [self._neg_entropy(logits)]), thr])
        fires = self.op("Greater", [self._maxprob(logits), thr])
        if criterion == "patience":
            preds = [self.op("ArgMax", [w], {"axis": -1, "keepdims": 0}) for w in window]
            for p in preds[:-1]:
                fires = self.op("And", [fires, self.op("Equal", [p, preds[-1]])])
        return fires

    def all_fire(
        self,
        logits: ir.Value,
        criterion: str,
        threshold: float,
        window: Sequence[ir.Value] = (),
    ) -> ir.Value:
        """Scalar bool: :meth:`fires` holds for every row (the If lowering's condition).

        ``entropy`` and ``maxprob`` compare the batch's worst row once: ``min(-entropy) > -threshold`` (the
        same float comparison as ``entropy < threshold``, negation is exact) and ``min(maxprob) >
        threshold``, four kernels fewer than a per-row test cast and reduced; other criteria use
        :meth:`all_rows` of :meth:`fires`.
        """
        if criterion in ("entropy", "maxprob"):
            score, limit = (self._neg_entropy(logits), -threshold) if criterion == "entropy" else (
                self._maxprob(logits), threshold)
            worst = self.reduce("ReduceMin", score, [0], 0, "all")
            return self.op("Greater", [worst, self.const(np.array(limit, np.float32), "threshold")])
        return self.all_rows(self.fires(logits, criterion, threshold, window))

    def all_margins_exceed(self, x: ir.Value, w: np.ndarray, b: np.ndarray, criterion: str, threshold: float
                           ) -> ir.Value:
        """Scalar bool: :meth:`all_fire` of two-class logits ``x @ w + b`` computed from their difference alone.

        With two classes, entropy and top probability are functions of ``|l0 - l1|`` only (decreasing and
        increasing), so ``entropy < t`` is ``|d| > margin_threshold("entropy", t)`` with ``d = x @ (w0 - w1) + (b0 -
        b1)``: one ``[H, 1]`` product, ``Abs``, the batch's ``ReduceMin`` and a comparison, instead of the logits'
        product, ``LogSoftmax``, ``Exp``, ``Mul`` and ``ReduceSum``; the logits themselves are only needed where the
        exit is taken.
        """
        w, b = np.asarray(w, np.float64), np.asarray(b, np.float64).reshape(-1)
        wd = (w[:, :1] - w[:, 1:2]).astype(np.float32)  # [H, 1]
        d = self.op("Add", [self.op("MatMul", [x, self.const(wd, "margin_w")]),
                            self.const(np.array([b[0] - b[1]], np.float32), "margin_b")])
        worst = self.op("ReduceMin", [self.op("Abs", [d])], {"keepdims": 0})  # over every axis: a scalar
        limit = margin_threshold(criterion, threshold)
        return self.op("Greater", [worst, self.const(np.array(limit, np.float32), "margin")])

    def _neg_entropy(self, logits: ir.Value) -> ir.Value:
        """Per-row ``sum p log p`` ``[B]`` (minus the entropy) of ``logits``."""
        logp = self.op("LogSoftmax", [logits], {"axis": -1})
        return self.reduce("ReduceSum", self.op("Mul", [self.op("Exp", [logp]), logp]), [-1], 0, "ent")

    def _maxprob(self, logits: ir.Value) -> ir.Value:
        """Per-row top softmax probability ``[B]`` of ``logits``."""
        return self.reduce("ReduceMax", self.op("Softmax", [logits], {"axis": -1}), [-1], 0, "maxp")

    def all_rows(self, fires: ir.Value) -> ir.Value:
        """Scalar bool: every row fires (the If lowering exits only when the whole batch may)."""
        f = self.op("Cast", [fires], {"to": ir.DataType.FLOAT})
        low = self.reduce("ReduceMin", f, [0], 0, "all")
        return self.op("Greater", [low, self.const(np.array(0.5, np.float32), "half_all")])

    # --- learned exit policy ---------------------------------------------------------------------

    def learned_score(
        self, logits: ir.Value, prev_logits: ir.Value | None, weights: Sequence[float], bias: float
    ) -> ir.Value:
        """Per-row float ``[B]``: the learned policy's score of this exit (``dyncompile.runtime.rules.exit_policy``).

        Features ``[maxprob, margin, entropy, agree_prev, moved, prev_maxprob]`` from this head's logits and
        the previous exit's (``None`` for the first exit: the head itself), then ``features @ w + b``.

        Lowered as one feature row per input row and one ``MatMul``, the weights folded so that no feature
        needs its own kernel: ``[top1, top2, sum p log p, sum |p - q|, agree, max q] @ [w_max + w_margin,
        -w_margin, -w_entropy, w_moved, w_agree, w_prev] + b`` (margin = top1 - top2, entropy = -sum p log p).
        The first exit has ``q = p``: moved is 0, agree 1 (folded into the bias) and max q = top1, leaving
        ``[top1, top2, sum p log p]`` (8 kernels; 17 with a previous exit).
        """
        w_max, w_margin, w_ent, w_agree, w_moved, w_prev = (float(v) for v in weights)
        p = self.op("Softmax", [logits], {"axis": -1})
        top, _ = self.tape.op_multi_out(
            "TopK", [p, self.const(np.array([2], np.int64), "k2")], {"axis": -1, "largest": 1, "sorted": 1}, num_outputs=2
        )
        plogp = self.reduce("ReduceSum", self.op("Mul", [p, self.op("LogSoftmax", [logits], {"axis": -1})]), [-1], 1,
                            "pol_ent")
        if prev_logits is None:
            feats, w, b = [top, plogp], [w_max + w_margin + w_prev, -w_margin, -w_ent], bias + w_agree
        else:
            q = self.op("Softmax", [prev_logits], {"axis": -1})
            moved = self.reduce("ReduceSum", self.op("Abs", [self.op("Sub", [p, q])]), [-1], 1, "pol_moved")
            same = self.op("Equal", [self.op("ArgMax", [p], {"axis": -1, "keepdims": 1}),
                                     self.op("ArgMax", [q], {"axis": -1, "keepdims": 1})])
            agree = self.op("Cast", [same], {"to": ir.DataType.FLOAT})
            prev_max = self.reduce("ReduceMax", q, [-1], 1, "pol_prevmax")
            feats, w, b = [top, plogp, moved, agree, prev_max], [w_max + w_margin, -w_margin, -w_ent, w_moved, w_agree,
                                                                  w_prev], bias
        x = self.op("Concat", feats, {"axis": -1})
        score = self.op("MatMul", [x, self.const(np.asarray(w, np.float32), "pol_w")])
        return self.op("Add", [score, self.const(np.float32(b), "pol_b")])

    def learned_fires(
        self, logits: ir.Value, prev_logits: ir.Value | None, weights: Sequence[float], bias: float, threshold: float
    ) -> ir.Value:
        """Per-row bool ``[B]``: learned score ``> threshold``."""
        score = self.learned_score(logits, prev_logits, weights, bias)
        return self.op("Greater", [score, self.const(np.array(threshold, np.float32), "threshold")])
