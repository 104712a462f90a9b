"""What the runtime needs to know about a KV-cache decoder, read from its graph and the files beside it.

* :func:`decoder_spec` — input names, logits, and the (past, present) KV pairs of a decoder graph (the
  ``decoder`` spec of a ``generate`` / ``speculative_generate`` plan step);
* :func:`generation_config` — stop tokens, BOS, maximum length and chat template (model config + the HF
  ``generation_config.json``);
* :func:`check_same_tokenizer` — a drafter must tokenize exactly like its target.

Every refusal is a :class:`DrafterError` naming the model, what is missing and how to fix it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import onnx_ir as ir

from dyncompile.errors import PassConfigError
from dyncompile.passes._keys import LOGITS_EXACT
from dyncompile.passes.causal_attention import is_causal_attention_graph

logger = logging.getLogger(__name__)

__all__ = ["DrafterError", "check_same_tokenizer", "decoder_spec", "generation_config", "is_kv_decoder"]

_KNOWN_INPUTS = ("input_ids", "attention_mask", "position_ids", "attention_bias", "logits_to_keep")


class DrafterError(PassConfigError, ir.passes.PreconditionError):
    """A drafter or target unfit for speculative decoding (what, where, how to fix)."""


# ------------------------------------------------------------------------------------------- decoder I/O


def _static(d) -> int | None:
    return d if isinstance(d, int) else None


def _kv_pairs(g: ir.Graph, inputs: dict[str, ir.Value]) -> dict[str, tuple[str, int]]:
    """``{past input: (present output, concat axis)}``.

    An output computed by ``Concat(past input, new)``, else the optimum / Hugging Face naming convention.
    """
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
    return pairs


def _head_dims(v: ir.Value, axis: int, what: str) -> list[int]:
    """The static dims of a past tensor other than batch and the sequence ``axis``, or a DrafterError."""
    dims = [d for i, d in enumerate(v.shape) if i not in (0, axis)]
    if any(_static(d) is None for d in dims):
        raise DrafterError(
            f"the {what}: past tensor {v.name!r} has shape {list(v.shape)}; its head dims must be static "
            "numbers (e.g. [batch, 3, past, 64])"
        )
    return [int(d) for d in dims]


def decoder_spec(model: ir.Model, file_key: str, *, what: str = "model", where: str = "",
                 extra_inputs: tuple[str, ...] = ()) -> dict[str, Any]:
    """How the runtime drives ``model``: input names, logits, and its (past, present) KV pairs.

    ``extra_inputs``: inputs the caller feeds itself (an EAGLE drafter's features), not refused.

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
    pairs = _kv_pairs(g, inputs)
    if not pairs:
        raise DrafterError(
            f"the {what}{where} has no KV cache: no past_key_values inputs paired with present outputs "
            f"(inputs: {list(inputs)[:6]}{'…' if len(inputs) > 6 else ''}). Speculative decoding verifies several "
            "tokens per call on top of a cache; re-export the model with its KV cache (e.g. optimum "
            "--task text-generation-with-past, or `dyncompile models build`)"
        )
    extra = [n for n in inputs if n not in pairs and n not in _KNOWN_INPUTS and n not in extra_inputs]
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
        kv.append({"past": name, "present": present, "axis": axis, "shape": _head_dims(v, axis, f"{what}{where}")})
        dtype = v.dtype
    vocab = _static(logits.shape[-1]) if logits.shape is not None else None
    causal = is_causal_attention_graph(g)  # causal-attention: the mask sizes the cache, so it stays gap-free
    shared = _kv_shared(g, [inputs[e["past"]] for e in kv], causal)
    return {
        "model": file_key,
        "input_ids": "input_ids",
        "attention_mask": "attention_mask" if "attention_mask" in inputs else None,
        "position_ids": "position_ids" if "position_ids" in inputs else None,
        "logits": logits.name,
        "kv": kv,
        "kv_dtype": "float16" if dtype == ir.DataType.FLOAT16 else "float32",
        "vocab_size": vocab,
        **({"attention_bias": "attention_bias"} if "attention_bias" in inputs else {}),
        **({"kv_buffer": "shared"} if shared else {}),
        **({"attention": "causal"} if causal else {}),
        **({"logits_to_keep": "logits_to_keep"} if "logits_to_keep" in inputs else {}),
        **({"logits_exact": "argmax"} if model.metadata_props.get(LOGITS_EXACT) == "argmax" else {}),
    }


def _kv_shared(graph: ir.Graph, pasts: list[ir.Value], causal: bool) -> bool:
    """Whether the runtime may bind one preallocated buffer as both past and present of every KV tensor.

    True when each past input is read only by ``GroupQueryAttention`` (as its past key / value, which GQA
    writes in place when past and present share memory; nothing else, e.g. a ``Shape`` that sizes the mask,
    sees the buffer's capacity) and every such GQA takes its logical ``past + new`` length from a mask input the
    runtime feeds — the graph's ``attention_bias`` (masked slots stay masked) or, for causal GQA
    (``causal-attention``, ``causal``), the ``attention_mask`` that sizes ``seqlens_k`` — and returns its present
    key / value as graph outputs.
    """
    outputs = set(graph.outputs)
    bias = next((v for v in graph.inputs if v.name == "attention_bias"), None)
    if (bias is None and not causal) or not pasts:
        return False
    for v in pasts:
        uses = list(v.uses())
        if not uses:
            return False
        for node, idx in uses:
            if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft" or idx not in (3, 4):
                return False
            if not causal and (len(node.inputs) < 11 or node.inputs[10] is not bias):
                return False
            if node.outputs[idx - 2] not in outputs:
                return False
    return True


def is_kv_decoder(model: ir.Model) -> bool:
    """Whether :func:`decoder_spec` accepts ``model`` (a decoder the generation runtime can drive)."""
    try:
        decoder_spec(model, "model")
    except Exception:  # noqa: BLE001 - any reason not to be one
        return False
    return True


# ------------------------------------------------------------------------------------------- generation config


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
