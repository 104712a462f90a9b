"""Choosing tokens from logits: the temperature softmax and one seeded draw (shared by every decode loop)."""

from __future__ import annotations

import numpy as np

__all__ = ["probs_from_logits", "sample_from"]


def probs_from_logits(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Softmax of ``logits / temperature`` in float64 (rows sum to 1)."""
    z = np.asarray(logits, dtype=np.float64) / float(temperature)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def sample_from(p: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn from the (possibly unnormalised, non-negative) weights ``p``."""
    c = np.cumsum(p)
    total = c[-1]
    if not total > 0:
        raise ValueError("cannot sample from an all-zero distribution")
    i = int(np.searchsorted(c, rng.random() * total, side="right"))
    return min(i, len(p) - 1)
