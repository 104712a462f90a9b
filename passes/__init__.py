"""Graph passes on onnx-ir, registered by name for ``dyncompile --passes``.

Importing this package registers every built-in pass and plan emitter. Layout:

* ``_infra`` — registry and pipeline runner (checking, timing, IR dumps belong here, not in passes);
* ``presets`` — optimization levels: the EP-aware lowering passes a compile inserts (``-O``), as data;
* ``_graph`` — graph helpers every pass shares (backward slices through subgraph captures, constant reads);
* ``compiler`` — the compile driver behind :func:`dyncompile.compile`;
* ``emit`` — turns the final graph into a plan (emitters per technique);
* ``unet_cache/`` — feature caching across denoising steps (``cache-unet``) for diffusion U-Nets;
* ``early_exit/`` — exit heads, their fitting and calibration, the exit rule, the lowering passes;
* ``speculative/`` — decoder specs, measurement, the split drafter and the speculative pass;
* ``analysis/`` — layers, cut tensors and the family of an exported transformer;
* one module per remaining pass (``cleanup_graph``, ``verify_model``, ``causal_attention``, ``cast_float16``, ``quantize_weights``, ``fuse_decoder``,
  ``fuse_encoder_attention``, ``fuse_gelu``, ``fuse_int8_epilogues``, ``pack_matmuls``,
  ``matmul_to_conv``, ``raise_opset``, ``tabulate_length_values``).
"""

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
from dyncompile.passes.cast_float16 import CastFloat16Pass
from dyncompile.passes.causal_attention import CausalAttentionPass
from dyncompile.passes.cleanup_graph import CleanupGraphPass
from dyncompile.passes.early_exit import (
    FitExitHeadsPass,
    InsertEarlyExitPass,
    WireGivenExitHeadsPass,
)
from dyncompile.passes.fuse_decoder import FuseDecoderPass
from dyncompile.passes.fuse_encoder_attention import FuseEncoderAttentionPass
from dyncompile.passes.fuse_gelu import FuseGeluPass
from dyncompile.passes.fuse_int8_epilogues import FuseInt8EpiloguesPass
from dyncompile.passes.key_padding_mask import KeyPaddingMaskPass
from dyncompile.passes.matmul_to_conv import MatMulToConvPass
from dyncompile.passes.pack_matmuls import PackMatMulsPass
from dyncompile.passes.quantize_weights import QuantizeDynamicInt8Pass, QuantizeWeightsInt4Pass
from dyncompile.passes.raise_opset import RaiseOpsetPass
from dyncompile.passes.screen_lm_head import ScreenLMHeadPass
from dyncompile.passes.smooth_activations import SmoothActivationsPass
from dyncompile.passes.sparsify_activations import SparsifyActivationsPass
from dyncompile.passes.speculative import SpeculativePass, SplitDrafterPass
from dyncompile.passes.step_saver import pipeline as _step_saver  # noqa: F401  (diffusion plans)
from dyncompile.passes.tabulate_length_values import TabulateLengthValuesPass
from dyncompile.passes.trim_logits import TrimLogitsPass
from dyncompile.passes.unet_cache import CacheUNetFeaturesPass
from dyncompile.passes.verify_model import VerifyModelPass

__all__ = [
    "PASS_REGISTRY",
    "CastFloat16Pass",
    "CausalAttentionPass",
    "CleanupGraphPass",
    "CompileContext",
    "FitExitHeadsPass",
    "FuseDecoderPass",
    "FuseEncoderAttentionPass",
    "FuseGeluPass",
    "FuseInt8EpiloguesPass",
    "KeyPaddingMaskPass",
    "MatMulToConvPass",
    "PackMatMulsPass",
    "InsertEarlyExitPass",
    "PipelineResult",
    "QuantizeDynamicInt8Pass",
    "RaiseOpsetPass",
    "SpeculativePass",
    "SplitDrafterPass",
    "TabulateLengthValuesPass",
    "TrimLogitsPass",
    "CacheUNetFeaturesPass",
    "QuantizeWeightsInt4Pass",
    "ScreenLMHeadPass",
    "SmoothActivationsPass",
    "SparsifyActivationsPass",
    "VerifyModelPass",
    "WireGivenExitHeadsPass",
    "build_passes",
    "known_passes",
    "parse_pass_spec",
    "register_pass",
    "run_pipeline",
]
