"""Chi-square helpers of the drift guard: the survival function and a 2 x K homogeneity test (numpy only)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dyncompile.errors import DataError

__all__ = ["chi2_sf", "homogeneity_test"]

_MIN_EXPECTED = 5.0


def _gammaincc(a: float, x: float) -> float:
    """Regularised upper incomplete gamma ``Q(a, x)`` (series / Lentz continued fraction)."""
    if x <= 0:
        return 1.0
    log_pre = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_pre))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return min(1.0, math.exp(log_pre) * h)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    return _gammaincc(df / 2.0, max(float(x), 0.0) / 2.0)


def _merge_bins(ref: np.ndarray, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge adjacent bins (layers are ordered) until each expected count is >= 5 in both rows."""
    n_ref, n_obs = ref.sum(), obs.sum()
    groups: list[list[float]] = []
    cur = [0.0, 0.0]
    for r, o in zip(ref, obs):
        cur[0] += r
        cur[1] += o
        pooled = (cur[0] + cur[1]) / (n_ref + n_obs)
        if min(pooled * n_ref, pooled * n_obs) >= _MIN_EXPECTED:
            groups.append(cur)
            cur = [0.0, 0.0]
    if cur[0] + cur[1] > 0:
        if groups:
            groups[-1][0] += cur[0]
            groups[-1][1] += cur[1]
        else:
            groups.append(cur)
    g = np.array(groups, dtype=np.float64).reshape(-1, 2)
    return g[:, 0], g[:, 1]


def homogeneity_test(ref_counts: Sequence[float], obs_counts: Sequence[float]) -> tuple[float, int, float]:
    """Chi-square test that two count histograms over the same ordered bins come from one distribution.

    Returns ``(statistic, degrees of freedom, p-value)``; adjacent bins are merged until every expected
    count is >= 5. One bin left (nothing to compare): ``(0.0, 0, 1.0)``.
    """
    ref = np.asarray(ref_counts, np.float64)
    obs = np.asarray(obs_counts, np.float64)
    if ref.shape != obs.shape or ref.ndim != 1:
        raise DataError(f"histograms must be 1-D and of one length, got {ref.shape} and {obs.shape}")
    if ref.sum() <= 0 or obs.sum() <= 0:
        raise DataError("both histograms need at least one row")
    r, o = _merge_bins(ref, obs)
    if len(r) < 2:
        return 0.0, 0, 1.0
    n_r, n_o = r.sum(), o.sum()
    pooled = (r + o) / (n_r + n_o)
    stat = float((((r - n_r * pooled) ** 2) / (n_r * pooled)).sum() + (((o - n_o * pooled) ** 2) / (n_o * pooled)).sum())
    df = len(r) - 1
    return stat, df, chi2_sf(stat, df)
