"""Schemas of decoder plans: ``generate``, ``speculative_generate`` and ``policy.speculative``.

A decoder step names its KV-cache decoder graph (:class:`DecoderSpec`), the stop tokens and chat template
(:class:`GenerationConfig`) and, for speculative decoding, the drafter (:class:`DrafterParams`) and the
draft-length and draft-tree policies (:class:`DraftPolicy`, :class:`TreePolicy`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from dyncompile.errors import PlanError
from dyncompile.plan._typed import _field, from_json

__all__ = [
    "MAX_DIM",
    "MAX_DRAFT_NODES",
    "MAX_POSITIONS",
    "POLICIES",
    "CustomOpsPolicy",
    "STEPS",
    "DecoderSpec",
    "DraftPolicy",
    "DrafterParams",
    "GenerateParams",
    "GenerationConfig",
    "KVEntry",
    "SparsityCheck",
    "SparsityPolicy",
    "SparsityQuality",
    "SpeculativeParams",
    "SpeculativePolicy",
    "TreePolicy",
    "lookahead_tree_nodes",
]

MAX_DIM = 1 << 16  # a KV head dimension
MAX_POSITIONS = 1 << 24  # max_length of a decoder


@dataclasses.dataclass
class KVEntry:
    """One (past, present) KV pair of a decoder; ``shape``: the fixed dims after batch, seq axis left out."""

    past: str
    present: str
    axis: int = _field(2, lo=1, hi=3)
    shape: tuple[int, ...] = _field((), lo=1, hi=MAX_DIM)

    def _check(self, where: str) -> None:
        if math.prod(self.shape) > MAX_DIM * 64:
            raise PlanError(f"{where}.shape {list(self.shape)} is too large for a KV head")


@dataclasses.dataclass
class DecoderSpec:
    """How to drive one KV-cache decoder graph (see :mod:`dyncompile.runtime.decode.generate` for the JSON form).

    ``min_rows`` (default 1: every call as it comes): the fewest token rows any call of this decoder computes. A
    call of fewer new tokens (a one-token decode step, a verification of the root alone) is padded to
    ``min_rows`` rows by repeating its last token at the next positions; only the real rows' outputs come back
    and the padded rows' cache slots are cut, so they leave no trace. For targets whose logits depend on the
    number of rows in a call only below some count: an int4 target with int8 compute
    (``quantize-int4{block_size=32,accuracy_level=4}``) is bitwise row-invariant in calls of two rows or more
    on AVX-512 CPUs but not in one-row calls, so ``min_rows=2`` makes the target alone and its speculative
    verification calls run the same kernels (token-identical greedy output). The ``speculative`` pass measures
    this on the compile machine and sets it; only a target's spec may have it (a drafter's stays 1).
    """

    model: str
    input_ids: str = "input_ids"
    attention_mask: str | None = "attention_mask"
    position_ids: str | None = "position_ids"
    logits: str = "logits"
    kv: list[KVEntry] = dataclasses.field(default_factory=list)
    kv_dtype: Literal["float32", "float16", "float", "FLOAT", "FLOAT16", "bfloat16"] = "float32"
    #: a 4-D additive float mask input ``[batch, 1, new, past + new]`` (``explicit-attention``): draft trees
    attention_bias: str | None = None
    #: how the runtime holds the KV cache: ``concat`` (the graph returns ``past + new`` as a new tensor each
    #: call) or ``shared`` (every past input feeds only ``GroupQueryAttention``, which writes the new tokens into
    #: the past buffer in place: one preallocated buffer per tensor is bound as both past and present)
    kv_buffer: Literal["concat", "shared"] = "concat"
    #: an int64 ``[1]`` input (``trim-logits``; 0 = every row) limiting the logits to the last ``k`` new tokens:
    #: prompts need the last row only
    logits_to_keep: str | None = None
    #: the fewest rows per call: fewer new tokens are padded with copies of the last one (see the class docstring)
    min_rows: int = _field(1, lo=1, hi=64)
    #: ``masked`` (the mask inputs say which cache slots each row sees: holes and trees allowed) or ``causal``
    #: (``causal-attention``: ``attention_mask`` only says how many slots are valid; the runtime keeps the cache
    #: gap-free and verifies chains)
    attention: Literal["masked", "causal"] = "masked"
    #: ``all`` (every logit is the model's) or ``argmax`` (``screen-lm-head``: each row's argmax is the model's, the
    #: other logits are bounded approximations): such a decoder decodes greedily only
    logits_exact: Literal["all", "argmax"] = "all"

    def _check(self, where: str) -> None:
        if not self.kv:
            raise PlanError(f"{where}.kv must list the decoder's (past, present) pairs; got none")

    @classmethod
    def from_params(cls, d: Any, what: str = "decoder") -> DecoderSpec:
        """Validated spec from a plan step's JSON (absent mask / position names mean the graph has none)."""
        if isinstance(d, dict):
            d = {"attention_mask": None, "position_ids": None, **d}
        return from_json(cls, d, f"plan step: {what}")

    def to_params(self) -> dict[str, Any]:
        """The step JSON of this spec (what :meth:`from_params` reads back)."""
        return {
            "model": self.model,
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
            "logits": self.logits,
            "kv": [{"past": e.past, "present": e.present, "axis": e.axis, "shape": list(e.shape)} for e in self.kv],
            "kv_dtype": self.kv_dtype,
            **({"attention_bias": self.attention_bias} if self.attention_bias else {}),
            **({"kv_buffer": self.kv_buffer} if self.kv_buffer != "concat" else {}),
            **({"logits_to_keep": self.logits_to_keep} if self.logits_to_keep else {}),
            **({"min_rows": self.min_rows} if self.min_rows != 1 else {}),
            **({"attention": self.attention} if self.attention != "masked" else {}),
            **({"logits_exact": self.logits_exact} if self.logits_exact != "all" else {}),
        }


