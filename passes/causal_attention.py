"""``causal-attention``: let a fused decoder's GroupQueryAttention mask causally instead of through a 4-D bias.

``explicit-attention,fuse-decoder`` gives each layer a ``com.microsoft.GroupQueryAttention`` (GQA) that takes the
graph input ``attention_bias`` (``[batch, 1, new, past + new]``, additive) as its mask: any mask the runtime
wants (draft trees, rolled-back holes in the cache). ONNX Runtime's CUDA GQA accepts no ``attention_bias`` at all
(and no float32: ``float16`` is the other half of the CUDA graph), so such a graph runs its attention on the CPU
EP behind host copies. This pass gives GQA the causal form every CUDA kernel takes, the one onnxruntime-genai's
models use:

* Scope: the main graph of a ``fuse-decoder`` graph whose GQA nodes read the ``attention_bias`` input (and nothing
  else reads it but the ``Shape`` that sizes ``seqlens_k`` / ``total_sequence_length``). Anything else is left
  alone with a reason (no GQA, no bias input, another consumer of the bias).
* Rewrite: the 4-D float input ``attention_bias`` becomes a 2-D int64 input ``attention_mask`` ``[batch, past +
  new]`` (ones over the valid slots); every GQA masks causally (``causal=1``), drops its ``attention_bias`` and takes ``seqlens_k =
  ReduceSum(attention_mask) - 1`` and ``total_sequence_length = attention_mask.shape[1]``; a GQA that applies
  rotary embeddings itself (``do_rotary=1``) also drops ``position_ids`` and takes its positions from
  ``seqlens_k`` (slot index = position in a gap-free cache).
* Invariants: every other input, output and name unchanged; the logits equal the bias graph's (fed the causal
  bias of a gap-free cache) within float round-off. What the graph gives up: holes in the cache (the mask says how
  many slots are valid, not which) and draft trees. The runtime reads that from the plan
  (``DecoderSpec.attention = "causal"``): it keeps the cache gap-free (rollback by copy, or by moving a shared
  buffer's end) and verifies chains only; ``speculative{tree=true}`` is refused on such a graph.
* Order: after ``fuse-decoder`` and ``pack-matmuls`` (which fold q/k/v and the rotary into GQA), before
  ``speculative``.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from dyncompile.passes._infra import not_fired, register_pass

logger = logging.getLogger(__name__)

__all__ = ["CausalAttentionPass", "causal_gqa_nodes", "is_causal_attention_graph"]

_MS = "com.microsoft"
_BIAS = "attention_bias"
_MASK = "attention_mask"
#: GroupQueryAttention's input slots
_SEQLENS, _TOTAL, _POSITIONS, _BIAS_SLOT = 5, 6, 9, 10
_FIX = "leave causal-attention out, or compile with --passes explicit-attention,fuse-decoder first"


def _gqa(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == _MS]


def causal_gqa_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The GroupQueryAttention nodes of ``graph`` that mask causally (no ``attention_bias`` input)."""
    return [n for n in _gqa(graph) if len(n.inputs) <= _BIAS_SLOT or n.inputs[_BIAS_SLOT] is None]


def is_causal_attention_graph(graph: ir.Graph) -> bool:
    """Whether every GroupQueryAttention of ``graph`` masks causally, sized by an ``attention_mask`` input.

    What this pass leaves (a second run does nothing) and what the plan records as ``attention: causal``.
    """
    gqa = _gqa(graph)
    return bool(gqa) and len(causal_gqa_nodes(graph)) == len(gqa) and any(v.name == _MASK for v in graph.inputs)


def _trim(node: ir.Node, drop: set[int]) -> None:
    """Set inputs ``drop`` of ``node`` to None and cut trailing None inputs."""
    inputs = [None if i in drop else v for i, v in enumerate(node.inputs)]
    while inputs and inputs[-1] is None:
        inputs.pop()
    if len(inputs) == len(node.inputs):
        for i in drop:
            node.replace_input_with(i, None)
        return
    node.resize_inputs(len(inputs))
    for i, v in enumerate(inputs):
        if node.inputs[i] is not v:
            node.replace_input_with(i, v)


