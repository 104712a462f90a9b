"""Text-to-image plans: prompt encoding, the step count, the guided denoising loop (step handlers).

A diffusion plan (``task: text-to-image``) runs three or four steps in order:

* ``diffusion_encode`` — tokenises ``[null prompt] + prompts`` with the plan's tokenizer and runs the text
  encoder **once on that batch**; puts the text states (``ctx``, ``null_ctx``) and the masked-mean pooled
  text features (``text_features``) into the state.
* ``predict_steps`` (from the ``step-saver`` pass) — a linear head on the text features predicts
  ``log2(steps)``; the runtime picks each prompt's step count *before* the loop.
* ``diffusion_denoise`` — the classifier-free-guided scheduler loop over the U-Net (one U-Net call per
  step on ``[uncond; cond]``), optionally with the online stop rule, then the optional VAE decoder and
  the conversion to uint8 images.

Which step count a call uses (``step_policy``): ``fixed`` (``num_inference_steps`` of the call or the
plan), ``predicted`` (the ``predict_steps`` head) or ``online`` (the stop rule); the plan's default is in
``diffusion_denoise``'s ``default_policy``. Everything in the plan is data: parameters are validated when
the plan is loaded and nothing in it is executed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError, PlanError
from dyncompile.runtime.diffusion.denoise import Denoiser, StopRule, make_noise, mean_pool, to_uint8
from dyncompile.runtime.registry import StepHandler, register_step
from dyncompile.runtime.rules.schedulers import make_scheduler

logger = logging.getLogger(__name__)

__all__ = ["POLICIES", "DiffusionResult", "generate_images", "save_png", "validate_step_params"]

POLICIES = ("fixed", "predicted", "online")
NOISE_SOURCES = ("numpy", "torch")
MAX_STEPS = 1000


# ------------------------------------------------------------------------------------------ validation


def _num(params: dict, key: str, where: str, *, lo=None, hi=None, integer=False, required=True, default=None):
    if key not in params:
        if required:
            raise PlanError(f"{where}: missing parameter {key!r}; recompile the plan")
        return default
    v = params[key]
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or (not integer and not math.isfinite(v)):
        raise PlanError(f"{where}: {key}={v!r} must be {'an integer' if integer else 'a finite number'}; recompile the plan")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise PlanError(f"{where}: {key}={v!r} is out of range [{lo}, {hi}]; recompile the plan")
    return v


def _floats(params: dict, key: str, where: str, length: int | None = None) -> np.ndarray:
    v = params.get(key)
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise PlanError(f"{where}: {key} must be a list of numbers; recompile the plan")
    a = np.asarray(v, np.float64)
    if not np.all(np.isfinite(a)):
        raise PlanError(f"{where}: {key} holds non-finite numbers; recompile the plan")
    if length is not None and len(a) != length:
        raise PlanError(f"{where}: {key} has {len(a)} values, expected {length}; recompile the plan")
    return a


def _file_key(params: dict, key: str, where: str, plan, role: str | None = None, required: bool = True) -> str | None:
    v = params.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str) or v not in plan.files:
        raise PlanError(f"{where}: {key}={v!r} names no file of the plan (files: {', '.join(plan.files)})")
    if role is not None and plan.files[v].role != role:
        raise PlanError(f"{where}: file {v!r} has role {plan.files[v].role!r}, expected {role!r}")
    return v


def _stop_rule(d: Any, where: str) -> StopRule | None:
    if d is None:
        return None
    if not isinstance(d, dict) or d.get("kind") != "x0_change":
        raise PlanError(f"{where}: stop_rule must be {{'kind': 'x0_change', ...}} or null, got {d!r}")
    max_steps = _num(d, "max_steps", where + " stop_rule", lo=2, hi=MAX_STEPS, integer=True)
    return StopRule(
        threshold=float(_num(d, "threshold", where + " stop_rule", lo=0.0, hi=1.0)),
        max_steps=max_steps,
        min_steps=_num(d, "min_steps", where + " stop_rule", lo=1, hi=max_steps, integer=True, required=False, default=1),
    )


def validate_step_params(kind: str, params: dict[str, Any], plan) -> dict[str, Any]:
    """Check one diffusion step's parameters (types, ranges, file keys); returns the parsed values."""
    where = f"plan step {kind!r}"
    if kind == "diffusion_encode":
        te = _file_key(params, "text_encoder", where, plan)
        null = params.get("null_prompt", "")
        if not isinstance(null, str):
            raise PlanError(f"{where}: null_prompt must be a string")
        out = params.get("output", "last_hidden_state")
        if not isinstance(out, str):
            raise PlanError(f"{where}: output must be an output name")
        if not plan.tokenizer or "file" not in plan.tokenizer:
            raise PlanError(f"{where}: the plan has no tokenizer; recompile the pipeline")
        return {"text_encoder": te, "null_prompt": null, "output": out}
    if kind == "predict_steps":
        w = _floats(params, "weights", where)
        grid = params.get("grid")
        if (not isinstance(grid, list) or not grid or any(not isinstance(g, int) or isinstance(g, bool) for g in grid)
                or sorted(set(grid)) != grid or grid[0] < 1 or grid[-1] > MAX_STEPS):
            raise PlanError(f"{where}: grid must be an increasing list of step counts in [1, {MAX_STEPS}], got {grid!r}")
        feats = params.get("features", "mean_pool")
        if feats != "mean_pool":
            raise PlanError(f"{where}: features={feats!r} is not implemented (mean_pool)")
        return {
            "weights": w,
            "bias": float(_num(params, "bias", where)),
            "mean": _floats(params, "mean", where, len(w)),
            "scale": _floats(params, "scale", where, len(w)),
            "offset": float(_num(params, "offset", where, lo=-10, hi=10)),
            "grid": grid,
        }
    if kind == "diffusion_denoise":
        unet = _file_key(params, "unet", where, plan)
        sched = make_scheduler(params.get("scheduler"))
        shape = params.get("sample_shape")
        if not isinstance(shape, list) or len(shape) != 3 or any(not isinstance(s, int) or s < 1 for s in shape):
            raise PlanError(f"{where}: sample_shape must be [C, H, W] positive integers, got {shape!r}")
        crop = params.get("output_crop")
        if crop is not None and (
            not isinstance(crop, list) or len(crop) != 4 or any(not isinstance(c, int) or c < 0 for c in crop)
            or not (crop[0] < crop[1] <= shape[1] and crop[2] < crop[3] <= shape[2])
        ):
            raise PlanError(f"{where}: output_crop must be [top, bottom, left, right] inside {shape[1:]}, got {crop!r}")
        eta = _num(params, "eta", where, required=False, default=0.0)
        if eta != 0:
            raise PlanError(f"{where}: eta={eta} is not implemented (deterministic DDIM, eta 0)")
        noise = params.get("noise", "numpy")
        if noise not in NOISE_SOURCES:
            raise PlanError(f"{where}: noise={noise!r} must be one of {NOISE_SOURCES}")
        policy = params.get("default_policy", "fixed")
        if policy not in POLICIES:
            raise PlanError(f"{where}: default_policy={policy!r} must be one of {POLICIES}")
        rule = _stop_rule(params.get("stop_rule"), where)
        if policy == "online" and rule is None:
            raise PlanError(f"{where}: default_policy 'online' needs a stop_rule")
        vae = params.get("vae_decoder")
        if vae is not None:
            if not isinstance(vae, dict):
                raise PlanError(f"{where}: vae_decoder must be {{'file': KEY, 'scaling_factor': X}}")
            _file_key(vae, "file", where + " vae_decoder", plan)
            _num(vae, "scaling_factor", where + " vae_decoder", lo=1e-6)
        in_names = params.get("input_names", ["sample", "timestep", "encoder_hidden_states"])
        if not isinstance(in_names, list) or len(in_names) != 3 or not all(isinstance(s, str) for s in in_names):
            raise PlanError(f"{where}: input_names must name the U-Net's sample, timestep and text-state inputs")
        return {
            "unet": unet,
            "scheduler": sched,
            "sample_shape": shape,
            "output_crop": crop,
            "noise": noise,
            "guidance_scale": float(_num(params, "guidance_scale", where, lo=1.0, hi=100.0)),
            "num_inference_steps": _num(params, "num_inference_steps", where, lo=1, hi=MAX_STEPS, integer=True),
            "default_policy": policy,
            "stop_rule": rule,
            "vae_decoder": vae,
            "input_names": in_names,
        }
    raise PlanError(f"{where}: not a diffusion step")


