"""Text-to-image step handlers: prompt encoding, the step count, the guided denoising loop.

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
``diffusion_denoise``'s ``default_policy``. Everything in the plan is data: the handlers read the parameters
the plan's typed schema validated when the plan loaded (``step.typed``), and nothing in the plan is executed.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from typing import Any

import numpy as np

from dyncompile.errors import DataError, PlanError
from dyncompile.plan import STEP_SCHEMAS, DiffusionDenoiseParams
from dyncompile.runtime.diffusion.denoise import (
    Denoiser,
    FeatureCache,
    StopRule,
    make_noise,
    mean_pool,
    to_uint8,
)
from dyncompile.runtime.registry import StepHandler, register_step
from dyncompile.runtime.rules.schedulers import make_scheduler

logger = logging.getLogger(__name__)

__all__ = ["MAX_STEPS", "NOISE_SOURCES", "POLICIES", "DiffusionDenoiseStep", "DiffusionEncodeStep", "PredictStepsStep",
           "predict_steps"]

# what a call may ask for, read from the plan schema (one source for the plan's and the call's bounds)
_HINTS = typing.get_type_hints(DiffusionDenoiseParams)
POLICIES: tuple[str, ...] = typing.get_args(_HINTS["default_policy"])
NOISE_SOURCES: tuple[str, ...] = typing.get_args(_HINTS["noise"])
MAX_STEPS: int = next(f for f in dataclasses.fields(DiffusionDenoiseParams) if f.name == "num_inference_steps").metadata["hi"]


def _typed(step) -> Any:
    """The step's parameters as validated by the plan schema (built here for a step made by hand)."""
    return step.typed or STEP_SCHEMAS[step.kind](step.params, f"plan step {step.kind!r}")


@register_step("diffusion_encode")
class DiffusionEncodeStep(StepHandler):
    """``[null] + prompts`` through the text encoder in one batch -> ``ctx``, ``null_ctx``, ``text_features``."""

    def __init__(self, step, ctx) -> None:
        """Open the text encoder's session and read the plan's tokenizer."""
        super().__init__(step, ctx)
        p = _typed(step)
        from dyncompile.runtime.text import TextEncoder

        spec = ctx.plan.tokenizer
        if not spec or "file" not in spec:
            raise PlanError(f"plan step {step.kind!r}: the plan has no tokenizer; recompile the pipeline")
        self.tokens = TextEncoder.from_plan(ctx.plan, spec)
        self.session = ctx.session(p.text_encoder)
        self.feed_names = [i.name for i in self.session.get_inputs()]
        self.output = p.output
        self.null_prompt = p.null_prompt

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        """Encode ``[null prompt] + state['prompts']``."""
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


