"""``speculative``: turn a KV-cache decoder into a speculative-decoding plan with a drafter.

Drafters (``--drafter``):

* ``DRAFT.onnx`` — an *external* decoder with the same tokenizer (checked: the ``tokenizer.json`` and
  ``dyncompile-model.json`` beside each model must agree on the vocabulary and special tokens, and the two
  graphs' logits on the vocabulary size) and a KV cache of its own;
* ``prompt-lookup`` — no model: n-gram matches in the prompt and the text so far;
* ``lookahead`` — no model: lookahead decoding (a Jacobi window of ``window`` columns x ``ngram - 1`` levels and an
  n-gram pool, ``guesses`` pool n-grams per round), verified as one draft tree per round: it needs
  ``explicit-attention`` first and always records a fixed-size tree (``tree=true`` is implied);
* nothing, after ``split-drafter`` — the drafter that pass built from the target's own first layers (or after
  ``eagle-drafter`` / ``medusa-heads`` — the EAGLE head / the Medusa heads those passes built).

The target graph is not changed: the pass validates both graphs, records how the runtime drives them
(inputs, logits, KV pairs), the drafter and the draft-length policy under ``dyncompile.speculative`` in the
model's ``metadata_props``, and selects the ``speculative`` plan emitter, which writes the target and the
drafter files and a ``speculative_generate`` step (:mod:`dyncompile.runtime.decode.speculative`). The external
drafter graph travels to the emitter in ``model.meta`` (in memory, never serialised).

With ``tree=true`` (after ``explicit-attention``, which gives the target a 4-D attention mask input) each
round verifies a draft tree instead of a chain (``tree_nodes``, ``tree_depth``, ``branching``,
``tree_adaptive``; :mod:`dyncompile.runtime.decode.draft_tree`), and the verification cost curve is timed up to
the largest tree. A model drafter (external or EAGLE) then gets the same 4-D attention bias input
(:class:`ExposeAttentionMaskPass` on the drafter graph), so it can grow its tree best-first, one drafter call
per depth (EAGLE-2).

The draft-cost numbers of the record (the target's verification cost by tokens per call, an external
drafter's step cost) are timed on this machine (:mod:`.probe`) unless ``measure=False``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from dyncompile.errors import DyncompileError, PassConfigError, PlanError
from dyncompile.io import load_input_model
from dyncompile.passes import _keys
from dyncompile.passes._infra import CompileContext, register_pass
from dyncompile.passes.sparsify_activations import keep_verification_rows, prefill_only_rows
from dyncompile.passes.speculative.decoder_spec import (
    DrafterError,
    check_same_tokenizer,
    decoder_spec,
    generation_config,
)
from dyncompile.passes.speculative.explicit_attention import ExposeAttentionMaskPass
from dyncompile.passes.speculative.probe import (
    drafter_step_seconds,
    fastest_times,
    measure_step_rounds,
    probe_chunk,
    session_for,
    target_min_rows,
    target_verify_costs,
    weight_reads,
)
from dyncompile.passes.speculative.split_drafter import frequent_subset, tokenized_calibration, trim_lm_head
from dyncompile.plan import from_json
from dyncompile.plan.decode import MAX_DRAFT_NODES, TreePolicy, lookahead_tree_nodes

logger = logging.getLogger(__name__)

__all__ = ["PROMPT_LOOKUP", "SpeculativePass", "call_shape_dependent_ops", "trim_drafter_vocab"]

SPECULATIVE_FORMAT = "dyncompile.speculative/v1"
PROMPT_LOOKUP = "prompt-lookup"
LOOKAHEAD = "lookahead"
MODEL_FREE = (PROMPT_LOOKUP, LOOKAHEAD)
#: the draft-policy entries that are timed on this machine
MEASURED_KEYS = ("verify_cost", "draft_cost", "draft_cost_source")


#: default longest draft: prompt lookup drafts for free, and on grounded prompts its matches run long (tuned on
#: ``prompt_sets --split calib`` grounded prompts, Qwen2.5-Coder-0.5B fp32: max 8 / 16 / 24 / 32 gave 3.38x / 3.64x /
#: 3.69x / 3.71x decode speed over greedy, the adaptive policy cutting drafts where matches fail); model drafters
#: pay a drafter step per token
DEFAULT_MAX_DRAFT = {PROMPT_LOOKUP: 16, "model": 8}


def trim_drafter_vocab(drafter: ir.Model, token_ids: Sequence[int]) -> None:
    """Restrict an external drafter's LM head to ``token_ids`` (in place), for ``SpeculativePass(drafter_vocab=...)``.

    Its logits then cover those tokens only: a draft step reads that much less of the head (Qwen2.5-Coder-0.5B
    int4, 32,768 of 151,936 tokens: one step 9.5 -> 7.5 ms on 2 cores). Any subset keeps decoding exact; tokens
    outside it are never drafted, which only lowers acceptance where the target emits them.
    """
    spec = decoder_spec(drafter, "drafter", what="drafter")
    if not trim_lm_head(drafter, spec["logits"], np.asarray(token_ids, np.int64)):
        raise DrafterError("draft_vocab: cannot restrict this drafter's LM head to a vocabulary subset (it is not a "
                           "MatMul, a tied-embedding MatMul or a MatMulNBits producing the logits); leave draft_vocab out")
    common_passes.RemoveUnusedNodesPass()(drafter)  # the full head's weights, unless something else reads them


def calibration_vocab(context: CompileContext, n: int, vocab_size: int) -> np.ndarray:
    """The ``n`` most frequent tokens of ``--calib`` (the target's tokenizer) plus its special tokens."""
    calib = context.options.get("calib")
    if not calib:
        raise DrafterError(f"speculative{{draft_vocab={n}}} keeps the {n} most frequent tokens of the calibration "
                           "text in the drafter's LM head: pass --calib TEXT (a text file, JSONL with 'text' or a "
                           "directory of .txt/.py/.md files, like the prompts you will serve)")
    texts, special = tokenized_calibration(context, calib, "draft_vocab")
    ids = np.concatenate([np.asarray(t, np.int64) for t in texts])
    score = np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size).astype(np.float64)
    return frequent_subset(score, n, special)


