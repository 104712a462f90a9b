"""Calibration of the step saver: generation runs, per-prompt labels, the step head, the stop rule.

**Runs.** For each calibration prompt (text states + initial noise) the runtime's own denoising loop
(:class:`~dyncompile.runtime.diffusion.denoise.Denoiser`, the plan's scheduler and guidance) generates the image at
every step count of a grid and at the long reference schedule, and keeps the x0 prediction after every
step of the ``online_max_steps`` schedule (for the online rule). Prompts are spread over worker
processes, one ORT thread each.

**Labels.** ``min_steps(tau)``: the smallest grid count whose image has SSIM >= tau to the reference
image of the same prompt and seed (the asset's definition); prompts that reach it nowhere on the grid get
the grid's last count.

**Step head.** Ridge regression of ``log2(min_steps)`` on the standardised mean-pooled text states; the
ridge strength by K-fold cross-validation; then an additive offset on ``log2`` chosen on the
*cross-validated* predictions: the smallest offset whose predicted counts (rounded up onto the grid) give
at least ``1 - budget/100`` of the calibration prompts an image with SSIM >= tau.

**Stop rule.** The largest x0-change threshold whose stopped images reach SSIM >= tau on at least the same
share of calibration prompts.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from dyncompile.passes.step_saver.metrics import ssim
from dyncompile.runtime.diffusion.denoise import Denoiser, StopRule, to_uint8
from dyncompile.runtime.rules.schedulers import make_scheduler

logger = logging.getLogger(__name__)

__all__ = [
    "load_runs",
    "generation_runs",
    "min_steps",
    "fit_step_head",
    "calibrate_offset",
    "predict_on_grid",
    "stop_outcomes",
    "calibrate_stop_rule",
]

_W: dict[str, Any] = {}


def _init_worker(unet_path: str, sched_cfg: dict, crop, threads: int) -> None:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(unet_path, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    out = sess.get_outputs()[0].name

    def unet(x, t, c):
        return sess.run([out], {names[0]: x, names[1]: t, names[2]: c})[0]

    _W["den"] = Denoiser(unet, make_scheduler(sched_cfg), crop=crop)
    _W["crop"] = crop


def _one(args) -> dict[str, Any]:
    ctx, null_ctx, noise, counts, ref_steps, traj_steps, guidance = args
    den, crop = _W["den"], _W["crop"]
    out: dict[str, Any] = {"images": [], "seconds": []}
    for c in counts:
        t0 = time.perf_counter()
        r = den.sample(ctx[None], null_ctx, noise[None], int(c), guidance, keep_x0=(c == traj_steps))
        out["seconds"].append(time.perf_counter() - t0)
        out["images"].append(to_uint8(r["samples"], crop)[0])
        if c == ref_steps:
            out["ref"] = out["images"][-1]
        if c == traj_steps:
            out["traj_x0"] = to_uint8(r["x0"][:, 0], crop)
            out["traj_change"] = r["change"][:, 0]
    return out


def generation_runs(
    unet_path: str,
    scheduler_config: dict,
    guidance: float,
    crop,
    ctx: np.ndarray,
    null_ctx: np.ndarray,
    noise: np.ndarray,
    counts: list[int],
    ref_steps: int,
    traj_steps: int,
    *,
    workers: int = 1,
    threads: int = 1,
) -> dict[str, np.ndarray]:
    """Images at every count of ``counts`` (which must include ``ref_steps`` and ``traj_steps``) per prompt.

    Returns ``images`` uint8 [n, len(counts), H, W], ``ref`` [n, H, W], ``ssim`` [n, len(counts)] to the
    reference, ``seconds`` [n, len(counts)] per single-prompt run, ``traj_x0`` [n, traj_steps, H, W] and
    ``traj_change`` [n, traj_steps], ``traj_ssim`` [n, traj_steps] (x0 after each step vs the reference).
    """
    counts = [int(c) for c in counts]
    if ref_steps not in counts or traj_steps not in counts:
        raise ValueError("counts must include ref_steps and traj_steps")
    jobs = [(ctx[i], null_ctx, noise[i], counts, ref_steps, traj_steps, guidance) for i in range(len(ctx))]
    init = (str(unet_path), scheduler_config, crop, threads)
    t0 = time.perf_counter()
    if workers <= 1:
        _init_worker(*init)
        res = [_one(j) for j in jobs]
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker, initargs=init) as ex:
            res = list(ex.map(_one, jobs, chunksize=1))
    logger.info("%d calibration prompts x %d step counts in %.1f s", len(jobs), len(counts), time.perf_counter() - t0)
    images = np.stack([np.stack(r["images"]) for r in res])
    ref = np.stack([r["ref"] for r in res])
    traj_x0 = np.stack([r["traj_x0"] for r in res])
    return {
        "counts": np.asarray(counts),
        "images": images,
        "ref": ref,
        "ssim": ssim(images, ref[:, None]),
        "seconds": np.array([r["seconds"] for r in res]),
        "traj_x0": traj_x0,
        "traj_change": np.stack([r["traj_change"] for r in res]),
        "traj_ssim": ssim(traj_x0, ref[:, None]),
    }


def load_runs(spec) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One runs file, or several joined with ``+`` (same step counts, same split): arrays concatenated by prompt."""
    import json
    from pathlib import Path

    from dyncompile.errors import DataError

    paths = [Path(p) for p in str(spec).split("+")]
    parts, metas = [], []
    for p in paths:
        if not p.is_file():
            raise DataError(f"runs file not found: {p}")
        d = np.load(p, allow_pickle=False)
        parts.append({k: d[k] for k in d.files if k != "meta"})
        metas.append(json.loads(str(d["meta"])))
    for p, part, m in zip(paths[1:], parts[1:], metas[1:]):
        if list(part["counts"]) != list(parts[0]["counts"]) or m.get("split") != metas[0].get("split"):
            raise DataError(f"{p}: step counts or split differ from {paths[0]}; join only runs made alike")
    runs = {k: (parts[0][k] if k == "counts" else np.concatenate([x[k] for x in parts])) for k in parts[0]}
    meta = {**metas[0], "rows": [r for m in metas for r in m["rows"]], "run": [m.get("run") for m in metas]}
    return runs, meta


