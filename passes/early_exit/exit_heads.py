"""Exit heads and budgeted exit-threshold calibration: the numerical core of early exit.

An encoder classifier is cut after each layer ``k``; at each cut an *exit head* predicts the class from
the layer-``k`` hidden states, and at run time the model stops at the first exit whose head is
confident enough. This module holds everything about that which is plain numbers (numpy only; no
torch, no ONNX), so that the early-exit pass can lower the result into ONNX ops and the runtime's
reference check can reproduce every decision exactly:

* :func:`pool_features` — ``cls`` (first token), ``mean`` (attention-masked mean over tokens) or
  ``cls+mean`` (their concatenation) pooling of ``[N, S, H]`` hidden states.
* :class:`ExitHead` — ``pooling`` + a stack of dense layers (activation ``none``/``tanh``/``relu``/
  ``gelu``) + softmax. Feature standardisation (and the optional PCA projection used while fitting)
  is folded into the first dense layer, so a head is exactly ``softmax(act(x W1 + b1) W2 + b2)``:
  MatMul/Add/activation/Softmax, nothing else.
* :func:`fit_exit_heads` — fits one head per exit by distillation (cross-entropy to a mix of the full
  model's temperature-softened probabilities and the labels, L2, full-batch Adam) and K-fold
  cross-fitting, whose *out-of-fold* probabilities are what thresholds are calibrated on (in-sample
  probabilities are over-confident and would make the calibration promise a speed-up that the
  heads cannot deliver on new data).
* :func:`calibrate_thresholds` — per-exit thresholds that maximise the saved compute subject to
  "accuracy drop <= budget points" on the calibration data (agreement with the full model when no
  labels are given), for the ``entropy``, ``maxprob`` and ``patience`` criteria.
* :func:`exit_decisions` — the exit index of every row under a :class:`Calibration`; calibration
  reports its figures through this very function, and the runtime's reference check uses it too.

Exit rule (shared by all three criteria): a row stops at the first exit ``e`` whose test fires; the
last exit always stops (its threshold is ignored; calibration stores ``None`` there).

* ``entropy``: fires when ``H(p_e) < thresholds[e]`` (natural log, nats).
* ``maxprob``: fires when ``max(p_e) > thresholds[e]``.
* ``patience``: fires when the last ``patience`` exits up to and including ``e`` (``e-patience+1 ..
  e``) all predict the same class **and** ``max(p_e) > thresholds[e]``. With ``thresholds[e] = 0.0``
  that is plain PABEE (Zhou et al. 2020; their patience ``t`` is ``patience = t + 1`` here, i.e.
  ``patience`` counts agreeing exits, not agreeing *extra* exits); calibration may raise the
  threshold of an exit where agreement alone is not safe enough, or switch the exit off.

``thresholds[e] is None`` means "exit ``e`` never fires" (its head need not even be computed).
"Always fires" is written with finite numbers so that calibrations stay strict JSON:
``log(C) + 1`` for entropy (entropy never exceeds ``log C``) and ``0.0`` for maxprob/patience.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dyncompile.errors import DataError

logger = logging.getLogger(__name__)

__all__ = [
    "ACTIVATIONS",
    "CRITERIA",
    "POOLINGS",
    "Calibration",
    "CalibrationError",
    "ExitHead",
    "FitResult",
    "calibrate_thresholds",
    "exit_decisions",
    "exit_scores",
    "fit_exit_heads",
    "pool_features",
]

POOLINGS = ("cls", "mean", "cls+mean")
ACTIVATIONS = ("none", "tanh", "relu", "gelu")
CRITERIA = ("entropy", "maxprob", "patience")

HEAD_FORMAT = "dyncompile.exit_head/v1"
CALIBRATION_FORMAT = "dyncompile.exit_calibration/v1"

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


class CalibrationError(DataError):
    """Exit-head fitting or threshold calibration got input it cannot use (the message says how to fix it)."""


# --------------------------------------------------------------------------------------------------
# pooling and the head itself


def pool_features(hidden: np.ndarray, attention_mask: np.ndarray | None, pooling: str) -> np.ndarray:
    """Pool layer hidden states ``[N, S, H]`` into head features ``[N, F]`` (float32).

    ``cls``: ``hidden[:, 0, :]`` (F = H). ``mean``: mean over the tokens whose ``attention_mask`` is
    non-zero (F = H; a row with an all-zero mask gives zeros). ``cls+mean``: ``[cls, mean]`` (F = 2H).
    ``attention_mask`` ``[N, S]`` may be ``None`` for ``cls`` (and means "all tokens" for ``mean``).
    """
    if pooling not in POOLINGS:
        raise CalibrationError(f"unknown pooling {pooling!r}; use one of {', '.join(POOLINGS)}")
    hidden = np.asarray(hidden)
    if hidden.ndim != 3 or hidden.shape[1] == 0:
        raise CalibrationError(
            f"hidden states must be [N, S, H] with S >= 1, got shape {hidden.shape}; pass one layer's "
            "output (e.g. hidden_states[k] of a Hugging Face model)"
        )
    hidden = hidden.astype(np.float32, copy=False)
    cls = hidden[:, 0, :]
    if pooling == "cls":
        return np.ascontiguousarray(cls)
    if attention_mask is None:
        mask = np.ones(hidden.shape[:2], np.float32)
    else:
        mask = np.asarray(attention_mask)
        if mask.shape != hidden.shape[:2]:
            raise CalibrationError(
                f"attention_mask shape {mask.shape} does not match hidden states {hidden.shape[:2]} "
                "([N, S]); pass the mask the model was run with"
            )
        mask = (mask != 0).astype(np.float32)
    count = mask.sum(axis=1, keepdims=True)
    mean = np.einsum("nsh,ns->nh", hidden, mask) / np.maximum(count, 1.0)
    mean = mean.astype(np.float32)
    if pooling == "mean":
        return mean
    return np.concatenate([cls, mean], axis=1)


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, below float32 resolution of GELU's output).
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * np.exp(
        -a * a
    )
    return s * y


def _activate(x: np.ndarray, act: str) -> np.ndarray:
    if act == "none":
        return x
    if act == "tanh":
        return np.tanh(x)
    if act == "relu":
        return np.maximum(x, 0)
    if act == "gelu":  # exact (erf) GELU, as ONNX Gelu with approximate="none"
        return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(x.dtype, copy=False)
    raise CalibrationError(f"unknown activation {act!r}; use one of {', '.join(ACTIVATIONS)}")


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _encode_array(a: np.ndarray, encoding: str) -> Any:
    a = np.asarray(a, np.float32)
    if encoding == "list":
        return a.tolist()
    return {
        "dtype": "float32",
        "shape": list(a.shape),
        "base64": base64.b64encode(np.ascontiguousarray(a).astype("<f4").tobytes()).decode("ascii"),
    }


def _decode_array(x: Any, what: str) -> np.ndarray:
    if isinstance(x, dict):
        try:
            shape = tuple(int(s) for s in x["shape"])
            raw = base64.b64decode(x["base64"])
            return np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)
        except (KeyError, ValueError, TypeError) as exc:
            raise CalibrationError(f"exit head {what}: malformed base64 array ({exc})") from exc
    return np.asarray(x, dtype=np.float32)


@dataclasses.dataclass
class ExitHead:
    """One exit head: ``softmax(dense_n(... act(dense_1(pool(h)))))``.

    Attributes:
        pooling: one of :data:`POOLINGS`; how the layer's ``[N, S, H]`` states become features.
        layers: ``[(W [in, out] float32, b [out] float32, activation), ...]``; the last layer's
            output are the logits (its activation is normally ``"none"``). Standardisation of the
            features is already folded into the first layer: feed raw pooled features.
        info: free-form JSON-able facts (exit index, OOF accuracy, fitting recipe).
    """

    pooling: str
    layers: list[tuple[np.ndarray, np.ndarray, str]]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise CalibrationError(f"unknown pooling {self.pooling!r}; use one of {', '.join(POOLINGS)}")
        if not self.layers:
            raise CalibrationError("an exit head needs at least one dense layer")
        fixed = []
        width = None
        for i, (w, b, act) in enumerate(self.layers):
            w = np.asarray(w, np.float32)
            b = np.asarray(b, np.float32)
            if w.ndim != 2 or b.shape != (w.shape[1],):
                raise CalibrationError(
                    f"exit head layer {i}: W must be [in, out] and b [out], got {w.shape} and {b.shape}"
                )
            if width is not None and w.shape[0] != width:
                raise CalibrationError(f"exit head layer {i}: expects {w.shape[0]} inputs, previous layer gives {width}")
            if act not in ACTIVATIONS:
                raise CalibrationError(f"exit head layer {i}: unknown activation {act!r}; use one of {ACTIVATIONS}")
            width = w.shape[1]
            fixed.append((w, b, act))
        self.layers = fixed

    @property
    def in_features(self) -> int:
        return int(self.layers[0][0].shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.layers[-1][0].shape[1])

    def logits(self, features: np.ndarray) -> np.ndarray:
        """Logits ``[N, C]`` (float32) from pooled features ``[N, F]``."""
        x = np.asarray(features, np.float32)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise CalibrationError(
                f"exit head expects pooled features [N, {self.in_features}] ({self.pooling} pooling), got {x.shape}"
            )
        for w, b, act in self.layers:
            x = _activate(x @ w + b, act)
        return x

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        """Class probabilities ``[N, C]`` (float32) from pooled features ``[N, F]``."""
        return _softmax(self.logits(features)).astype(np.float32)

    def predict_proba_hidden(self, hidden: np.ndarray, attention_mask: np.ndarray | None) -> np.ndarray:
        """Class probabilities straight from the layer's hidden states ``[N, S, H]``."""
        return self.predict_proba(pool_features(hidden, attention_mask, self.pooling))

    def to_dict(self, encoding: str = "base64") -> dict[str, Any]:
        """JSON-able description; ``encoding="base64"`` (compact, exact) or ``"list"`` (nested lists, exact)."""
        if encoding not in ("base64", "list"):
            raise CalibrationError(f"unknown encoding {encoding!r}; use 'base64' or 'list'")
        return {
            "format": HEAD_FORMAT,
            "pooling": self.pooling,
            "layers": [
                {"W": _encode_array(w, encoding), "b": _encode_array(b, encoding), "activation": act}
                for w, b, act in self.layers
            ],
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExitHead:
        if not isinstance(d, dict) or d.get("format") != HEAD_FORMAT:
            raise CalibrationError(
                f"not an exit head description (format {d.get('format') if isinstance(d, dict) else type(d)!r}, "
                f"expected {HEAD_FORMAT!r}); write it with ExitHead.to_dict()"
            )
        try:
            layers = [
                (_decode_array(layer["W"], f"layer {i} W"), _decode_array(layer["b"], f"layer {i} b"), layer["activation"])
                for i, layer in enumerate(d["layers"])
            ]
            return cls(pooling=d["pooling"], layers=layers, info=dict(d.get("info", {})))
        except KeyError as exc:
            raise CalibrationError(f"exit head description lacks the field {exc}") from exc


# --------------------------------------------------------------------------------------------------
# fitting


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


def _check_probs(p: np.ndarray, what: str, fix: str) -> None:
    if not np.all(np.isfinite(p)):
        raise CalibrationError(f"{what} contains NaN or infinite values; {fix}")
    if np.any(p < -1e-6) or np.any(np.abs(p.sum(axis=-1) - 1.0) > 1e-3):
        raise CalibrationError(
            f"{what} are not probabilities (negative entries or rows not summing to 1); {fix} "
            "(apply softmax to logits first)"
        )


def _check_two_classes(y: np.ndarray, why: str) -> None:
    """Calibration labels of a single class are an error; ``why`` continues the message."""
    if len(np.unique(y)) < 2:
        raise CalibrationError(f"all {len(y)} labels are class {int(y[0])}{why}")


def _check_labels(labels: Any, n: int, c: int, what: str = "labels") -> np.ndarray:
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
        t = _softmax(np.log(t) / temperature)
    if labels is None or alpha >= 1.0:
        return t.astype(np.float32)
    onehot = np.eye(teacher.shape[1])[labels]
    return (alpha * t + (1.0 - alpha) * onehot).astype(np.float32)


@dataclasses.dataclass
class _Prep:
    """Standardisation (+ optional PCA) fitted on the rows of one exit: z = (x - mu) / sd @ P."""

    mu: np.ndarray
    sd: np.ndarray
    proj: np.ndarray | None

    def apply(self, x: np.ndarray) -> np.ndarray:
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


def _fit_prep(x: np.ndarray, pca_dim: int | None) -> _Prep:
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
    return _Prep(mu.astype(np.float32), sd.astype(np.float32), proj)


def _adam_fit(
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
            h = _activate(a, activation)
            logits = np.einsum("nkh,khc->nkc", h, w2) + bb2
            g = (_softmax(logits) - q[:, None, :]) * wrow[:, :, None]  # [N, K, C]
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
            g = (_softmax(logits) - q[:, None, :]) * wrow[:, :, None]
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


def _make_head(prep: _Prep, dense: list[tuple[np.ndarray, np.ndarray]], pooling: str, activation: str) -> ExitHead:
    w0, b0 = prep.fold_into(*dense[0])
    if len(dense) == 2:
        return ExitHead(pooling=pooling, layers=[(w0, b0, activation), (dense[1][0], dense[1][1], "none")])
    return ExitHead(pooling=pooling, layers=[(w0, b0, "none")])


def _average_heads(heads: Sequence[ExitHead]) -> ExitHead:
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
    combine: str = "average",
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
        alpha: target = ``alpha * teacher_T + (1 - alpha) * onehot(label)`` (ignored without labels).
        temperature: softens the teacher's probabilities before mixing (``T = 1``: as they are).
        l2: weight decay on the (standardised-input) weights.
        steps, lr: full-batch Adam iterations and peak step size (cosine decay).
        pca_dim: hidden heads only — fit on the top ``pca_dim`` whitened principal components of the
            standardised features (folded into the first layer afterwards); ``None`` to fit on all.

    Returns:
        :class:`FitResult` with the heads (fitted on all rows) and the out-of-fold probabilities.

    Raises:
        CalibrationError: empty input, mismatched shapes, non-probabilities, too few rows for the folds.
    """
    t0 = time.perf_counter()
    if pooling not in POOLINGS:
        raise CalibrationError(f"unknown pooling {pooling!r}; use one of {', '.join(POOLINGS)}")
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
    feats = [np.asarray(f) for f in features]
    if not feats:
        raise CalibrationError("no exits: features is empty; pass one [N, F] array per exit")
    teacher = np.asarray(teacher_probs)
    if teacher.ndim != 2 or teacher.shape[0] == 0 or teacher.shape[1] < 2:
        raise CalibrationError(f"teacher_probs must be [N, C] with N >= 1 and C >= 2, got shape {teacher.shape}")
    n, c = teacher.shape
    _check_probs(teacher, "teacher_probs", "pass the full model's softmax output")
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
        y = _check_labels(labels, n, c)
        _check_two_classes(
            y,
            "; heads cannot learn to tell classes apart — use a calibration set with every class (or labels=None "
            "to distil the full model alone)",
        )
    strata = y if y is not None else teacher.argmax(1)
    if n < 2 * folds:
        raise CalibrationError(f"{n} rows are too few for {folds}-fold cross-fitting; use at least {2 * folds} rows")

    rng = np.random.default_rng(seed)
    fold = _fold_ids(strata, folds, rng)
    q = _soft_targets(teacher, y, alpha, temperature)
    teacher_pred = teacher.argmax(1)
    n_exits = len(feats)
    if combine not in ("average", "refit"):
        raise CalibrationError(f"combine must be 'average' or 'refit', got {combine!r}")
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
        prep = _fit_prep(x, pca_dim if hidden else None)
        z = prep.apply(x)
        masks = np.stack([fold != k for k in range(folds)] + ([np.ones(n, bool)] if combine == "refit" else []), 1)
        dense = _adam_fit(z, q, masks, kw["hidden"], activation, l2, steps, lr, np.random.default_rng([seed, e]))
        fold_heads = [_make_head(prep, d, pooling, activation) for d in dense]
        for k in range(folds):
            oof[e, fold == k] = fold_heads[k].predict_proba(x[fold == k])
        head = fold_heads[folds] if combine == "refit" else _average_heads(fold_heads[:folds])
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
              "lr": lr, "pca_dim": pca_dim if hidden else None, "folds": folds, "seed": seed, "combine": combine}
    for h in heads:
        h.info["recipe"] = config
    logger.info("fitted %d exit heads (%d fits) in %.1fs", n_exits, total, secs)
    return FitResult(heads=heads, oof_probs=oof, oof_accuracy=oof_acc, oof_agreement=oof_agr, fit_seconds=secs,
                     config=config)


# --------------------------------------------------------------------------------------------------
# calibration


@dataclasses.dataclass
class Calibration:
    """Per-exit thresholds and what they are expected to give (measured on the calibration rows).

    Attributes:
        thresholds: one per exit; ``None`` = that exit never fires; the last exit always stops (its
            entry is ignored, calibration stores ``None``). Semantics per ``criterion``: see the module
            docstring (entropy: exit when ``H < t``; maxprob: when ``max p > t``; patience: when the
            last ``patience`` exits agree and ``max p > t``).
        criterion: ``"entropy"``, ``"maxprob"`` or ``"patience"``.
        patience: number of consecutive agreeing exits (``patience`` criterion only).
        costs: the cumulative relative costs the calibration optimised (full model = 1.0).
        budget: the accuracy-drop budget asked (points).
        metric: ``"accuracy"`` (labels given) or ``"agreement"`` (with the full model).
        expected_speedup: ``1 / mean cost`` on the calibration rows.
        expected_accuracy, baseline_accuracy: % with early exit / of the full model (``None`` without labels).
        expected_agreement: % of rows whose early-exit prediction equals the full model's.
        exit_histogram: rows stopping at each exit.
        warnings: things the caller should know (small set for the budget, nothing exits, ...).
        reference: set when the budget is measured against another model than the one whose exits were
            calibrated (e.g. the fp32 original of an int8 model; see
            :func:`dyncompile.passes.fit_exit_heads.reference_budget`): that model's accuracy, the part of
            the budget the model itself already spends, and the part left to the exits.
    """

    thresholds: list[float | None]
    criterion: str
    patience: int
    costs: list[float]
    budget: float
    metric: str
    expected_speedup: float
    expected_accuracy: float | None
    baseline_accuracy: float | None
    expected_agreement: float
    exit_histogram: list[int]
    warnings: list[str] = dataclasses.field(default_factory=list)
    n_rows: int = 0
    teacher_temperature: float | None = None
    reference: dict[str, Any] | None = None

    @property
    def num_exits(self) -> int:
        return len(self.thresholds)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["format"] = CALIBRATION_FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        if not isinstance(d, dict) or d.get("format") != CALIBRATION_FORMAT:
            raise CalibrationError(f"not an exit calibration (expected format {CALIBRATION_FORMAT!r})")
        fields = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in fields})
        except TypeError as exc:
            raise CalibrationError(f"exit calibration description is incomplete: {exc}") from exc


def _entropy(p: np.ndarray) -> np.ndarray:
    p64 = p.astype(np.float64)
    return -(p64 * np.log(np.clip(p64, 1e-30, 1.0))).sum(axis=-1)


def _streak_ok(pred: np.ndarray, patience: int) -> np.ndarray:
    """[E, N] bool: exits e-patience+1..e all predict the same class as exit e."""
    n_exits = pred.shape[0]
    ok = np.zeros(pred.shape, bool)
    for e in range(patience - 1, n_exits):
        window = pred[e - patience + 1 : e + 1]
        ok[e] = np.all(window == window[-1], axis=0)
    return ok


def exit_scores(exit_probs: np.ndarray, criterion: str, patience: int = 2) -> np.ndarray:
    """Confidence scores ``[E, N]`` (float64; larger = more confident; ``-inf`` = may not exit here).

    An exit fires when its score exceeds its *confidence threshold*: for ``entropy`` the score is
    ``-H`` and the confidence threshold ``-t``; for ``maxprob``/``patience`` the score is ``max p``
    (``-inf`` where the patience condition fails) and the confidence threshold is ``t``.
    """
    p = np.asarray(exit_probs)
    if criterion == "entropy":
        return -_entropy(p)
    if criterion == "maxprob":
        return p.astype(np.float64).max(axis=-1)
    if criterion == "patience":
        s = p.astype(np.float64).max(axis=-1)
        return np.where(_streak_ok(p.argmax(axis=-1), patience), s, -np.inf)
    raise CalibrationError(f"unknown criterion {criterion!r}; use one of {', '.join(CRITERIA)}")


def _always_value(criterion: str, n_classes: int) -> float:
    return float(math.log(n_classes) + 1.0) if criterion == "entropy" else 0.0


def _to_conf_thresholds(thresholds: Sequence[float | None], criterion: str) -> np.ndarray:
    out = np.empty(len(thresholds), np.float64)
    for e, t in enumerate(thresholds):
        if t is None:
            out[e] = np.inf
        elif criterion == "entropy":
            out[e] = -float(t)
        else:
            out[e] = float(t)
    return out


def _from_conf_thresholds(tc: np.ndarray, criterion: str, n_classes: int) -> list[float | None]:
    out: list[float | None] = []
    for e, t in enumerate(tc):
        if e == len(tc) - 1 or t == np.inf:
            out.append(None)
        elif t == -np.inf:
            out.append(_always_value(criterion, n_classes))
        else:
            out.append(float(-t) if criterion == "entropy" else float(t))
    return out


def _first_exit(scores: np.ndarray, tc: np.ndarray) -> np.ndarray:
    fires = scores > tc[:, None]
    fires[-1] = True
    return fires.argmax(axis=0)


def exit_decisions(exit_probs: np.ndarray, calibration: Calibration) -> np.ndarray:
    """Exit index ``[N]`` (0-based) at which each row stops under ``calibration``.

    The same rule calibration optimised (see the module docstring): first exit whose test fires, else
    the last exit. Works for the runtime's reference check on new data as well.
    """
    p = np.asarray(exit_probs)
    if p.ndim != 3 or p.shape[0] != calibration.num_exits:
        raise CalibrationError(
            f"exit_probs must be [E, N, C] with E = {calibration.num_exits} exits (as calibrated), got shape {p.shape}"
        )
    if p.shape[1] == 0:
        return np.zeros(0, np.int64)
    scores = exit_scores(p, calibration.criterion, calibration.patience)
    tc = _to_conf_thresholds(calibration.thresholds, calibration.criterion)
    return _first_exit(scores, tc).astype(np.int64)


def _fit_temperature(probs: np.ndarray, labels: np.ndarray) -> float:
    """Temperature T minimising the NLL of softmax(log p / T) on the labels (golden-section on log T)."""
    logp = np.log(np.clip(probs.astype(np.float64), 1e-30, 1.0))
    rows = np.arange(len(labels))

    def nll(log_t: float) -> float:
        z = logp / math.exp(log_t)
        z = z - z.max(axis=1, keepdims=True)
        return float(-(z[rows, labels] - np.log(np.exp(z).sum(axis=1))).mean())

    lo, hi = math.log(0.05), math.log(20.0)
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = nll(a), nll(b)
    for _ in range(60):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = nll(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = nll(b)
    return math.exp((lo + hi) / 2)


def _fit_combiner(log_t: np.ndarray, log_e: np.ndarray, labels: np.ndarray, ridge: float = 1e-3) -> np.ndarray:
    """Posterior P(y | full model, exit) as softmax(a log q + b log p + c) fitted by Newton on the labels.

    A conditional-logit model with C + 1 parameters (a, b, class biases c[1:]); returns [N, C] probabilities.
    """
    n, c = log_t.shape
    phi = np.zeros((n, c, c + 1))
    phi[:, :, 0] = log_t
    phi[:, :, 1] = log_e
    for k in range(1, c):
        phi[:, k, k + 1] = 1.0
    theta = np.zeros(c + 1)
    theta[0] = 1.0
    rows = np.arange(n)
    for _ in range(50):
        z = phi @ theta
        pr = _softmax(z)
        mean_phi = np.einsum("nk,nkd->nd", pr, phi)
        grad = (mean_phi - phi[rows, labels]).sum(axis=0) + ridge * theta
        centred = phi - mean_phi[:, None, :]
        hess = np.einsum("nk,nkd,nke->de", pr, centred, centred) + ridge * np.eye(c + 1)
        step = np.linalg.solve(hess, grad)
        theta -= step
        if np.abs(step).max() < 1e-8:
            break
    return _softmax(phi @ theta)


def _fit_logistic(x: np.ndarray, t: np.ndarray, ridge: float = 1e-3) -> np.ndarray:
    """Binary logistic regression by Newton (x [M, D] with a bias column, t [M] in {0, 1}); returns weights."""
    w = np.zeros(x.shape[1])
    for _ in range(100):
        pr = 1.0 / (1.0 + np.exp(-(x @ w)))
        grad = x.T @ (pr - t) + ridge * w
        hess = (x * (pr * (1 - pr))[:, None]).T @ x + ridge * np.eye(x.shape[1])
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    return w


def _disagreement_gains(p: np.ndarray, final: np.ndarray, ref: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """[E, N] expected change in correctness of stopping at each exit, smoothed by a logistic model.

    Only rows where an exit disagrees with the full model matter. On those (pooled over exits) a
    4-parameter logistic regression predicts 'the full model is the right one' from the full model's
    log-probability margin over the exit's class, the exit's own margin, and the exit's depth. The
    expected change is then P(exit right) - P(model right). One smooth, low-variance estimate per row
    instead of a +-1 coin the optimiser can exploit.
    """
    n_exits, n, _ = p.shape
    final_pred = final.argmax(1)
    log_final = np.log(np.clip(final.astype(np.float64), 1e-30, 1.0))
    pred = p.argmax(2)
    log_p = np.log(np.clip(p.astype(np.float64), 1e-30, 1.0))
    feats, target, where = [], [], []
    for e in range(n_exits):
        dis = np.flatnonzero(pred[e] != final_pred)
        if len(dis) == 0:
            continue
        tm = log_final[dis, final_pred[dis]] - log_final[dis, pred[e, dis]]
        hm = log_p[e, dis, pred[e, dis]] - log_p[e, dis, final_pred[dis]]
        feats.append(np.stack([np.ones(len(dis)), tm, hm, np.full(len(dis), costs[e])], 1))
        target.append(np.where(ref[dis] == final_pred[dis], 1.0, np.where(ref[dis] == pred[e, dis], 0.0, np.nan)))
        where.append((e, dis))
    gains = np.zeros((n_exits, n))
    if not feats:
        return gains
    x = np.concatenate(feats)
    t = np.concatenate(target)
    ok = np.isfinite(t)
    one_right = ok.mean()  # rows where one of the two is right (all rows for 2 classes)
    if ok.sum() < 2 or len(np.unique(t[ok])) < 2:
        model_right = np.full(len(x), float(np.nanmean(t)) if ok.any() else 0.5)
    else:
        w = _fit_logistic(x[ok], t[ok])
        model_right = 1.0 / (1.0 + np.exp(-(x @ w)))
    i = 0
    for e, dis in where:
        m = model_right[i : i + len(dis)]
        gains[e, dis] = one_right * (1.0 - 2.0 * m)
        i += len(dis)
    return gains


class _Cascade:
    """Exact evaluation and coordinate-wise optimisation of per-exit confidence thresholds.

    Works in 'confidence' space: exit e fires when score[e, n] > tc[e] (tc = +inf: never; the last
    exit always stops). ``gains`` are [M, E, N] per-row 'value' matrices (e.g. correctness); constraint
    m holds when the sum over rows of gains[m, exit(n), n] is >= required[m]. The Lagrangian phase
    trades cost against gains[0].
    """

    def __init__(self, scores: np.ndarray, gains: np.ndarray, required: np.ndarray, costs: np.ndarray):
        self.scores = scores  # [E, N] float64
        self.gains = gains.astype(np.float64)  # [M, E, N]
        self.required = required.astype(np.float64)  # [M]
        self.costs = costs  # [E]
        self.n_exits, self.n = scores.shape
        self.cols = np.arange(self.n)
        self.order = [np.argsort(-scores[e], kind="stable") for e in range(self.n_exits)]

    def evaluate(self, tc: np.ndarray) -> tuple[float, np.ndarray]:
        ex = _first_exit(self.scores, tc)
        return float(self.costs[ex].sum()), self.gains[:, ex, self.cols].sum(axis=1)

    def feasible(self, totals: np.ndarray) -> np.ndarray:
        return np.all(totals >= self.required[:, None] - 1e-9, axis=0) if totals.ndim == 2 else bool(
            np.all(totals >= self.required - 1e-9)
        )

    def coordinate_options(self, tc: np.ndarray, e: int):
        """All distinct settings of tc[e] with the other thresholds fixed.

        Returns (thresholds [K+1], total_cost [K+1], totals [M, K+1]); option 0 is 'never'.
        """
        fires = self.scores > tc[:, None]
        fires[-1] = True
        reach = ~fires[:e].any(axis=0) if e > 0 else np.ones(self.n, bool)
        after = fires[e + 1 :]
        rest = e + 1 + after.argmax(axis=0)  # where a row goes if it does not stop at e or before
        ex = fires.argmax(axis=0)
        ex_off = np.where(reach, rest, ex)  # exit e switched off
        base_cost = self.costs[ex_off].sum()
        base_tot = self.gains[:, ex_off, self.cols].sum(axis=1)
        order = self.order[e]
        order = order[reach[order]]
        sc = self.scores[e, order]
        finite = np.isfinite(sc)
        order, sc = order[finite], sc[finite]
        if len(order) == 0:
            return np.array([np.inf]), np.array([base_cost]), base_tot[:, None], 0
        dcost = np.cumsum(self.costs[e] - self.costs[rest[order]])
        dtot = np.cumsum(self.gains[:, e, order] - self.gains[:, rest[order], order], axis=1)
        # cut only between distinct values: last index of each group of equal scores
        last = np.flatnonzero(np.r_[sc[1:] != sc[:-1], True])
        lower = np.r_[sc[last[:-1] + 1], -np.inf]  # the next distinct value below each cut
        thr = np.where(np.isfinite(lower), 0.5 * (sc[last] + lower), -np.inf)
        current = int(np.searchsorted(-sc[last], -tc[e], side="left"))  # groups above tc[e] now
        return (
            np.r_[np.inf, thr],
            np.r_[base_cost, base_cost + dcost[last]],
            np.concatenate([base_tot[:, None], base_tot[:, None] + dtot[:, last]], axis=1),
            current,
        )

    def ascend(self, tc: np.ndarray, lam: float | None, max_sweeps: int = 30) -> np.ndarray:
        """Coordinate ascent. lam given: maximise -cost + lam * total[0] (unconstrained).
        lam None: minimise cost subject to every constraint (tc must start feasible)."""
        tc = tc.copy()
        for _ in range(max_sweeps):
            changed = False
            for e in range(self.n_exits - 1):
                thr, cost, tot, cur = self.coordinate_options(tc, e)
                if lam is not None:
                    obj = -cost + lam * tot[0]
                else:
                    obj = np.where(self.feasible(tot), -cost, -np.inf)
                best = int(np.argmax(obj))
                if obj[best] > obj[cur] + 1e-9:  # strict improvement only: guarantees termination
                    tc[e] = thr[best]
                    changed = True
            if not changed:
                break
        return tc


def calibrate_thresholds(
    exit_probs: np.ndarray,
    final_probs: np.ndarray,
    labels: np.ndarray | None,
    costs: Sequence[float],
    *,
    budget: float,
    criterion: str = "entropy",
    patience: int = 2,
    estimate: str = "both",
    gain_weight: float = 1.0,
    grid: int | None = None,
) -> Calibration:
    """Choose per-exit thresholds that save the most compute within an accuracy-drop budget.

    Objective: minimise the mean cost ``mean_n costs[exit(n)]`` subject to
    ``accuracy(early exit) >= accuracy(full model) - budget`` on these rows (with ``labels=None``:
    ``agreement with the full model >= 100 - budget``). The budget is turned into a number of rows,
    ``floor(budget / 100 * N)``, so the constraint holds exactly on the calibration data.

    With labels, the accuracy drop is constrained two ways (``estimate="both"``, the default): the
    *empirical* drop (label counts) and the *posterior* drop — the expected drop under the full
    model's own temperature-calibrated probabilities (``q_n[pred_full] - q_n[pred_exit]`` per row,
    the temperature fitted to the labels). The empirical count alone is a difference of two noisy
    counts (rows the exit gets right and the model wrong, and vice versa) that the optimiser learns to
    exploit, so on new data it overshoots the budget (by ~1 point on movie-calib cross-validation); the
    posterior estimate has far lower variance and generalises. ``"empirical"`` / ``"posterior"``
    use one of them only.

    Search: a Lagrangian sweep over a shared multiplier ``lam`` (rows of accuracy per unit of
    full-model cost) in which, for each ``lam``, exact coordinate ascent sets one exit's threshold at a
    time to the best of *all* its distinct cut points (with the other exits fixed, every cut's cost and
    accuracy come from one sort and cumulative sums), then a constrained coordinate-ascent polish spends
    whatever budget is left. Thresholds sit midway between adjacent calibration scores.

    Args:
        exit_probs: ``[E, N, C]`` probabilities of every exit (out-of-fold ones for fitted heads; the last
            exit may be the model's own final output).
        final_probs: ``[N, C]`` the full model's probabilities (the accuracy baseline / agreement target).
        labels: ``[N]`` gold labels or ``None``.
        costs: ``[E]`` cumulative relative cost of stopping at each exit (full model = 1.0), e.g. ``k / L``.
        budget: max accuracy drop in percentage points (>= 0).
        criterion: ``"entropy"``, ``"maxprob"`` or ``"patience"`` (see the module docstring).
        patience: consecutive agreeing exits required by ``"patience"`` (>= 1).
        estimate: ``"both"``, ``"empirical"`` or ``"posterior"`` (with labels; see above).

    Raises:
        CalibrationError: empty input, budget < 0, a single label, mismatched shapes, bad probabilities or costs.
    """
    if criterion not in CRITERIA:
        raise CalibrationError(f"unknown criterion {criterion!r}; use one of {', '.join(CRITERIA)}")
    if estimate not in ("both", "empirical", "posterior", "stacked", "model", "model+empirical"):
        raise CalibrationError(f"unknown estimate {estimate!r}; use 'both', 'empirical', 'stacked' or 'posterior'")
    if not isinstance(patience, int | np.integer) or isinstance(patience, bool) or patience < 1:
        raise CalibrationError(f"patience must be an int >= 1 (consecutive agreeing exits), got {patience!r}")
    try:
        budget = float(budget)
    except (TypeError, ValueError) as exc:
        raise CalibrationError(f"budget must be a number of accuracy points, got {budget!r}") from exc
    if not math.isfinite(budget) or budget < 0:
        raise CalibrationError(
            f"budget must be a finite accuracy drop >= 0 (in points, e.g. 1.0 = one point), got {budget}"
        )
    p = np.asarray(exit_probs)
    if p.ndim != 3:
        raise CalibrationError(f"exit_probs must be [E, N, C] (exits, rows, classes), got shape {p.shape}")
    n_exits, n, c = p.shape
    if n_exits == 0 or n == 0:
        raise CalibrationError(
            f"nothing to calibrate on: exit_probs has {n_exits} exits and {n} rows; pass the calibration "
            "set's probabilities of every exit"
        )
    if c < 2:
        raise CalibrationError(f"exit_probs has {c} class(es); a classifier needs at least 2")
    final = np.asarray(final_probs)
    if final.shape != (n, c):
        raise CalibrationError(
            f"final_probs must be [N, C] = ({n}, {c}) to match exit_probs {p.shape}, got {final.shape}"
        )
    _check_probs(p, "exit_probs", "pass softmax probabilities of every exit")
    _check_probs(final, "final_probs", "pass the full model's softmax output")
    cost = np.asarray(costs, dtype=np.float64)
    if cost.shape != (n_exits,):
        raise CalibrationError(f"costs must have one entry per exit ({n_exits}), got shape {cost.shape}")
    if not np.all(np.isfinite(cost)) or np.any(cost <= 0) or np.any(np.diff(cost) < 0):
        raise CalibrationError(
            f"costs must be positive, finite and non-decreasing (cumulative cost of stopping at each exit, "
            f"full model = 1.0, e.g. k/L), got {cost.tolist()}"
        )
    final_pred = final.argmax(axis=1)
    pred = p.argmax(axis=2)
    cols = np.arange(n)
    if labels is not None:
        ref = _check_labels(labels, n, c)
        _check_two_classes(
            ref,
            ": accuracy on such a set says nothing about when exiting early is safe; calibrate on rows of every "
            "class (or pass labels=None to use agreement with the full model)",
        )
        metric = "accuracy"
    else:
        ref = final_pred
        metric = "agreement"

    warnings: list[str] = []
    allowed = math.floor(budget / 100.0 * n + 1e-9)
    if 0 < budget / 100.0 * n < 10:
        warnings.append(
            f"the budget of {budget:g} points is only {budget / 100.0 * n:.1f} of the {n} calibration rows: "
            f"thresholds will be noisy and the drop on new data may exceed the budget; use at least "
            f"{math.ceil(1000.0 / budget)} calibration rows or a larger budget"
        )

    correct = (pred == ref[None, :]).astype(np.float64)  # [E, N]
    gains, required = [], []
    temperature = None
    log_final = np.log(np.clip(final.astype(np.float64), 1e-30, 1.0))
    if labels is not None and estimate == "posterior":
        temperature = _fit_temperature(final, ref)
        q = _softmax(log_final / temperature)
        post = q[cols[None, :], pred]  # [E, N]: expected correctness of each exit's prediction
        gains.append(post)
        required.append(q[cols, final_pred].sum() - budget / 100.0 * n)
    if labels is not None and estimate in ("both", "stacked"):
        # per exit: expected change in correctness when stopping there, under P(y | full model, exit)
        stacked = np.zeros((n_exits, n))
        for e in range(n_exits):
            r = _fit_combiner(log_final, np.log(np.clip(p[e].astype(np.float64), 1e-30, 1.0)), ref)
            stacked[e] = r[cols, pred[e]] - r[cols, final_pred]
        gains.append(stacked)
        required.append(-budget / 100.0 * n)
    if labels is not None and estimate in ("model", "model+empirical"):
        gains.append(_disagreement_gains(p, final, ref, cost))
        required.append(-budget / 100.0 * n)
    if labels is None or estimate in ("both", "empirical", "model+empirical"):
        # change in correctness vs the full model per (exit, row); rows the exit gets right and the model
        # wrong ('gains') count gain_weight (1: plain accuracy)
        d = correct - (final_pred == ref)[None, :]
        gains.append(np.where(d > 0, gain_weight * d, d))
        required.append(-float(allowed))
    scores = exit_scores(p, criterion, patience)
    edges = None
    if grid:
        # coarse candidate thresholds: per-exit score quantiles (fewer choices, less fitting to noise)
        edges = []
        binned = np.full_like(scores, -np.inf)
        for e in range(n_exits):
            fin = np.isfinite(scores[e])
            if fin.any():
                ed = np.unique(np.quantile(scores[e, fin], np.linspace(0, 1, grid + 1)[1:-1]))
            else:
                ed = np.zeros(0)
            edges.append(ed)
            binned[e, fin] = np.searchsorted(ed, scores[e, fin], side="left")
        scores = binned
    cas = _Cascade(scores, np.stack(gains), np.array(required), cost)

    never = np.full(n_exits, np.inf)
    best_tc = never
    best_cost, tot = cas.evaluate(never)
    if not cas.feasible(tot):
        warnings.append(
            "even with no early exit the last exit misses the budget against the full model; make the "
            "last exit the full model's own output"
        )
    else:
        candidates: list[np.ndarray] = [never]
        feasible_lams: list[float] = []
        infeasible_lams: list[float] = []
        for lam in np.geomspace(1e-3, 1e3, 25):
            tc = cas.ascend(never, lam=float(lam))
            if cas.feasible(cas.evaluate(tc)[1]):
                candidates.append(tc)
                feasible_lams.append(float(lam))
            else:
                infeasible_lams.append(float(lam))
        # refine the multiplier where feasibility switches on (bisection in log space)
        if feasible_lams:
            hi = min(feasible_lams)
            lo = max([x for x in infeasible_lams if x < hi], default=None)
            for _ in range(10 if lo is not None else 0):
                mid = math.sqrt(lo * hi)
                tc = cas.ascend(never, lam=mid)
                if cas.feasible(cas.evaluate(tc)[1]):
                    candidates.append(tc)
                    hi = mid
                else:
                    lo = mid
        for tc in candidates:
            tc = cas.ascend(tc, lam=None)
            cst, tot = cas.evaluate(tc)
            if cas.feasible(tot) and cst < best_cost - 1e-9:
                best_tc, best_cost = tc, cst

    if edges is not None:
        best_tc = np.array([
            t if not np.isfinite(t) else (edges[e][int(math.floor(t))] if int(math.floor(t)) < len(edges[e]) else np.inf)
            for e, t in enumerate(best_tc)
        ])
    cal = Calibration(
        thresholds=_from_conf_thresholds(best_tc, criterion, c), criterion=criterion, patience=int(patience),
        costs=cost.tolist(), budget=budget, metric=metric, expected_speedup=0.0, expected_accuracy=None,
        baseline_accuracy=float((final_pred == ref).mean() * 100) if labels is not None else None,
        expected_agreement=0.0, exit_histogram=[], warnings=warnings, n_rows=n,
        teacher_temperature=temperature,
    )
    ex = exit_decisions(p, cal)
    cal.expected_speedup = float(1.0 / cost[ex].mean())
    cal.expected_agreement = float((pred[ex, cols] == final_pred).mean() * 100)
    if labels is not None:
        cal.expected_accuracy = float((pred[ex, cols] == ref).mean() * 100)
    cal.exit_histogram = np.bincount(ex, minlength=n_exits).astype(int).tolist()
    if cal.exit_histogram[-1] == n:
        warnings.append(
            f"no row exits early within a budget of {budget:g} points: the exits are not confident enough "
            "on this data (try a larger budget, better heads, or more calibration rows)"
        )
    logger.info(
        "calibrated %s thresholds (budget %.2f points, %s): speedup %.2fx, agreement %.2f%%, exits %s",
        criterion, budget, metric, cal.expected_speedup, cal.expected_agreement, cal.exit_histogram,
    )
    return cal
