"""``matmul-to-conv``: run a decoder's constant-weight MatMuls as 1x1 Convs (ONNX Runtime's x86 CPU EP).

Why: at batch 1 a decoder step multiplies a few rows (1 token; ``k + 1`` when verifying ``k`` drafts) by every
weight, and is bound by streaming the weights from memory. ONNX Runtime's fp32 SGEMM (MLAS) does not overlap that
stream with the arithmetic of a few rows. The CPU EP's NCHWc transformer (x86 with AVX2/AVX-512, graph
optimization level ``all``) runs a 1x1 Conv with its blocked pointwise-convolution kernel, over a blocked copy of
the weight, which does overlap them: decode and verification steps get faster, while long prompts pay for ORT's
NCHWc reorders. The paired measurements are in ``bench-results/decoder-graphs/`` and ``bench-results/peers/``.

* Scope: the main graph's standard-domain ``MatMul`` nodes whose first input is an activation of known rank 3,
  ``[batch, seq, K]`` (exports carry the shapes; on a graph without them the pass runs ONNX shape inference
  itself, which only annotates shapes), and whose
  second is a constant 2-D float32 initializer ``[K, N]`` read by that node alone (a shared weight, such as an LM
  head tied to the embedding, would be stored twice: left alone). ``MatMulNBits`` (int4)
  and MatMuls in subgraphs are left alone; a graph without such a MatMul is not modified.
* Rewrite: ``Y = MatMul(X, W)`` -> ``Y = Squeeze(Transpose(Conv(Transpose(Unsqueeze(X, [1]), [0, 3, 1, 2]),
  W^T[N, K, 1, 1]), [0, 2, 3, 1]), [1])``: ``X`` is read as an NHWC image ``[batch, 1, seq, K]`` and the Conv runs
  over ``[batch, K, 1, seq]``, so the sequence is the Conv's width, which is what the pointwise kernel walks along
  (as the height it was slower on long prompts). Written with these 4-D NHWC <-> NCHW Transposes, ONNX
  Runtime folds both into its NCHWc reorders (``ReorderInput`` / ``ReorderOutput`` with ``channels_last=1``), so no
  Transpose of the lowering itself runs (rank-3 Transposes around an Unsqueeze all ran). The weight is stored
  transposed in place of the old one (the same bytes); ``Y`` keeps its name, type and shape.
* Invariants: graph inputs and outputs unchanged; each output element is the same dot product reduced in another
  order, so outputs match within float round-off (tested <= 1e-5 in ORT with ``ORT_DISABLE_ALL`` and with every
  optimization on). Greedy speculative decoding stays token-identical to the same plan's target alone, since
  both run this one graph. Idempotent: a second run finds no MatMul to lower (``modified=False``).
* Order: last before ``speculative`` (which then times verification on the lowered graph): after the passes that
  find MatMuls by pattern (``fuse-decoder``, ``pack-matmuls``, ``trim-logits``'s LM head, ``quantize-int4``,
  ``eagle-drafter``, ``split-drafter``). A CPU-EP lowering: on other EPs (and ARM CPUs, which have no NCHWc
  kernels) a 1x1 Conv is at best as fast as the MatMul, so the ``-O2`` preset inserts it for the CPU EP only.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from dyncompile.passes._graph import replace_node_output
from dyncompile.passes._infra import not_fired, register_pass

logger = logging.getLogger(__name__)

__all__ = ["MatMulToConvPass"]


def _has_weight(node: ir.Node) -> bool:
    """A standard MatMul whose second input is a constant initializer (lowerable given a known rank-3 activation)."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    w = node.inputs[1]
    return w is not None and w.is_initializer() and w.const_value is not None


def _infer_shapes(model: ir.Model) -> None:
    """Annotate the graph's values with ONNX shape inference (shapes only: no node or weight changes)."""
    from onnx_ir.passes.common import ShapeInferencePass

    try:
        ShapeInferencePass()(model)
    except Exception as e:  # noqa: BLE001 - a graph ONNX shape inference cannot handle: reported by the caller
        logger.info("matmul-to-conv: shape inference failed: %s", str(e)[:200])


def _why_none(model: ir.Model) -> str:
    """Why no MatMul of ``model`` can be lowered (after shape inference), naming what was found instead."""
    nodes = list(model.graph)
    weighted = [n for n in nodes if _has_weight(n)]
    gemms = [n for n in nodes if n.op_type == "Gemm"]
    if not weighted:
        why = "no MatMul with a constant weight initializer"
        if gemms:
            why += (f" ({len(gemms)} Gemm nodes, e.g. {gemms[0].name!r}: GPT-2-style Conv1D projections on [batch*seq, "
                    "K] rows, which this lowering does not take)")
        return why
    n = weighted[0]
    x = n.inputs[0]
    if x is None or x.shape is None:
        return (f"shape inference found no shape for the activations of the {len(weighted)} constant-weight MatMuls "
                f"(e.g. {n.name!r} reads {x.name if x is not None else None!r})")
    return (f"none of the {len(weighted)} constant-weight MatMuls has a [batch, seq, K] activation with a float32 "
            f"[K, N] weight read by it alone (e.g. {n.name!r}: activation rank {len(x.shape)})")


