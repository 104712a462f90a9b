"""Accuracy-aware int8: per-MatMul sensitivity and a budget-driven fp32 fallback search.

``quantize-int8{budget_share=S}`` with ``--calib`` and ``--budget B`` quantizes every constant-weight MatMul
except the most sensitive ones, kept in fp32 until the int8 model alone is expected to stay within ``S * B``
accuracy points of the fp32 original, and certifies what it chose with the early-exit machinery (the
Waudby-Smith–Ramdas betting bound of :mod:`dyncompile.passes.early_exit.certify`). Quantization is still ORT's
(``quantize_dynamic`` with ``nodes_to_exclude``, or with ``format=static`` :class:`~dyncompile.passes.quantize_weights.QuantizeStaticInt8Pass`'s
``quantize_static``, calibrated on the path rows); this module only decides which nodes to exclude. The static
search simulates the fixed activation ranges the calibrator will find (:func:`static_qparams`); after
``smooth-activations`` it searches the smoothed graph.

How (every step on the calibration rows, split as the early-exit certification splits them):

1. **Split.** :func:`~dyncompile.passes.early_exit.certify.stratified_split` with the early-exit defaults
   (path fraction 0.3, seed 0, strata = labels, else the fp32 predictions): the *search* uses the path rows
   only, the *certificate* the other 70 % (the test rows). ``--passes quantize-int8,early-exit`` therefore
   builds its exit path on the same rows the fallback was searched on, and certifies the composed pipeline
   (int8 + exits, against the fp32 original) once, on rows neither search has seen.
2. **Sensitivity.** One ONNX Runtime session of a *gated fake-quant* copy of the model
   (:func:`gated_fake_quant`): every target MatMul reads ``x + g_i (dq(q(x)) - x)`` and ``W + g_i (dq(q(W)) - W)``
   with ``q`` what ``quantize_dynamic`` does (uint8 per-tensor activations via ``DynamicQuantizeLinear``,
   symmetric int8 weights per output channel) and ``g`` a graph input. ``g = e_i`` quantizes MatMul ``i`` alone,
   ``g = 0`` is the fp32 model (to float round-off: the MatMuls read a computed weight, another kernel path):
   one session measures every configuration, no quantizer runs in the loop. Sensitivity of ``i`` = mean KL(fp32 || int8-only-``i``) on up to ``sensitivity_rows`` path rows
   (with the flips and the accuracy change, for the table).
3. **Fallback.** MatMuls sorted by sensitivity; configuration ``k`` keeps the ``k`` most sensitive in fp32.
   The first ``k`` of :func:`fallback_counts` (0, 1, ..., 8, 12, 16, 24, ...) whose path-row loss
   (``1[int8 wrong] - 1[fp32 wrong]``, or disagreement without labels) predicts a bound within the target at
   the test part's size (:func:`predicted_bound`) is chosen; the plan records each ``k`` tried. ``forecast=
   "clipped"`` forecasts from that loss clipped at 0: a flip that helps does not pay for one that hurts (on
   MPNet-base a 0-fallback model 2 path rows *better* than fp32 forecast 0.45 and was 0.43 points worse on
   the held-out rows).
4. **Quantize and certify.** ``quantize_dynamic(nodes_to_exclude=the k names)``; the *real* int8 model (not the
   simulation) runs on every calibration row; on the test rows its observed drop and its betting UCB at
   ``--confidence`` are recorded (:class:`QuantSearchResult`), ``certified`` when the bound is within ``S * B``.

``quantize-int4{budget_share=S}`` (``int4=``:class:`Int4Format`) runs the same steps with three precisions: the
gated model has a second gate per MatMul that makes it int4 as ``MatMulNBits`` computes it (:func:`int4_weights`,
:func:`gated_fake_quant`), every MatMul starts in int4, and the scan walks :func:`precision_moves` (int4 -> int8
-> fp32, one level a move); the last step is :class:`QuantizeMixedInt4Pass`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from dyncompile.passes._graph import add_initializer

logger = logging.getLogger(__name__)

__all__ = [
    "GATE_INPUT",
    "Int4Format",
    "QuantSearchResult",
    "QuantizeMixedInt4Pass",
    "QuantTarget",
    "dequantize_nbits",
    "gated_fake_quant",
    "int4_weights",
    "precision_moves",
    "predicted_bound",
    "quant_losses",
    "quant_targets",
    "certify_quantized",
    "fallback_counts",
    "search_fallback",
    "static_qparams",
]

GATE_INPUT = "dyncompile_quant_gate"
SEARCH_FORMAT = "dyncompile.quant_search/v1"


@dataclasses.dataclass(frozen=True)
class QuantTarget:
    """One MatMul the int8 pass may quantize: node name, weight name, layer (0 = outside the layers), label."""

    node: str
    weight: str
    layer: int
    label: str


def quant_targets(model: ir.Model) -> list[QuantTarget]:
    """The main graph's MatMuls with a 2-D float32 initializer weight, in graph order, labelled by layer.

    Labels are ``L<layer>.<j> KxN`` (``j``-th such MatMul of the layer, ``ffn-out`` when a GELU feeds it), or
    ``head.<j>`` outside the repeated layers (:func:`~dyncompile.passes.analysis.analyze_model`).
    """
    from dyncompile.passes.quantize_weights import gelu_fed_matmuls

    g = model.graph
    layer_of: dict[str, int] = {}
    try:
        from dyncompile.passes.analysis.layers import analyze_model

        s = analyze_model(model)
        for layer in s.layers if s.has_layers else ():
            for name in layer.node_names:
                layer_of[name] = layer.index
    except Exception as e:  # noqa: BLE001 - the labels are cosmetic; the search works without layers
        logger.info("quantize-int8 search: no layer structure for the labels (%s)", e)
    gelu = set(gelu_fed_matmuls(model))
    out, per_layer = [], {}
    for n, node in enumerate(g):
        w = node.inputs[1] if node.op_type == "MatMul" and len(node.inputs) == 2 else None
        if w is None or w.const_value is None or w.name not in g.initializers:
            continue
        if w.const_value.dtype != ir.DataType.FLOAT or len(w.const_value.shape) != 2:
            continue
        if not node.name:
            node.name = f"MatMul_{n}"
        layer = layer_of.get(node.name, 0)
        j = per_layer.get(layer, 0)
        per_layer[layer] = j + 1
        k, m = w.const_value.shape
        where = f"L{layer}.{j}" if layer else f"head.{j}"
        out.append(QuantTarget(node.name, w.name, layer, f"{where} {k}x{m}" + (" ffn-out" if node.name in gelu else "")))
    return out


def static_qparams(lo: float, hi: float, symmetric: bool) -> tuple[float, int, bool]:
    """``(scale, zero point, signed)`` ORT's ``quantize_static`` (MinMax) gives a tensor observed in ``[lo, hi]``.

    uint8: the range widened to hold 0, ``scale = (hi - lo) / 255``, ``zero = round(-lo / scale)``; symmetric int8:
    ``scale = max(|lo|, |hi|) / 127``, zero 0 (``onnxruntime.quantization.quant_utils.compute_scale_zp``).
    """
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if symmetric:
        return max(max(-lo, hi), 1e-12) / 127.0, 0, True
    scale = max(hi - lo, 1e-12) / 255.0
    return scale, int(np.clip(np.round(-lo / scale), 0, 255)), False


@dataclasses.dataclass(frozen=True)
class Int4Format:
    """The int4 weight format the search may give a MatMul (ORT's ``MatMulNBits``).

    ``block_size`` weights share a scale (and, unless ``symmetric``, a 4-bit zero point); ``accuracy_level`` 4
    quantizes the activation to int8 per block of ``block_size`` inside the op (int8 dot products), 0 computes
    in fp32.
    """

    block_size: int = 32
    symmetric: bool = False
    accuracy_level: int = 4

    def to_dict(self) -> dict[str, Any]:
        """JSON-able record."""
        return dataclasses.asdict(self)


def dequantize_nbits(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int,
                     block_size: int) -> np.ndarray:
    """The ``[K, N]`` float weight a 4-bit ``MatMulNBits`` computes with: ``(q - zp) * scale`` per block.

    ``packed`` ``[N, blocks, block_size / 2]`` (low nibble first), ``scales`` ``[N, blocks]`` (or flat),
    ``zero_points`` ``[N, ceil(blocks / 2)]`` packed the same way, or None (symmetric: zero point 8).
    """
    blocks = (k + block_size - 1) // block_size
    b = np.asarray(packed, np.uint8).reshape(n, blocks, block_size // 2)
    q = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, blocks, block_size).astype(np.float32)
    if zero_points is None:
        zp = np.full((n, blocks), 8.0, np.float32)
    else:
        z = np.asarray(zero_points, np.uint8).reshape(n, -1)
        zp = np.stack([z & 0x0F, z >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float32)
    w = (q - zp[:, :, None]) * np.asarray(scales, np.float32).reshape(n, blocks)[:, :, None]
    return np.ascontiguousarray(w.reshape(n, blocks * block_size)[:, :k].T)


def int4_weights(model: ir.Model, targets: Sequence[QuantTarget], fmt: Int4Format) -> dict[str, np.ndarray]:
    """``{node: dq(q4(W))}`` for the targets ORT's ``MatMulNBitsQuantizer`` turns into 4-bit ``MatMulNBits``.

    The weights are the quantizer's own (run once on a copy, then unpacked by :func:`dequantize_nbits`), so the
    gated model sees exactly the int4 weights the real model will have. Targets whose ``K`` is not a multiple of
    ``block_size`` are left out (int8 or fp32 only): the activation blocks of :func:`gated_fake_quant` need it.
    """
    from dyncompile.passes.quantize_weights import QuantizeWeightsInt4Pass

    shapes = {t.node: model.graph.initializers[t.weight].const_value.shape for t in targets}
    ok = [t.node for t in targets if shapes[t.node][0] % fmt.block_size == 0]
    if not ok:
        return {}
    work = ir.from_proto(ir.to_proto(model))
    QuantizeWeightsInt4Pass(block_size=fmt.block_size, symmetric=fmt.symmetric, accuracy_level=fmt.accuracy_level,
                            include_nodes=ok)(work)
    inits = work.graph.initializers
    out = {}
    for node in work.graph:
        if node.op_type != "MatMulNBits" or not node.name.endswith("_Q4") or node.name[:-3] not in shapes:
            continue
        k, n = node.attributes.get_int("K"), node.attributes.get_int("N")
        zp = node.inputs[3] if len(node.inputs) > 3 else None
        out[node.name[:-3]] = dequantize_nbits(
            inits[node.inputs[1].name].const_value.numpy(), inits[node.inputs[2].name].const_value.numpy(),
            None if zp is None else inits[zp.name].const_value.numpy(), k, n, fmt.block_size)
    return out


def _fake_quant_weight(w: np.ndarray, per_channel: bool, qmax: int = 127) -> np.ndarray:
    """``dq(q(W))`` as ``quantize_dynamic`` stores it: symmetric int8, a scale per column (axis 1).

    Values in ``[-qmax, qmax]``: 127, or 64 with ORT's ``reduce_range``.
    """
    from dyncompile.passes.quantize_weights import _int8_weight

    q, scale = _int8_weight(w.astype(np.float32), per_channel, qmax)
    return (q * scale).astype(np.float32)


def gated_fake_quant(model: ir.Model, targets: Sequence[QuantTarget], per_channel: bool = True,
                     act_qparams: dict[str, tuple[float, int, bool]] | None = None,
                     int4: dict[str, np.ndarray] | None = None, int4_act_block: int | None = None,
                     weight_max: int = 127) -> bytes:
    """A serialised copy of ``model`` whose target MatMuls are int8 where the input ``GATE_INPUT[i]`` is 1.

    ``g`` is a float ``[len(targets)]`` graph input. MatMul ``i`` reads ``x + g_i (dq(q(x)) - x)`` and
    ``W + g_i D_i`` with ``D_i = dq(q(W)) - W`` a constant; ``g_i = 0`` leaves it fp32 (to round-off). ``q(x)`` is
    dynamic uint8 (``DynamicQuantizeLinear``, as ``quantize_dynamic``) or, with ``act_qparams`` (node name ->
    ``(scale, zero point, signed)``), static with that fixed range (as ``quantize_static``: uint8, or int8 when
    ``signed``; :func:`static_qparams`).
    With ``int4`` (node name -> ``dq(q4(W))``, :func:`int4_weights`) ``g`` has ``2 * len(targets)`` entries and
    ``g[len(targets) + i] = 1`` makes MatMul ``i`` int4 as ``MatMulNBits`` computes it: ``W`` read as its int4
    weight and, with ``int4_act_block`` (``accuracy_level=4``), ``x`` rounded to symmetric int8 per block of that
    many elements along ``K`` (MLAS's ``QuantizeARow_CompInt8``: scale ``max|x| / 127``, round to nearest even).
    ``weight_max``: the int8 weights' range (64 for ``reduce_range``). ``model`` is not modified.
    """
    work = ir.from_proto(ir.to_proto(model))
    g = work.graph
    int4 = int4 or {}
    m = len(targets)
    gate = ir.Value(name=GATE_INPUT, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2 * m if int4 else m]))
    g.inputs.append(gate)
    index = {t.node: i for i, t in enumerate(targets)}
    for node in [n for n in g if n.op_type == "MatMul" and n.name in index]:
        i = index[node.name]
        x, w = node.inputs[0], node.inputs[1]
        arr = w.const_value.numpy()
        p = f"dyncompile_fq{i}"
        idx = ir.Value(name=f"{p}/idx", const_value=ir.tensor(np.array(i, np.int64), name=f"{p}/idx"))
        wd = _fake_quant_weight(arr, per_channel, weight_max) - arr.astype(np.float32)
        wdelta = ir.Value(name=f"{p}/wdelta", const_value=ir.tensor(wd, name=f"{p}/wdelta"))
        g.register_initializer(idx)
        g.register_initializer(wdelta)
        gi = ir.node("Gather", [gate, idx], {"axis": 0}, name=f"{p}/gate")
        if act_qparams is None:
            q = ir.node("DynamicQuantizeLinear", [x], num_outputs=3, name=f"{p}/quantize")
            dq = ir.node("DequantizeLinear", list(q.outputs), name=f"{p}/dequantize")
        else:
            scale, zero, signed = act_qparams[node.name]
            sc = ir.Value(name=f"{p}/xscale", const_value=ir.tensor(np.array(scale, np.float32), name=f"{p}/xscale"))
            zp = ir.Value(name=f"{p}/xzero", const_value=ir.tensor(np.array(zero, np.int8 if signed else np.uint8),
                                                                   name=f"{p}/xzero"))
            g.register_initializer(sc)
            g.register_initializer(zp)
            q = ir.node("QuantizeLinear", [x, sc, zp], name=f"{p}/quantize")
            dq = ir.node("DequantizeLinear", [q.outputs[0], sc, zp], name=f"{p}/dequantize")
        xd = ir.node("Sub", [dq.outputs[0], x], name=f"{p}/xdelta")
        xg = ir.node("Mul", [xd.outputs[0], gi.outputs[0]], name=f"{p}/xgate")
        xn = ir.node("Add", [x, xg.outputs[0]], name=f"{p}/x")
        wg = ir.node("Mul", [wdelta, gi.outputs[0]], name=f"{p}/wgate")
        wn = ir.node("Add", [w, wg.outputs[0]], name=f"{p}/w")
        new = [gi, q, dq, xd, xg, xn, wg, wn]
        if node.name in int4:
            new += _int4_gate(g, p, m + i, gate, x, xn.outputs[0], wn.outputs[0], arr, int4[node.name], int4_act_block)
        for k, n in enumerate(new):
            for j, o in enumerate(n.outputs):
                o.name = f"{p}/out{k}_{j}"
        g.insert_before(node, new)
        node.replace_input_with(0, new[-2].outputs[0] if node.name in int4 else xn.outputs[0])
        node.replace_input_with(1, new[-1].outputs[0] if node.name in int4 else wn.outputs[0])
    return ir.to_proto(work).SerializeToString()


def _int4_gate(g: ir.Graph, p: str, j: int, gate: ir.Value, x: ir.Value, x8: ir.Value, w8: ir.Value, arr: np.ndarray,
               w4: np.ndarray, act_block: int | None) -> list[ir.Node]:
    """The int4 gate ``g_j`` added on top of the int8 one: ``x8 + g_j (dq_blk(x) - x)``, ``w8 + g_j (dq4(W) - W)``.

    The last two nodes compute the MatMul's new activation and weight.
    """
    def const(name: str, a: np.ndarray) -> ir.Value:
        return add_initializer(g, f"{p}/{name}", a)

    gj = ir.node("Gather", [gate, const("idx4", np.array(j, np.int64))], {"axis": 0}, name=f"{p}/gate4")
    nodes = [gj]
    w4d = const("w4delta", (w4 - arr.astype(np.float32)).astype(np.float32))
    if act_block:
        k = arr.shape[0]
        shp = ir.node("Shape", [x], name=f"{p}/a4shape")
        xr = ir.node("Reshape", [x, const("a4blocks", np.array([-1, k // act_block, act_block], np.int64))],
                     name=f"{p}/a4reshape")
        ab = ir.node("Abs", [xr.outputs[0]], name=f"{p}/a4abs")
        amax = ir.node("ReduceMax", [ab.outputs[0], const("a4axis", np.array([-1], np.int64))], {"keepdims": 1},
                       name=f"{p}/a4amax")
        safe = ir.node("Max", [amax.outputs[0], const("a4tiny", np.array(1e-30, np.float32))], name=f"{p}/a4safe")
        inv = ir.node("Div", [const("a4qmax", np.array(127.0, np.float32)), safe.outputs[0]], name=f"{p}/a4inv")
        scale = ir.node("Div", [amax.outputs[0], const("a4qmax2", np.array(127.0, np.float32))], name=f"{p}/a4scale")
        xs = ir.node("Mul", [xr.outputs[0], inv.outputs[0]], name=f"{p}/a4scaled")
        rq = ir.node("Round", [xs.outputs[0]], name=f"{p}/a4round")
        dq = ir.node("Mul", [rq.outputs[0], scale.outputs[0]], name=f"{p}/a4dq")
        back = ir.node("Reshape", [dq.outputs[0], shp.outputs[0]], name=f"{p}/a4back")
        xd = ir.node("Sub", [back.outputs[0], x], name=f"{p}/a4delta")
        xg = ir.node("Mul", [xd.outputs[0], gj.outputs[0]], name=f"{p}/a4gate")
        nodes += [shp, xr, ab, amax, safe, inv, scale, xs, rq, dq, back, xd, xg]
        xn = ir.node("Add", [x8, xg.outputs[0]], name=f"{p}/x4")
    else:
        xn = ir.node("Identity", [x8], name=f"{p}/x4")
    wg = ir.node("Mul", [w4d, gj.outputs[0]], name=f"{p}/w4gate")
    wn = ir.node("Add", [w8, wg.outputs[0]], name=f"{p}/w4")
    return [*nodes, wg, xn, wn]


class _Runner:
    """Probabilities ``[N, C]`` of a classifier session on calibration texts (length-ordered batches)."""

    def __init__(self, model_bytes: bytes, texts: Sequence[str], tokenizer_file: Path, max_length: int,
                 batch_size: int = 32) -> None:
        import onnxruntime as ort

        from dyncompile.passes.early_exit.fit_exit_heads import length_order
        from dyncompile.runtime.text import TextEncoder

        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        from dyncompile.runtime.providers import calibration_session

        self.sess = calibration_session(model_bytes, so)
        self.enc = TextEncoder(tokenizer_file, max_length=max_length)
        self.texts = list(texts)
        self.order = length_order(self.enc, self.texts)
        self.inputs = [i.name for i in self.sess.get_inputs()]
        self.output = self.sess.get_outputs()[0].name
        self.batch_size = batch_size
        self._feeds: dict[tuple[int, ...], dict[str, np.ndarray]] = {}

    def probs(self, rows: np.ndarray, gate: np.ndarray | None = None) -> np.ndarray:
        """Softmax outputs on ``rows`` (indices into the texts), in that order."""
        from dyncompile.runtime.rules.exit_rule import softmax

        rows = np.asarray(rows)
        pos = {int(r): j for j, r in enumerate(rows)}
        ordered = [int(r) for r in self.order if int(r) in pos]
        out = None
        for s in range(0, len(ordered), self.batch_size):
            chunk = tuple(ordered[s : s + self.batch_size])
            feeds = self._feeds.get(chunk)
            if feeds is None:
                enc = self.enc([self.texts[r] for r in chunk])
                feeds = self._feeds[chunk] = {k: v for k, v in enc.items() if k in self.inputs}
            run = dict(feeds)
            if gate is not None:
                run[GATE_INPUT] = gate.astype(np.float32)
            p = softmax(self.sess.run([self.output], run)[0].astype(np.float64))
            if out is None:
                out = np.empty((len(rows), p.shape[1]), np.float64)
            out[[pos[r] for r in chunk]] = p
        return out


def quant_losses(probs: np.ndarray, ref_probs: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
    """Per-row loss of the quantized model against the reference (the early-exit certificate's loss).

    ``1[q wrong] - 1[ref wrong]`` with labels, else ``1[q != ref]``: the int8 model as the only exit.
    """
    from dyncompile.passes.early_exit.certify import exit_losses

    return exit_losses(np.asarray(probs)[None], np.asarray(ref_probs).argmax(-1), labels)[0]


def predicted_bound(losses: np.ndarray, n_test: int, delta: float, lo: float, seed: int = 0) -> float:
    """A forecast (points) of the certificate's betting bound on ``n_test`` new rows from path-row ``losses``.

    The betting UCB of the path losses, shuffled (seeded) and repeated to ``n_test`` rows: the bound the
    certificate would give if the test rows looked like the path rows. Used only to *choose* a configuration
    on the path rows (a choice that never reads the test rows keeps the certificate valid).
    """
    from dyncompile.passes.early_exit.certify import betting_ucb

    x = np.asarray(losses, np.float64)
    sample = np.resize(x[np.random.default_rng(seed).permutation(len(x))], n_test)
    return 100.0 * betting_ucb(sample, delta, lo, 1.0)


@dataclasses.dataclass
class QuantSearchResult:
    """What the search decided and on what evidence (``to_dict`` is the plan's ``policy.quantization``)."""

    excluded: list[str]
    target_points: float
    budget: float
    share: float
    confidence: float | None
    table: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    rows: dict[str, int]
    per_channel: bool
    certificate: dict[str, Any] = dataclasses.field(default_factory=dict)
    int8_format: str = "dynamic"
    forecast: str = "labels"
    int4: dict[str, Any] | None = None  #: the int4 format (Int4Format) when the search may use int4
    int8_nodes: list[str] = dataclasses.field(default_factory=list)  #: with int4: the MatMuls kept 8-bit
    int4_nodes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able record with its format tag."""
        return {"format": SEARCH_FORMAT, **dataclasses.asdict(self)}


def fallback_counts(m: int) -> list[int]:
    """The numbers of fp32 MatMuls the search tries, in order: 0, 1, ..., 8, 12, 16, 24, 32, ... (< m).

    A scan from int8-everywhere up, not a bisection: on a few hundred path rows the loss moves by whole rows and
    is not monotone in the count (a bisection that lands on an unlucky count skips every smaller one); the
    first count that meets the target wins, so speed is preferred. ``m`` (every MatMul fp32) is implied.
    """
    out, j = list(range(9)), 8
    while j < m:
        out += [j, j + j // 2]
        j *= 2
    return sorted({c for c in out if c < m})


def _kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    p, q = np.clip(p, 1e-12, 1.0), np.clip(q, 1e-12, 1.0)
    return (p * (np.log(p) - np.log(q))).sum(-1)


def search_fallback(
    model: ir.Model,
    texts: Sequence[str],
    labels: np.ndarray | None,
    *,
    tokenizer_file: Path,
    max_length: int,
    budget: float,
    share: float,
    confidence: float | None,
    per_channel: bool = True,
    sensitivity_rows: int = 256,
    forecast: str = "labels",
    act_qparams: dict[str, tuple[float, int, bool]] | None = None,
    split: float | None = None,
    seed: int = 0,
    batch_size: int = 32,
    int4: Int4Format | None = None,
    reduce_range: bool = False,
) -> tuple[QuantSearchResult, _Runner, np.ndarray, np.ndarray]:
    """Steps 1–3 of the module docstring: the names to keep in fp32 (and, with ``int4``, in int8) and the evidence.

    With ``int4`` every MatMul starts in int4 (those whose ``K`` is not a multiple of the block size in int8) and
    the search raises precisions one level at a time (:func:`precision_moves`): the configuration after ``k``
    moves is scanned for ``k`` in :func:`fallback_counts` as the fp32 count is without it.

    Returns ``(result without certificate, runner of the gated model, fp32 probabilities on every row, test
    rows)``; :func:`certify_quantized` fills the certificate from the real quantized model.
    """
    from dyncompile.passes.early_exit.certify import DEFAULT_SPLIT, stratified_split

    split = DEFAULT_SPLIT if split is None else split  # the early-exit certification's split: the same path rows
    targets = quant_targets(model)
    if not targets:
        raise ValueError("no MatMul with a 2-D float32 weight initializer to quantize")
    w4 = int4_weights(model, targets, int4) if int4 is not None else {}
    act_block = int4.block_size if int4 is not None and int4.accuracy_level == 4 else None
    from dyncompile.passes.quantize_weights import weight_qmax

    fq = gated_fake_quant(model, targets, per_channel, act_qparams, w4, act_block, weight_qmax(reduce_range))
    runner = _Runner(fq, texts, tokenizer_file, max_length, batch_size)
    n, m = len(texts), len(targets)
    width = 2 * m if w4 else m
    every = np.arange(n)
    zero = np.zeros(width, np.float32)
    fp32 = runner.probs(every, zero)
    y = None if labels is None else np.asarray(labels, np.int64)
    strata = fp32.argmax(-1) if y is None else y
    path, test = stratified_split(n, split, seed, strata)
    sens_rows = path[np.random.default_rng(seed).permutation(len(path))[: min(sensitivity_rows, len(path))]]
    sens_rows = np.sort(sens_rows)
    ref_s, ref_p = fp32[sens_rows], fp32[path]

    table = _sensitivity_table(runner, targets, w4, sens_rows, ref_s, y, width)
    start = [4 if t.node in w4 else 8 for t in targets] if int4 is not None else [8] * m
    moves = precision_moves(table, start)
    first = {}
    for j, (i, _) in enumerate(moves):
        first.setdefault(i, j)
    for rank, i in enumerate(sorted(range(m), key=lambda i: first[i])):
        table[i]["rank"] = rank + 1
    delta = 0.1 if confidence is None else 1.0 - confidence
    lo = -1.0 if y is not None else 0.0
    target = share * budget
    steps: dict[int, dict[str, Any]] = {}

    def levels(k: int) -> list[int]:
        lv = list(start)
        for i, to in moves[:k]:
            lv[i] = to
        return lv

    def evaluate(k: int) -> float:
        lv = levels(k)
        gate = np.zeros(width, np.float32)
        for i, b in enumerate(lv):
            if b == 8:
                gate[i] = 1.0
            elif b == 4:
                gate[m + i] = 1.0
        q = runner.probs(path, gate)
        losses = quant_losses(q, ref_p, None if y is None else y[path])
        if forecast == "clipped":  # a flip that helps does not pay for one that hurts: the loss clipped at 0
            pb = predicted_bound(np.maximum(losses, 0.0), len(test), delta, 0.0)
        else:
            pb = predicted_bound(losses, len(test), delta, lo)
        steps[k] = {"fp32_kept": lv.count(32), "observed_path": round(100.0 * float(losses.mean()), 4),
                    "agreement_path": round(100.0 * float((q.argmax(-1) == ref_p.argmax(-1)).mean()), 4),
                    "predicted_bound": round(pb, 4)}
        if int4 is not None:
            steps[k].update(moves=k, int8=lv.count(8), int4=lv.count(4))
        logger.info("quantize search: %s: path-row drop %.2f, predicted bound %.2f (target %.2f)",
                    _describe_levels(lv), steps[k]["observed_path"], pb, target)
        return pb

    k = next((j for j in fallback_counts(len(moves)) if evaluate(j) <= target), len(moves))
    final = levels(k)
    excluded = [targets[i].node for i in range(m) if final[i] == 32]
    _label_precisions(table, final, start, int4, target)
    res = QuantSearchResult(
        excluded=excluded, target_points=round(target, 6), budget=float(budget), share=float(share),
        confidence=confidence, table=table, steps=[steps[j] for j in sorted(steps)],
        rows={"calibration": n, "path": len(path), "test": len(test), "sensitivity": len(sens_rows)},
        per_channel=per_channel, int8_format="dynamic" if act_qparams is None else "static", forecast=forecast,
        int4=None if int4 is None else int4.to_dict(),
        int8_nodes=[targets[i].node for i in range(m) if final[i] == 8] if int4 is not None else [],
        int4_nodes=[targets[i].node for i in range(m) if final[i] == 4],
    )
    return res, runner, fp32, test


def _sensitivity_table(runner: _Runner, targets: Sequence[QuantTarget], w4: dict[str, np.ndarray],
                       rows: np.ndarray, ref: np.ndarray, y: np.ndarray | None, width: int) -> list[dict[str, Any]]:
    """The sensitivity of each target on ``rows``: KL(fp32 || that MatMul alone in int8), flips, accuracy change.

    With int4 weights, also the same with it alone in int4 (``kl_int4``, ``flips_int4``, ``acc_change_int4``).
    """
    m = len(targets)

    def sensitivity(j: int, suffix: str) -> dict[str, Any]:
        gate = np.zeros(width, np.float32)
        gate[j] = 1.0
        q = runner.probs(rows, gate)
        row = {f"kl{suffix}": float(_kl(ref, q).mean()), f"flips{suffix}": int((q.argmax(-1) != ref.argmax(-1)).sum())}
        if y is not None:
            row[f"acc_change{suffix}"] = round(100.0 * float((q.argmax(-1) == y[rows]).mean()
                                                              - (ref.argmax(-1) == y[rows]).mean()), 4)
        return row

    table = []
    for i, t in enumerate(targets):
        row = {"node": t.node, "label": t.label, "layer": t.layer, **sensitivity(i, "")}
        if t.node in w4:
            row.update(sensitivity(m + i, "_int4"))
        table.append(row)
    return table


def precision_moves(table: Sequence[dict[str, Any]], start: Sequence[int]) -> list[tuple[int, int]]:
    """The order in which the search raises precisions: ``[(MatMul index, new bits), ...]`` (bits 8 or 32 = fp32).

    Each MatMul's steps (int4 -> int8 -> fp32, from its ``start``) are worth their drop in sensitivity: int4 ->
    int8 ``kl_int4 - kl``, int8 -> fp32 ``kl`` (the mean KL to fp32 with that MatMul alone quantized). A MatMul
    whose second step is worth more than its first goes int4 -> fp32 in one move (worth ``kl_int4``, the hull of
    its steps). Moves are taken most valuable first, each MatMul's in its order. Without int4 (every start 8)
    this is the int8 search's order: by ``kl``, descending.
    """
    import heapq

    heap: list[tuple[float, int, int, int]] = []

    def push(i: int, frm: int) -> None:
        r = table[i]
        if frm == 4:
            up8, up32 = r["kl_int4"] - r["kl"], r["kl"]
            if up32 >= up8:
                heapq.heappush(heap, (-r["kl_int4"] / 2.0, i, i, 32))
            else:
                heapq.heappush(heap, (-up8, i, i, 8))
        elif frm == 8:
            heapq.heappush(heap, (-r["kl"], i, i, 32))

    for i, b in enumerate(start):
        push(i, b)
    out = []
    while heap:
        _, _, i, to = heapq.heappop(heap)
        out.append((i, to))
        if to == 8:
            push(i, 8)
    return out


def _label_precisions(table: list[dict[str, Any]], final: Sequence[int], start: Sequence[int],
                      int4: Int4Format | None, target: float) -> None:
    """Each table row's ``precision`` (``fp32: True`` too, as the int8 search records it) and ``why``."""
    name = {4: "int4", 8: "int8", 32: "fp32"}
    for i, row in enumerate(table):
        row["precision"] = name[final[i]]
        if final[i] == 32:
            row["fp32"] = True
        row["why"] = _why(row, final[i], start[i], int4, target)
        for key in ("kl", "kl_int4"):
            if key in row:
                row[key] = round(row[key], 6)


def _describe_levels(lv: Sequence[int]) -> str:
    return f"{lv.count(4)} int4, {lv.count(8)} int8, {lv.count(32)} fp32 of {len(lv)} MatMuls"


def _why(row: dict[str, Any], bits: int, start: int, int4: Int4Format | None, target: float) -> str:
    """The table's reason for one MatMul's precision."""
    if bits == 32 and int4 is not None and start == 4:
        return (f"rank {row['rank']} of the fallback order (KL {row['kl_int4']:.2e} alone in int4, {row['kl']:.2e} "
                f"in int8); with fewer fallbacks the forecast was above {target:.2f} points")
    if bits == 32:
        return (f"rank {row['rank']} of the fallback order (KL {row['kl']:.2e} with it alone in int8); "
                f"with fewer fallbacks the forecast was above {target:.2f} points")
    if int4 is None:
        return ""
    if bits == 8 and start == 8:
        return f"K {row['label'].split()[1].split('x')[0]} is not a multiple of block_size {int4.block_size}: no int4"
    if bits == 8:
        return (f"kept 8-bit: rank {row['rank']} (KL {row['kl_int4']:.2e} in int4, {row['kl']:.2e} in int8); with it "
                f"in int4 the forecast was above {target:.2f} points")
    return f"int4 (KL {row['kl_int4']:.2e} alone in int4)"


def certify_quantized(res: QuantSearchResult, quantized: ir.Model, runner: _Runner, fp32: np.ndarray,
                      labels: np.ndarray | None, test: np.ndarray) -> None:
    """Step 4: run the real int8 model on the test rows; fill ``res.certificate`` (observed drop, betting UCB)."""
    import onnxruntime as ort

    from dyncompile.passes.early_exit.certify import betting_ucb

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    from dyncompile.runtime.providers import calibration_session

    sess = calibration_session(ir.to_proto(quantized).SerializeToString(), so)
    swap = runner.sess
    runner.sess = sess
    try:
        q = runner.probs(test)
    finally:
        runner.sess = swap
    y = None if labels is None else np.asarray(labels, np.int64)[test]
    ref = fp32[test]
    losses = quant_losses(q, ref, y)
    lo = -1.0 if y is not None else 0.0
    rng = np.random.default_rng(0)
    cert: dict[str, Any] = {
        "mode": "labels" if y is not None else "agreement", "rows": int(len(test)),
        "observed": round(100.0 * float(losses.mean()), 4),
        "agreement": round(100.0 * float((q.argmax(-1) == ref.argmax(-1)).mean()), 4),
        "confidence": res.confidence, "target": res.target_points,
    }
    if y is not None:
        cert["fp32_accuracy"] = round(100.0 * float((ref.argmax(-1) == y).mean()), 4)
        cert["int8_accuracy"] = round(100.0 * float((q.argmax(-1) == y).mean()), 4)
    if res.confidence is not None:
        bound = 100.0 * betting_ucb(losses[rng.permutation(len(losses))], 1.0 - res.confidence, lo, 1.0)
        cert.update(bound=round(bound, 4), certified=bool(bound <= res.target_points + 1e-9), method="betting")
    else:
        cert.update(bound=None, certified=False, method="none")
    res.certificate = cert


def _layer_record(model: ir.Model) -> dict[str, Any] | None:
    """``{"num_layers", "cuts": {layer: output cut tensor}, "pooling"}`` of the fp32 graph, or None without layers."""
    from dyncompile.passes.analysis.layers import analyze_model

    try:
        s = analyze_model(model)
    except Exception:  # noqa: BLE001 - no layer record: a later pass analyses the graph itself
        return None
    if not s.has_layers:
        return None
    return {"num_layers": len(s.layers), "cuts": {str(layer.index): layer.output_cut for layer in s.layers},
            "pooling": s.head.pooling if s.head else "cls"}


class QuantizeMixedInt4Pass(ir.passes.InPlacePass):
    """int4 ``MatMulNBits`` for every constant-weight MatMul but the named int8 (dynamic) and fp32 ones.

    The precisions an int4 search chose, given by name (``quantize-int4{int8_nodes=A+B,fp32_nodes=C}``, names
    from ``dyncompile inspect``), or the search's own last step. A MatMul whose ``K`` is not a multiple of the
    block size is int8, as in the search. Scope: main graph. Invariants: graph inputs/outputs unchanged; the int8
    MatMuls are what ``quantize_dynamic`` makes of them, the int4 ones what ``MatMulNBitsQuantizer`` makes.
    Records ``dyncompile.quantized`` (scheme ``mixed-int4-int8``). Idempotent: a graph with MatMulNBits or int8
    MatMuls is left alone.
    """

    def __init__(self, int4: Int4Format, int8_nodes: Sequence[str] = (), fp32_nodes: Sequence[str] = (), *,
                 per_channel: bool = True, reduce_range: bool = False) -> None:
        super().__init__()
        self.reduce_range = bool(reduce_range)
        self.int4 = int4
        self.int8_nodes = tuple(int8_nodes)
        self.fp32_nodes = tuple(fp32_nodes)
        self.per_channel = bool(per_channel)

    def __repr__(self) -> str:
        from dyncompile.passes.quantize_weights import _rr_repr

        return (f"QuantizeMixedInt4Pass({self.int4}, int8_nodes=<{len(self.int8_nodes)} names>, "
                f"fp32_nodes=<{len(self.fp32_nodes)} names>{_rr_repr(self.reduce_range)})")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        import json

        from dyncompile.passes import _keys
        from dyncompile.passes.quantize_weights import (
            INT8_OPS,
            QuantizeDynamicInt8Pass,
            QuantizeWeightsInt4Pass,
            _has_ops,
        )

        if _has_ops(model, {*INT8_OPS, "MatMulNBits"}):
            return ir.passes.PassResult(model, modified=False)
        targets = quant_targets(model)
        unknown = sorted(set(self.int8_nodes + self.fp32_nodes) - {t.node for t in targets})
        if unknown:
            from dyncompile.errors import PassConfigError

            raise PassConfigError(f"quantize-int4: {len(unknown)} named MatMuls are not constant-weight MatMuls of this "
                                  f"graph (e.g. {unknown[0]!r}); take the names from `dyncompile inspect` of a plan "
                                  "compiled from the same model")
        f, keep = self.int4, set(self.fp32_nodes)
        shapes = {t.node: model.graph.initializers[t.weight].const_value.shape for t in targets}
        int8 = [t.node for t in targets if t.node not in keep
                and (t.node in self.int8_nodes or shapes[t.node][0] % f.block_size)]
        int4 = [t.node for t in targets if t.node not in keep and t.node not in int8]
        # int8 first: ORT's dynamic quantizer cannot type a graph that holds MatMulNBits already
        if int8:
            QuantizeDynamicInt8Pass(per_channel=self.per_channel, reduce_range=self.reduce_range,
                                    exclude_nodes=[*keep, *int4])(model)
        if int4:
            QuantizeWeightsInt4Pass(block_size=f.block_size, symmetric=f.symmetric, accuracy_level=f.accuracy_level,
                                    include_nodes=int4)(model)
        if not int8 and not int4:
            return ir.passes.PassResult(model, modified=False)
        model.metadata_props[_keys.QUANTIZED] = json.dumps(
            {"scheme": "mixed-int4-int8", **f.to_dict(), "per_channel": self.per_channel,
             "reduce_range": self.reduce_range, "int4_matmuls": len(int4),
             "int8_matmuls": len(int8), "fp32_matmuls_kept": len(keep)})
        return ir.passes.PassResult(model, modified=True)


class SearchInt8FallbackPass(ir.passes.InPlacePass):
    """Accuracy-aware dynamic int8: keep the most sensitive MatMuls in fp32 until a budget share is met.

    With ``int4`` (an :class:`Int4Format`) the same search over int4 / int8 / fp32 per MatMul, quantized at the
    end by :class:`QuantizeMixedInt4Pass`.

    Scope: main graph of a classifier (one ``[batch, classes]`` float output) with a tokenizer and calibration
    rows. What it does: the search of :func:`search_fallback` (sensitivity per MatMul on the path rows,
    bisection on how many of the most sensitive stay fp32), then :class:`QuantizeDynamicInt8Pass` with those
    nodes excluded, then :func:`certify_quantized` on the test rows. Records ``dyncompile.quantized`` (as the
    plain pass, plus the kept names) and the search (``policy.quantization``: sensitivity table, steps,
    certificate) for the plan and ``dyncompile inspect``.

    Invariants: graph inputs/outputs unchanged; the quantized graph is exactly what ``quantize_dynamic`` makes
    with ``nodes_to_exclude`` (``fmt="static"``: what :class:`~dyncompile.passes.quantize_weights.QuantizeStaticInt8Pass` makes from ``static_feeds``
    with ``exclude_nodes``). Idempotent: a graph that already holds int8 MatMuls or QDQ is left alone.
    """

    def __init__(self, texts: Sequence[str], labels: Sequence[int] | None, *, tokenizer_file: str | Path,
                 max_length: int = 512, budget: float = 1.0, share: float = 1.0, confidence: float | None = 0.9,
                 per_channel: bool = True, sensitivity_rows: int = 256, progress: bool = True, fmt: str = "dynamic",
                 static_feeds: Sequence[dict[str, np.ndarray]] | None = None,
                 symmetric_activations: bool = False, forecast: str = "labels",
                 int4: Int4Format | None = None, reduce_range: bool = False) -> None:
        super().__init__()
        self.int4 = int4
        self.reduce_range = bool(reduce_range)
        if int4 is not None and fmt != "dynamic":
            raise ValueError("the int4 search falls back to dynamic int8 (fmt='dynamic')")
        self.texts = list(texts)
        self.labels = None if labels is None else np.asarray(labels, np.int64)
        self.tokenizer_file = Path(tokenizer_file)
        self.max_length = int(max_length)
        self.budget = float(budget)
        self.share = float(share)
        self.confidence = confidence
        self.per_channel = bool(per_channel)
        self.sensitivity_rows = int(sensitivity_rows)
        self.progress = progress
        self.fmt = fmt
        self.symmetric_activations = bool(symmetric_activations)
        if forecast not in ("labels", "clipped"):
            raise ValueError(f"forecast is 'labels' or 'clipped', got {forecast!r}")
        self.forecast = forecast
        self.static_feeds = None if static_feeds is None else list(static_feeds)
        if fmt not in ("dynamic", "static") or (fmt == "static" and not self.static_feeds):
            raise ValueError("fmt is 'dynamic', or 'static' with static_feeds (calibration batches)")

    def __repr__(self) -> str:
        from dyncompile.passes.quantize_weights import _rr_repr

        return (f"SearchInt8FallbackPass(rows={len(self.texts)}, budget={self.budget}, share={self.share}, "
                f"confidence={self.confidence}, per_channel={self.per_channel}, format={self.fmt}"
                + _rr_repr(self.reduce_range) + (f", int4={self.int4})" if self.int4 else ")"))

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        from dyncompile.passes.quantize_weights import INT8_OPS, _has_ops

        if _has_ops(model, INT8_OPS):
            return
        outs = list(model.graph.outputs)
        if len(outs) != 1 or outs[0].shape is None or len(outs[0].shape) != 2:
            raise ir.passes.PreconditionError(
                "the accuracy-aware int8 search (quantize-int8{budget_share=...}) needs a classifier with one "
                f"[batch, classes] output; the graph has {[v.name for v in outs]} — drop budget_share to quantize "
                "without a search")
        if len(self.texts) < 100:
            raise ir.passes.PreconditionError(
                f"the calibration set has {len(self.texts)} rows; the int8 search needs at least 100 (a few "
                "thousand for budgets near 1 point)")
        if not self.tokenizer_file.is_file():
            raise ir.passes.PreconditionError(f"tokenizer file {self.tokenizer_file} not found")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the search and the quantization on ``model`` (scope and invariants: the class docstring)."""
        import json

        from dyncompile.passes import _keys
        from dyncompile.passes.quantize_weights import (
            INT8_OPS,
            QuantizeDynamicInt8Pass,
            QuantizeStaticInt8Pass,
            _has_ops,
        )

        if (_has_ops(model, {*INT8_OPS, "QuantizeLinear", "MatMulNBits"}) or _keys.QUANTIZED in model.metadata_props
                or _keys.POLICY_PREFIX + "quantization" in model.metadata_props):
            return ir.passes.PassResult(model, modified=False)
        if not quant_targets(model):
            from dyncompile.passes._infra import not_fired
            from dyncompile.passes.quantize_weights import _no_int8_target

            return not_fired(model, "quantize-int8", _no_int8_target(model), "leave quantize-int8 out for this model")
        act_qparams = None
        if self.fmt == "static":  # the fixed ranges quantize_static's MinMax calibrator will find on the same feeds
            from dyncompile.passes.smooth_activations import channel_ranges

            nodes = {n.name: n for n in model.graph}
            xs = {t.node: nodes[t.node].inputs[0].name for t in quant_targets(model)}
            stats = channel_ranges(model, sorted(set(xs.values())), self.static_feeds)
            act_qparams = {k: static_qparams(float(stats[v][0].min()), float(stats[v][1].max()),
                                             self.symmetric_activations) for k, v in xs.items()}
        res, runner, fp32, test = search_fallback(
            model, self.texts, self.labels, tokenizer_file=self.tokenizer_file, max_length=self.max_length,
            budget=self.budget, share=self.share, confidence=self.confidence, per_channel=self.per_channel,
            sensitivity_rows=self.sensitivity_rows, act_qparams=act_qparams, forecast=self.forecast, int4=self.int4,
            reduce_range=self.reduce_range,
        )
        layers = json.loads(model.metadata_props.get(_keys.SMOOTHED, "{}")).get("layers") or _layer_record(model)
        if len(res.excluded) == len(res.table):
            logger.warning("quantize-int8 search: no int8 configuration is expected within %.2f points of the fp32 "
                           "original; every MatMul stays fp32 (a larger budget or budget_share lets int8 in)",
                           res.target_points)
            result = ir.passes.PassResult(model, modified=False)
        elif self.int4 is not None:
            result = QuantizeMixedInt4Pass(self.int4, res.int8_nodes, res.excluded, per_channel=self.per_channel,
                                           reduce_range=self.reduce_range)(model)
        elif self.fmt == "static":
            result = QuantizeStaticInt8Pass(self.static_feeds, per_channel=self.per_channel, exclude_nodes=res.excluded,
                                            symmetric_activations=self.symmetric_activations,
                                            reduce_range=self.reduce_range)(model)
        else:
            result = QuantizeDynamicInt8Pass(per_channel=self.per_channel, exclude_nodes=res.excluded,
                                             reduce_range=self.reduce_range)(model)
        certify_quantized(res, result.model, runner, fp32, self.labels, test)
        del runner
        c = res.certificate
        if self.int4 is not None:
            logger.info("quantize-int4 search: %d int4, %d int8, %d fp32 of %d MatMuls", len(res.int4_nodes),
                        len(res.int8_nodes), len(res.excluded), len(res.table))
        logger.info(
            "quantize search: %d of %d MatMuls kept in fp32; the quantized model alone on %d held-out calibration rows: "
            "drop %.2f points, agreement %.2f %%, bound %s (target %.2f = %g x budget %g)",
            len(res.excluded), len(res.table), c["rows"], c["observed"], c["agreement"],
            "none" if c["bound"] is None else f"{c['bound']:.2f}", res.target_points, res.share, res.budget,
        )
        if res.confidence is not None and not c["certified"]:
            logger.warning(
                "quantize search: the quantized model's own share (%.2f points) is not certified (bound %.2f); "
                "a following early-exit certifies the whole pipeline against the fp32 original", res.target_points,
                c["bound"])
        if result.modified:
            meta = json.loads(result.model.metadata_props.get(_keys.QUANTIZED, "{}"))
            meta.update(search="budget", fp32_nodes=list(res.excluded))
            if self.int4 is not None:
                meta.update(int8_nodes=list(res.int8_nodes))
            values = ir.convenience.create_value_mapping(result.model.graph)
            if layers and all(c in values for c in layers["cuts"].values()):
                # fp32 kept in some layers only: the int8 layers no longer repeat exactly, so a later early-exit
                # reads the layer boundaries found on the fp32 graph from here (their tensors keep their names)
                meta["layers"] = layers
            result.model.metadata_props[_keys.QUANTIZED] = json.dumps(meta)
        # the search's record, also when every MatMul stayed fp32 (the table says why)
        result.model.metadata_props[_keys.POLICY_PREFIX + "quantization"] = json.dumps(res.to_dict())
        return ir.passes.PassResult(result.model, modified=True)
