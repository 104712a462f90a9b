"""Early exit for encoder classifiers: exit heads after chosen layers, thresholds calibrated to an
accuracy budget, lowered to an If graph or a staged plan.

* ``exit_heads`` — the head model, fitting, the exit rule and threshold calibration (numpy);
* ``fit_exit_heads`` — :class:`FitExitHeadsPass` (probe features, fit heads, calibrate);
* ``wire_given_exit_heads`` — :class:`WireGivenExitHeadsPass` (per-layer logits the graph already has);
* ``insert_early_exit`` — :class:`InsertEarlyExitPass` (lowering to the If graph or staged segments);
* ``graph`` — ONNX builders for heads and the exit test; ``emit_staged`` — the staged plan emitter.
"""

from dyncompile.passes.early_exit import emit_staged  # noqa: F401  (registers the staged plan emitter)
from dyncompile.passes.early_exit.fit_exit_heads import AttachExitHeadsPass, FitExitHeadsPass
from dyncompile.passes.early_exit.insert_early_exit import InsertEarlyExitPass
from dyncompile.passes.early_exit.wire_given_exit_heads import WireGivenExitHeadsPass

__all__ = ["AttachExitHeadsPass", "FitExitHeadsPass", "InsertEarlyExitPass", "WireGivenExitHeadsPass"]