@dataclasses.dataclass
class GenerationConfig:
    """Stop tokens, BOS, the number of positions the decoder supports and its chat template."""

    eos_token_ids: tuple[int, ...] = _field((), lo=0, hi=2**31 - 1)
    bos_token_id: int | None = _field(None, lo=0, hi=2**31 - 1)
    max_length: int | None = _field(None, lo=2, hi=MAX_POSITIONS)
    chat_template: str | None = None

    @classmethod
    def from_params(cls, d: Any) -> GenerationConfig:
        """Validated config from a plan step's JSON (a single eos id, null and absent are accepted)."""
        d = d or {}
        if isinstance(d, dict) and isinstance(d.get("eos_token_ids"), int) and not isinstance(d["eos_token_ids"], bool):
            d = {**d, "eos_token_ids": [d["eos_token_ids"]]}
        if isinstance(d, dict) and d.get("eos_token_ids") is None and "eos_token_ids" in d:
            d = {k: v for k, v in d.items() if k != "eos_token_ids"}
        return from_json(cls, d, "plan step: generation")


def lookahead_tree_nodes(window: int, ngram: int, guesses: int) -> int:
    """Drafted nodes of a full lookahead tree: the window's cells plus ``guesses`` pool n-grams."""
    return (window + guesses) * (ngram - 1)


