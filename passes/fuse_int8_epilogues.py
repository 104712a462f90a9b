"""``fuse-int8-epilogues``: the elementwise chains around an encoder's int8 MatMuls -> dyncompile's fused CPU kernels.

An encoder quantized with per-row (per-token) activation scales (``quantize-int8{format=dynamic,
activations=mixed}`` or ``per-token``) runs five kernels to quantize a MatMul's input row by row (``ReduceMax ->
Mul -> Max -> QuantizeLinear`` for the zero point ``-> QuantizeLinear`` for the rows) and three after the
``MatMulIntegerToFloat`` (``Mul`` by the row scale, ``Add`` the bias, ``Add`` the residual). At batch 1 on two CPU
cores each is a pass over a [rows, width] tensor plus a kernel dispatch. This pass rewrites them to two custom
operators of dyncompile's kernel library (:mod:`dyncompile.runtime.kernels`, domain ``dyncompile``), each
computing the same float operations in the same order, so the fused graph's outputs are **bit-identical**:

* ``QuantizeRows(x) -> (q, s)``: ``s = max(max_k x * inv_range, floor)``, ``q = saturate(round(x / s) + 128)``;
* ``ScaledResidualAdd(acc, s, bias, residual) -> ((acc * s) + bias) + residual``.

The ``LayerNormalization`` after a residual stays ONNX Runtime's: its kernel's summation order is not reproduced,
and a 1-ulp change there moves the next per-tensor int8 rounding, so an early-exit compile would calibrate other
exits on a fused graph (measured: a different certified exit mix, 1.68x expected instead of 2.44x, on
MPNet-base). Bit-identical outputs mean the exits, thresholds and certificate of an ``early-exit`` after this pass
are those of the unfused graph.

* Scope: the main graph of a float32 encoder after ``quantize-int8`` and before ``early-exit``. CPU EP only (the
  kernels are CPU kernels). The patterns are onnxscript ``RewriteRule`` classes. The rewrite needs to prove that
  the residual ``Add`` does not broadcast: ``quantize-int8``'s output records no shapes, so the pass derives them
  by a forward walk (:func:`propagate_shapes`); and constants for every scale, floor and zero point (zero point
  128 of type uint8, as ``quantize-int8`` writes it).
* Cost: the plan then needs dyncompile's kernel library wherever it runs: the runtime builds it from the installed
  package's C sources with the system C compiler (``policy.custom_ops``; a missing compiler is one clear error at
  compile time and at load time). A plan never carries native code.
* Invariants: graph inputs/outputs unchanged; the constants only the replaced chains read are removed; outputs
  equal the original's bit for bit (tested in ORT with
  ``ORT_DISABLE_ALL`` on generated graphs and on MiniLM-L6). Idempotent: a fused graph has no such chain left, so
  a second run reports ``modified=False``. A graph without the chains (no per-row int8, unknown shapes) is left
  alone with a message saying why.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from dyncompile.passes._graph import const_array
from dyncompile.passes._infra import not_fired, register_pass
from dyncompile.runtime.kernels import DOMAIN as _DOMAIN

logger = logging.getLogger(__name__)

__all__ = ["FuseInt8EpiloguesPass", "propagate_shapes", "quantize_rows_rules", "scaled_residual_rules"]

_MS = "com.microsoft"
_OPS = ("QuantizeRows", "ScaledResidualAdd")


def _scalar(v: ir.Value | None, dtype: ir.DataType | None = None) -> float | None:
    """The value of a one-element initializer (or other ``const_value``), else None.

    Not a ``Constant`` node's output (:func:`~dyncompile.passes._graph.const_array` reads those): the rewrite would
    leave that node behind unused, where the initializers it leaves unused are removed.
    """
    if v is None or v.const_value is None:
        return None
    if dtype is not None and v.const_value.dtype != dtype:  # the tensor's: a pass's new initializer may lack v.dtype
        return None
    arr = v.const_value.numpy()
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


_UNARY = frozenset({"Gelu", "Erf", "Relu", "Tanh", "Sigmoid", "Sqrt", "Abs", "Neg", "Cast", "Identity",
                    "FastGelu", "BiasGelu", "QuickGelu"})
_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"})
_MATMULS = frozenset({"MatMul", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"})


def _dim(d):
    if isinstance(d, int):
        return d
    return d.value if isinstance(d, ir.SymbolicDim) and d.value is not None else None


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    """Numpy broadcast of two shapes whose dims are ints or dim names; None where it cannot be decided."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(reversed(out))


