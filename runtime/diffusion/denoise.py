"""The denoising loop of a text-to-image plan, independent of the plan executor.

Classifier-free guidance as in Stable Diffusion / diffusers: the U-Net runs on the batch
``[uncond; cond]`` (the null prompt's text states first) and the two halves are combined as
``eps = eps_uncond + s * (eps_cond - eps_uncond)``. The scheduler (:mod:`dyncompile.runtime.rules.schedulers`)
steps the sample. Used by the runtime's ``diffusion_denoise`` step and by the step-saver pass's
calibration (which must see exactly what the runtime will do).

The online stop rule ("stop when the predicted clean image stops changing") watches the scheduler's x0
prediction: after each step it measures ``d_k = RMS(x0_k - x0_{k-1})`` on the output crop in [0, 1] pixel
units and stops a row once ``d_k < threshold`` (at or after ``min_steps``); the row's image is then its
x0 prediction at that step. Rows stop independently; stopped rows leave the batch.

Feature caching (the ``cache-unet`` pass, :class:`FeatureCache`): on a refresh step the full U-Net runs and
also returns its deep feature; on the other steps the shallow graph runs with the cached feature. The cache
holds the CFG batch's rows (``[uncond; cond]``) and follows the rows that leave the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["StopRule", "FeatureCache", "Denoiser", "make_noise", "to_uint8", "crop_slices", "mean_pool"]


def make_noise(seeds: Sequence[int], shape: Sequence[int], source: str = "numpy") -> np.ndarray:
    """Initial noise ``[n, *shape]``, one row per seed.

    ``numpy``: ``np.random.default_rng(seed).standard_normal(shape, float32)`` (no extra dependency);
    ``torch``: ``torch.randn((1, *shape), generator=torch.Generator().manual_seed(seed))`` — the
    convention of diffusers pipelines and of the fashion-diffusion asset's evaluation.
    """
    shape = tuple(int(s) for s in shape)
    rows = []
    for s in seeds:
        if source == "numpy":
            rows.append(np.random.default_rng(int(s)).standard_normal(shape, dtype=np.float32))
        elif source == "torch":
            try:
                import torch
            except ImportError:
                from dyncompile.errors import DataError

                raise DataError("noise source 'torch' needs PyTorch (pip install torch); use the default 'numpy' noise") from None

            rows.append(torch.randn((1, *shape), generator=torch.Generator().manual_seed(int(s))).numpy()[0])
        else:
            raise ValueError(f"noise source must be 'numpy' or 'torch', not {source!r}")
    return np.stack(rows).astype(np.float32)


def crop_slices(crop: Sequence[int] | None) -> tuple[slice, slice]:
    """``[top, bottom, left, right]`` (python slice bounds on H and W) or None for the whole image."""
    if crop is None:
        return slice(None), slice(None)
    t, b, left, r = (int(v) for v in crop)
    return slice(t, b), slice(left, r)


def to_uint8(x: np.ndarray, crop: Sequence[int] | None = None) -> np.ndarray:
    """Samples in [-1, 1], ``[n, C, H, W]`` -> uint8 ``[n, H', W']`` (C == 1) or ``[n, H', W', C]``."""
    hs, ws = crop_slices(crop)
    y = np.round((np.clip(x[:, :, hs, ws], -1.0, 1.0) + 1.0) * 127.5).astype(np.uint8)
    return y[:, 0] if y.shape[1] == 1 else np.transpose(y, (0, 2, 3, 1))


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Masked mean over tokens: ``[n, L, D]``, ``[n, L]`` -> ``[n, D]`` (float64)."""
    m = mask.astype(np.float64)[..., None]
    return (hidden.astype(np.float64) * m).sum(1) / np.maximum(m.sum(1), 1.0)


@dataclasses.dataclass(frozen=True)
class StopRule:
    """Online stop rule: stop a row when its x0 prediction changes by less than ``threshold`` (RMS, [0,1])."""

    threshold: float
    max_steps: int
    min_steps: int = 1

    def to_dict(self) -> dict[str, Any]:
        """The rule in its plan form."""
        return {"kind": "x0_change", "threshold": self.threshold, "max_steps": self.max_steps, "min_steps": self.min_steps}


def x0_change(prev: np.ndarray, cur: np.ndarray, crop: Sequence[int] | None) -> np.ndarray:
    """RMS difference per row of two x0 predictions on the crop, in [0, 1] pixel units."""
    hs, ws = crop_slices(crop)
    a = (np.clip(prev[:, :, hs, ws], -1, 1) + 1) / 2
    b = (np.clip(cur[:, :, hs, ws], -1, 1) + 1) / 2
    return np.sqrt(((a - b) ** 2).reshape(len(a), -1).mean(1))


@dataclasses.dataclass(frozen=True)
class FeatureCache:
    """The two graphs of a feature-cached U-Net and the rule that picks one per step.

    Args:
        full: ``f(sample, timestep, states) -> (model output, deep feature)``.
        shallow: ``f(sample, timestep, states, deep feature) -> model output``.
        refreshes: ``f(k, interval, steps) -> bool``: whether 0-based step ``k`` of a ``steps``-step schedule runs
            ``full`` (``interval`` None: the plan's rule, else a uniform interval).
    """

    full: Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
    shallow: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    refreshes: Callable[[int, int | None, int], bool]


