"""``dyncompile export-eagle3 HEAD_DIR --target MODEL_DIR -o FOLDER``: an EAGLE-3 head as a reference checkpoint.

EAGLE-3's reference checkpoints (the layout of the EAGLE-3 authors' code, AngelSlim and SpecForge; what vLLM and
SGLang load as ``method="eagle3"`` and what optimum-intel exports for OpenVINO GenAI's ``draft_model``) hold one
``LlamaForCausalLMEagle3`` layer: ``fc`` (3H -> H over the target's low/middle/high features), ``midlayer`` (the
draft layer, its attention 2H wide over ``[input_layernorm(embedding), hidden_norm(feature)]``), ``norm``,
``lm_head`` over a draft vocabulary and ``d2t`` (draft id -> target id offset) / ``t2d`` (target ids in the draft
vocabulary). The embedding is the target's, shared at run time, and not written (as in the published heads).

A head trained with ``dyncompile train-drafter --features fused --layout reference`` is that layer: ``fc`` is its
``fuse``, ``midlayer`` its ``mid``; ``norm`` and ``lm_head`` are the target's final norm and the draft vocabulary's
rows of the target's LM head, which the head uses frozen (read here from the target's Hugging Face checkpoint,
``MODEL_DIR/hf``). A head in dyncompile's default ``fc`` layout (``fc([embedding, feature])`` into a copy of the
target's layer) is refused: no other runtime has that layer, and it is not a re-arrangement of the reference one
(the reference normalises the embedding and the feature separately; ``fc`` mixes them before one norm).

Feature taps: the head reads the Hugging Face ``hidden_states[i]`` for ``i`` in its ``feature_layers`` (the input of
decoder layer ``i``, as vLLM's ``eagle_aux_hidden_state_layer_ids`` counts); ``config.json`` records them there.
OpenVINO GenAI's ``hidden_layers_list`` counts the *output* of layer ``i``, one less (``openvino_layers`` in the
``dyncompile`` record of ``config.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.io import atomic_output_dir
from dyncompile.passes.speculative.eagle_drafter import HEAD_FORMAT_REFERENCE, load_head

logger = logging.getLogger(__name__)

__all__ = ["export_eagle3", "main", "reference_tensors"]

#: the target config fields the draft layer shares (rotary and norm settings included)
_SHARED_CONFIG = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings",
                  "vocab_size", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")


def _target_tensors(hf: Path, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """``names`` from the target's safetensors checkpoint (one file, or shards with an index)."""
    from safetensors import safe_open

    index = hf / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    else:
        where = {n: "model.safetensors" for n in names}
    out: dict[str, np.ndarray] = {}
    for file in sorted({where[n] for n in names if n in where}):  # each file opened once
        with safe_open(str(hf / file), framework="numpy") as f:
            present = set(f.keys())
            for n in names:
                if where.get(n) == file and n in present:
                    out[n] = np.asarray(f.get_tensor(n), np.float32)
    return out


