"""The learned router: a bag-of-embeddings logistic head over the cheapest candidate's token embedding table.

Features of a text (before any candidate runs): the mean of its tokens' input embeddings (MiniLM's
word-embedding table, looked up, no transformer layer) and the log of its token count. Head: per candidate
but the last, a ridge logistic regression of "this candidate's answer is as good as the reference's"
on the standardised features (:func:`dyncompile.passes.early_exit.certify.fit_logistic`, the exit policy's
fitter). Because the head is linear in the mean embedding, the standardisation and the weights fold into
one ``[V, K-1]`` per-token score table: the ONNX router is ``Gather`` + masked mean + ``log(len) * a + b``
— a few microseconds beside the tokenizer, where a MiniLM forward pass would cost as much as the cheapest
candidate itself (the 3 % overhead target rules that out).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from dyncompile.errors import DataError

__all__ = ["RouterHead", "bag_features", "build_router_onnx", "find_token_embedding", "fit_router_head"]

ROUTER_OUTPUT = "route_scores"


def find_token_embedding(model_path: str | Path) -> np.ndarray:
    """The ``[V, D]`` token embedding table of an encoder: the initializer a ``Gather`` reads with ``input_ids``."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path), load_external_data=True)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    for node in g.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == "input_ids" and node.input[0] in inits:
            table = numpy_helper.to_array(inits[node.input[0]])
            if table.ndim == 2:
                return table.astype(np.float32)
    raise DataError(
        f"{model_path}: no token embedding table (a Gather of an initializer by 'input_ids'); the learned router "
        "reads the cheapest candidate's embeddings — use a transformer encoder as the first candidate"
    )


def bag_features(input_ids: np.ndarray, mask: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``[N, D + 1]``: masked mean of the token embeddings and ``log(token count)`` (float64)."""
    m = np.asarray(mask, np.float64)
    emb = table[np.asarray(input_ids)].astype(np.float64)  # [N, S, D]
    length = m.sum(1, keepdims=True)
    mean = (emb * m[..., None]).sum(1) / np.maximum(length, 1.0)
    return np.concatenate([mean, np.log(np.maximum(length, 1.0))], axis=1)


@dataclasses.dataclass
class RouterHead:
    """Per candidate but the last: ``score = ((f - mean) / scale) @ weights[k] + bias[k]`` on :func:`bag_features`."""

    mean: np.ndarray  # [F]
    scale: np.ndarray  # [F]
    weights: np.ndarray  # [K-1, F]
    bias: np.ndarray  # [K-1]
    ridge: float

    def scores(self, features: np.ndarray) -> np.ndarray:
        """``[N, K-1]`` (float64)."""
        z = (np.asarray(features, np.float64) - self.mean) / self.scale
        return z @ self.weights.T + self.bias

    def to_dict(self) -> dict:
        """What the plan records of the router (features, ridge, sizes)."""
        return {"features": "mean token embedding + log token count", "ridge": self.ridge,
                "n_features": int(len(self.mean)), "candidates_scored": int(len(self.bias))}


def fit_router_head(features: np.ndarray, targets: np.ndarray, ridge: float = 30.0) -> RouterHead:
    """Fit :class:`RouterHead` on ``features`` ``[N, F]`` and 0/1 ``targets`` ``[K-1, N]`` (numpy, Newton)."""
    from dyncompile.passes.early_exit.certify import fit_logistic
    from dyncompile.passes.early_exit.newton import blas_threads

    x = np.asarray(features, np.float64)
    t = np.atleast_2d(np.asarray(targets, np.float64))
    mu, sd = x.mean(0), x.std(0)
    sd = np.where(sd > 1e-9, sd, 1.0)
    z = np.c_[(x - mu) / sd, np.ones(len(x))]
    ws, bs = [], []
    with blas_threads(1):
        for row in t:
            if row.min() == row.max():  # every row right (or wrong): a constant score
                p = (row.mean() * len(row) + 0.5) / (len(row) + 1.0)
                ws.append(np.zeros(x.shape[1]))
                bs.append(float(np.log(p / (1 - p))))
                continue
            w = fit_logistic(z, row, ridge)
            ws.append(w[:-1])
            bs.append(float(w[-1]))
    return RouterHead(mu, sd, np.array(ws), np.array(bs), float(ridge))


def build_router_onnx(head: RouterHead, table: np.ndarray, path: str | Path, opset: int = 17) -> Path:
    """Write the router as ONNX.

    Inputs ``input_ids``, ``attention_mask`` ``[B, S]`` (int64), output ``route_scores`` ``[B, K-1]`` equal to ``head.scores(bag_features(...))`` up to float32 rounding.

    Folding: ``((mean_emb - mu) / sd) @ w + ((log L - mu_L) / sd_L) w_L + b`` = mean over tokens of
    ``T[id]`` + ``log L * a`` + ``c`` with ``T = table @ (w / sd)[:D]`` (``[V, K-1]``), ``a = w_L / sd_L``,
    ``c = b - mu @ (w / sd)``.
    """
    import onnx
    import onnx_ir as ir

    d = table.shape[1]
    wz = head.weights / head.scale[None, :]  # [K-1, F]
    token_table = (table.astype(np.float64) @ wz[:, :d].T).astype(np.float32)  # [V, K-1]
    a = wz[:, d].astype(np.float32)
    c = (head.bias - wz @ head.mean).astype(np.float32)
    k = len(c)
    ids = ir.Value(name="input_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", "seq"]))
    mask = ir.Value(name="attention_mask", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", "seq"]))
    tape = ir.tape.Tape()

    def const(name: str, arr: np.ndarray) -> ir.Value:
        return tape.initializer(ir.tensor(arr, name=name), name=name)

    tok = tape.op("Gather", [const("token_scores", token_table), ids])  # [B, S, K-1]
    maskf = tape.op("Cast", [mask], attributes={"to": ir.DataType.FLOAT})
    axis1 = const("axis1", np.array([1], np.int64))
    tok_m = tape.op("Mul", [tok, tape.op("Unsqueeze", [maskf, const("axis_last", np.array([-1], np.int64))])])
    tok_sum = tape.op("ReduceSum", [tok_m, axis1], attributes={"keepdims": 0})  # [B, K-1]
    length0 = tape.op("ReduceSum", [maskf, axis1], attributes={"keepdims": 1})  # [B, 1]
    length = tape.op("Max", [length0, const("one", np.array(1.0, np.float32))])
    tok_mean = tape.op("Div", [tok_sum, length])
    len_term = tape.op("Mul", [tape.op("Log", [length]), const("length_coef", a)])
    out = tape.op("Add", [tape.op("Add", [tok_mean, len_term]), const("bias", c)])
    out.name = ROUTER_OUTPUT
    out.type = ir.TensorType(ir.DataType.FLOAT)
    out.shape = ir.Shape(["batch", k])
    graph = ir.Graph([ids, mask], [out], nodes=tape.nodes, initializers=tape.initializers,
                     opset_imports={"": opset}, name="dyncompile_router")
    model = ir.Model(graph, ir_version=8, producer_name="dyncompile")
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    path = Path(path)
    onnx.save(proto, str(path))
    return path