def _const_ints(node: ir.Node, i: int) -> list[int] | None:
    arr = const_array(node.inputs[i] if len(node.inputs) > i else None, max_elements=64)
    return None if arr is None else [int(a) for a in arr.reshape(-1)]


def _last_axis(axes, rank: int) -> bool:
    return axes in ([-1], [rank - 1], -1, rank - 1)


def _shape_matmul(node, ins):
    w = node.inputs[1] if len(node.inputs) > 1 else None
    if ins[0] and w is not None and w.const_value is not None and len(ins[1]) == 2 and ins[0][-1] == ins[1][0]:
        return [ins[0][:-1] + (ins[1][1],)]
    return []


def _shape_quantize(node, ins):
    return [ins[0], (), ()] if node.op_type == "DynamicQuantizeLinear" else [ins[0]]


def _shape_attention(node, ins):
    q, v = ins[0], ins[2] if len(ins) > 2 else None
    return [q[:-1] + (v[-1],)] if q and v and len(q) == 3 and len(v) == 3 else []


def _shape_split(node, ins):
    sizes = _const_ints(node, 1)
    if ins[0] and sizes and len(sizes) == len(node.outputs) and _last_axis(node.attributes.get_int("axis", 0),
                                                                         len(ins[0])):
        return [ins[0][:-1] + (k,) for k in sizes]
    return []


def _shape_reduce_max(node, ins):
    if ins[0] and node.attributes.get_int("keepdims", 1) == 1 and _last_axis(_const_ints(node, 1), len(ins[0])):
        return [ins[0][:-1] + (1,)]
    return []


def _shape_binary(node, ins):
    return [_broadcast(ins[0], ins[1])] if len(ins) == 2 and None not in ins else []


def _shape_same(node, ins):
    return [ins[0]]


def _shape_kernels(node, ins):
    if node.domain != _DOMAIN:
        return []
    return [ins[0], ins[0][:-1] + (1,)] if node.op_type == "QuantizeRows" else [ins[0]]


_SHAPE_RULES = {
    **dict.fromkeys(_UNARY | {"LayerNormalization"}, _shape_same),
    **dict.fromkeys(_BINARY, _shape_binary),
    **dict.fromkeys(_MATMULS, _shape_matmul),
    **dict.fromkeys(("DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear"), _shape_quantize),
    "MultiHeadAttention": _shape_attention,
    "Split": _shape_split,
    "ReduceMax": _shape_reduce_max,
    "QuantizeRows": _shape_kernels,
    "ScaledResidualAdd": _shape_kernels,
}


def propagate_shapes(graph: ir.Graph) -> dict[ir.Value, tuple]:
    """Each main-graph value's dims (ints or dim names) where a forward walk can tell them, else absent.

    ``quantize-int8`` hands on a graph without recorded shapes (ORT's quantizer drops them) and ONNX's shape
    inference stops at the ``com.microsoft`` operators of an optimized encoder, so the pass derives what it needs
    from the graph inputs, the constants and the few operators of an encoder layer: elementwise ops (numpy
    broadcasting), MatMuls with a constant 2-D weight, ``LayerNormalization``, ``MultiHeadAttention`` (the query's
    rows, the value's width), ``Split``/``ReduceMax`` on the last axis and the quantization ops. Recorded shapes
    are used where present; anything else is unknown (the rules then do not fire).
    """
    dims: dict[ir.Value, tuple] = {}

    def get(v: ir.Value | None) -> tuple | None:
        if v is None:
            return None
        if v in dims:
            return dims[v]
        if v.const_value is not None:
            return tuple(int(d) for d in v.const_value.shape.numpy())
        if v.shape is not None and all(_dim(d) is not None for d in v.shape):
            return tuple(_dim(d) for d in v.shape)
        return None

    for node in graph:
        ins = [get(i) for i in node.inputs]
        rule = _SHAPE_RULES.get(node.op_type)
        out = rule(node, ins) if rule is not None and ins and ins[0] is not None else []
        for i, v in enumerate(node.outputs):
            d = out[i] if i < len(out) and out[i] is not None else get(v)
            if d is not None:
                dims[v] = d
    for v in graph.inputs:
        if get(v) is not None:
            dims.setdefault(v, get(v))
    return dims


