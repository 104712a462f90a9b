"""``fuse-gelu``: the exact (erf) GELU written as five elementwise nodes -> one ``com.microsoft.Gelu``.

torch's ONNX exporter writes ``gelu(x)`` of a BERT-style encoder's feed-forward layer as
``x * (0.5 * (Erf(x / sqrt(2)) + 1))`` (or ``0.5 * (x * (Erf(x / sqrt(2)) + 1))``): ``Div``, ``Erf``, ``Add``,
``Mul``, ``Mul``, each a pass over a ``[batch, sequence, 4 * hidden]`` tensor, and ONNX Runtime's own
``GeluFusion`` does not match the exporter's operand order (checked on the MiniLM-L6 and MPNet-base exports:
their optimized graphs keep every ``Erf``). One fused kernel reads the tensor once: on MiniLM-L6 int8 at batch 1
(2 CPU threads) the model runs 1.10x faster and its early-exit plan 1.10x (``bench-results/quantized-certified/``,
round 8).

* Scope: the main graph (run it before ``early-exit``, which moves layers into If branches, and before the
  quantization passes, whose dynamic int8 activations then read the fused kernel's output). The patterns are
  onnxscript's (``onnxscript.rewriter.ort_fusions.erfgelu``): ``x / sqrt(2)`` with the constants ``sqrt(2)``,
  ``1`` and ``0.5`` as scalar constants.
* Rewrite: ``com.microsoft.Gelu(x)`` replaces the last ``Mul``'s output; the other four nodes go.
* Invariants: graph inputs/outputs unchanged; outputs equal the original's within float round-off (tested
  <= 1e-5 in ORT with ``ORT_DISABLE_ALL``). Idempotent: a fused graph has no such pattern left, so a second run
  reports ``modified=False``. A graph without the pattern (a SiLU decoder, a tanh-approximate GELU) is left
  alone with a message saying why.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from dyncompile.passes._infra import not_fired, register_pass, warn_unmeasured_contrib_op

logger = logging.getLogger(__name__)

__all__ = ["FuseGeluPass"]

_MS = "com.microsoft"


class FuseGeluPass(ir.passes.InPlacePass):
    """Exact GELU as ``Div/Erf/Add/Mul/Mul`` -> ``com.microsoft.Gelu`` (see the module docstring)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the module docstring)."""
        from onnxscript.rewriter.ort_fusions.erfgelu import rules

        count = rules.apply_to_model(model)
        if not count:
            if any(n.op_type == "Gelu" and n.domain == _MS for n in model.graph):
                return ir.passes.PassResult(model, modified=False)  # fused by an earlier run
            return not_fired(model, "fuse-gelu",
                             "no exact GELU written as x * 0.5 * (Erf(x / sqrt(2)) + 1) in the main graph",
                             "leave fuse-gelu out for this model")
        model.opset_imports.setdefault(_MS, 1)
        logger.info("fuse-gelu: %d GELUs fused into com.microsoft.Gelu", count)
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "fuse-gelu",
    help="the exact GELU a torch export writes as Div/Erf/Add/Mul/Mul -> one com.microsoft.Gelu; exact within "
    "float round-off (run before early-exit and quantization)",
    before=("early-exit", "quantize-int8", "quantize-int4"),
)
def _make_fuse_gelu(context) -> FuseGeluPass:
    warn_unmeasured_contrib_op(context, logger, "fuse-gelu", "Gelu")
    return FuseGeluPass()