@dataclasses.dataclass(frozen=True)
class DrafterParams:
    """The drafter of a ``speculative_generate`` step.

    A model (``decoder``), prompt lookup, an EAGLE head (``decoder`` fed the target's ``features`` output;
    see :mod:`dyncompile.runtime.decode.eagle`) or lookahead decoding (a Jacobi window of ``window`` columns and
    ``ngram - 1`` levels plus an n-gram pool of ``guesses`` candidates per first token; no model, see
    :mod:`dyncompile.runtime.decode.lookahead`) or Medusa heads (``heads_model``: a graph reading the target's
    ``features`` output and giving each of ``heads`` heads' ``topk`` best tokens; see
    :mod:`dyncompile.runtime.decode.medusa`). ``prompt_lookup`` (model, eagle, lookahead, medusa): a *hybrid* drafter
    whose tree holds prompt-lookup candidates (``max_ngram`` / ``min_ngram``) where the context has n-gram matches
    and this drafter's candidates in the rest of the tree budget.
    """

    kind: Literal["model", "prompt-lookup", "eagle", "lookahead", "medusa"]
    name: str = "external"
    decoder: DecoderSpec | None = None
    share_kv: list[int] | None = _field(None, lo=0, hi=100_000)
    vocab: str | None = None
    max_ngram: int = _field(3, lo=1, hi=64)
    min_ngram: int = _field(1, lo=1, hi=64)
    #: eagle: the target's features output, the drafter's features input and predicted-feature output
    features: str | None = None
    feature_input: str | None = None
    hidden_output: str | None = None
    #: lookahead: Jacobi window columns, n-gram size (levels + 1), pool candidates verified per round
    window: int = _field(5, lo=1, hi=64)
    ngram: int = _field(4, lo=2, hi=16)
    guesses: int = _field(5, lo=0, hi=64)
    #: hybrid: prompt-lookup candidates where the context has n-gram matches of ``lookup_min_match`` tokens or more,
    #: this drafter's elsewhere
    prompt_lookup: bool = False
    lookup_min_match: int = _field(1, lo=1, hi=64)
    #: medusa: the heads graph (plan file key), its number of heads and the candidates per head in its output
    heads_model: str | None = None
    heads: int = _field(3, lo=1, hi=16)
    topk: int = _field(4, lo=1, hi=64)
    #: model: a twin of the drafter's graph (plan file key; same inputs, outputs and cache, other weight kernels) that
    #: runs the drafter's calls of ``rows_from`` new tokens or more (the prompt; :mod:`~dyncompile.passes.speculative.drafter_rows`)
    rows_model: str | None = None
    rows_from: int = _field(0, lo=0, hi=1_000_000)

    def _check(self, where: str) -> None:  # noqa: C901 - one rule per drafter kind
        if self.prompt_lookup and self.kind == "prompt-lookup":
            raise PlanError(f"{where}.prompt_lookup: a hybrid needs a second drafter (kind model, eagle, lookahead or medusa), "
                            "not prompt-lookup itself")
        if self.min_ngram > self.max_ngram:
            raise PlanError(f"{where}: min_ngram {self.min_ngram} > max_ngram {self.max_ngram}")
        if self.lookup_min_match > self.max_ngram:
            raise PlanError(f"{where}.lookup_min_match: {self.lookup_min_match}, but prompt lookup matches at most "
                            f"max_ngram = {self.max_ngram} tokens; give at most that")
        if self.decoder is not None and self.decoder.min_rows != 1:
            raise PlanError(f"{where}.decoder.min_rows: {self.decoder.min_rows}, but padding calls to a minimum of rows is "
                            "for the target only (a drafter's calls need not match the target's kernels); give 1")
        if (self.rows_model is None) != (self.rows_from == 0) or self.rows_from == 1:
            raise PlanError(f"{where}: rows_model and rows_from go together (a twin for calls of rows_from >= 2 rows; "
                            f"none: null and 0), got {self.rows_model!r} and {self.rows_from}")
        if self.rows_model is not None and self.kind != "model":
            raise PlanError(f"{where}.rows_model: only a model drafter has a twin for its calls of many rows")
        if self.kind == "lookahead":
            if self.decoder is not None:
                raise PlanError(f"{where}.decoder: a lookahead drafter has no model (it reads the target's logits)")
        elif self.kind == "medusa":
            if self.decoder is not None:
                raise PlanError(f"{where}.decoder: a medusa drafter has no KV-cache decoder (its heads graph is "
                                "'heads_model')")
            missing = [k for k in ("heads_model", "features") if not getattr(self, k)]
            if missing:
                raise PlanError(f"{where}: a medusa drafter needs {', '.join(missing)} (a plan file key and the "
                                "target's features output)")
            if self.share_kv is not None or self.vocab is not None:
                raise PlanError(f"{where}: a medusa drafter has no share_kv or vocab (its graph maps its own ids)")
        elif self.kind == "eagle":
            if self.decoder is None:
                raise PlanError(f"{where}: an eagle drafter needs its 'decoder' spec")
            missing = [k for k in ("features", "feature_input", "hidden_output") if not getattr(self, k)]
            if missing:
                raise PlanError(f"{where}: an eagle drafter needs {', '.join(missing)} (tensor names)")
            if self.share_kv is not None:
                raise PlanError(f"{where}.share_kv: an eagle drafter keeps its own one-layer cache (give null)")
        elif self.kind == "model":
            if self.decoder is None:
                raise PlanError(f"{where}: a model drafter needs its 'decoder' spec")
            if self.share_kv is not None and len(self.share_kv) != len(self.decoder.kv):
                raise PlanError(f"{where}.share_kv must list one target kv index per drafter kv entry")


#: the most drafted tokens one round verifies (a tree's nodes, a chain's length): a verification call has at most
#: MAX_DRAFT_NODES + 1 rows (the root); sparsify-activations keeps calls of up to that many rows bit-identical
MAX_DRAFT_NODES = 256


@dataclasses.dataclass(frozen=True)
class TreePolicy:
    """Draft trees of a ``speculative_generate`` step: several candidates verified in one target call.

    ``max_nodes``: drafted nodes per tree (the root excluded); ``max_depth``: longest root-to-leaf path;
    ``branching``: candidates per node a drafter may offer (prompt-lookup matches, a model's top-k);
    ``adaptive``: size the tree from the measured verification cost curve and what branches bought.
    """

    max_nodes: int = _field(16, lo=1, hi=MAX_DRAFT_NODES)
    max_depth: int = _field(8, lo=1, hi=MAX_DRAFT_NODES)
    branching: int = _field(3, lo=1, hi=64)
    adaptive: bool = True