# ------------------------------------------------------------------------------------------ handlers


@register_step("diffusion_encode")
class DiffusionEncodeStep(StepHandler):
    """``[null] + prompts`` through the text encoder in one batch -> ``ctx``, ``null_ctx``, ``text_features``."""

    def __init__(self, step, ctx) -> None:
        super().__init__(step, ctx)
        p = validate_step_params(step.kind, step.params, ctx.plan)
        from dyncompile.runtime.text import TextEncoder

        spec = ctx.plan.tokenizer
        self.tokens = TextEncoder.from_plan(ctx.plan, spec)
        self.session = ctx.session(p["text_encoder"])
        self.feed_names = [i.name for i in self.session.get_inputs()]
        self.output = p["output"]
        self.null_prompt = p["null_prompt"]

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        prompts = state["prompts"]
        feeds = self.tokens([self.null_prompt, *prompts])
        missing = [n for n in self.feed_names if n not in feeds]
        if missing:
            raise PlanError(f"text encoder wants inputs {missing} the tokenizer does not give")
        hidden = self.session.run([self.output], {n: feeds[n] for n in self.feed_names})[0].astype(np.float32)
        state["null_ctx"] = hidden[:1]
        state["ctx"] = hidden[1:]
        state["text_features"] = mean_pool(hidden[1:], feeds["attention_mask"][1:])
        return state


