"""Quality checks of built models with ONNX Runtime: classifier accuracy on a labelled JSONL split and
greedy decoding with the KV-cache decoder.

Used by the tests and by benchmarks that need the quality figure next to a speed figure.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from dyncompile.io import read_jsonl
from dyncompile.models._core import ModelArtifacts, RecipeError

logger = logging.getLogger("dyncompile.models")


@dataclasses.dataclass(frozen=True)
class Accuracy:
    accuracy: float
    """fraction correct (0..1)"""
    correct: int
    total: int
    predictions: list[int]

    @property
    def percent(self) -> float:
        return 100.0 * self.accuracy


def read_labelled(path: str | Path) -> tuple[list[str], list[int]]:
    """Texts and integer labels of a JSONL split (fields ``text`` and ``label``)."""
    rows = read_jsonl(path)
    return [r["text"] for r in rows], [int(r["label"]) for r in rows]


def load_tokenizer(art: ModelArtifacts, *, pad_to: int | None = None):
    """``tokenizers.Tokenizer`` of a built model. Classifiers truncate at ``max_length`` (64) and pad to the
    longest in a batch as saved; ``pad_to`` pads to a fixed length instead."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(art.tokenizer_path))
    if pad_to is not None:
        pad_id = art.config.get("pad_token_id") or 0
        pad_token = (art.config.get("tokenizer") or {}).get("pad_token") or tok.id_to_token(pad_id)
        tok.enable_padding(pad_id=pad_id, pad_token=pad_token, length=pad_to)
    return tok


def classifier_logits(
    art: ModelArtifacts,
    texts: list[str],
    *,
    batch_size: int = 32,
    pad_to: int | None = None,
    sort_by_length: bool = True,
    session=None,
):
    """Logits [n, num_labels] (in the order of ``texts``) of a text-classification model on ORT CPU.

    Tokenizes with the model's tokenizer.json (truncation at ``max_length``), pads each batch to its longest
    row (or to ``pad_to``); with ``sort_by_length`` batches are formed from length-sorted texts, which saves
    padding work without changing results (padding is masked).
    """
    import numpy as np

    if art.config.get("task") != "text-classification":
        raise RecipeError(f"{art.name} is a {art.config.get('task')} model, not a classifier")
    if session is None:
        import onnxruntime as ort

        session = ort.InferenceSession(str(art.onnx_path), providers=["CPUExecutionProvider"])
    tok = load_tokenizer(art)
    tok.no_padding()
    pad_id = int(art.config.get("pad_token_id") or 0)
    names = [i.name for i in session.get_inputs()]
    encs = tok.encode_batch(list(texts))
    order = (
        sorted(range(len(encs)), key=lambda k: len(encs[k].ids)) if sort_by_length else list(range(len(encs)))
    )
    logits = [None] * len(encs)
    for i in range(0, len(order), batch_size):
        idx = order[i : i + batch_size]
        width = pad_to or max(len(encs[k].ids) for k in idx)
        arrays = {
            "input_ids": np.full((len(idx), width), pad_id, np.int64),
            "attention_mask": np.zeros((len(idx), width), np.int64),
            "token_type_ids": np.zeros((len(idx), width), np.int64),
        }
        for r, k in enumerate(idx):
            e = encs[k]
            n = len(e.ids)
            arrays["input_ids"][r, :n] = e.ids
            arrays["attention_mask"][r, :n] = e.attention_mask
            arrays["token_type_ids"][r, :n] = e.type_ids
        out = session.run(["logits"], {name: arrays[name] for name in names})[0]
        for r, k in enumerate(idx):
            logits[k] = out[r]
    return np.stack(logits, axis=0)


def classifier_accuracy(
    art: ModelArtifacts,
    split: str | Path,
    *,
    batch_size: int = 32,
    pad_to: int | None = None,
    sort_by_length: bool = True,
    session=None,
) -> Accuracy:
    """Accuracy of a classifier on a labelled JSONL split with ORT CPU."""
    texts, labels = read_labelled(split)
    logits = classifier_logits(
        art, texts, batch_size=batch_size, pad_to=pad_to, sort_by_length=sort_by_length, session=session
    )
    preds = [int(p) for p in logits.argmax(-1)]
    correct = sum(int(p == y) for p, y in zip(preds, labels))
    acc = Accuracy(correct / len(labels), correct, len(labels), preds)
    logger.info(
        "%s accuracy on %s: %.2f %% (%d/%d)", art.name, Path(split).name, acc.percent, correct, len(labels)
    )
    return acc


def greedy_generate(
    art: ModelArtifacts, prompt: str, max_new_tokens: int = 32, *, stop_at_eos: bool = True, session=None
) -> dict[str, Any]:
    """Greedy decoding with the KV-cache decoder on ORT CPU; returns ids and text of the new tokens."""
    from tokenizers import Tokenizer

    from dyncompile.models._decoders import ort_greedy

    if art.config.get("task") != "text-generation":
        raise RecipeError(f"{art.name} is a {art.config.get('task')} model, not a decoder")
    if session is None:
        import onnxruntime as ort

        session = ort.InferenceSession(str(art.onnx_path), providers=["CPUExecutionProvider"])
    tok = Tokenizer.from_file(str(art.tokenizer_path))
    ids = tok.encode(prompt).ids
    cfg = art.config
    new = ort_greedy(
        session,
        ids,
        max_new_tokens,
        num_layers=cfg["num_layers"],
        kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        eos_token_id=cfg.get("eos_token_id") if stop_at_eos else None,
    )
    return {"prompt_ids": ids, "new_ids": new, "text": tok.decode(new, skip_special_tokens=False)}