def _lowerable(node: ir.Node) -> bool:
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    x, w = node.inputs
    if x is None or x.shape is None or len(x.shape) != 3 or w is None:
        return False
    t = w.const_value
    if t is None or not w.is_initializer() or len(t.shape) != 2 or t.dtype != ir.DataType.FLOAT:
        return False
    return len(list(w.uses())) == 1


class MatMulToConvPass(ir.passes.InPlacePass):
    """Lower constant-weight MatMuls on ``[batch, seq, K]`` activations to 1x1 Convs over ``[batch, K, 1, seq]``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        graph = model.graph
        nodes = [n for n in graph if _lowerable(n)]
        if not nodes and any(_has_weight(n) and n.inputs[0] is not None and n.inputs[0].shape is None for n in graph):
            _infer_shapes(model)  # an export without shapes: annotate them rather than give up
            graph = model.graph
            nodes = [n for n in graph if _lowerable(n)]
        if not nodes and any(n.name.endswith("/as_conv/Conv") for n in graph):  # lowered by an earlier run
            return ir.passes.PassResult(model, modified=False)
        if not nodes:
            return not_fired(model, "matmul-to-conv", _why_none(model),
                             "leave matmul-to-conv out for this model (it only pays on decoders' [batch, seq, K] "
                             "MatMuls on the x86 CPU EP)")
        axes = ir.Value(name="matmul_to_conv.axes", const_value=ir.tensor(np.array([1], np.int64),
                                                                          name="matmul_to_conv.axes"))
        while axes.name in graph.initializers:
            axes.name += "_"
        graph.register_initializer(axes)
        for node in nodes:
            x, w = node.inputs
            y = node.outputs[0]
            stem = f"{node.name or w.name}/as_conv"
            weight = np.ascontiguousarray(w.const_value.numpy().T)[:, :, None, None]  # [N, K, 1, 1]
            name = w.name  # the transposed weight takes over the old one's name once the old one is gone
            wt = ir.Value(const_value=ir.tensor(weight, name=name))
            u = ir.node("Unsqueeze", [x, axes], name=f"{stem}/Unsqueeze")  # [b, 1, s, K]: NHWC
            t = ir.node("Transpose", [u.outputs[0]], attributes={"perm": [0, 3, 1, 2]}, name=f"{stem}/to_nchw")
            c = ir.node("Conv", [t.outputs[0], wt], name=f"{stem}/Conv")
            back = ir.node("Transpose", [c.outputs[0]], attributes={"perm": [0, 2, 3, 1]}, name=f"{stem}/to_nhwc")
            s = ir.node("Squeeze", [back.outputs[0], axes], name=f"{stem}/Squeeze")
            for i, n in enumerate((u, t, c, back)):
                n.outputs[0].name = f"{stem}.{i}"
                n.outputs[0].dtype = ir.DataType.FLOAT
            graph.insert_before(node, [u, t, c, back, s])
            replace_node_output(graph, node, y, s.outputs[0])
            del graph.initializers[name]  # read by this node alone (checked), so unused now
            wt.name = name
            graph.register_initializer(wt)
        logger.info("matmul-to-conv: %d MatMuls run as 1x1 Convs", len(nodes))
        gemms = [n for n in graph if n.op_type == "Gemm" and len(n.inputs) > 1 and n.inputs[1] is not None
                 and n.inputs[1].const_value is not None]
        if gemms:
            logger.info("matmul-to-conv: %d constant-weight Gemm nodes left as they are (e.g. %r: GPT-2-style Conv1D "
                        "on [batch*seq, K] rows, which this lowering does not take)", len(gemms), gemms[0].name)
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "matmul-to-conv",
    help="run constant-weight MatMuls as 1x1 Convs: ONNX Runtime's x86 CPU EP then uses its blocked pointwise "
    "kernels, faster for the few rows of a decode or verification step; CPU EP only; outputs equal within round-off",
    after=("fuse-decoder", "pack-matmuls", "trim-logits", "quantize-int4", "quantize-int8", "eagle-drafter", "split-drafter",
           "explicit-attention"),
    before=("speculative",),
)
def _make_matmul_to_conv(context) -> MatMulToConvPass:
    return MatMulToConvPass()
