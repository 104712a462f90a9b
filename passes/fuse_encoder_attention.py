"""``fuse-encoder-attention``: an encoder's decomposed scaled-dot-product attention -> one ``MultiHeadAttention``.

torch's ONNX exporter (dynamo) writes a BERT-style encoder layer's attention as ~25 small nodes: a Reshape and a
Transpose per q/k/v projection, a Shape/Slice/Concat/Reshape/Transpose detour that transposes k, a scale split
over q and k, the scores MatMul, the additive mask, Softmax, an ``IsNaN``/``Where`` guard, the MatMul with v, and
a Transpose + Reshape back to ``[batch, sequence, hidden]``. At batch 1 on a CPU a short sentence is a few dozen
rows: each of those kernels costs more in launch and thread-pool synchronisation than in arithmetic, and ONNX
Runtime's own attention fusion does not match the exporter's pattern. onnxruntime's transformer optimizer emits
the same contrib operator for the patterns it knows; this pass matches the dynamo export's.

* Scope: the main graph (run it before ``early-exit``, which moves layers into If branches, and before the
  quantization passes). Each standard-domain ``Softmax(axis=-1)`` over ``scores + b1 (+ b2)`` where ``scores`` is
  ``MatMul(Mul(q, a), Mul(k, b))`` (BERT/MiniLM: the scale split over q and k), ``Div(MatMul(q, k), c)`` or
  ``Mul(MatMul(q, k), c)`` (MPNet, whose ``b1`` is its relative position bias), ``q`` =
  ``Transpose[0,2,1,3](Reshape(Q, [B, S, H, D]))``, ``k`` the same of ``K`` transposed to ``[B, H, D, T]`` (the
  exporter's ``Reshape/Transpose[0,2,1]/Reshape`` detour, or ``Transpose[0,2,3,1]``), ``a``, ``b``, ``c`` scalar
  constants; optionally ``Where(IsNaN(p), c, p)`` after the Softmax; then ``MatMul(p, v)`` with ``v`` like ``q``
  and ``Reshape(Transpose[0,2,1,3](.), [B, S, H * D])``. ``H`` and ``D`` come from the Reshape's constant parts and
  the projection width.
* Rewrite: ``MultiHeadAttention(Q, K, V, attention_bias=b1 (+ b2), num_heads=H, scale=...)`` (com.microsoft)
  replaces the final Reshape's output (it keeps its name); two biases are summed once (one ``Add`` per distinct
  pair, shared by the layers); the detours' nodes go when nothing else reads them.
* Invariants: graph inputs/outputs unchanged; outputs equal the original's within float round-off (tested
  <= 1e-5 in ORT with ``ORT_DISABLE_ALL``, padded batches included) for every input in which each row attends
  to at least one position (the ``IsNaN`` guard only matters for a row whose keys are all masked, which a
  tokenized text never has: it starts with a special token). Idempotent: a fused graph has no such Softmax left,
  so a second run reports ``modified=False``.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx_ir as ir

from dyncompile.passes._graph import const_array, replace_node_output
from dyncompile.passes._infra import not_fired, register_pass, warn_unmeasured_contrib_op

logger = logging.getLogger(__name__)

__all__ = ["FuseEncoderAttentionPass"]

_MS = "com.microsoft"


def _std(node: ir.Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def _perm(node: ir.Node) -> list[int] | None:
    a = node.attributes.get("perm")
    return list(a.value) if a is not None else None


def _scalar(v: ir.Value | None) -> float | None:
    a = const_array(v, max_elements=1)
    return None if a is None or a.size != 1 else float(a.reshape(()))


def _heads(v: ir.Value | None) -> tuple[ir.Value, int, int] | None:
    """``v = Transpose[0,2,1,3](Reshape(X, [B, S, H, D]))`` -> ``(X, H, D)``, H and D from the shape's constants."""
    t = v.producer() if v is not None else None
    if not _std(t, "Transpose") or _perm(t) != [0, 2, 1, 3]:
        return None
    r = t.inputs[0].producer()
    if not _std(r, "Reshape") or r.inputs[0] is None:
        return None
    return _split_heads(r)


def _split_heads(r: ir.Node) -> tuple[ir.Value, int, int] | None:
    """``(X, H, D)`` of ``Reshape(X, shape)`` whose shape's last two entries are ``H, D`` (one may be ``-1``).

    The shape is a constant or the exporter's ``Concat`` of the batch and sequence sizes (computed, one entry each)
    and constants.
    """
    shape = r.inputs[1]
    dims = const_array(shape, max_elements=8)
    if dims is None:
        c = shape.producer() if shape is not None else None
        if not _std(c, "Concat"):
            return None
        parts: list[int | None] = []
        for x in c.inputs:
            a = const_array(x, max_elements=8)
            parts.extend([None] if a is None else [int(d) for d in a.reshape(-1)])
        if len(parts) != 4 or parts[2] is None or parts[3] is None:
            return None
        dims = np.array([0, 0, parts[2], parts[3]])
    if len(dims) != 4:
        return None
    h, d = int(dims[2]), int(dims[3])
    x = r.inputs[0]
    width = x.shape[-1] if x.shape is not None and len(x.shape) and isinstance(x.shape[-1], int) else None
    if h == -1 and d > 0 and width:
        h = width // d
    elif d == -1 and h > 0 and width:
        d = width // h
    if h <= 0 or d <= 0 or (width is not None and h * d != width):
        return None
    return x, h, d


