"""Autoregressive generation on a plan's decoder (batch 1): the ``generate`` step and the Python API.

A plan for a decoder names its ONNX file(s) and, in the step parameters, everything the runtime needs to
drive them without looking at the graphs again (the runtime never re-derives what the compiler decided):

``decoder`` spec (for the target, and for a model drafter)::

    {"model": "model",                               # plan file key
     "input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
     "logits": "logits",
     "kv": [{"past": "past_key_values.0.key", "present": "present.0.key", "axis": 2,
             "shape": [3, 64]}, ...],                # per-head dims of [batch, heads, past, head_dim]
     "kv_dtype": "float32"}

Optional entries: ``attention_bias``, ``kv_buffer``, ``logits_to_keep`` (written by the passes that add them) and,
for a target only, ``min_rows`` (default 1: calls of fewer tokens are padded to that many rows, the padding
dropped; see :class:`~dyncompile.plan.DecoderSpec`).

``generation`` config: ``eos_token_ids``, ``bos_token_id``, ``max_length`` (positions the model supports),
``chat_template`` (optional).

:class:`~dyncompile.runtime.decode.kv_cache.KVDecoder` keeps one decoder's cache (:mod:`dyncompile.runtime.decode.kv_cache`),
:mod:`dyncompile.runtime.rules.sampling` picks tokens from logits, :class:`~dyncompile.runtime.text.TextCodec`
turns text into ids and back. The ``generate`` step (target-only plans) and the ``speculative_generate`` step
(:mod:`dyncompile.runtime.decode.speculative`) share them. :func:`generate` (``CompiledModel.generate``) is the
Python entry point.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dyncompile.errors import DataError, PlanError
from dyncompile.plan import STEP_SCHEMAS, DecoderSpec, GenerationConfig, KVEntry  # noqa: F401  (schema; re-exported)
from dyncompile.runtime.decode.kv_cache import KVDecoder, SessionTimer
from dyncompile.runtime.registry import (
    StepHandler,
    TaskAPI,
    first_line,
    is_ort_error,
    register_step,
    register_task,
)
from dyncompile.runtime.rules.sampling import probs_from_logits, sample_from
from dyncompile.runtime.text import ChatTemplateError, TextCodec, render_chat

logger = logging.getLogger(__name__)

__all__ = [
    "DecoderSpec",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "GenerateStep",
    "GenerationAPI",
    "KVEntry",
    "PromptError",
    "check_generation_args",
    "decode_target_only",
    "GenerationStream",
    "generate",
    "refuse_sampling_on_screened_logits",
    "generate_stream",
    "prompt_ids_of",
]


class PromptError(DataError):
    """An empty prompt, a bad ``max_new_tokens``/``temperature``, or a prompt longer than the model allows."""




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
        """New tokens per second of generation."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted share of the drafted tokens (None without drafts)."""
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
        """Seconds spent outside the target and drafter sessions."""
        return max(0.0, self.seconds - self.target_seconds - self.drafter_seconds)

    @property
    def overhead_ms_per_round(self) -> float:
        """The runtime's own time per decode round (Python, slicing, sampling), outside ORT."""
        return 1e3 * self.overhead_seconds / max(1, self.rounds + 1)

    def to_dict(self) -> dict[str, Any]:
        """The statistics as a JSON-ready dict, derived rates included."""
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
    """A generation: the text (None without a tokenizer), the new token ids, the prompt ids and the statistics."""

    text: str | None
    token_ids: list[int]
    prompt_ids: list[int]
    stats: GenerationStats

    def __repr__(self) -> str:
        """One line: new tokens, speed and the text's start."""
        s = self.stats
        acc = f", acceptance={s.acceptance_rate:.2f}" if s.acceptance_rate is not None else ""
        return (
            f"GenerationResult({len(self.token_ids)} tokens, {s.tokens_per_s:.1f} tok/s, "
            f"{s.tokens_per_target_call:.2f} tokens/target call{acc}, stop={s.stop_reason!r})"
        )


# ------------------------------------------------------------------------------------------- arguments


def check_generation_args(max_new_tokens: Any, sample: bool, temperature: Any) -> tuple[int, float]:
    """Check ``max_new_tokens`` (an integer >= 1) and ``temperature`` (> 0 when sampling); returns both."""
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


