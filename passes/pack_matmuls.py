"""``pack-matmuls``: merge the MatMuls that read one activation with constant weights into one MatMul + Split.

A decoder layer multiplies the same normed hidden state by three constant weights (q, k, v projections) and the
MLP input by two (gate, up). On a CPU at batch 1 each of those is a memory-bound GEMV with its own kernel launch
and thread-pool synchronisation; onnxruntime-genai's model builder emits them packed (one ``[K, Nq+Nk+Nv]``
weight). This pass does the same to any graph:

* Scope: the main graph's standard-domain ``MatMul`` nodes whose second input is a constant 2-D float tensor
  (an initializer); nodes reading the same first input form a group. Groups of fewer than ``min_group`` nodes,
  nodes in subgraphs, groups whose weights differ in dtype or rows, and groups any of whose outputs is a graph
  output are left alone.
* Rewrite: ``Y_i = MatMul(X, W_i)`` -> ``P = MatMul(X, concat_i(W_i, axis=1))``, ``Y_1..Y_n = Split(P, axis=-1,
  split=[N_1..N_n])``; every former consumer of ``Y_i`` reads the split output instead; the old weights go when no
  longer used. When every ``Y_i`` feeds exactly one ``Add`` of a constant ``[N_i]`` bias (Qwen's q/k/v), the
  biases are packed too: ``Split(Add(P, concat_i(b_i)))`` replaces the Adds' outputs (one Add instead of n).
* Attention: when a packed q/k/v Split feeds ``GroupQueryAttention`` (from ``fuse-decoder``) through one
  ``RotaryEmbedding`` on q and one on k (same ``position_ids`` and cos/sin caches, full-head, not interleaved),
  GQA takes the packed tensor whole and applies the rotary itself: ``GQA(P, -, -, past_k, past_v, seqlens_k,
  total, cos, sin, position_ids, bias, do_rotary=1)``, as onnxruntime-genai's builder emits it. The Split and
  both RotaryEmbeddings go (per layer: three kernels and two copies of q/k). GQA's ``position_ids`` input keeps
  arbitrary positions working (a draft tree's siblings share one).
* Invariants: graph inputs/outputs unchanged; each output column is the same dot product as before (the packed
  GEMM reduces over K in the same order per column), so outputs match within float round-off (tested ≤ 1e-5 in
  ORT with ``ORT_DISABLE_ALL``); weight bytes unchanged in total. Idempotent: a packed activation has one MatMul
  consumer left, so a second run reports ``modified=False``.
* Order: after ``fuse-decoder`` (whose attention patterns match the unpacked q/k/v MatMuls) and before
  ``quantize-int4`` (which then quantizes the packed weight as one MatMulNBits).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from dyncompile.errors import PassConfigError
from dyncompile.passes._infra import not_fired, register_pass

logger = logging.getLogger(__name__)

__all__ = ["PackMatMulsPass"]

_MS = "com.microsoft"


def _const_weight(v: ir.Value | None) -> ir.TensorProtocol | None:
    if v is None or v.const_value is None or not v.is_initializer():
        return None
    shape = v.const_value.shape
    if len(shape) != 2 or v.const_value.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return None
    return v.const_value


def _packed_gqa_rule():
    """``GQA(rope(q), rope(k), v, ...)`` over ``q, k, v = Split(P)`` -> ``GQA(P, ..., do_rotary=1)``."""
    from onnxscript.rewriter import pattern

    class _PackedGQA(pattern.RewriteRuleClassBase):
        def __init__(self) -> None:
            super().__init__("PackedGQA", remove_nodes=True)

        def pattern(self, op, packed, sizes, pos, cos, sin, past_k, past_v, seqlens_k, total, bias):
            q, k, v = op.Split(packed, sizes, axis=-1, _outputs=3)
            q_rot = op.RotaryEmbedding(q, pos, cos, sin, _domain=_MS, _allow_other_attributes=True,
                                       _outputs=["q_rot"])
            k_rot = op.RotaryEmbedding(k, pos, cos, sin, _domain=_MS, _allow_other_attributes=True,
                                       _outputs=["k_rot"])
            return op.GroupQueryAttention(q_rot, k_rot, v, past_k, past_v, seqlens_k, total, None, None, None, bias,
                                          _domain=_MS, _allow_other_attributes=True, _outputs=["out", "pk", "pv"])

        def check(self, context, sizes, q_rot, k_rot, out, **_):
            r = pattern.MatchResult()
            gqa = out.producer()
            a = gqa.attributes
            h, hkv = a.get_int("num_heads", 0), a.get_int("kv_num_heads", 0)
            if a.get_int("do_rotary", 0) or len(gqa.inputs) != 11 or len(gqa.outputs) != 3:
                return r.fail("GroupQueryAttention already rotates, or has other optional inputs", out)
            for rope, heads in ((q_rot, h), (k_rot, hkv)):
                ra = rope.producer().attributes
                if (ra.get_int("interleaved", 0) or ra.get_int("rotary_embedding_dim", 0)
                        or ra.get_int("num_heads", 0) != heads or "scale" in ra):
                    return r.fail("rotary is interleaved, partial or scaled", rope)
            widths = sizes.const_value.numpy().tolist() if sizes.const_value is not None else None
            if not h or not widths or len(widths) != 3 or widths[1] != widths[2] or widths[0] * hkv != widths[1] * h:
                return r.fail("the Split is not q/k/v for these head counts", sizes)
            self._attrs = {k: v.value for k, v in a.items()}
            return r

        def rewrite(self, op, packed, pos, cos, sin, past_k, past_v, seqlens_k, total, bias, **_):
            return op.GroupQueryAttention(packed, None, None, past_k, past_v, seqlens_k, total, cos, sin, pos, bias,
                                          _domain=_MS, _outputs=3, **{**self._attrs, "do_rotary": 1})

    return _PackedGQA.rule()


class PackMatMulsPass(ir.passes.InPlacePass):
    """Pack sibling MatMuls (same activation, constant weights) into one MatMul followed by a Split."""

    def __init__(self, min_group: int = 2) -> None:
        super().__init__()
        if min_group < 2:
            raise ValueError(f"min_group must be >= 2, not {min_group}")
        self.min_group = min_group

    def __repr__(self) -> str:
        return f"{type(self).__name__}(min_group={self.min_group})"

    def _groups(self, model: ir.Model) -> list[list[ir.Node]]:
        outputs = set(model.graph.outputs)
        by_input: dict[int, list[ir.Node]] = {}
        for node in model.graph:
            if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
                continue
            if node.inputs[0] is None or _const_weight(node.inputs[1]) is None or node.outputs[0] in outputs:
                continue
            by_input.setdefault(id(node.inputs[0]), []).append(node)
        groups = []
        for nodes in by_input.values():
            if len(nodes) < self.min_group:
                continue
            ws = [n.inputs[1].const_value for n in nodes]
            if len({w.dtype for w in ws}) != 1 or len({w.shape[0] for w in ws}) != 1:
                continue
            groups.append(nodes)
        return groups

    @staticmethod
    def _biases(nodes: list[ir.Node], outputs: set) -> list[tuple[ir.Node, ir.Value]] | None:
        """The ``(Add(y_i, b_i), b_i)`` after each MatMul, or ``None`` when any MatMul lacks one.

        ``b_i`` is a constant ``[N_i]`` vector and ``y_i`` is read by nothing else; with ``None`` the biases stay
        where they are.
        """
        adds = []
        for n in nodes:
            uses = list(n.outputs[0].uses())
            if len(uses) != 1 or uses[0][0].op_type != "Add" or uses[0][0].domain not in ("", "ai.onnx"):
                return None
            add = uses[0][0]
            b = add.inputs[1 - uses[0][1]]
            w = n.inputs[1].const_value
            if (b is None or b.const_value is None or not b.is_initializer() or b.const_value.dtype != w.dtype
                    or list(b.const_value.shape) != [w.shape[1]] or add.outputs[0] in outputs):
                return None
            adds.append((add, b))
        return adds

    def _why_none(self, model: ir.Model) -> str:
        """Why no group formed, naming a fused projection (GPT-2's Conv1D: one Gemm + Split) when there is one."""
        why = (f"no {self.min_group} or more constant-weight MatMuls read the same activation (packable groups: same "
               "weight dtype and rows, no graph output among them)")
        split = next((n for n in model.graph if n.op_type == "Split" and n.inputs and n.inputs[0] is not None
                      and n.inputs[0].producer() is not None
                      and n.inputs[0].producer().op_type in ("Gemm", "MatMul", "Reshape")), None)
        if split is not None:
            why += f"; the projections may already be packed in the export (Split {split.name!r} of one product)"
        return why

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        groups = self._groups(model)
        if not groups:
            if any(n.name.startswith("pack_matmuls.") for n in model.graph):  # packed by an earlier run
                return ir.passes.PassResult(model, modified=False)
            return not_fired(model, "pack-matmuls", self._why_none(model),
                             "leave pack-matmuls out for this model")
        graph = model.graph
        for k, nodes in enumerate(groups):
            x = nodes[0].inputs[0]
            arrays = [n.inputs[1].const_value.numpy() for n in nodes]
            widths = [int(a.shape[1]) for a in arrays]
            stem = f"pack_matmuls.{k}"
            while any(v.name == f"{stem}.weight" for v in graph.initializers.values()):
                stem += "_"
            w = ir.Value(name=f"{stem}.weight", const_value=ir.tensor(np.concatenate(arrays, axis=1),
                                                                       name=f"{stem}.weight"))
            graph.register_initializer(w)
            sizes = ir.Value(name=f"{stem}.split", const_value=ir.tensor(np.asarray(widths, np.int64),
                                                                          name=f"{stem}.split"))
            graph.register_initializer(sizes)
            packed = ir.node("MatMul", [x, w], name=f"{stem}/MatMul")
            packed.outputs[0].name = f"{stem}.out"
            new_nodes = [packed]
            adds = self._biases(nodes, set(graph.outputs))
            if adds:  # one Add of the concatenated biases on the packed output, before the Split
                bias = np.concatenate([b.const_value.numpy() for _, b in adds])
                b = ir.Value(name=f"{stem}.bias", const_value=ir.tensor(bias, name=f"{stem}.bias"))
                graph.register_initializer(b)
                new_nodes.append(ir.node("Add", [packed.outputs[0], b], name=f"{stem}/Add"))
                new_nodes[-1].outputs[0].name = f"{stem}.biased"
            split = ir.node("Split", [new_nodes[-1].outputs[0], sizes], attributes={"axis": -1},
                            num_outputs=len(nodes), name=f"{stem}/Split")
            new_nodes.append(split)
            graph.insert_before(nodes[0], new_nodes)
            replaced = [a for a, _ in adds] if adds else nodes
            for old, new in zip(replaced, split.outputs):
                out = old.outputs[0]
                name = out.name  # keep the value names the rest of the graph (and readers) know
                out.name = None
                new.name = name
                if out.shape is not None:
                    new.shape = out.shape
                new.type = out.type
                ir.convenience.replace_all_uses_with(out, new)
            graph.remove([*replaced, *nodes] if adds else nodes, safe=True)
        import onnx_ir.passes.common as common_passes

        gqa = _packed_gqa_rule().apply_to_model(model) if any(n.op_type == "GroupQueryAttention" for n in graph) else 0
        common_passes.RemoveUnusedNodesPass()(model)  # the replaced weights (and rotary caches, if any went)
        logger.info("pack-matmuls: %d groups packed (%s MatMuls); %d attention layers take packed q/k/v", len(groups),
                    sum(len(g) for g in groups), gqa)
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "pack-matmuls",
    help="merge MatMuls that read the same activation with constant weights (q/k/v, gate/up) into one MatMul + "
    "Split, as onnxruntime-genai's builder packs them; exact",
    after=("fuse-decoder",),
    before=("quantize-int4",),
)
def _make_pack_matmuls(context, min_group: int = 2) -> PackMatMulsPass:
    if min_group < 2:
        raise PassConfigError(f"pack-matmuls: min_group must be >= 2, not {min_group}")
    return PackMatMulsPass(min_group=min_group)