def _key(v: ir.Value | None) -> tuple[ir.Value, int, int] | None:
    """``(K, H, D)`` of the keys transposed to ``[B, H, D, T]``.

    Either ``Transpose[0,2,3,1](Reshape(K, ...))`` or the exporter's detour
    ``Reshape(Transpose[0,2,1](Reshape(Transpose[0,2,1,3](Reshape(K, ...)), [B*H, T, D])), [B, H, D, T])``.
    """
    n = v.producer() if v is not None else None
    if _std(n, "Transpose") and _perm(n) == [0, 2, 3, 1]:
        r = n.inputs[0].producer()
        return _split_heads(r) if _std(r, "Reshape") else None
    if not _std(n, "Reshape"):
        return None
    t = n.inputs[0].producer()
    if not _std(t, "Transpose") or _perm(t) != [0, 2, 1]:
        return None
    r = t.inputs[0].producer()
    if not _std(r, "Reshape"):
        return None
    return _heads(r.inputs[0])


def _scaled(v: ir.Value | None) -> tuple[ir.Value, float] | None:
    """``Mul(x, c)`` with a scalar constant ``c`` -> ``(x, c)``."""
    n = v.producer() if v is not None else None
    if not _std(n, "Mul"):
        return None
    for i in (0, 1):
        c = _scalar(n.inputs[1 - i])
        if c is not None and n.inputs[i] is not None:
            return n.inputs[i], c
    return None


@dataclasses.dataclass
class _Match:
    q: ir.Value
    k: ir.Value
    v: ir.Value
    bias: list[ir.Value]
    heads: int
    scale: float
    out_node: ir.Node  # the Reshape whose output the MultiHeadAttention takes over


def _scores(v: ir.Value | None) -> tuple[ir.Node, float] | None:
    """The q.k^T ``MatMul`` under ``v`` and the scale applied to it.

    ``MatMul(Mul(q, a), Mul(k, b))`` (scale ``a*b``), ``Div(MatMul(q, k), c)`` (``1/c``), ``Mul(MatMul(q, k), c)``
    (``c``).
    """
    n = v.producer() if v is not None else None
    if _std(n, "MatMul"):
        qs, ks = _scaled(n.inputs[0]), _scaled(n.inputs[1])
        return n, (qs[1] if qs is not None else 1.0) * (ks[1] if ks is not None else 1.0)
    if _std(n, "Div") and n.inputs[0] is not None and _std(n.inputs[0].producer(), "MatMul"):
        c = _scalar(n.inputs[1])
        return (n.inputs[0].producer(), 1.0 / c) if c else None
    if _std(n, "Mul"):
        for i in (0, 1):
            mm = n.inputs[i].producer() if n.inputs[i] is not None else None
            c = _scalar(n.inputs[1 - i])
            if _std(mm, "MatMul") and c is not None:
                return mm, c
    return None


def _unscaled(v: ir.Value | None) -> ir.Value | None:
    s = _scaled(v)
    return s[0] if s is not None else v


def _biased_scores(v: ir.Value | None) -> tuple[ir.Node, float, list[ir.Value]] | None:
    """``Add(...Add(scores, b1)..., bn)`` (either operand order) -> ``(q.k^T MatMul, scale, [b1, ..., bn])``."""
    biases: list[ir.Value] = []
    while True:
        sc = _scores(v)
        if sc is not None:
            return (sc[0], sc[1], biases[::-1]) if biases else None
        n = v.producer() if v is not None else None
        if not _std(n, "Add") or len(biases) >= 2:
            return None
        # the operand that leads to the scores continues the walk; the other is a bias
        for i in (0, 1):
            x = n.inputs[i]
            p = x.producer() if x is not None else None
            if p is not None and p.op_type in ("Add", "MatMul", "Div", "Mul"):
                if _scores(x) is not None or (_std(p, "Add") and _biased_scores(x) is not None):
                    biases.append(n.inputs[1 - i])
                    v = x
                    break
        else:
            return None


