"""``raise-opset``: declare a newer default ONNX opset when no operator of the graph changes meaning on the way.

Some lowerings need operators of a newer opset than an export declares: opset 21's blocked ``QuantizeLinear``
quantizes each row of a 3-D activation with its own scale, so per-token int8 (``quantize-int8{activations=
per-token|mixed}``) needs no 2-D view of the activation and no shape arithmetic around it — five of its sixteen
kernels a feed-forward layer go (MPNet-base mixed int8 exit plan: 1.02x at the same bytes,
``bench-results/quantized-certified/`` round 12). torch's exporters write opset 17-18.

* Scope: the model's default-domain opset import and the version of every default-domain node, in the main
  graph and every subgraph (If/Loop/Scan branches). Other domains (``com.microsoft``) are untouched.
* Rule: each operator the graph uses is looked up in ONNX's schemas between the declared opset and the target.
  An operator whose later versions only add types or optional inputs/attributes whose defaults are the old
  behaviour (:data:`SAME_MEANING`: ``Cast``, ``Reshape``, ``If``, ``QuantizeLinear``, ...) keeps its meaning;
  any other operator with a new version in between (``GroupNormalization``-21 reads its scale per channel,
  ``DFT``-20 takes its axis as an input, ``GridSample``-20 renamed its modes) stops the pass with a message
  naming it, and the graph is left as it is. Model-local functions also stop it (their own imports).
* Invariants: graph inputs/outputs, nodes and weights unchanged; outputs bit-identical (tested in ORT with
  ``ORT_DISABLE_ALL`` and with every optimization, both If branches). Idempotent: a model already at or above the
  target reports ``modified=False``.

The onnxscript version converter is not used: it logs and skips a node whose adapter fails and still raises
the model's opset, and it inlines functions and removes unused nodes on the way.
"""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

from dyncompile.passes._graph import default_opset
from dyncompile.passes._infra import not_fired, register_pass

logger = logging.getLogger(__name__)

__all__ = ["SAME_MEANING", "RaiseOpsetPass", "changed_operators"]

#: the highest opset this pass raises to (ONNX Runtime >= 1.20 runs it; dyncompile needs >= 1.24)
MAX_TARGET = 21

#: operators whose versions 19-21 only add element types (float8, int4, string, bool) or optional
#: attributes/inputs whose defaults keep the earlier behaviour (Cast/QuantizeLinear ``saturate``, Pad ``wrap``,
#: Resize's new modes, AveragePool ``dilations``, QuantizeLinear's ``block_size`` 0 and ``output_dtype``)
SAME_MEANING = frozenset({
    "AveragePool", "Cast", "CastLike", "Constant", "ConstantOfShape", "DequantizeLinear", "Equal", "Flatten",
    "Identity", "If", "IsInf", "IsNaN", "Loop", "Pad", "QuantizeLinear", "ReduceMax", "ReduceMin", "Reshape",
    "Resize", "Scan", "Shape", "Size", "Squeeze", "Transpose", "Unsqueeze",
})


def _since(op: str, opset: int) -> int | None:
    try:
        return onnx.defs.get_schema(op, max_inclusive_version=opset, domain="").since_version
    except onnx.defs.SchemaError:
        return None


def changed_operators(model: ir.Model, target: int) -> list[str]:
    """The default-domain operators of ``model`` that may change meaning on the way to opset ``target``, sorted.

    Those with a version between the model's opset and ``target`` not in :data:`SAME_MEANING`; unknown
    operators count as changed.
    """
    opset = default_opset(model)
    ops = {n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.domain in ("", "ai.onnx")}
    return sorted(op for op in ops - SAME_MEANING
                  if _since(op, opset) is None or _since(op, target) != _since(op, opset))


class RaiseOpsetPass(ir.passes.InPlacePass):
    """Declare default opset ``target`` where no operator of the graph changes meaning (module docstring)."""

    def __init__(self, target: int = MAX_TARGET) -> None:
        super().__init__()
        if not 18 <= int(target) <= MAX_TARGET:
            raise ValueError(f"raise-opset: target must be between 18 and {MAX_TARGET}, not {target}")
        self.target = int(target)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(target={self.target})"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Raise the declared opset of ``model`` (scope and rule: the module docstring)."""
        opset = default_opset(model)
        if opset >= self.target:
            logger.debug("raise-opset: the model already declares opset %d (>= %d)", opset, self.target)
            return ir.passes.PassResult(model, modified=False)
        if model.functions:
            return not_fired(model, "raise-opset",
                             f"the model has {len(model.functions)} local function(s) with their own opset imports",
                             "inline them first (onnx_ir.passes.common.InlinePass) or leave raise-opset out")
        changed = changed_operators(model, self.target)
        if changed:
            return not_fired(model, "raise-opset",
                             f"{', '.join(changed)} may change meaning between opset {opset} and {self.target}",
                             "leave raise-opset out for this model (the per-token int8 lowering then uses 2-D views)")
        model.opset_imports.pop("ai.onnx", None)
        model.opset_imports[""] = self.target
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.domain in ("", "ai.onnx") and node.version is not None:
                node.version = self.target
        logger.info("raise-opset: default opset %d -> %d", opset, self.target)
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "raise-opset",
    help="declare a newer default ONNX opset (21) when none of the graph's operators changes meaning on the way; "
    "bit-identical outputs (lets per-token int8 use opset 21's blocked QuantizeLinear)",
    before=("quantize-int8", "quantize-int4", "early-exit"),
)
def _make_raise_opset(context, target: int = MAX_TARGET) -> RaiseOpsetPass:
    return RaiseOpsetPass(target)