def reference_tensors(arrays: dict[str, np.ndarray], target_hf: Path) -> dict[str, np.ndarray]:
    """The reference checkpoint's tensors for a reference-layout head (``load_head`` arrays) and its target."""
    vocab = np.asarray(arrays["vocab"], np.int64)
    got = _target_tensors(target_hf, ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"))
    if "model.norm.weight" not in got or not ({"lm_head.weight", "model.embed_tokens.weight"} & set(got)):
        raise DataError(f"{target_hf} holds no model.norm.weight and LM head (lm_head.weight, or a tied "
                        "model.embed_tokens.weight): give the target's model directory (`dyncompile models build`)")
    lm = got.get("lm_head.weight", got.get("model.embed_tokens.weight"))
    t = {"fc.weight": np.asarray(arrays["fuse.weight"], np.float32),
         "norm.weight": got["model.norm.weight"],
         "lm_head.weight": np.ascontiguousarray(lm[vocab]),
         "d2t": vocab - np.arange(len(vocab), dtype=np.int64),
         "t2d": np.isin(np.arange(lm.shape[0]), vocab)}
    for k, v in arrays.items():
        if k.startswith("mid."):
            t[f"midlayer.{k[4:]}"] = np.asarray(v, np.float32)
    return t


def export_eagle3(head_dir: str | Path, target_dir: str | Path, out: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of the reference checkpoint to ``out`` (a new folder)."""
    from safetensors.numpy import save_file

    arrays, info, sha = load_head(head_dir)
    if info.get("format") != HEAD_FORMAT_REFERENCE:
        raise DataError(f"{head_dir} is a {info.get('format')} head in dyncompile's fc layout, which no other runtime "
                        "has (module docstring: it is not a re-arrangement of the reference layer); train the head with "
                        "`dyncompile train-drafter --features fused --layout reference` to export it")
    hf = Path(target_dir).expanduser() / "hf"
    cfg_file = hf / "config.json"
    if not cfg_file.is_file():
        raise DataError(f"{cfg_file} not found: --target is the model directory the head was trained for (with hf/)")
    tcfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    tc = info.get("target_config") or {}
    if tcfg.get("hidden_size") != tc.get("hidden_size") or tcfg.get("num_hidden_layers") != tc.get("num_layers"):
        raise DataError(f"the head was trained for a target of hidden size {tc.get('hidden_size')} and "
                        f"{tc.get('num_layers')} layers; {target_dir} has {tcfg.get('hidden_size')} and "
                        f"{tcfg.get('num_hidden_layers')}")
    out = Path(out).expanduser()
    if out.exists():
        raise DataError(f"{out} exists; give a new folder (nothing is overwritten)")
    tensors = reference_tensors(arrays, hf)
    taps = [int(x) for x in info["feature_layers"]]
    cfg: dict[str, Any] = {k: tcfg[k] for k in _SHARED_CONFIG if k in tcfg}
    cfg.update({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "draft_vocab_size": int(len(arrays["vocab"])), "target_hidden_size": int(tcfg["hidden_size"]),
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": taps, "use_aux_hidden_state": True},
        "dyncompile": {"head_format": info["format"], "head_sha256": sha, "target": info.get("target"),
                       "target_model_type": tcfg.get("model_type"), "feature_layers": taps,
                       "openvino_layers": [t - 1 for t in taps], "eval": info.get("eval")},
    })
    cfg.setdefault("head_dim", int(tcfg["hidden_size"]) // int(tcfg["num_attention_heads"]))
    with atomic_output_dir(out, protect=(Path(head_dir).expanduser(), hf)) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    """``dyncompile export-eagle3 HEAD_DIR --target MODEL_DIR -o FOLDER``."""
    p = argparse.ArgumentParser(
        prog="dyncompile export-eagle3",
        description="Write an EAGLE-3 head trained with `train-drafter --features fused --layout reference` as the "
        "reference checkpoint (config.json + model.safetensors, LlamaForCausalLMEagle3) that vLLM, SGLang and "
        "optimum-intel / OpenVINO GenAI load. The target's final norm and LM-head rows come from MODEL_DIR/hf.",
        epilog="then, for OpenVINO GenAI: optimum-cli export openvino -m FOLDER DRAFT_OV --task text-generation-with-past "
        "and openvino_genai.draft_model(DRAFT_OV, 'CPU', hidden_layers_list=<config.json: dyncompile.openvino_layers>)",
    )
    p.add_argument("head", help="head directory (eagle_head.npz + eagle_head.json)")
    p.add_argument("--target", required=True, help="the target's model directory (with hf/), as given to train-drafter")
    p.add_argument("-o", "--out", required=True, help="new folder to write")
    args = p.parse_args(argv)
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise DataError("export-eagle3 needs safetensors: pip install 'dyncompile[train]'") from None
    out = export_eagle3(args.head, args.target, args.out)
    print(f"EAGLE-3 reference checkpoint written to {out}")
    return 0