def _match(softmax: ir.Node) -> _Match | None:
    axis = softmax.attributes.get("axis")
    if axis is None or axis.value != -1:
        return None
    found = _biased_scores(softmax.inputs[0])
    if found is None or any(b is None for b in found[2]):
        return None
    mm, scale, biases = found
    q, k = _heads(_unscaled(mm.inputs[0])), _key(_unscaled(mm.inputs[1]))
    if q is None or k is None or q[1:] != k[1:]:
        return None
    # the probabilities: Softmax, or Where(IsNaN(p), c, p)
    p = softmax.outputs[0]
    uses = list(p.uses())
    if len(uses) == 2 and {u[0].op_type for u in uses} == {"IsNaN", "Where"}:
        where = next(u[0] for u in uses if u[0].op_type == "Where")
        isnan = next(u[0] for u in uses if u[0].op_type == "IsNaN")
        if where.inputs[0] is not isnan.outputs[0] or where.inputs[2] is not p:
            return None
        p = where.outputs[0]
        uses = list(p.uses())
    if len(uses) != 1 or not _std(uses[0][0], "MatMul") or uses[0][1] != 0:
        return None
    pv = uses[0][0]
    v = _heads(pv.inputs[1])
    if v is None or v[1:] != q[1:]:
        return None
    t_uses = list(pv.outputs[0].uses())
    if len(t_uses) != 1 or not _std(t_uses[0][0], "Transpose") or _perm(t_uses[0][0]) != [0, 2, 1, 3]:
        return None
    r_uses = list(t_uses[0][0].outputs[0].uses())
    if len(r_uses) != 1 or not _std(r_uses[0][0], "Reshape"):
        return None
    return _Match(q[0], k[0], v[0], biases, q[1], scale, r_uses[0][0])


class FuseEncoderAttentionPass(ir.passes.InPlacePass):
    """Decomposed encoder self-attention -> ``com.microsoft.MultiHeadAttention`` (see the module docstring)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the module docstring)."""
        graph = model.graph
        outputs = set(graph.outputs)
        matches = [m for m in (_match(n) for n in graph if _std(n, "Softmax")) if m is not None
                   and m.out_node.outputs[0] not in outputs]
        if not matches:
            if any(n.op_type == "MultiHeadAttention" and n.domain == _MS for n in graph):
                return ir.passes.PassResult(model, modified=False)  # fused by an earlier run
            return not_fired(model, "fuse-encoder-attention",
                             "no Softmax of scaled, masked q.k^T scores between head-split q/k/v projections (the "
                             "attention of a dynamo-exported BERT-style encoder)",
                             "leave fuse-encoder-attention out for this model")
        summed: dict[tuple[int, ...], ir.Value] = {}  # one Add per distinct pair of biases (MPNet: position + mask)
        for j, m in enumerate(matches):
            bias = m.bias[0]
            if len(m.bias) == 2:
                key = tuple(id(b) for b in m.bias)
                if key not in summed:
                    add = ir.node("Add", list(m.bias), name=f"fuse_encoder_attention.bias{len(summed)}")
                    add.outputs[0].name = f"fuse_encoder_attention.bias{len(summed)}"
                    graph.insert_before(m.out_node, add)
                    summed[key] = add.outputs[0]
                bias = summed[key]
            inputs = [m.q, m.k, m.v, None, None, bias]
            mha = ir.node("MultiHeadAttention", inputs, domain=_MS, name=f"fuse_encoder_attention.{j}",
                          attributes={"num_heads": ir.AttrInt64("num_heads", m.heads),
                                      "scale": ir.AttrFloat32("scale", float(np.float32(m.scale)))})
            graph.insert_before(m.out_node, mha)
            out = mha.outputs[0]
            replace_node_output(graph, m.out_node, m.out_node.outputs[0], out)
            # contrib-op outputs get no type from ONNX shape inference: where the export recorded none, give it the
            # query's (ORT's quantizer reads the types of the MatMul inputs it quantizes)
            if out.type is None:
                out.type = m.q.type
            if out.shape is None and m.q.shape is not None:
                out.shape = m.q.shape
        model.opset_imports.setdefault(_MS, 1)
        import onnx_ir.passes.common as common_passes

        common_passes.RemoveUnusedNodesPass()(model)
        logger.info("fuse-encoder-attention: %d attention layers fused into MultiHeadAttention", len(matches))
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "fuse-encoder-attention",
    help="an encoder's decomposed scaled-dot-product attention (torch dynamo export of BERT-style models) -> one "
    "com.microsoft.MultiHeadAttention per layer; exact (run before early-exit and quantization)",
    before=("early-exit", "quantize-int8", "quantize-int4", "pack-matmuls"),
)
def _make_fuse_encoder_attention(context) -> FuseEncoderAttentionPass:
    warn_unmeasured_contrib_op(context, logger, "fuse-encoder-attention", "MultiHeadAttention")
    return FuseEncoderAttentionPass()
