"""``quantize-int8`` / ``quantize-int4``: weight quantization through ONNX Runtime's quantization tools.

Both passes hand the model to ``onnxruntime.quantization`` (the reference implementations that ORT's
kernels are written for) and bring the result back into onnx-ir, so they compose in one pipeline with
the dynamic-execution passes: ``--passes quantize-int8,early-exit`` fits the exit heads on the quantized
model's features, and (see ``FitExitHeadsPass(reference_model=...)``) calibrates the exit budget
against the fp32 original: both passes record ``dyncompile.quantized`` in the model's metadata so later
passes know the numerics changed.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import onnx_ir as ir

from dyncompile.io import external_data_dirs, working_directory
from dyncompile.passes import _keys
from dyncompile.passes._graph import add_initializer, default_opset, replace_node_output
from dyncompile.passes._infra import not_fired, register_pass

logger = logging.getLogger(__name__)

__all__ = [
    "QuantizeDynamicInt8Pass",
    "QuantizeDynamicInt8MixedPass",
    "QuantizeDynamicInt8PerTokenPass",
    "QuantizeStaticInt8Pass",
    "QuantizeWeightsInt4Pass",
    "QuantizeWeightsInt8Pass",
    "choose_int8_format",
    "gelu_fed_matmuls",
    "gemms_as_matmuls",
]

INT8_OPS = {"MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeLinear", "DynamicQuantizeMatMul", "QLinearMatMul"}
#: ``keep_fp32`` groups the int8 pass understands.
KEEP_FP32_GROUPS = ("ffn-out",)
_GELU_OPS = {"Erf", "Gelu", "FastGelu", "BiasGelu", "QuickGelu"}
_STOP_OPS = {"MatMul", "Gemm", "MatMulInteger", "LayerNormalization", "SkipLayerNormalization", "Softmax"}


def _replace_contents(model: ir.Model, new: ir.Model) -> None:
    """Make ``model`` (in place) hold ``new``'s graph, opsets and functions; keep dyncompile metadata."""
    meta = dict(model.metadata_props)
    model.graph = new.graph
    model.functions.clear()
    model.functions.update(new.functions)
    model.metadata_props.clear()
    model.metadata_props.update(new.metadata_props)
    model.metadata_props.update({k: v for k, v in meta.items() if k.startswith("dyncompile.")})


def _rebase_external(model: ir.Model, base_dir: str | None) -> None:
    """Tensors that came back from a proto with relative external-data locations: read them from base_dir."""
    if not base_dir:
        return
    for v in model.graph.initializers.values():
        t = v.const_value
        if isinstance(t, ir.ExternalTensor) and not str(t.base_dir):
            t.base_dir = base_dir


def _why_not_unfoldable(node: ir.Node) -> str | None:
    """Why the ``Gemm`` ``node`` is not ``MatMul(A, W) + C`` with a constant 2-D float32 ``W``, or None."""
    w = node.inputs[1] if len(node.inputs) > 1 else None
    if w is None or w.const_value is None:
        return "its weight B is not a constant"
    if w.const_value.dtype != ir.DataType.FLOAT or len(w.const_value.shape) != 2:
        return "its weight B is not a 2-D float32 tensor"
    if node.attributes.get_int("transA", 0) or node.attributes.get_float("alpha", 1.0) != 1.0:
        return "transA=1 or alpha != 1"
    if len(node.inputs) > 2 and node.inputs[2] is not None and node.attributes.get_float("beta", 1.0) != 1.0:
        return "beta != 1"
    return None


def gemms_as_matmuls(model: ir.Model) -> tuple[int, dict[str, str]]:
    """Rewrite (in place) each constant-weight ``Gemm`` of the main graph as ``MatMul`` (+ ``Add`` of C).

    ORT's int4 quantizer quantizes ``MatMul`` nodes only; Hugging Face's ``Conv1D`` (GPT-2's attention and MLP
    projections: ``addmm(bias, x, W)`` with ``W`` stored ``[in, out]``) exports as ``Gemm(x, W, bias)``, so
    without this only GPT-2's LM head (a MatMul) would be quantized. Exact: the same products and the same bias
    add (tested <= 1e-5). A ``transB=1`` weight is stored transposed in its place when nothing else reads it.

    Returns:
        The number of Gemms rewritten and ``{node name: why not}`` for the Gemms with a constant weight left alone.
    """
    graph = model.graph
    done, left = 0, {}
    for node in [n for n in graph if n.op_type == "Gemm" and n.domain in ("", "ai.onnx")]:
        why = _why_not_unfoldable(node)
        w = node.inputs[1] if len(node.inputs) > 1 else None
        if why is None and node.attributes.get_int("transB", 0) and (not w.is_initializer() or len(list(w.uses())) != 1):
            why = "transB=1 on a weight other nodes read too"
        if why is not None:
            if w is not None and w.const_value is not None:
                left[node.name or node.outputs[0].name] = why
            continue
        if node.attributes.get_int("transB", 0):
            name = w.name
            wt = ir.Value(name=name, const_value=ir.tensor(np.ascontiguousarray(w.const_value.numpy().T), name=name))
            node.replace_input_with(1, wt)
            del graph.initializers[name]
            graph.register_initializer(wt)
            w = wt
        stem = node.name or node.outputs[0].name
        y = node.outputs[0]
        mm = ir.node("MatMul", [node.inputs[0], w], name=f"{stem}/MatMul")
        new = [mm]
        out = mm.outputs[0]
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            add = ir.node("Add", [out, node.inputs[2]], name=f"{stem}/Add")
            out.name, out.dtype = f"{stem}/MatMul_output", y.dtype
            new.append(add)
            out = add.outputs[0]
        graph.insert_before(node, new)
        replace_node_output(graph, node, y, out)
        done += 1
    return done, left


def _weight_matmuls(model: ir.Model) -> int:
    """MatMul / Gemm nodes of the main graph whose second input is a constant weight."""
    return sum(1 for n in model.graph if n.op_type in ("MatMul", "Gemm") and len(n.inputs) > 1
               and n.inputs[1] is not None and n.inputs[1].const_value is not None)


def _has_ops(model: ir.Model, ops: set[str]) -> bool:
    return any(n.op_type in ops for n in model.graph.all_nodes())


def gelu_fed_matmuls(model: ir.Model, depth: int = 4) -> list[str]:
    """Names of the constant-weight MatMuls whose activation input is a GELU output (FFN output projections).

    A GELU is an ``Erf``-based pattern (``x * 0.5 * (1 + erf(x / sqrt 2))``, as exported by torch) or a fused
    ``Gelu``/``FastGelu`` op within ``depth`` producers of the MatMul's first input, not crossing another
    MatMul/Gemm/LayerNorm/Softmax. Post-GELU activations have long positive tails: per-tensor uint8 dynamic
    quantization of them costs most of int8's accuracy on BERT-class encoders.
    """
    names = []
    for n in model.graph.all_nodes():
        if n.op_type != "MatMul" or len(n.inputs) < 2 or n.inputs[1] is None or n.inputs[1].const_value is None:
            continue
        frontier, found = [n.inputs[0]], False
        for _ in range(depth):
            nxt = []
            for v in frontier:
                p = v.producer() if v is not None else None
                if p is None or p.op_type in _STOP_OPS:
                    continue
                if p.op_type in _GELU_OPS:
                    found = True
                    break
                nxt.extend(i for i in p.inputs if i is not None and i.const_value is None)
            if found or not nxt:
                break
            frontier = nxt
        if found:
            names.append(n.name)
    return names


def _save_without_value_info(model: ir.Model, path: Path) -> None:
    """Save ``model`` with no ``value_info`` (recorded shapes): the quantizer infers them again.

    ORT 1.24's quantizer (onnxruntime-openvino 1.24.1) rewrites weight initializers but keeps their recorded
    shapes, then fails its own shape inference ("Inferred shape and existing shape differ", seen on the
    exported encoders); 1.32's does not.
    """
    import onnx

    if any(isinstance(v.const_value, ir.ExternalTensor) for g in model.graphs() for v in g.initializers.values()):
        # the weights stay in the input's data file: write them beside ``path`` (a reference to the input's
        # file would not resolve from the temporary folder), then drop the shapes from the graph alone
        ir.save(model, path, external_data=path.name + ".data")
        proto = onnx.load(path, load_external_data=False)
        del proto.graph.value_info[:]
        onnx.save_model(proto, path)
        return
    proto = ir.to_proto(model)
    del proto.graph.value_info[:]
    onnx.save_model(proto, path, save_as_external_data=proto.ByteSize() > 1_800_000_000)


def _ort_quantized(model: ir.Model, quantize) -> ir.Model:
    """``quantize(src, dst)`` on a temporary copy of ``model``; the quantized model, detached from the files.

    ``quantize`` calls an ``onnxruntime.quantization`` entry point, which works on files.
    """
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
        _save_without_value_info(model, src)
        quantize(src, dst)
        new = ir.load(dst)
        for v in new.graph.initializers.values():  # detach from the temp file before it goes
            if v.const_value is not None:
                v.const_value = ir.tensor(v.const_value.numpy(), name=v.name)
    return new


