"""Fast exit-head fitting: the linear distillation head in closed form (Newton on PCA features).

The default exit head is linear: ``softmax(x W + b)`` fitted by minimising

    mean_n CE(q_n, softmax(z_n W + b)) + l2 / 2 * ||W||^2,      z = (x - mu) / sd (standardised),

with ``q`` the distillation target (teacher probabilities mixed with the labels) and K-fold
cross-fitting for out-of-fold probabilities. :func:`fit_exit_heads_newton` solves that same problem
much faster than full-batch gradient descent:

* **PCA**: ``z`` is projected (not whitened) onto its top ``pca_dim`` principal components ``E``
  (randomised subspace iteration on ``z^T z``, one BLAS-3 product per exit). Restricted to that
  subspace the objective is unchanged (``||E v|| = ||v||``); the dropped low-variance directions are
  the ones the L2 term shrinks hardest anyway.
* **Newton**: two classes (the common case) reduce exactly to one binary logistic regression in
  ``v = w_1 - w_0`` with penalty ``l2 / 4 * ||v||^2`` (the optimum has ``w_0 = -w_1``); each fold is a
  handful of Newton steps on a ``(pca_dim + 1)``-dimensional system. More classes: the multinomial
  Newton step on the ``pca_dim * C`` system.
* float32 for the big products, float64 for the small Hessians and solves.

The result is a :class:`~dyncompile.passes.early_exit.fit.FitResult` of plain linear
:class:`~dyncompile.passes.early_exit.heads.ExitHead` s (standardisation and projection folded into
``W``), interchangeable with the gradient-descent fit's; the final head is the average of the fold heads
(as there). Standardisation and PCA are fitted on all rows (unsupervised; the labels and teacher of a
held-out fold never reach its head).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from dyncompile.passes.early_exit.checks import CalibrationError, check_fit_inputs
from dyncompile.passes.early_exit.fit import (
    DEFAULT_ALPHA,
    DEFAULT_L2,
    DEFAULT_POOLING,
    DEFAULT_TEMPERATURE,
    FitResult,
    _fold_ids,
    _soft_targets,
)
from dyncompile.passes.early_exit.heads import POOLINGS, ExitHead
from dyncompile.runtime.rules.exit_rule import softmax as _softmax

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_NEWTON_PCA_DIM", "auto_pca_dim", "blas_threads", "fit_exit_heads_newton"]

#: Most principal components the Newton fit keeps: 128 had the best mean out-of-fold agreement on movie-calib
#: (2,000 rows) for MiniLM-L6 and MPNet-base among 64/128/192/256/all (chosen on movie-calib only, never on test).
DEFAULT_NEWTON_PCA_DIM = 128
#: ... and at most one per this many training rows: on 400 movie-calib rows 32 components beat 64, 128,
#: 256 and all of them in out-of-fold agreement (a fold trains on 320 rows).
ROWS_PER_COMPONENT = 10


def auto_pca_dim(n_train: int) -> int:
    """Components for ``n_train`` training rows: ``min(128, max(16, n_train // 10))``."""
    return int(min(DEFAULT_NEWTON_PCA_DIM, max(16, n_train // ROWS_PER_COMPONENT)))
_MAX_NEWTON_STEPS = 30


def _openblas_thread_api() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """(get, set) of the OpenBLAS thread count numpy loaded, or ``None`` (another BLAS, or not found)."""
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line})
    except OSError:
        return None
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "64_"), ("openblas", "")):
            get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            set_ = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                set_.argtypes = [ctypes.c_int]
                return get, set_
    return None


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """Run the block with numpy's OpenBLAS limited to ``n`` threads (no-op for another BLAS).

    The fit is a long sequence of small products and solves; on a busy 2-core machine OpenBLAS's
    threads wait for each other on every one of them (a 100x129 solve took 50 ms instead of 0.5 ms
    under load), so one thread is faster there, and never much slower.
    """
    api = _openblas_thread_api()
    if api is None:
        yield
        return
    get, set_ = api
    old = int(get())
    set_(int(n))
    try:
        yield
    finally:
        set_(old)


def _standardise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z, mu, sd): constant features get sd = inf (z = 0, weight folds to 0)."""
    mu = x.mean(axis=0, dtype=np.float64)
    sd = x.std(axis=0, dtype=np.float64)
    floor = max(float(np.median(sd)) * 1e-3, 1e-12)
    sd = np.where(sd > floor, sd, np.inf)
    z = ((x - mu.astype(np.float32)) / sd.astype(np.float32)).astype(np.float32)
    return z, mu, sd


def _top_components(z: np.ndarray, r: int, rng: np.random.Generator) -> np.ndarray:
    """Orthonormal ``[F, r]`` basis of the top-``r`` principal directions of ``z`` (columns, by variance)."""
    f = z.shape[1]
    if r >= f:
        return np.eye(f, dtype=np.float32)
    cov = z.T @ z  # [F, F] float32 sgemm: the one big product
    k = min(f, r + 16)
    q = rng.standard_normal((f, k)).astype(np.float32)
    for _ in range(3):  # subspace iteration; the spectrum of pooled transformer features decays fast
        q, _ = np.linalg.qr(cov @ q)
    small = (q.T @ cov @ q).astype(np.float64)
    evals, evecs = np.linalg.eigh((small + small.T) / 2)
    top = np.argsort(evals)[::-1][:r]
    return (q.astype(np.float64) @ evecs[:, top]).astype(np.float32)


def _newton_binary(u: np.ndarray, q1: np.ndarray, lam: float) -> tuple[np.ndarray, float]:
    """argmin_{v,c} mean CE(q1, sigmoid(u v + c)) + lam / 2 ||v||^2 (c unpenalised)."""
    m, r = u.shape
    ua = np.concatenate([u, np.ones((m, 1), np.float32)], axis=1)
    theta = np.zeros(r + 1)
    pbar = float(np.clip(q1.mean(), 1e-6, 1 - 1e-6))
    theta[-1] = math.log(pbar / (1 - pbar))
    reg = np.full(r + 1, lam)
    reg[-1] = 0.0
    for _ in range(_MAX_NEWTON_STEPS):
        a = ua @ theta.astype(np.float32)
        p = 1.0 / (1.0 + np.exp(-a.astype(np.float64)))
        grad = (ua.T @ (p - q1).astype(np.float32)).astype(np.float64) / m + reg * theta
        s = (p * (1 - p)).astype(np.float32)
        hess = (ua.T @ (ua * s[:, None])).astype(np.float64) / m + np.diag(reg) + 1e-10 * np.eye(r + 1)
        step = np.linalg.solve(hess, grad)
        theta -= step
        if float(np.abs(step).max()) < 1e-6:
            break
    return theta[:-1], float(theta[-1])


def _newton_multinomial(u: np.ndarray, q: np.ndarray, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """argmin_{W,b} mean CE(q, softmax(u W + b)) + lam / 2 ||W||^2 (b unpenalised), W [r, C]."""
    m, r = u.shape
    c = q.shape[1]
    ua = np.concatenate([u, np.ones((m, 1), np.float32)], axis=1)
    d = r + 1
    theta = np.zeros((d, c))
    theta[-1] = np.log(np.clip(q.mean(0), 1e-6, 1.0))
    reg = np.full(d, lam)
    reg[-1] = 1e-8  # the bias is (almost) free; a tiny ridge fixes softmax's shift invariance
    for _ in range(_MAX_NEWTON_STEPS):
        p = _softmax((ua @ theta.astype(np.float32)).astype(np.float64))
        grad = (ua.T @ (p - q).astype(np.float32)).astype(np.float64) / m + reg[:, None] * theta
        hess = np.zeros((d, c, d, c))
        for i in range(c):
            for j in range(i, c):
                s = (p[:, i] * ((i == j) - p[:, j])).astype(np.float32)
                block = (ua.T @ (ua * s[:, None])).astype(np.float64) / m
                hess[:, i, :, j] = block
                hess[:, j, :, i] = block.T
        hess = hess.reshape(d * c, d * c) + np.diag(np.repeat(reg, c)) + 1e-10 * np.eye(d * c)
        step = np.linalg.solve(hess, grad.reshape(-1)).reshape(d, c)
        theta -= step
        if float(np.abs(step).max()) < 1e-6:
            break
    return theta[:-1], theta[-1]


def _fit_linear(u: np.ndarray, q: np.ndarray, l2: float) -> tuple[np.ndarray, np.ndarray]:
    """(W [r, C], b [C]) minimising mean CE(q, softmax(u W + b)) + l2 / 2 ||W||^2."""
    if q.shape[1] == 2:
        v, c = _newton_binary(u, q[:, 1], l2 / 2.0)
        return np.stack([-v / 2, v / 2], axis=1), np.array([-c / 2, c / 2])
    return _newton_multinomial(u, q, l2)


def fit_exit_heads_newton(
    features: Sequence[np.ndarray],
    teacher_probs: np.ndarray,
    labels: np.ndarray | None,
    *,
    pooling: str = DEFAULT_POOLING,
    seed: int = 0,
    folds: int = 5,
    progress: Callable[[int, int, str], None] | None = None,
    alpha: float = DEFAULT_ALPHA,
    temperature: float = DEFAULT_TEMPERATURE,
    l2: float = DEFAULT_L2,
    pca_dim: int | str | None = "auto",
) -> FitResult:
    """Linear exit heads by Newton's method on PCA features, with K-fold out-of-fold probabilities.

    Same inputs and result as :func:`~dyncompile.passes.early_exit.fit.fit_exit_heads` with a
    linear head (``hidden=None``); see the module docstring for the method. ``pca_dim``: components kept,
    ``"auto"`` (default: :func:`auto_pca_dim` of a fold's training rows) or ``None`` for every dimension
    (exact, slower on wide features).

    Raises:
        CalibrationError: empty input, mismatched shapes, non-probabilities, too few rows for the folds.
    """
    with blas_threads(1):
        return _fit(features, teacher_probs, labels, pooling=pooling, seed=seed, folds=folds, progress=progress,
                    alpha=alpha, temperature=temperature, l2=l2, pca_dim=pca_dim)


def _fit(features, teacher_probs, labels, *, pooling, seed, folds, progress, alpha, temperature, l2, pca_dim) -> FitResult:
    t0 = time.perf_counter()
    if pooling not in POOLINGS[:3]:
        raise CalibrationError(f"unknown pooling {pooling!r} for this fit; use one of {', '.join(POOLINGS[:3])} "
                               "(cls+mean+attn heads are trained: heads='trained')")
    if not isinstance(folds, int | np.integer) or folds < 2:
        raise CalibrationError(f"folds must be an int >= 2 (K-fold cross-fitting), got {folds!r}")
    if not 0.0 <= alpha <= 1.0 or temperature <= 0 or l2 <= 0:
        raise CalibrationError(f"bad fitting options alpha={alpha} (0..1), temperature={temperature} (>0), l2={l2} (>0)")
    if pca_dim is not None and pca_dim != "auto" and (not isinstance(pca_dim, int | np.integer) or pca_dim < 1):
        raise CalibrationError(f"pca_dim must be a positive int, 'auto' or None, got {pca_dim!r}")
    feats, teacher, y = check_fit_inputs(features, teacher_probs, labels)
    n, c = teacher.shape
    if n < 2 * folds:
        raise CalibrationError(f"{n} rows are too few for {folds}-fold cross-fitting; use at least {2 * folds} rows")

    if pca_dim == "auto":
        pca_dim = auto_pca_dim(n - math.ceil(n / folds))  # rows a fold head trains on (n minus the largest fold)
    rng = np.random.default_rng(seed)
    fold = _fold_ids(y if y is not None else teacher.argmax(1), folds, rng)
    q = _soft_targets(teacher, y, alpha, temperature)
    teacher_pred = teacher.argmax(1)
    heads: list[ExitHead] = []
    oof = np.zeros((len(feats), n, c), np.float32)
    oof_acc: list[float | None] = []
    oof_agr: list[float] = []
    for e, x in enumerate(feats):
        x = x.astype(np.float32, copy=False)
        z, mu, sd = _standardise(x)
        basis = _top_components(z, pca_dim or z.shape[1], np.random.default_rng([seed, e]))
        u = z @ basis
        ws, bs = [], []
        for k in range(folds):
            tr = fold != k
            w, b = _fit_linear(np.ascontiguousarray(u[tr]), q[tr], l2)
            oof[e, ~tr] = _softmax((u[~tr] @ w.astype(np.float32) + b).astype(np.float64))
            ws.append(w)
            bs.append(b)
        w_u, b_u = np.mean(ws, axis=0), np.mean(bs, axis=0)  # the average of the fold heads (linear: exact)
        w_raw = (basis.astype(np.float64) @ w_u) / sd[:, None]
        b_raw = b_u - mu @ w_raw
        pred = oof[e].argmax(1)
        acc = float((pred == y).mean() * 100) if y is not None else None
        agr = float((pred == teacher_pred).mean() * 100)
        oof_acc.append(acc)
        oof_agr.append(agr)
        heads.append(ExitHead(pooling=pooling, layers=[(w_raw.astype(np.float32), b_raw.astype(np.float32), "none")],
                              info={"exit": e, "oof_accuracy": acc, "oof_agreement": agr}))
        if progress is not None:
            progress(e + 1, len(feats), f"exit {e + 1}/{len(feats)} fitted")
        logger.info("exit head %d/%d: OOF agreement %.2f%%%s", e + 1, len(feats), agr,
                    f", OOF accuracy {acc:.2f}%" if acc is not None else "")
    secs = time.perf_counter() - t0
    config = {"solver": "newton", "pooling": pooling, "hidden": None, "activation": "none",
              "alpha": alpha if y is not None else 1.0, "temperature": temperature, "l2": l2, "pca_dim": pca_dim,
              "folds": folds, "seed": seed, "combine": "average"}
    for h in heads:
        h.info["recipe"] = config
    logger.info("fitted %d exit heads (Newton, %d folds) in %.1fs", len(feats), folds, secs)
    return FitResult(heads=heads, oof_probs=oof, oof_accuracy=oof_acc, oof_agreement=oof_agr, fit_seconds=secs,
                     config=config)
