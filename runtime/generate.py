"""Autoregressive generation on a plan's decoder (batch 1): KV-cache bookkeeping, sampling, the ``generate`` step.

A plan for a decoder names its ONNX file(s) and, in the step parameters, everything the runtime needs to
drive them without looking at the graphs again (the runtime never re-derives what the compiler decided):

``decoder`` spec (for the target, and for a model drafter)::

    {"model": "model",                               # plan file key
     "input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
     "logits": "logits",
     "kv": [{"past": "past_key_values.0.key", "present": "present.0.key", "axis": 2,
             "shape": [3, 64]}, ...],                # per-head dims of [batch, heads, past, head_dim]
     "kv_dtype": "float32"}

``generation`` config: ``eos_token_ids``, ``bos_token_id``, ``max_length`` (positions the model supports),
``chat_template`` (optional).

:class:`KVDecoder` keeps one decoder's cache as arrays (past tensors), feeds ``attention_mask`` /
``position_ids`` for batch 1, and rolls back by slicing the past tensors to a length (a copy only
when something is cut). The ``generate`` step (target-only plans) and the ``speculative_generate`` step
(:mod:`dyncompile.runtime.speculative`) share it. ``CompiledModel.generate`` is the Python entry point.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncompile.errors import DataError, PlanError
from dyncompile.plan import DecoderSpec, GenerationConfig, KVEntry  # noqa: F401  (the plan schema; re-exported)
from dyncompile.runtime.executor import StepHandler, register_step

logger = logging.getLogger(__name__)

__all__ = [
    "DecoderSpec",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "GenerateStep",
    "KVDecoder",
    "PromptError",
    "generate",
    "probs_from_logits",
    "sample_from",
]


class PromptError(DataError):
    """An empty prompt, a bad ``max_new_tokens``/``temperature``, or a prompt longer than the model allows."""


_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "float": np.float32, "FLOAT": np.float32,
              "FLOAT16": np.float16, "bfloat16": np.float32}


class SessionTimer:
    """Accumulates seconds spent inside ORT ``run`` calls, per model role."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, role: str, dt: float) -> None:
        self.seconds[role] = self.seconds.get(role, 0.0) + dt
        self.calls[role] = self.calls.get(role, 0) + 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class KVDecoder:
    """One decoder session plus its KV cache (batch 1).

    ``forward(ids)`` runs the new tokens on top of the cache and returns their logits ``[n, vocab]``;
    the cache grows by ``n``. ``truncate(length)`` rolls the cache back (rejected draft tokens).
    ``adopt(arrays, length)`` installs past tensors computed elsewhere (a split drafter's first layers are
    the target's first layers, so it takes the target's cache instead of recomputing it).

    Rollback (``rollback=``):

    * ``"mask"`` (default): rejected positions stay in the past tensors but get ``attention_mask = 0`` (their
      attention weight is exactly zero) and later tokens take their positions through ``position_ids``; no
      copy per rejection. The cache is compacted (one copy) once masked slots exceed a quarter of it. Logits
      differ from a gap-free cache only in float rounding, like verifying several tokens per call does
      (measured on SmolLM2: 3e-5 vs 2e-5 max abs logit difference).
    * ``"copy"``: slice the past tensors to the kept length at once (a copy of the whole cache per rejected round).
      Needs a model without ``attention_mask`` input too.

    With ``io_binding=True`` the past tensors stay ORT values bound by ``IOBinding`` between calls instead
    of numpy arrays passed to ``run``; both give the same numbers (``tools/bench_speculative.py --io-binding``
    measures which is faster). On the CUDA EP the bound past/present tensors live in GPU memory (only the
    logits come back to the host), so the cache is not copied across PCIe on every step.
    """

    def __init__(self, session, spec: DecoderSpec, *, role: str = "target", timer: SessionTimer | None = None,
                 io_binding: bool = False, rollback: str = "mask") -> None:
        self.session = session
        self.spec = spec
        self.role = role
        self.timer = timer or SessionTimer()
        self.io_binding = bool(io_binding)
        providers = session.get_providers() if hasattr(session, "get_providers") else []
        self.kv_device = "cuda" if providers and providers[0] == "CUDAExecutionProvider" else "cpu"
        names = {i.name for i in session.get_inputs()}
        outs = {o.name for o in session.get_outputs()}
        missing = [n for n in [spec.input_ids, *(e.past for e in spec.kv)] if n not in names]
        missing += [n for n in [spec.logits, *(e.present for e in spec.kv)] if n not in outs]
        if missing:
            raise PlanError(
                f"the {role} model of the plan lacks {missing[:4]}{'…' if len(missing) > 4 else ''} named in the plan; "
                "the plan and its ONNX files disagree — recompile"
            )
        self.mask_name = spec.attention_mask if spec.attention_mask in names else None
        self.pos_name = spec.position_ids if spec.position_ids in names else None
        self.output_names = [spec.logits, *(e.present for e in spec.kv)]
        self.dtype = _NP_DTYPES.get(spec.kv_dtype, np.float32)
        if rollback not in ("mask", "copy"):
            raise PlanError(f"rollback must be 'mask' or 'copy', not {rollback!r}")
        self.rollback = rollback if self.mask_name and self.pos_name else "copy"
        self._mask = np.ones((1, 1024), np.int64)  # validity of each physical cache slot, then ones
        self._arange = np.arange(1024, dtype=np.int64)[None]
        self.past: list[Any] = []
        self.length = 0  # tokens of the sequence held in the cache
        self.slots = 0  # physical positions of the past tensors (>= length when some are masked)
        self.compactions = 0
        self.reset()

    # --- cache -----------------------------------------------------------------------------------
    def _empty(self, e: KVEntry) -> np.ndarray:
        dims = list(e.shape)
        dims.insert(e.axis - 1, 0)
        return np.zeros([1, *dims], self.dtype)

    def reset(self) -> None:
        self.past = [self._empty(e) for e in self.spec.kv]
        if self.io_binding:
            self.past = [self._ortvalue(a) for a in self.past]
        self.length = self.slots = 0
        self._mask[:] = 1

    def _ortvalue(self, a: np.ndarray):
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy(a, self.kv_device, 0)

    def _arrays(self) -> list[np.ndarray]:
        return [v.numpy() for v in self.past] if self.io_binding else list(self.past)

    def _set_arrays(self, arrays: list[np.ndarray]) -> None:
        self.past = [self._ortvalue(a) for a in arrays] if self.io_binding else arrays

    def _keep(self, keep) -> None:
        """Keep the physical slots ``keep`` (a slice or an index array) of every past tensor (one copy)."""
        out = []
        for a, e in zip(self._arrays(), self.spec.kv):
            idx = [slice(None)] * a.ndim
            idx[e.axis] = keep
            out.append(np.ascontiguousarray(a[tuple(idx)]))
        self._set_arrays(out)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens of the sequence in the cache (no-op when it holds no more)."""
        drop = self.length - length
        if drop <= 0:
            return
        if self.rollback == "copy" and self.slots == self.length:
            self._keep(slice(0, length))
            self.slots = self.length = length
            return
        # mask the newest ``drop`` valid slots (they are the last ones written)
        valid = np.flatnonzero(self._mask[0, : self.slots])
        self._mask[0, valid[-drop:]] = 0
        self.length = length
        garbage = self.slots - self.length
        if self.rollback == "copy" or garbage > max(32, self.slots // 4):
            self.compact()

    def compact(self) -> None:
        """Drop masked slots from the past tensors (one copy)."""
        if self.slots == self.length:
            return
        keep = np.flatnonzero(self._mask[0, : self.slots])
        self._keep(keep)
        self.slots = self.length = len(keep)
        self._mask[0, : self.slots] = 1
        self._mask[0, self.slots :] = 1
        self.compactions += 1

    def adopt(self, other: KVDecoder, indices: Sequence[int]) -> None:
        """Use ``other``'s past tensors ``indices`` (aligned with this decoder's kv entries) and its slot mask."""
        self.past = [other.past[j] for j in indices]
        self.length, self.slots = other.length, other.slots
        self._grow(self.slots + 1)
        self._mask[0, : self.slots] = other._mask[0, : self.slots]
        self._mask[0, self.slots :] = 1

    # --- running ---------------------------------------------------------------------------------
    def _grow(self, total: int) -> None:
        if total > self._mask.shape[1]:
            size = max(2 * total, 2048)
            mask = np.ones((1, size), np.int64)
            mask[0, : self.slots] = self._mask[0, : self.slots]
            self._mask = mask
            self._arange = np.arange(size, dtype=np.int64)[None]

    def _aux(self, n: int) -> dict[str, np.ndarray]:
        total = self.slots + n
        self._grow(total)
        feeds = {}
        if self.mask_name:
            feeds[self.mask_name] = self._mask[:, :total]
        if self.pos_name:
            feeds[self.pos_name] = self._arange[:, self.length : self.length + n]
        return feeds

    def forward(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Logits ``[len(ids), vocab]`` of the new tokens; the cache grows by ``len(ids)``."""
        ids_arr = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        n = ids_arr.shape[1]
        if self.io_binding:
            io = self.session.io_binding()
            io.bind_cpu_input(self.spec.input_ids, ids_arr)
            for k, v in self._aux(n).items():
                io.bind_cpu_input(k, np.ascontiguousarray(v))
            for e, v in zip(self.spec.kv, self.past):
                io.bind_ortvalue_input(e.past, v)
            io.bind_output(self.output_names[0], "cpu")
            for name in self.output_names[1:]:
                io.bind_output(name, self.kv_device)
            t0 = time.perf_counter()
            self.session.run_with_iobinding(io)
            self.timer.add(self.role, time.perf_counter() - t0)
            outs = io.get_outputs()
            logits = outs[0].numpy()[0]
            self.past = list(outs[1:])
        else:
            feeds = {self.spec.input_ids: ids_arr, **self._aux(n)}
            for e, a in zip(self.spec.kv, self.past):
                feeds[e.past] = a
            t0 = time.perf_counter()
            outs = self.session.run(self.output_names, feeds)
            self.timer.add(self.role, time.perf_counter() - t0)
            logits = outs[0][0]
            self.past = outs[1:]
        self.length += n
        self.slots += n
        return logits


