"""``speculative``: turn a KV-cache decoder into a speculative-decoding plan with a drafter.

Drafters (``--drafter``):

* ``DRAFT.onnx`` — an *external* decoder with the same tokenizer (checked: the ``tokenizer.json`` and
  ``dyncompile-model.json`` beside each model must agree on the vocabulary and special tokens, and the two
  graphs' logits on the vocabulary size) and a KV cache of its own;
* ``prompt-lookup`` — no model: n-gram matches in the prompt and the text so far;
* nothing, after ``split-drafter`` — the drafter that pass built from the target's own first layers.

The target graph is not changed: the pass validates both graphs, records how the runtime drives them
(inputs, logits, KV pairs), the drafter and the draft-length policy under ``dyncompile.speculative`` in the
model's ``metadata_props``, and selects the ``speculative`` plan emitter, which writes the target and the
drafter files and a ``speculative_generate`` step (:mod:`dyncompile.runtime.speculative`). The external
drafter graph travels to the emitter in ``model.meta`` (in memory, never serialised).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import onnx_ir as ir

from dyncompile.errors import PassConfigError
from dyncompile.passes._infra import CompileContext, register_pass

logger = logging.getLogger(__name__)

__all__ = [
    "DRAFTER_META",
    "SPECULATIVE_KEY",
    "DrafterError",
    "SpeculativePass",
    "check_same_tokenizer",
    "decoder_spec",
    "generation_config",
]

SPECULATIVE_KEY = "dyncompile.speculative"
SPECULATIVE_FORMAT = "dyncompile.speculative/v1"
#: ``model.meta`` key of the drafter ``ir.Model`` (external or split), read by the plan emitter
DRAFTER_META = "dyncompile.drafter_model"
PROMPT_LOOKUP = "prompt-lookup"
_KNOWN_INPUTS = ("input_ids", "attention_mask", "position_ids")


class DrafterError(PassConfigError, ir.passes.PreconditionError):
    """A drafter or target unfit for speculative decoding (what, where, how to fix)."""


# ------------------------------------------------------------------------------------------- decoder I/O


def _static(d) -> int | None:
    return d if isinstance(d, int) else None


def decoder_spec(model: ir.Model, file_key: str, *, what: str = "model", where: str = "") -> dict[str, Any]:
    """How the runtime drives ``model``: input names, logits, and its (past, present) KV pairs.

    Raises:
        DrafterError: no ``input_ids`` input, no logits output, no KV cache, an unknown extra input, or
            past tensors whose head dims are not static.
    """
    g = model.graph
    where = f" ({where})" if where else ""
    inputs = {v.name: v for v in g.inputs if not v.is_initializer()}
    if "input_ids" not in inputs:
        raise DrafterError(
            f"the {what}{where} has no 'input_ids' input (inputs: {list(inputs)[:6]}); speculative decoding needs a "
            "causal LM exported from Hugging Face with input_ids / attention_mask / past_key_values"
        )
    # KV pairs: an output computed by Concat(past input, new) — else the optimum/HF naming convention
    pairs: dict[str, tuple[str, int]] = {}
    for out in g.outputs:
        prod = out.producer()
        if prod is None or prod.op_type != "Concat":
            continue
        for v in prod.inputs:
            if v is not None and v.name in inputs and v.shape is not None and len(v.shape) == 4:
                axis = prod.attributes.get_int("axis", 0)
                pairs[v.name] = (out.name, axis % 4)
    out_names = {v.name for v in g.outputs}
    for name, v in inputs.items():
        if name in pairs or v.shape is None or len(v.shape) != 4:
            continue
        for old, new in (("past_key_values.", "present."), ("past_key_values_", "present_"), ("past.", "present.")):
            if name.startswith(old) and name.replace(old, new, 1) in out_names:
                pairs[name] = (name.replace(old, new, 1), 2)
    if not pairs:
        raise DrafterError(
            f"the {what}{where} has no KV cache: no past_key_values inputs paired with present outputs "
            f"(inputs: {list(inputs)[:6]}{'…' if len(inputs) > 6 else ''}). Speculative decoding verifies several "
            "tokens per call on top of a cache; re-export the model with its KV cache (e.g. optimum "
            "--task text-generation-with-past, or `dyncompile models build`)"
        )
    extra = [n for n in inputs if n not in pairs and n not in _KNOWN_INPUTS]
    if extra:
        raise DrafterError(
            f"the {what}{where} has inputs the generation runtime does not know how to feed: {extra[:4]}; "
            f"supported: {', '.join(_KNOWN_INPUTS)} and past key/value tensors"
        )
    logits = next((v for v in g.outputs if v.name == "logits"), None)
    if logits is None:
        cands = [v for v in g.outputs if v.name not in {p for p, _ in pairs.values()} and v.shape is not None
                 and len(v.shape) == 3]
        if len(cands) != 1:
            raise DrafterError(
                f"the {what}{where} has no 'logits' output [batch, seq, vocab] (outputs: {[v.name for v in g.outputs][:5]})"
            )
        logits = cands[0]
    kv = []
    dtype = None
    for name in inputs:  # graph input order
        if name not in pairs:
            continue
        present, axis = pairs[name]
        v = inputs[name]
        dims = [d for i, d in enumerate(v.shape) if i not in (0, axis)]
        if any(_static(d) is None for d in dims):
            raise DrafterError(
                f"the {what}{where}: past tensor {name!r} has shape {list(v.shape)}; its head dims must be static "
                "numbers (e.g. [batch, 3, past, 64])"
            )
        kv.append({"past": name, "present": present, "axis": axis, "shape": [int(d) for d in dims]})
        dtype = v.dtype
    vocab = _static(logits.shape[-1]) if logits.shape is not None else None
    return {
        "model": file_key,
        "input_ids": "input_ids",
        "attention_mask": "attention_mask" if "attention_mask" in inputs else None,
        "position_ids": "position_ids" if "position_ids" in inputs else None,
        "logits": logits.name,
        "kv": kv,
        "kv_dtype": "float16" if dtype == ir.DataType.FLOAT16 else "float32",
        "vocab_size": vocab,
    }


# ------------------------------------------------------------------------------------------- configs


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DrafterError(f"{path} is not valid JSON ({e}); rebuild the model directory") from None


def _as_list(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, list | tuple) else [v])]


def generation_config(model_config: dict[str, Any], model_dir: Path | None = None) -> dict[str, Any]:
    """Stop tokens, BOS, maximum length and chat template of a decoder (model config + HF generation config)."""
    eos = _as_list(model_config.get("eos_token_id"))
    if model_dir is not None:
        hf = _read_json(Path(model_dir) / model_config.get("hf_dir", "hf") / "generation_config.json") or {}
        eos += [e for e in _as_list(hf.get("eos_token_id")) if e not in eos]
    return {
        "eos_token_ids": eos,
        "bos_token_id": model_config.get("bos_token_id"),
        "max_length": model_config.get("max_position_embeddings"),
        "chat_template": model_config.get("chat_template"),
    }


def _tokenizer_facts(directory: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    return _read_json(directory / "tokenizer.json"), _read_json(directory / "dyncompile-model.json")


def _vocab_of(tok: dict[str, Any]) -> dict[str, int]:
    model = tok.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        out = dict(vocab)
    elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
        out = {p[0] if isinstance(p, list) else str(p): i for i, p in enumerate(vocab)}
    else:
        out = {}
    for t in tok.get("added_tokens") or []:
        out[t["content"]] = int(t["id"])
    return out


def check_same_tokenizer(target_dir: Path, drafter_dir: Path, *, target_config: dict[str, Any] | None = None) -> str:
    """Compare the tokenizers beside the target and the drafter; raise :class:`DrafterError` on a mismatch.

    Returns a one-line summary of what was checked ("vocabulary (49152 tokens) and special tokens identical",
    or what could not be checked).
    """
    t_tok, t_cfg = _tokenizer_facts(target_dir)
    d_tok, d_cfg = _tokenizer_facts(drafter_dir)
    t_cfg = target_config or t_cfg
    checked = []
    fix = (
        "a drafter must use exactly the target's tokenizer (same ids for the same text); pick a drafter from the "
        "same model family (e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b), or use --drafter prompt-lookup"
    )
    if t_tok is not None and d_tok is not None:
        tv, dv = _vocab_of(t_tok), _vocab_of(d_tok)
        if len(tv) != len(dv):
            raise DrafterError(
                f"tokenizer mismatch: the target's tokenizer ({target_dir / 'tokenizer.json'}) has {len(tv)} tokens, the "
                f"drafter's ({drafter_dir / 'tokenizer.json'}) {len(dv)}; {fix}"
            )
        if tv != dv:
            diff = sorted((tv[k], k) for k in tv if dv.get(k) != tv[k])[:1] or sorted((dv[k], k) for k in dv if k not in tv)[:1]
            i, piece = diff[0]
            other = next((k for k, j in dv.items() if j == i), None)
            raise DrafterError(
                f"tokenizer mismatch: token {i} is {piece!r} in the target's tokenizer ({target_dir / 'tokenizer.json'}) "
                f"but {other!r} in the drafter's ({drafter_dir / 'tokenizer.json'}); {fix}"
            )
        checked.append(f"vocabulary ({len(tv)} tokens)")
    if t_cfg and d_cfg:
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "bos_token", "eos_token"):
            a, b = t_cfg.get(key), d_cfg.get(key)
            if key != "vocab_size" and (a is None or b is None):
                continue
            if a != b:
                raise DrafterError(
                    f"tokenizer mismatch: {key} is {a!r} for the target ({target_dir / 'dyncompile-model.json'}) but "
                    f"{b!r} for the drafter ({drafter_dir / 'dyncompile-model.json'}); {fix}"
                )
        checked.append("special tokens")
    if not checked:
        msg = (
            f"could not compare tokenizers: no tokenizer.json / dyncompile-model.json beside "
            f"{'the drafter' if (d_tok is None and d_cfg is None) else 'the target'}; only the vocabulary size is checked"
        )
        logger.warning(msg)
        return msg
    return " and ".join(checked) + " identical"


# ------------------------------------------------------------------------------------------- the pass


class SpeculativePass(ir.passes.InPlacePass):
    """Record a speculative-decoding plan for a KV-cache decoder: drafter, KV bookkeeping, draft policy.

    Scope: the main graph's inputs and outputs (read only) and ``metadata_props``; nodes are never touched.

    Invariants: the target graph (nodes, initializers, I/O) is unchanged; only ``dyncompile.speculative``
    and ``dyncompile.emitter`` metadata are set, and an external drafter graph is attached in ``model.meta``.
    Precondition: the target's numerics must not depend on the number of tokens per call (no int8 activation
    quantization: MatMulNBits accuracy_level=4, DynamicQuantizeLinear), or greedy output could not be
    token-identical to the target alone; ``allow_inexact_target=True`` overrides.
    Idempotent: a second run finds the same record and reports ``modified=False``.

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
        max_draft: int = 8,
        adaptive: bool = True,
        max_ngram: int = 3,
        min_ngram: int = 1,
        tokenizer_check: str | None = None,
        measure: bool = True,
        allow_inexact_target: bool = False,
    ) -> None:
        super().__init__()
        self.measure = bool(measure)
        self.allow_inexact_target = bool(allow_inexact_target)
        if isinstance(drafter, str) and drafter != PROMPT_LOOKUP:
            raise DrafterError(f"drafter must be an ir.Model, {PROMPT_LOOKUP!r} or None, not {drafter!r}")
        if not 0 <= int(min_draft) <= int(max_draft) or int(draft_length) < 1:
            raise DrafterError(
                f"draft lengths need 1 <= draft_length and 0 <= min_draft <= max_draft, got draft_length={draft_length}, "
                f"min_draft={min_draft}, max_draft={max_draft}"
            )
        if not 1 <= int(min_ngram) <= int(max_ngram):
            raise DrafterError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.drafter = drafter
        self.drafter_source = drafter_source
        self.generation = dict(generation or {})
        self.draft = {
            "initial": int(draft_length),
            "min": int(min_draft),
            "max": max(int(max_draft), int(draft_length)),
            "adaptive": bool(adaptive),
        }
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.tokenizer_check = tokenizer_check

    def __repr__(self) -> str:
        d = self.drafter
        kind = PROMPT_LOOKUP if d == PROMPT_LOOKUP else ("split" if d is None else f"external:{self.drafter_source}")
        return f"SpeculativePass(drafter={kind!r}, draft={self.draft})"

    def _split(self, model: ir.Model) -> tuple[ir.Model, dict[str, Any]]:
        from dyncompile.passes.speculative.split_drafter import SPLIT_DRAFTER_KEY, SPLIT_DRAFTER_META

        if SPLIT_DRAFTER_KEY not in model.metadata_props:
            raise DrafterError(
                "speculative needs a drafter: give --drafter DRAFT.onnx (a smaller model with the same tokenizer), "
                "--drafter prompt-lookup, or run split-drafter first (--passes split-drafter,speculative --calib TEXT)"
            )
        drafter = model.meta.get(SPLIT_DRAFTER_META)
        if drafter is None:
            raise DrafterError(
                "this model records a split drafter but the drafter graph is not in memory (it never is after saving); "
                "compile from the original model with --passes split-drafter,speculative"
            )
        return drafter, json.loads(model.metadata_props[SPLIT_DRAFTER_KEY])

    def requires(self, model: ir.Model) -> None:
        from dyncompile.passes.speculative.split_drafter import SPLIT_DRAFTER_KEY

        target = decoder_spec(model, "model", what="target model")
        inexact = call_shape_dependent_ops(model)
        if inexact and not self.allow_inexact_target:
            raise DrafterError(
                f"the target's {inexact} quantize activations with scales taken over the whole call, so its logits "
                "depend on how many tokens one call processes (measured on Qwen2.5-Coder-0.5B int4 with int8 compute: "
                "0.2 vs 2e-5 with fp32 compute) and no speculative decoder can be token-identical to its one-token-"
                "at-a-time output. Quantize the target with quantize-int4{accuracy_level=0} (weights int4, fp32 "
                "compute), quantize only the drafter, or pass speculative{allow_inexact_target=true} to accept "
                "near-tie differences"
            )
        if self.drafter is not None and SPLIT_DRAFTER_KEY in model.metadata_props:
            raise DrafterError(
                "two drafters: split-drafter built one from the target and --drafter names another "
                f"({self.drafter_source or self.drafter}); drop one of them"
            )
        if self.drafter == PROMPT_LOOKUP:
            return
        if isinstance(self.drafter, ir.Model):
            spec = decoder_spec(self.drafter, "drafter", what="drafter", where=self.drafter_source or "")
        else:
            drafter, _ = self._split(model)
            spec = decoder_spec(drafter, "drafter", what="split drafter")
        tv, dv = target["vocab_size"], spec["vocab_size"]
        split_vocab = self.drafter is None and model.meta.get("dyncompile.split_drafter.vocab") is not None
        if tv is not None and dv is not None and tv != dv and not split_vocab:
            raise DrafterError(
                f"vocabulary size mismatch: the target's logits have {tv} entries, the drafter's "
                f"({self.drafter_source or 'split drafter'}) {dv}; the drafter must share the target's tokenizer"
            )

    def _record(self, model: ir.Model) -> dict[str, Any]:
        target = decoder_spec(model, "model", what="target model")
        if self.drafter == PROMPT_LOOKUP:
            drafter: dict[str, Any] = {"kind": PROMPT_LOOKUP, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
        elif isinstance(self.drafter, ir.Model):
            drafter = {
                "kind": "model",
                "name": "external",
                "source": self.drafter_source,
                "decoder": decoder_spec(self.drafter, "drafter", what="drafter"),
                "share_kv": None,
                "tokenizer_check": self.tokenizer_check,
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
        draft = dict(self.draft)
        if drafter.get("name") == "split":
            sd = self._split(model)[1]
            draft["alpha0"] = sd.get("acceptance")
            draft["draft_cost"] = sd.get("draft_cost")
            draft["verify_cost"] = sd.get("verify_cost")
        else:
            draft["draft_cost"] = 0.0
            if self.measure:
                draft["verify_cost"], t1 = _measure_target(model, target)
            if isinstance(self.drafter, ir.Model) and self.measure:
                draft["draft_cost"] = round(_measure_step(self.drafter, target) / t1, 4)
                draft["draft_cost_source"] = "measured (drafter step / target step, this machine)"
            elif isinstance(self.drafter, ir.Model):
                from dyncompile.passes.speculative.split_drafter import weight_reads

                draft["draft_cost"] = round(weight_reads(self.drafter) / max(1, weight_reads(model)), 4)
                draft["draft_cost_source"] = "weight bytes"
        return {
            "format": SPECULATIVE_FORMAT,
            "target": target,
            "drafter": drafter,
            "draft": {k: v for k, v in draft.items() if v is not None},
            "generation": self.generation,
        }

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        record = self._record(model)
        text = json.dumps(record, sort_keys=True)
        props = model.metadata_props
        modified = props.get(SPECULATIVE_KEY) != text or props.get("dyncompile.emitter") != "speculative"
        props[SPECULATIVE_KEY] = text
        props["dyncompile.emitter"] = "speculative"
        props["dyncompile.task"] = "text-generation"
        if isinstance(self.drafter, ir.Model):
            model.meta[DRAFTER_META] = self.drafter
        elif self.drafter is None:
            model.meta[DRAFTER_META] = self._split(model)[0]
        else:
            model.meta.pop(DRAFTER_META, None)
        logger.info("speculative: drafter %s, draft policy %s", record["drafter"].get("name", record["drafter"]["kind"]),
                    record["draft"])
        return ir.passes.PassResult(model, modified=modified)

    def ensures(self, model: ir.Model) -> None:
        rec = json.loads(model.metadata_props[SPECULATIVE_KEY])
        if rec["drafter"]["kind"] == "model" and DRAFTER_META not in model.meta:
            raise ir.passes.PostconditionError("the drafter graph did not reach model.meta")


def call_shape_dependent_ops(model: ir.Model) -> str | None:
    """Describe the ops whose numerics depend on the number of rows in a call (None if there are none):
    MatMulNBits with int8 compute (``accuracy_level`` 4) and dynamic int8 quantization of activations."""
    found: dict[str, int] = {}
    for node in model.graph.all_nodes():
        if node.op_type == "MatMulNBits":
            attr = node.attributes.get("accuracy_level")
            if attr is not None and attr.as_int() == 4:
                found["MatMulNBits(accuracy_level=4)"] = found.get("MatMulNBits(accuracy_level=4)", 0) + 1
        elif node.op_type in ("DynamicQuantizeLinear", "DynamicQuantizeMatMul"):
            found[node.op_type] = found.get(node.op_type, 0) + 1
    if not found:
        return None
    return ", ".join(f"{n} {op} nodes" for op, n in found.items())


def _probe_chunk(spec: dict[str, Any]) -> list[int]:
    return [int(i) % max(2, spec.get("vocab_size") or 2) for i in range(1, 129)]


def _measure_target(model: ir.Model, spec: dict[str, Any]) -> tuple[dict[str, float], float]:
    """Verification cost of s tokens relative to one on this machine (the runtime's draft-length model), and
    the seconds of one target decode step."""
    from dyncompile.passes.speculative.split_drafter import (
        _external_dir,
        _session,
        measure_step_times,
        relative_verify_costs,
    )

    sess = _session(model, _external_dir(model))
    times = measure_step_times(sess, spec, _probe_chunk(spec), [1, 2, 4, 9])
    costs = relative_verify_costs(times)
    logger.info("speculative: target step %.1f ms; verification cost by tokens %s", times[1] * 1e3, costs)
    return {str(k): v for k, v in costs.items()}, times[1]


def _measure_step(drafter: ir.Model, target_spec: dict[str, Any]) -> float:
    """Seconds of one drafter decode step on the same probe as the target's."""
    from dyncompile.passes.speculative.split_drafter import _external_dir, _session, measure_step_times

    dspec = decoder_spec(drafter, "drafter", what="drafter")
    sess = _session(drafter, _external_dir(drafter))
    t = measure_step_times(sess, dspec, _probe_chunk(target_spec), [1])[1]
    logger.info("speculative: drafter step %.1f ms", t * 1e3)
    return t


def _load_drafter(path_text: str, target_path: Path | None) -> ir.Model:
    from dyncompile.io import load_input_model

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
        from dyncompile.errors import DyncompileError

        if isinstance(e, DyncompileError):
            raise type(e)(f"drafter: {e}") from None
        raise


@register_pass(
    "speculative",
    help="speculative decoding plan: --drafter DRAFT.onnx | prompt-lookup (or after split-drafter); greedy output "
    "token-identical to the target, sampling exact",
    after=("split-drafter",),
)
def _make_speculative(context: CompileContext, draft_length: int = 4, min_draft: int = 0, max_draft: int = 8,
                      adaptive: bool = True, max_ngram: int = 3, min_ngram: int = 1, measure: bool = True,
                      allow_inexact_target: bool = False):
    opt = context.options.get("drafter")
    target_dir = context.model_path.parent if context.model_path else None
    gen = generation_config(context.model_config, target_dir)
    drafter: str | ir.Model | None = None
    check = None
    source = None
    if opt in (None, ""):
        drafter = None  # split-drafter's, checked when the pass runs
    elif str(opt) == PROMPT_LOOKUP:
        drafter = PROMPT_LOOKUP
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
        decoder_spec(drafter, "drafter", what="drafter", where=source)  # fail before loading the target
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
    )