def prompt_ids_of(prompt: Any, codec: TextCodec | None, gen: GenerationConfig, *, chat: bool = False) -> list[int]:
    """Token ids of ``prompt`` (text, or a sequence of ids), with a clear error for an empty prompt."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError(
                "empty prompt: give some text to continue (e.g. --prompt 'def fibonacci(n):') or a list of token ids"
            )
        if codec is None:
            raise PromptError("this plan has no tokenizer: pass the prompt as a list of token ids")
        try:
            text = render_chat(gen.chat_template, prompt) if chat else prompt
        except ChatTemplateError as e:
            raise PromptError(str(e)) from None
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
    stop_when: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Plain autoregressive decoding with the target alone (the reference speculative decoding must match).

    ``stop_when(out)`` (optional) ends the generation after the token that makes it true (stop strings).
    """
    target.reset()
    eos_set = set(eos)
    budget = max_new_tokens if max_length is None else min(max_new_tokens, max_length - len(prompt_ids))
    out: list[int] = []
    t0 = time.perf_counter()
    logits = target.forward(prompt_ids, last=1)[-1]
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
        if stop_when is not None and stop_when(out):
            stats.stop_reason = "stop_sequence"
            break
        if len(out) >= budget:
            stats.stop_reason = "max_new_tokens" if len(out) >= max_new_tokens else "max_length"
            break
        logits = target.forward([tok])[-1]
        stats.target_calls += 1
        stats.rounds += 1
    return out


@register_step("generate")
class GenerateStep(StepHandler):
    """Autoregressive generation with the plan's decoder alone (target-only plans).

    Params: ``target`` (decoder spec), ``generation`` (eos ids, max length, chat template).
    ``run(state)`` (``CompiledModel.run_feeds``) runs one forward pass on the given arrays.
    """

    def __init__(self, step, ctx) -> None:
        """Open the target decoder's session and read the plan's tokenizer."""
        super().__init__(step, ctx)
        # params validated against the plan schema (plan.STEP_SCHEMAS) when the plan loaded
        self.params = step.typed or STEP_SCHEMAS[step.kind](step.params, f"{step.kind} step")
        self.target_spec = self.params.target
        self.gen = self.params.generation
        self.timer = SessionTimer()
        # the KV caches, drafter state and timer belong to this step: one generation at a time (other threads wait)
        self.lock = threading.RLock()
        graph = ctx.graph_session(self.target_spec.model) if ctx.options.cuda_graph else None
        self.target = KVDecoder(graph or ctx.session(self.target_spec.model), self.target_spec, timer=self.timer,
                                io_binding=self.params.io_binding, rollback=self.params.rollback,
                                cuda_graph=graph is not None)
        # the plan's tokenizer for prompts and generated text, read at load from the hash-checked bytes
        self.codec: TextCodec | None = TextCodec.from_plan(ctx.plan)

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        """Run one forward pass of the decoder on the arrays in ``state`` (``run_feeds``)."""
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
        """Decode up to ``max_new_tokens`` after ``prompt_ids`` with the target alone; returns the ids and statistics."""
        del speculative  # target-only
        refuse_sampling_on_screened_logits(self.target_spec, sample)
        stop_when = options.pop("stop_when", None)
        io_binding = options.pop("io_binding", None)
        self.target.io_binding = bool(self.params.io_binding if io_binding is None else io_binding)
        options.pop("rollback", None)  # nothing is ever rolled back without drafts
        self.target.set_kv_buffer(options.pop("kv_buffer", None))
        if options:
            raise PromptError(f"unknown generation options for a target-only plan: {sorted(options)}")
        stats = GenerationStats(prompt_tokens=len(prompt_ids), mode="sample" if sample else "greedy")
        self.timer.reset()
        t0 = time.perf_counter()
        out = decode_target_only(self.target, prompt_ids, max_new_tokens, eos=self.gen.eos_token_ids,
                                 max_length=self.gen.max_length, sample=sample, temperature=temperature, rng=rng,
                                 stats=stats, stop_when=stop_when)
        stats.seconds = time.perf_counter() - t0
        stats.new_tokens = len(out)
        stats.target_seconds = self.timer.seconds.get("target", 0.0)
        return out, stats