# ------------------------------------------------------------------------------------------- sampling


def probs_from_logits(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Softmax of ``logits / temperature`` in float64 (rows sum to 1)."""
    z = np.asarray(logits, dtype=np.float64) / float(temperature)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def sample_from(p: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn from the (possibly unnormalised, non-negative) weights ``p``."""
    c = np.cumsum(p)
    total = c[-1]
    if not total > 0:
        raise ValueError("cannot sample from an all-zero distribution")
    i = int(np.searchsorted(c, rng.random() * total, side="right"))
    return min(i, len(p) - 1)


# ------------------------------------------------------------------------------------------- results


@dataclasses.dataclass
class GenerationStats:
    """What one ``generate`` call did. Times in seconds; ``overhead`` is time outside ORT ``run`` calls."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    target_calls: int = 0
    target_seconds: float = 0.0
    drafter_calls: int = 0
    drafter_seconds: float = 0.0
    rounds: int = 0  # decode rounds after the prefill (one target call each)
    drafted: int = 0
    accepted: int = 0
    stop_reason: str = ""
    draft_lengths: dict[int, int] = dataclasses.field(default_factory=dict)
    mode: str = "greedy"
    drafter: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_target_call(self) -> float:
        """New tokens per target call (the prefill's call counts: it yields the first token)."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def mean_accepted_per_round(self) -> float | None:
        """Accepted draft tokens per verification round (each round adds one more, target-chosen, token)."""
        return self.accepted / self.rounds if self.rounds and self.drafter else None

    @property
    def overhead_seconds(self) -> float:
        return max(0.0, self.seconds - self.target_seconds - self.drafter_seconds)

    @property
    def overhead_ms_per_round(self) -> float:
        """The runtime's own time per decode round (Python, slicing, sampling), outside ORT."""
        return 1e3 * self.overhead_seconds / max(1, self.rounds + 1)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["draft_lengths"] = {str(k): v for k, v in sorted(self.draft_lengths.items())}
        for k in ("tokens_per_s", "acceptance_rate", "tokens_per_target_call", "mean_accepted_per_round",
                  "overhead_seconds", "overhead_ms_per_round"):
            v = getattr(self, k)
            d[k] = None if v is None else round(float(v), 4)
        for k in ("seconds", "prefill_seconds", "target_seconds", "drafter_seconds"):
            d[k] = round(d[k], 5)
        return d


@dataclasses.dataclass
class GenerationResult:
    text: str | None
    token_ids: list[int]
    prompt_ids: list[int]
    stats: GenerationStats

    def __repr__(self) -> str:
        s = self.stats
        acc = f", acceptance={s.acceptance_rate:.2f}" if s.acceptance_rate is not None else ""
        return (
            f"GenerationResult({len(self.token_ids)} tokens, {s.tokens_per_s:.1f} tok/s, "
            f"{s.tokens_per_target_call:.2f} tokens/target call{acc}, stop={s.stop_reason!r})"
        )


# ------------------------------------------------------------------------------------------- arguments


def check_generation_args(max_new_tokens: Any, sample: bool, temperature: Any) -> tuple[int, float]:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer):
        raise PromptError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if max_new_tokens <= 0:
        raise PromptError(
            f"max_new_tokens must be >= 1, got {max_new_tokens}: ask for at least one new token "
            "(e.g. --max-new-tokens 128)"
        )
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise PromptError(f"temperature must be a number, got {temperature!r}") from None
    if sample and not (t > 0 and np.isfinite(t)):
        raise PromptError(
            f"temperature must be > 0 for sampling, got {temperature!r}; for greedy decoding leave out --sample"
        )
    return int(max_new_tokens), t


def render_chat(template: str | None, prompt: str) -> str:
    if not template:
        raise PromptError("this plan has no chat template (the model config had none); call without chat=True")
    try:
        import jinja2
    except ImportError:  # pragma: no cover - jinja2 comes with torch/transformers
        raise PromptError("chat=True needs jinja2 (pip install jinja2)") from None
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True)


