"""Schemas of text-to-image plans (``task: text-to-image``): ``diffusion_encode``, ``predict_steps``, ``diffusion_denoise``.

These dataclasses are the one validator of the diffusion steps: types, ranges, enums, file keys and the
stop rule are checked when the plan is loaded, and the step handlers read the typed values
(:attr:`dyncompile.plan.Step.typed`). The scheduler config inside ``diffusion_denoise`` is a diffusers
config that the runtime's scheduler checks when it is built (it refuses types and options it does not
implement).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from dyncompile.errors import PlanError
from dyncompile.plan._typed import _field, _short, from_json

__all__ = [
    "MAX_STEPS",
    "NOISE_SOURCES",
    "STEPS",
    "STEP_POLICIES",
    "DiffusionDenoiseParams",
    "CacheScheduleParams",
    "DiffusionEncodeParams",
    "FeatureCacheParams",
    "NoiseSource",
    "PredictStepsParams",
    "StepPolicy",
    "StopRuleParams",
    "VaeDecoderParams",
]

MAX_STEPS = 1000  # denoising steps of one image
StepPolicy = Literal["fixed", "predicted", "online"]
NoiseSource = Literal["numpy", "torch"]
STEP_POLICIES: tuple[str, ...] = typing.get_args(StepPolicy)
"""How a call picks its step count: ``fixed``, ``predicted`` (the ``predict_steps`` head), ``online`` (stop rule)."""
NOISE_SOURCES: tuple[str, ...] = typing.get_args(NoiseSource)
"""Where the initial noise comes from (the same seeds give the same images as that library)."""


@dataclasses.dataclass(frozen=True)
class DiffusionEncodeParams:
    """``diffusion_encode``: ``[null prompt] + prompts`` through the text encoder in one batch."""

    text_encoder: str
    output: str = "last_hidden_state"
    null_prompt: str = ""

    needs_tokenizer = True  # the prompts are tokenized with the plan's tokenizer

    def file_keys(self) -> list[tuple[str, str]]:
        """The plan files this step names, as ``(field, file key)`` pairs."""
        return [("text_encoder", self.text_encoder)]


@dataclasses.dataclass(frozen=True)
class PredictStepsParams:
    """``predict_steps`` (step-saver): a linear head on the text features predicts ``log2`` of the step count.

    ``log2 steps = ((f - mean) / scale) @ weights + bias + offset``, rounded up onto ``grid``; ``f`` is the
    masked mean of the text states.
    """

    weights: list[float]
    bias: float
    mean: list[float]
    scale: list[float]
    grid: list[int] = _field(lo=1, hi=MAX_STEPS)
    offset: float = _field(lo=-10.0, hi=10.0)
    features: Literal["mean_pool"] = "mean_pool"

    def _check(self, where: str) -> None:
        n = len(self.weights)
        if len(self.mean) != n or len(self.scale) != n:
            raise PlanError(f"{where}: mean has {len(self.mean)} values, scale {len(self.scale)}, expected {n} (weights)")
        if any(s <= 0 for s in self.scale):
            raise PlanError(f"{where}.scale must be > 0")
        if not self.grid or list(self.grid) != sorted(set(self.grid)):
            raise PlanError(f"{where}.grid must be an increasing list of step counts, got {_short(self.grid)}")

    def file_keys(self) -> list[tuple[str, str]]:
        """The plan files this step names: none."""
        return []


@dataclasses.dataclass(frozen=True)
class StopRuleParams:
    """The online stop rule: stop a row when its x0 prediction changes by less than ``threshold`` (RMS, [0, 1])."""

    kind: Literal["x0_change"]
    threshold: float = _field(lo=0.0, hi=1.0)
    max_steps: int = _field(lo=2, hi=MAX_STEPS)
    min_steps: int = _field(1, lo=1, hi=MAX_STEPS)

    def _check(self, where: str) -> None:
        if self.min_steps > self.max_steps:
            raise PlanError(f"{where}.min_steps {self.min_steps} exceeds max_steps {self.max_steps}")


@dataclasses.dataclass(frozen=True)
class VaeDecoderParams:
    """The optional VAE decoder of ``diffusion_denoise``: its file key and the latent scaling factor."""

    file: str
    scaling_factor: float = _field(lo=1e-6, hi=1e6)


def _refreshes(k: int, steps: int | None, interval: int, warmup: int, final: int, refresh_steps) -> bool:
    """The refresh rule of :class:`FeatureCacheParams` for one schedule (see there)."""
    if interval == 1 or (steps is not None and k >= steps - final):
        return True
    r = refresh_steps
    if r is not None:
        return k in r or (k > r[-1] and (k - r[-1]) % interval == 0)
    return k < warmup or (k - warmup) % interval == 0


def _check_refresh_steps(r, where: str) -> None:
    if r is not None and (not r or r[0] != 0 or list(r) != sorted(set(r))):
        raise PlanError(f"{where}.refresh_steps must be increasing step indices starting at 0, got {_short(r)}")


@dataclasses.dataclass(frozen=True)
class CacheScheduleParams:
    """One row of a feature cache's table by step count: the refresh rule of ``steps``-step schedules.

    A ``K``-step schedule uses the row with the largest ``steps`` <= ``K`` (caching off below the first row).
    ``interval`` 1 is "no caching" (every step runs the full graph). ``quality`` is the calibration's record of
    this row (mean SSIM to the reference image, uncached and with this rule, on calibration prompts; informational).
    """

    steps: int = _field(lo=1, hi=MAX_STEPS)
    interval: int = _field(1, lo=1, hi=MAX_STEPS)
    warmup: int = _field(0, lo=0, hi=MAX_STEPS)
    final: int = _field(0, lo=0, hi=MAX_STEPS)
    refresh_steps: list[int] | None = _field(None, lo=0, hi=MAX_STEPS - 1)
    quality: dict[str, Any] | None = None

    def _check(self, where: str) -> None:
        _check_refresh_steps(self.refresh_steps, where)

    def refreshes(self, k: int, steps: int | None = None) -> bool:
        """Whether 0-based step ``k`` of a ``steps``-step schedule runs the full graph under this row."""
        return _refreshes(k, steps, self.interval, self.warmup, self.final, self.refresh_steps)


@dataclasses.dataclass(frozen=True)
class FeatureCacheParams:
    """Feature caching across denoising steps (``cache-unet``): which graph runs at which step.

    On a *refresh* step the full U-Net (``unet`` of ``diffusion_denoise``) runs and also returns the deep feature
    ``deep_output`` (the up-path tensor the skip connection at cut ``depth`` concatenates with a shallow skip); on
    the other steps the shallow graph ``shallow_unet`` runs with the cached feature fed as ``deep_input``. Step
    ``k`` (0-based) of a ``K``-step schedule refreshes when ``k < warmup``, ``k >= K - final``, or
    ``(k - warmup) % interval == 0``; an explicit ``refresh_steps`` list (0 first, increasing) replaces the warm-up
    and interval rule up to its last entry, after which ``interval`` continues from it. ``interval`` 1 refreshes
    every step (caching off: the uncached loop's outputs).

    ``schedules`` (a table by step count, increasing ``steps``) replaces that rule for every schedule whose step
    count is known: a ``K``-step schedule uses the row with the largest ``steps`` <= ``K``, and runs uncached
    below the first row (:class:`CacheScheduleParams`). StepSaver's per-prompt step counts thus each get the
    rule calibrated for them.
    """

    shallow_unet: str
    deep_output: str
    deep_input: str
    depth: int = _field(lo=1, hi=64)
    interval: int = _field(1, lo=1, hi=MAX_STEPS)
    warmup: int = _field(0, lo=0, hi=MAX_STEPS)
    final: int = _field(0, lo=0, hi=MAX_STEPS)
    refresh_steps: list[int] | None = _field(None, lo=0, hi=MAX_STEPS - 1)
    calibration: dict[str, Any] | None = None
    schedules: list[CacheScheduleParams] | None = None

    def _check(self, where: str) -> None:
        _check_refresh_steps(self.refresh_steps, where)
        t = self.schedules
        if t is not None:
            ks = [r.steps for r in t]
            if not ks or ks != sorted(set(ks)):
                raise PlanError(f"{where}.schedules must be a non-empty list of rows with increasing 'steps', got steps "
                                f"{_short(ks)}")

    def schedule_for(self, steps: int) -> CacheScheduleParams | None:
        """The ``schedules`` row a ``steps``-step schedule uses (None: below the first row, or no table)."""
        row = None
        for r in self.schedules or ():
            if r.steps <= steps:
                row = r
        return row

    def refreshes(self, k: int, interval: int | None = None, steps: int | None = None) -> bool:
        """Whether 0-based step ``k`` of a ``steps``-step schedule runs the full graph.

        ``interval`` replaces the plan's rule with a uniform interval (1 = caching off).
        """
        if interval is not None:
            return k % interval == 0
        if self.schedules is not None and steps is not None:
            row = self.schedule_for(steps)
            return True if row is None else row.refreshes(k, steps)
        return _refreshes(k, steps, self.interval, self.warmup, self.final, self.refresh_steps)


@dataclasses.dataclass(frozen=True)
class DiffusionDenoiseParams:
    """``diffusion_denoise``: the guided scheduler loop over the U-Net.

    ``scheduler`` is a diffusers config the runtime's scheduler checks when it is built (it refuses types
    and options it does not implement).
    """

    unet: str
    scheduler: dict[str, Any]
    sample_shape: list[int] = _field(lo=1, hi=1_000_000)
    guidance_scale: float = _field(lo=1.0, hi=100.0)
    num_inference_steps: int = _field(lo=1, hi=MAX_STEPS)
    input_names: list[str] = _field(factory=lambda: ["sample", "timestep", "encoder_hidden_states"])
    output_crop: list[int] | None = _field(None, lo=0, hi=1_000_000)
    eta: float = 0.0
    noise: NoiseSource = "numpy"
    default_policy: StepPolicy = "fixed"
    stop_rule: StopRuleParams | None = None
    vae_decoder: VaeDecoderParams | None = None
    feature_cache: FeatureCacheParams | None = None

    def _check(self, where: str) -> None:
        if len(self.sample_shape) != 3:
            raise PlanError(f"{where}.sample_shape must be [C, H, W], got {_short(self.sample_shape)}")
        if len(self.input_names) != 3:
            raise PlanError(f"{where}.input_names must name the U-Net's sample, timestep and text-state inputs")
        c = self.output_crop
        if c is not None and (len(c) != 4 or not (c[0] < c[1] <= self.sample_shape[1] and c[2] < c[3] <= self.sample_shape[2])):
            raise PlanError(f"{where}.output_crop must be [top, bottom, left, right] inside {self.sample_shape[1:]}, got {_short(c)}")
        if self.eta != 0:
            raise PlanError(f"{where}.eta is {self.eta}; only deterministic DDIM (eta 0) is implemented")
        if self.default_policy == "online" and self.stop_rule is None:
            raise PlanError(f"{where}: default_policy 'online' needs a stop_rule")

    def file_keys(self) -> list[tuple[str, str]]:
        """The plan files this step names (the U-Net, the VAE decoder), as ``(field, file key)`` pairs."""
        keys = [("unet", self.unet)]
        if self.vae_decoder is not None:
            keys.append(("vae_decoder.file", self.vae_decoder.file))
        if self.feature_cache is not None:
            keys.append(("feature_cache.shallow_unet", self.feature_cache.shallow_unet))
        return keys


STEPS: dict[str, Any] = {
    "diffusion_encode": lambda d, where: from_json(DiffusionEncodeParams, d, where),
    "predict_steps": lambda d, where: from_json(PredictStepsParams, d, where),
    "diffusion_denoise": lambda d, where: from_json(DiffusionDenoiseParams, d, where),
}
"""This module's step kinds -> ``build(params_json, where)`` (merged into :data:`dyncompile.plan.STEP_SCHEMAS`)."""