class CausalAttentionPass(ir.passes.InPlacePass):
    """Replace the GQA nodes' 4-D ``attention_bias`` by causal masking sized by a 2-D ``attention_mask`` input."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @staticmethod
    def _why_not(graph: ir.Graph) -> str | None:
        gqa = _gqa(graph)
        if not gqa:
            return "no GroupQueryAttention node (compile with fuse-decoder first)"
        bias = next((v for v in graph.inputs if v.name == _BIAS), None)
        if bias is None:
            return f"no {_BIAS} graph input (compile with explicit-attention before fuse-decoder)"
        if any(v.name == _MASK for v in graph.inputs):
            return f"the graph has both {_BIAS} and {_MASK} inputs"
        for node, idx in bias.uses():
            if node.op_type == "GroupQueryAttention" and node.domain == _MS and idx == _BIAS_SLOT:
                continue
            if node.op_type == "Shape" and node.attributes.get_int("start", 0) == 3:
                continue
            return f"{_BIAS} also feeds {node.op_type} {node.name!r} (an attention layer fuse-decoder left unfused?)"
        if any(len(n.inputs) <= _BIAS_SLOT or n.inputs[_BIAS_SLOT] is not bias for n in gqa):
            return f"a GroupQueryAttention node does not take the {_BIAS} input as its mask"
        return None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the module docstring)."""
        graph = model.graph
        if is_causal_attention_graph(graph):
            return ir.passes.PassResult(model, modified=False)  # done already
        why = self._why_not(graph)
        if why is not None:
            return not_fired(model, "causal-attention", why, _FIX)
        bias = next(v for v in graph.inputs if v.name == _BIAS)
        batch = bias.shape[0] if bias.shape is not None else "batch"
        total = bias.shape[3] if bias.shape is not None else "total_sequence_length"
        mask = ir.Value(name=_MASK, shape=ir.Shape([batch, total]), type=ir.TensorType(ir.DataType.INT64))
        graph.inputs[graph.inputs.index(bias)] = mask
        one = ir.Value(name="causal_attention.one", const_value=ir.tensor(np.array(1, np.int64), name="causal_attention.one"))
        axes = ir.Value(name="causal_attention.axes", const_value=ir.tensor(np.array([1], np.int64), name="causal_attention.axes"))
        graph.register_initializer(one)
        graph.register_initializer(axes)
        nodes = [
            ir.node("ReduceSum", [mask, axes], attributes={"keepdims": 0}, name="causal_attention/ReduceSum"),
        ]
        nodes.append(ir.node("Sub", [nodes[0].outputs[0], one], name="causal_attention/Sub"))
        nodes.append(ir.node("Cast", [nodes[1].outputs[0]], attributes={"to": ir.DataType.INT32}, name="causal_attention/Cast"))
        nodes.append(ir.node("Shape", [mask], attributes={"start": 1, "end": 2}, name="causal_attention/Shape"))
        nodes.append(ir.node("Cast", [nodes[3].outputs[0]], attributes={"to": ir.DataType.INT32}, name="causal_attention/CastTotal"))
        nodes.append(ir.node("Squeeze", [nodes[4].outputs[0]], name="causal_attention/Squeeze"))
        seqlens, total_len = nodes[2].outputs[0], nodes[5].outputs[0]
        seqlens.name, total_len.name = "causal_attention.seqlens_k", "causal_attention.total_sequence_length"
        seqlens.type = total_len.type = ir.TensorType(ir.DataType.INT32)
        seqlens.shape, total_len.shape = ir.Shape([batch]), ir.Shape([])
        graph.insert_before(next(iter(graph)), nodes)
        dropped_positions = 0
        for node in _gqa(graph):
            node.replace_input_with(_SEQLENS, seqlens)
            node.replace_input_with(_TOTAL, total_len)
            node.attributes["causal"] = ir.AttrInt64("causal", 1)  # fuse-decoder's causal=0 left the mask to the bias
            drop = {_BIAS_SLOT}
            if node.attributes.get_int("do_rotary", 0) and len(node.inputs) > _POSITIONS and node.inputs[_POSITIONS] is not None:
                drop.add(_POSITIONS)
                dropped_positions += 1
            _trim(node, drop)
        import onnx_ir.passes.common as common_passes

        common_passes.RemoveUnusedNodesPass()(model)  # the old Shape(attention_bias) -> seqlens / total chain
        if list(bias.uses()):  # pragma: no cover - _why_not allows only GQA and the dead Shape chain
            raise RuntimeError(f"causal-attention left {_BIAS} in use")
        logger.info("causal-attention: %d GroupQueryAttention nodes mask causally (attention_mask sizes them)%s",
                    len(_gqa(graph)), f"; {dropped_positions} take rotary positions from seqlens_k" if dropped_positions else "")
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "causal-attention",
    help="decoder: GroupQueryAttention masks causally, sized by a 2-D attention_mask input, instead of reading the "
    "4-D attention_bias (what ORT's CUDA kernel takes; chains only, no draft trees)",
    after=("explicit-attention", "fuse-decoder", "pack-matmuls", "trim-logits"),
    before=("speculative",),
)
def _make_causal_attention(context) -> CausalAttentionPass:
    return CausalAttentionPass()
