"""Recipe ``fashion-diffusion``: assemble a diffusers-style ONNX text-to-image pipeline folder.

From ``shared/assets/fashion-diffusion`` (pixel-space U-Net, DDIM scheduler config) and
``shared/assets/minilm-l6-sentiment`` (the text encoder named by the asset's ``model_index.json``), per
the asset README's text-encoding recipe: the **BERT backbone** (``BertModel``, fp16 weights upcast to
fp32, eval mode; the classifier head and the pooler unused) exported to ONNX with output
``last_hidden_state`` [batch, 12, 384], and the tokenizer saved with truncation *and padding* to exactly
12 tokens. The cache folder then looks like an exported Stable Diffusion pipeline::

    model_index.json                 parts + the sampling conventions (null prompt, guidance, crop)
    text_encoder/model.onnx          input_ids, attention_mask, token_type_ids -> last_hidden_state
    tokenizer/tokenizer.json         BertTokenizerFast, max_length 12, padding max_length
    unet/model.onnx, unet/config.json
    scheduler/scheduler_config.json  DDIMScheduler (trailing spacing, clip_sample false)
    dyncompile-model.json            provenance and checks (written last)
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from dyncompile.models._core import RecipeError, Steps, require_asset, sha256_file, write_json_atomic
from dyncompile.models._export import EXPORT_TOOL, OPSET, export_onnx, onnx_io, ort_session, versions

logger = logging.getLogger("dyncompile.models")

ASSET = "fashion-diffusion"
ASSET_FILES = ("model_index.json", "unet/model.onnx", "unet/config.json", "scheduler/scheduler_config.json")
TEXT_ASSET = "minilm-l6-sentiment"
TEXT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
MAX_TOKENS = 12
HIDDEN_TOLERANCE = 1e-4
STEPS = (
    "locate assets",
    "load BERT backbone (fp32)",
    "export text encoder (dynamo)",
    "write + verify tokenizer.json",
    "check text encoder: ONNX Runtime vs PyTorch",
    "copy U-Net + scheduler, write model_index.json",
)
CHECK_PROMPTS = ["", "a dark patterned pullover", "photo of a small plain sandal", "ankle boot: dark, plain",
                 "light coloured bag with a pattern", "an image of trousers"]


def _tokenizer_json(hf_tokenizer, dest: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    tok.no_truncation()
    tok.no_padding()
    tok.enable_truncation(max_length=MAX_TOKENS)
    tok.enable_padding(pad_id=hf_tokenizer.pad_token_id, pad_token=hf_tokenizer.pad_token, length=MAX_TOKENS)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest))


def _verify_tokenizer(hf_tokenizer, path: Path, texts: list[str]) -> dict[str, Any]:
    from tokenizers import Tokenizer

    fast = Tokenizer.from_file(str(path))
    ref = hf_tokenizer(texts, max_length=MAX_TOKENS, padding="max_length", truncation=True)
    for i, (text, enc) in enumerate(zip(texts, fast.encode_batch(texts))):
        got = {"input_ids": enc.ids, "attention_mask": enc.attention_mask, "token_type_ids": enc.type_ids}
        for f in got:
            if list(ref[f][i]) != list(got[f]):
                raise RecipeError(f"tokenizer.json disagrees with the transformers tokenizer on {text!r} field {f}")
    return {"texts": len(texts), "max_length": MAX_TOKENS, "padding": "max_length", "identical": True}


def build_fashion_diffusion(*, name: str, work: Path, assets_dir, downloads: Path, steps: Steps) -> dict[str, Any]:
    steps.start("locate assets")
    asset = require_asset(assets_dir, ASSET, ASSET_FILES)
    text_asset = require_asset(assets_dir, TEXT_ASSET, TEXT_FILES)
    src_index = json.loads((asset / "model_index.json").read_text())
    sched_cfg = json.loads((asset / "scheduler" / "scheduler_config.json").read_text())
    if sched_cfg.get("_class_name") != "DDIMScheduler" or sched_cfg.get("clip_sample"):
        raise RecipeError(f"{asset}/scheduler/scheduler_config.json: expected DDIMScheduler with clip_sample false")

    steps.start("load BERT backbone (fp32)")
    import numpy as np
    import torch
    from transformers import AutoTokenizer, BertModel

    hf_tok = AutoTokenizer.from_pretrained(str(text_asset))
    bert = BertModel.from_pretrained(str(text_asset), dtype=torch.float32).eval()

    class Backbone(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state

    steps.start("export text encoder (dynamo)")
    names = ("input_ids", "attention_mask", "token_type_ids")
    ex = hf_tok(CHECK_PROMPTS[:2], max_length=MAX_TOKENS, padding="max_length", truncation=True, return_tensors="pt")
    batch = torch.export.Dim("batch")
    seq = torch.export.Dim("seq")
    te_path = work / "text_encoder" / "model.onnx"
    info = export_onnx(
        Backbone(bert).eval(),
        tuple(ex[n] for n in names),
        input_names=names,
        output_names=["last_hidden_state"],
        dynamic_shapes={n: {0: batch, 1: seq} for n in names},
        out_path=te_path,
        strip_prefix="model.",
    )

    steps.start("write + verify tokenizer.json")
    tok_path = work / "tokenizer" / "tokenizer.json"
    _tokenizer_json(hf_tok, tok_path)
    tok_check = _verify_tokenizer(hf_tok, tok_path, CHECK_PROMPTS)

    steps.start("check text encoder: ONNX Runtime vs PyTorch")
    enc = hf_tok(CHECK_PROMPTS, max_length=MAX_TOKENS, padding="max_length", truncation=True, return_tensors="np")
    feed = {n: enc[n].astype(np.int64) for n in names}
    with torch.no_grad():
        ref = bert(**{k: torch.from_numpy(v) for k, v in feed.items()}).last_hidden_state.numpy()
    got = ort_session(te_path).run(["last_hidden_state"], feed)[0]
    diff = float(np.abs(got - ref).max())
    if got.shape != (len(CHECK_PROMPTS), MAX_TOKENS, 384) or not diff <= HIDDEN_TOLERANCE:
        raise RecipeError(f"text encoder export: shape {got.shape}, max |ORT - torch| {diff:.3g} > {HIDDEN_TOLERANCE}")
    logger.info("text encoder: max |ORT - torch| %.2e on %d prompts", diff, len(CHECK_PROMPTS))

    steps.start("copy U-Net + scheduler, write model_index.json")
    for rel in ("unet/model.onnx", "unet/config.json", "scheduler/scheduler_config.json"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(asset / rel, work / rel)
    index = {
        "_class_name": "FashionDiffusionPipeline",
        "_diffusers_version": src_index.get("_diffusers_version"),
        "text_encoder": ["onnx", "text_encoder/model.onnx"],
        "tokenizer": ["tokenizers", "tokenizer/tokenizer.json"],
        "unet": ["onnx", "unet/model.onnx"],
        "scheduler": ["diffusers", "DDIMScheduler"],
        "vae_decoder": None,
        "dyncompile": {
            "text_encoder_output": "last_hidden_state",
            "tokenizer_max_length": MAX_TOKENS,
            "tokenizer_padding": "max_length",
            "null_prompt": src_index.get("null_prompt", ""),
            "guidance_scale": 3.0,
            "num_inference_steps": 50,
            "sample_shape": [int(src_index.get("in_channels", 1)), int(src_index["sample_size"]), int(src_index["sample_size"])],
            "output_crop": [2, 30, 2, 30],
            "note": "pixel space, no VAE; generated 32x32 images are cropped to the 28x28 Fashion-MNIST frame",
        },
    }
    write_json_atomic(work / "model_index.json", index)
    return {
        "name": name,
        "task": "text-to-image",
        "family": "diffusion",
        "pipeline": True,
        "text_encoder": {
            "source": str(text_asset.resolve()),
            "recipe": "BertModel (backbone of the BertForSequenceClassification folder), fp16 weights upcast to fp32, "
                      "eval; last_hidden_state of all 12 positions, [PAD] included",
            "export": {"tool": EXPORT_TOOL, "opset": OPSET, **versions(), **info, "io": onnx_io(te_path)},
            "max_abs_diff_vs_torch": diff,
            "tolerance": HIDDEN_TOLERANCE,
        },
        "tokenizer": {"file": "tokenizer/tokenizer.json", "check": tok_check},
        "sources": [
            {"package": f"assets:{ASSET}", "file": rel, "sha256": sha256_file(asset / rel)} for rel in ASSET_FILES
        ] + [{"package": f"assets:{TEXT_ASSET}", "file": "model.safetensors", "sha256": sha256_file(text_asset / "model.safetensors")}],
    }
