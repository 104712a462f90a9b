"""Diffusion schedulers in numpy, configured from a diffusers ``scheduler_config.json``.

The scheduler math is written once, here; the runtime's denoising loop and the step-saver pass's
calibration both step through it. Only what a plan needs is implemented: ``DDIMScheduler`` with eta 0
(deterministic DDIM), betas ``linear`` / ``scaled_linear``, spacing ``trailing`` / ``leading`` /
``linspace``, prediction ``epsilon`` / ``v_prediction`` / ``sample``, optional x0 clipping. Options that
change the math and are not implemented (thresholding, zero-SNR rescaling, trained betas) are refused
with a :class:`~dyncompile.errors.PlanError` rather than silently ignored.

The DDIM update (Song et al. 2021, eq. 12 with sigma 0), as in diffusers' ``DDIMScheduler.step``::

    prev_t  = t - T // N                          (T = num_train_timesteps, N = inference steps)
    x0      = (x_t - sqrt(1 - a_t) * eps) / sqrt(a_t)
    x_prev  = sqrt(a_prev) * x0 + sqrt(1 - a_prev) * eps
    a_prev  = alphas_cumprod[prev_t] if prev_t >= 0 else (1 if set_alpha_to_one else alphas_cumprod[0])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dyncompile.errors import PlanError

__all__ = ["SCHEDULERS", "DDIMScheduler", "make_scheduler"]

_SPACINGS = ("trailing", "leading", "linspace")
_BETAS = ("linear", "scaled_linear")
_PREDICTIONS = ("epsilon", "v_prediction", "sample")


MAX_TRAIN_TIMESTEPS = 100_000  # diffusers' schedulers train on 1000


class DDIMScheduler:
    """Deterministic DDIM (eta 0) over a diffusers-style config; float32 like diffusers' torch tensors."""

    name = "DDIMScheduler"

    def __init__(self, config: dict[str, Any]) -> None:
        """Read and check the diffusers config (PlanError for options not implemented)."""
        cfg = dict(config)
        self.config = cfg
        where = "scheduler config"

        def get(key, default, kind):
            v = cfg.get(key, default)
            if kind is bool:
                ok = isinstance(v, bool)
            elif kind is int:
                ok = isinstance(v, int) and not isinstance(v, bool)
            elif kind is float:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            else:
                ok = v in kind
            if not ok:
                want = " | ".join(map(repr, kind)) if isinstance(kind, tuple) else kind.__name__
                raise PlanError(f"{where}: {key}={v!r} is not supported (expected {want}); fix the scheduler config")
            return v

        self.T = get("num_train_timesteps", 1000, int)
        if not 2 <= self.T <= MAX_TRAIN_TIMESTEPS:
            raise PlanError(f"{where}: num_train_timesteps={self.T} must be in [2, {MAX_TRAIN_TIMESTEPS}]")
        beta_start = float(get("beta_start", 1e-4, float))
        beta_end = float(get("beta_end", 0.02, float))
        if not 0 < beta_start <= beta_end < 1:
            raise PlanError(f"{where}: need 0 < beta_start <= beta_end < 1, got {beta_start}, {beta_end}")
        schedule = get("beta_schedule", "linear", _BETAS)
        self.spacing = get("timestep_spacing", "leading", _SPACINGS)
        self.prediction_type = get("prediction_type", "epsilon", _PREDICTIONS)
        self.steps_offset = get("steps_offset", 0, int)
        if not 0 <= self.steps_offset < self.T:
            raise PlanError(f"{where}: steps_offset={self.steps_offset} must be in [0, num_train_timesteps)")
        self.clip_sample = get("clip_sample", True, bool)
        self.clip_sample_range = float(get("clip_sample_range", 1.0, float))
        if not 0 < self.clip_sample_range <= 1e6:  # NaN fails too; 0 would clip every image to grey
            raise PlanError(f"{where}: clip_sample_range={self.clip_sample_range} must be in (0, 1e6]")
        set_alpha_to_one = get("set_alpha_to_one", True, bool)
        for key in ("thresholding", "rescale_betas_zero_snr"):
            if cfg.get(key):
                raise PlanError(f"{where}: {key}=true is not implemented by the dyncompile runtime; set it to false")
        if cfg.get("trained_betas") is not None:
            raise PlanError(f"{where}: trained_betas are not implemented by the dyncompile runtime; use beta_schedule")
        if schedule == "linear":
            betas = np.linspace(beta_start, beta_end, self.T, dtype=np.float32)
        else:  # scaled_linear (Stable Diffusion)
            betas = (np.linspace(beta_start**0.5, beta_end**0.5, self.T, dtype=np.float32) ** 2).astype(np.float32)
        self.alphas_cumprod = np.cumprod(np.float32(1.0) - betas, dtype=np.float32)
        self.final_alpha_cumprod = np.float32(1.0) if set_alpha_to_one else self.alphas_cumprod[0]

    def __repr__(self) -> str:
        """The scheduler and its main options."""
        return (
            f"DDIMScheduler(T={self.T}, spacing={self.spacing!r}, prediction={self.prediction_type!r}, "
            f"clip_sample={self.clip_sample})"
        )

    def timesteps(self, n: int) -> list[int]:
        """The N timesteps of an N-step schedule, descending (diffusers' ``set_timesteps``)."""
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"number of inference steps must be a positive integer, got {n!r}")
        n = int(n)
        if n > self.T:
            raise ValueError(f"number of inference steps {n} exceeds num_train_timesteps {self.T}")
        T = self.T
        if self.spacing == "trailing":
            ts = np.round(np.arange(T, 0, -T / n)).astype(np.int64) - 1
        elif self.spacing == "leading":
            ts = (np.arange(0, n) * (T // n)).round()[::-1].astype(np.int64) + self.steps_offset
        else:  # linspace
            ts = np.linspace(0, T - 1, n).round()[::-1].astype(np.int64)
        if len(ts) and not (0 <= ts.min() and ts.max() < T):
            raise PlanError(
                f"scheduler config: a {n}-step {self.spacing!r} schedule with steps_offset {self.steps_offset} reaches "
                f"timestep {int(ts.max())}, outside [0, {T}); fix steps_offset or the step count"
            )
        return [int(t) for t in ts]

    def prev_timestep(self, t: int, n: int) -> int:
        """The timestep after ``t`` on an ``n``-step schedule."""
        return int(t) - self.T // int(n)

    def step(self, model_output: np.ndarray, t: int, sample: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """One DDIM step (eta 0) from ``t``; returns ``(x_prev, x0_pred)``, float32."""
        a_t = self.alphas_cumprod[int(t)]
        prev_t = self.prev_timestep(t, n)
        a_prev = self.alphas_cumprod[prev_t] if prev_t >= 0 else self.final_alpha_cumprod
        b_t = np.float32(1.0) - a_t
        out = model_output.astype(np.float32, copy=False)
        x = sample.astype(np.float32, copy=False)
        if self.prediction_type == "epsilon":
            x0 = (x - np.sqrt(b_t) * out) / np.sqrt(a_t)
            eps = out
        elif self.prediction_type == "sample":
            x0 = out
            eps = (x - np.sqrt(a_t) * x0) / np.sqrt(b_t)
        else:  # v_prediction
            x0 = np.sqrt(a_t) * x - np.sqrt(b_t) * out
            eps = np.sqrt(a_t) * out + np.sqrt(b_t) * x
        if self.clip_sample:
            x0 = np.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        x_prev = np.sqrt(a_prev) * x0 + np.sqrt(np.float32(1.0) - a_prev) * eps
        return x_prev.astype(np.float32, copy=False), x0.astype(np.float32, copy=False)


SCHEDULERS: dict[str, type] = {"DDIMScheduler": DDIMScheduler}


def make_scheduler(config: dict[str, Any]):
    """The scheduler named by ``config['_class_name']`` (PlanError naming the implemented ones otherwise)."""
    if not isinstance(config, dict):
        raise PlanError("scheduler config must be a JSON object")
    name = config.get("_class_name")
    if name not in SCHEDULERS:
        raise PlanError(
            f"scheduler type {name!r} is not implemented by the dyncompile runtime (implemented: "
            f"{', '.join(SCHEDULERS)}); export the pipeline with one of those, e.g. DDIMScheduler.from_config(...)"
        )
    return SCHEDULERS[name](config)
