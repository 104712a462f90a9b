"""Image metrics of the step-saver calibration and bench (numpy; the fashion-diffusion asset's definitions).

* :func:`ssim` — Wang et al. 2004: 11x11 Gaussian window (sigma 1.5), K1 0.01, K2 0.03, valid region, on
  uint8 images scaled to [0, 1] (as ``fd_model.ssim``);
* :func:`frechet` — Fréchet distance between Gaussian fits of two feature sets (``fd_model.frechet``);
* :func:`texture` — mean |4-neighbour Laplacian| over interior foreground pixels (``prep_data.measure``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["ssim", "frechet", "texture", "FOREGROUND"]

FOREGROUND = 16


def _gauss(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    g = np.arange(size, dtype=np.float64) - (size - 1) / 2
    g = np.exp(-(g**2) / (2 * sigma**2))
    return g / g.sum()


def _filter(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Separable valid-mode filtering over the last two axes."""
    k = len(g)
    h, w = x.shape[-2:]
    rows = sum(g[i] * x[..., i : h - k + 1 + i, :] for i in range(k))
    return sum(g[i] * rows[..., :, i : w - k + 1 + i] for i in range(k))


def ssim(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Mean SSIM per image of uint8 ``[N, H, W]`` arrays (or one ``[H, W]`` pair -> a 0-d array)."""
    a = np.asarray(a, np.float64) / 255.0
    b = np.asarray(b, np.float64) / 255.0
    g = _gauss()
    c1, c2 = 0.01**2, 0.03**2
    mu_a, mu_b = _filter(a, g), _filter(b, g)
    saa = _filter(a * a, g) - mu_a**2
    sbb = _filter(b * b, g) - mu_b**2
    sab = _filter(a * b, g) - mu_a * mu_b
    m = ((2 * mu_a * mu_b + c1) * (2 * sab + c2)) / ((mu_a**2 + mu_b**2 + c1) * (saa + sbb + c2))
    return m.mean(axis=(-2, -1))


def frechet(f1: np.ndarray, f2: np.ndarray) -> float:
    """Fréchet distance between the Gaussians fitted to two feature sets (rows are samples)."""
    f1 = np.asarray(f1, np.float64)
    f2 = np.asarray(f2, np.float64)
    m1, m2 = f1.mean(0), f2.mean(0)
    s1, s2 = np.cov(f1, rowvar=False), np.cov(f2, rowvar=False)
    w, v = np.linalg.eigh(s1)
    r1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    m = r1 @ s2 @ r1
    tr_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    return float(((m1 - m2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * tr_sqrt)


def texture(x: np.ndarray) -> np.ndarray:
    """Mean |Laplacian| inside the item of uint8 ``[N, 28, 28]`` images (the captions' texture measure)."""
    xf = x.astype(np.float32) / 255.0
    fg = x >= FOREGROUND
    area = fg.sum((1, 2)).astype(np.float32)
    p = np.pad(xf, ((0, 0), (1, 1), (1, 1)))
    lap = np.abs(4 * p[:, 1:-1, 1:-1] - p[:, :-2, 1:-1] - p[:, 2:, 1:-1] - p[:, 1:-1, :-2] - p[:, 1:-1, 2:])
    pf = np.pad(fg, ((0, 0), (1, 1), (1, 1)))
    interior = fg & pf[:, :-2, 1:-1] & pf[:, 2:, 1:-1] & pf[:, 1:-1, :-2] & pf[:, 1:-1, 2:]
    n_int = interior.sum((1, 2))
    tex_int = (lap * interior).sum((1, 2)) / np.maximum(n_int, 1)
    tex_fg = (lap * fg).sum((1, 2)) / np.maximum(area, 1)
    return np.where(n_int >= 10, tex_int, tex_fg).astype(np.float32)