class Denoiser:
    """Runs the guided sampling loop for a batch of rows sharing one schedule.

    Args:
        unet: ``f(sample, timestep, encoder_hidden_states) -> model output`` (an ORT session wrapper).
        scheduler: a :mod:`~dyncompile.runtime.rules.schedulers` scheduler.
        crop: output crop (for the stop rule's change measure and the uint8 image).
        cache: the feature-cached U-Net (``cache-unet``), or None (``unet`` runs every step).
    """

    def __init__(self, unet: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray], scheduler, crop=None,
                 cache: FeatureCache | None = None) -> None:
        """Sample with ``unet`` and ``scheduler``; ``crop`` is the output crop; ``cache`` the feature cache."""
        self.unet = unet
        self.scheduler = scheduler
        self.crop = crop
        self.cache = cache
        self.unet_calls = 0
        self.unet_rows = 0

    def _guided(self, x: np.ndarray, t: int, ctx: np.ndarray, null_ctx: np.ndarray, scale: float,
                deep: np.ndarray | None = None, refresh: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """One guided model call; with a cache: the full graph (``refresh``) or the shallow one on ``deep``."""
        n = len(x)
        if scale == 1.0:  # no guidance: the conditional half alone gives the same eps
            feeds = (x, np.full((n,), t, np.int64), ctx)
        else:
            uncond = np.broadcast_to(null_ctx, (n, *null_ctx.shape[1:]))
            feeds = (np.concatenate([x, x]), np.full((2 * n,), t, np.int64), np.concatenate([uncond, ctx]).astype(np.float32))
        if self.cache is None:
            e = self.unet(*feeds)
        elif refresh:
            e, deep = self.cache.full(*feeds)
        else:
            e = self.cache.shallow(*feeds, deep)
        self.unet_calls += 1
        self.unet_rows += len(feeds[0])
        if scale == 1.0:
            return e, deep
        eu, ec = e[:n], e[n:]
        return eu + np.float32(scale) * (ec - eu), deep

    def sample(
        self,
        ctx: np.ndarray,
        null_ctx: np.ndarray,
        noise: np.ndarray,
        num_steps: int,
        guidance_scale: float,
        *,
        stop_rule: StopRule | None = None,
        keep_x0: bool = False,
        cache_interval: int | None = None,
    ) -> dict[str, Any]:
        """Denoise ``noise`` (``[n, C, H, W]``) with text states ``ctx`` (``[n, L, D]``).

        ``cache_interval`` overrides the feature cache's refresh rule with a uniform interval (1: caching off).

        Returns ``{"samples": [n,C,H,W] float32, "steps": [n] int (U-Net steps each row took),
        "x0": [k, n, C, H, W] (if keep_x0), "change": [k, n] (x0 change per step, nan at step 1),
        "unet_calls": int, "shallow_calls": int (calls of the cached U-Net's shallow graph)}``.
        """
        n = len(noise)
        if stop_rule is not None:
            num_steps = stop_rule.max_steps
        timesteps = self.scheduler.timesteps(num_steps)
        x = noise.astype(np.float32).copy()
        out = np.empty_like(x)
        steps = np.full(n, len(timesteps), np.int64)
        active = np.arange(n)
        prev_x0 = None
        traj, changes = [], []
        calls = shallow = 0  # this call's U-Net calls (the counters on self add up every call, from every thread)
        deep = None
        for k, t in enumerate(timesteps, start=1):
            refresh = self.cache is None or deep is None or self.cache.refreshes(k - 1, cache_interval, len(timesteps))
            eps, deep = self._guided(x, t, ctx[active], null_ctx, guidance_scale, deep, refresh)
            calls += 1
            shallow += not refresh
            x, x0 = self.scheduler.step(eps, t, x, num_steps)
            change = np.full(n, np.nan)
            if prev_x0 is not None:
                change[active] = x0_change(prev_x0, x0, self.crop)
            if keep_x0:
                full = np.full((n, *noise.shape[1:]), np.nan, np.float32)
                full[active] = x0
                traj.append(full)
            changes.append(change)
            if stop_rule is not None and k < len(timesteps) and k >= stop_rule.min_steps and prev_x0 is not None:
                done = change[active] < stop_rule.threshold
                if done.any():
                    rows = active[done]
                    out[rows] = x0[done]
                    steps[rows] = k
                    keep = ~done
                    if deep is not None:  # the cache holds [uncond; cond] rows (or the cond rows alone)
                        deep = deep[np.concatenate([keep, keep])] if len(deep) == 2 * len(keep) else deep[keep]
                    active, x, x0 = active[keep], x[keep], x0[keep]
                    if not len(active):
                        break
            prev_x0 = x0
        if len(active):
            out[active] = x
        res: dict[str, Any] = {"samples": out, "steps": steps, "change": np.array(changes), "unet_calls": calls,
                                "shallow_calls": shallow}
        if keep_x0:
            res["x0"] = np.stack(traj)
        return res
