"""``smooth-activations``: SmoothQuant-style per-channel scaling of LayerNorm → MatMul groups (exact in float).

int8 activations are quantized per tensor: one scale for a ``[tokens, C]`` activation, set by its largest value.
BERT-class encoders carry a few outlier channels after each LayerNorm (values tens of times the rest), so most
channels get only a few of the 255 int8 levels. SmoothQuant (Xiao et al., 2023) moves that range into the
weights: for ``Y = X W`` and per-channel scales ``s_j``, ``Y = (X / s) (diag(s) W)``. With
``s_j = max|X_j|^α / max_k |W_jk|^(1−α)`` the activation's channels become even and the weight rows absorb the
difference (weights are quantized per output channel, a row scale costs them little).

This pass applies that where it is free: ``X`` is a ``LayerNormalization`` output, so ``X / s`` is the
LayerNorm with ``γ / s`` and ``β / s``; every constant-weight MatMul reading it gets ``W`` with row ``j``
multiplied by ``s_j``. The LayerNorm's other readers (the residual ``Add`` of a post-LN encoder, a graph output,
an exit head's cut) read ``Mul(X / s, s)``, which holds the original tensor *and its name* — exact in float up to
round-off. ``max|X_j|`` comes from calibration feeds (run on the fp32 graph); ``α = 0.5`` is the paper's default.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from dyncompile.passes import _keys
from dyncompile.passes._infra import not_fired, register_pass
from dyncompile.runtime.providers import calibration_session

logger = logging.getLogger(__name__)

__all__ = ["SmoothActivationsPass", "channel_absmax", "channel_ranges", "smoothing_groups"]

#: scales are kept in this range: a dead channel (max 0) gets scale 1
_SCALE_RANGE = (1e-4, 1e4)


def _const_1d(v: ir.Value | None, c: int) -> bool:
    return (v is not None and v.const_value is not None and v.const_value.dtype == ir.DataType.FLOAT
            and tuple(v.const_value.shape) == (c,))


def smoothing_groups(model: ir.Model) -> tuple[list[tuple[ir.Node, list[ir.Node]]], str]:
    """``([(LayerNorm, [MatMuls reading it with a constant [C, N] float weight]), ...], why none)`` of the main graph.

    A LayerNorm qualifies when it normalizes the last axis, its scale (and bias, if any) is a constant
    float ``[C]`` and at least one MatMul reads its output as the activation (input 0) with a 2-D float32
    constant weight of ``C`` rows.
    """
    groups, seen = [], 0
    for ln in model.graph:
        if ln.op_type != "LayerNormalization" or ln.domain not in ("", "ai.onnx"):
            continue
        seen += 1
        x = ln.outputs[0]
        w = ln.inputs[1] if len(ln.inputs) > 1 else None
        c = w.const_value.shape[0] if w is not None and w.const_value is not None and len(w.const_value.shape) == 1 else None
        axis = ln.attributes.get_int("axis", -1)
        rank = len(ln.inputs[0].shape) if ln.inputs[0].shape is not None else None
        if c is None or not (axis == -1 or (rank is not None and axis == rank - 1)):
            continue
        if not _const_1d(w, c) or (len(ln.inputs) > 2 and ln.inputs[2] is not None and not _const_1d(ln.inputs[2], c)):
            continue
        mms = []
        for u in x.uses():
            n = u.node
            if n.op_type != "MatMul" or u.idx != 0 or n.graph is not model.graph:
                continue
            wt = n.inputs[1]
            if (wt is not None and wt.const_value is not None and wt.const_value.dtype == ir.DataType.FLOAT
                    and len(wt.const_value.shape) == 2 and wt.const_value.shape[0] == c):
                mms.append(n)
        if mms:
            groups.append((ln, list(dict.fromkeys(mms))))
    if groups:
        return groups, ""
    if not seen:
        return [], "the graph has no LayerNormalization node (ONNX opset 17 op) to fold the scales into"
    return [], (f"none of its {seen} LayerNormalization nodes normalizes the last axis with constant float "
                "scale/bias and feeds a MatMul with a constant 2-D float32 weight")


def channel_ranges(model: ir.Model, names: Sequence[str],
                   feeds: Sequence[dict[str, np.ndarray]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-channel (last axis) ``(min, max)`` of the values ``names`` over ONNX Runtime runs of ``model`` on ``feeds``."""
    import onnxruntime as ort

    proto = ir.to_proto(model)
    have = {o.name for o in proto.graph.output}
    for name in names:
        if name not in have:
            proto.graph.output.add().name = name
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = calibration_session(proto.SerializeToString(), so)
    inputs = {i.name for i in sess.get_inputs()}
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for f in feeds:
        vals = sess.run(list(names), {k: v for k, v in f.items() if k in inputs})
        for name, v in zip(names, vals, strict=True):
            a = np.asarray(v, np.float32).reshape(-1, v.shape[-1])
            lo, hi = a.min(axis=0), a.max(axis=0)
            out[name] = (lo, hi) if name not in out else (np.minimum(out[name][0], lo), np.maximum(out[name][1], hi))
    return out