def _parse_keep_fp32(keep_fp32) -> tuple[str, ...]:
    from dyncompile.errors import PassConfigError

    if keep_fp32 in (None, "", "none"):
        return ()
    groups = tuple(keep_fp32.replace(";", "+").split("+")) if isinstance(keep_fp32, str) else tuple(keep_fp32)
    bad = [g for g in groups if g not in KEEP_FP32_GROUPS]
    if bad:
        raise PassConfigError(f"keep_fp32 must name groups among {', '.join(KEEP_FP32_GROUPS)} (or none), got {bad}")
    return groups


def _no_int8_target(model: ir.Model) -> str:
    """Why an int8 pass found no MatMul to quantize: the counts, and int8 weights the graph already holds."""
    g = model.graph
    matmuls = [n for n in g.all_nodes() if n.op_type == "MatMul"]
    const = sum(1 for n in matmuls if len(n.inputs) == 2 and n.inputs[1] is not None and n.inputs[1].const_value is not None
                and n.inputs[1].const_value.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16))
    int8 = [v for v in g.initializers.values() if v.const_value is not None
            and v.const_value.dtype in (ir.DataType.INT8, ir.DataType.UINT8) and v.const_value.size >= 1024]
    reason = f"{const} of the {len(matmuls)} MatMul nodes read a float weight initializer"
    if int8:
        reason += (f"; the model already stores {len(int8)} weights in int8 (e.g. {int8[0].name!r}) and dequantizes "
                   "them in the graph: it is quantized already")
    return reason


def _weight_matmuls_to_quantize(model: ir.Model, skip: set[str], dtypes: tuple[ir.DataType, ...]
                                ) -> list[tuple[ir.Node, ir.Value]]:
    """The ``(MatMul, weight)`` pairs an int8 pass that rewrites the graph itself quantizes.

    Main graph only; the weight is a 2-D initializer of one of ``dtypes``; nodes named in ``skip`` are left out.
    """
    g = model.graph
    targets = []
    for node in g:
        w = node.inputs[1] if node.op_type == "MatMul" and len(node.inputs) == 2 else None
        if w is None or w.const_value is None or node.name in skip or w.name not in g.initializers:
            continue
        if len(w.const_value.shape) == 2 and w.const_value.dtype in dtypes:
            targets.append((node, w))
    return targets


#: the largest int8 weight of ORT's reduced range (``reduce_range=True``: [-64, 64]): a u8 x s8 product pair
#: stays within int16 (2 x 255 x 64 = 32,640 <= 32,767), so CPUs without VNNI do not saturate
REDUCED_WEIGHT_MAX = 64


def weight_qmax(reduce_range: bool) -> int:
    """The largest symmetric int8 weight: 127, or 64 with ``reduce_range`` (ORT's reduced int8 range)."""
    return REDUCED_WEIGHT_MAX if reduce_range else 127


