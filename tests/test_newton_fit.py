"""The Newton exit-head fit (dyncompile.passes.early_exit.newton) on synthetic data."""

from __future__ import annotations

import numpy as np
import pytest

from dyncompile.passes.early_exit.checks import CalibrationError
from dyncompile.passes.early_exit.fit import fit_exit_heads
from dyncompile.passes.early_exit.newton import (
    _fit_linear,
    _openblas_thread_api,
    blas_threads,
    fit_exit_heads_newton,
)


def _softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _problem(n=400, f=40, c=2, seed=0, noise=1.5):
    """Features with a linear class signal plus noise; a 'teacher' that is a noisy linear model of them."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, c, n)
    centers = rng.standard_normal((c, f)) * 0.8
    x = (centers[y] + rng.standard_normal((n, f)) * noise).astype(np.float32)
    teacher = _softmax(x @ rng.standard_normal((f, c)) * 0.3 + 2.0 * np.eye(c)[y])
    return x, teacher, y


def _objective_grad(u, q, w, b, l2):
    p = _softmax(u.astype(np.float64) @ w + b)
    return u.T @ (p - q) / len(u) + l2 * w, (p - q).mean(0)


@pytest.mark.parametrize("c", [2, 3])
def test_fit_linear_solves_the_stated_objective(c):
    """At the returned (W, b) the gradient of mean CE + l2/2 ||W||^2 vanishes (it is the optimum)."""
    x, teacher, y = _problem(c=c)
    u = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
    q = 0.5 * teacher + 0.5 * np.eye(c)[y]
    w, b = _fit_linear(u, q, 1e-2)
    gw, gb = _objective_grad(u, q, w, b, 1e-2)
    assert np.abs(gw).max() < 1e-4 and np.abs(gb).max() < 1e-4  # float32 products
    # negative control: a perturbed solution is not stationary
    gw2, _ = _objective_grad(u, q, w * 1.1, b, 1e-2)
    assert np.abs(gw2).max() > 1e-3


def test_newton_matches_gradient_descent_fit_quality():
    """Same objective, same folds: out-of-fold agreement within a few points of the Adam fit."""
    x, teacher, y = _problem(n=600, f=30)
    feats = [x, x[:, :10].copy()]
    a = fit_exit_heads(feats, teacher.astype(np.float32), y, pooling="cls", hidden=None, folds=5)
    b = fit_exit_heads_newton(feats, teacher, y, pooling="cls", folds=5, pca_dim=None)
    for ea, eb in zip(a.oof_agreement, b.oof_agreement):
        assert abs(ea - eb) < 3.0
    # the heads are plain linear heads on raw features and reproduce the OOF-free predictions
    p = b.heads[0].predict_proba(x)
    assert p.shape == (600, 2) and np.allclose(p.sum(1), 1, atol=1e-5)
    assert b.oof_probs.shape == (2, 600, 2)
    assert b.config["solver"] == "newton"


def test_pca_dim_restricts_the_subspace_and_is_deterministic():
    x, teacher, y = _problem(n=300, f=60)
    r1 = fit_exit_heads_newton([x], teacher, y, pooling="cls", pca_dim=8, seed=1)
    r2 = fit_exit_heads_newton([x], teacher, y, pooling="cls", pca_dim=8, seed=1)
    assert np.array_equal(r1.oof_probs, r2.oof_probs)
    w = r1.heads[0].layers[0][0].astype(np.float64)
    # the weight difference lies in an 8-dim subspace of the standardised features
    z_dir = (w[:, 1] - w[:, 0]) * x.std(0)
    assert np.linalg.norm(z_dir) > 0
    full = fit_exit_heads_newton([x], teacher, y, pooling="cls", pca_dim=None, seed=1)
    assert not np.allclose(full.heads[0].layers[0][0], r1.heads[0].layers[0][0])


def test_newton_without_labels_distils_the_teacher():
    x, teacher, _ = _problem(n=300)
    res = fit_exit_heads_newton([x], teacher, None, pooling="cls", folds=3)
    assert res.oof_accuracy == [None]
    assert res.oof_agreement[0] > 70.0  # well above the 50 % of chance on two balanced classes


def test_newton_errors():
    x, teacher, y = _problem(n=40)
    with pytest.raises(CalibrationError, match="features is empty"):
        fit_exit_heads_newton([], teacher, y)
    with pytest.raises(CalibrationError, match="must be \\[N, F\\]"):
        fit_exit_heads_newton([x[:10]], teacher, y)
    with pytest.raises(CalibrationError, match="all 40 labels are class 0"):
        fit_exit_heads_newton([x], teacher, np.zeros(40, int))
    with pytest.raises(CalibrationError, match="not probabilities"):
        fit_exit_heads_newton([x], teacher * 3, y)
    with pytest.raises(CalibrationError, match="too few"):
        fit_exit_heads_newton([x[:6]], teacher[:6], y[:6], folds=5)
    with pytest.raises(CalibrationError, match="pca_dim"):
        fit_exit_heads_newton([x], teacher, y, pca_dim=0)


def test_blas_threads_restores_the_thread_count():
    api = _openblas_thread_api()
    if api is None:
        pytest.skip("numpy is not linked against OpenBLAS here")
    get, _ = api
    before = get()
    with blas_threads(1):
        assert get() == 1
    assert get() == before


def test_auto_pca_dim_scales_with_rows():
    from dyncompile.passes.early_exit.newton import auto_pca_dim

    assert auto_pca_dim(1600) == 128 and auto_pca_dim(320) == 32 and auto_pca_dim(50) == 16
    x, teacher, y = _problem(n=400, f=60)
    res = fit_exit_heads_newton([x], teacher, y, pooling="cls")  # default "auto": 320 training rows -> 32
    assert res.config["pca_dim"] == 32
