"""``dyncompile export-genai PLAN -o FOLDER``: a text-generation plan as an onnxruntime-genai model folder.

For a user who wants to move to onnxruntime-genai (0.18) with the graphs dyncompile compiled: writes
``genai_config.json`` (the decoder's input/output names mapped from the plan's decoder spec, greedy ``search``
settings, and for a speculative plan either the ``model.draft`` decoder of its drafter model or the ``speculative``
n-gram settings of its prompt lookup), copies the ONNX files and their external data (reflinks where the file
system makes them: the export never shares an inode with the plan), and writes
the tokenizer (``tokenizer.json`` from the plan, a minimal ``tokenizer_config.json``). The plan's files are
hash-checked first; nothing in the plan is executed.

What does not carry over (``NOT_CARRIED``; the command prints the ones that apply to the plan it exported):
dyncompile's adaptive draft length (a cost model measured at compile time that can also stop drafting, draft
length 0), the prompt-lookup fallback to shorter n-grams, split/shared-KV drafters and drafters with their own
vocabulary (refused), copy rollback and IOBinding settings, a target's ``min_rows`` padding, and dyncompile's session
settings. Draft trees do not exist in dyncompile's plans, so none are exported.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path
from typing import Any

from dyncompile.errors import DataError, PlanError
from dyncompile.io import clone_or_copy

logger = logging.getLogger(__name__)

__all__ = ["NOT_CARRIED", "export_genai", "genai_config", "main"]

#: genai model types that run any decoder-only graph with the standard KV-cache IO; other families export as llama
GENAI_TYPES = {"llama", "qwen2", "qwen3", "mistral", "phi3", "phi", "gemma", "gemma2", "granite", "olmo", "smollm3"}
#: onnxruntime-genai 0.18's bounds for speculative.max_draft_tokens and ngram_size
GENAI_MAX_K = 16

NOT_CARRIED = {
    "adaptive": "dyncompile's adaptive draft length (cost model measured at compile time, min {min} .. max {max}, "
    "draft length 0 when drafting does not pay) has no onnxruntime-genai equivalent: the folder uses a fixed "
    "max_draft_tokens = {k} (onnxruntime-genai's own adaptive width, speculative.min_adaptive_k, has a floor >= 1 "
    "and a ceiling of 16, and probes by throughput: pass --genai-adaptive-k N to turn it on)",
    "lookup-fallback": "prompt lookup: dyncompile matches the longest suffix of {max_ngram} down to {min_ngram} tokens; "
    "onnxruntime-genai matches exactly ngram_size - 1 = {max_ngram} tokens (no fallback to shorter n-grams), and "
    "proposes up to max_draft_tokens = {k}",
    "rollback": "rollback={rollback} and io_binding={io_binding}: onnxruntime-genai manages its own KV cache",
    "session": "dyncompile's session settings (threads, spinning, optimisation level) are not written; "
    "onnxruntime-genai uses its defaults (set model.decoder.session_options to change them)",
    "trees": "draft trees: dyncompile's plans have none (linear drafts only), so none are exported",
    "timing": "dyncompile's measured verify/draft costs (plan.policy) are dropped",
    "min_rows": "the target's min_rows={min_rows} (dyncompile pads shorter calls so that the target alone and "
    "verification compute every row with the same kernels: its int8-compute logits depend on the rows per call "
    "otherwise) has no onnxruntime-genai equivalent: its one-token steps run as one-row calls, so greedy output "
    "may differ from dyncompile's near ties",
}


def _pattern(names: list[str], what: str) -> str:
    """``past_key_values.%d.key`` from the per-layer names (onnxruntime-genai needs one %d pattern per kind)."""
    if not names:
        raise DataError(f"{what}: no names")
    m = re.fullmatch(r"(.*?)0(\D.*|)", names[0])
    if not m:
        raise DataError(f"{what}: first name {names[0]!r} has no layer index 0; onnxruntime-genai needs names like "
                        "'past_key_values.%d.key'")
    pat = f"{m.group(1)}%d{m.group(2)}"
    for i, n in enumerate(names):
        if n != pat.replace("%d", str(i)):
            raise DataError(
                f"{what}: name {n!r} (layer {i}) does not follow the pattern {pat!r}; onnxruntime-genai addresses the "
                "KV cache by one printf pattern per kind, so this decoder cannot be exported as is")
    return pat


def _decoder_block(spec, *, filename: str, hidden_size: int, num_heads: int | None) -> dict[str, Any]:
    kv = spec.kv
    if len(kv) % 2:
        raise DataError(f"decoder {spec.model!r}: {len(kv)} KV entries; expected (key, value) pairs per layer")
    keys, values = kv[0::2], kv[1::2]
    for e in kv:
        if e.axis != 2 or len(e.shape) != 2:
            raise DataError(f"decoder {spec.model!r}: KV {e.past!r} has sequence axis {e.axis} and head shape "
                            f"{list(e.shape)}; onnxruntime-genai needs [batch, kv_heads, seq, head_dim] (axis 2)")
    kv_heads, head = int(kv[0].shape[0]), int(kv[0].shape[1])
    for name, made_by in ((spec.logits_to_keep, "trim-logits"), (spec.attention_bias, "explicit-attention")):
        if name:
            raise DataError(f"decoder {spec.model!r} has the input {name!r} ({made_by}), which onnxruntime-genai "
                            f"does not feed; export a plan compiled without {made_by}")
    inputs = {"input_ids": spec.input_ids}
    if spec.attention_mask:
        inputs["attention_mask"] = spec.attention_mask
    if spec.position_ids:
        inputs["position_ids"] = spec.position_ids
    inputs["past_key_names"] = _pattern([e.past for e in keys], f"decoder {spec.model!r} past keys")
    inputs["past_value_names"] = _pattern([e.past for e in values], f"decoder {spec.model!r} past values")
    return {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": filename,
        "head_size": head,
        "hidden_size": int(hidden_size),
        "inputs": inputs,
        "outputs": {
            "logits": spec.logits,
            "present_key_names": _pattern([e.present for e in keys], f"decoder {spec.model!r} present keys"),
            "present_value_names": _pattern([e.present for e in values], f"decoder {spec.model!r} present values"),
        },
        # used by onnxruntime-genai only for cross-attention caches; decoder-only KV shapes use num_key_value_heads
        "num_attention_heads": int(num_heads or kv_heads),
        "num_hidden_layers": len(keys),
        "num_key_value_heads": kv_heads,
    }


def genai_config(plan, *, max_draft_tokens: int | None = None, adaptive_k: int | None = None) -> tuple[dict, list[str]]:
    """The ``genai_config.json`` of ``plan`` (a loaded text-generation plan) and the notes on what did not carry."""
    if plan.task != "text-generation" or not plan.steps or plan.steps[0].kind not in ("generate", "speculative_generate"):
        kinds = [s.kind for s in plan.steps]
        raise DataError(f"export-genai needs a text-generation plan (generate / speculative_generate step); "
                        f"{plan.directory} has task {plan.task!r}, steps {kinds}")
    step = plan.steps[0]
    p = step.typed
    mc = (plan.provenance or {}).get("model_config") or {}
    vocab = _vocab_size(plan, p.target.logits)
    hidden = int(mc.get("hidden_size") or 0)
    family = str(mc.get("family") or "llama")
    gen = p.generation
    eos = list(gen.eos_token_ids)
    if not eos:
        raise DataError(f"plan {plan.directory}: no eos_token_ids in the generation settings; onnxruntime-genai needs one")
    bad = [t for t in eos if t >= vocab]
    if bad:
        raise DataError(f"plan {plan.directory}: eos token id(s) {bad} >= the vocabulary size {vocab}; onnxruntime-genai "
                        "requires every eos_token_id inside the vocabulary")
    files = plan.files
    model: dict[str, Any] = {
        "bos_token_id": gen.bos_token_id if gen.bos_token_id is not None else eos[0],
        "context_length": int(gen.max_length or 4096),
        "decoder": _decoder_block(p.target, filename=files[p.target.model].path, hidden_size=hidden,
                                  num_heads=mc.get("num_attention_heads")),
        "eos_token_id": eos if len(eos) > 1 else eos[0],
        "pad_token_id": eos[0],
        "type": family if family in GENAI_TYPES else "llama",
        "vocab_size": vocab,
    }
    notes = [NOT_CARRIED["session"], NOT_CARRIED["trees"]]
    if p.target.min_rows > 1:
        notes.append(NOT_CARRIED["min_rows"].format(min_rows=p.target.min_rows))
    if family not in GENAI_TYPES:
        notes.append(f"model family {family!r} is not an onnxruntime-genai type name; exported as 'llama' (the graph "
                     "carries the architecture; the type only selects the generic decoder-only runner)")
    config: dict[str, Any] = {"model": model, "search": {
        "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
        "max_length": int(gen.max_length or 4096), "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
        "num_return_sequences": 1,
        # dyncompile's decoders concatenate past and new keys (present = past + seq): no shared buffer
        "past_present_share_buffer": False,
        "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0}}
    if step.kind == "speculative_generate":
        d, pol = p.drafter, p.draft
        # 0 is a value, not "the default": only None means the plan's initial draft length
        k = int(max_draft_tokens) if max_draft_tokens is not None else min(max(pol.initial, 1), GENAI_MAX_K)
        if not 1 <= k <= GENAI_MAX_K:
            raise DataError(f"--max-draft-tokens must be 1..{GENAI_MAX_K} (onnxruntime-genai's bounds), got {k}")
        spec: dict[str, Any] = {"max_draft_tokens": k}
        if adaptive_k is not None:
            if not 1 <= adaptive_k <= GENAI_MAX_K:
                raise DataError(f"--genai-adaptive-k must be 1..{GENAI_MAX_K}, got {adaptive_k}")
            spec["min_adaptive_k"] = int(adaptive_k)
        if d.kind == "prompt-lookup":
            n = d.max_ngram + 1
            if not 2 <= n <= GENAI_MAX_K:
                raise DataError(f"prompt lookup max_ngram {d.max_ngram}: onnxruntime-genai's ngram_size = max_ngram + 1 "
                                f"must be 2..{GENAI_MAX_K}")
            spec["ngram_size"] = n
            notes.append(NOT_CARRIED["lookup-fallback"].format(max_ngram=d.max_ngram, min_ngram=d.min_ngram, k=k))
        else:
            if d.kind == "lookahead":
                raise DataError("this plan's drafter is lookahead decoding (a Jacobi window verified as a draft tree); "
                                "onnxruntime-genai verifies draft chains only: not exportable")
            if d.kind == "eagle":
                raise DataError("this plan's drafter is an EAGLE head (it reads the target's features each step); "
                                "onnxruntime-genai's draft model is a standalone decoder: not exportable")
            if d.share_kv is not None:
                raise DataError("this plan's drafter shares the target's KV cache (a split drafter); onnxruntime-genai's "
                                "draft model must be a standalone decoder with its own cache: not exportable")
            if d.vocab is not None:
                raise DataError("this plan's drafter has its own vocabulary (a vocab map); onnxruntime-genai needs the "
                                "draft and the target to share token ids: not exportable")
            model["draft"] = _decoder_block(d.decoder, filename=files[d.decoder.model].path, hidden_size=0,
                                            num_heads=None)
            dvocab = _vocab_size(plan, d.decoder.logits, file_key=d.decoder.model)
            if dvocab not in (None, vocab):
                raise DataError(f"drafter logits width {dvocab} != target {vocab}; onnxruntime-genai needs the same "
                                "static vocabulary dimension")
        if pol.adaptive and not adaptive_k:
            notes.append(NOT_CARRIED["adaptive"].format(min=pol.min, max=pol.max, k=k))
        notes.append(NOT_CARRIED["timing"])
        config["speculative"] = spec
    elif max_draft_tokens is not None or adaptive_k is not None:
        raise DataError("--max-draft-tokens and --genai-adaptive-k apply to speculative plans; this plan generates with "
                        "its target alone — drop them")
    if p.rollback != "mask" or p.io_binding:
        notes.append(NOT_CARRIED["rollback"].format(rollback=p.rollback, io_binding=p.io_binding))
    return config, notes


def _vocab_size(plan, logits: str, file_key: str | None = None) -> int | None:
    """The static last dim of the logits output: from the plan's outputs (target) or the drafter's ONNX (drafter)."""
    if file_key is None:
        for o in plan.outputs or []:
            if o.get("name") == logits and o.get("shape") and isinstance(o["shape"][-1], int):
                return int(o["shape"][-1])
        raise DataError(f"plan {plan.directory}: output {logits!r} has no static vocabulary dimension; "
                        "onnxruntime-genai needs one")
    import onnx

    m = onnx.load(str(plan.path_of(file_key)), load_external_data=False)
    for o in m.graph.output:
        if o.name == logits:
            dims = o.type.tensor_type.shape.dim
            return int(dims[-1].dim_value) if dims and dims[-1].HasField("dim_value") else None
    return None


def _tokenizer_config(plan, gen) -> dict[str, Any]:
    """A minimal tokenizer_config.json for onnxruntime-extensions (bos/eos strings from tokenizer.json's added tokens)."""
    tok = json.loads(plan.contents[plan.tokenizer["file"]]) if plan.tokenizer else {}
    by_id = {t.get("id"): t.get("content") for t in tok.get("added_tokens", [])}
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if gen.eos_token_ids and gen.eos_token_ids[0] in by_id:
        cfg["eos_token"] = by_id[gen.eos_token_ids[0]]
    if gen.bos_token_id is not None and gen.bos_token_id in by_id:
        cfg["bos_token"] = by_id[gen.bos_token_id]
    if gen.chat_template:
        cfg["chat_template"] = gen.chat_template
    return cfg


def _copy(src: Path, dst: Path) -> str:
    """A file of its own (a reflink where the file system makes one, else a full copy): an edit of the exported
    folder never changes the plan's hashed files."""
    clone_or_copy(src, dst)
    return "copy"


def export_genai(plan_dir: str | Path, out_dir: str | Path, *, max_draft_tokens: int | None = None,
                 adaptive_k: int | None = None, force: bool = False) -> tuple[Path, list[str]]:
    """Write the onnxruntime-genai folder of plan ``plan_dir`` into ``out_dir``; returns (folder, notes)."""
    from dyncompile.io import atomic_output_dir
    from dyncompile.plan import load_plan
    from dyncompile.runtime.executor import known_step_kinds

    plan = load_plan(plan_dir, verify_hashes=True, known_step_kinds=known_step_kinds())
    config, notes = genai_config(plan, max_draft_tokens=max_draft_tokens, adaptive_k=adaptive_k)
    p = plan.steps[0].typed
    keys = [p.target.model]
    if getattr(p, "drafter", None) is not None and p.drafter.kind == "model":
        keys.append(p.drafter.decoder.model)
    with atomic_output_dir(out_dir, force=force, protect=(Path(plan_dir),)) as tmp:
        how = set()
        for key in keys:
            entry = plan.files[key]
            names = [entry.path, *(entry.external_data or [])]
            for name in names:
                if "/" in name or "\\" in name or name.startswith("."):
                    raise PlanError(f"plan file {name!r} is not a plain file name; refusing to export it")
                how.add(_copy(plan.directory / name, tmp / name))
        if plan.tokenizer:
            (tmp / "tokenizer.json").write_bytes(plan.contents[plan.tokenizer["file"]])
            (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(plan, p.generation), indent=2))
        (tmp / "genai_config.json").write_text(json.dumps(config, indent=4))
        (tmp / "DYNCOMPILE-EXPORT.txt").write_text(
            f"exported from dyncompile plan {Path(plan_dir).resolve()} for onnxruntime-genai 0.18 "
            f"(ONNX files: {', '.join(sorted(how))})\n\nnot carried over:\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    return Path(out_dir), notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dyncompile export-genai",
        description="Export a text-generation plan (target alone, draft-model or prompt-lookup speculative) as an "
        "onnxruntime-genai model folder: genai_config.json (+ model.draft / speculative), the ONNX files (copied; "
        "reflinked where possible), tokenizer. Prints what does not carry over.",
        epilog="then, in an environment with onnxruntime-genai 0.18: og.Model(FOLDER); greedy output is the plan's",
    )
    p.add_argument("plan", help="plan directory")
    p.add_argument("-o", "--output", required=True, help="folder to write (must not exist unless --force)")
    p.add_argument("--max-draft-tokens", type=int, help="fixed draft width (default: the plan's initial draft length)")
    p.add_argument("--genai-adaptive-k", type=int, help="turn on onnxruntime-genai's adaptive width from N (min_adaptive_k)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    args = p.parse_args(argv)
    out, notes = export_genai(args.plan, args.output, max_draft_tokens=args.max_draft_tokens,
                              adaptive_k=args.genai_adaptive_k, force=args.force)
    print(f"written: {out} (genai_config.json, ONNX files, tokenizer)")
    print("not carried over:")
    for n in notes:
        print(f"  - {n}")
    return 0