def predict_steps(params: Any, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The step-saver head: ``log2 steps = ((f - mean) / scale) @ w + b + offset``, rounded up onto the grid.

    Args:
        params: the ``predict_steps`` step's typed parameters (``weights``, ``bias``, ``mean``, ``scale``,
            ``offset``, ``grid``).
        features: ``[n, d]`` pooled text features.

    Returns:
        The step count per row (a grid value) and the unrounded ``log2`` prediction.
    """
    z = (features - np.asarray(params.mean, np.float64)) / np.asarray(params.scale, np.float64)
    log2 = z @ np.asarray(params.weights, np.float64) + params.bias + params.offset
    want = np.exp2(log2)
    grid = np.asarray(params.grid)
    idx = np.searchsorted(grid, want - 1e-9, side="left")
    return grid[np.minimum(idx, len(grid) - 1)], log2


@register_step("predict_steps")
class PredictStepsStep(StepHandler):
    """Per-prompt step count from the text features (the ``step-saver`` pass's fitted head)."""

    def __init__(self, step, ctx) -> None:
        """Read the fitted head from the step's typed parameters."""
        super().__init__(step, ctx)
        self.p = _typed(step)

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        """Predict each prompt's step count from ``state['text_features']``."""
        steps, log2 = predict_steps(self.p, state["text_features"])
        state["predicted_steps"] = steps
        state["predicted_log2_steps"] = log2
        return state


@register_step("diffusion_denoise")
class DiffusionDenoiseStep(StepHandler):
    """The guided scheduler loop over the U-Net, then (optionally) the VAE decoder and uint8 images."""

    def __init__(self, step, ctx) -> None:
        """Open the U-Net (and VAE decoder) sessions and build the scheduler and stop rule."""
        super().__init__(step, ctx)
        self.p = p = _typed(step)
        scheduler = make_scheduler(p.scheduler)
        self.max_steps = scheduler.T  # a schedule has at most one step per training timestep
        for what, k in (("num_inference_steps", p.num_inference_steps),
                        ("stop_rule.max_steps", None if p.stop_rule is None else p.stop_rule.max_steps)):
            if k is not None and k > scheduler.T:
                raise PlanError(f"plan step 'diffusion_denoise': {what} {k} exceeds the scheduler's "
                                f"num_train_timesteps {scheduler.T}")
        scheduler.timesteps(p.num_inference_steps)  # PlanError if the plan's schedule leaves [0, T)
        r = p.stop_rule
        self.stop_rule = None if r is None else StopRule(r.threshold, r.max_steps, r.min_steps)
        self.session = ctx.session(p.unet)
        names = [i.name for i in self.session.get_inputs()]
        if sorted(names) != sorted(p.input_names):
            raise PlanError(f"plan step 'diffusion_denoise': the U-Net's inputs are {names}, the plan says {list(p.input_names)}")
        self.out_name = self.session.get_outputs()[0].name
        s, t, c = p.input_names

        def unet(x, ts, states):
            return self.session.run([self.out_name], {s: x, t: ts, c: states})[0]

        self.denoiser = Denoiser(unet, scheduler, crop=p.output_crop, cache=self._feature_cache(ctx, p))
        self.vae = ctx.session(p.vae_decoder.file) if p.vae_decoder is not None else None

    def _feature_cache(self, ctx, p) -> FeatureCache | None:
        """The full/shallow graph pair of a ``cache-unet`` plan (None without ``feature_cache``)."""
        fc = p.feature_cache
        if fc is None:
            return None
        outs = [o.name for o in self.session.get_outputs()]
        if fc.deep_output not in outs:
            raise PlanError(f"plan step 'diffusion_denoise': feature_cache.deep_output {fc.deep_output!r} is not an "
                            f"output of the U-Net (it has {outs}); recompile with --passes cache-unet")
        shallow = ctx.session(fc.shallow_unet)
        names = [i.name for i in shallow.get_inputs()]
        s, t, c = p.input_names
        if fc.deep_input not in names or not {s, t}.issubset(names):
            raise PlanError(f"plan step 'diffusion_denoise': the shallow U-Net's inputs are {names}; the plan needs "
                            f"{[s, t, fc.deep_input]} (and optionally {c})")
        with_states = c in names
        full_names = [self.out_name, fc.deep_output]
        shallow_out = shallow.get_outputs()[0].name

        def full(x, ts, states):
            e, deep = self.session.run(full_names, {s: x, t: ts, c: states})
            return e, deep

        def part(x, ts, states, deep):
            feeds = {s: x, t: ts, fc.deep_input: deep}
            if with_states:
                feeds[c] = states
            return shallow.run([shallow_out], feeds)[0]

        return FeatureCache(full, part, fc.refreshes)

    def _policy(self, state) -> str:
        policy = state.get("step_policy") or self.p.default_policy
        if policy not in POLICIES:
            raise DataError(f"step policy {policy!r} is not one of {', '.join(POLICIES)}")
        if state.get("num_inference_steps") is not None and state.get("step_policy") is None:
            policy = "fixed"  # an explicit step count wins over the plan's default
        if policy == "predicted" and "predicted_steps" not in state:
            raise DataError("this plan has no step predictor (compile it with --passes step-saver); use fixed steps")
        if policy == "online" and self.stop_rule is None:
            raise DataError("this plan has no online stop rule (compile it with --passes step-saver); use fixed steps")
        return policy

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        """Denoise every row with the step count its policy gives; decode and convert to images."""
        ctx_, null_ctx = state["ctx"], state["null_ctx"]
        n = len(ctx_)
        scale = state.get("guidance_scale")
        scale = self.p.guidance_scale if scale is None else scale
        noise = state.get("noise")
        shape = list(self.p.sample_shape)
        if noise is None:
            noise = make_noise(state["seeds"], shape, state.get("noise_source") or self.p.noise)
        elif noise.shape != (n, *shape):
            raise DataError(f"noise has shape {noise.shape}, the plan samples {[n, *shape]}")
        policy = self._policy(state)
        ci = state.get("cache_interval")
        if ci is not None and self.denoiser.cache is None and ci != 1:
            raise DataError("this plan has no feature cache (compile it with --passes cache-unet); drop cache_interval")
        samples = np.empty((n, *shape), np.float32)
        steps = np.zeros(n, np.int64)
        calls = shallow = 0  # this call's, from the samplers' results (the denoiser is shared by concurrent calls)
        if policy == "online":
            r = self.denoiser.sample(ctx_, null_ctx, noise, 0, scale, stop_rule=self.stop_rule, cache_interval=ci)
            samples[:], steps[:] = r["samples"], r["steps"]
            calls += r["unet_calls"]
            shallow += r["shallow_calls"]
        else:
            if policy == "predicted":
                want = np.asarray(state["predicted_steps"], np.int64)
                if want.size and want.max() > self.max_steps:
                    raise PlanError(f"plan step 'predict_steps': its grid reaches {int(want.max())} steps, over the "
                                    f"scheduler's num_train_timesteps {self.max_steps}")
            else:
                k = state.get("num_inference_steps")
                if k is not None and k > self.max_steps:
                    raise DataError(f"steps={k}: this plan's scheduler has {self.max_steps} timesteps; ask for at "
                                    f"most {self.max_steps} steps")
                want = np.broadcast_to(np.asarray(self.p.num_inference_steps if k is None else k, np.int64), (n,))
            for k in np.unique(want):  # rows sharing a step count share a batch
                rows = np.flatnonzero(want == k)
                r = self.denoiser.sample(ctx_[rows], null_ctx, noise[rows], int(k), scale, cache_interval=ci)
                samples[rows], steps[rows] = r["samples"], r["steps"]
                calls += r["unet_calls"]
                shallow += r["shallow_calls"]
        if self.vae is not None:
            name_in = self.vae.get_inputs()[0].name
            samples = self.vae.run(None, {name_in: samples / np.float32(self.p.vae_decoder.scaling_factor)})[0]
        state["samples"] = samples
        state["images"] = to_uint8(samples, self.p.output_crop)
        state["steps"] = steps
        state["policy"] = policy
        state["unet_calls"] = calls
        state["shallow_calls"] = shallow
        return state
