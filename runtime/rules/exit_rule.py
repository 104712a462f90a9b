"""The early-exit rule in numpy: when does a row stop at an exit? A leaf module: numpy only.

One implementation for everybody who needs the decision in numpy: threshold calibration
(:mod:`dyncompile.passes.early_exit.calibrate`) optimises it, the staged runtime step
(:mod:`dyncompile.runtime.early_exit`) applies it per segment, and the If lowering's ONNX builder
(:meth:`dyncompile.passes.early_exit.graph.GraphBuilder.fires`) is tested against it.

Rule (shared by all criteria): a row stops at the first exit ``e`` whose test fires; the last exit
always stops (its threshold is ignored; calibration stores ``None`` there).

* ``entropy``: fires when ``H(p_e) < thresholds[e]`` (natural log, nats).
* ``maxprob``: fires when ``max(p_e) > thresholds[e]``.
* ``patience``: fires when the last ``patience`` exits up to and including ``e`` (``e-patience+1 ..
  e``) all predict the same class **and** ``max(p_e) > thresholds[e]``. With ``thresholds[e] = 0.0``
  that is plain PABEE (Zhou et al. 2020; their patience ``t`` is ``patience = t + 1`` here, i.e.
  ``patience`` counts agreeing exits, not agreeing *extra* exits).

``thresholds[e] is None`` means "exit ``e`` never fires" (its head need not even be computed).
"Always fires" is written with finite numbers so that calibrations stay strict JSON:
``log(C) + 1`` for entropy (entropy never exceeds ``log C``) and ``0.0`` for maxprob/patience.

Internally every criterion is one comparison in *confidence space*: a score (larger = more
confident; ``-H`` for entropy, ``max p`` otherwise, ``-inf`` where the patience window disagrees)
against a confidence threshold (``-t`` for entropy, ``t`` otherwise, ``+inf`` for ``None``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "CRITERIA",
    "LEARNED",
    "always_value",
    "confidence",
    "confidence_thresholds",
    "entropy",
    "exit_fires",
    "exit_scores",
    "first_exit",
    "first_exits",
    "softmax",
    "streak_ok",
    "thresholds_from_confidence",
    "window_agrees",
]

CRITERIA = ("entropy", "maxprob", "patience")
#: The learned exit policy's criterion: scores from :mod:`dyncompile.runtime.rules.exit_policy`, no closed form here.
LEARNED = "learned"


def softmax(z: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in the dtype of ``z`` (the one softmax of the early-exit code)."""
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def entropy(p: np.ndarray) -> np.ndarray:
    """Entropy in nats over the last axis (float64; ``0 log 0 = 0``)."""
    p64 = np.asarray(p).astype(np.float64)
    return -(p64 * np.log(np.clip(p64, 1e-30, 1.0))).sum(axis=-1)


def confidence(p: np.ndarray, criterion: str) -> np.ndarray:
    """Score before any patience window: ``-H(p)`` for entropy, ``max p`` otherwise (float64)."""
    if criterion == "entropy":
        return -entropy(p)
    if criterion in ("maxprob", "patience"):
        return np.asarray(p).astype(np.float64).max(axis=-1)
    raise ValueError(f"unknown criterion {criterion!r}; use one of {', '.join(CRITERIA)}")


def window_agrees(preds: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    """``[N]`` bool: every prediction of the window (``[W, N]``) equals its last one."""
    window = np.asarray(preds)
    return np.all(window == window[-1], axis=0)


def streak_ok(pred: np.ndarray, patience: int) -> np.ndarray:
    """``[E, N]`` bool: exits ``e-patience+1 .. e`` all predict the same class as exit ``e``."""
    ok = np.zeros(pred.shape, bool)
    for e in range(patience - 1, pred.shape[0]):
        ok[e] = window_agrees(pred[e - patience + 1 : e + 1])
    return ok


def exit_scores(exit_probs: np.ndarray, criterion: str, patience: int = 2, policy=None) -> np.ndarray:
    """Confidence scores ``[E, N]`` (float64; larger = more confident; ``-inf`` = may not exit here).

    Criterion ``learned``: the scores of ``policy`` (a :class:`dyncompile.runtime.rules.exit_policy.ExitPolicy`),
    compared with the thresholds as they are (the exit fires when ``score > threshold``).
    """
    p = np.asarray(exit_probs)
    if criterion == LEARNED:
        if policy is None:
            raise ValueError("criterion 'learned' needs the exit policy (policy=ExitPolicy)")
        return policy.scores(p)
    s = confidence(p, criterion)
    if criterion == "patience":
        return np.where(streak_ok(p.argmax(axis=-1), patience), s, -np.inf)
    return s


def confidence_thresholds(thresholds: Sequence[float | None], criterion: str) -> np.ndarray:
    """Thresholds as written in a calibration -> confidence thresholds (``None`` -> ``+inf``)."""
    out = np.empty(len(thresholds), np.float64)
    for e, t in enumerate(thresholds):
        if t is None:
            out[e] = np.inf
        elif criterion == "entropy":
            out[e] = -float(t)
        else:
            out[e] = float(t)
    return out


def always_value(criterion: str, n_classes: int) -> float:
    """A finite threshold that always fires (entropy never exceeds ``log C``; probabilities are > 0)."""
    return float(math.log(n_classes) + 1.0) if criterion == "entropy" else 0.0


def thresholds_from_confidence(tc: np.ndarray, criterion: str, n_classes: int) -> list[float | None]:
    """Inverse of :func:`confidence_thresholds`; the last exit is stored as ``None`` (it always stops)."""
    out: list[float | None] = []
    for e, t in enumerate(tc):
        if e == len(tc) - 1 or t == np.inf:
            out.append(None)
        elif t == -np.inf:
            out.append(always_value(criterion, n_classes))
        else:
            out.append(float(-t) if criterion == "entropy" else float(t))
    return out


def first_exit(scores: np.ndarray, tc: np.ndarray) -> np.ndarray:
    """``[N]`` index of the first exit whose score beats its confidence threshold (else the last exit)."""
    fires = scores > tc[:, None]
    fires[-1] = True
    return fires.argmax(axis=0)


def first_exits(
    exit_probs: np.ndarray, thresholds: Sequence[float | None], criterion: str, patience: int = 2
) -> np.ndarray:
    """``[N]`` int64 exit index of every row of ``exit_probs`` ``[E, N, C]`` under ``thresholds``."""
    p = np.asarray(exit_probs)
    if p.shape[1] == 0:
        return np.zeros(0, np.int64)
    scores = exit_scores(p, criterion, patience)
    return first_exit(scores, confidence_thresholds(thresholds, criterion)).astype(np.int64)


def exit_fires(
    probs: np.ndarray,
    threshold: float | None,
    criterion: str,
    patience: int = 2,
    window_preds: Sequence[np.ndarray] = (),
) -> np.ndarray:
    """``[N]`` bool: does one exit's test fire (the runtime's per-segment form of :func:`first_exits`).

    ``probs`` ``[N, C]`` are this exit's probabilities; ``window_preds`` (patience only) the argmax
    predictions of the exits up to and including this one, oldest first. With fewer than ``patience``
    of them the window is not full yet and the exit cannot fire.
    """
    n = probs.shape[0]
    if threshold is None or (criterion == "patience" and len(window_preds) < patience):
        return np.zeros(n, bool)
    s = confidence(probs, criterion)
    if criterion == "patience":
        s = np.where(window_agrees(list(window_preds)[-patience:]), s, -np.inf)
    return s > confidence_thresholds([threshold], criterion)[0]