def min_steps(ssim_grid: np.ndarray, grid: list[int], tau: float) -> np.ndarray:
    """Smallest grid count with SSIM >= tau per row (the grid's last count where none reaches it)."""
    ok = ssim_grid >= tau
    idx = np.where(ok.any(1), ok.argmax(1), len(grid) - 1)
    return np.asarray(grid)[idx]


def _ridge(x: np.ndarray, y: np.ndarray, lam: float) -> tuple[np.ndarray, float]:
    ym = y.mean()
    w = np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), x.T @ (y - ym))
    return w, float(ym)


def fit_step_head(features: np.ndarray, y: np.ndarray, *, folds: int = 5, lambdas=(1, 3, 10, 30, 100, 300, 1000, 3000), seed: int = 0):
    """Ridge head ``y ~ ((f - mean) / scale) @ w + b``; returns (head dict, cross-validated predictions, report)."""
    f = np.asarray(features, np.float64)
    mean, scale = f.mean(0), f.std(0) + 1e-6
    z = (f - mean) / scale
    n = len(y)
    order = np.random.default_rng(seed).permutation(n)
    fold = np.empty(n, int)
    fold[order] = np.arange(n) % folds
    best = None
    for lam in lambdas:
        pred = np.empty(n)
        for k in range(folds):
            tr, te = fold != k, fold == k
            w, b = _ridge(z[tr], y[tr], lam)
            pred[te] = z[te] @ w + b
        mse = float(((pred - y) ** 2).mean())
        if best is None or mse < best[1]:
            best = (lam, mse, pred)
    lam, mse, cv_pred = best
    w, b = _ridge(z, y, lam)
    var = float(y.var())
    report = {"ridge_lambda": lam, "cv_mse": mse, "cv_r2": 1 - mse / var if var > 0 else 0.0, "folds": folds, "n": n}
    head = {"weights": w.tolist(), "bias": b, "mean": mean.tolist(), "scale": scale.tolist(), "features": "mean_pool"}
    return head, cv_pred, report


def predict_on_grid(log2: np.ndarray, grid: list[int]) -> np.ndarray:
    """Round ``2**log2`` up onto the grid (the runtime's ``predict_steps``)."""
    g = np.asarray(grid)
    idx = np.searchsorted(g, np.exp2(log2) - 1e-9, side="left")
    return g[np.minimum(idx, len(g) - 1)]


def calibrate_offset(cv_log2: np.ndarray, ssim_grid: np.ndarray, grid: list[int], tau: float, target: float):
    """Smallest offset on log2 giving >= target of the rows an image with SSIM >= tau; (offset, report)."""
    g = list(grid)
    for off in np.arange(-2.0, 4.0001, 0.05):
        steps = predict_on_grid(cv_log2 + off, g)
        idx = np.searchsorted(g, steps)
        conv = ssim_grid[np.arange(len(steps)), idx] >= tau
        if conv.mean() >= target:
            return float(round(off, 2)), {"share_converged": float(conv.mean()), "mean_steps": float(steps.mean())}
    steps = np.full(len(cv_log2), g[-1])
    conv = ssim_grid[:, -1] >= tau
    return 4.0, {"share_converged": float(conv.mean()), "mean_steps": float(steps.mean()), "target_not_met": True}


def stop_outcomes(change: np.ndarray, rule: StopRule) -> np.ndarray:
    """Step at which the rule stops each row, from the per-step x0 changes of its max_steps run.

    Exactly :meth:`Denoiser.sample`'s rule: the first k in [min_steps, max_steps) with change < threshold.
    """
    n, k_max = change.shape
    stop = np.full(n, k_max)
    for i in range(n):
        for k in range(max(rule.min_steps, 2), k_max):
            if change[i, k - 1] < rule.threshold:
                stop[i] = k
                break
    return stop


def calibrate_stop_rule(change: np.ndarray, traj_ssim: np.ndarray, tau: float, target: float, max_steps: int, min_steps: int):
    """Largest threshold whose stopped x0 images reach SSIM >= tau on >= target of the rows; (rule, report)."""
    cands = np.unique(np.quantile(change[:, 1:][np.isfinite(change[:, 1:])], np.linspace(0, 1, 400)))
    best = None
    for thr in cands[::-1]:
        rule = StopRule(float(thr), max_steps, min_steps)
        stop = stop_outcomes(change, rule)
        conv = traj_ssim[np.arange(len(stop)), stop - 1] >= tau
        if conv.mean() >= target:
            best = (rule, {"share_converged": float(conv.mean()), "mean_steps": float(stop.mean())})
            break
    if best is None:
        rule = StopRule(0.0, max_steps, min_steps)
        best = (rule, {"share_converged": float((traj_ssim[:, -1] >= tau).mean()), "mean_steps": float(max_steps),
                       "target_not_met": True})
    return best