def refuse_sampling_on_screened_logits(spec: DecoderSpec, sample: bool) -> None:
    """Sampling needs every logit; a decoder whose logits are exact at the argmax only (``screen-lm-head``) cannot."""
    if sample and spec.logits_exact == "argmax":
        raise PromptError("this plan's LM head is screened (screen-lm-head): each row's argmax is exact but the other "
                          "logits are approximations, so it decodes greedily only; leave out sample=True / --sample, "
                          "or recompile without screen-lm-head to sample")


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
    stop: Sequence[str] | None = None,
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
            Calls from several threads on one loaded plan run one after the other (the step's KV caches).
        stop: stop strings: generation ends once the decoded continuation contains one (the text is not cut;
            a speculative round may run past it by the tokens that round accepted). Needs the plan's tokenizer.
        **options: ``on_tokens=f``: ``f(ids)`` is called with the new tokens so far after each token (target
            alone) or verification round (speculative), not after the last; it returning True ends the generation
            there (stop reason ``stop_sequence``), which streaming uses to cancel. Also speculative runtime options, e.g. ``draft_length=4``, ``adaptive=False``, ``max_draft=8``,
            ``stop_below=0.4`` (a model, EAGLE or Medusa drafter ends its chain after a token it gives less probability),
            ``hybrid=False`` / ``hybrid="prompt-lookup"`` (a hybrid plan drafts with one of its two parts alone).
    """
    handler = _generation_handler(compiled)
    max_new_tokens, temperature = check_generation_args(max_new_tokens, sample, temperature)
    codec = handler.codec
    gen = handler.gen
    ids = prompt_ids_of(prompt, codec, gen, chat=chat)
    if gen.max_length is not None and len(ids) >= gen.max_length:
        raise PromptError(
            f"the prompt has {len(ids)} tokens but the model supports {gen.max_length} positions; shorten it"
        )
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0):
        raise PromptError(f"seed must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(seed)
    if stop:
        if isinstance(stop, str) or not all(isinstance(x, str) and x for x in stop):
            raise PromptError("stop must be a list of non-empty strings")
        if codec is None:
            raise PromptError("stop strings need the plan's tokenizer; this plan has none")
        stops = tuple(stop)
        options["stop_when"] = lambda out: any(x in codec.decode(out) for x in stops)
    on_tokens = options.pop("on_tokens", None)
    if on_tokens is not None:  # a progress hook (streaming): called with the tokens so far, never changes them
        inner = options.get("stop_when")
        options["stop_when"] = lambda out: bool(on_tokens(out)) or bool(inner is not None and inner(out))
    with handler.lock:  # the step's KV caches and drafter serve one generation at a time
        out, stats = handler.generate_ids(ids, max_new_tokens, sample=bool(sample), temperature=temperature, rng=rng,
                                          speculative=speculative, **options)
    if stats.stop_reason == "max_length":
        logger.warning("generation stopped after %d new tokens: the model supports %d positions and the prompt has %d "
                       "tokens (stop reason 'max_length'); give a shorter prompt for a longer continuation",
                       len(out), gen.max_length, len(ids))
    text = codec.decode(out) if codec is not None else None
    compiled.last_info = {"generation": stats.to_dict()}
    return GenerationResult(text, out, ids, stats)


class GenerationStream:
    """One generation's new tokens as they are decoded (``CompiledModel.generate_stream``).

    Iterating gives lists of new token ids, in order; together they are exactly the ``token_ids`` of the
    :class:`GenerationResult` the same call of :func:`generate` returns (the hook that reports them never changes a
    token). The generation runs in a worker thread; :attr:`result` (and :attr:`info`, the worker's ``last_info``)
    are set once the iteration ends. Errors of the call are raised by the iteration. :meth:`close` stops the
    generation after its current token or round.

    Args:
        model: the loaded plan (its ``last_info`` is read in the worker thread).
        run: a function of the progress hook that runs the generation and returns its result.
    """

    def __init__(self, model: Any, run: Callable[[Callable[[list[int]], bool]], GenerationResult]) -> None:
        """Start the generation in a worker thread."""
        self.result: GenerationResult | None = None
        self.info: dict[str, Any] = {}
        self._queue: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self._reported = 0  # tokens the hook has put on the queue (written by the worker only)
        self._rest: list[int] | None = None
        self._finished = False
        self._model = model
        self._thread = threading.Thread(target=self._work, args=(run,), daemon=True, name="dyncompile-stream")
        self._thread.start()

    def _hook(self, out: list[int]) -> bool:
        if len(out) > self._reported:
            self._queue.put(("tokens", list(out[self._reported:])))
            self._reported = len(out)
        return self._cancel.is_set()

    def _work(self, run) -> None:
        try:
            res = run(self._hook)
            self.info = dict(self._model.last_info)
            self._queue.put(("done", res))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer's thread
            self._queue.put(("error", e))

    def __iter__(self) -> GenerationStream:
        """The stream is its own iterator."""
        return self

    def __next__(self) -> list[int]:
        """The next new tokens (at least one); ``StopIteration`` once the generation has ended."""
        while not self._finished:
            kind, value = self._queue.get()
            if kind == "tokens":
                return value
            self._finished = True
            if kind == "error":
                raise value
            self.result = value
            rest = value.token_ids[self._reported:]  # the last token(s): after them no hook runs
            if rest:
                return list(rest)
        raise StopIteration

    def close(self) -> None:
        """Stop the generation after its current token or verification round (a client went away)."""
        self._cancel.set()

    def __enter__(self) -> GenerationStream:
        """Use as a context manager: leaving it closes the stream."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """Close the stream."""
        self.close()


def generate_stream(compiled, prompt: str | Sequence[int], **kwargs: Any) -> GenerationStream:
    """:func:`generate`, streamed: a :class:`GenerationStream` of the new token ids (the same ids, same arguments)."""
    if "on_tokens" in kwargs:
        raise PromptError("generate_stream() reports the tokens itself; leave out on_tokens")
    return GenerationStream(compiled, lambda hook: generate(compiled, prompt, on_tokens=hook, **kwargs))


@register_task("text-generation")
class GenerationAPI(TaskAPI):
    """Decoder plans: :meth:`generate` (``CompiledModel.generate``).

    Args:
        model: the loaded plan.
    """

    def __init__(self, model: Any) -> None:
        """Find the step that takes the raw prompt (routed plans), if any."""
        super().__init__(model)
        # a step fed the raw prompt (routed plans of decoders): it picks the candidate that answers
        self.text_step = next((h for h in model.handlers if getattr(h, "takes_text", False)), None)

    def generate_stream(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationStream:
        """Continue ``prompt``, streamed (see :class:`GenerationStream`); one prompt at a time.

        Routed plans of decoders stream the answering candidate's tokens in one piece once its check has passed
        (the check reads the whole answer); ``stream.info`` names the candidate.
        """
        if isinstance(prompt, list | tuple) and prompt and all(isinstance(p, str) for p in prompt):
            raise PromptError("generate_stream() takes one prompt; call it once per prompt")
        if self.text_step is None:
            return GenerationStream(self.model, lambda hook: self._generate_guarded(prompt, on_tokens=hook, **kwargs))
        return GenerationStream(self.model, lambda hook: self.generate(prompt, **kwargs))

    def _generate_guarded(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        try:
            return generate(self.model, prompt, **kwargs)
        except Exception as e:
            if not is_ort_error(e):
                raise
            raise self._ort_failure(e) from None

    def _ort_failure(self, e: BaseException) -> PlanError:
        """The one clear error for an ONNX Runtime failure while generating (the plan and its files disagree)."""
        return PlanError(
            f"ONNX Runtime failed generating with plan {self.model.plan.directory}: {first_line(e)}; the plan and "
            "its ONNX files disagree — recompile"
        )

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        """Continue ``prompt`` (see :func:`generate` for the keyword arguments); a list of text prompts gives a list.

        Routed plans of decoders: the answering candidate's result; ``model.last_info`` names the candidate
        (and the executable check's verdicts); ``record=`` passes extra input fields to the check.
        """
        if isinstance(prompt, list | tuple) and prompt and all(isinstance(p, str) for p in prompt):
            return [self.generate(p, **kwargs) for p in prompt]  # a list of prompts: one result each, in order
        if self.text_step is None:
            return self._generate_guarded(prompt, **kwargs)
        try:
            k, res, checks = self.text_step.generate(prompt, **kwargs)
        except Exception as e:
            if not is_ort_error(e):
                raise
            raise self._ort_failure(e) from None
        self.model.last_info = {"candidate": self.text_step.names[k], "candidate_index": k, "checks": checks}
        return res
