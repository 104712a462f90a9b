"""Graph passes on onnx-ir, registered by name for ``dyncompile --passes``.

Importing this package registers every built-in pass.
"""

from dyncompile.passes import (
    _emit_speculative,  # noqa: F401  (registers the generate/speculative plan emitters)
    _emit_staged,  # noqa: F401  (registers the staged plan emitter)
)
from dyncompile.passes._infra import (
    PASS_REGISTRY,
    CompileContext,
    PipelineResult,
    build_passes,
    known_passes,
    parse_pass_spec,
    register_pass,
    run_pipeline,
)
from dyncompile.passes.cleanup_graph import CleanupGraphPass
from dyncompile.passes.fit_exit_heads import FitExitHeadsPass
from dyncompile.passes.insert_early_exit import InsertEarlyExitPass
from dyncompile.passes.quantize_weights import QuantizeDynamicInt8Pass, QuantizeWeightsInt4Pass
from dyncompile.passes.speculative import SpeculativePass
from dyncompile.passes.split_drafter import SplitDrafterPass
from dyncompile.passes.verify_model import VerifyModelPass
from dyncompile.passes.wire_given_exit_heads import WireGivenExitHeadsPass

__all__ = [
    "PASS_REGISTRY",
    "CleanupGraphPass",
    "CompileContext",
    "FitExitHeadsPass",
    "InsertEarlyExitPass",
    "PipelineResult",
    "QuantizeDynamicInt8Pass",
    "SpeculativePass",
    "SplitDrafterPass",
    "QuantizeWeightsInt4Pass",
    "VerifyModelPass",
    "WireGivenExitHeadsPass",
    "build_passes",
    "known_passes",
    "parse_pass_spec",
    "register_pass",
    "run_pipeline",
]