def default_max_draft(drafter, hybrid: bool = False) -> int:
    """The longest chain a plan drafts unless ``max_draft`` is given.

    Prompt lookup's for prompt lookup and for a hybrid (its prompt-lookup rounds copy long matches; the other
    part's controller picks its own, shorter lengths); a model drafter's otherwise.
    """
    return DEFAULT_MAX_DRAFT[PROMPT_LOOKUP if drafter == PROMPT_LOOKUP or hybrid else "model"]


def lookahead_tree(window: int, ngram: int, guesses: int, hybrid: bool, max_ngram: int) -> dict[str, Any]:
    """The fixed tree policy of a lookahead drafter: every window cell and pool n-gram, the window's depth.

    A hybrid (prompt lookup too) gets as many nodes again for the context's matches.
    """
    nodes = lookahead_tree_nodes(window, ngram, guesses)
    return {"max_nodes": min(MAX_DRAFT_NODES, 2 * nodes if hybrid else nodes), "max_depth": window + ngram - 2,
            "branching": max(3, guesses + 1), "adaptive": False}


def _verify_sizes(top: int) -> list[int]:
    """Token counts whose verification is timed: 1, 2, 4, 9, ... below ``top``, and ``top`` itself."""
    return sorted({*(s for s in (1, 2, 4, 9, 16, 24, 32, 48, 64) if s < top), top})


# ------------------------------------------------------------------------------------------- the pass


def _tree_target_message(model: ir.Model, target: dict[str, Any]) -> str:
    """Why ``model`` cannot verify draft trees, and what to do: add explicit-attention only where it can fire."""
    from dyncompile.passes.speculative import explicit_attention

    need = ("speculative{tree=true} needs a target with a 4-D attention mask input (attention_bias) and position_ids, "
            "so that one call can verify a draft tree")
    if not target.get("position_ids"):
        return f"{need}: this target has no position_ids input; re-export it with position_ids, or leave out tree=true"
    if target.get("attention") == "causal":
        return f"{need}: causal-attention replaced it by a causal mask (chains only); leave out causal-attention or tree=true"
    why = explicit_attention.why_no_attention_bias(model)
    if why is not None:
        return (f"{need}: explicit-attention cannot fire on this model ({why}), so draft trees are not available for "
                "it; leave out tree=true")
    return f"{need}: add the explicit-attention pass first (--passes explicit-attention,speculative{{tree=true}})"


