"""The exit-head model: pooling, activations, ``ExitHead`` and its JSON form (numpy only).

An exit head turns one layer's hidden states ``[N, S, H]`` into class probabilities:
``pool`` (:func:`pool_features`: ``cls``, ``mean``, ``cls+mean`` or ``cls+mean+attn``, the last with a learned
attention query, see :func:`attention_pool`) then a stack of dense layers
(activation ``none``/``tanh``/``relu``/``gelu``) then softmax. Feature standardisation (and the
optional PCA projection used while fitting) is folded into the first dense layer, so a head is exactly
``softmax(act(x W1 + b1) W2 + b2)``: MatMul/Add/activation/Softmax, nothing else, which
:mod:`dyncompile.passes.early_exit.graph` lowers op for op.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from typing import Any

import numpy as np

from dyncompile.passes.early_exit.checks import CalibrationError
from dyncompile.runtime.rules.exit_rule import softmax

__all__ = [
    "ACTIVATIONS",
    "HEAD_FORMAT",
    "POOLINGS",
    "CalibrationError",
    "ExitHead",
    "activate",
    "attention_pool",
    "pool_features",
    "softmax",
]

POOLINGS = ("cls", "mean", "cls+mean", "cls+mean+attn")
#: Added to the attention scores of padding tokens (their softmax weight underflows to exactly 0).
ATTN_MASK_BIAS = -1e9
ACTIVATIONS = ("none", "tanh", "relu", "gelu")

HEAD_FORMAT = "dyncompile.exit_head/v1"


def attention_pool(hidden: np.ndarray, attention_mask: np.ndarray | None, query: np.ndarray) -> np.ndarray:
    """Attention pooling ``sum_s softmax_s(h_s . q + bias_s) h_s`` ``[N, H]`` (float32).

    ``bias_s`` is 0 for a token the mask keeps and :data:`ATTN_MASK_BIAS` for padding, so padding gets
    weight 0; ``query`` ``[H]`` is learned (a zero query gives the masked mean). The ONNX lowering
    (:meth:`dyncompile.passes.early_exit.graph.GraphBuilder.pool`) computes the same ops in the same order.
    """
    h = np.asarray(hidden, np.float32)
    q = np.asarray(query, np.float32).reshape(-1)
    if q.shape[0] != h.shape[2]:
        raise CalibrationError(f"attention query has {q.shape[0]} entries, the hidden states {h.shape[2]}")
    s = h @ q  # [N, S]
    if attention_mask is not None:
        s = s + (np.asarray(attention_mask).astype(np.float32) - np.float32(1.0)) * np.float32(-ATTN_MASK_BIAS)
    s = s - s.max(axis=1, keepdims=True)
    e = np.exp(s)
    a = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    return np.einsum("nsh,ns->nh", h, a).astype(np.float32)


def pool_features(
    hidden: np.ndarray, attention_mask: np.ndarray | None, pooling: str, query: np.ndarray | None = None
) -> np.ndarray:
    """Pool layer hidden states ``[N, S, H]`` into head features ``[N, F]`` (float32).

    ``cls``: ``hidden[:, 0, :]`` (F = H). ``mean``: mean over the tokens whose ``attention_mask`` is
    non-zero (F = H; a row with an all-zero mask gives zeros). ``cls+mean``: ``[cls, mean]`` (F = 2H).
    ``cls+mean+attn``: ``[cls, mean, attention_pool(query)]`` (F = 3H; needs ``query`` ``[H]``).
    ``attention_mask`` ``[N, S]`` may be ``None`` for ``cls`` (and means "all tokens" for ``mean``).
    """
    if pooling not in POOLINGS:
        raise CalibrationError(f"unknown pooling {pooling!r}; use one of {', '.join(POOLINGS)}")
    if pooling == "cls+mean+attn":
        if query is None:
            raise CalibrationError("cls+mean+attn pooling needs the head's attention query")
        base = pool_features(hidden, attention_mask, "cls+mean")
        return np.concatenate([base, attention_pool(hidden, attention_mask, query)], axis=1)
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
    # the token weights mask / max(count, 1), then their weighted sum: the ONNX lowering's order (one MatMul)
    weights = mask / np.maximum(mask.sum(axis=1, keepdims=True), np.float32(1.0))
    mean = np.einsum("nsh,ns->nh", hidden, weights).astype(np.float32)
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


def activate(x: np.ndarray, act: str) -> np.ndarray:
    """Elementwise activation of a dense layer (one of :data:`ACTIVATIONS`)."""
    if act == "none":
        return x
    if act == "tanh":
        return np.tanh(x)
    if act == "relu":
        return np.maximum(x, 0)
    if act == "gelu":  # exact (erf) GELU, as ONNX Gelu with approximate="none"
        return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(x.dtype, copy=False)
    raise CalibrationError(f"unknown activation {act!r}; use one of {', '.join(ACTIVATIONS)}")


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
        attn_query: ``[H]`` float32, the attention query of ``cls+mean+attn`` pooling (else ``None``).
    """

    pooling: str
    layers: list[tuple[np.ndarray, np.ndarray, str]]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    attn_query: np.ndarray | None = None

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
        if (self.pooling == "cls+mean+attn") != (self.attn_query is not None):
            raise CalibrationError("an exit head has an attention query exactly when its pooling is cls+mean+attn")
        if self.attn_query is not None:
            self.attn_query = np.asarray(self.attn_query, np.float32).reshape(-1)
            if 3 * self.attn_query.shape[0] != self.in_features:
                raise CalibrationError(
                    f"cls+mean+attn pooling of width-{self.attn_query.shape[0]} states gives "
                    f"{3 * self.attn_query.shape[0]} features, the first layer expects {self.in_features}"
                )

    def features(self, hidden: np.ndarray, attention_mask: np.ndarray | None) -> np.ndarray:
        """The pooled features ``[N, F]`` this head reads, from layer states ``[N, S, H]``."""
        return pool_features(hidden, attention_mask, self.pooling, self.attn_query)

    @property
    def in_features(self) -> int:
        """Width of the pooled features the head reads."""
        return int(self.layers[0][0].shape[0])

    def logits(self, features: np.ndarray) -> np.ndarray:
        """Logits ``[N, C]`` (float32) from pooled features ``[N, F]``."""
        x = np.asarray(features, np.float32)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise CalibrationError(
                f"exit head expects pooled features [N, {self.in_features}] ({self.pooling} pooling), got {x.shape}"
            )
        for w, b, act in self.layers:
            x = activate(x @ w + b, act)
        return x

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        """Class probabilities ``[N, C]`` (float32) from pooled features ``[N, F]``."""
        return softmax(self.logits(features)).astype(np.float32)

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
        } | ({"attn_query": _encode_array(self.attn_query, encoding)} if self.attn_query is not None else {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExitHead:
        """Read a head written by :meth:`to_dict`; :class:`CalibrationError` for anything else."""
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
            query = _decode_array(d["attn_query"], "attn_query") if "attn_query" in d else None
            return cls(pooling=d["pooling"], layers=layers, info=dict(d.get("info", {})), attn_query=query)
        except KeyError as exc:
            raise CalibrationError(f"exit head description lacks the field {exc}") from exc

