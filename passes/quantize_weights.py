"""``quantize-int8`` / ``quantize-int4``: weight quantization through ONNX Runtime's quantization tools.

Both passes hand the model to ``onnxruntime.quantization`` (the reference implementations that ORT's
kernels are written for) and bring the result back into onnx-ir, so they compose in one pipeline with
the dynamic-execution passes: ``--passes quantize-int8,early-exit`` fits the exit heads on the quantized
model's features.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import onnx_ir as ir
from dyncompile.passes._infra import register_pass

logger = logging.getLogger(__name__)

__all__ = ["QuantizeDynamicInt8Pass", "QuantizeWeightsInt4Pass"]

INT8_OPS = {"MatMulInteger", "DynamicQuantizeLinear", "DynamicQuantizeMatMul", "QLinearMatMul"}


def _replace_contents(model: ir.Model, new: ir.Model) -> None:
    """Make ``model`` (in place) hold ``new``'s graph, opsets and functions; keep dyncompile metadata."""
    meta = dict(model.metadata_props)
    model.graph = new.graph
    model.functions.clear()
    model.functions.update(new.functions)
    model.metadata_props.clear()
    model.metadata_props.update(new.metadata_props)
    model.metadata_props.update({k: v for k, v in meta.items() if k.startswith("dyncompile.")})


def _has_ops(model: ir.Model, ops: set[str]) -> bool:
    return any(n.op_type in ops for n in model.graph.all_nodes())


class QuantizeDynamicInt8Pass(ir.passes.InPlacePass):
    """Dynamic int8 quantization of MatMul weights (``onnxruntime.quantization.quantize_dynamic``).

    Scope: main graph and subgraphs (whatever ORT's quantizer handles).
    Invariants: graph inputs/outputs unchanged; activations quantized on the fly (DynamicQuantizeLinear +
    MatMulInteger), weights stored as int8 (``per_channel`` optional). Idempotent: a graph that already
    holds int8 MatMuls is left alone (``modified=False``).
    Sketch: ``MatMul(x, W) -> MatMulInteger(DynamicQuantizeLinear(x), q(W)) * scales``.
    """

    def __init__(self, per_channel: bool = False, reduce_range: bool = False, op_types: tuple[str, ...] = ("MatMul",)) -> None:
        super().__init__()
        self.per_channel = bool(per_channel)
        self.reduce_range = bool(reduce_range)
        self.op_types = tuple(op_types)

    def __repr__(self) -> str:
        return f"QuantizeDynamicInt8Pass(per_channel={self.per_channel}, op_types={list(self.op_types)})"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if _has_ops(model, INT8_OPS):
            return ir.passes.PassResult(model, modified=False)
        from onnxruntime.quantization import QuantType, quantize_dynamic

        with tempfile.TemporaryDirectory() as tmp:
            src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
            ir.save(model, src)
            quantize_dynamic(
                src,
                dst,
                op_types_to_quantize=list(self.op_types),
                per_channel=self.per_channel,
                reduce_range=self.reduce_range,
                weight_type=QuantType.QInt8,
            )
            new = ir.load(dst)
            for v in new.graph.initializers.values():  # detach from the temp file before it goes
                if v.const_value is not None:
                    v.const_value = ir.tensor(v.const_value.numpy(), name=v.name)
        modified = _has_ops(new, INT8_OPS)
        if modified:
            _replace_contents(model, new)
        logger.info("int8: %d MatMulInteger nodes", sum(n.op_type == "MatMulInteger" for n in model.graph.all_nodes()))
        return ir.passes.PassResult(model, modified=modified)


class QuantizeWeightsInt4Pass(ir.passes.InPlacePass):
    """Weight-only int4 (block-wise) quantization of MatMul weights into ``com.microsoft.MatMulNBits``.

    Scope: main graph. Invariants: graph inputs/outputs unchanged; activations stay float.
    Idempotent: a graph with MatMulNBits is left alone. Sketch: ``MatMul(x, W) -> MatMulNBits(x, q4(W), s)``.
    """

    def __init__(self, block_size: int = 32, symmetric: bool = True, accuracy_level: int | None = None) -> None:
        super().__init__()
        self.block_size = int(block_size)
        self.symmetric = bool(symmetric)
        self.accuracy_level = accuracy_level

    def __repr__(self) -> str:
        return f"QuantizeWeightsInt4Pass(block_size={self.block_size}, symmetric={self.symmetric})"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if _has_ops(model, {"MatMulNBits"}):
            return ir.passes.PassResult(model, modified=False)
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        proto = ir.to_proto(model)
        q = MatMulNBitsQuantizer(
            proto, bits=4, block_size=self.block_size, is_symmetric=self.symmetric, accuracy_level=self.accuracy_level
        )
        q.process()
        new = ir.from_proto(q.model.model)
        modified = _has_ops(new, {"MatMulNBits"})
        if modified:
            _replace_contents(model, new)
        return ir.passes.PassResult(model, modified=modified)


@register_pass("quantize-int8", help="dynamic int8 quantization of MatMul weights (onnxruntime.quantization)")
def _make_int8(context, per_channel: bool = False, reduce_range: bool = False):
    return QuantizeDynamicInt8Pass(per_channel=per_channel, reduce_range=reduce_range)


@register_pass("quantize-int4", help="weight-only int4 MatMulNBits quantization (block-wise)")
def _make_int4(context, block_size: int = 32, symmetric: bool = True, accuracy_level: int | None = None):
    return QuantizeWeightsInt4Pass(block_size=block_size, symmetric=symmetric, accuracy_level=accuracy_level)