class TextCodec:
    """The plan's tokenizer for generation: no truncation, no padding, the model's own special tokens."""

    def __init__(self, path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def prompt_ids_of(prompt: Any, codec: TextCodec | None, gen: GenerationConfig, *, chat: bool = False) -> list[int]:
    """Token ids of ``prompt`` (text, or a sequence of ids), with a clear error for an empty prompt."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError(
                "empty prompt: give some text to continue (e.g. --prompt 'def fibonacci(n):') or a list of token ids"
            )
        if codec is None:
            raise PromptError("this plan has no tokenizer: pass the prompt as a list of token ids")
        text = render_chat(gen.chat_template, prompt) if chat else prompt
        ids = codec.encode(text)
    else:
        try:
            ids = [int(i) for i in np.asarray(prompt, dtype=np.int64).reshape(-1)]
        except (TypeError, ValueError):
            raise PromptError(f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}") from None
    if not ids:
        raise PromptError("empty prompt: it encodes to no tokens; give at least one token")
    return ids


# ------------------------------------------------------------------------------------------- target-only loop


def decode_target_only(
    target: KVDecoder,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    eos: Sequence[int],
    max_length: int | None,
    sample: bool,
    temperature: float,
    rng: np.random.Generator,
    stats: GenerationStats,
) -> list[int]:
    """Plain autoregressive decoding with the target alone (the reference speculative decoding must match)."""
    target.reset()
    eos_set = set(eos)
    budget = max_new_tokens if max_length is None else min(max_new_tokens, max_length - len(prompt_ids))
    out: list[int] = []
    t0 = time.perf_counter()
    logits = target.forward(prompt_ids)[-1]
    stats.prefill_seconds = time.perf_counter() - t0
    stats.target_calls += 1
    while True:
        if sample:
            tok = sample_from(probs_from_logits(logits, temperature), rng)
        else:
            tok = int(np.argmax(logits))
        out.append(tok)
        if tok in eos_set:
            stats.stop_reason = "eos"
            break
        if len(out) >= budget:
            stats.stop_reason = "max_new_tokens" if len(out) >= max_new_tokens else "max_length"
            break
        logits = target.forward([tok])[-1]
        stats.target_calls += 1
        stats.rounds += 1
    return out


def plan_decoder_session(ctx, spec: DecoderSpec):
    return ctx.session(spec.model)


@register_step("generate")
class GenerateStep(StepHandler):
    """Autoregressive generation with the plan's decoder alone (target-only plans).

    Params: ``target`` (decoder spec), ``generation`` (eos ids, max length, chat template).
    ``run(state)`` (``CompiledModel.run_feeds``) runs one forward pass on the given arrays.
    """

    def __init__(self, step, ctx) -> None:
        super().__init__(step, ctx)
        self.target_spec = DecoderSpec.from_params(step.params.get("target") or {}, "target")
        self.gen = GenerationConfig.from_params(step.params.get("generation"))
        self.timer = SessionTimer()
        self.target = KVDecoder(plan_decoder_session(ctx, self.target_spec), self.target_spec, timer=self.timer,
                                io_binding=bool(step.params.get("io_binding", False)),
                                rollback=step.params.get("rollback", "mask"))

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        sess = self.target.session
        names = [i.name for i in sess.get_inputs()]
        outs = [o.name for o in sess.get_outputs()]
        missing = [n for n in names if n not in state]
        if missing:
            raise DataError(f"run_feeds on a decoder needs {missing[:3]}…; for text use generate()")
        for name, val in zip(outs, sess.run(outs, {n: state[n] for n in names})):
            state[name] = np.asarray(val)
        return state

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, *, sample: bool, temperature: float,
                     rng: np.random.Generator, speculative: bool = True, **options) -> tuple[list[int], GenerationStats]:
        del speculative  # target-only
        io_binding = options.pop("io_binding", None)
        self.target.io_binding = bool(self.step.params.get("io_binding", False) if io_binding is None else io_binding)
        options.pop("rollback", None)  # nothing is ever rolled back without drafts
        if options:
            raise PromptError(f"unknown generation options for a target-only plan: {sorted(options)}")
        stats = GenerationStats(prompt_tokens=len(prompt_ids), mode="sample" if sample else "greedy")
        self.timer.reset()
        t0 = time.perf_counter()
        out = decode_target_only(self.target, prompt_ids, max_new_tokens, eos=self.gen.eos_token_ids,
                                 max_length=self.gen.max_length, sample=sample, temperature=temperature, rng=rng,
                                 stats=stats)
        stats.seconds = time.perf_counter() - t0
        stats.new_tokens = len(out)
        stats.target_seconds = self.timer.seconds.get("target", 0.0)
        return out, stats


def _generation_handler(compiled):
    for h in reversed(compiled.handlers):
        if hasattr(h, "generate_ids"):
            return h
    raise DataError(
        f"this plan (task {compiled.plan.task!r}, steps {[s.kind for s in compiled.plan.steps]}) does not generate "
        "text; compile a decoder with KV cache (e.g. --passes verify,cleanup or --passes speculative --drafter ...)"
    )


def generate(
    compiled,
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int = 128,
    sample: bool = False,
    temperature: float = 1.0,
    seed: int | None = None,
    chat: bool = False,
    speculative: bool = True,
    **options,
) -> GenerationResult:
    """Generate a continuation of ``prompt`` with a compiled decoder plan (see ``CompiledModel.generate``).

    Args:
        compiled: a loaded plan (``dyncompile.load``) with a ``generate`` or ``speculative_generate`` step.
        prompt: text (encoded with the plan's tokenizer) or a sequence of token ids.
        max_new_tokens: stop after this many new tokens (>= 1); also stops at an eos token and at the
            model's maximum length.
        sample: sample (exact speculative sampling) instead of greedy decoding.
        temperature: softmax temperature for sampling (> 0).
        seed: seed of the sampling RNG.
        chat: wrap the prompt in the model's chat template (a user turn + the assistant prefix).
        speculative: ``False`` runs the plan's target alone (the reference), in the same sessions.
        **options: speculative runtime options, e.g. ``draft_length=4``, ``adaptive=False``, ``max_draft=8``.
    """
    handler = _generation_handler(compiled)
    max_new_tokens, temperature = check_generation_args(max_new_tokens, sample, temperature)
    codec = getattr(handler, "_codec", None)
    if codec is None and compiled.plan.tokenizer:
        codec = TextCodec(compiled.plan.path_of(compiled.plan.tokenizer["file"]))
        handler._codec = codec
    gen = handler.gen
    ids = prompt_ids_of(prompt, codec, gen, chat=chat)
    if gen.max_length is not None and len(ids) >= gen.max_length:
        raise PromptError(
            f"the prompt has {len(ids)} tokens but the model supports {gen.max_length} positions; shorten it"
        )
    rng = np.random.default_rng(seed)
    out, stats = handler.generate_ids(ids, max_new_tokens, sample=bool(sample), temperature=temperature, rng=rng,
                                      speculative=speculative, **options)
    text = codec.decode(out) if codec is not None else None
    compiled.last_info = {"generation": stats.to_dict()}
    return GenerationResult(text, out, ids, stats)
