"""Optimization levels: the EP-aware lowering passes a compile inserts around the passes the user named.

A user who asks for a technique (``--passes speculative --drafter prompt-lookup``) should get the fastest exact
graph for the execution provider the plan is for without knowing the lowering passes. :data:`PRESETS` says, as
data, which lowering passes pay on which provider for which kind of model; :func:`resolve` merges them into the
user's pipeline for an optimization level:

* ``-O0``: exactly the passes named, nothing added;
* ``-O1``: plus the provider's *bit-exact* lowerings (the same arithmetic on the same rows: ``explicit-attention``
  fed the bias the graph computed, ``trim-logits`` fed ``0``);
* ``-O2`` (the default): plus the lowerings exact within float round-off (fused attention, packed and 1x1-Conv
  matmuls: another summation order), which keep greedy decoding token-identical.

Only what was measured to pay is listed: on the CPU EP a decoder gets ``explicit-attention, fuse-decoder,
pack-matmuls, trim-logits, matmul-to-conv`` (the README's fastest exact decoder graph, ``bench-results/peers/``),
and an EAGLE drafter ``quantize-drafter`` (8-bit drafter weights; the target untouched, greedy decoding still
token-identical: a Qwen2.5-Coder-0.5B drafter step 1.86x faster, ``bench-results/eagle3-interop/``).
On the CUDA EP the same graph without ``matmul-to-conv`` (a CPU kernel trick): on Qwen2.5-Coder-0.5B fp32 (H200) the
fused graph decodes at 1.95x the unfused export's rate end to end and EAGLE-3 runs 1.33x faster on it
(``bench-results/eagle3/``, "CUDA"); ORT runs its GroupQueryAttention on the CPU there (the CUDA kernel takes no
``attention_bias`` and no float32), and it still wins by cutting ~1,500 kernel launches per step to a few hundred;
on SmolLM2 prompt lookup 1.29x (``bench-results/speculative-cuda/``). It costs prefill (TTFT 2.6x at ORT's default
threads, 7-8x at 2 threads, where the unfused graph then wins end to end): compile with ``-O0`` for that case.
On OpenVINO and DirectML no lowering was measured: those rows are empty. Classifiers on the CPU EP get
``fuse-encoder-attention`` (one MultiHeadAttention per layer of a dynamo-exported encoder: MiniLM-L6 fp32 1.05x,
its int8 early-exit plans 1.07-1.08x, ``bench-results/quantized-certified/`` round 6), ``key-padding-mask`` (the
exported padding-mask chain -> the operator's own key padding mask: ~20 kernels a row; round 10) and ``fuse-gelu`` (one Gelu
kernel per feed-forward layer: MiniLM-L6 fp32 1.07x, int8 1.10x, MPNet-base fp32 1.05x, round 8); their If-vs-staged choice
follows the declared batch sizes in the ``early-exit`` pass. Two bit-exact ones (so from ``-O1``):
``tabulate-length-values`` (what the encoder computes from the sequence length alone -> a slice of a table: MPNet's
relative-position bias, 24 kernels a row) and ``raise-opset`` (opset 21, whose blocked ``QuantizeLinear`` lets
per-token int8 quantize each row without a 2-D view); round 12 of the study measures both.

Placement follows the registry's ``after`` / ``before`` constraints: each inserted pass goes after every pass it
must follow (and after the presets listed before it), as late as possible but before the first pass that consumes
the lowered graph (:data:`ANCHORS`, e.g. ``speculative``, which times verification on it) and before the presets
listed after it that the user named. A pass the user named is never inserted again; one that cannot be placed is left out with an INFO line. At run time an inserted pass
whose model is not a KV-cache decoder, or whose preconditions fail, is skipped with an INFO line saying why
(:class:`PresetPass`), never an error.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import onnx_ir as ir

from dyncompile.errors import PassConfigError
from dyncompile.passes._infra import (
    CompileContext,
    build_pipeline,
    is_pass_list,
    must_precede,
    split_spec,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ANCHORS",
    "DEFAULT_OPT_LEVEL",
    "OPT_LEVELS",
    "PRESETS",
    "EffectivePipeline",
    "PresetPass",
    "describe_presets",
    "resolve",
]

#: the optimization levels and what each adds to the named passes
OPT_LEVELS = {
    0: "exactly the passes named",
    1: "plus the provider's bit-exact lowerings",
    2: "plus the lowerings exact within float round-off (greedy decoding token-identical)",
}
DEFAULT_OPT_LEVEL = 2

#: provider -> technique -> ((lowering pass, lowest level that inserts it), ...), in pipeline order
PRESETS: dict[str, dict[str, tuple[tuple[str, int], ...]]] = {
    "cpu": {
        "text-generation": (
            ("explicit-attention", 1),
            ("fuse-decoder", 2),
            ("pack-matmuls", 2),
            ("trim-logits", 1),
            ("matmul-to-conv", 2),
            ("quantize-drafter", 2),
        ),
        "text-classification": (("fuse-encoder-attention", 2), ("key-padding-mask", 2), ("fuse-gelu", 2),
                                ("tabulate-length-values", 1), ("raise-opset", 1)),
    },
    "cuda": {
        "text-generation": (
            ("explicit-attention", 1),
            ("fuse-decoder", 2),
            ("pack-matmuls", 2),
            ("trim-logits", 1),
        ),
    },
    "openvino": {"text-generation": ()},
    "directml": {"text-generation": ()},
}

#: presets that lower what another pass builds: inserted only when the pipeline names that pass
PRESET_NEEDS = {"quantize-drafter": "eagle-drafter"}

#: passes that consume the lowered graph: inserted lowerings go before the first of them that they may precede
ANCHORS = ("speculative", "quantize-int8", "quantize-int4")

#: passes that make a compile a decoder (text-generation) compile, whatever the model config says
_DECODER_PASSES = frozenset({"speculative", "split-drafter", "eagle-drafter"})


def technique_of(names: Sequence[str], context: CompileContext) -> str | None:
    """The preset technique of a compile.

    ``"text-generation"`` for a decoder compile, ``"text-classification"`` for a classifier's (its config says so,
    or the pipeline has ``early-exit``), else ``None``.
    """
    task = (context.model_config or {}).get("task")
    if _DECODER_PASSES & set(names) or task == "text-generation":
        return "text-generation"
    if task == "text-classification" or "early-exit" in names:
        return "text-classification"
    return None


def _check_level(opt_level: object) -> int:
    if isinstance(opt_level, bool) or opt_level not in OPT_LEVELS:
        raise PassConfigError(f"opt level must be one of {', '.join(map(str, OPT_LEVELS))} (-O0, -O1, -O2), "
                              f"not {opt_level!r}")
    return int(opt_level)


def _check_provider(provider: str) -> str:
    if provider not in PRESETS:
        raise PassConfigError(f"unknown provider {provider!r} for the optimization presets; choose one of "
                              f"{', '.join(PRESETS)}")
    return provider


def place(names: Sequence[str], presets: Sequence[str]) -> tuple[list[str], list[int], dict[str, str]]:
    """Merge ``presets`` (in order) into the pipeline ``names``.

    Returns:
        The merged names, the indices of the inserted ones, and ``{preset: why it was left out}``.
    """
    merged = [(n, False) for n in names]
    left_out: dict[str, str] = {}
    last = -1
    for k, p in enumerate(presets):
        if p in names:  # named by the user: kept where the user put it, never repeated
            last = max(last, next(i for i, (q, ins) in enumerate(merged) if q == p and not ins))
            continue
        lo = max([i for i, (q, _) in enumerate(merged) if must_precede(q, p)] + [last]) + 1
        succ = [i for i, (q, _) in enumerate(merged) if must_precede(p, q)]
        early = [merged[i][0] for i in succ if i < lo]
        if early:
            left_out[p] = f"it must run before {early[0]!r}, which the pipeline needs earlier"
            continue
        # the table's order holds for the named presets too (explicit-attention finds the mask fuse-decoder fuses)
        later = [i for i, (q, _) in enumerate(merged) if i >= lo and (q in ANCHORS or q in presets[k + 1:])]
        hi = min([*succ, *later, len(merged)])
        merged.insert(hi, (p, True))
        last = hi
    return [n for n, _ in merged], [i for i, (_, ins) in enumerate(merged) if ins], left_out


def _entry_text(name: str, raw: dict[str, str]) -> str:
    return name + ("{" + ",".join(f"{k}={v}" for k, v in raw.items()) + "}" if raw else "")


@dataclasses.dataclass
class EffectivePipeline:
    """The pipeline a compile runs: the named passes plus the inserted presets, with what decided them."""

    spec: list[str] | list[ir.passes.PassBase]
    inserted: tuple[int, ...] = ()
    opt_level: int = DEFAULT_OPT_LEVEL
    provider: str = "cpu"
    technique: str | None = None

    def names(self) -> list[str]:
        """The pass names in order (the class names when the pipeline was given as pass instances)."""
        if is_pass_list(self.spec):
            return [type(p).__name__ for p in self.spec]
        return [n for n, _ in split_spec(self.spec)]

    def build(self, context: CompileContext) -> list[ir.passes.PassBase]:
        """Instantiate the passes; inserted presets are wrapped in a :class:`PresetPass` guard."""
        if is_pass_list(self.spec):
            return list(self.spec)
        out: list[ir.passes.PassBase] = []
        for i, (name, made) in enumerate(build_pipeline(self.spec, context)):
            out.extend(PresetPass(p, name, self.opt_level, self.technique) if i in self.inserted else p for p in made)
        return out

    def provenance(self) -> dict:
        """What the plan records: level, provider, technique, the effective names and the inserted ones."""
        names = self.names()
        return {"opt_level": self.opt_level, "provider": self.provider, "technique": self.technique,
                "passes": names, "inserted": [names[i] for i in self.inserted]}


def resolve(
    spec: str | Sequence[str] | Sequence[ir.passes.PassBase],
    context: CompileContext,
    opt_level: int = DEFAULT_OPT_LEVEL,
) -> EffectivePipeline:
    """The pipeline to run for ``spec`` at ``opt_level`` on the compile's provider (``context.options["provider"]``).

    Names, options and order of ``spec`` are checked here (before the model loads); a list of pass instances
    (Python API) runs as given.
    """
    level = _check_level(opt_level)
    provider = _check_provider(str(context.options.get("provider") or "cpu"))
    if is_pass_list(spec):
        if level:
            logger.info("pass instances given: they run as given (no -O%d presets)", level)
        return EffectivePipeline(list(spec), (), level, provider, None)
    entries = split_spec(spec)
    names = [n for n, _ in entries]
    technique = technique_of(names, context)
    wanted = [p for p, lowest in PRESETS[provider].get(technique or "", ())
              if level >= lowest and (p not in PRESET_NEEDS or PRESET_NEEDS[p] in names)]
    merged, inserted, left_out = place(names, wanted)
    for p, why in left_out.items():
        logger.info("-O%d: preset pass %s left out: %s", level, p, why)
    raw = iter(entries)
    texts = [_entry_text(p, {}) if i in inserted else _entry_text(*next(raw)) for i, p in enumerate(merged)]
    if inserted:
        logger.info("-O%d on %s (%s): pipeline %s", level, provider, technique, ",".join(merged))
    return EffectivePipeline(texts, tuple(inserted), level, provider, technique)


def describe_presets() -> list[str]:
    """Lines for ``dyncompile passes``: the levels and the lowering each provider gets per technique."""
    lines = [f"optimization levels (-O, default {DEFAULT_OPT_LEVEL}):"]
    lines += [f"  -O{level}  {what}" for level, what in OPT_LEVELS.items()]
    lines.append("presets per provider (inserted before the technique's passes; a named pass is not repeated):")
    for provider, techniques in PRESETS.items():
        for technique, passes in techniques.items():
            text = ", ".join(f"{p} (-O{lowest}" + (f", with {PRESET_NEEDS[p]})" if p in PRESET_NEEDS else ")")
                             for p, lowest in passes) or "none measured to pay"
            lines.append(f"  {provider:<9} {technique:<19} {text}")
    return lines


class PresetPass(ir.passes.PassBase):
    """Run an inserted preset pass only where it applies; otherwise skip it with an INFO line.

    A decoder preset applies to a KV-cache decoder (:func:`~dyncompile.passes.speculative.decoder_spec.is_kv_decoder`),
    a classifier preset to any model; either only when its state meets the pass's preconditions, and the pass itself
    still decides whether it fires (one that cannot says why at INFO). Skipping reports ``modified=False``. No state
    between runs.
    """

    def __init__(self, wrapped: ir.passes.PassBase, name: str, opt_level: int,
                 technique: str | None = "text-generation") -> None:
        super().__init__()
        self.wrapped = wrapped
        self.name = name
        self.opt_level = opt_level
        self.technique = technique

    @property
    def in_place(self) -> bool:
        """As the wrapped pass."""
        return self.wrapped.in_place

    @property
    def changes_input(self) -> bool:
        """As the wrapped pass."""
        return self.wrapped.changes_input

    def __repr__(self) -> str:
        return f"{self.wrapped!r} [-O{self.opt_level} preset]"

    def why_not(self, model: ir.Model) -> str | None:
        """Why the preset cannot apply to ``model``, or ``None`` when it can."""
        from dyncompile.passes.speculative.decoder_spec import is_kv_decoder

        if self.technique == "text-generation" and not is_kv_decoder(model):
            return "the model is not a KV-cache decoder"
        try:
            self.wrapped.requires(model)
        except ir.passes.PreconditionError as e:
            return str(e)
        return None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the wrapped pass, or return ``model`` unchanged with the reason logged."""
        reason = self.why_not(model)
        if reason is not None:
            logger.info("-O%d: preset pass %s skipped: %s", self.opt_level, self.name, reason)
            return ir.passes.PassResult(model, modified=False)
        return self.wrapped(model)
