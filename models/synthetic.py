"""Small deterministic graphs for unit tests (test models are code, not checked-in binaries)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

__all__ = ["tiny_encoder_classifier", "tiny_mlp"]


def _t(rng: np.random.Generator, shape, scale: float, name: str) -> ir.Value:
    arr = (rng.standard_normal(shape) * scale).astype(np.float32)
    return ir.val(name, const_value=ir.tensor(arr, name=name))


def tiny_encoder_classifier(
    num_layers: int = 4, hidden: int = 256, vocab: int = 512, num_labels: int = 2, seed: int = 0
) -> ir.Model:
    """A BERT-shaped classifier: embeddings, ``num_layers`` residual blocks, CLS pooling, linear head.

    Inputs ``input_ids``/``attention_mask`` (int64 ``[batch, seq]``), output ``logits`` ``[batch, num_labels]``.
    Each block: ``h = LayerNorm(h + Relu(h @ W1 + b1) @ W2 * mask)``, plus a mask-weighted token mix so
    the mask matters. Weights are ``hidden x hidden`` (>= 65,536 elements for hidden 256: "heavy").
    """
    rng = np.random.default_rng(seed)
    tape = ir.tape.Tape()
    ids = ir.val("input_ids", ir.DataType.INT64, ir.Shape(["batch", "seq"]))
    mask = ir.val("attention_mask", ir.DataType.INT64, ir.Shape(["batch", "seq"]))
    inits: list[ir.Value] = []

    def init(shape, scale, name):
        v = _t(rng, shape, scale, name)
        inits.append(v)
        return v

    def const(arr, name):
        v = ir.val(name, const_value=ir.tensor(np.asarray(arr), name=name))
        inits.append(v)
        return v

    emb = init((vocab, hidden), 1.0, "embeddings.word")
    h = tape.op("Gather", [emb, ids], {"axis": 0})
    ln_scale = const(np.ones(hidden, np.float32), "ln.scale")
    ln_bias = const(np.zeros(hidden, np.float32), "ln.bias")
    h = tape.op("LayerNormalization", [h, ln_scale, ln_bias], {"axis": -1, "epsilon": 1e-5})
    axes = const(np.array([-1], np.int64), "axes_last")
    maskf = tape.op("Cast", [mask], {"to": ir.DataType.FLOAT})
    mask3 = tape.op("Unsqueeze", [maskf, axes])  # [b, s, 1]
    axis1 = const(np.array([1], np.int64), "axes_seq")
    denom = tape.op("ReduceSum", [mask3, axis1], {"keepdims": 1})  # [b, 1, 1]
    for i in range(num_layers):
        w1 = init((hidden, hidden), 1.0 / np.sqrt(hidden), f"layer{i}.w1")
        b1 = init((hidden,), 0.1, f"layer{i}.b1")
        w2 = init((hidden, hidden), 1.0 / np.sqrt(hidden), f"layer{i}.w2")
        z = tape.op("Relu", [tape.op("Add", [tape.op("MatMul", [h, w1]), b1])])
        z = tape.op("Mul", [tape.op("MatMul", [z, w2]), mask3])
        mix = tape.op(
            "Div", [tape.op("ReduceSum", [tape.op("Mul", [h, mask3]), axis1], {"keepdims": 1}), denom]
        )
        h = tape.op(
            "Add", [tape.op("Add", [h, z]), tape.op("Mul", [mix, const(np.float32(0.5), f"layer{i}.mix")])]
        )
        h = tape.op("LayerNormalization", [h, ln_scale, ln_bias], {"axis": -1, "epsilon": 1e-5})
    zero = const(np.array(0, np.int64), "cls_index")
    cls = tape.op("Gather", [h, zero], {"axis": 1})  # [b, hidden]
    wc = init((hidden, num_labels), 1.0 / np.sqrt(hidden), "classifier.weight")
    bc = init((num_labels,), 0.1, "classifier.bias")
    logits = tape.op("Add", [tape.op("MatMul", [cls, wc]), bc])
    logits.name = "logits"
    logits.dtype = ir.DataType.FLOAT
    logits.shape = ir.Shape(["batch", num_labels])
    graph = ir.Graph(
        [ids, mask],
        [logits],
        nodes=tape.nodes,
        initializers=inits,
        opset_imports={"": 18},
        name="tiny_encoder",
    )
    return ir.Model(graph, ir_version=10, producer_name="dyncompile.models.synthetic")


def tiny_mlp(seed: int = 0) -> ir.Model:
    """A 3-node MLP with no layer structure (for 'no layers found' paths)."""
    rng = np.random.default_rng(seed)
    w = ir.val("w", const_value=ir.tensor(rng.standard_normal((8, 4)).astype(np.float32), name="w"))
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["batch", 8]))
    tape = ir.tape.Tape()
    y = tape.op("Softmax", [tape.op("Relu", [tape.op("MatMul", [x, w])])], {"axis": -1})
    y.name, y.dtype, y.shape = "y", ir.DataType.FLOAT, ir.Shape(["batch", 4])
    g = ir.Graph([x], [y], nodes=tape.nodes, initializers=[w], opset_imports={"": 18}, name="tiny_mlp")
    return ir.Model(g, ir_version=10, producer_name="dyncompile.models.synthetic")