@dataclasses.dataclass(frozen=True)
class DraftPolicy:
    """Draft lengths and the cost model of a ``speculative_generate`` step.

    ``stop_below``: a model, EAGLE or Medusa drafter's chain ends after a token whose probability under the drafter is below
    this (the chain is then shorter than the round's length; 0: never), as transformers' assisted generation does
    with ``assistant_confidence_threshold``.
    """

    initial: int = _field(4, lo=0, hi=MAX_DRAFT_NODES)
    min: int = _field(1, lo=0, hi=MAX_DRAFT_NODES)
    max: int = _field(8, lo=0, hi=MAX_DRAFT_NODES)
    adaptive: bool = True
    alpha0: float = _field(0.6, lo=0.0, hi=1.0)
    verify_slope: float = _field(0.1, lo=0.0, hi=1e6)
    draft_cost: float | None = _field(None, lo=0.0, hi=1e6)
    draft_cost_source: str | None = None
    verify_cost: dict[str, float] | None = _field(None, lo=0.0, hi=1e6)
    timing: bool = False
    tree: TreePolicy | None = None
    #: a model, EAGLE or Medusa drafter ends its chain after a token it gives less than this probability (0: never)
    stop_below: float = _field(0.0, lo=0.0, hi=1.0)

    def _check(self, where: str) -> None:
        if self.min > self.max:
            raise PlanError(f"{where}: min {self.min} > max {self.max}")
        for k in self.verify_cost or {}:
            if not k.isdigit() or not 1 <= int(k) <= 4096:
                raise PlanError(f"{where}.verify_cost: key {k!r} must be a token count 1..4096")


@dataclasses.dataclass(frozen=True)
class GenerateParams:
    """``generate``: the target decoder alone."""

    target: DecoderSpec
    generation: GenerationConfig = _field(factory=GenerationConfig)
    io_binding: bool = False
    rollback: Literal["mask", "copy"] = "mask"

    def file_keys(self) -> list[tuple[str, str]]:
        """The plan files this step names, as ``(field, file key)`` pairs."""
        return [("target.model", self.target.model)]


@dataclasses.dataclass(frozen=True)
class SpeculativeParams(GenerateParams):
    """``speculative_generate``: a drafter proposes, the target verifies."""

    drafter: DrafterParams = _field(factory=lambda: DrafterParams("prompt-lookup"))
    draft: DraftPolicy = _field(factory=DraftPolicy)

    def file_keys(self) -> list[tuple[str, str]]:
        """The plan files this step names (the target's, then the drafter's), as ``(field, file key)`` pairs."""
        keys = super().file_keys()
        if self.drafter.decoder is not None:
            keys.append(("drafter.decoder.model", self.drafter.decoder.model))
        if self.drafter.vocab is not None:
            keys.append(("drafter.vocab", self.drafter.vocab))
        if self.drafter.heads_model is not None:
            keys.append(("drafter.heads_model", self.drafter.heads_model))
        if self.drafter.rows_model is not None:
            keys.append(("drafter.rows_model", self.drafter.rows_model))
        return keys


def _generate_from_json(cls: type) -> Any:
    """The step builder of a decoder step: fills absent mask / position names and accepts a single eos id."""

    def build(d: Any, where: str) -> Any:
        if isinstance(d, dict):
            d = dict(d)
            if isinstance(d.get("target"), dict):
                d["target"] = {"attention_mask": None, "position_ids": None, **d["target"]}
            dr = d.get("drafter")
            if isinstance(dr, dict) and isinstance(dr.get("decoder"), dict):
                d["drafter"] = {**dr, "decoder": {"attention_mask": None, "position_ids": None, **dr["decoder"]}}
            gen = d.get("generation")
            if isinstance(gen, dict) and isinstance(gen.get("eos_token_ids"), int) and not isinstance(
                gen["eos_token_ids"], bool
            ):
                d["generation"] = {**gen, "eos_token_ids": [gen["eos_token_ids"]]}
            if gen is None and "generation" in d:
                del d["generation"]
        return from_json(cls, d, where)

    return build


@dataclasses.dataclass(frozen=True)
class SpeculativePolicy:
    """``policy.speculative``: which drafter and its draft policy (informational)."""

    _extra = True

    drafter: str = ""
    draft: DraftPolicy = _field(factory=DraftPolicy)


