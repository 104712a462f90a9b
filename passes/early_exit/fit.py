"""Fitting exit heads: distillation towards the full model with K-fold cross-fitting (numpy only).

:func:`fit_exit_heads` fits one head per exit by distillation (cross-entropy to a mix of the full
model's temperature-softened probabilities and the labels, L2, full-batch Adam) and K-fold
cross-fitting, whose *out-of-fold* probabilities are what thresholds are calibrated on (in-sample
probabilities are over-confident and would make the calibration promise a speed-up that the heads
cannot deliver on new data). The shipped head of an exit is the average of its K fold heads (exactly
the mean of their logits, still one dense stack), with the standardisation folded into its first layer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dyncompile.passes.early_exit.checks import CalibrationError, check_fit_inputs
from dyncompile.passes.early_exit.heads import POOLINGS, ExitHead, activate
from dyncompile.runtime.rules.exit_rule import softmax

logger = logging.getLogger(__name__)

__all__ = [
    "FitResult",
    "Standardisation",
    "adam_fit",
    "average_heads",
    "fit_exit_heads",
    "fit_standardisation",
]

# Defaults of the fitting recipe, chosen on movie-calib cross-validation and movie-train (never on
# movie-test); see fit_exit_heads' docstring.
DEFAULT_POOLING = "cls+mean"
DEFAULT_HIDDEN = None
DEFAULT_L2 = 1e-2
DEFAULT_ALPHA = 0.5
DEFAULT_TEMPERATURE = 1.0
DEFAULT_STEPS = 300
DEFAULT_LR = 0.02
DEFAULT_PCA_DIM = 256


@dataclasses.dataclass
class FitResult:
    """What :func:`fit_exit_heads` returns.

    Attributes:
        heads: one :class:`ExitHead` per exit, fitted on all rows.
        oof_probs: ``[E, N, C]`` float32 out-of-fold probabilities (row ``n`` predicted by the head
            fitted without ``n``'s fold) — calibrate thresholds on these.
        oof_accuracy: per exit, % of rows whose OOF prediction equals the label (``None`` without labels).
        oof_agreement: per exit, % of rows whose OOF prediction equals the full model's.
        fit_seconds: wall time of the whole fit.
        config: the recipe used (JSON-able).
    """

    heads: list[ExitHead]
    oof_probs: np.ndarray
    oof_accuracy: list[float | None]
    oof_agreement: list[float]
    fit_seconds: float
    config: dict[str, Any]


def _fold_ids(strata: np.ndarray, folds: int, rng: np.random.Generator) -> np.ndarray:
    """Stratified, shuffled fold assignment (deterministic given rng)."""
    fold = np.empty(len(strata), np.int64)
    offset = 0
    for cls in np.unique(strata):
        idx = np.flatnonzero(strata == cls)
        idx = idx[rng.permutation(len(idx))]
        fold[idx] = (np.arange(len(idx)) + offset) % folds
        offset += len(idx)
    return fold


def _soft_targets(teacher: np.ndarray, labels: np.ndarray | None, alpha: float, temperature: float) -> np.ndarray:
    t = np.clip(teacher.astype(np.float64), 1e-12, 1.0)
    if temperature != 1.0:
        t = softmax(np.log(t) / temperature)
    if labels is None or alpha >= 1.0:
        return t.astype(np.float32)
    onehot = np.eye(teacher.shape[1])[labels]
    return (alpha * t + (1.0 - alpha) * onehot).astype(np.float32)


@dataclasses.dataclass
class Standardisation:
    """Standardisation (+ optional PCA) fitted on the rows of one exit: z = (x - mu) / sd @ P."""

    mu: np.ndarray
    sd: np.ndarray
    proj: np.ndarray | None

    def apply(self, x: np.ndarray) -> np.ndarray:
        """Standardise (and project) the rows ``x``."""
        z = (x - self.mu) / self.sd
        if self.proj is not None:
            z = z @ self.proj
        return z.astype(np.float32, copy=False)

    def fold_into(self, w: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(W, b) acting on z -> (W', b') acting on raw x."""
        w64 = w.astype(np.float64)
        if self.proj is not None:
            w64 = self.proj.astype(np.float64) @ w64
        w_raw = w64 / self.sd.astype(np.float64)[:, None]
        b_raw = b.astype(np.float64) - self.mu.astype(np.float64) @ w_raw
        return w_raw.astype(np.float32), b_raw.astype(np.float32)


def fit_standardisation(x: np.ndarray, pca_dim: int | None) -> Standardisation:
    """Per-feature standardisation of ``x`` [N, F] (+ the top ``pca_dim`` whitened principal components)."""
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=0)
    sd = x64.std(axis=0)
    # Dimensions that are (nearly) constant carry no signal; keep them from blowing up to huge z.
    floor = max(float(np.median(sd)) * 1e-3, 1e-12)
    sd = np.where(sd > floor, sd, np.inf)  # z = 0 for constant features, their weight folds to 0
    proj = None
    if pca_dim is not None and pca_dim < x.shape[1]:
        z = np.where(np.isfinite(sd), (x64 - mu) / np.where(np.isfinite(sd), sd, 1.0), 0.0)
        cov = z.T @ z / max(len(z) - 1, 1)
        evals, evecs = np.linalg.eigh(cov)
        order = np.argsort(evals)[::-1][:pca_dim]
        # whiten the kept components so that the optimiser sees unit-variance inputs
        proj = evecs[:, order] / np.sqrt(np.maximum(evals[order], 1e-12))[None, :]
        # deterministic sign: largest-magnitude loading positive
        sign = np.sign(proj[np.abs(proj).argmax(axis=0), np.arange(proj.shape[1])])
        proj = (proj * np.where(sign == 0, 1.0, sign)[None, :]).astype(np.float32)
    return Standardisation(mu.astype(np.float32), sd.astype(np.float32), proj)