def _vector(v: ir.Value | None, n: int) -> bool:
    """``v`` is a float32 constant holding ``n`` values along one axis (a LayerNorm weight, a bias)."""
    if v is None or v.const_value is None or v.const_value.dtype != ir.DataType.FLOAT:
        return False
    shape = [int(d) for d in v.const_value.shape.numpy()]
    return int(np.prod(shape)) == n and max(shape, default=1) == n


def quantize_rows_rules(dims: dict[ir.Value, tuple]):
    """The ``QuantizeRows`` rules (with and without ``Abs``); ``dims``: :func:`propagate_shapes` of the graph."""
    from onnxscript.rewriter import pattern

    class _QuantizeRows(pattern.RewriteRuleClassBase):
        """``ReduceMax -> Mul -> Max -> QuantizeLinear(zero point) -> QuantizeLinear(rows)`` -> ``QuantizeRows``."""

        def __init__(self, absolute: bool) -> None:
            super().__init__(f"QuantizeRows{'Abs' if absolute else ''}", remove_nodes=True)
            self._absolute = absolute

        def pattern(self, op, x, axes, inv_range, floor, zp_scale, zp):
            src = op.Abs(x) if self._absolute else x
            row_max = op.ReduceMax(src, axes, _allow_other_attributes=True, _outputs=["row_max"])
            s = op.Max(op.Mul(row_max, inv_range), floor)
            z = op.QuantizeLinear(s, zp_scale, zp, _allow_other_attributes=True, _outputs=["z"])
            q = op.QuantizeLinear(x, s, z, _allow_other_attributes=True, _outputs=["q"])
            return q, s

        def check(self, context, x, axes, inv_range, floor, zp_scale, zp, row_max, z, q, **_):
            r = pattern.MatchResult()
            d = dims.get(x)  # x is float32 when the range factor is (Mul and Max take one type); its dtype may be unset
            if _scalar(inv_range, ir.DataType.FLOAT) is None or not d or not isinstance(d[-1], int):
                return r.fail("the quantized tensor is not float32 with a known last dimension", x)
            rank, k = len(d), d[-1]
            ax = axes.const_value.numpy().reshape(-1).tolist() if axes.const_value is not None else None
            if ax not in ([-1], [rank - 1]) or row_max.producer().attributes.get_int("keepdims", 1) != 1:
                return r.fail("ReduceMax is not over the last axis with keepdims", row_max)
            self._inv, self._floor = _scalar(inv_range, ir.DataType.FLOAT), _scalar(floor, ir.DataType.FLOAT)
            big, zero = _scalar(zp_scale, ir.DataType.FLOAT), _scalar(zp, ir.DataType.UINT8)
            if self._inv is None or self._floor is None or not (self._inv > 0 and self._floor > 0):
                return r.fail("the range factor and the scale floor are not positive float constants", x)
            if big is None or big < 1e30 or zero != 128:
                return r.fail("the zero point is not the constant 128 (uint8) derived through a >= 1e30 scale", z)
            qa = q.producer().attributes
            if qa.get_int("axis", 1) not in (-1, rank - 1) or qa.get_int("block_size", 0) != k:
                return r.fail("the rows are not quantized in one block per row (axis -1, block_size = width)", q)
            if qa.get_int("saturate", 1) != 1 or qa.get_int("output_dtype", 0) not in (0, 2):
                return r.fail("QuantizeLinear with another output type or saturation", q)
            return r

        def rewrite(self, op, x, **_):
            return op.QuantizeRows(x, inv_range=float(self._inv), floor=float(self._floor),
                                   absolute=int(self._absolute), _domain=_DOMAIN, _outputs=2)

    return pattern.RewriteRuleSet([_QuantizeRows.rule(False), _QuantizeRows.rule(True)])


def _scaled_residual_mismatch(dims, acc, row_scale, bias, residual):
    """Why ``((acc * row_scale) + bias) + residual`` cannot become ``ScaledResidualAdd``: (reason, value) or None."""
    prod = acc.producer()
    if prod is None or prod.op_type != "MatMulIntegerToFloat" or prod.domain != _MS:
        return "the scaled term is not a MatMulIntegerToFloat output", acc
    d = dims.get(acc)
    if not d or not isinstance(d[-1], int):
        return "the MatMul's output has no known shape", acc
    if dims.get(residual) != d:
        return "the residual Add may broadcast (its operands' shapes differ or are unknown)", residual
    if dims.get(row_scale) != d[:-1] + (1,):
        return "the row scale is not one value per row", row_scale
    if not _vector(bias, d[-1]):  # float32 like the bias: Mul and Add take one type
        return "the bias is not a float32 vector of the MatMul's width", bias
    return None