def channel_absmax(model: ir.Model, names: Sequence[str], feeds: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-channel (last axis) ``max |x|`` of the values ``names`` over ONNX Runtime runs of ``model`` on ``feeds``."""
    return {k: np.maximum(-lo, hi) for k, (lo, hi) in channel_ranges(model, names, feeds).items()}


def _own_initializer(graph: ir.Graph, v: ir.Value, node: ir.Node, idx: int, array: np.ndarray, suffix: str) -> None:
    """Give ``node`` input ``idx`` the constant ``array``: in place when only ``node`` reads ``v``, else a copy."""
    if len(list(v.uses())) == 1 and v.is_initializer() and not v.is_graph_output():
        v.const_value = ir.tensor(array, name=v.name)
        return
    name = f"{v.name}{suffix}"
    new = ir.Value(name=name, const_value=ir.tensor(array, name=name), type=v.type, shape=ir.Shape(list(array.shape)))
    graph.register_initializer(new)
    node.replace_input_with(idx, new)


class SmoothActivationsPass(ir.passes.InPlacePass):
    """Fold SmoothQuant per-channel scales into each LayerNorm → MatMul(s) group (an identity in float).

    Scope: main graph; the groups of :func:`smoothing_groups`. For each: ``s = clip(max|X|^α / max|W_row|^(1−α))``
    over the channels (``max|X|`` from ``feeds``, ``max|W_row|`` over every MatMul of the group), LayerNorm
    ``γ, β ← γ / s, β / s`` (copied if another node shares them), each MatMul's ``W ← diag(s) W`` (copied if
    shared). The LayerNorm's output gets the name ``NAME/smoothed``; its other readers and the graph outputs read
    ``Mul(NAME/smoothed, s)``, named ``NAME`` (the same tensor as before, so layer cuts by name still hold).

    Invariants: graph inputs/outputs and every value's name and meaning unchanged (outputs equal within float
    round-off); only LayerNorm/MatMul constants change, plus one ``Mul`` per LayerNorm with other readers.
    Records ``dyncompile.smoothed`` (α, groups, the layer cuts of the unsmoothed graph for a later early exit).
    Idempotent: a model carrying that key is left alone (``modified=False``).
    """

    def __init__(self, feeds: Sequence[dict[str, np.ndarray]], alpha: float = 0.5) -> None:
        super().__init__()
        self.feeds = list(feeds)
        self.alpha = float(alpha)

    def __repr__(self) -> str:
        return f"SmoothActivationsPass(alpha={self.alpha}, feeds={len(self.feeds)} batches)"

    def requires(self, model: ir.Model) -> None:
        """Refuse an empty calibration set or an alpha outside [0, 1] before anything changes."""
        if not self.feeds:
            raise ir.passes.PreconditionError("smooth-activations needs calibration feeds (pass --calib FILE.jsonl)")
        if not 0.0 <= self.alpha <= 1.0:
            raise ir.passes.PreconditionError(f"smooth-activations alpha must be in [0, 1], got {self.alpha}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Rewrite ``model`` in place (scope and invariants: the class docstring)."""
        if _keys.SMOOTHED in model.metadata_props:
            return ir.passes.PassResult(model, modified=False)
        groups, why = smoothing_groups(model)
        if not groups:
            return not_fired(model, "smooth-activations", why, "leave smooth-activations out for this model")
        from dyncompile.passes.quantize_search import _layer_record

        layers = _layer_record(model)
        stats = channel_absmax(model, [ln.outputs[0].name for ln, _ in groups], self.feeds)
        g = model.graph
        spread = []
        for k, (ln, mms) in enumerate(groups):
            x = ln.outputs[0]
            xmax = stats[x.name].astype(np.float64)
            wmax = np.max([np.abs(m.inputs[1].const_value.numpy()).max(axis=1) for m in mms], axis=0).astype(np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):
                s = np.power(xmax, self.alpha) / np.power(wmax, 1.0 - self.alpha)
            s = np.where(np.isfinite(s) & (s > 0), s, 1.0)
            s = np.clip(s, *_SCALE_RANGE).astype(np.float32)
            spread.append(float(xmax.max() / max(np.median(xmax), 1e-12)))
            gamma = ln.inputs[1].const_value.numpy().astype(np.float32)
            _own_initializer(g, ln.inputs[1], ln, 1, gamma / s, f"/smoothed{k}")
            if len(ln.inputs) > 2 and ln.inputs[2] is not None:
                beta = ln.inputs[2].const_value.numpy().astype(np.float32)
                _own_initializer(g, ln.inputs[2], ln, 2, beta / s, f"/smoothed{k}")
            for m in mms:
                w = m.inputs[1].const_value.numpy().astype(np.float32)
                _own_initializer(g, m.inputs[1], m, 1, w * s[:, None], f"/smoothed{k}")
            others = [u for u in x.uses() if u.node not in mms]
            name = x.name
            if others or x.is_graph_output():
                sv = ir.Value(name=f"{name}/smooth_scale", const_value=ir.tensor(s, name=f"{name}/smooth_scale"))
                g.register_initializer(sv)
                x.name = f"{name}/smoothed"
                mul = ir.node("Mul", [x, sv], name=f"{ln.name or name}/unsmooth")
                restored = mul.outputs[0]
                g.insert_after(ln, mul)
                for u in others:
                    u.node.replace_input_with(u.idx, restored)
                for i, out in enumerate(g.outputs):
                    if out is x:
                        g.outputs[i] = restored
                restored.name, restored.type, restored.shape = name, x.type, x.shape
            else:
                x.name = f"{name}/smoothed"
        model.metadata_props[_keys.SMOOTHED] = json.dumps(
            {"alpha": self.alpha, "groups": len(groups), "matmuls": sum(len(m) for _, m in groups),
             "outlier_ratio_max": round(max(spread), 3), "layers": layers}
        )
        logger.info("smooth-activations: %d LayerNorm groups (%d MatMuls), alpha %.2f; largest channel max / median "
                    "channel max before smoothing: %.1f", len(groups), sum(len(m) for _, m in groups), self.alpha,
                    max(spread))
        return ir.passes.PassResult(model, modified=True)