def adam_fit(
    z: np.ndarray,
    q: np.ndarray,
    masks: np.ndarray,
    hidden: int | None,
    activation: str,
    l2: float,
    steps: int,
    lr: float,
    rng: np.random.Generator,
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Fit K heads at once by full-batch Adam, head k on the rows where ``masks[:, k]`` is set.

    Each head minimises mean_{its rows} CE(q, softmax(f_k(z))) + l2/2 * ||its weights||^2. The K
    problems are independent but share every pass over ``z`` (one [N, F] x [F, K*out] product per step
    instead of K), which is what makes K-fold cross-fitting cheap. Returns per head [(W, b), ...].
    """
    n, f = z.shape
    c = q.shape[1]
    k = masks.shape[1]
    counts = masks.sum(axis=0).astype(np.float32)  # [K]
    wrow = (masks / counts[None, :]).astype(np.float32)  # [N, K]: row weight in head k's mean
    prior = np.stack([np.log(np.clip(q[m].mean(0), 1e-6, 1.0)) for m in masks.T]).astype(np.float32)
    if hidden:
        params = [
            (rng.standard_normal((f, k * hidden)) / math.sqrt(f)).astype(np.float32),  # W1: K blocks
            np.zeros((k, hidden), np.float32),
            (rng.standard_normal((k, hidden, c)) * 0.01).astype(np.float32),  # W2
            prior,
        ]
    else:
        params = [np.zeros((f, k * c), np.float32), prior]
    m1 = [np.zeros_like(p) for p in params]
    m2 = [np.zeros_like(p) for p in params]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    zt = np.ascontiguousarray(z.T)
    for t in range(1, steps + 1):
        if hidden:
            w1, bb1, w2, bb2 = params
            a = (z @ w1).reshape(n, k, hidden) + bb1
            h = activate(a, activation)
            logits = np.einsum("nkh,khc->nkc", h, w2) + bb2
            g = (softmax(logits) - q[:, None, :]) * wrow[:, :, None]  # [N, K, C]
            gw2 = np.einsum("nkh,nkc->khc", h, g) + l2 * w2
            gh = np.einsum("nkc,khc->nkh", g, w2)
            if activation == "tanh":
                ga = gh * (1.0 - h * h)
            elif activation == "relu":
                ga = gh * (a > 0)
            else:
                ga = gh
            gw1 = zt @ ga.reshape(n, k * hidden) + l2 * w1
            grads = [gw1, ga.sum(0), gw2, g.sum(0)]
        else:
            w, bb = params
            logits = (z @ w).reshape(n, k, c) + bb
            g = (softmax(logits) - q[:, None, :]) * wrow[:, :, None]
            grads = [zt @ g.reshape(n, k * c) + l2 * w, g.sum(0)]
        # cosine-decayed step size: a fixed, deterministic schedule (no early stopping on noise)
        step = lr * 0.5 * (1.0 + math.cos(math.pi * (t - 1) / steps))
        c1 = 1 - beta1**t
        c2 = 1 - beta2**t
        for i, (p, gr) in enumerate(zip(params, grads, strict=True)):
            m1[i] *= beta1
            m1[i] += (1 - beta1) * gr
            m2[i] *= beta2
            m2[i] += (1 - beta2) * gr * gr
            p -= (step / c1) * m1[i] / (np.sqrt(m2[i] / c2) + eps)
    out = []
    for j in range(k):
        if hidden:
            w1, bb1, w2, bb2 = params
            out.append([(w1[:, j * hidden : (j + 1) * hidden].copy(), bb1[j].copy()), (w2[j].copy(), bb2[j].copy())])
        else:
            w, bb = params
            out.append([(w[:, j * c : (j + 1) * c].copy(), bb[j].copy())])
    return out


def _make_head(prep: Standardisation, dense: list[tuple[np.ndarray, np.ndarray]], pooling: str, activation: str) -> ExitHead:
    w0, b0 = prep.fold_into(*dense[0])
    if len(dense) == 2:
        return ExitHead(pooling=pooling, layers=[(w0, b0, activation), (dense[1][0], dense[1][1], "none")])
    return ExitHead(pooling=pooling, layers=[(w0, b0, "none")])


def average_heads(heads: Sequence[ExitHead]) -> ExitHead:
    """One head whose logits are the mean of the given heads' logits (exactly).

    Linear heads: average W and b. One-hidden-layer heads: concatenate the hidden units and stack the
    output weights divided by K (a K-times wider hidden layer, still one dense stack).
    """
    k = len(heads)
    if len(heads[0].layers) == 1:
        w = np.mean([h.layers[0][0].astype(np.float64) for h in heads], axis=0)
        b = np.mean([h.layers[0][1].astype(np.float64) for h in heads], axis=0)
        return ExitHead(pooling=heads[0].pooling, layers=[(w.astype(np.float32), b.astype(np.float32), "none")])
    act = heads[0].layers[0][2]
    w1 = np.concatenate([h.layers[0][0] for h in heads], axis=1)
    b1 = np.concatenate([h.layers[0][1] for h in heads])
    w2 = np.concatenate([h.layers[1][0] for h in heads], axis=0) / k
    b2 = np.mean([h.layers[1][1].astype(np.float64) for h in heads], axis=0)
    return ExitHead(pooling=heads[0].pooling, layers=[(w1, b1, act), (w2.astype(np.float32), b2.astype(np.float32), "none")])


def fit_exit_heads(
    features: Sequence[np.ndarray],
    teacher_probs: np.ndarray,
    labels: np.ndarray | None,
    *,
    pooling: str = DEFAULT_POOLING,
    hidden: int | None = DEFAULT_HIDDEN,
    seed: int = 0,
    folds: int = 5,
    progress: Callable[[int, int, str], None] | None = None,
    activation: str = "tanh",
    alpha: float = DEFAULT_ALPHA,
    temperature: float = DEFAULT_TEMPERATURE,
    l2: float = DEFAULT_L2,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    pca_dim: int | None = DEFAULT_PCA_DIM,
) -> FitResult:
    """Fit one exit head per exit, with K-fold cross-fitted out-of-fold probabilities.

    Args:
        features: one ``[N, F_e]`` array per exit, pooled with ``pooling`` (see :func:`pool_features`).
        teacher_probs: ``[N, C]`` softmax of the full model (the distillation target).
        labels: ``[N]`` gold labels, or ``None`` (pure distillation).
        pooling: recorded in the heads (the features must already be pooled this way).
        hidden: ``None`` for a linear head; else the width of one hidden layer (``activation``).
        seed: all randomness (fold split, initialisation) derives from it; same seed, same heads.
        folds: K of the cross-fitting (>= 2). Total fits: ``E * (K + 1)``.
        progress: called as ``progress(done, total, message)`` after every fit.
        activation: of the hidden layer: ``tanh``, ``relu`` or ``none``.
        alpha: target = ``alpha * teacher_T + (1 - alpha) * onehot(label)`` (ignored without labels).
        temperature: softens the teacher's probabilities before mixing (``T = 1``: as they are).
        l2: weight decay on the (standardised-input) weights.
        steps: full-batch Adam iterations.
        lr: Adam's peak step size (cosine decay).
        pca_dim: hidden heads only — fit on the top ``pca_dim`` whitened principal components of the
            standardised features (folded into the first layer afterwards); ``None`` to fit on all.

    Returns:
        :class:`FitResult` with the heads (fitted on all rows) and the out-of-fold probabilities.

    Raises:
        CalibrationError: empty input, mismatched shapes, non-probabilities, too few rows for the folds.
    """
    t0 = time.perf_counter()
    if pooling not in POOLINGS[:3]:
        raise CalibrationError(f"unknown pooling {pooling!r} for this fit; use one of {', '.join(POOLINGS[:3])} "
                               "(cls+mean+attn heads are trained: heads='trained')")
    if activation not in ("none", "tanh", "relu"):
        raise CalibrationError(f"fitting supports activations none/tanh/relu, got {activation!r}")
    if hidden is not None and (not isinstance(hidden, int | np.integer) or hidden < 1):
        raise CalibrationError(f"hidden must be None (linear head) or a positive int, got {hidden!r}")
    if not isinstance(folds, int | np.integer) or folds < 2:
        raise CalibrationError(f"folds must be an int >= 2 (K-fold cross-fitting), got {folds!r}")
    if not 0.0 <= alpha <= 1.0 or temperature <= 0 or l2 < 0 or steps < 1 or lr <= 0:
        raise CalibrationError(
            f"bad fitting options alpha={alpha} (0..1), temperature={temperature} (>0), l2={l2} (>=0), "
            f"steps={steps} (>=1), lr={lr} (>0)"
        )
    feats, teacher, y = check_fit_inputs(features, teacher_probs, labels)
    n, c = teacher.shape
    strata = y if y is not None else teacher.argmax(1)
    if n < 2 * folds:
        raise CalibrationError(f"{n} rows are too few for {folds}-fold cross-fitting; use at least {2 * folds} rows")

    rng = np.random.default_rng(seed)
    fold = _fold_ids(strata, folds, rng)
    q = _soft_targets(teacher, y, alpha, temperature)
    teacher_pred = teacher.argmax(1)
    n_exits = len(feats)
    total = n_exits
    done = 0
    heads: list[ExitHead] = []
    oof = np.zeros((n_exits, n, c), np.float32)
    oof_acc: list[float | None] = []
    oof_agr: list[float] = []
    kw = dict(pooling=pooling, hidden=int(hidden) if hidden else None, activation=activation, l2=l2, steps=steps,
              lr=lr, pca_dim=pca_dim)
    for e, x in enumerate(feats):
        x = x.astype(np.float32, copy=False)
        prep = fit_standardisation(x, pca_dim if hidden else None)
        z = prep.apply(x)
        masks = np.stack([fold != k for k in range(folds)], 1)
        dense = adam_fit(z, q, masks, kw["hidden"], activation, l2, steps, lr, np.random.default_rng([seed, e]))
        fold_heads = [_make_head(prep, d, pooling, activation) for d in dense]
        for k in range(folds):
            oof[e, fold == k] = fold_heads[k].predict_proba(x[fold == k])
        head = average_heads(fold_heads)
        done += 1
        if progress is not None:
            progress(done, total, f"exit {e + 1}/{n_exits} fitted")
        pred = oof[e].argmax(1)
        acc = float((pred == y).mean() * 100) if y is not None else None
        agr = float((pred == teacher_pred).mean() * 100)
        oof_acc.append(acc)
        oof_agr.append(agr)
        head.info = {"exit": e, "oof_accuracy": acc, "oof_agreement": agr}
        heads.append(head)
        logger.info(
            "exit head %d/%d: OOF agreement %.2f%%%s", e + 1, n_exits, agr,
            f", OOF accuracy {acc:.2f}%" if acc is not None else "",
        )
    secs = time.perf_counter() - t0
    config = {"pooling": pooling, "hidden": kw["hidden"], "activation": activation if hidden else "none",
              "alpha": alpha if y is not None else 1.0, "temperature": temperature, "l2": l2, "steps": steps,
              "lr": lr, "pca_dim": pca_dim if hidden else None, "folds": folds, "seed": seed, "combine": "average"}
    for h in heads:
        h.info["recipe"] = config
    logger.info("fitted %d exit heads (%d fits) in %.1fs", n_exits, total, secs)
    return FitResult(heads=heads, oof_probs=oof, oof_accuracy=oof_acc, oof_agreement=oof_agr, fit_seconds=secs,
                     config=config)

