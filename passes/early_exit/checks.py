"""Input checks shared by head fitting and threshold calibration, and their error type."""

from __future__ import annotations

from typing import Any

import numpy as np

from dyncompile.errors import DataError

__all__ = ["CalibrationError", "check_labels", "check_probs", "check_two_classes"]


class CalibrationError(DataError):
    """Exit-head fitting or threshold calibration got input it cannot use (the message says how to fix it)."""


def check_probs(p: np.ndarray, what: str, fix: str) -> None:
    """``p`` must be finite probabilities (non-negative, rows summing to 1 within 1e-3)."""
    if not np.all(np.isfinite(p)):
        raise CalibrationError(f"{what} contains NaN or infinite values; {fix}")
    if np.any(p < -1e-6) or np.any(np.abs(p.sum(axis=-1) - 1.0) > 1e-3):
        raise CalibrationError(
            f"{what} are not probabilities (negative entries or rows not summing to 1); {fix} "
            "(apply softmax to logits first)"
        )


def check_two_classes(y: np.ndarray, why: str) -> None:
    """Calibration labels of a single class are an error; ``why`` continues the message."""
    if len(np.unique(y)) < 2:
        raise CalibrationError(f"all {len(y)} labels are class {int(y[0])}{why}")


def check_labels(labels: Any, n: int, c: int, what: str = "labels") -> np.ndarray:
    """``labels`` as int64 ``[N]`` class indices below ``c``, or a :class:`CalibrationError` naming ``what``."""
    y = np.asarray(labels)
    if y.shape != (n,):
        raise CalibrationError(f"{what} must have shape [N] = ({n},) to match the probabilities, got {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        if np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
            y = y.astype(np.int64)
        else:
            raise CalibrationError(f"{what} must be integer class indices, got dtype {y.dtype}")
    if n and (y.min() < 0 or y.max() >= c):
        raise CalibrationError(
            f"{what} must lie in [0, {c - 1}] (the probabilities have {c} classes), found {int(y.min())}..{int(y.max())}"
        )
    return y.astype(np.int64)



def check_fit_inputs(features, teacher_probs, labels) -> tuple[list[np.ndarray], np.ndarray, np.ndarray | None]:
    """``(features, teacher, labels)`` of an exit-head fit, checked.

    One finite ``[N, F]`` array per exit, ``[N, C]`` teacher probabilities, ``[N]`` integer labels (or None) of
    at least two classes.
    """
    feats = [np.asarray(f) for f in features]
    if not feats:
        raise CalibrationError("no exits: features is empty; pass one [N, F] array per exit")
    teacher = np.asarray(teacher_probs)
    if teacher.ndim != 2 or teacher.shape[0] == 0 or teacher.shape[1] < 2:
        raise CalibrationError(f"teacher_probs must be [N, C] with N >= 1 and C >= 2, got shape {teacher.shape}")
    n, c = teacher.shape
    check_probs(teacher, "teacher_probs", "pass the full model's softmax output")
    for e, f in enumerate(feats):
        if f.ndim != 2 or f.shape[0] != n or f.shape[1] == 0:
            raise CalibrationError(
                f"features[{e}] must be [N, F] with N = {n} rows (as teacher_probs), got shape {f.shape}; "
                "pool the hidden states with pool_features first"
            )
        if not np.all(np.isfinite(f)):
            raise CalibrationError(f"features[{e}] contains NaN or infinite values")
    y = None
    if labels is not None:
        y = check_labels(labels, n, c)
        check_two_classes(
            y,
            "; heads cannot learn to tell classes apart — use a calibration set with every class (or labels=None "
            "to distil the full model alone)",
        )
    return feats, teacher, y