def calibration_feeds(context, rows: int, batch_size: int = 16) -> list[dict[str, np.ndarray]]:
    """Tokenized batches of the calibration rows a following certificate does not test on (the path rows).

    The rows are the early-exit certificate's path split (30 %, stratified by label, seed 0), so a
    ``quantize-int8`` search or ``early-exit`` after this pass still certifies on rows nothing has read;
    at most ``rows`` of them, in length order (little padding).
    """
    from dyncompile.errors import PassConfigError
    from dyncompile.io import read_jsonl, texts_and_labels
    from dyncompile.passes.early_exit.certify import DEFAULT_SPLIT, stratified_split
    from dyncompile.passes.early_exit.fit_exit_heads import length_order
    from dyncompile.runtime.text import TextEncoder

    o = context.options
    if not o.get("calib"):
        raise PassConfigError("calibration rows are needed: pass --calib FILE.jsonl")
    tok = context.require_tokenizer("calibrating activation ranges")
    texts, labels = texts_and_labels(read_jsonl(o["calib"]), context.model_config.get("labels"))
    if labels is None:
        raise PassConfigError("smooth-activations reads only the calibration rows the certificate does not test on, "
                              "split by label: give --calib rows with labels")
    path, _ = stratified_split(len(texts), DEFAULT_SPLIT, 0, np.asarray(labels, np.int64))
    path = np.sort(path[np.random.default_rng(0).permutation(len(path))[:rows]])
    enc = TextEncoder(tok, max_length=int(context.model_config.get("max_length", 512)))
    sub = [texts[i] for i in path]
    order = length_order(enc, sub)
    return [enc([sub[i] for i in order[s : s + batch_size]]) for s in range(0, len(order), batch_size)]


@register_pass(
    "smooth-activations",
    help="SmoothQuant scaling before int8: per-channel scales max|X|^alpha / max|W|^(1-alpha) (from --calib) folded "
    "into each LayerNorm's gamma/beta and the rows of the MatMuls it feeds; exact in float; options alpha=0.5, "
    "rows=256 calibration rows",
    requires=("calib",),
    before=("quantize-int8",),
)
def _make_smooth(context, alpha: float = 0.5, rows: int = 256):
    from dyncompile.errors import PassConfigError

    if not 0.0 <= alpha <= 1.0:
        raise PassConfigError(f"smooth-activations alpha must be in [0, 1], got {alpha}")
    if rows < 8:
        raise PassConfigError(f"smooth-activations rows must be >= 8, got {rows}")
    return SmoothActivationsPass(calibration_feeds(context, rows), alpha=alpha)