class SpeculativePass(ir.passes.InPlacePass):
    """Record a speculative-decoding plan for a KV-cache decoder: drafter, KV bookkeeping, draft policy.

    Scope: the main graph's inputs and outputs (read only) and ``metadata_props``; nodes are never touched.

    Invariants: the target graph (nodes, initializers, I/O) is unchanged; only ``dyncompile.speculative``
    and ``dyncompile.emitter`` metadata are set; ``model.meta`` (in memory) gets the drafter graph for the
    emitter and the costs timed by this run.
    Precondition: the target's numerics must not depend on the number of tokens per call, or greedy output could
    not be token-identical to the target alone. Targets with int8 activation quantization are checked: one scale per
    call (``DynamicQuantizeLinear``) is refused; int8-compute ``MatMulNBits`` (``accuracy_level`` 4, one scale per
    row and block) is measured on this machine (:func:`.probe.target_min_rows`): if padding every call to
    ``min_rows`` (1 or 2) rows makes a row's logits the same in any call (bitwise), the target's spec gets that
    ``min_rows`` (the runtime pads; see :class:`~dyncompile.plan.DecoderSpec`), else it is refused.
    ``allow_inexact_target=True`` skips the check (and the padding).
    Idempotent: a second run finds the same record and reports ``modified=False``; with ``measure=True`` it
    times nothing again, because the costs of the last run are kept while the target and drafter graphs are
    the ones they were timed on (checked by a fingerprint of nodes and initializers; in memory only, so a
    model loaded from disk is always timed afresh).

    Draft cost: ``stop_below`` goes to the draft policy (a model, EAGLE or Medusa drafter's chain ends after a token it gives
    less probability); ``drafter_vocab`` names the token ids of an external drafter whose LM head
    :func:`trim_drafter_vocab` restricted to them (the plan maps its logits back; the CLI's ``draft_vocab=N`` picks
    the N commonest tokens of ``--calib``).

    Sketch: ``decoder -> decoder + {drafter, kv pairs, draft policy}`` -> plan step ``speculative_generate``.
    """

    def __init__(
        self,
        drafter: str | ir.Model | None = None,
        *,
        drafter_source: str | None = None,
        generation: dict[str, Any] | None = None,
        draft_length: int = 4,
        min_draft: int = 0,
        max_draft: int | None = None,
        adaptive: bool = True,
        max_ngram: int = 3,
        min_ngram: int = 1,
        tokenizer_check: str | None = None,
        measure: bool = True,
        allow_inexact_target: bool = False,
        tree: dict[str, Any] | None = None,
        window: int = 5,
        ngram: int = 4,
        guesses: int = 5,
        hybrid: bool = False,
        lookup_min_match: int | None = None,
        stop_below: float = 0.0,
        drafter_vocab: Sequence[int] | None = None,
        drafter_rows: bool = True,
    ) -> None:
        super().__init__()
        self.drafter_rows = bool(drafter_rows)
        self.measure = bool(measure)
        self.allow_inexact_target = bool(allow_inexact_target)
        if isinstance(drafter, str) and drafter not in MODEL_FREE:
            raise DrafterError(f"drafter must be an ir.Model, {PROMPT_LOOKUP!r}, {LOOKAHEAD!r} or None, not {drafter!r}")
        if not (1 <= int(window) <= 64 and 2 <= int(ngram) <= 16 and 0 <= int(guesses) <= 64):
            raise DrafterError(f"lookahead needs 1 <= window <= 64, 2 <= ngram <= 16 and 0 <= guesses <= 64, got "
                               f"window={window}, ngram={ngram}, guesses={guesses}")
        if hybrid and drafter == PROMPT_LOOKUP:
            raise DrafterError("hybrid=true adds prompt lookup to another drafter (a model, an EAGLE head or "
                               "lookahead); --drafter prompt-lookup alone already is prompt lookup")
        self.window, self.ngram, self.guesses, self.hybrid = int(window), int(ngram), int(guesses), bool(hybrid)
        if drafter == LOOKAHEAD and tree is None:  # the Jacobi window is a tree: always verified as one
            tree = lookahead_tree(self.window, self.ngram, self.guesses, self.hybrid, int(max_ngram))
        if max_draft is None:
            max_draft = default_max_draft(drafter, self.hybrid)
        if not 0 <= int(min_draft) <= int(max_draft) or int(draft_length) < 1:
            raise DrafterError(
                f"draft lengths need 1 <= draft_length and 0 <= min_draft <= max_draft, got draft_length={draft_length}, "
                f"min_draft={min_draft}, max_draft={max_draft}"
            )
        if not 1 <= int(min_ngram) <= int(max_ngram):
            raise DrafterError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if drafter_vocab is not None and not isinstance(drafter, ir.Model):
            raise DrafterError("drafter_vocab names the tokens of an external drafter's trimmed LM head "
                               "(trim_drafter_vocab); give that drafter model")
        self.drafter_vocab = None if drafter_vocab is None else np.asarray(drafter_vocab, np.int64)
        self.drafter = drafter
        self.drafter_source = drafter_source
        self.generation = dict(generation or {})
        self.draft = {
            "initial": int(draft_length),
            "min": int(min_draft),
            "max": max(int(max_draft), int(draft_length)),
            "adaptive": bool(adaptive),
        }
        if not 0.0 <= float(stop_below) <= 1.0:
            raise DrafterError(f"stop_below is a drafter probability in [0, 1], got {stop_below}")
        if float(stop_below) > 0.0:  # a model, EAGLE or Medusa drafter's chains end at its first unsure token
            self.draft["stop_below"] = float(stop_below)
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        # beside a model, EAGLE or Medusa drafter a hybrid takes prompt lookup's candidates on full max_ngram matches
        # only (shorter ones lose to the drafter's: the runtime's HybridDrafter); lookahead's pool is no better
        # than a short match, so there every match counts
        if lookup_min_match is None:
            lookup_min_match = 1 if drafter == LOOKAHEAD else self.max_ngram
        self.lookup_min_match = int(lookup_min_match)
        if not 1 <= self.lookup_min_match <= self.max_ngram:
            raise DrafterError(f"lookup_min_match must be between 1 and max_ngram ({self.max_ngram}), got "
                               f"{lookup_min_match}")
        self.tokenizer_check = tokenizer_check
        self.tree = None
        if tree is not None:
            t = {"max_nodes": 16, "max_depth": self.draft["max"], "branching": 3, "adaptive": True, **tree}
            # the plan schema's own check, so a tree this pass accepts is one the runtime loads
            try:
                policy = from_json(TreePolicy, t, "tree")
            except PlanError as e:
                raise DrafterError(f"{e} (the options tree_nodes, tree_depth, branching)") from None
            self.tree = dataclasses.asdict(policy)
            self.draft["max"] = max(self.draft["max"], self.tree["max_depth"])

    def __repr__(self) -> str:
        d = self.drafter
        kind = d if d in MODEL_FREE else ("split" if d is None else f"external:{self.drafter_source}")
        tree = f", tree={self.tree}" if self.tree else ""
        return f"SpeculativePass(drafter={kind!r}, draft={self.draft}{tree})"

    def _split(self, model: ir.Model) -> tuple[ir.Model, dict[str, Any]]:
        if _keys.SPLIT_DRAFTER not in model.metadata_props:
            raise DrafterError(
                "speculative needs a drafter: give --drafter DRAFT.onnx (a smaller model with the same tokenizer), "
                "--drafter prompt-lookup, or run split-drafter first (--passes split-drafter,speculative --calib TEXT)"
            )
        drafter = model.meta.get(_keys.SPLIT_DRAFTER_MODEL)
        if drafter is None:
            raise DrafterError(
                "this model records a split drafter but the drafter graph is not in memory (it never is after saving); "
                "compile from the original model with --passes split-drafter,speculative"
            )
        return drafter, json.loads(model.metadata_props[_keys.SPLIT_DRAFTER])

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        target = decoder_spec(model, "model", what="target model")
        if self.tree and not (target.get("attention_bias") and target.get("position_ids")):
            raise DrafterError(_tree_target_message(model, target))
        inexact = call_shape_dependent_ops(model)
        if inexact and not self.allow_inexact_target and _paddable(model):
            self._min_rows(model, target)  # refuses a target that padding does not make row-invariant
        elif inexact and not self.allow_inexact_target:
            raise DrafterError(
                f"the target's {inexact} round activations to int8 (DynamicQuantizeLinear with one scale per call, "
                "MatMulNBits per block of each row), which turns the last-bit differences between ORT's one-row and "
                "many-row float kernels into whole int8 steps: its logits depend on how many tokens one call "
                "processes (measured on Qwen2.5-Coder-0.5B int4 with int8 compute: up to 0.97 vs 6e-5 with fp32 "
                "compute) and no speculative decoder can be token-identical to its one-token-"
                "at-a-time output. Quantize the target with quantize-int4{accuracy_level=0} (weights int4, fp32 "
                "compute), quantize only the drafter, or pass speculative{allow_inexact_target=true} to accept "
                "near-tie differences"
            )
        if self.drafter is not None and _keys.SPLIT_DRAFTER in model.metadata_props:
            raise DrafterError(
                "two drafters: split-drafter built one from the target and --drafter names another "
                f"({self.drafter_source or self.drafter}); drop one of them"
            )
        if self.drafter in MODEL_FREE:
            return
        if self.drafter is None and _keys.MEDUSA in model.metadata_props:
            if _keys.MEDUSA_MODEL not in model.meta:
                raise DrafterError("this model records Medusa heads but their graph is not in memory; compile from the "
                                   "original model with --passes medusa-heads{head=DIR},speculative")
            return
        if self.drafter is None and _keys.EAGLE in model.metadata_props:
            if _keys.EAGLE_MODEL not in model.meta:
                raise DrafterError("this model records an EAGLE drafter but its graph is not in memory; compile from the "
                                   "original model with --passes eagle-drafter{head=DIR},speculative")
            return
        if isinstance(self.drafter, ir.Model):
            spec = decoder_spec(self.drafter, "drafter", what="drafter", where=self.drafter_source or "")
        else:
            drafter, _ = self._split(model)
            spec = decoder_spec(drafter, "drafter", what="split drafter")
        tv, dv = target["vocab_size"], spec["vocab_size"]
        split_vocab = self.drafter is None and model.meta.get(_keys.SPLIT_DRAFTER_VOCAB) is not None
        if self.drafter_vocab is not None:
            if dv is not None and dv != len(self.drafter_vocab) or tv is not None and self.drafter_vocab.max() >= tv:
                raise DrafterError(
                    f"the drafter's logits have {dv} entries but drafter_vocab names {len(self.drafter_vocab)} token ids "
                    f"(the largest {int(self.drafter_vocab.max())}, the target's vocabulary {tv}): trim the drafter's "
                    "LM head with trim_drafter_vocab(drafter, ids) and pass the same ids"
                )
        elif tv is not None and dv is not None and tv != dv and not split_vocab:
            raise DrafterError(
                f"vocabulary size mismatch: the target's logits have {tv} entries, the drafter's "
                f"({self.drafter_source or 'split drafter'}) {dv}; the drafter must share the target's tokenizer"
            )

    def _min_rows(self, model: ir.Model, target: dict[str, Any]) -> int:
        """The target's ``min_rows``: the fewest rows per call (1 or 2) that make its rows row-invariant here.

        Measured once per graph (:func:`.probe.target_min_rows`, kept in ``model.meta`` with the graph's
        fingerprint); a target that no padding makes row-invariant is refused.
        """
        key = _fingerprint(model)
        last = model.meta.get(_keys.SPECULATIVE_ROWS)
        if last is not None and last[0] == key:
            chosen, diffs = last[1]
        else:
            chosen, diffs = target_min_rows(model, target, MIN_ROWS_CANDIDATES)
            model.meta[_keys.SPECULATIVE_ROWS] = (key, (chosen, diffs))
            measured = ", ".join(f"{d:.1e} with calls of >= {m} row{'s' if m > 1 else ''}" if d else
                                 f"none (bitwise equal) with calls of >= {m} rows" for m, d in sorted(diffs.items()))
            if chosen is not None:
                logger.warning(
                    "speculative: the target's %s round activations to int8, so a row's logits may depend on the rows "
                    "in its call; measured on this machine, a row's largest |logit difference| between a verification "
                    "call and its own call was %s. min_rows=%d%s",
                    call_shape_dependent_ops(model), measured, chosen,
                    ": every target call (prompt, one-token steps, verification) computes at least 2 rows, the "
                    "padding row dropped, so the target alone and speculative decoding are token-identical (a "
                    "one-token step pays for a second row)" if chosen > 1 else ": no padding needed")
        if chosen is None:
            raise DrafterError(
                f"the target's {call_shape_dependent_ops(model)} round activations to int8 and its logits depend on "
                f"how many tokens one call processes even with calls padded to {max(MIN_ROWS_CANDIDATES)} rows "
                f"(measured on this machine, the largest |logit difference| of a row between a verification call "
                f"and its own call: {', '.join(f'{m} rows: {d:.2g}' for m, d in sorted(diffs.items()))}), so no "
                "speculative decoder could be token-identical to the target alone. Quantize the target with "
                "quantize-int4{block_size=32,accuracy_level=4} (int8 compute, row-invariant for calls of >= 2 rows "
                "on AVX-512 CPUs) or quantize-int4{accuracy_level=0} (fp32 compute), quantize only the drafter, or "
                "pass speculative{allow_inexact_target=true} to accept near-tie differences"
            )
        return chosen

    def _record(self, model: ir.Model) -> dict[str, Any]:  # noqa: C901 - one branch per drafter kind
        target = decoder_spec(model, "model", what="target model")
        if not self.allow_inexact_target and call_shape_dependent_ops(model) and _paddable(model):
            rows = self._min_rows(model, target)
            if rows > 1:
                target["min_rows"] = rows
        if self.drafter == PROMPT_LOOKUP:
            drafter: dict[str, Any] = {"kind": PROMPT_LOOKUP, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
        elif self.drafter == LOOKAHEAD:
            drafter = {"kind": LOOKAHEAD, "window": self.window, "ngram": self.ngram, "guesses": self.guesses}
        elif isinstance(self.drafter, ir.Model):
            drafter = {
                "kind": "model",
                "name": "external",
                "source": self.drafter_source,
                "decoder": decoder_spec(self.drafter, "drafter", what="drafter"),
                "share_kv": None,
                "tokenizer_check": self.tokenizer_check,
            }
            if self.drafter_vocab is not None:
                drafter["draft_vocab"] = int(len(self.drafter_vocab))
            twin = self._rows_twin(model, target, drafter["decoder"])
            if twin is not None:
                drafter["rows_from"] = twin["rows_from"]
                drafter["rows_twin"] = twin
        elif _keys.MEDUSA in model.metadata_props:
            rec = json.loads(model.metadata_props[_keys.MEDUSA])
            drafter = {"kind": "medusa", "name": "medusa", "features": rec["features"], "heads": rec["heads"],
                       "topk": rec["topk"], "head": rec["head"]}
        elif _keys.EAGLE in model.metadata_props:
            rec = json.loads(model.metadata_props[_keys.EAGLE])
            dmodel = model.meta[_keys.EAGLE_MODEL][0]
            drafter = {
                "kind": "eagle",
                "name": "eagle",
                "decoder": decoder_spec(dmodel, "drafter", what="EAGLE drafter", extra_inputs=(rec["feature_input"],)),
                "features": rec["features"],
                "feature_input": rec["feature_input"],
                "hidden_output": rec["hidden_output"],
                "head": rec["head"],
            }
        else:
            dmodel, split = self._split(model)
            drafter = {
                "kind": "model",
                "name": "split",
                "decoder": decoder_spec(dmodel, "drafter", what="split drafter"),
                "share_kv": split["share_kv"],
                "layers": split["layers"],
                "vocab_size": split.get("vocab_size"),
            }
        if self.hybrid:
            drafter.update({"prompt_lookup": True, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram,
                            "lookup_min_match": self.lookup_min_match})
        draft = dict(self.draft)
        if self.tree:
            draft["tree"] = dict(self.tree)
        if drafter.get("name") == "split":  # measured by split-drafter
            sd = self._split(model)[1]
            draft["alpha0"] = sd.get("acceptance")
            draft["draft_cost"] = sd.get("draft_cost")
            draft["verify_cost"] = sd.get("verify_cost")
        elif drafter["kind"] == "medusa":  # K residual blocks + the draft-vocabulary LM head, in weight bytes
            draft["draft_cost"] = round(weight_reads(model.meta[_keys.MEDUSA_MODEL]) / max(1, weight_reads(model)), 4)
            draft["draft_cost_source"] = "weight bytes"
            agree = (drafter["head"].get("eval") or {}).get("head_top1_agreement")
            if agree:
                draft["alpha0"] = float(agree[0])
            if self.measure:
                draft["verify_cost"] = target_verify_costs(model, target, self._cost_sizes())[0]
        elif drafter["kind"] == "eagle":  # one layer + fc + the draft-vocabulary head, in weight bytes
            dmodel = model.meta[_keys.EAGLE_MODEL][0]
            draft["draft_cost"] = round(weight_reads(dmodel) / max(1, weight_reads(model)), 4)
            draft["draft_cost_source"] = "weight bytes"
            agree = ((drafter["head"].get("eval") or {}).get("draft_top1_agreement"))
            if agree is not None:
                draft["alpha0"] = float(agree)
            if self.measure:
                draft["verify_cost"] = target_verify_costs(model, target, self._cost_sizes())[0]
        elif self.measure:
            draft.update(self._measured_costs(model, target))
        else:
            draft["draft_cost"] = 0.0
            if isinstance(self.drafter, ir.Model):
                draft["draft_cost"] = round(weight_reads(self.drafter) / max(1, weight_reads(model)), 4)
                draft["draft_cost_source"] = "weight bytes"
        return {
            "format": SPECULATIVE_FORMAT,
            "target": target,
            "drafter": drafter,
            "draft": {k: v for k, v in draft.items() if v is not None},
            "generation": self.generation,
        }

    def _rows_twin(self, model: ir.Model, target: dict[str, Any], dspec: dict[str, Any]) -> dict[str, Any] | None:
        """An int8 twin of an int4 external drafter for its calls of many rows, if it is faster here (else ``None``).

        :mod:`.drafter_rows`: built from the drafter, timed against it at :data:`~.drafter_rows.ROW_SIZES` on this
        machine (``dspec``: the drafter's decoder spec); kept (in ``model.meta``, with the drafter's fingerprint, so a
        second run neither rebuilds nor re-times it) from the fewest rows at which it is faster at every larger size
        timed. Says why at INFO when there is none.
        """
        from dyncompile.passes.speculative import drafter_rows as dr

        if not self.drafter_rows or not isinstance(self.drafter, ir.Model):
            return None
        if not self.measure:
            logger.info("speculative: no int8 twin for the drafter's calls of many rows: measure=false times nothing, "
                        "and the twin is kept only where it is faster on this machine")
            return None
        key = _fingerprint(self.drafter)
        last = model.meta.get(_keys.DRAFTER_ROWS_MODEL)
        if last is not None and last[0] == key:
            return last[2]
        record = None
        twin = dr.int8_rows_twin(self.drafter)
        if twin is None:
            logger.info("speculative: no int8 twin for the drafter's calls of many rows: it has no int4 "
                        "MatMulNBits weights (an int8 or float drafter already runs them with its own kernels)")
        else:
            sizes = dr.ROW_SIZES
            d_times, t_times = (fastest_times(measure_step_rounds(session_for(m), dspec, probe_chunk(target), sizes,
                                                                  repeats=3)) for m in (self.drafter, twin))
            start = dr.rows_from(d_times, t_times)
            said = dr.describe(d_times, t_times)
            if start is None:
                logger.info("speculative: the drafter's int8 twin is not faster for calls of many rows on this machine "
                            "(rows: int4 / int8 twin %s); the drafter runs every call", said)
                twin = None
            else:
                logger.info("speculative: the drafter's calls of >= %d rows (its prompt) run on an int8 twin, faster on "
                            "this machine (rows: int4 / int8 twin %s)", start, said)
                record = {"rows_from": start, **dr.twin_summary(twin),
                          "ms_by_rows": {str(s): [round(d_times[s] * 1e3, 2), round(t_times[s] * 1e3, 2)] for s in sizes}}
        model.meta[_keys.DRAFTER_ROWS_MODEL] = (key, twin, record)
        return record

    def _cost_sizes(self) -> list[int]:
        """Call sizes of the verification cost curve.

        Up to the largest tree (root included) or the longest chain (+ its bonus token), so the draft policy never
        extrapolates past what it can draft.
        """
        return _verify_sizes(self.tree["max_nodes"] + 1 if self.tree else max(9, self.draft["max"] + 1))

    def _measured_costs(self, model: ir.Model, target: dict[str, Any]) -> dict[str, Any]:
        """The draft policy's timed entries.

        The target's verification costs and an external drafter's step cost (0 for prompt lookup), kept from the
        last run while the graphs are the ones timed then.
        """
        external = isinstance(self.drafter, ir.Model)
        sizes = self._cost_sizes()
        timed_on = (_fingerprint(model), _fingerprint(self.drafter) if external else str(self.drafter), tuple(sizes))
        last = model.meta.get(_keys.SPECULATIVE_MEASURED)
        if last is not None and last[0] == timed_on:
            logger.info("speculative: the graphs are the ones timed by the last run; keeping its costs")
            return dict(last[1])
        costs: dict[str, Any] = {"draft_cost": 0.0}
        costs["verify_cost"], t1 = target_verify_costs(model, target, sizes)
        if external:
            costs["draft_cost"] = round(drafter_step_seconds(self.drafter, target) / t1, 4)
            costs["draft_cost_source"] = "measured (drafter step / target step, this machine)"
        model.meta[_keys.SPECULATIVE_MEASURED] = (timed_on, dict(costs))
        return costs

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if self.tree and isinstance(self.drafter, ir.Model):
            # an external drafter expands its tree one depth per call: it gets the 4-D attention bias input too
            ExposeAttentionMaskPass()(self.drafter)
        elif self.tree and self.drafter is None and _keys.EAGLE_MODEL in model.meta:
            # so does an EAGLE drafter (EAGLE-2 dynamic trees, runtime/decode/eagle.py); its chain steps then get a causal
            # bias from the runtime instead of the in-graph mask (same numbers)
            ExposeAttentionMaskPass()(model.meta[_keys.EAGLE_MODEL][0])
        # a sparse target's verification calls keep the kernel's rows (bit-identical to its one-row calls), before
        # the probes time them
        rows_changed = keep_verification_rows(model)
        record = self._record(model)
        text = json.dumps(record, sort_keys=True)
        props = model.metadata_props
        modified = rows_changed or props.get(_keys.SPECULATIVE) != text or props.get(_keys.EMITTER) != "speculative"
        props[_keys.SPECULATIVE] = text
        props[_keys.EMITTER] = "speculative"
        props[_keys.TASK] = "text-generation"
        model.meta.pop(_keys.DRAFTER_VOCAB, None)
        if not (isinstance(self.drafter, ir.Model) and self.drafter_rows and self.measure):
            model.meta.pop(_keys.DRAFTER_ROWS_MODEL, None)  # (kept otherwise, with or without a twin: the timing's memo)
        if isinstance(self.drafter, ir.Model):
            model.meta[_keys.DRAFTER_MODEL] = self.drafter
            if self.drafter_vocab is not None:
                model.meta[_keys.DRAFTER_VOCAB] = self.drafter_vocab
        elif self.drafter is None and _keys.MEDUSA in model.metadata_props:
            model.meta[_keys.DRAFTER_MODEL] = model.meta[_keys.MEDUSA_MODEL]
        elif self.drafter is None and _keys.EAGLE in model.metadata_props:
            model.meta[_keys.DRAFTER_MODEL] = model.meta[_keys.EAGLE_MODEL][0]
        elif self.drafter is None:
            model.meta[_keys.DRAFTER_MODEL] = self._split(model)[0]
        else:
            model.meta.pop(_keys.DRAFTER_MODEL, None)
        logger.info("speculative: drafter %s, draft policy %s", record["drafter"].get("name", record["drafter"]["kind"]),
                    record["draft"])
        return ir.passes.PassResult(model, modified=modified)

    def ensures(self, model: ir.Model) -> None:
        """Check what the pass promises on its output."""
        rec = json.loads(model.metadata_props[_keys.SPECULATIVE])
        if rec["drafter"]["kind"] in ("model", "eagle", "medusa") and _keys.DRAFTER_MODEL not in model.meta:
            raise ir.passes.PostconditionError("the drafter graph did not reach model.meta")
        if prefill_only_rows(model):
            raise ir.passes.PostconditionError("a SparseRowsMatMul would run a verification call through ORT's MatMul")


def call_shape_dependent_ops(model: ir.Model) -> str | None:
    """Describe the ops whose numerics depend on the number of rows in a call (None if there are none).

    Those are MatMulNBits with int8 compute (``accuracy_level`` 4) and dynamic int8 quantization of activations.
    MatMulNBits quantizes each row on its own (per block of K), so its rows would not depend on the call, but
    the int8 rounding amplifies the last-bit differences of ORT's one-row kernels elsewhere (such as MLAS SGEMM's
    ``M == 1`` path): on Qwen2.5-Coder-0.5B int4, block 32, int8 compute, rows are bitwise equal in every call of
    two rows or more and differ by up to 0.5 in a one-row call (``bench-results/quantized-certified/``).
    """
    found = _row_dependent_ops(model)
    if not found:
        return None
    return ", ".join(f"{n} {op} nodes" for op, n in found.items())


INT8_COMPUTE_NBITS = "MatMulNBits(accuracy_level=4)"
#: the ``min_rows`` the speculative pass tries for an int8-compute int4 target, fewest first
MIN_ROWS_CANDIDATES = (1, 2)


def _row_dependent_ops(model: ir.Model) -> dict[str, int]:
    """Counts of the ops :func:`call_shape_dependent_ops` describes, by op (and compute type)."""
    found: dict[str, int] = {}
    for node in model.graph.all_nodes():
        if node.metadata_props.get(_keys.LOGITS_EXACT) == "screen":
            continue  # screen-lm-head's int8 screen: its rounding never reaches an argmax (exact float32 candidates)
        if node.op_type == "MatMulNBits":
            attr = node.attributes.get("accuracy_level")
            if attr is not None and attr.as_int() == 4:
                found[INT8_COMPUTE_NBITS] = found.get(INT8_COMPUTE_NBITS, 0) + 1
        elif node.op_type in ("DynamicQuantizeLinear", "DynamicQuantizeMatMul"):
            found[node.op_type] = found.get(node.op_type, 0) + 1
    return found


def _paddable(model: ir.Model) -> bool:
    """Whether padding calls to a minimum of rows may make the target row-invariant.

    Only int8-compute ``MatMulNBits`` (each row quantized on its own) can be; one int8 scale per call
    (``DynamicQuantizeLinear``) depends on every row of the call.
    """
    return set(_row_dependent_ops(model)) == {INT8_COMPUTE_NBITS}


_SCALAR_ATTRS = (ir.AttributeType.INT, ir.AttributeType.FLOAT, ir.AttributeType.STRING, ir.AttributeType.INTS,
                 ir.AttributeType.FLOATS, ir.AttributeType.STRINGS)


def _fingerprint(model: ir.Model) -> str:
    """A digest of a graph's nodes and initializers (names, types, shapes): what its timings depend on."""
    h = hashlib.sha256()
    for node in model.graph.all_nodes():
        attrs = {k: a.value for k, a in node.attributes.items() if a.type in _SCALAR_ATTRS}
        h.update(f"{node.domain}:{node.op_type}:{[v.name if v is not None else '' for v in node.inputs]}:{attrs};".encode())
    for name, v in sorted(model.graph.initializers.items()):
        h.update(f"{name}:{v.dtype}:{v.shape};".encode())
    return h.hexdigest()


def _load_drafter(path_text: str, target_path: Path | None) -> ir.Model:
    path = Path(path_text).expanduser()
    if target_path is not None and path.resolve() == Path(target_path).resolve():
        raise DrafterError(
            f"the drafter {path} is the target itself: a drafter must be a smaller, cheaper model (or use "
            "--drafter prompt-lookup, or --passes split-drafter,speculative)"
        )
    if path.is_dir():
        cands = sorted(path.glob("*.onnx"))
        if len(cands) == 1:
            path = cands[0]
    try:
        return load_input_model(path)
    except PassConfigError:
        raise
    except Exception as e:  # ModelLoadError is a DyncompileError: say it is the drafter
        if isinstance(e, DyncompileError):
            raise type(e)(f"drafter: {e}") from None
        raise


@register_pass(
    "speculative",
    help="speculative decoding plan: --drafter DRAFT.onnx | prompt-lookup (or after split-drafter); greedy output "
    "token-identical to the target, sampling exact; options draft_length=4, max_draft (16 for prompt-lookup and "
    "hybrids, 8 for model drafters), adaptive=true, tree=false, tree_nodes=16; --drafter lookahead: window=5, ngram=4, guesses=5 "
    "(a fixed tree, after explicit-attention); hybrid=true: prompt lookup's matches in the same tree as the drafter's "
    "(lookup_min_match=max_ngram, 1 with lookahead: only matches of that many tokens; the drafter's candidates "
    "elsewhere); "
    "stop_below=P: a model, EAGLE or Medusa drafter ends a chain after a token it gives probability < P (0: off); "
    "draft_vocab=N (with --drafter DRAFT.onnx and --calib TEXT): the drafter's LM head keeps the N most frequent "
    "tokens of the calibration text (a cheaper draft step; decoding stays exact); drafter_rows=true: an int4 "
    "drafter's calls of many rows (its prompt) run on an int8 twin where that is faster on the compiling machine",
    after=("split-drafter", "eagle-drafter", "medusa-heads"),
)
def _make_speculative(context: CompileContext, draft_length: int = 4, min_draft: int = 0, max_draft: int | None = None,
                      adaptive: bool = True, max_ngram: int = 3, min_ngram: int = 1, measure: bool = True,
                      allow_inexact_target: bool = False, tree: bool = False, tree_nodes: int = 16,
                      tree_depth: int | None = None, branching: int = 3, tree_adaptive: bool = True, window: int = 5,
                      ngram: int = 4, guesses: int = 5, hybrid: bool = False, lookup_min_match: int | None = None,
                      stop_below: float = 0.0, draft_vocab: int = 0, drafter_rows: bool = True):
    opt = context.options.get("drafter")
    target_dir = context.model_path.parent if context.model_path else None
    gen = generation_config(context.model_config, target_dir)
    drafter: str | ir.Model | None = None
    check = None
    source = None
    if opt in (None, ""):
        drafter = None  # split-drafter's, checked when the pass runs
    elif str(opt) in MODEL_FREE:
        drafter = str(opt)
    else:
        source = str(opt)
        dpath = Path(source).expanduser()
        if not dpath.exists():
            raise DrafterError(
                f"drafter not found: {dpath} (give an ONNX decoder with the target's tokenizer, or "
                f"--drafter {PROMPT_LOOKUP})"
            )
        drafter_dir = dpath if dpath.is_dir() else dpath.parent
        if target_dir is not None:
            check = check_same_tokenizer(target_dir, drafter_dir, target_config=context.model_config or None)
        drafter = _load_drafter(source, context.model_path)
        dspec = decoder_spec(drafter, "drafter", what="drafter", where=source)  # fail before loading the target
    subset = None
    if draft_vocab:
        if not isinstance(drafter, ir.Model):
            raise DrafterError(f"speculative{{draft_vocab={draft_vocab}}} trims a drafter model's LM head: give "
                               "--drafter DRAFT.onnx (an EAGLE head brings its own draft vocabulary)")
        if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 1:
            raise DrafterError(f"draft_vocab must be a number of tokens >= 1, got {draft_vocab!r}")
        vocab_size = dspec["vocab_size"]
        if vocab_size is None:
            raise DrafterError("draft_vocab: the drafter's logits have no static vocabulary size to trim")
        if draft_vocab < vocab_size:
            subset = calibration_vocab(context, int(draft_vocab), int(vocab_size))
            trim_drafter_vocab(drafter, subset)
        else:
            logger.warning("speculative: draft_vocab=%d is not below the drafter's vocabulary (%d tokens); its LM head "
                           "stays whole", draft_vocab, vocab_size)
    # a tree is no deeper than a model drafter's longest chain (prompt lookup's 16-token chains would make it a chain)
    chain_max = DEFAULT_MAX_DRAFT["model"] if max_draft is None else max_draft
    tree_policy = {"max_nodes": tree_nodes, "max_depth": tree_depth or max(chain_max, draft_length), "branching": branching,
                   "adaptive": tree_adaptive} if tree else None
    # --drafter lookahead without tree=true: the window's own fixed tree (SpeculativePass); with it, the tree options
    return SpeculativePass(
        drafter,
        drafter_source=source,
        generation=gen,
        draft_length=draft_length,
        min_draft=min_draft,
        max_draft=max_draft,
        adaptive=adaptive,
        max_ngram=max_ngram,
        min_ngram=min_ngram,
        tokenizer_check=check,
        measure=measure,
        allow_inexact_target=allow_inexact_target,
        tree=tree_policy,
        window=window,
        ngram=ngram,
        guesses=guesses,
        hybrid=hybrid,
        lookup_min_match=lookup_min_match,
        stop_below=stop_below,
        drafter_vocab=subset,
        drafter_rows=drafter_rows,
    )
