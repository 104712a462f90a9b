"""The execution plan: a versioned JSON file beside the ONNX files it names, and its one schema.

``plan.json`` (``"format": "dyncompile.plan/v1"``) says which files make up a compiled model (relative
paths + sha256, each with a role), the I/O signature, the tokenizer, and the ordered ``steps`` the
runtime executes with their policy parameters (thresholds, ...). Passes and the compiler produce it;
the runtime only follows it.

Plans travel (they are made to be copied to edge devices), so a plan may come from a stranger. Loading
therefore validates everything against one declared schema before any ONNX file is opened: size (at most
:data:`MAX_PLAN_BYTES`) and nesting depth of the JSON, the version, paths that would escape the plan
directory, the sha256 of every file, the step kinds known to the runtime, and the type and range of every
field of every step kind (:data:`STEP_SCHEMAS`) and policy (:data:`POLICY_SCHEMAS`). The schema is written
as typed dataclasses (:class:`DecoderSpec`, :class:`GenerationConfig`, :class:`StagedEarlyExitParams`, ...)
built by :func:`from_json`, which checks each value against the field's annotation (``int`` is an integer,
not a bool or a string; ``float`` is a finite number; ``Literal[...]`` is one of the listed values) and
the field's ``lo``/``hi`` range, and rejects unknown keys. Every failure is a :class:`PlanError` naming
the field (``steps[0].segments[1].threshold``), what it got and what it needs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import types
import typing
from pathlib import Path, PurePosixPath
from typing import Any, Literal, Union

from dyncompile.errors import PlanError
from dyncompile.io import sha256_file, write_json_atomic

__all__ = [
    "MAX_PLAN_BYTES",
    "PLAN_FORMAT",
    "PLAN_FILENAME",
    "POLICY_SCHEMAS",
    "STEP_SCHEMAS",
    "DecoderSpec",
    "DrafterParams",
    "DraftPolicy",
    "EarlyExitPolicy",
    "FileRef",
    "GenerateParams",
    "GenerationConfig",
    "KVEntry",
    "Plan",
    "RunModelParams",
    "Segment",
    "SpeculativeParams",
    "StagedEarlyExitParams",
    "Step",
    "TreePolicy",
    "from_json",
    "is_plan_dir",
    "load_plan",
    "load_subplan",
    "Candidate",
    "CandidateCost",
    "RoutedParams",
    "RouteParams",
    "RoutingPolicy",
    "RoutingRule",
    "plan_digest",
    "save_plan",
]

PLAN_FORMAT = "dyncompile.plan/v1"
PLAN_FILENAME = "plan.json"
SUPPORTED_FORMATS = (PLAN_FORMAT,)
MAX_PLAN_BYTES = 16 * 2**20  # a real plan is a few kB (a split drafter's record: tens of kB)
MAX_DEPTH = 32  # nesting of JSON containers; real plans reach 6
MAX_DIM = 1 << 16  # a KV head dimension
MAX_POSITIONS = 1 << 24  # max_length of a decoder


# ------------------------------------------------------------------------------------------- the validator


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _field(default: Any = dataclasses.MISSING, *, lo: float | None = None, hi: float | None = None,
           factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with an inclusive numeric range (``lo``/``hi``) checked by :func:`from_json`."""
    meta = {"lo": lo, "hi": hi}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple):
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"an object of {_describe(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "an object"
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _check_json(v: Any, where: str) -> Any:
    """Free-form JSON (informational records): only finite numbers and string keys."""
    if isinstance(v, float) and not math.isfinite(v):
        raise PlanError(f"{where}: {v} is not a finite number")
    if isinstance(v, dict):
        for k, x in v.items():
            _check_json(x, f"{where}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _check_json(x, f"{where}[{i}]")
    return v


def _convert(tp: Any, v: Any, where: str, lo: float | None = None, hi: float | None = None) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return _check_json(v, where)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # X | None: X's own, more specific message
            return _convert(options[0], v, where, lo, hi)
        for a in options:
            try:
                return _convert(a, v, where, lo, hi)
            except PlanError:
                pass
        raise PlanError(f"{where} must be {_describe(tp)}, got {_short(v)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if any(v == c and type(v) is type(c) for c in choices):
            return v
        raise PlanError(f"{where} must be {_describe(tp)}, got {_short(v)}")
    if tp is bool:
        if isinstance(v, bool):
            return v
    elif tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            _range(v, where, lo, hi)
            return v
    elif tp is float:
        if isinstance(v, int | float) and not isinstance(v, bool):
            if not math.isfinite(v):
                raise PlanError(f"{where} must be a finite number, got {v}")
            _range(v, where, lo, hi)
            return float(v)
    elif tp is str:
        if isinstance(v, str):
            return v
    elif origin in (list, tuple):
        if isinstance(v, list):
            item = typing.get_args(tp)[0]
            out = [_convert(item, x, f"{where}[{i}]", lo, hi) for i, x in enumerate(v)]
            return tuple(out) if origin is tuple else out
    elif origin is dict:
        if isinstance(v, dict):
            item = typing.get_args(tp)[1]
            return {str(k): _convert(item, x, f"{where}.{k}", lo, hi) for k, x in v.items()}
    elif dataclasses.is_dataclass(tp):
        return from_json(tp, v, where)
    else:  # pragma: no cover - a schema annotation this validator does not know
        raise TypeError(f"plan schema: unsupported annotation {tp!r} at {where}")
    raise PlanError(f"{where} must be {_describe(tp)}, got {_short(v)}")


def _range(v: float, where: str, lo: float | None, hi: float | None) -> None:
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise PlanError(f"{where} must be {bounds}, got {v}")


_HINTS: dict[type, dict[str, Any]] = {}


def from_json(cls: type, d: Any, where: str) -> Any:
    """Build the schema dataclass ``cls`` from JSON value ``d``, checking every field (see the module docstring).

    Unknown keys are an error unless ``cls`` sets ``_extra = True`` (informational records); a missing
    field without a default is an error; ``cls._check(self, where)`` runs cross-field checks.
    """
    if not isinstance(d, dict):
        raise PlanError(f"{where} must be an object, got {_short(d)}")
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    extra = [k for k in d if k not in fields]
    if extra and not getattr(cls, "_extra", False):
        raise PlanError(f"{where}: unknown field {extra[0]!r}; valid fields: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanError(f"{where}: missing required field {name!r}")
            continue
        kwargs[name] = _convert(hints[name], d[name], f"{where}.{name}", f.metadata.get("lo"), f.metadata.get("hi"))
    obj = cls(**kwargs)
    check = getattr(obj, "_check", None)
    if check is not None:
        check(where)
    return obj


# ------------------------------------------------------------------------------------------- step schemas

Criterion = Literal["entropy", "maxprob", "patience", "learned"]


def _check_threshold(t: float | None, criterion: str, where: str) -> None:
    if t is None:
        return
    if criterion == "learned":  # a logit score: any finite number (finiteness is checked for every float)
        return
    if criterion == "entropy" and t < 0:
        raise PlanError(f"{where} must be >= 0 (an entropy in nats) for criterion 'entropy', got {t}")
    if criterion != "entropy" and not 0.0 <= t <= 1.0:
        raise PlanError(f"{where} must be in [0, 1] (a probability) for criterion {criterion!r}, got {t}")


@dataclasses.dataclass(frozen=True)
class RunModelParams:
    """``run_model``: run one ONNX file; ``outputs`` renames ONNX outputs in the state."""

    model: str
    outputs: dict[str, str] = _field(factory=dict)


@dataclasses.dataclass(frozen=True)
class Segment:
    """One segment of a staged early-exit plan (``head`` is None for the final segment)."""

    model: str
    layer: int = _field(lo=0, hi=100_000)
    cut_in: str | None = None
    cut_out: str | None = None
    head: str | None = None
    threshold: float | None = None
    output: str | None = None
    score: str | None = None  # learned criterion: the segment's exit-score output (fires when score > threshold)
    prev_head: str | None = None  # learned criterion: input fed with the previous exit's head logits


@dataclasses.dataclass(frozen=True)
class StagedEarlyExitParams:
    """``early_exit_staged``: run ``segments`` in order; rows whose exit test fires leave the batch."""

    segments: list[Segment]
    criterion: Criterion
    output: str
    patience: int = _field(2, lo=1, hi=1000)
    num_layers: int | None = _field(None, lo=1, hi=100_000)

    def _check(self, where: str) -> None:
        if not self.segments:
            raise PlanError(f"{where}.segments must list at least one segment")
        for i, s in enumerate(self.segments):
            last = i == len(self.segments) - 1
            if last and (s.head is not None or not s.output):
                raise PlanError(f"{where}.segments[{i}]: the last segment needs 'output' and no 'head'")
            if not last and (s.head is None or not s.cut_out):
                raise PlanError(f"{where}.segments[{i}]: an exit segment needs 'head' and 'cut_out'")
            if bool(i) != bool(s.cut_in):
                raise PlanError(f"{where}.segments[{i}]: every segment but the first needs 'cut_in' (the first none)")
            _check_threshold(s.threshold, self.criterion, f"{where}.segments[{i}].threshold")


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
    """How to drive one KV-cache decoder graph (see :mod:`dyncompile.runtime.generate` for the JSON form)."""

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
        d = d or {}
        if isinstance(d, dict) and isinstance(d.get("eos_token_ids"), int) and not isinstance(d["eos_token_ids"], bool):
            d = {**d, "eos_token_ids": [d["eos_token_ids"]]}
        if isinstance(d, dict) and d.get("eos_token_ids") is None and "eos_token_ids" in d:
            d = {k: v for k, v in d.items() if k != "eos_token_ids"}
        return from_json(cls, d, "plan step: generation")


@dataclasses.dataclass(frozen=True)
class DrafterParams:
    """The drafter of a ``speculative_generate`` step: a model (``decoder``), prompt lookup, or an EAGLE head
    (``decoder`` fed the target's ``features`` output; see :mod:`dyncompile.runtime.eagle`)."""

    kind: Literal["model", "prompt-lookup", "eagle"]
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

    def _check(self, where: str) -> None:
        if self.kind == "eagle":
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
        elif self.min_ngram > self.max_ngram:
            raise PlanError(f"{where}: min_ngram {self.min_ngram} > max_ngram {self.max_ngram}")


@dataclasses.dataclass(frozen=True)
class TreePolicy:
    """Draft trees of a ``speculative_generate`` step: several candidates verified in one target call.

    ``max_nodes``: drafted nodes per tree (the root excluded); ``max_depth``: longest root-to-leaf path;
    ``branching``: candidates per node a drafter may offer (prompt-lookup matches, a model's top-k);
    ``adaptive``: size the tree from the measured verification cost curve and what branches bought.
    """

    max_nodes: int = _field(16, lo=1, hi=256)
    max_depth: int = _field(8, lo=1, hi=256)
    branching: int = _field(3, lo=1, hi=64)
    adaptive: bool = True


@dataclasses.dataclass(frozen=True)
class DraftPolicy:
    """Draft lengths and the cost model of a ``speculative_generate`` step."""

    initial: int = _field(4, lo=0, hi=256)
    min: int = _field(1, lo=0, hi=256)
    max: int = _field(8, lo=0, hi=256)
    adaptive: bool = True
    alpha0: float = _field(0.6, lo=0.0, hi=1.0)
    verify_slope: float = _field(0.1, lo=0.0, hi=1e6)
    draft_cost: float | None = _field(None, lo=0.0, hi=1e6)
    draft_cost_source: str | None = None
    verify_cost: dict[str, float] | None = _field(None, lo=0.0, hi=1e6)
    timing: bool = False
    tree: TreePolicy | None = None

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


@dataclasses.dataclass(frozen=True)
class SpeculativeParams(GenerateParams):
    """``speculative_generate``: a drafter proposes, the target verifies."""

    drafter: DrafterParams = _field(factory=lambda: DrafterParams("prompt-lookup"))
    draft: DraftPolicy = _field(factory=DraftPolicy)


def _generate_from_json(cls):
    def build(d: Any, where: str):
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


# diffusion plans (``task: text-to-image``; runtime/diffusion.py, passes/step_saver/)


@dataclasses.dataclass(frozen=True)
class DiffusionEncodeParams:
    """``diffusion_encode``: ``[null prompt] + prompts`` through the text encoder in one batch."""

    text_encoder: str
    output: str = "last_hidden_state"
    null_prompt: str = ""


@dataclasses.dataclass(frozen=True)
class PredictStepsParams:
    """``predict_steps`` (step-saver): ``log2 steps = ((f - mean) / scale) @ weights + bias + offset``, rounded up
    onto ``grid``; ``f`` the masked mean of the text states."""

    weights: list[float]
    bias: float
    mean: list[float]
    scale: list[float]
    grid: list[int] = _field(lo=1, hi=1000)
    offset: float = _field(0.0, lo=-10.0, hi=10.0)
    features: Literal["mean_pool"] = "mean_pool"

    def _check(self, where: str) -> None:
        n = len(self.weights)
        if len(self.mean) != n or len(self.scale) != n:
            raise PlanError(f"{where}: mean has {len(self.mean)} values, scale {len(self.scale)}, expected {n} (weights)")
        if any(s <= 0 for s in self.scale):
            raise PlanError(f"{where}.scale must be > 0")
        if not self.grid or list(self.grid) != sorted(set(self.grid)):
            raise PlanError(f"{where}.grid must be an increasing list of step counts, got {_short(self.grid)}")


@dataclasses.dataclass(frozen=True)
class StopRuleParams:
    """The online stop rule: stop a row when its x0 prediction changes by less than ``threshold`` (RMS, [0, 1])."""

    kind: Literal["x0_change"]
    threshold: float = _field(lo=0.0, hi=1.0)
    max_steps: int = _field(lo=2, hi=1000)
    min_steps: int = _field(1, lo=1, hi=1000)

    def _check(self, where: str) -> None:
        if self.min_steps > self.max_steps:
            raise PlanError(f"{where}.min_steps {self.min_steps} exceeds max_steps {self.max_steps}")


@dataclasses.dataclass(frozen=True)
class VaeDecoderParams:
    file: str
    scaling_factor: float = _field(lo=1e-6, hi=1e6)


@dataclasses.dataclass(frozen=True)
class DiffusionDenoiseParams:
    """``diffusion_denoise``: the guided scheduler loop over the U-Net (``scheduler`` is a diffusers config the
    runtime validates; it refuses types and options it does not implement)."""

    unet: str
    scheduler: dict[str, Any]
    sample_shape: list[int] = _field(lo=1, hi=1_000_000)
    guidance_scale: float = _field(lo=1.0, hi=100.0)
    num_inference_steps: int = _field(lo=1, hi=1000)
    input_names: list[str] = _field(factory=lambda: ["sample", "timestep", "encoder_hidden_states"])
    output_crop: list[int] | None = _field(None, lo=0, hi=1_000_000)
    eta: float = _field(0.0, lo=0.0, hi=0.0)
    noise: Literal["numpy", "torch"] = "numpy"
    default_policy: Literal["fixed", "predicted", "online"] = "fixed"
    stop_rule: StopRuleParams | None = None
    vae_decoder: VaeDecoderParams | None = None

    def _check(self, where: str) -> None:
        if len(self.sample_shape) != 3:
            raise PlanError(f"{where}.sample_shape must be [C, H, W], got {_short(self.sample_shape)}")
        if len(self.input_names) != 3:
            raise PlanError(f"{where}.input_names must name the U-Net's sample, timestep and text-state inputs")
        c = self.output_crop
        if c is not None and (len(c) != 4 or not (c[0] < c[1] <= self.sample_shape[1] and c[2] < c[3] <= self.sample_shape[2])):
            raise PlanError(f"{where}.output_crop must be [top, bottom, left, right] inside {self.sample_shape[1:]}, got {_short(c)}")
        if self.default_policy == "online" and self.stop_rule is None:
            raise PlanError(f"{where}: default_policy 'online' needs a stop_rule")


# routing and cascades across whole plans (runtime/route.py, passes/routing/, tools/route.py)

RULE_KINDS = ("confidence", "learned", "check")
_HEX = "0123456789abcdef"


@dataclasses.dataclass(frozen=True)
class CandidateCost:
    """A candidate's cost: median wall-clock ms per call on ``provider`` at ``batch`` (measured at compile time,
    or ``given`` by the user for plans that cannot be timed there)."""

    ms: float = _field(lo=0.0, hi=1e9)
    provider: str = "cpu"
    batch: int = _field(1, lo=1, hi=1_000_000)
    source: Literal["measured", "given"] = "measured"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate of a ``route``/``cascade`` step: a sub-plan folder inside the routed plan, its digest
    (:func:`plan_digest`; checked when the routed plan is loaded) and its cost."""

    name: str
    plan: str
    digest: str
    cost: CandidateCost
    task: str
    labels: list[str] | None = None

    def _check(self, where: str) -> None:
        if len(self.digest) != 64 or any(c not in _HEX for c in self.digest):
            raise PlanError(f"{where}.digest must be 64 lowercase hex digits (a plan digest), got {_short(self.digest)}")
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise PlanError(f"{where}.name must be letters, digits, '-', '_' or '.', got {_short(self.name)}")


@dataclasses.dataclass(frozen=True)
class RoutingRule:
    """The decision rule of a routed plan.

    * ``confidence`` (cascade): candidate ``k`` answers when its ``criterion`` confidence passes
      ``thresholds[k]`` (entropy: ``H < t``; maxprob: ``max p > t``; ``None``: never); the last always answers.
    * ``learned`` (route): the ONNX ``router`` file reads the input before any candidate runs and outputs one
      score per candidate but the last; the first ``k`` with ``score_k > thresholds[k]`` answers.
    * ``check`` (cascade): candidate ``k`` answers when the registered executable check ``check`` passes on
      (input, its output); the last always answers.
    """

    kind: Literal["confidence", "learned", "check"]
    thresholds: list[float | None] = _field(factory=list)
    criterion: Literal["entropy", "maxprob"] | None = None
    router: str | None = None
    router_output: str = "route_scores"
    check: str | None = None

    def _check(self, where: str) -> None:
        if self.kind == "confidence":
            if self.criterion is None:
                raise PlanError(f"{where}: a confidence rule needs 'criterion' (entropy or maxprob)")
            for i, t in enumerate(self.thresholds):
                _check_threshold(t, self.criterion, f"{where}.thresholds[{i}]")
        if self.kind == "learned" and not self.router:
            raise PlanError(f"{where}: a learned rule needs 'router' (the file key of the router ONNX model)")
        if self.kind == "check" and not self.check:
            raise PlanError(f"{where}: a check rule needs 'check' (the name of a registered executable check)")
        if self.kind != "learned" and self.router is not None:
            raise PlanError(f"{where}: 'router' belongs to a learned rule, not to a {self.kind!r} rule")
        if self.kind != "check" and self.check is not None:
            raise PlanError(f"{where}: 'check' belongs to a check rule, not to a {self.kind!r} rule")


@dataclasses.dataclass(frozen=True)
class RoutedParams:
    """``cascade`` (run candidates cheapest first, stop when the rule accepts) and ``route`` (a learned router
    picks one candidate before any runs): ``candidates`` cheapest first, the last is the fallback."""

    candidates: list[Candidate]
    rule: RoutingRule
    output: str = "logits"

    _kind = "cascade"

    def _check(self, where: str) -> None:
        if len(self.candidates) < 2:
            raise PlanError(f"{where}.candidates must list at least two sub-plans, got {len(self.candidates)}")
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise PlanError(f"{where}.candidates: names must be unique, got {names}")
        plans = [c.plan for c in self.candidates]
        if len(set(plans)) != len(plans):
            raise PlanError(f"{where}.candidates: each candidate needs its own sub-plan folder, got {plans}")
        if len(self.rule.thresholds) != len(self.candidates) - 1 and self.rule.kind != "check":
            raise PlanError(
                f"{where}.rule.thresholds must have one value per candidate but the last "
                f"({len(self.candidates) - 1}), got {len(self.rule.thresholds)}"
            )
        tasks = {c.task for c in self.candidates}
        if len(tasks) != 1:
            raise PlanError(f"{where}.candidates: all candidates must do the same task, got {sorted(tasks)}")
        labels = {tuple(c.labels) if c.labels is not None else None for c in self.candidates}
        if len(labels) != 1:
            raise PlanError(f"{where}.candidates: all candidates must share one label set, got {sorted(map(str, labels))}")
        want = ("learned",) if self._kind == "route" else ("confidence", "check")
        if self.rule.kind not in want:
            raise PlanError(f"{where}.rule.kind {self.rule.kind!r} does not fit a {self._kind!r} step (use {' or '.join(want)})")


@dataclasses.dataclass(frozen=True)
class RouteParams(RoutedParams):
    _kind = "route"



STEP_SCHEMAS: dict[str, Any] = {
    "run_model": lambda d, where: from_json(RunModelParams, d, where),
    "early_exit_staged": lambda d, where: from_json(StagedEarlyExitParams, d, where),
    "generate": _generate_from_json(GenerateParams),
    "speculative_generate": _generate_from_json(SpeculativeParams),
    "diffusion_encode": lambda d, where: from_json(DiffusionEncodeParams, d, where),
    "predict_steps": lambda d, where: from_json(PredictStepsParams, d, where),
    "diffusion_denoise": lambda d, where: from_json(DiffusionDenoiseParams, d, where),
    "cascade": lambda d, where: from_json(RoutedParams, d, where),
    "route": lambda d, where: from_json(RouteParams, d, where),
}
"""Step kind -> ``build(params_json, where)`` returning the typed params (declared schema per kind)."""


# ------------------------------------------------------------------------------------------- policy schemas


@dataclasses.dataclass(frozen=True)
class EarlyExitPolicy:
    """``policy.early_exit``: the criterion and per-layer thresholds (plus calibration records)."""

    _extra = True  # calibration / exit_stats / fit records are informational

    criterion: Criterion = "entropy"
    patience: int = _field(2, lo=1, hi=1000)
    num_layers: int | None = _field(None, lo=1, hi=100_000)
    lowering: Literal["if", "staged"] | None = None
    lowering_choice: Any = None
    thresholds: dict[str, float | None] = _field(factory=dict)
    certificate: Any = None  # passes/early_exit/certify.py Certificate.to_dict(): what the budget promise rests on
    exit_policy: Any = None  # criterion 'learned': the per-exit policy weights (also in the graph / segments)

    def _check(self, where: str) -> None:
        for k, t in self.thresholds.items():
            if not k.isdigit():
                raise PlanError(f"{where}.thresholds: key {k!r} must be a layer number")
            _check_threshold(t, self.criterion, f"{where}.thresholds.{k}")


@dataclasses.dataclass(frozen=True)
class SpeculativePolicy:
    """``policy.speculative``: which drafter and its draft policy (informational)."""

    _extra = True

    drafter: str = ""
    draft: DraftPolicy = _field(factory=DraftPolicy)


@dataclasses.dataclass(frozen=True)
class RoutingPolicy:
    """``policy.routing``: the budget the rule was calibrated to, its certificate and calibration record."""

    _extra = True  # calibration records are informational

    budget: float | None = _field(None, lo=0.0, hi=100.0)
    reference: str | None = None
    metric: Literal["accuracy", "agreement", "check"] | None = None
    certificate: Any = None  # passes/early_exit/certify.py Certificate.to_dict()
    router_overhead_ms: float | None = _field(None, lo=0.0, hi=1e9)


POLICY_SCHEMAS: dict[str, type] = {
    "early_exit": EarlyExitPolicy,
    "speculative": SpeculativePolicy,
    "routing": RoutingPolicy,
}
"""Policy name -> schema; other policy entries must be free-form JSON (finite numbers)."""


# ------------------------------------------------------------------------------------------- the plan


@dataclasses.dataclass
class FileRef:
    """One file of the plan: path relative to the plan dir (posix), sha256 and role."""

    path: str
    sha256: str
    role: str
    external_data: list[str] = dataclasses.field(default_factory=list)  # sidecar files of an ONNX model

    def to_dict(self) -> dict[str, Any]:
        d = {"path": self.path, "sha256": self.sha256, "role": self.role}
        if self.external_data:
            d["external_data"] = list(self.external_data)
        return d


@dataclasses.dataclass
class Step:
    """One step of the plan; ``kind`` selects the runtime handler, ``params`` are its policy.

    ``typed`` holds the params validated against the kind's schema (:data:`STEP_SCHEMAS`) once the plan
    was loaded (None for a step built in memory or a kind without a declared schema).
    """

    kind: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    typed: Any = dataclasses.field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.params}


@dataclasses.dataclass(frozen=True)
class _TokenizerSpec:
    file: str
    max_length: int = _field(512, lo=1, hi=MAX_POSITIONS)
    padding: Literal["longest", "max_length"] = "longest"


@dataclasses.dataclass(frozen=True)
class _IOSpec:
    _extra = True
    name: str
    dtype: str | None = None
    shape: list[int | str | None] = _field(factory=list)


@dataclasses.dataclass(frozen=True)
class _FileSpec:
    path: str
    sha256: str
    role: str
    external_data: list[str] = _field(factory=list)

    def _check(self, where: str) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise PlanError(f"{where}.sha256 must be 64 lowercase hex digits, got {_short(self.sha256)}")


@dataclasses.dataclass(frozen=True)
class _PlanSpec:
    format: str
    task: str
    files: dict[str, _FileSpec]
    steps: list[Any]
    inputs: list[_IOSpec] = _field(factory=list)
    outputs: list[_IOSpec] = _field(factory=list)
    tokenizer: _TokenizerSpec | None = None
    labels: list[str] | None = None
    policy: dict[str, Any] = _field(factory=dict)
    provenance: dict[str, Any] = _field(factory=dict)


@dataclasses.dataclass
class Plan:
    """In-memory form of ``plan.json``."""

    task: str
    files: dict[str, FileRef]
    steps: list[Step]
    inputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    outputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tokenizer: dict[str, Any] | None = None
    labels: list[str] | None = None
    policy: dict[str, Any] = dataclasses.field(default_factory=dict)
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)
    format: str = PLAN_FORMAT
    directory: Path | None = dataclasses.field(default=None, compare=False)
    contents: dict[str, bytes] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Bytes of the small non-ONNX files (tokenizer, vocab maps), read once and hash-checked at load."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "task": self.task,
            "files": {k: f.to_dict() for k, f in self.files.items()},
            "inputs": self.inputs,
            "outputs": self.outputs,
            "tokenizer": self.tokenizer,
            "labels": self.labels,
            "steps": [s.to_dict() for s in self.steps],
            "policy": self.policy,
            "provenance": self.provenance,
        }

    def path_of(self, key: str) -> Path:
        """Absolute path of file ``key`` (plan must have been loaded from / saved to a directory)."""
        if self.directory is None:
            raise PlanError("plan has no directory; load it with load_plan(dir)")
        if key not in self.files:
            raise PlanError(f"plan names no file {key!r}; it has: {', '.join(self.files)}")
        return self.directory / self.files[key].path

    def original_model(self, purpose: str = "--compare") -> Path:
        """The original model this plan was compiled from (``provenance.source``), checked against its sha256.

        Raises:
            PlanError: no source recorded, the file is missing, or its sha256 differs from the recorded one
                (it is not the model the plan was compiled from, so figures "vs original" would be wrong).
        """
        src = self.provenance.get("source") if isinstance(self.provenance, dict) else None
        path = src.get("path") if isinstance(src, dict) else None
        want = src.get("sha256") if isinstance(src, dict) else None
        if not isinstance(path, str) or not path or not isinstance(want, str):
            raise PlanError(f"{purpose} needs the original model, but the plan records none (provenance.source)")
        p = Path(path)
        if not p.is_absolute() or "\x00" in path:
            raise PlanError(f"{purpose}: the plan's original model path {path!r} is not an absolute path")
        if not p.is_file():
            raise PlanError(
                f"{purpose} needs the original model, recorded as {path}, which is not there any more; copy it back "
                f"or leave out {purpose}"
            )
        actual = sha256_file(p)
        if actual != want:
            raise PlanError(
                f"{purpose}: {path} is not the model this plan was compiled from (sha256 {actual[:12]}… != recorded "
                f"{want[:12]}…); restore the original, or leave out {purpose}"
            )
        return p

    def content_of(self, key: str) -> bytes:
        """The verified bytes of small file ``key`` (read at load; read now for a plan built in memory)."""
        data = self.contents.get(key)
        if data is None:
            data = self.path_of(key).read_bytes()
        return data


def file_ref(plan_dir: Path, rel: str, role: str, external_data: list[str] | None = None) -> FileRef:
    """A :class:`FileRef` for ``plan_dir/rel`` with its current sha256."""
    return FileRef(rel, sha256_file(plan_dir / rel), role, list(external_data or []))


def save_plan(plan: Plan, plan_dir: str | Path) -> Path:
    """Write ``plan_dir/plan.json`` atomically; returns its path."""
    plan_dir = Path(plan_dir)
    path = plan_dir / PLAN_FILENAME
    write_json_atomic(path, plan.to_dict())
    plan.directory = plan_dir
    return path


def _check_rel_path(plan_dir: Path, rel: Any, what: str) -> Path:
    if not isinstance(rel, str) or not rel:
        raise PlanError(f"{what}: path must be a non-empty string, got {rel!r}")
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or "\\" in rel or "\x00" in rel:
        raise PlanError(
            f"{what}: path {rel!r} escapes the plan directory; plan paths must be relative and stay inside it"
        )
    full = (plan_dir / rel).resolve()
    if plan_dir.resolve() not in full.parents and full != plan_dir.resolve():
        raise PlanError(f"{what}: path {rel!r} resolves outside the plan directory ({full})")
    return full


def _depth_ok(v: Any, limit: int) -> bool:
    stack = [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict | list):
            if d > limit:
                return False
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return True


def _read_plan_json(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    if size > MAX_PLAN_BYTES:
        raise PlanError(
            f"{path} is {size / 2**20:.1f} MiB; a plan.json is at most {MAX_PLAN_BYTES // 2**20} MiB (real plans "
            "are a few kB): this is not a plan dyncompile wrote"
        )
    data = path.read_bytes()
    if data[:1] != b"{" and data.lstrip()[:1] != b"{":
        raise PlanError(f"{path} is not a plan (plan.json is a JSON object); recompile the model")
    try:
        raw = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path} is not valid JSON ({e}); recompile the model") from None
    except RecursionError:
        raise PlanError(f"{path}: JSON nested too deeply (a plan nests at most {MAX_DEPTH} levels)") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: top level must be a JSON object")
    if not _depth_ok(raw, MAX_DEPTH):
        raise PlanError(f"{path}: JSON nested too deeply (a plan nests at most {MAX_DEPTH} levels)")
    return raw


def is_plan_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory holding a ``plan.json`` of a format this dyncompile writes."""
    p = Path(path) / PLAN_FILENAME
    try:
        if not p.is_file() or p.stat().st_size > MAX_PLAN_BYTES:
            return False
        raw = json.loads(p.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and raw.get("format") in SUPPORTED_FORMATS


def _resolve_plan_path(plan_dir: Path) -> tuple[Path, Path]:
    if plan_dir.is_dir():
        return plan_dir, plan_dir / PLAN_FILENAME
    if plan_dir.is_file():
        if plan_dir.name == PLAN_FILENAME:
            return plan_dir.parent, plan_dir
        with open(plan_dir, "rb") as f:
            head = f.read(64).lstrip()
        if plan_dir.suffix == ".onnx" or (head[:1] != b"{" and plan_dir.suffix != ".json"):
            raise PlanError(
                f"{plan_dir} is an ONNX model (or another file), not a plan; compile it first "
                f"(`dyncompile {plan_dir} -o DIR`) and run the plan directory DIR"
            )
        raise PlanError(f"{plan_dir} is a file, not a plan directory; give the directory holding {PLAN_FILENAME}")
    raise PlanError(
        f"no plan at {plan_dir}: expected {plan_dir / PLAN_FILENAME} (make one with `dyncompile MODEL.onnx -o DIR`)"
    )


def load_plan(plan_dir: str | Path, *, verify_hashes: bool = True, known_step_kinds=None) -> Plan:
    """Load and validate ``plan_dir/plan.json`` against the plan schema; read and hash-check every file.

    ONNX files and their external data are hashed here and opened later by the runtime; small files
    (tokenizer, vocab maps) are read once into :attr:`Plan.contents` from the same bytes that were hashed,
    so a file swapped after ``load`` is never used.

    Raises:
        PlanError: missing/oversized/malformed plan, unknown format version, a field of the wrong type or
            out of range, a path escaping the plan dir, a file whose sha256 differs from the plan's
            (modified after compile), or an unknown step kind.
    """
    plan_dir, path = _resolve_plan_path(Path(plan_dir))
    if not path.is_file():
        raise PlanError(
            f"no plan at {plan_dir}: expected {path} (make one with `dyncompile MODEL.onnx -o DIR`)"
        )
    raw = _read_plan_json(path)
    fmt = raw.get("format")
    if not isinstance(fmt, str) or fmt not in SUPPORTED_FORMATS:
        raise PlanError(
            f"{path}: unknown plan format {_short(fmt)}; this dyncompile reads {', '.join(SUPPORTED_FORMATS)} — "
            "recompile the model with this version, or use the dyncompile version that wrote it"
        )
    for key in ("task", "files", "steps"):
        if key not in raw:
            raise PlanError(f"{path}: missing required field {key!r}")
    try:
        spec = from_json(_PlanSpec, raw, "plan")
    except PlanError as e:
        raise PlanError(f"{path}: {e}; recompile the model, or fix plan.json") from None

    files: dict[str, FileRef] = {}
    contents: dict[str, bytes] = {}
    for key, fr in spec.files.items():
        full = _check_rel_path(plan_dir, fr.path, f"file {key!r}")
        for e in fr.external_data:
            _check_rel_path(plan_dir, e, f"external data of file {key!r}")
        if not full.is_file():
            raise PlanError(f"file {key!r} of the plan is missing: {full}")
        small = not fr.path.endswith((".onnx", ".data")) and fr.role not in ("external_data",)
        if small:
            data = full.read_bytes()
            contents[key] = data
            actual = hashlib.sha256(data).hexdigest()
        else:
            actual = sha256_file(full) if verify_hashes else fr.sha256
        if verify_hashes and actual != fr.sha256:
            raise PlanError(
                f"file {key!r} ({full}) was modified after compile: sha256 {actual[:12]}… != plan's "
                f"{fr.sha256[:12]}…; recompile, or restore the original file"
            )
        files[key] = FileRef(fr.path, fr.sha256, fr.role, list(fr.external_data))

    if not spec.steps:
        raise PlanError(f"{path}: 'steps' must be a non-empty list")
    steps = []
    for i, s in enumerate(spec.steps):
        if not isinstance(s, dict) or not isinstance(s.get("kind"), str):
            raise PlanError(f"{path}: step {i} has no 'kind' (a string naming the step handler)")
        kind = s["kind"]
        if known_step_kinds is not None and kind not in known_step_kinds:
            raise PlanError(
                f"{path}: step {i} has unknown kind {_short(kind)}; this runtime knows: "
                f"{', '.join(sorted(known_step_kinds))} (plan from a newer dyncompile?)"
            )
        params = {k: v for k, v in s.items() if k != "kind"}
        build = STEP_SCHEMAS.get(kind)
        typed = None
        if build is not None:
            try:
                typed = build(params, f"steps[{i}] ({kind})")
            except PlanError as e:
                raise PlanError(f"{path}: {e}; recompile the model, or fix plan.json") from None
            _check_file_keys(path, i, kind, typed, files)
        else:
            _check_json(params, f"steps[{i}]")
        steps.append(Step(kind, params, typed))

    for name, value in spec.policy.items():
        schema = POLICY_SCHEMAS.get(name)
        try:
            if schema is not None:
                from_json(schema, value, f"policy.{name}")
            else:
                _check_json(value, f"policy.{name}")
        except PlanError as e:
            raise PlanError(f"{path}: {e}; recompile the model, or fix plan.json") from None
    if spec.labels is not None and spec.task == "text-classification" and spec.outputs:
        classes = spec.outputs[0].shape[-1] if spec.outputs[0].shape else None
        if isinstance(classes, int) and classes != len(spec.labels):
            raise PlanError(
                f"{path}: labels lists {len(spec.labels)} classes but the output {spec.outputs[0].name!r} has {classes}; "
                "recompile the model, or fix plan.json"
            )
    if spec.tokenizer is not None and spec.tokenizer.file not in files:
        raise PlanError(f"{path}: tokenizer.file {spec.tokenizer.file!r} names no file of the plan ({', '.join(files)})")
    return Plan(
        task=spec.task,
        files=files,
        steps=steps,
        inputs=raw.get("inputs") or [],
        outputs=raw.get("outputs") or [],
        tokenizer=raw.get("tokenizer"),
        labels=spec.labels,
        policy=spec.policy,
        provenance=spec.provenance,
        format=fmt,
        directory=plan_dir,
        contents=contents,
    )


def _check_file_keys(path: Path, i: int, kind: str, typed: Any, files: dict[str, FileRef]) -> None:
    keys: list[tuple[str, str]] = []
    if isinstance(typed, RunModelParams):
        keys.append(("model", typed.model))
    elif isinstance(typed, StagedEarlyExitParams):
        keys += [(f"segments[{j}].model", s.model) for j, s in enumerate(typed.segments)]
    elif isinstance(typed, GenerateParams):
        keys.append(("target.model", typed.target.model))
        if isinstance(typed, SpeculativeParams):
            if typed.drafter.decoder is not None:
                keys.append(("drafter.decoder.model", typed.drafter.decoder.model))
            if typed.drafter.vocab is not None:
                keys.append(("drafter.vocab", typed.drafter.vocab))
    elif isinstance(typed, DiffusionEncodeParams):
        keys.append(("text_encoder", typed.text_encoder))
    elif isinstance(typed, RoutedParams):
        if typed.rule.router is not None:
            keys.append(("rule.router", typed.rule.router))
        for j, c in enumerate(typed.candidates):
            sub = _check_rel_path(path.parent, c.plan, f"steps[{i}] ({kind}).candidates[{j}].plan")
            if not (sub / PLAN_FILENAME).is_file():
                raise PlanError(
                    f"{path}: steps[{i}] ({kind}): sub-plan {c.name!r} is missing (no {sub / PLAN_FILENAME}); a routed "
                    "plan carries its candidates inside its folder — copy the whole folder, or recompile with "
                    "`dyncompile route`"
                )
    elif isinstance(typed, DiffusionDenoiseParams):
        keys.append(("unet", typed.unet))
        if typed.vae_decoder is not None:
            keys.append(("vae_decoder.file", typed.vae_decoder.file))
    for where, key in keys:
        if key not in files:
            raise PlanError(
                f"{path}: steps[{i}] ({kind}).{where} names file {key!r}, which the plan does not list "
                f"(files: {', '.join(files)}); recompile the model"
            )


def plan_digest(plan_dir: str | Path, *, loaded: Plan | None = None) -> str:
    """One sha256 over the whole plan: ``plan.json`` and every file it names, in canonical (sorted path) order.

    Each entry contributes ``path NUL sha256-of-bytes NUL``, so the digest changes when any byte of any
    file changes, when a file is renamed, added to or dropped from the plan. Compare it with the digest
    the plan's publisher printed (``dyncompile inspect --verify PLAN``). A routed plan (``route`` /
    ``cascade`` steps) also checks every sub-plan against the digest it records (:func:`load_subplan`).

    ``loaded``: the plan as :func:`load_plan` returned it with ``verify_hashes=True`` — its files' hashes were
    just checked, so they are not read a second time (same digest).
    """
    plan = loaded if loaded is not None else load_plan(plan_dir, verify_hashes=True)
    assert plan.directory is not None
    known = {f.path: f.sha256 for f in plan.files.values()}
    rels = {PLAN_FILENAME}
    for f in plan.files.values():
        rels.add(f.path)
        rels.update(f.external_data)
    h = hashlib.sha256(b"dyncompile.plan-digest/v1\0")
    for rel in sorted(rels):
        full = plan.directory / rel
        if not full.is_file():
            raise PlanError(f"file {rel!r} named by the plan is missing: {full}")
        digest = known[rel] if (loaded is not None and rel in known) else sha256_file(full)
        h.update(rel.encode("utf-8") + b"\0" + digest.encode() + b"\0")
    if loaded is None:
        for step in plan.steps:
            if isinstance(step.typed, RoutedParams):
                for c in step.typed.candidates:
                    load_subplan(plan, c)
    return h.hexdigest()


def load_subplan(parent: Plan, candidate: Candidate, known_step_kinds=None) -> Plan:
    """Load candidate ``candidate`` of routed plan ``parent`` with the same checks as a top-level plan, and
    check it against the digest the routed plan records.

    Raises:
        PlanError: the sub-plan is missing, fails any check of :func:`load_plan`, is itself a routed plan, or
            differs from what was compiled in (digest mismatch: a file added, removed, renamed or changed).
    """
    assert parent.directory is not None
    sub_dir = _check_rel_path(parent.directory, candidate.plan, f"candidate {candidate.name!r}")
    if not (sub_dir / PLAN_FILENAME).is_file():
        raise PlanError(
            f"sub-plan {candidate.name!r} of {parent.directory} is missing (no {sub_dir / PLAN_FILENAME}); copy the "
            "whole routed folder, or recompile with `dyncompile route`"
        )
    try:
        sub = load_plan(sub_dir, verify_hashes=True, known_step_kinds=known_step_kinds)
    except PlanError as e:
        raise PlanError(f"sub-plan {candidate.name!r} of routed plan {parent.directory}: {e}") from None
    if any(isinstance(s.typed, RoutedParams) for s in sub.steps):
        raise PlanError(f"sub-plan {candidate.name!r} of {parent.directory} is itself a routed plan; candidates must be plain plans")
    digest = plan_digest(sub_dir, loaded=sub)
    if digest != candidate.digest:
        raise PlanError(
            f"sub-plan {candidate.name!r} ({sub_dir}) was modified after the routed plan was compiled: digest "
            f"{digest[:12]}… != recorded {candidate.digest[:12]}… (a file added, removed or changed); restore it, or "
            "recompile with `dyncompile route`"
        )
    if sub.task != candidate.task or (sub.labels is not None and candidate.labels is not None and list(sub.labels) != list(candidate.labels)):
        raise PlanError(f"sub-plan {candidate.name!r} does not match the task / labels the routed plan records; recompile")
    return sub
