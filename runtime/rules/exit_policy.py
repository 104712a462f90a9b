"""The learned exit policy's score, in numpy: the reference the ONNX lowering is tested against.

A learned exit policy (criterion ``learned``) gives every exit ``e`` a score
``s_e = x_e . w_e + b_e``, a logistic-regression logit of "exit ``e``'s answer equals the full model's
answer", from features the exit graph already has (:data:`POLICY_FEATURES`):

* ``maxprob``   ``max_c p_e[c]`` (``p_e = softmax(logits_e)``);
* ``margin``    top-1 minus top-2 probability;
* ``entropy``   ``-sum_c p_e[c] log p_e[c]`` (nats);
* ``agree_prev`` 1 when ``argmax p_e == argmax p_{e-1}`` (the previous exit's answer), else 0;
* ``moved``     ``sum_c |p_e[c] - p_{e-1}[c]|`` (how far the probabilities moved since the previous exit);
* ``prev_maxprob`` ``max_c p_{e-1}[c]``.

The first exit has no previous exit: it uses itself (``agree_prev = 1``, ``moved = 0``,
``prev_maxprob = maxprob``). The layer index is the exit itself (one model per exit). The exit fires when
``s_e > threshold_e``. The same features and score are built as ONNX ops by
``dyncompile.passes.early_exit.graph.GraphBuilder.learned_score``; the two agree to float32 rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["POLICY_FEATURES", "LEARNED_POLICY_FORMAT", "ExitPolicy", "policy_features", "policy_scores"]

POLICY_FEATURES = ("maxprob", "margin", "entropy", "agree_prev", "moved", "prev_maxprob")
LEARNED_POLICY_FORMAT = "dyncompile.exit_policy/v1"


def _softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def policy_features(probs: np.ndarray, prev_probs: np.ndarray | None) -> np.ndarray:
    """Features ``[N, F]`` (float64, order :data:`POLICY_FEATURES`) of one exit.

    From its probabilities ``[N, C]`` and the previous exit's (``None`` for the first exit).
    """
    p = np.asarray(probs, np.float64)
    q = p if prev_probs is None else np.asarray(prev_probs, np.float64)
    top = -np.sort(-p, axis=-1)
    maxp = top[:, 0]
    margin = top[:, 0] - top[:, 1]
    ent = -(p * np.log(np.clip(p, 1e-30, 1.0))).sum(-1)
    agree = (p.argmax(-1) == q.argmax(-1)).astype(np.float64)
    moved = np.abs(p - q).sum(-1)
    return np.stack([maxp, margin, ent, agree, moved, q.max(-1)], axis=1)


@dataclasses.dataclass
class ExitPolicy:
    """Per-exit linear scores on :data:`POLICY_FEATURES` (standardisation folded in).

    Attributes:
        weights: one ``[F]`` weight vector per exit (the last exit, the full model, has none: ``None``).
        biases: one bias per exit (``None`` for the last).
        info: JSON-able facts (fitting rows, in-sample AUC, ...).
    """

    weights: list[list[float] | None]
    biases: list[float | None]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_exits(self) -> int:
        """Number of exits the policy decides at."""
        return len(self.weights)

    def score(self, e: int, probs: np.ndarray, prev_probs: np.ndarray | None) -> np.ndarray:
        """Score ``[N]`` (float64) of exit ``e``; ``-inf`` where exit ``e`` has no model."""
        w = self.weights[e]
        if w is None:
            return np.full(len(probs), -np.inf)
        return policy_features(probs, prev_probs) @ np.asarray(w, np.float64) + float(self.biases[e])

    def scores(self, exit_probs: np.ndarray) -> np.ndarray:
        """Scores ``[E, N]`` of every exit from ``exit_probs`` ``[E, N, C]`` (exits in order)."""
        p = np.asarray(exit_probs)
        return np.stack([self.score(e, p[e], p[e - 1] if e > 0 else None) for e in range(p.shape[0])])

    def to_dict(self) -> dict[str, Any]:
        """The policy in its plan form."""
        return {"format": LEARNED_POLICY_FORMAT, "features": list(POLICY_FEATURES), "weights": self.weights,
                "biases": self.biases, "info": self.info}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExitPolicy:
        """The policy from its plan form (PlanError when it is not one)."""
        if not isinstance(d, dict) or d.get("format") != LEARNED_POLICY_FORMAT:
            raise ValueError(f"not a learned exit policy (expected format {LEARNED_POLICY_FORMAT!r})")
        if list(d.get("features", [])) != list(POLICY_FEATURES):
            raise ValueError(f"learned exit policy features {d.get('features')} differ from {list(POLICY_FEATURES)}")
        return cls(weights=d["weights"], biases=d["biases"], info=dict(d.get("info", {})))


def policy_scores(logits: np.ndarray, prev_logits: np.ndarray | None, weights, bias) -> np.ndarray:
    """Score ``[N]`` of one exit from raw head logits (what the runtime sees), float64."""
    p = _softmax(np.asarray(logits, np.float64))
    q = None if prev_logits is None else _softmax(np.asarray(prev_logits, np.float64))
    return policy_features(p, q) @ np.asarray(weights, np.float64) + float(bias)
