"""Diffusers-style pipeline folders as compile inputs, and the ``diffusion`` plan emitter.

``dyncompile PIPELINE_DIR --passes ... -o plan/`` compiles a folder laid out like an exported Stable
Diffusion pipeline::

    model_index.json                 names the parts (diffusers convention)
    text_encoder/model.onnx          token ids -> text states (e.g. ``last_hidden_state``)
    tokenizer/tokenizer.json         HF tokenizers file
    unet/model.onnx                  (sample, timestep, encoder_hidden_states) -> noise prediction
    scheduler/scheduler_config.json  a scheduler the runtime implements (DDIMScheduler)
    vae_decoder/model.onnx           optional (latent diffusion); absent in pixel space

The passes run on the U-Net (the part the loop repeats: ``verify``, ``cleanup``, ``quantize-int8``,
``step-saver``); the emitter copies the other parts into the plan and writes the steps
``diffusion_encode`` -> (``predict_steps``) -> ``diffusion_denoise``. Sampling conventions that
``model_index.json`` does not state for every pipeline (null prompt, guidance scale, tokenizer length,
output crop) come from its ``dyncompile`` block, else from Stable Diffusion's defaults.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import onnx_ir as ir

from dyncompile.errors import DataError, ModelLoadError, PlanError
from dyncompile.passes import _keys
from dyncompile.passes.emit import (
    EmitRequest,
    add_model_files,
    copy_model,
    io_signature,
    register_default_emitter,
    register_emitter,
    save_model,
)
from dyncompile.plan import Plan, Step, file_ref
from dyncompile.runtime.rules.schedulers import make_scheduler

__all__ = ["PipelineFolder", "read_pipeline", "is_pipeline_dir", "pipeline_compile_inputs"]

INDEX = "model_index.json"
SD_DEFAULTS = {
    "text_encoder_output": "last_hidden_state",
    "tokenizer_max_length": 77,
    "tokenizer_padding": "max_length",
    "null_prompt": "",
    "guidance_scale": 7.5,
    "num_inference_steps": 50,
    "output_crop": None,
    "vae_scaling_factor": 0.18215,
}


@dataclasses.dataclass
class PipelineFolder:
    """A diffusers-style pipeline folder: its index and the files of each component."""
    root: Path
    index: dict[str, Any]
    text_encoder: Path
    tokenizer: Path
    unet: Path
    scheduler_config: dict[str, Any]
    vae_decoder: Path | None
    conventions: dict[str, Any]


def is_pipeline_dir(path: str | Path) -> bool:
    """Whether ``path`` is a pipeline folder (a directory with the pipeline index)."""
    return Path(path).is_dir() and (Path(path) / INDEX).is_file()


def _part(root: Path, rel: str, what: str) -> Path:
    p = root / rel
    if not p.is_file():
        raise ModelLoadError(
            f"pipeline folder {root} is missing its {what}: {p} does not exist; export the full pipeline "
            f"(e.g. `dyncompile models build fashion-diffusion`) or copy the part into the folder"
        )
    return p


def read_pipeline(root: str | Path) -> PipelineFolder:
    """Read and check a pipeline folder; every missing or malformed part is one clear error."""
    root = Path(root)
    if not root.is_dir():
        raise ModelLoadError(f"pipeline folder not found: {root}")
    idx_path = root / INDEX
    if not idx_path.is_file():
        raise ModelLoadError(
            f"{root} is a directory without {INDEX}: give an ONNX file, or a diffusers-style pipeline folder"
        )
    try:
        index = json.loads(idx_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{idx_path} is not valid JSON ({e}); re-export the pipeline") from None
    if not isinstance(index, dict):
        raise ModelLoadError(f"{idx_path} must hold a JSON object")
    te = _part(root, "text_encoder/model.onnx", "text encoder")
    tok = _part(root, "tokenizer/tokenizer.json", "tokenizer (a tokenizers file)")
    unet = _part(root, "unet/model.onnx", "U-Net")
    sched_path = _part(root, "scheduler/scheduler_config.json", "scheduler config")
    try:
        sched = json.loads(sched_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{sched_path} is not valid JSON ({e})") from None
    try:
        make_scheduler(sched)
    except PlanError as e:
        raise ModelLoadError(f"{sched_path}: {e}") from None
    vae = root / "vae_decoder" / "model.onnx"
    if index.get("vae_decoder") and not vae.is_file():
        _part(root, "vae_decoder/model.onnx", "VAE decoder (model_index.json names one)")
    conv = dict(SD_DEFAULTS)
    extra = index.get("dyncompile") or {}
    if not isinstance(extra, dict):
        raise ModelLoadError(f"{idx_path}: 'dyncompile' must be an object")
    conv.update({k: v for k, v in extra.items() if k != "note"})
    if "sample_shape" not in conv:
        conv["sample_shape"] = None  # from the U-Net's input shape (emitter)
    return PipelineFolder(root, index, te, tok, unet, sched, vae if vae.is_file() else None, conv)


def pipeline_compile_inputs(root: str | Path, output_dir, options: dict[str, Any]):
    """The compile inputs of a pipeline folder, for :func:`~dyncompile.passes.compiler.compile_model`.

    The U-Net to run the passes on, the default output directory and the options (with ``pipeline_dir``).
    """
    pipe = read_pipeline(root)
    out = Path(output_dir) if output_dir else pipe.root.parent / f"{pipe.root.name}-compiled"
    if out.resolve() == pipe.root.resolve() or pipe.root.resolve() in out.resolve().parents:
        raise DataError(f"output directory {out} is inside the pipeline folder {pipe.root}; choose another -o")
    return pipe.unet, out, {**options, "pipeline_dir": str(pipe.root)}


@register_default_emitter
def _diffusion_rule(model: ir.Model, req: EmitRequest) -> str | None:
    return "diffusion" if req.options.get("pipeline_dir") else None


def _sample_shape(model: ir.Model, conv: dict[str, Any]) -> list[int]:
    if conv.get("sample_shape"):
        return [int(v) for v in conv["sample_shape"]]
    x = model.graph.inputs[0]
    dims = list(x.shape or [])[1:]
    if len(dims) != 3 or not all(isinstance(d, int) for d in dims):
        raise PlanError(
            f"the U-Net's first input {x.name!r} has shape {x.shape}; state the sample shape as "
            "model_index.json -> dyncompile.sample_shape [C, H, W]"
        )
    return dims


def _emit_shallow_unet(model: ir.Model, rec: dict[str, Any], out: Path, files: dict) -> dict[str, Any]:
    """The shallow graph of a ``cache-unet`` cut, cut out of the final U-Net (after every pass), and its plan block."""
    from dyncompile.passes.unet_cache.structure import shallow_model

    deep = rec["deep_output"]
    if deep not in [v.name for v in model.graph.outputs]:
        raise PlanError(f"the U-Net lost the cached feature output {deep!r} after cache-unet; run cache-unet last")
    shallow = shallow_model(model, deep)
    refs = save_model(shallow, out / "unet", "shallow.onnx", "unet_shallow")
    files["unet_shallow"] = dataclasses.replace(refs[0], path="unet/" + refs[0].path,
                                                external_data=["unet/" + e for e in refs[0].external_data])
    for i, r in enumerate(refs[1:]):
        files[f"unet_shallow.data{i or ''}"] = dataclasses.replace(r, path="unet/" + r.path)
    return {"shallow_unet": "unet_shallow", "deep_output": deep, "deep_input": deep, "depth": int(rec["depth"]),
            "interval": int(rec["interval"]), "warmup": int(rec["warmup"]), "final": int(rec.get("final", 0)),
            "refresh_steps": rec.get("refresh_steps"),
            "calibration": rec.get("calibration"), "schedules": rec.get("schedules")}


@register_emitter("diffusion")
def emit_diffusion(model: ir.Model, req: EmitRequest) -> Plan:
    """Text-to-image plan: text encoder + tokenizer copied, U-Net from the passes, the scheduler config inline."""
    pipe = read_pipeline(req.options["pipeline_dir"])
    conv = pipe.conventions
    out = req.out_dir
    files = {}
    (out / "unet").mkdir(parents=True, exist_ok=True)
    refs = save_model(model, out / "unet", "model.onnx", "unet")
    files["unet"] = dataclasses.replace(refs[0], path="unet/" + refs[0].path,
                                        external_data=["unet/" + e for e in refs[0].external_data])
    for i, r in enumerate(refs[1:]):
        files[f"unet.data{i or ''}"] = dataclasses.replace(r, path="unet/" + r.path)
    add_model_files(files, "text_encoder", copy_model(pipe.text_encoder, out, "text_encoder/model.onnx", "text_encoder"))
    shutil.copyfile(pipe.tokenizer, out / "tokenizer.json")
    files["tokenizer"] = file_ref(out, "tokenizer.json", "tokenizer")
    steps = [Step("diffusion_encode", {"text_encoder": "text_encoder", "output": conv["text_encoder_output"],
                                       "null_prompt": conv["null_prompt"]})]
    policy: dict[str, Any] = {"diffusion": {"pipeline": str(pipe.root.resolve()), "scheduler": pipe.scheduler_config["_class_name"],
                                            "guidance_scale": conv["guidance_scale"]}}
    denoise = {
        "unet": "unet",
        "input_names": [v.name for v in model.graph.inputs],
        "scheduler": pipe.scheduler_config,
        "guidance_scale": float(conv["guidance_scale"]),
        "num_inference_steps": int(conv["num_inference_steps"]),
        "sample_shape": _sample_shape(model, conv),
        "output_crop": conv.get("output_crop"),
        "eta": 0.0,
        "noise": "numpy",
        "default_policy": "fixed",
        "stop_rule": None,
    }
    if pipe.vae_decoder is not None:
        add_model_files(files, "vae_decoder", copy_model(pipe.vae_decoder, out, "vae_decoder/model.onnx", "vae_decoder"))
        denoise["vae_decoder"] = {"file": "vae_decoder", "scaling_factor": float(conv["vae_scaling_factor"])}
    cache = model.metadata_props.get(_keys.UNET_CACHE)
    if cache:
        denoise["feature_cache"] = _emit_shallow_unet(model, json.loads(cache), out, files)
        policy["unet_cache"] = {k: v for k, v in json.loads(cache).items() if k not in ("fingerprint", "calibration", "schedules")}
    meta = model.metadata_props.get(_keys.STEP_SAVER)
    if meta:
        ss = json.loads(meta)
        steps.append(Step("predict_steps", ss["head"]))
        denoise["stop_rule"] = ss.get("stop_rule")
        denoise["default_policy"] = ss["default_policy"]
        denoise["num_inference_steps"] = int(ss.get("fixed_steps", denoise["num_inference_steps"]))
        policy["step_saver"] = {k: v for k, v in ss.items() if k != "head"}
    steps.append(Step("diffusion_denoise", denoise))
    inputs, outputs = io_signature(model.graph)
    return Plan(
        task="text-to-image",
        files=files,
        steps=steps,
        inputs=inputs,
        outputs=outputs,
        tokenizer={"file": "tokenizer", "max_length": int(conv["tokenizer_max_length"]), "padding": conv["tokenizer_padding"]},
        labels=None,
        policy=policy,
        provenance=req.provenance,
    )