@dataclasses.dataclass(frozen=True)
class CustomOpsPolicy:
    """``policy.custom_ops``: dyncompile's own ONNX Runtime custom operators that the plan's graphs use.

    Any plan kind (a decoder's ``sparsify-activations``, a classifier's ``fuse-int8-epilogues``); it is defined here
    with the decoder policies it first served and merged into the one policy schema with them.

    Never a file of the plan: the runtime builds the library from the installed package's own C source into the
    user's cache (``dyncompile.runtime.kernels``) and registers that, so a plan cannot bring native code. The
    plan names the source it was compiled against; another source is refused (recompile the plan).
    """

    ops: list[str]
    source_sha256: str


def _check_interval(iv: list[float] | None, where: str) -> None:
    if iv is not None and (len(iv) != 2 or iv[0] > iv[1]):
        raise PlanError(f"{where}.interval must be [lo, hi] with lo <= hi, got {iv}")


@dataclasses.dataclass(frozen=True)
class SparsityQuality:
    """``policy.sparsity.quality``: held-out perplexity of the sparse model against the dense one.

    ``part``: ``all`` (every held-out window: a fixed ``sparsity``) or ``check`` (the check half of a budget search,
    never used to choose the level). ``interval``: the two-sided interval of ``increase_pct`` at the policy's
    ``confidence`` (null with fewer than two files; absent in plans compiled before intervals were recorded).
    """

    heldout_windows: int = _field(lo=0)
    heldout_tokens: int = _field(lo=0)
    perplexity_dense: float = _field(lo=0.0)
    perplexity: float = _field(lo=0.0)
    increase_pct: float = _field()
    interval: list[float] | None = None
    part: Literal["all", "check"] = "all"

    def _check(self, where: str) -> None:
        _check_interval(self.interval, where)


@dataclasses.dataclass(frozen=True)
class SparsityCheck:
    """``policy.sparsity.check``: a budget's check on the held-out half the search never saw.

    ``increase_pct`` with its two-sided ``interval`` at the policy's ``confidence``; ``holds``: the increase is
    within the budget there.
    """

    windows: int = _field(lo=1)
    tokens: int = _field(lo=1)
    increase_pct: float = _field()
    interval: list[float] | None
    holds: bool
    files: int | None = _field(None, lo=1)

    def _check(self, where: str) -> None:
        _check_interval(self.interval, where)


@dataclasses.dataclass(frozen=True)
class SparsityPolicy:
    """``policy.sparsity`` / ``policy.drafter_sparsity``: what ``sparsify-activations`` chose and measured.

    For a sparse target (``sparsity``) or a sparse model drafter (``drafter_sparsity``); informational (the
    thresholds are in the graph).
    ``mode``: ``sparsity`` (a fixed share) or ``budget`` (the largest share within ``budget_pct`` percent held-out
    perplexity increase at ``confidence``, checked on held-out text the search never saw: ``check``).
    """

    op: str
    sparsity: float = _field(lo=0.0, hi=1.0)
    sites: Literal["mlp", "all"] = "mlp"
    allocation: Literal["uniform", "greedy"] = "uniform"
    mode: Literal["sparsity", "budget"] = "sparsity"
    budget_pct: float | None = _field(None, lo=0.0)
    confidence: float | None = _field(None, lo=0.5, hi=1.0)
    achieved_sparsity_heldout: dict[str, float] | None = _field(None, lo=0.0, hi=1.0)
    quality: SparsityQuality | None = None
    check: SparsityCheck | None = None

    def _check(self, where: str) -> None:
        if self.sparsity >= 1.0:
            raise PlanError(f"{where}.sparsity must be < 1, got {self.sparsity}")
        if self.confidence is not None and self.confidence >= 1.0:
            raise PlanError(f"{where}.confidence must be < 1, got {self.confidence}")
        if self.mode == "budget" and (self.budget_pct is None or self.budget_pct <= 0):
            raise PlanError(f"{where}: mode 'budget' needs a positive budget_pct, got {self.budget_pct}")
        if self.check is not None and self.mode != "budget":
            raise PlanError(f"{where}.check is the check of a budget search, but mode is {self.mode!r}")


STEPS: dict[str, Any] = {
    "generate": _generate_from_json(GenerateParams),
    "speculative_generate": _generate_from_json(SpeculativeParams),
}
"""This module's step kinds -> ``build(params_json, where)`` (merged into :data:`dyncompile.plan.STEP_SCHEMAS`)."""

POLICIES: dict[str, type] = {"speculative": SpeculativePolicy, "custom_ops": CustomOpsPolicy,
                             "sparsity": SparsityPolicy, "drafter_sparsity": SparsityPolicy}
"""This module's policy names -> schema (merged into :data:`dyncompile.plan.POLICY_SCHEMAS`)."""