def scaled_residual_rules(dims: dict[ir.Value, tuple]):
    """The ``ScaledResidualAdd`` rules (residual on either side); ``dims``: :func:`propagate_shapes`."""
    from onnxscript.rewriter import pattern

    class _ScaledResidualAdd(pattern.RewriteRuleClassBase):
        """``((MatMulIntegerToFloat * row_scale) + bias) + residual`` -> ``ScaledResidualAdd``."""

        def __init__(self, residual_first: bool) -> None:
            super().__init__(f"ScaledResidualAdd{'Swapped' if residual_first else ''}", remove_nodes=True)
            self._residual_first = residual_first

        def pattern(self, op, acc, row_scale, bias, residual):
            lin = op.Add(op.Mul(acc, row_scale), bias)
            return op.Add(residual, lin) if self._residual_first else op.Add(lin, residual)

        def check(self, context, acc, row_scale, bias, residual, **_):
            r = pattern.MatchResult()
            why = _scaled_residual_mismatch(dims, acc, row_scale, bias, residual)
            return r.fail(*why) if why else r

        def rewrite(self, op, acc, row_scale, bias, residual, **_):
            return op.ScaledResidualAdd(acc, row_scale, bias, residual, _domain=_DOMAIN)

    return pattern.RewriteRuleSet([_ScaledResidualAdd.rule(False), _ScaledResidualAdd.rule(True)])


def _fused_counts(model: ir.Model) -> dict[str, int]:
    return {op: sum(1 for n in model.graph if n.domain == _DOMAIN and n.op_type == op) for op in _OPS}


class FuseInt8EpiloguesPass(ir.passes.InPlacePass):
    """Per-row int8 quantization and residual LayerNorms -> dyncompile's fused kernels (see the module docstring)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def requires(self, model: ir.Model) -> None:
        """The kernel library must build here (a C compiler and ONNX Runtime's header): else one clear error."""
        import dyncompile.runtime.kernels as kernels

        kernels.library()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the module docstring)."""
        before = _fused_counts(model)
        read = {name for name, v in model.graph.initializers.items() if v.uses()}
        count = 0
        for make_rules in (quantize_rows_rules, scaled_residual_rules):
            while True:  # a rewrite's outputs are new values: their shapes are known on the next walk
                n = make_rules(propagate_shapes(model.graph)).apply_to_model(model)
                count += n
                if not n:
                    break
        if not count:
            if any(before.values()):
                return ir.passes.PassResult(model, modified=False)  # fused by an earlier run
            return not_fired(model, "fuse-int8-epilogues",
                             "no per-row int8 quantization chain (ReduceMax/Mul/Max/QuantizeLinear) and no row-scaled "
                             "MatMulIntegerToFloat + bias + residual Add with known, equal shapes in the main graph",
                             "run it after quantize-int8{format=dynamic,activations=mixed or per-token} on an "
                             "encoder with static shapes, or leave it out")
        model.opset_imports.setdefault(_DOMAIN, 1)
        for name in [n for n, v in model.graph.initializers.items() if n in read and not v.uses()]:
            model.graph.initializers.pop(name)  # the replaced chains' constants (ranges, floors, zero points)
        after = _fused_counts(model)
        logger.info("fuse-int8-epilogues: %s", ", ".join(f"{after[op] - before[op]} {op}" for op in _OPS))
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "fuse-int8-epilogues",
    help="an int8 encoder's per-row quantization chains and row-scale + bias + residual Adds -> dyncompile's fused "
    "CPU kernels (QuantizeRows, ScaledResidualAdd), outputs bit-identical; the plan then needs the system C compiler "
    "wherever it runs (the runtime builds the kernels); run after quantize-int8, before early-exit",
    after=("quantize-int8",),
    before=("early-exit",),
)
def _make_fuse_int8_epilogues(context) -> FuseInt8EpiloguesPass:
    from dyncompile.errors import PassConfigError

    provider = context.options.get("provider") or "cpu"
    if provider != "cpu":
        raise PassConfigError(f"fuse-int8-epilogues writes CPU kernels; with --provider {provider} ONNX Runtime "
                              "would run them on the CPU between that EP's partitions: leave it out for this provider")
    return FuseInt8EpiloguesPass()
