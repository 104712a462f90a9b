"""Every ``dyncompile.*`` key passes write into a model.

Two kinds: ``metadata_props`` (strings, saved with the ONNX file) and ``model.meta`` (in-memory objects handed
from one pass to the next or to the plan emitter).

One module, so that a reader finds every key a pass may leave behind, and a new key is declared once
(``tests/test_metadata_keys.py`` fails on a ``"dyncompile.…"`` literal in ``passes/`` that is not here).
"""

from __future__ import annotations

__all__ = [
    "DRAFTER_MODEL",
    "DRAFTER_ROWS_MODEL",
    "EAGLE",
    "EAGLE_FEATURES",
    "EAGLE_MODEL",
    "MEDUSA",
    "MEDUSA_MODEL",
    "EARLY_EXIT",
    "EARLY_EXIT_LOWERING",
    "EARLY_EXIT_LOWERING_CHOICE",
    "EMITTER",
    "EXPLICIT_ATTENTION",
    "LOGITS_EXACT",
    "METADATA_KEYS",
    "META_KEYS",
    "POLICY_PREFIX",
    "QUANTIZED",
    "ROLE",
    "SMOOTHED",
    "SPECULATIVE",
    "SPARSITY",
    "SPECULATIVE_MEASURED",
    "SPECULATIVE_ROWS",
    "SPLIT_DRAFTER",
    "SPLIT_DRAFTER_MODEL",
    "SPLIT_DRAFTER_VOCAB",
    "DRAFTER_VOCAB",
    "STEP_SAVER",
    "TASK",
    "UNET_CACHE",
]

# --- metadata_props (strings; JSON where structured) -------------------------------------------------
TASK = "dyncompile.task"  # the plan's task ("text-classification", "text-generation")
EMITTER = "dyncompile.emitter"  # which plan emitter writes the plan ("early_exit_staged", "speculative", ...)
EARLY_EXIT = "dyncompile.early_exit"  # JSON: exit heads, cuts, thresholds, calibration (FitExitHeadsPass)
EARLY_EXIT_LOWERING = "dyncompile.early_exit.lowering"  # "if" | "staged" (InsertEarlyExitPass)
EARLY_EXIT_LOWERING_CHOICE = "dyncompile.early_exit.lowering_choice"  # JSON: provider and reason of the choice
QUANTIZED = "dyncompile.quantized"  # JSON: scheme of the quantize passes
SMOOTHED = "dyncompile.smoothed"  # JSON: alpha, groups and fp32 layer cuts (SmoothActivationsPass)
SPECULATIVE = "dyncompile.speculative"  # JSON: target/drafter specs, draft policy, generation config
SPLIT_DRAFTER = "dyncompile.split_drafter"  # JSON: SplitDrafterPass decisions and measurements
ROLE = "dyncompile.role"  # "drafter" on a drafter graph
UNET_CACHE = "dyncompile.unet_cache"  # JSON: cut depth, deep output, refresh schedule, calibration (CacheUNetFeaturesPass)
STEP_SAVER = "dyncompile.step_saver"  # JSON: step head, stop rule, default policy, calibration (StepSaverPass)
EAGLE = "dyncompile.eagle"  # JSON: EAGLE head provenance, draft vocabulary, IO names (EagleDrafterPass)
MEDUSA = "dyncompile.medusa"  # JSON: Medusa heads provenance, heads, topk, IO names (MedusaHeadsPass)
SPARSITY = "dyncompile.sparsity"  # JSON: thresholds, achieved sparsity, held-out quality (SparsifyActivationsPass)
EAGLE_FEATURES = "dyncompile.eagle.features"  # name of the features output (ExposeFeaturesPass)
EXPLICIT_ATTENTION = "dyncompile.explicit_attention"  # JSON: the 4-D attention bias input (ExposeAttentionMaskPass)
LOGITS_EXACT = "dyncompile.logits_exact"  # "argmax": the logits are exact at each row's argmax only (ScreenLMHeadPass)
POLICY_PREFIX = "dyncompile.policy."  # dyncompile.policy.NAME -> plan policy NAME

# --- model.meta (in-memory objects, never saved) ----------------------------------------------------
DRAFTER_MODEL = "dyncompile.drafter_model"  # ir.Model of the drafter (SpeculativePass -> emitter)
SPLIT_DRAFTER_MODEL = "dyncompile.split_drafter.model"  # ir.Model built by SplitDrafterPass
SPLIT_DRAFTER_VOCAB = "dyncompile.split_drafter.vocab"  # the drafter's vocabulary subset (token ids)
DRAFTER_VOCAB = "dyncompile.drafter_vocab"  # an external drafter's trimmed LM head's token ids (SpeculativePass -> emitter)
MEDUSA_MODEL = "dyncompile.medusa.model"  # ir.Model heads graph built by MedusaHeadsPass
EAGLE_MODEL = "dyncompile.eagle.model"  # (ir.Model drafter, vocab ids) built by EagleDrafterPass
SPECULATIVE_MEASURED = "dyncompile.speculative.measured"  # SpeculativePass timings + graph fingerprint (reused on a re-run)
SPECULATIVE_ROWS = "dyncompile.speculative.rows"  # SpeculativePass row-invariance probe + graph fingerprint (reused)
DRAFTER_ROWS_MODEL = "dyncompile.drafter_rows"  # (drafter fingerprint, int8 twin or None, record) (SpeculativePass)

METADATA_KEYS = frozenset(
    {TASK, EMITTER, EARLY_EXIT, EARLY_EXIT_LOWERING, EARLY_EXIT_LOWERING_CHOICE, QUANTIZED, SPECULATIVE, SPLIT_DRAFTER,
     ROLE, SMOOTHED, STEP_SAVER, UNET_CACHE, EAGLE, EAGLE_FEATURES, EXPLICIT_ATTENTION, MEDUSA, SPARSITY,
     LOGITS_EXACT}
)
META_KEYS = frozenset({EAGLE_MODEL, MEDUSA_MODEL, DRAFTER_MODEL, DRAFTER_VOCAB, SPLIT_DRAFTER_MODEL, SPLIT_DRAFTER_VOCAB,
                       SPECULATIVE_MEASURED,
                       SPECULATIVE_ROWS, DRAFTER_ROWS_MODEL})
