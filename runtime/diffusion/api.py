"""The text-to-image task API: ``model.generate_images(prompts, ...)`` and its result."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.runtime.diffusion.steps import MAX_STEPS, NOISE_SOURCES, POLICIES
from dyncompile.runtime.registry import TaskAPI, register_task

#: the largest classifier-free guidance scale a request may ask for (the plan schema's bound)
MAX_GUIDANCE = 100.0

__all__ = ["DiffusionResult", "ImagesAPI"]


class DiffusionResult:
    """Images (uint8 ``[n, H, W]`` or ``[n, H, W, C]``), the steps each prompt took, and timing."""

    def __init__(self, state: dict[str, Any], seconds: float) -> None:
        """Read the results of a finished run from the final ``state``."""
        self.images: np.ndarray = state["images"]
        self.samples: np.ndarray = state["samples"]
        self.steps: np.ndarray = state["steps"]
        self.policy: str = state["policy"]
        self.predicted_steps = state.get("predicted_steps")
        self.unet_calls: int = state["unet_calls"]
        self.shallow_calls: int = state.get("shallow_calls", 0)
        self.seconds = seconds

    def to_dict(self) -> dict[str, Any]:
        """The result without the images, JSON-ready."""
        return {
            "policy": self.policy,
            "steps": self.steps.tolist(),
            "predicted_steps": None if self.predicted_steps is None else np.asarray(self.predicted_steps).tolist(),
            "unet_calls": self.unet_calls,
            "shallow_calls": self.shallow_calls,
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
        if (isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not math.isfinite(guidance)
                or not 1 <= guidance <= MAX_GUIDANCE):
            raise DataError(f"guidance={guidance!r}: the guidance scale must be >= 1 and <= {MAX_GUIDANCE:g} (1 = no "
                            "classifier-free guidance; diffusion models use 1.5-15, larger saturates the image)")
    if policy is not None and policy not in POLICIES:
        raise DataError(f"policy={policy!r}: choose one of {', '.join(POLICIES)}")
    if steps is not None and policy in ("predicted", "online"):
        raise DataError(f"--steps {steps} with --policy {policy}: a fixed step count applies only to the fixed policy "
                        "(the predicted and online policies choose each prompt's steps); drop one of them")
    return prompts


@register_task("text-to-image")
class ImagesAPI(TaskAPI):
    """The task API of text-to-image plans: :meth:`generate_images` (``CompiledModel.generate_images``)."""

    def generate_images(self, prompts: Sequence[str] | str, **kwargs: Any) -> DiffusionResult:
        """Run the plan on ``prompts`` (see :func:`_generate_images` for the keyword arguments)."""
        return _generate_images(self.model, prompts, **kwargs)


def _generate_images(
    model: Any,
    prompts: Sequence[str] | str,
    *,
    seed: int | Sequence[int] = 0,
    steps: int | None = None,
    guidance: float | None = None,
    policy: str | None = None,
    noise: np.ndarray | None = None,
    noise_source: str | None = None,
    cache_interval: int | None = None,
) -> DiffusionResult:
    """Run a text-to-image plan: the body of ``model.generate_images(prompts, ...)``.

    Args:
        model: a loaded plan (:func:`dyncompile.load`) whose task is ``text-to-image``.
        prompts: one prompt or a list.
        seed: one int (prompt i gets ``seed + i``) or one seed per prompt.
        steps: fixed number of denoising steps (overrides the plan's step policy).
        guidance: classifier-free guidance scale (>= 1; default the plan's).
        policy: ``fixed``, ``predicted`` or ``online`` (default: the plan's, ``fixed`` if ``steps`` is given).
        noise: explicit initial noise ``[n, C, H, W]`` (overrides ``seed``).
        noise_source: ``numpy`` (default) or ``torch`` (diffusers' ``torch.randn`` with a seeded generator).
        cache_interval: a ``cache-unet`` plan's refresh rule replaced by a uniform interval (1: caching off).

    Returns:
        The images, the steps each prompt took and the timing.
    """
    prompts = _check_request(prompts, steps, guidance, policy)
    if noise_source is not None and noise_source not in NOISE_SOURCES:
        raise DataError(f"noise source {noise_source!r}: choose one of {', '.join(NOISE_SOURCES)}")
    seeds = [int(seed) + i for i in range(len(prompts))] if isinstance(seed, (int, np.integer)) else [int(s) for s in seed]
    if len(seeds) != len(prompts):
        raise DataError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    if any(not 0 <= s < 2**63 for s in seeds):
        raise DataError(f"seeds must be non-negative integers below 2**63, got {seeds[:4]}")
    if cache_interval is not None and (isinstance(cache_interval, bool) or not isinstance(cache_interval, (int, np.integer))
                                       or not 1 <= cache_interval <= MAX_STEPS):
        raise DataError(f"cache_interval={cache_interval!r}: an integer in [1, {MAX_STEPS}] (1 = caching off)")
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
        "cache_interval": None if cache_interval is None else int(cache_interval),
    }
    t0 = time.perf_counter()
    state = model.run_feeds(state)
    return DiffusionResult(state, time.perf_counter() - t0)