def predict_steps(params: dict[str, Any], features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The step-saver head: ``log2 steps = ((f - mean) / scale) @ w + b + offset``, rounded up onto the grid."""
    z = (features - params["mean"]) / params["scale"]
    log2 = z @ params["weights"] + params["bias"] + params["offset"]
    want = np.exp2(log2)
    grid = np.asarray(params["grid"])
    idx = np.searchsorted(grid, want - 1e-9, side="left")
    return grid[np.minimum(idx, len(grid) - 1)], log2


@register_step("predict_steps")
class PredictStepsStep(StepHandler):
    """Per-prompt step count from the text features (the ``step-saver`` pass's fitted head)."""

    def __init__(self, step, ctx) -> None:
        super().__init__(step, ctx)
        self.p = validate_step_params(step.kind, step.params, ctx.plan)

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        steps, log2 = predict_steps(self.p, state["text_features"])
        state["predicted_steps"] = steps
        state["predicted_log2_steps"] = log2
        return state


@register_step("diffusion_denoise")
class DiffusionDenoiseStep(StepHandler):
    """The guided scheduler loop over the U-Net, then (optionally) the VAE decoder and uint8 images."""

    def __init__(self, step, ctx) -> None:
        super().__init__(step, ctx)
        self.p = p = validate_step_params(step.kind, step.params, ctx.plan)
        self.session = ctx.session(p["unet"])
        names = [i.name for i in self.session.get_inputs()]
        if sorted(names) != sorted(p["input_names"]):
            raise PlanError(f"plan step 'diffusion_denoise': the U-Net's inputs are {names}, the plan says {p['input_names']}")
        self.out_name = self.session.get_outputs()[0].name
        s, t, c = p["input_names"]

        def unet(x, ts, states):
            return self.session.run([self.out_name], {s: x, t: ts, c: states})[0]

        self.denoiser = Denoiser(unet, p["scheduler"], crop=p["output_crop"])
        self.vae = ctx.session(p["vae_decoder"]["file"]) if p["vae_decoder"] else None

    def _policy(self, state) -> str:
        policy = state.get("step_policy") or self.p["default_policy"]
        if policy not in POLICIES:
            raise DataError(f"step policy {policy!r} is not one of {', '.join(POLICIES)}")
        if state.get("num_inference_steps") is not None and state.get("step_policy") is None:
            policy = "fixed"  # an explicit step count wins over the plan's default
        if policy == "predicted" and "predicted_steps" not in state:
            raise DataError("this plan has no step predictor (compile it with --passes step-saver); use fixed steps")
        if policy == "online" and self.p["stop_rule"] is None:
            raise DataError("this plan has no online stop rule (compile it with --passes step-saver); use fixed steps")
        return policy

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        ctx_, null_ctx = state["ctx"], state["null_ctx"]
        n = len(ctx_)
        scale = state.get("guidance_scale")
        scale = self.p["guidance_scale"] if scale is None else scale
        noise = state.get("noise")
        shape = self.p["sample_shape"]
        if noise is None:
            noise = make_noise(state["seeds"], shape, state.get("noise_source") or self.p["noise"])
        elif noise.shape != (n, *shape):
            raise DataError(f"noise has shape {noise.shape}, the plan samples {[n, *shape]}")
        policy = self._policy(state)
        samples = np.empty((n, *shape), np.float32)
        steps = np.zeros(n, np.int64)
        calls0 = self.denoiser.unet_calls
        if policy == "online":
            r = self.denoiser.sample(ctx_, null_ctx, noise, 0, scale, stop_rule=self.p["stop_rule"])
            samples[:], steps[:] = r["samples"], r["steps"]
        else:
            if policy == "predicted":
                want = np.asarray(state["predicted_steps"], np.int64)
            else:
                k = state.get("num_inference_steps")
                want = np.broadcast_to(np.asarray(self.p["num_inference_steps"] if k is None else k, np.int64), (n,))
            for k in np.unique(want):  # rows sharing a step count share a batch
                rows = np.flatnonzero(want == k)
                r = self.denoiser.sample(ctx_[rows], null_ctx, noise[rows], int(k), scale)
                samples[rows], steps[rows] = r["samples"], r["steps"]
        if self.vae is not None:
            vae = self.p["vae_decoder"]
            name_in = self.vae.get_inputs()[0].name
            samples = self.vae.run(None, {name_in: samples / np.float32(vae["scaling_factor"])})[0]
        state["samples"] = samples
        state["images"] = to_uint8(samples, self.p["output_crop"])
        state["steps"] = steps
        state["policy"] = policy
        state["unet_calls"] = self.denoiser.unet_calls - calls0
        return state


# ------------------------------------------------------------------------------------------ API


class DiffusionResult:
    """Images (uint8 ``[n, H, W]`` or ``[n, H, W, C]``), the steps each prompt took, and timing."""

    def __init__(self, state: dict[str, Any], seconds: float) -> None:
        self.images: np.ndarray = state["images"]
        self.samples: np.ndarray = state["samples"]
        self.steps: np.ndarray = state["steps"]
        self.policy: str = state["policy"]
        self.predicted_steps = state.get("predicted_steps")
        self.unet_calls: int = state["unet_calls"]
        self.seconds = seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "steps": self.steps.tolist(),
            "predicted_steps": None if self.predicted_steps is None else np.asarray(self.predicted_steps).tolist(),
            "unet_calls": self.unet_calls,
            "seconds": round(self.seconds, 4),
            "image_shape": list(self.images.shape[1:]),
        }


def _check_request(prompts, steps, guidance, policy) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise DataError("no prompt given; pass --prompt TEXT")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise DataError(f"prompt #{i} is empty; give a non-empty text (the empty prompt is the plan's null prompt)")
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= MAX_STEPS:
            raise DataError(f"steps={steps!r}: the number of denoising steps must be an integer in [1, {MAX_STEPS}]")
    if guidance is not None:
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not math.isfinite(guidance) or guidance < 1:
            raise DataError(f"guidance={guidance!r}: the guidance scale must be >= 1 (1 = no classifier-free guidance)")
    if policy is not None and policy not in POLICIES:
        raise DataError(f"policy={policy!r}: choose one of {', '.join(POLICIES)}")
    return prompts


def generate_images(
    model,
    prompts: Sequence[str] | str,
    *,
    seed: int | Sequence[int] = 0,
    steps: int | None = None,
    guidance: float | None = None,
    policy: str | None = None,
    noise: np.ndarray | None = None,
    noise_source: str | None = None,
) -> DiffusionResult:
    """Run a text-to-image plan.

    Args:
        model: a loaded plan (:func:`dyncompile.load`) whose task is ``text-to-image``.
        prompts: one prompt or a list.
        seed: one int (prompt i gets ``seed + i``) or one seed per prompt.
        steps: fixed number of denoising steps (overrides the plan's step policy).
        guidance: classifier-free guidance scale (>= 1; default the plan's).
        policy: ``fixed``, ``predicted`` or ``online`` (default: the plan's, ``fixed`` if ``steps`` is given).
        noise: explicit initial noise ``[n, C, H, W]`` (overrides ``seed``).
        noise_source: ``numpy`` (default) or ``torch`` (diffusers' ``torch.randn`` with a seeded generator).
    """
    if model.plan.task != "text-to-image":
        raise DataError(f"this plan's task is {model.plan.task!r}, not text-to-image")
    prompts = _check_request(prompts, steps, guidance, policy)
    if noise_source is not None and noise_source not in NOISE_SOURCES:
        raise DataError(f"noise source {noise_source!r}: choose one of {', '.join(NOISE_SOURCES)}")
    seeds = [int(seed) + i for i in range(len(prompts))] if isinstance(seed, (int, np.integer)) else [int(s) for s in seed]
    if len(seeds) != len(prompts):
        raise DataError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    if policy == "fixed" and steps is None:
        steps = None  # the plan's num_inference_steps
    state: dict[str, Any] = {
        "prompts": prompts,
        "seeds": seeds,
        "noise": None if noise is None else np.asarray(noise, np.float32),
        "noise_source": noise_source,
        "num_inference_steps": steps,
        "guidance_scale": None if guidance is None else float(guidance),
        "step_policy": policy,
    }
    t0 = time.perf_counter()
    state = model.run_feeds(state)
    return DiffusionResult(state, time.perf_counter() - t0)


def save_png(path: str | Path, image: np.ndarray) -> Path:
    """Write a uint8 ``[H, W]`` (grey) or ``[H, W, 3]`` image as PNG, atomically (no imaging library needed)."""
    import os
    import struct
    import tempfile
    import zlib

    path = Path(path)
    img = np.ascontiguousarray(image, np.uint8)
    if img.ndim == 2:
        color, rows = 0, img
    elif img.ndim == 3 and img.shape[2] == 3:
        color, rows = 2, img.reshape(img.shape[0], -1)
    else:
        raise DataError(f"cannot write an image of shape {img.shape} as PNG")
    h, w = img.shape[:2]

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + rows[i].tobytes() for i in range(h))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    if not path.parent.is_dir():
        raise DataError(f"cannot write {path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(png)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
