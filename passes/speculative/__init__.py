"""Speculative decoding: a drafter proposes tokens, the target verifies them in one call (lossless).

Modules, in import order (each imports only those above it):

* ``decoder_spec`` — how the runtime drives a KV-cache decoder, its generation config, the tokenizer check;
* ``probe`` — ORT sessions on in-memory models and the timings that go into a plan;
* ``explicit_attention`` — :class:`ExposeAttentionMaskPass` (a 4-D attention mask input, for draft trees);
* ``split_drafter`` — :class:`SplitDrafterPass` (a drafter from the target's first k layers) and its graph surgery;
* ``expose_features`` — :class:`ExposeFeaturesPass` (the target's top-layer features as an output);
* ``eagle_drafter`` — :class:`EagleDrafterPass` (an EAGLE drafter from a head trained by ``train-drafter``);
* ``medusa_heads`` — :class:`MedusaHeadsPass` (Medusa heads trained by ``train-drafter --kind medusa``);
* ``speculative`` — :class:`SpeculativePass` (external / prompt-lookup / split / eagle / medusa drafter);
* ``emit`` — the ``generate`` / ``speculative`` plan emitters.

The cost model behind the projections (expected tokens per round, verification cost, speedup) is
:mod:`dyncompile.runtime.rules.cost_model`, the one the runtime's draft-length controller uses.
"""

from dyncompile.passes.speculative import emit  # noqa: F401  (registers the generate/speculative emitters)
from dyncompile.passes.speculative.decoder_spec import (
    DrafterError,
    check_same_tokenizer,
    decoder_spec,
    generation_config,
    is_kv_decoder,
)
from dyncompile.passes.speculative.eagle_drafter import EagleDrafterPass
from dyncompile.passes.speculative.explicit_attention import ExposeAttentionMaskPass
from dyncompile.passes.speculative.expose_features import ExposeFeaturesPass
from dyncompile.passes.speculative.medusa_heads import MedusaHeadsPass
from dyncompile.passes.speculative.speculative import SpeculativePass, trim_drafter_vocab
from dyncompile.passes.speculative.split_drafter import SplitDrafterPass

__all__ = [
    "DrafterError",
    "EagleDrafterPass",
    "ExposeFeaturesPass",
    "ExposeAttentionMaskPass",
    "MedusaHeadsPass",
    "SpeculativePass",
    "SplitDrafterPass",
    "check_same_tokenizer",
    "decoder_spec",
    "generation_config",
    "is_kv_decoder",
    "trim_drafter_vocab",
]