def _int8_weight(a: np.ndarray, per_channel: bool = True, qmax: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 ``(q, scale)`` of the float weight ``a`` ``[in, out]``: one scale per output column (or one).

    Values in ``[-qmax, qmax]``.
    """
    amax = np.abs(a).max(axis=0) if per_channel else np.abs(a).max(keepdims=True)
    scale = (np.maximum(amax, 1e-12) / float(qmax)).astype(np.float32)
    return np.clip(np.rint(a / scale), -qmax, qmax).astype(np.int8), scale


def resolve_reduce_range(reduce_range: bool | str, provider: str | None) -> bool:
    """``reduce_range`` as an int8 pass takes it (True: 7-bit weights, ORT's reduced range).

    ``"auto"`` is True where the int8 MatMuls will run on the CPU EP of a CPU whose u8 x s8 kernels saturate (x86
    without VNNI: :func:`~dyncompile.runtime.providers.int8_pairs_saturate`), judged on the compiling machine (the
    plan records the choice; ``dyncompile.load`` warns where a plan with 8-bit weights runs on such a CPU).
    """
    if reduce_range == "auto":
        from dyncompile.runtime.providers import int8_pairs_saturate

        chosen = (provider or "cpu") == "cpu" and int8_pairs_saturate()
        if chosen:
            logger.info("quantize-int8: this CPU has no VNNI (ONNX Runtime's int8 kernels add u8 x s8 pairs in int16 "
                        "with saturation): 7-bit weights (reduce_range=true); reduce_range=false keeps 8 bits")
        return chosen
    if not isinstance(reduce_range, bool):
        from dyncompile.errors import PassConfigError

        raise PassConfigError(f"quantize-int8 reduce_range is true, false or auto, got {reduce_range!r}")
    return reduce_range


def _rr_repr(reduce_range: bool) -> str:
    """The repr part the runtime reads (``reduce_range=True``: 7-bit weights, no saturation)."""
    return ", reduce_range=True" if reduce_range else ""


def _fp32_repr(keep_fp32: tuple[str, ...], exclude_nodes: tuple[str, ...]) -> str:
    """The ``keep_fp32`` / ``exclude_nodes`` part of an int8 pass's repr (empty when neither is set)."""
    keep = f", keep_fp32={'+'.join(keep_fp32)!r}" if keep_fp32 else ""
    return keep + (f", exclude_nodes=<{len(exclude_nodes)} names>" if exclude_nodes else "")


def _fp32_names(model: ir.Model, keep_fp32: tuple[str, ...], exclude_nodes: tuple[str, ...]) -> list[str]:
    """The MatMuls an int8 pass leaves in fp32: the ``keep_fp32`` groups', then the named ones, without repeats."""
    groups = gelu_fed_matmuls(model) if "ffn-out" in keep_fp32 else []
    return list(dict.fromkeys([*groups, *exclude_nodes]))


class QuantizeDynamicInt8Pass(ir.passes.InPlacePass):
    """Dynamic int8 quantization of MatMul weights (``onnxruntime.quantization.quantize_dynamic``).

    Scope: main graph and subgraphs (whatever ORT's quantizer handles).
    Invariants: graph inputs/outputs unchanged; activations quantized on the fly (DynamicQuantizeLinear +
    MatMulInteger), weights stored as int8 (``per_channel`` optional). ``keep_fp32="ffn-out"`` leaves the
    MatMuls fed by a GELU (the FFN output projections, :func:`gelu_fed_matmuls`) in fp32. Records
    ``dyncompile.quantized`` in the metadata. Idempotent: a graph that already holds int8 MatMuls is left
    alone (``modified=False``).
    Sketch: ``MatMul(x, W) -> MatMulInteger(DynamicQuantizeLinear(x), q(W)) * scales``.
    """

    def __init__(
        self,
        per_channel: bool = False,
        reduce_range: bool = False,
        op_types: tuple[str, ...] = ("MatMul",),
        keep_fp32: str | tuple[str, ...] | None = None,
        exclude_nodes: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.per_channel = bool(per_channel)
        self.reduce_range = bool(reduce_range)
        self.op_types = tuple(op_types)
        self.keep_fp32 = _parse_keep_fp32(keep_fp32)
        self.exclude_nodes = tuple(exclude_nodes)

    def __repr__(self) -> str:
        keep = _fp32_repr(self.keep_fp32, self.exclude_nodes)
        rr = _rr_repr(self.reduce_range)
        return f"QuantizeDynamicInt8Pass(per_channel={self.per_channel}{rr}, op_types={list(self.op_types)}{keep})"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _has_ops(model, INT8_OPS):
            return ir.passes.PassResult(model, modified=False)
        from onnxruntime.quantization import QuantType, quantize_dynamic

        exclude = _fp32_names(model, self.keep_fp32, self.exclude_nodes)
        new = _ort_quantized(model, lambda src, dst: quantize_dynamic(
            src, dst, op_types_to_quantize=list(self.op_types), per_channel=self.per_channel,
            reduce_range=self.reduce_range, weight_type=QuantType.QInt8, nodes_to_exclude=exclude,
            # a contrib op's output (fuse-encoder-attention's MultiHeadAttention) has no type from ONNX shape
            # inference; the MatMuls quantized here are float32
            extra_options={"DefaultTensorType": int(ir.DataType.FLOAT)}))
        modified = _has_ops(new, INT8_OPS)
        if not modified:
            return not_fired(model, "quantize-int8", _no_int8_target(model), "leave quantize-int8 out for this model")
        if modified:
            _replace_contents(model, new)
            model.metadata_props[_keys.QUANTIZED] = json.dumps(
                {"scheme": "int8-dynamic", "per_channel": self.per_channel, "reduce_range": self.reduce_range,
                 "keep_fp32": list(self.keep_fp32), "fp32_matmuls_kept": len(exclude)}
            )
        logger.info(
            "int8: %d MatMulInteger nodes, %d MatMuls kept in fp32 (%s)",
            sum(n.op_type == "MatMulInteger" for n in model.graph.all_nodes()), len(exclude), "+".join(self.keep_fp32) or "-",
        )
        return ir.passes.PassResult(model, modified=modified)


#: the size of the Gelu function's most negative value, rounded up (exact erf form -0.169971, tanh form -0.170041)
GELU_FLOOR = 0.171


def _is_gelu_output(x: ir.Value) -> bool:
    """``x`` is produced by one ``Gelu`` kernel (ONNX's or ``com.microsoft``'s), so ``x >= -GELU_FLOOR``."""
    p = x.producer()
    return p is not None and p.op_type == "Gelu" and p.domain in ("", "ai.onnx", "com.microsoft")


class _PerTokenRewrite:
    """The nodes :func:`quantize_per_token` writes; the graph's shared constants are made once, here."""

    def __init__(self, model: ir.Model, integer_to_float: bool, weight_max: int = 127) -> None:
        self.g = model.graph
        self.weight_max = int(weight_max)
        opset = default_opset(model)
        self.blocked = opset >= 21  # QuantizeLinear with one block per row of x as it is (no 2-D view)
        self.rows = 15 <= opset < 21  # QuantizeLinear over the rows of a 2-D view (Shape's start/end: opset 15)
        self.inv127 = self.const("dyncompile_pt_inv127", np.array(1.0 / 127.0, np.float32))
        self.eps = self.const("dyncompile_pt_eps", np.array(1e-12, np.float32))
        self.gelu_floor: ir.Value | None = None  # made when a Gelu output is quantized (row_scale)
        self.zp = self.const("dyncompile_pt_zero_point", np.array(128, np.uint8))
        self.unit_scale = None
        if integer_to_float:
            self.unit_scale = self.const("dyncompile_pt_unit_scale", np.array(1.0, np.float32))
            model.opset_imports.setdefault("com.microsoft", 1)
        self.axes = self.const("dyncompile_pt_axes", np.array([-1], np.int64)) if opset >= 18 else None
        self.zp_of_scale: ir.Value | None = None  # made by the blocked quantizer (quantize_activation)
        if self.rows:
            self.zp_rows = self.const("dyncompile_pt_zero_point_rows", np.array([128], np.uint8))
            self.one = self.const("dyncompile_pt_axis1", np.array([1], np.int64))
        if not (self.rows or self.blocked):
            self.off = self.const("dyncompile_pt_offset", np.array(128.0, np.float32))
        #: activation -> (u8 x, its row scale, x's leading shape when x was viewed as 2-D)
        self.quantized: dict[ir.Value, tuple[ir.Value, ir.Value, ir.Value | None]] = {}
        self.weights: dict[str, tuple[ir.Value, ir.Value]] = {}

    def const(self, name: str, arr: np.ndarray) -> ir.Value:
        return add_initializer(self.g, name, arr)

    def row_scale(self, stem: str, v: ir.Value, keepdims: int, gelu: bool = False) -> list[ir.Node]:
        """``max(max |v| over the last axis / 127, eps)``: Abs, ReduceMax, Mul, Max (the scale is the last output).

        ``gelu``: ``v`` is a ``Gelu`` output, which is never below ``-GELU_FLOOR`` (-0.16997 exact, -0.17004 tanh
        form); ``max(max v / 127, GELU_FLOOR / 127)`` is then ``max |v| / 127`` whenever a row's largest value
        reaches ``GELU_FLOOR`` (its negatives are smaller in size), and a coarser grid that still clips nothing in
        a row that does not: no ``Abs`` pass over the activation (the same bytes on real rows, tested).
        """
        nodes = []
        if not gelu:
            nodes.append(ir.node("Abs", [v], name=f"{stem}/pt_abs"))
            v = nodes[-1].outputs[0]
        if self.axes is not None:
            rm = ir.node("ReduceMax", [v, self.axes], attributes={"keepdims": keepdims}, name=f"{stem}/pt_max")
        else:
            rm = ir.node("ReduceMax", [v], attributes={"axes": [-1], "keepdims": keepdims}, name=f"{stem}/pt_max")
        sc = ir.node("Mul", [rm.outputs[0], self.inv127], name=f"{stem}/pt_scale0")
        if gelu and self.gelu_floor is None:
            self.gelu_floor = self.const("dyncompile_pt_gelu_floor", np.array(GELU_FLOOR / 127.0, np.float32))
        floor = self.gelu_floor if gelu else self.eps
        return [*nodes, rm, sc, ir.node("Max", [sc.outputs[0], floor], name=f"{stem}/pt_scale")]

    def quantize_activation(self, stem: str, x: ir.Value, k: int) -> list[ir.Node]:
        """The nodes that quantize ``x`` per row (recorded in :attr:`quantized`)."""
        gelu = _is_gelu_output(x)
        if self.blocked:
            # one scale per row of x, keepdims: opset 21's blocked QuantizeLinear (block = the last axis) takes
            # it as it is, and MatMulInteger's [.., rows, n] output is scaled by it by broadcasting: the bytes of
            # the 2-D view below, five kernels fewer (tested)
            new = self.row_scale(stem, x, 1, gelu=gelu)
            s = new[-1].outputs[0]
            # the zero points (128 per row, shaped like s) in one kernel: s quantized with a scale so large that
            # every row rounds to 0, plus 128 (instead of Shape + Expand of a constant)
            if self.zp_of_scale is None:
                self.zp_of_scale = self.const("dyncompile_pt_zero_point_scale", np.array(1e30, np.float32))
            z = ir.node("QuantizeLinear", [s, self.zp_of_scale, self.zp], name=f"{stem}/pt_zero_points")
            q = ir.node("QuantizeLinear", [x, s, z.outputs[0]], attributes={"axis": -1, "block_size": k},
                        name=f"{stem}/pt_quant")
            self.quantized[x] = (q.outputs[0], s, None)
            return [*new, z, q]
        if self.rows:
            # x as [rows, k]; one scale per row; QuantizeLinear's per-axis form (axis 0) rounds x / s half to
            # even and adds the zero point in one pass: the same bytes as Div, Round, Add, Cast (tested)
            flat = self.const(f"{stem}/pt_rows_shape", np.array([-1, k], np.int64))
            x2 = ir.node("Reshape", [x, flat], name=f"{stem}/pt_rows")
            new = [x2, *self.row_scale(stem, x2.outputs[0], 0, gelu=gelu)]
            s = new[-1].outputs[0]
            n_rows = ir.node("Shape", [s], name=f"{stem}/pt_nrows")
            z = ir.node("Expand", [self.zp_rows, n_rows.outputs[0]], name=f"{stem}/pt_zero_points")
            q = ir.node("QuantizeLinear", [x2.outputs[0], s, z.outputs[0]], attributes={"axis": 0},
                        name=f"{stem}/pt_quant")
            col = ir.node("Unsqueeze", [s, self.one], name=f"{stem}/pt_scale_col")
            lead = ir.node("Shape", [x], attributes={"start": 0, "end": -1}, name=f"{stem}/pt_lead")
            self.quantized[x] = (q.outputs[0], col.outputs[0], lead.outputs[0])
            return [*new, n_rows, z, q, col, lead]
        new = self.row_scale(stem, x, 1, gelu=gelu)
        s = new[-1].outputs[0]
        d = ir.node("Div", [x, s], name=f"{stem}/pt_div")
        r = ir.node("Round", [d.outputs[0]], name=f"{stem}/pt_round")
        o = ir.node("Add", [r.outputs[0], self.off], name=f"{stem}/pt_offset")
        q = ir.node("Cast", [o.outputs[0]], attributes={"to": int(ir.DataType.UINT8)}, name=f"{stem}/pt_quant")
        self.quantized[x] = (q.outputs[0], s, None)
        return [*new, d, r, o, q]

    def product(self, stem: str, x: ir.Value, w: ir.Value) -> list[ir.Node]:
        """The int8 product of quantized ``x`` and weight ``w``, scaled back (its output is the last node's)."""
        xq, s_row, lead = self.quantized[x]
        if w.name not in self.weights:
            wq, sw = _int8_weight(w.const_value.numpy().astype(np.float32), qmax=self.weight_max)
            self.weights[w.name] = (self.const(f"{w.name}_int8pt", wq), self.const(f"{w.name}_int8pt_scale", sw))
        wq_v, sw_v = self.weights[w.name]
        if self.unit_scale is not None:
            mw = ir.node("MatMulIntegerToFloat", [xq, wq_v, self.unit_scale, sw_v, self.zp], domain="com.microsoft",
                         name=f"{stem}/pt_matmul")
            new = [mw]
        else:
            mm = ir.node("MatMulInteger", [xq, wq_v, self.zp], name=f"{stem}/pt_matmul")
            cf = ir.node("Cast", [mm.outputs[0]], attributes={"to": int(ir.DataType.FLOAT)}, name=f"{stem}/pt_float")
            mw = ir.node("Mul", [cf.outputs[0], sw_v], name=f"{stem}/pt_wscale")
            new = [mm, cf, mw]
        new.append(ir.node("Mul", [mw.outputs[0], s_row], name=f"{stem}/pt_xscale"))
        if lead is not None:  # back to x's leading dims
            n_out = self.const(f"{stem}/pt_out_width", np.array([w.const_value.shape[1]], np.int64))
            shape = ir.node("Concat", [lead, n_out], attributes={"axis": 0}, name=f"{stem}/pt_out_shape")
            new += [shape, ir.node("Reshape", [new[-1].outputs[0], shape.outputs[0]], name=f"{stem}/pt_unrows")]
        return new


def quantize_per_token(model: ir.Model, targets: Sequence[tuple[ir.Node, ir.Value]], integer_to_float: bool = False,
                       reduce_range: bool = False) -> int:
    """Rewrite ``targets`` (``(MatMul, 2-D float weight)`` pairs) as per-token int8; returns the activations quantized.

    The rewrite of :class:`QuantizeDynamicInt8PerTokenPass` (its docstring has the arithmetic); MatMuls that
    read one activation share its quantization. With ``integer_to_float``, ``MatMulInteger`` -> ``Cast`` ->
    ``Mul(weight scale)`` is one ``com.microsoft.MatMulIntegerToFloat`` (A's scale 1, B's the weight scale): the
    same bytes. With ``reduce_range`` the weights are in ORT's reduced int8 range ``[-64, 64]`` (no saturation on
    CPUs without VNNI). No targets: the graph is left as it is.
    """
    if not targets:
        return 0
    rw = _PerTokenRewrite(model, integer_to_float, weight_qmax(reduce_range))
    g = model.graph
    for i, (node, w) in enumerate(targets):
        x, y = node.inputs[0], node.outputs[0]
        stem = node.name or f"dyncompile_matmul_{i}"
        new = [] if x in rw.quantized else rw.quantize_activation(stem, x, w.const_value.shape[0])
        new += rw.product(stem, x, w)
        g.insert_before(node, new)
        replace_node_output(g, node, y, new[-1].outputs[0])
    for name in [n for n in rw.weights if n in g.initializers and not list(g.initializers[n].uses())]:
        del g.initializers[name]
    return len(rw.quantized)


class QuantizeDynamicInt8PerTokenPass(ir.passes.InPlacePass):
    """Dynamic int8 with one activation scale per token (row) and one weight scale per output channel.

    ORT's ``quantize_dynamic`` (:class:`QuantizeDynamicInt8Pass`) scales a MatMul's whole activation tensor with
    one range (``DynamicQuantizeLinear``), so one token with a large value coarsens every other token's grid;
    on MPNet-base that flips ~3 % of answers. Here each row of the activation gets its own symmetric scale
    (``max |x_row| / 127``), the LLM.int8 / SmoothQuant "per-token" granularity, and the product is still one
    ``MatMulInteger`` on the CPU's int8 GEMM.

    Scope: MatMuls of the main graph whose second input is a 2-D float initializer (as the other int8 passes;
    ``exclude_nodes`` and ``keep_fp32="ffn-out"`` stay fp32). MatMuls that read the same activation share its
    quantization.
    Invariants: graph inputs/outputs unchanged; weights stored as int8 (symmetric, per output channel);
    ``y = (MatMulInteger(u8(round(x / s) + 128), Wq, zero point 128) * w_scale) * s`` with
    ``s = max(|x| over the last axis, keepdims) / 127`` (the weight scale is multiplied first: ORT's
    ``MatMulIntegerToFloat`` fusion of MatMulInteger -> Cast -> Mul -> Add(bias) reads a Mul by a product of
    two scales as one scale and gets the per-row one wrong — tested at ORT_ENABLE_ALL against the emulation).
    For a ``Gelu`` output, never below -0.171, ``s = max(max x, 0.171) / 127``: no ``Abs`` pass over the
    activation, the same bytes for every row whose largest value reaches 0.171 (tested).
    From opset 15 the quantization is one ``QuantizeLinear`` over the rows of a 2-D view of ``x`` (per-axis
    scales and zero points, axis 0) instead of ``Div``, ``Round``, ``Add`` and ``Cast``: the same bytes (tested
    against the opset-14 chain), one pass over the activation instead of four (MPNet-base's FFN output, 43
    tokens: 1.1-1.2x the whole per-token MatMul); from opset 21 a blocked ``QuantizeLinear`` (one block per
    row of ``x`` as it is) needs no 2-D view and no shape arithmetic around it, six kernels fewer (the same bytes;
    ``raise-opset`` declares 21 for the CPU EP). With ``integer_to_float`` (the factory sets it for the CPU EP)
    ``MatMulInteger`` -> ``Cast`` -> ``Mul(w_scale)`` is one ``com.microsoft.MatMulIntegerToFloat`` (A's scale 1,
    B's ``w_scale``): the same bytes, two kernels fewer. ``reduce_range``: weights in ``[-64, 64]`` (scale
    ``max |w| / 64``), ORT's reduced range, so x86 CPUs without VNNI add u8 x s8 pairs without saturating.
    Records ``dyncompile.quantized``.
    Idempotent: a graph that already holds int8 MatMuls is left alone (``modified=False``).
    """

    def __init__(self, keep_fp32: str | tuple[str, ...] | None = None, exclude_nodes: Sequence[str] = (),
                 integer_to_float: bool = False, reduce_range: bool = False) -> None:
        super().__init__()
        self.keep_fp32 = _parse_keep_fp32(keep_fp32)
        self.exclude_nodes = tuple(exclude_nodes)
        self.integer_to_float = bool(integer_to_float)
        self.reduce_range = bool(reduce_range)

    def _repr_tail(self) -> str:
        return (", integer_to_float=True" if self.integer_to_float else "") + _rr_repr(self.reduce_range)

    def __repr__(self) -> str:
        return (f"QuantizeDynamicInt8PerTokenPass({_fp32_repr(self.keep_fp32, self.exclude_nodes).lstrip(', ')}"
                f"{self._repr_tail()})")

    def _targets(self, model: ir.Model) -> tuple[list[tuple[ir.Node, ir.Value]], list[str]]:
        exclude = _fp32_names(model, self.keep_fp32, self.exclude_nodes)
        return _weight_matmuls_to_quantize(model, set(exclude), (ir.DataType.FLOAT,)), exclude

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        opset = default_opset(model)
        if opset < 13 and not _has_ops(model, INT8_OPS) and self._targets(model)[0]:
            raise ir.passes.PreconditionError(
                f"per-token int8 (Round, ReduceMax) needs opset >= 13, the model imports opset {opset}; re-export "
                "with opset >= 13 or use quantize-int8{format=dynamic}"
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _has_ops(model, INT8_OPS):
            return ir.passes.PassResult(model, modified=False)
        targets, exclude = self._targets(model)
        if not targets:
            return not_fired(model, "quantize-int8", _no_int8_target(model), "leave quantize-int8 out for this model")
        return self._quantize(model, targets, exclude)

    def _quantize(self, model: ir.Model, targets: list[tuple[ir.Node, ir.Value]], exclude: list[str]
                  ) -> ir.passes.PassResult:
        """Quantize ``targets`` (the float-weight MatMuls not in ``exclude``) and record the scheme."""
        n_act = quantize_per_token(model, targets, self.integer_to_float, self.reduce_range)
        model.metadata_props[_keys.QUANTIZED] = json.dumps(
            {"scheme": "int8-dynamic-per-token", "per_channel": True, "reduce_range": self.reduce_range,
             "keep_fp32": list(self.keep_fp32), "fp32_matmuls_kept": len(exclude)}
        )
        logger.info("int8 per-token: %d MatMulInteger nodes (%d activations quantized), %d MatMuls kept in fp32",
                    len(targets), n_act, len(exclude))
        return ir.passes.PassResult(model, modified=True)


class QuantizeDynamicInt8MixedPass(QuantizeDynamicInt8PerTokenPass):
    """Dynamic int8: per-token activation scales where a GELU feeds the MatMul, ORT's per-tensor ones elsewhere.

    The answers per-tensor int8 flips come from the FFN output projections: their input is a GELU output with a
    long positive tail, so one tensor-wide range is coarse for most tokens (MPNet-base: 96.2 % agreement with
    fp32 on movie-calib per-tensor, 98.75 % with per-token scales on those 12 MatMuls alone, 98.95 % with
    per-token scales everywhere). Those MatMuls (:func:`gelu_fed_matmuls`) get the per-token rewrite
    (:func:`quantize_per_token`); the others keep ORT's ``quantize_dynamic`` kernels (``DynamicQuantizeLinear``
    fused with the GEMM), which the per-token arithmetic cannot use — so most of the per-tensor speed stays.

    Scope: as :class:`QuantizeDynamicInt8Pass` (per-channel weights) for the non-GELU-fed MatMuls and
    :class:`QuantizeDynamicInt8PerTokenPass` for the GELU-fed ones; ``exclude_nodes`` stay fp32.
    Invariants: graph inputs/outputs unchanged; records ``dyncompile.quantized`` (scheme
    ``int8-dynamic-mixed``). Idempotent: a graph that already holds int8 MatMuls is left alone
    (``modified=False``).
    """

    def __init__(self, exclude_nodes: Sequence[str] = (), integer_to_float: bool = False,
                 reduce_range: bool = False) -> None:
        super().__init__(exclude_nodes=exclude_nodes, integer_to_float=integer_to_float, reduce_range=reduce_range)

    def __repr__(self) -> str:
        return f"QuantizeDynamicInt8MixedPass({_fp32_repr((), self.exclude_nodes).lstrip(', ')}{self._repr_tail()})"

    def _quantize(self, model: ir.Model, targets: list[tuple[ir.Node, ir.Value]], exclude: list[str]
                  ) -> ir.passes.PassResult:
        """ORT's per-tensor int8 for ``targets`` a GELU does not feed, then the per-token rewrite for the rest."""
        gelu_fed = [n for n in gelu_fed_matmuls(model) if n not in self.exclude_nodes]
        if any(node.name not in gelu_fed for node, _ in targets):
            QuantizeDynamicInt8Pass(per_channel=True, reduce_range=self.reduce_range,
                                    exclude_nodes=(*gelu_fed, *self.exclude_nodes))(model)
        by_name = {n.name: n for n in model.graph}  # ORT's rewrite replaced the graph: look the MatMuls up again
        per_token = [(by_name[n], by_name[n].inputs[1]) for n in gelu_fed if n in by_name]
        n_act = quantize_per_token(model, per_token, self.integer_to_float, self.reduce_range)
        model.metadata_props[_keys.QUANTIZED] = json.dumps(
            {"scheme": "int8-dynamic-mixed", "per_channel": True, "reduce_range": self.reduce_range,
             "per_token_matmuls": len(per_token),
             "keep_fp32": [], "fp32_matmuls_kept": len(exclude)}
        )
        logger.info("int8 mixed: %d GELU-fed MatMuls per-token (%d activations), the rest per-tensor, %d kept in fp32",
                    len(per_token), n_act, len(exclude))
        return ir.passes.PassResult(model, modified=_has_ops(model, INT8_OPS))


class QuantizeWeightsInt8Pass(ir.passes.InPlacePass):
    """Weight-only int8 in QDQ form: ``MatMul(x, DequantizeLinear(q(W), scale, 0))``, activations stay float.

    Symmetric int8 weights, one scale per output channel (``per_channel=False``: one per matrix). This is the
    form OpenVINO compiles into ``FullyConnectedCompressed`` (int8 weights decompressed inside the GEMM: half
    the memory traffic of fp32 weights); ORT's dynamic-int8 ``MatMulInteger`` graph is run there as an fp32
    GEMM plus conversions, slower than fp32. ORT's CPU EP, conversely, dequantizes the weights on every call
    (slower than fp32): :func:`choose_int8_format` picks per provider.

    Scope: main graph; MatMuls whose second input is a 2-D float initializer (``keep_fp32="ffn-out"`` skips
    the GELU-fed ones). Invariants: graph inputs/outputs unchanged; every other node unchanged; each quantized
    MatMul gets its DequantizeLinear right before it (a staged cut never separates them). Records
    ``dyncompile.quantized``. Idempotent: a model with that key is left alone (``modified=False``).
    Precondition (``requires``, checked before anything changes): opset >= 13 when there is a MatMul to quantize.
    """

    def __init__(self, per_channel: bool = True, keep_fp32: str | tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.per_channel = bool(per_channel)
        self.keep_fp32 = _parse_keep_fp32(keep_fp32)

    def __repr__(self) -> str:
        keep = f", keep_fp32={'+'.join(self.keep_fp32)!r}" if self.keep_fp32 else ""
        return f"QuantizeWeightsInt8Pass(per_channel={self.per_channel}{keep})"

    def _targets(self, model: ir.Model) -> tuple[list[tuple[ir.Node, ir.Value]], set[str]]:
        """The MatMuls to quantize with their weights (2-D float initializers), and the names kept in fp32."""
        exclude = set(gelu_fed_matmuls(model)) if "ffn-out" in self.keep_fp32 else set()
        return _weight_matmuls_to_quantize(model, exclude, (ir.DataType.FLOAT, ir.DataType.FLOAT16)), exclude

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        if _keys.QUANTIZED in model.metadata_props:
            return
        opset = default_opset(model)
        if opset < 13 and self._targets(model)[0]:
            raise ir.passes.PreconditionError(
                f"weight-only int8 (per-channel DequantizeLinear) needs opset >= 13, the model imports opset {opset};"
                " re-export with opset >= 13 or use quantize-int8{format=dynamic}"
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _keys.QUANTIZED in model.metadata_props:
            return ir.passes.PassResult(model, modified=False)
        g = model.graph
        targets, exclude = self._targets(model)
        done: dict[str, tuple[ir.Value, ir.Value, ir.Value]] = {}
        count = 0
        for node, w in targets:
            arr = w.const_value.numpy()
            if w.name not in done:
                q, scale = _int8_weight(arr.astype(np.float32), self.per_channel)
                shape = scale.shape if self.per_channel else ()
                vals = (
                    ir.val(f"{w.name}.int8", const_value=ir.tensor(q, name=f"{w.name}.int8")),
                    ir.val(f"{w.name}.scale", const_value=ir.tensor(scale.reshape(shape), name=f"{w.name}.scale")),
                    ir.val(f"{w.name}.zero", const_value=ir.tensor(np.zeros(shape, np.int8), name=f"{w.name}.zero")),
                )
                for v in vals:
                    g.register_initializer(v)
                done[w.name] = vals
            attrs = {"axis": 1} if self.per_channel else {}
            dq = ir.node("DequantizeLinear", list(done[w.name]), attrs, name=f"{node.name}.dequantize_weight")
            dq.outputs[0].name = f"{w.name}.dequantized.{count}"
            dq.outputs[0].dtype, dq.outputs[0].shape = ir.DataType.FLOAT, ir.Shape(list(arr.shape))
            if arr.dtype == np.float16:
                dq.outputs[0].dtype = ir.DataType.FLOAT16  # DequantizeLinear's output type follows the scale
            g.insert_before(node, dq)
            node.replace_input_with(1, dq.outputs[0])
            if not w.uses() and not w.is_graph_output() and w not in g.inputs:
                g.initializers.pop(w.name)
            count += 1
        if not count:
            return not_fired(model, "quantize-int8", _no_int8_target(model), "leave quantize-int8 out for this model")
        model.metadata_props[_keys.QUANTIZED] = json.dumps(
            {"scheme": "int8-weights-qdq", "per_channel": self.per_channel, "keep_fp32": list(self.keep_fp32),
             "fp32_matmuls_kept": len(exclude), "int8_matmuls": count}
        )
        logger.info("int8 weights (QDQ): %d MatMuls, %d kept in fp32", count, len(exclude))
        return ir.passes.PassResult(model, modified=True)


class _FeedsReader:
    """``onnxruntime.quantization.CalibrationDataReader`` over fixed feeds (only the model's inputs)."""

    def __init__(self, feeds: Sequence[dict[str, np.ndarray]], inputs: set[str]) -> None:
        self._it = iter([{k: v for k, v in f.items() if k in inputs} for f in feeds])

    def get_next(self):
        """The next feed dict, or None when done (the reader protocol)."""
        return next(self._it, None)


def _quantize_static(src: Path, dst: Path, reader, names: list[str], per_channel: bool, symmetric: bool,
                     reduce_range: bool = False) -> None:
    """ORT's ``quantize_static`` on the MatMuls ``names``: QDQ, their outputs left float.

    MinMax activation ranges (uint8, or int8 when ``symmetric``), symmetric int8 weights (``[-64, 64]`` with
    ``reduce_range``).
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    quantize_static(
        src, dst, reader, quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"], nodes_to_quantize=names,
        per_channel=per_channel, reduce_range=reduce_range,
        activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
        weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax,
        extra_options={"ActivationSymmetric": symmetric, "WeightSymmetric": True,
                       "OpTypesToExcludeOutputQuantization": ["MatMul"], "DefaultTensorType": int(ir.DataType.FLOAT)},
    )


def _float_for_other_readers(model: ir.Model, quantized: set[str]) -> int:
    """Rewire every reader of a quantized activation other than the MatMuls ``quantized`` to the float tensor.

    ORT's QDQ quantizer replaces a quantized tensor for *all* its readers: in a post-LN encoder the residual ``Add``
    after a LayerNorm, and a fallback MatMul sharing the activation with a quantized one, would read int8-rounded
    values (measured on MiniLM-L6: 97.8 % agreement with fp32 on movie-calib with the residual quantized). Returns
    how many uses were rewired.
    """
    done = 0
    for dq in [n for n in model.graph if n.op_type == "DequantizeLinear"]:
        q = dq.inputs[0].producer() if dq.inputs[0] is not None else None
        if q is None or q.op_type != "QuantizeLinear":
            continue
        for u in list(dq.outputs[0].uses()):
            if not (u.node.op_type == "MatMul" and u.node.name in quantized):
                u.node.replace_input_with(u.idx, q.inputs[0])
                done += 1
    return done


class QuantizeStaticInt8Pass(ir.passes.InPlacePass):
    """Static int8 in QDQ form with calibrated activation ranges (``onnxruntime.quantization.quantize_static``).

    Every constant-weight MatMul (2-D float initializer) not in ``exclude_nodes`` reads
    ``DequantizeLinear(QuantizeLinear(x, s_x, z_x))`` and ``DequantizeLinear(q(W), s_W, 0)``: int8 weights
    (symmetric, one scale per output channel unless ``per_channel=False``) and activations with a fixed range
    from ONNX Runtime's MinMax calibrator over ``feeds``: uint8 with a zero point (the default), or symmetric int8
    (``symmetric_activations=True``, ``s_x = max|x| / 127``). The MatMul outputs stay float, so the CPU EP fuses
    each ``DQ, DQ -> MatMul`` into ``MatMulIntegerToFloat``; measured on MiniLM-L6 (ORT 1.32, x86): uint8
    activations fuse all 36 MatMuls (~2.1x fp32), symmetric int8 only the 12 whose activation has one reader
    (0.5x fp32 per-channel: the rest dequantize their weights on every call). OpenVINO reads QDQ as its native
    int8 format. Activation-times-activation MatMuls (attention scores) stay float, and so does every other reader
    of a quantized activation (the residual ``Add`` after a LayerNorm, a fallback MatMul): ORT's quantizer hands
    them the int8-rounded tensor, this pass gives them the float one back.

    ``reduce_range``: weights in ORT's reduced range ``[-64, 64]`` (no saturated u8 x s8 pairs on CPUs without VNNI).

    Scope: main graph. Invariants: graph inputs/outputs unchanged. Records ``dyncompile.quantized``
    (``scheme=int8-static-qdq``). Idempotent: a model with that key or with QuantizeLinear nodes is left alone.
    """

    def __init__(self, feeds: Sequence[dict[str, np.ndarray]], per_channel: bool = True,
                 exclude_nodes: Sequence[str] = (), symmetric_activations: bool = False,
                 reduce_range: bool = False) -> None:
        super().__init__()
        self.feeds = list(feeds)
        self.reduce_range = bool(reduce_range)
        self.symmetric_activations = bool(symmetric_activations)
        self.per_channel = bool(per_channel)
        self.exclude_nodes = tuple(exclude_nodes)

    def __repr__(self) -> str:
        ex = f", exclude_nodes=<{len(self.exclude_nodes)} names>" if self.exclude_nodes else ""
        return (f"QuantizeStaticInt8Pass(per_channel={self.per_channel}, symmetric_activations="
                f"{self.symmetric_activations}{_rr_repr(self.reduce_range)}, feeds={len(self.feeds)} batches{ex})")

    def requires(self, model: ir.Model) -> None:
        """Refuse missing calibration feeds or an opset without per-axis QDQ before anything changes."""
        if _keys.QUANTIZED in model.metadata_props:
            return
        if not self.feeds:
            raise ir.passes.PreconditionError("static int8 needs calibration feeds: pass --calib FILE.jsonl")
        opset = default_opset(model)
        if opset < 13:
            raise ir.passes.PreconditionError(
                f"static int8 (per-channel QDQ) needs opset >= 13, the model imports opset {opset}; re-export with "
                "opset >= 13 or use quantize-int8{format=dynamic}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _keys.QUANTIZED in model.metadata_props or _has_ops(model, {"QuantizeLinear", *INT8_OPS}):
            return ir.passes.PassResult(model, modified=False)
        from dyncompile.passes.quantize_search import quant_targets

        excluded = set(self.exclude_nodes)
        names = [t.node for t in quant_targets(model) if t.node not in excluded]
        if not names:
            return not_fired(model, "quantize-int8", _no_int8_target(model) if not excluded else
                             f"every one of the {len(excluded)} constant-weight MatMuls is kept in fp32",
                             "leave quantize-int8 out for this model")
        reader = _FeedsReader(self.feeds, {v.name for v in model.graph.inputs})
        quiet = logging.getLogger()  # ORT's quantizer advises pre-processing on the root logger
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            new = _ort_quantized(model, lambda src, dst: _quantize_static(
                src, dst, reader, names, self.per_channel, self.symmetric_activations, self.reduce_range))
        finally:
            quiet.setLevel(level)
        _float_for_other_readers(new, set(names))
        count = sum(1 for n in new.graph if n.op_type == "DequantizeLinear" and n.inputs[0] is not None
                    and n.inputs[0].const_value is not None)
        _replace_contents(model, new)
        model.metadata_props[_keys.QUANTIZED] = json.dumps(
            {"scheme": "int8-static-qdq", "per_channel": self.per_channel, "reduce_range": self.reduce_range,
             "activations": "int8-symmetric-minmax" if self.symmetric_activations else "uint8-minmax",
             "calibration_batches": len(self.feeds), "int8_matmuls": count, "fp32_matmuls_kept": len(excluded)})
        logger.info("int8 static (QDQ): %d MatMuls, %d kept in fp32, activation ranges from %d calibration batches",
                    count, len(excluded), len(self.feeds))
        return ir.passes.PassResult(model, modified=True)


def choose_int8_format(provider: str | None) -> tuple[str, str]:
    """``(format, reason)`` for ``quantize-int8{format=auto}`` from the target provider (``--provider``)."""
    if provider == "openvino":
        return "qdq-weights", (
            "OpenVINO compiles DequantizeLinear(int8 W) -> MatMul into FullyConnectedCompressed (MPNet-base, batch 1: "
            "~1.8x fp32 through the EP) but runs ORT's dynamic-int8 MatMulInteger as an fp32 GEMM plus conversions "
            "(0.74x fp32)"
        )
    return "dynamic", (
        "ORT's CPU EP runs DynamicQuantizeLinear + MatMulInteger with int8 kernels (fused to DynamicQuantizeMatMul); "
        "a weight-only QDQ graph would dequantize the weights on every call"
    )


#: measured slowdowns of weight quantization on the CUDA EP (bench-results/quantized-cuda/, MiniLM-L6 on an H200)
CUDA_SLOWDOWN = {
    "quantize-int8": "the CUDA EP has no int8 GEMM for these graphs outside TensorRT: it dequantizes and runs the fp32 "
                     "MatMul (measured on MiniLM-L6: 0.74x fp32 at batch 1, 0.82x at batch 32)",
    "quantize-int4": "the CUDA EP's MatMulNBits dequantizes per call (measured on MiniLM-L6: 0.87x fp32 at batch 1, "
                     "0.92x at batch 32)",
}


def warn_if_cuda(context, name: str) -> None:
    """Say at the default verbosity that ``name`` was measured to slow models down on the CUDA EP (``--provider``)."""
    if (context.options.get("provider") or "cpu") == "cuda":
        logger.warning("%s with --provider cuda: %s; compile without it for the CUDA EP unless your model measures "
                       "otherwise (`dyncompile bench classify PLAN --provider cuda`)", name, CUDA_SLOWDOWN[name])


class QuantizeWeightsInt4Pass(ir.passes.InPlacePass):
    """Weight-only int4 (block-wise) quantization of MatMul weights into ``com.microsoft.MatMulNBits``.

    Scope: main graph; constant-weight ``Gemm`` nodes (GPT-2's ``Conv1D``) are run as ``MatMul`` + ``Add`` first
    (:func:`gemms_as_matmuls`), so they are quantized too. Invariants: graph inputs/outputs unchanged; activations
    stay float outside the op.
    Idempotent: a graph with MatMulNBits is left alone. Sketch: ``MatMul(x, W) -> MatMulNBits(x, q4(W), s)``.

    ``accuracy_level`` is MatMulNBits' compute type: 4 (the default, as in onnxruntime-genai's model builder
    for CPU) quantizes the activations to int8 inside the op and runs int8 dot products; 0 dequantizes the
    weights to fp32. On ORT's CPU kernels level 0 is fast only for one row (decode): with several rows, as in
    speculative verification, it dequantizes whole matrices — measured on Qwen2.5-Coder-1.5B int4: verifying
    2 tokens cost 3.5x one token at level 0 (~1.1x at level 4).

    Defaults ``block_size=128, symmetric=False`` (one scale and zero point per 128 weights, the int4 format of
    OpenVINO's NNCF and of GPTQ/AWQ checkpoints): measured on Qwen2.5-Coder-0.5B (README, "int4 weight formats"),
    its decode step is 0.76x and its prompt 0.75x the time of ``block_size=32`` symmetric at level 4, at the same
    held-out perplexity (1.08x fp32's); ``block_size=32, symmetric=False`` is the most faithful format (1.07x).

    ``lm_head_bits`` (a decoder's LM head, found as ``trim-logits`` finds it): 8 (the default: ``MatMulNBits``
    with 8-bit weights, as NNCF keeps the head), 4 like every other MatMul, or 0 (left in float). On
    Qwen2.5-Coder-0.5B the int4 head is the whole perplexity gap to OpenVINO's int4 export (held-out perplexity
    1.082x fp32's with it, 1.059x with the 8-bit head, OpenVINO's 1.058x); the 8-bit head makes a decode step
    1.10x longer (README, "int4 weight formats").
    """

    def __init__(self, block_size: int = 128, symmetric: bool = False, accuracy_level: int | None = 4,
                 lm_head_bits: int = 8, include_nodes: Sequence[str] | None = None) -> None:
        super().__init__()
        #: only these MatMul nodes (by name) go to int4, every other MatMul is left as it is (no Gemm rewrite, no
        #: LM-head handling): the accuracy-aware search's int4 set; None quantizes every MatMul
        self.include_nodes = None if include_nodes is None else tuple(include_nodes)
        if int(lm_head_bits) not in (0, 4, 8):
            from dyncompile.errors import PassConfigError

            raise PassConfigError(f"quantize-int4 lm_head_bits must be 0 (float), 4 or 8, got {lm_head_bits}")
        self.block_size = int(block_size)
        self.symmetric = bool(symmetric)
        self.accuracy_level = accuracy_level
        self.lm_head_bits = int(lm_head_bits)

    def __repr__(self) -> str:
        inc = "" if self.include_nodes is None else f", include_nodes=<{len(self.include_nodes)} names>"
        return (
            f"QuantizeWeightsInt4Pass(block_size={self.block_size}, symmetric={self.symmetric}, "
            f"accuracy_level={self.accuracy_level}, lm_head_bits={self.lm_head_bits}{inc})"
        )

    @staticmethod
    def _report(count: int, weights: int, unfolded: int, gemms_left: dict[str, str]) -> None:
        """Log how many weight products were quantized; WARN about those left in float and why."""
        logger.info("quantize-int4: %d of %d MatMul/Gemm weight products quantized (%d Gemms run as MatMul + Add first)",
                    count, weights, unfolded)
        if gemms_left:
            name, why = next(iter(gemms_left.items()))
            logger.warning("quantize-int4: %d Gemm nodes left in float (e.g. %r: %s)", len(gemms_left), name, why)
        elif count < weights:
            logger.info("quantize-int4: %d weight products left in float (ORT's quantizer skips weights whose rows "
                        "are not a multiple of 16, and the LM head when lm_head_bits=0)", weights - count)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _has_ops(model, {"MatMulNBits"}):
            return ir.passes.PassResult(model, modified=False)
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        head = None
        if self.include_nodes is not None:
            return self._call_included(model)
        if self.lm_head_bits != 4:  # the head is found and quantized on its own
            from dyncompile.passes.trim_logits import lm_head

            head = lm_head(model.graph)
            if head is not None and head.op_type == "MatMul" and not head.name:
                head.name = "lm_head_matmul"
        kw = {"block_size": self.block_size, "is_symmetric": self.symmetric, "accuracy_level": self.accuracy_level}
        dirs = external_data_dirs(model)
        if len(dirs) > 1:
            raise ValueError(f"initializers read external data from several folders: {sorted(dirs)}")
        base_dir = dirs.pop() if dirs else None
        weights = _weight_matmuls(model)
        with working_directory(base_dir):  # ORT's quantizer resolves external data against the working directory
            work = ir.from_proto(ir.to_proto(model))  # the Gemm rewrite goes into a copy: model changes only if quantized
            _rebase_external(work, base_dir)
            unfolded, gemms_left = gemms_as_matmuls(work)
            q = MatMulNBitsQuantizer(ir.to_proto(work), bits=4, nodes_to_exclude=[head.name] if head else None, **kw)
            q.process()
            if head is not None and self.lm_head_bits == 8:
                q = MatMulNBitsQuantizer(q.model.model, bits=8, nodes_to_include=[head.name], **kw)
                q.process()
        new = ir.from_proto(q.model.model)
        _rebase_external(new, base_dir)
        count = sum(1 for n in new.graph if n.op_type == "MatMulNBits")
        modified = count > 0
        self._report(count, weights, unfolded, gemms_left)
        if not modified:
            return not_fired(model, "quantize-int4", f"none of the {weights} MatMul/Gemm nodes with a constant weight "
                             "could be quantized (ORT's MatMulNBits quantizer takes float MatMul weights [K, N] with "
                             "K a multiple of 16)", "leave quantize-int4 out for this model")
        _replace_contents(model, new)
        model.metadata_props[_keys.QUANTIZED] = json.dumps(
            {"scheme": "int4-weight-only", "block_size": self.block_size, "symmetric": self.symmetric,
             "accuracy_level": self.accuracy_level, "lm_head_bits": self.lm_head_bits if head is not None else 4}
        )
        return ir.passes.PassResult(model, modified=modified)

    def _call_included(self, model: ir.Model) -> ir.passes.PassResult:
        """int4 for the MatMuls named in ``include_nodes`` only.

        ORT's ``nodes_to_include`` adds to, not limits, the op types it quantizes: every other MatMul is passed as
        ``nodes_to_exclude``.
        """
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        include = set(self.include_nodes)
        found = {n.name for n in model.graph if n.op_type == "MatMul"} & include
        if not found:
            return ir.passes.PassResult(model, modified=False)
        for i, n in enumerate(model.graph):  # an unnamed MatMul could not be excluded by name
            if n.op_type == "MatMul" and not n.name:
                n.name = f"dyncompile_matmul_{i}"
        exclude = [n.name for n in model.graph if n.op_type == "MatMul" and n.name not in include]
        dirs = external_data_dirs(model)
        if len(dirs) > 1:
            raise ValueError(f"initializers read external data from several folders: {sorted(dirs)}")
        base_dir = dirs.pop() if dirs else None
        with working_directory(base_dir):
            q = MatMulNBitsQuantizer(ir.to_proto(model), bits=4, block_size=self.block_size, is_symmetric=self.symmetric,
                                     accuracy_level=self.accuracy_level, nodes_to_exclude=exclude)
            q.process()
        new = ir.from_proto(q.model.model)
        _rebase_external(new, base_dir)
        count = sum(1 for n in new.graph if n.op_type == "MatMulNBits")
        logger.info("quantize-int4: %d of the %d named MatMuls quantized", count, len(found))
        _replace_contents(model, new)
        model.metadata_props[_keys.QUANTIZED] = json.dumps(
            {"scheme": "int4-weight-only", "block_size": self.block_size, "symmetric": self.symmetric,
             "accuracy_level": self.accuracy_level, "int4_matmuls": count})
        return ir.passes.PassResult(model, modified=count > 0)


@register_pass(
    "quantize-int8",
    help="int8 MatMul weights: format=dynamic (ORT quantize_dynamic), static (QDQ, activation ranges calibrated on "
    "calib_rows=256 --calib rows; uint8, or symmetric_activations=true for int8), qdq-weights (weight-only QDQ) or auto (by "
    "--provider: OpenVINO gets qdq-weights); options per_channel, keep_fp32=ffn-out; budget_share=S (with --calib, "
    "--budget B): accuracy-aware search keeping the most sensitive MatMuls in fp32 until int8 alone is expected within "
    "S*B points of fp32, certified on held-out calibration rows; fp32_nodes=A+B (dynamic, static): these MatMul nodes stay fp32 "
    "(e.g. a search's choice, from `dyncompile inspect`); forecast=clipped: the search's path-row forecast does not let "
    "helpful flips cancel harmful ones; activations=per-token (format=dynamic): one int8 scale per token instead of one "
    "per tensor (fewer flipped answers, same int8 GEMM); activations=mixed: per-token only for the GELU-fed FFN output "
    "MatMuls, per-tensor elsewhere (nearly per-token's answers at nearly per-tensor's speed); reduce_range=auto: "
    "7-bit weights (ORT's reduced range [-64, 64]) where the compiling CPU's int8 kernels saturate (x86 without "
    "VNNI, e.g. AMD Zen 2/3: 8-bit weights there can cost tens of points), 8-bit elsewhere; true or false to choose "
    "(format=dynamic with 7-bit weights: per_channel defaults to true)",
    choices={"format": ("auto", "dynamic", "qdq-weights", "static"), "forecast": ("labels", "clipped"),
             "activations": ("per-tensor", "per-token", "mixed")},
)
def _make_int8(
    context, format: str = "auto", per_channel: bool | None = None,  # noqa: A002
    reduce_range: bool | Literal["auto"] = "auto", keep_fp32: str | None = None, budget_share: float | None = None,
    sensitivity_rows: int = 256,
    fp32_nodes: str | None = None, calib_rows: int = 256, symmetric_activations: bool = False,
    forecast: str = "labels", activations: str = "per-tensor",
):
    from dyncompile.errors import PassConfigError

    warn_if_cuda(context, "quantize-int8")
    if format == "auto":
        format, _ = choose_int8_format(context.options.get("provider") or "cpu")  # noqa: A001
    names = tuple(n for n in (fp32_nodes or "").split("+") if n)
    cpu = (context.options.get("provider") or "cpu") == "cpu"
    if format != "qdq-weights":  # weight-only QDQ computes in float: no int8 product to saturate
        reduce_range = resolve_reduce_range(reduce_range, context.options.get("provider"))
    if activations in ("per-token", "mixed"):
        if format != "dynamic" or budget_share is not None or per_channel is False:
            raise PassConfigError(f"quantize-int8 activations={activations} is a dynamic format with per-channel weights: "
                                  "use format=dynamic without budget_share or per_channel=false")
        if activations == "mixed":
            if keep_fp32:
                raise PassConfigError("quantize-int8 activations=mixed quantizes the GELU-fed MatMuls per token; drop "
                                      "keep_fp32 (or name fp32 MatMuls with fp32_nodes=A+B)")
            # MatMulIntegerToFloat is a CPU kernel of onnxruntime's contrib ops: written for the CPU EP only
            return QuantizeDynamicInt8MixedPass(exclude_nodes=names, integer_to_float=cpu, reduce_range=reduce_range)
        return QuantizeDynamicInt8PerTokenPass(keep_fp32=keep_fp32, exclude_nodes=names, integer_to_float=cpu,
                                               reduce_range=reduce_range)
    if budget_share is not None:
        if fp32_nodes:
            raise PassConfigError("quantize-int8: give budget_share (search the fp32 MatMuls) or fp32_nodes (name "
                                  "them), not both")
        return _make_int8_search(context, format, per_channel, reduce_range, keep_fp32, budget_share, sensitivity_rows,
                                 calib_rows, symmetric_activations, forecast)
    if names and format not in ("dynamic", "static"):
        raise PassConfigError(f"quantize-int8 fp32_nodes applies to format=dynamic or static, not {format!r}")
    if format == "static":
        if keep_fp32:
            raise PassConfigError("quantize-int8 format=static takes fp32_nodes=A+B for fp32 MatMuls; drop keep_fp32")
        if not context.options.get("calib"):
            raise PassConfigError("quantize-int8 format=static calibrates its activation ranges: pass --calib FILE.jsonl")
        return QuantizeStaticInt8Pass(_static_feeds(context, calib_rows),
                                      per_channel=per_channel is not False, exclude_nodes=names,
                                      symmetric_activations=symmetric_activations, reduce_range=reduce_range)
    if format == "dynamic":
        # 7-bit weights want a scale per output channel (one scale per matrix leaves too few levels: paraphrase-MiniLM-L3
        # embeddings' mean cosine to fp32 0.916 per matrix, 0.996 per channel, 0.978 8-bit per channel saturating)
        per_channel = reduce_range if per_channel is None else per_channel
        return QuantizeDynamicInt8Pass(per_channel=bool(per_channel), reduce_range=reduce_range, keep_fp32=keep_fp32,
                                       exclude_nodes=names)
    if format == "qdq-weights":
        return QuantizeWeightsInt8Pass(per_channel=True if per_channel is None else per_channel, keep_fp32=keep_fp32)
    raise PassConfigError(f"quantize-int8 format must be dynamic, static, qdq-weights or auto, got {format!r}")


def _make_int8_search(context, format: str, per_channel, reduce_range: bool, keep_fp32, share: float,  # noqa: A002
                      sensitivity_rows: int, calib_rows: int = 256, symmetric_activations: bool = False,
                      forecast: str = "labels", int4=None):
    """``quantize-int8{budget_share=S}``: the accuracy-aware search (:mod:`dyncompile.passes.quantize_search`)."""
    from dyncompile.errors import PassConfigError
    from dyncompile.io import read_jsonl, texts_and_labels
    from dyncompile.passes.early_exit.certify import CalibrationError, parse_confidence
    from dyncompile.passes.quantize_search import SearchInt8FallbackPass

    if format not in ("dynamic", "static"):
        raise PassConfigError(f"quantize-int8 budget_share searches the dynamic or static int8 formats, not {format!r};"
                              " use format=dynamic (the CPU EP's), format=static, or drop budget_share")
    if keep_fp32:
        raise PassConfigError("quantize-int8 budget_share chooses the fp32 MatMuls itself: drop keep_fp32")
    if isinstance(share, bool) or not 0.0 < float(share) <= 1.0:
        raise PassConfigError(f"quantize-int8 budget_share is the part of --budget the int8 model may spend, in (0, 1];"
                              f" got {share!r}")
    if sensitivity_rows < 32:
        raise PassConfigError(f"quantize-int8 sensitivity_rows must be >= 32, got {sensitivity_rows}")
    o = context.options
    if not o.get("calib"):
        raise PassConfigError("quantize-int8 budget_share needs calibration rows: pass --calib FILE.jsonl")
    budget = 1.0 if o.get("budget") is None else o["budget"]
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 <= budget <= 100:
        raise PassConfigError(f"--budget is the accepted accuracy drop in points, >= 0 (at most 100); got {budget!r}")
    try:
        confidence = parse_confidence(o.get("confidence"))
    except CalibrationError as e:
        raise PassConfigError(str(e)) from None
    tok = context.require_tokenizer("quantize-int8 budget_share")
    texts, labels = texts_and_labels(read_jsonl(o["calib"]), context.model_config.get("labels"))
    return SearchInt8FallbackPass(
        texts, labels, tokenizer_file=tok, max_length=int(context.model_config.get("max_length", 512)),
        budget=float(budget), share=float(share), confidence=confidence, sensitivity_rows=sensitivity_rows,
        per_channel=per_channel is not False, progress=context.progress, fmt=format,
        static_feeds=_static_feeds(context, calib_rows) if format == "static" else None,
        symmetric_activations=symmetric_activations, forecast=forecast, int4=int4, reduce_range=reduce_range,
    )


def _static_feeds(context, calib_rows: int):
    """Activation-calibration feeds for ``format=static``: ``calib_rows`` --calib rows, one row a batch."""
    from dyncompile.errors import PassConfigError
    from dyncompile.passes.smooth_activations import calibration_feeds

    if calib_rows < 8:
        raise PassConfigError(f"quantize-int8 calib_rows must be >= 8, got {calib_rows}")
    return calibration_feeds(context, calib_rows, batch_size=1)


@register_pass(
    "quantize-int4",
    help="weight-only int4 MatMulNBits quantization (block-wise, a scale and zero point per block); options "
    "block_size=128 (32: more faithful, slower), symmetric=false, accuracy_level=4 (int8 compute; 0: fp32 compute), "
    "lm_head_bits=8 (a decoder's LM head in 8 bits; 4: faster, less faithful; 0: float); budget_share=S (with --calib, "
    "--budget B, a classifier): accuracy-aware search, each MatMul int4, int8 (dynamic) or fp32, raised one level "
    "at a time by sensitivity until the quantized model alone is expected within S*B points of fp32, certified on "
    "held-out calibration rows (sensitivity_rows, forecast, per_channel as quantize-int8's); int8_nodes=A+B, "
    "fp32_nodes=C+D: those MatMuls int8 (dynamic) / fp32, every other int4 (e.g. a search's choice, from `dyncompile "
    "inspect`); reduce_range=auto: the int8 ones with 7-bit weights where this CPU's int8 kernels saturate (as "
    "quantize-int8's)",
    choices={"forecast": ("labels", "clipped")},
)
def _make_int4(context, block_size: int = 128, symmetric: bool = False, accuracy_level: int | None = 4,
               lm_head_bits: int = 8, budget_share: float | None = None, sensitivity_rows: int = 256,
               forecast: str = "labels", per_channel: bool = True, int8_nodes: str | None = None,
               fp32_nodes: str | None = None, reduce_range: bool | Literal["auto"] = "auto"):
    from dyncompile.errors import PassConfigError

    warn_if_cuda(context, "quantize-int4")
    if block_size < 16 or block_size & (block_size - 1):
        raise PassConfigError(f"quantize-int4 block_size must be a power of two >= 16 (e.g. 32), got {block_size}")
    if accuracy_level is not None and accuracy_level not in (0, 1, 2, 3, 4):
        raise PassConfigError(f"quantize-int4 accuracy_level must be 0..4 or none, got {accuracy_level}")
    if reduce_range != "auto" and not (int8_nodes or fp32_nodes or budget_share is not None):
        raise PassConfigError("quantize-int4 reduce_range applies to the int8 MatMuls of a mixed plan (int8_nodes or "
                              "budget_share); int4 MatMulNBits weights have no 8-bit range to reduce: drop it")
    if int8_nodes or fp32_nodes:
        from dyncompile.passes.quantize_search import Int4Format, QuantizeMixedInt4Pass

        if budget_share is not None:
            raise PassConfigError("quantize-int4: give budget_share (search the precisions) or int8_nodes/fp32_nodes "
                                  "(name them), not both")
        if accuracy_level not in (0, 4) or lm_head_bits != 8:
            raise PassConfigError("quantize-int4 int8_nodes/fp32_nodes take accuracy_level 4 or 0 and no lm_head_bits")
        return QuantizeMixedInt4Pass(Int4Format(block_size, bool(symmetric), int(accuracy_level)),
                                     [n for n in (int8_nodes or "").split("+") if n],
                                     [n for n in (fp32_nodes or "").split("+") if n], per_channel=per_channel,
                                     reduce_range=resolve_reduce_range(reduce_range, context.options.get("provider")))
    if budget_share is not None:
        from dyncompile.passes.quantize_search import Int4Format

        if accuracy_level not in (0, 4):
            raise PassConfigError(f"quantize-int4 budget_share searches accuracy_level 4 (int8 compute) or 0 (fp32 "
                                  f"compute), got {accuracy_level}")
        if lm_head_bits != 8:
            raise PassConfigError("quantize-int4 budget_share chooses every MatMul's precision itself: drop lm_head_bits")
        return _make_int8_search(context, "dynamic", per_channel, resolve_reduce_range(
            reduce_range, context.options.get("provider")), None, budget_share, sensitivity_rows,
                                 forecast=forecast, int4=Int4Format(block_size, bool(symmetric), int(accuracy_level)))
    return QuantizeWeightsInt4Pass(block_size=block_size, symmetric=symmetric, accuracy_level=accuracy_level,
                                   lm_head_bits=lm_head_bits)
