"""``explicit-attention``: give a KV-cache decoder an explicit 4-D additive attention mask input.

Exported decoders build their attention mask inside the graph: causal over ``past + new`` from the 2-D
``attention_mask [batch, past + seq]``, turned into an additive float bias ``[batch, 1, seq, past + seq]``
(0 = attend, a large negative = do not) that every layer adds to its attention scores before the Softmax.
A causal mask cannot express a *draft tree* (several candidate continuations verified in one call, each
node attending to its ancestors only: :mod:`dyncompile.runtime.decode.draft_tree`), so this pass replaces that
construction with a graph input ``attention_bias`` the runtime fills; with ``position_ids`` (already an
input of Hugging Face exports) the runtime then places each tree node at ``past_len + depth``.
"""

from __future__ import annotations

import json
import logging

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from dyncompile.passes import _keys
from dyncompile.passes._infra import CompileContext, not_fired, register_pass

logger = logging.getLogger(__name__)

__all__ = ["ExposeAttentionMaskPass", "find_attention_bias", "why_no_attention_bias"]


_WEIGHT_OPS = frozenset({"MatMul", "Gemm", "MatMulNBits", "MatMulInteger", "Conv", "Attention", "MultiHeadAttention",
                         "GroupQueryAttention"})


def _cone(value: ir.Value, limit: int = 5000) -> tuple[set[str], set[str]]:
    """Graph-input names and op types in the backward cone of ``value`` (the main graph, at most ``limit`` nodes)."""
    inputs: set[str] = set()
    ops: set[str] = set()
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        node = v.producer()
        if node is None:
            if not v.is_initializer() and v.const_value is None:
                inputs.add(v.name)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > limit:
            break
        ops.add(node.op_type)
        stack.extend(i for i in node.inputs if i is not None)
    return inputs, ops


def _dtype_of(bias: ir.Value) -> ir.DataType:
    """The bias's float type: its own, else that of a float operand of its producer (the Where's 0 / -inf), else float32."""
    if bias.dtype is not None:
        return bias.dtype
    node = bias.producer()
    for v in (node.inputs if node is not None else ()):
        if v is not None and v.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return v.dtype
    return ir.DataType.FLOAT


def find_attention_bias(model: ir.Model, mask_input: str = "attention_mask") -> ir.Value | None:
    """The additive attention bias every layer adds to its scores before the Softmax, or ``None``.

    The bias must be computed from the graph input ``mask_input`` alone (no weights) and shared by all layers.
    """
    g = model.graph
    if mask_input not in {v.name for v in g.inputs}:
        return None
    found: ir.Value | None = None
    count = 0
    for node in g:
        if node.op_type != "Softmax":
            continue
        add = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
        if add is None or add.op_type != "Add":
            continue
        cands = []
        for v in add.inputs:
            if v is None or v.dtype not in (None, ir.DataType.FLOAT, ir.DataType.FLOAT16):
                continue
            if v.shape is not None and len(v.shape) != 4:
                continue
            ins, ops = _cone(v)
            if mask_input in ins and not ops & _WEIGHT_OPS:
                cands.append(v)
        if len(cands) != 1:
            continue
        if found is not None and cands[0] is not found:
            return None  # layers with different masks (e.g. sliding windows): out of scope
        found = cands[0]
        count += 1
    return found if count else None


def why_no_attention_bias(model: ir.Model, mask_input: str = "attention_mask") -> str | None:
    """Why :func:`find_attention_bias` finds no shared bias in ``model`` (None when it finds one)."""
    if mask_input not in {v.name for v in model.graph.inputs}:
        return f"the model has no {mask_input!r} input to build the attention bias from"
    if find_attention_bias(model, mask_input) is not None:
        return None
    softmaxes = [n for n in model.graph if n.op_type == "Softmax"]
    if not softmaxes:
        return "the model has no Softmax (its attention is fused or not in the main graph)"
    return (f"no single additive bias computed from {mask_input!r} alone (no weights) is added to the scores before "
            f"all {len(softmaxes)} Softmaxes (e.g. {softmaxes[0].name!r}): the layers build their masks differently "
            "(sliding windows?) or apply them in another way")


class ExposeAttentionMaskPass(ir.passes.InPlacePass):
    """Replace a decoder's in-graph attention-mask construction by a 4-D additive float mask input.

    Scope: the main graph. Fires on a decoder with an ``attention_mask`` input and a ``position_ids`` input
    whose layers all add one shared bias ``[batch, 1, seq, past + seq]`` (computed from ``attention_mask``
    only) to their attention scores before the Softmax (Hugging Face exports: SmolLM2, Qwen2.5).

    Invariants: every consumer of that bias reads the new input ``attention_bias`` (same dtype and shape)
    instead; the nodes that built it and the then unused ``attention_mask`` input are removed; nothing else
    changes. Fed the bias the original graph computed (0 where a key is visible, the float32 minimum where
    not), the logits equal the original's; fed an ancestor-only mask over the new tokens and per-node
    ``position_ids``, one call verifies a draft tree. Records ``dyncompile.explicit_attention`` (JSON: input
    name, the value it replaced).
    Does not fire (``modified=False``): no ``attention_mask`` input (e.g. a second run), or no single shared
    bias before the Softmaxes.
    Precondition: where it would fire, a ``position_ids`` input (a decoder that derives positions from the mask
    would put tree nodes at the wrong positions).

    Sketch: ``Where(causal & mask, 0, -inf) -> Add(scores, .) -> Softmax`` becomes
    ``attention_bias -> Add(scores, .) -> Softmax``.
    """

    def __init__(self, input_name: str = "attention_bias", mask_input: str = "attention_mask",
                 position_input: str = "position_ids") -> None:
        super().__init__()
        self.input_name = input_name
        self.mask_input = mask_input
        self.position_input = position_input

    def __repr__(self) -> str:
        return f"ExposeAttentionMaskPass(input_name={self.input_name!r})"

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        names = {v.name for v in model.graph.inputs}
        if self.position_input not in names and find_attention_bias(model, self.mask_input) is not None:
            raise ir.passes.PreconditionError(
                f"explicit-attention: the decoder has {self.mask_input!r} but no {self.position_input!r} input, so it "
                "derives positions from the mask and tree nodes could not be placed at past_len + depth; re-export "
                "it with position_ids (Hugging Face exports have them)"
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        g = model.graph
        if self.input_name in {v.name for v in g.inputs}:
            logger.info("explicit-attention: %r is already an input; nothing to do", self.input_name)
            return ir.passes.PassResult(model, modified=False)
        bias = find_attention_bias(model, self.mask_input)
        if bias is None:
            return not_fired(model, "explicit-attention", why_no_attention_bias(model, self.mask_input) or "no bias",
                             "draft trees (speculative{tree=true}) need it; use speculative without tree=true")
        shape = ir.Shape(["batch", 1, "seq", "past_plus_seq"])
        new = ir.Value(name=self.input_name, shape=shape, type=ir.TensorType(_dtype_of(bias)))
        replaced = bias.name
        ir.convenience.replace_all_uses_with(bias, new)
        g.inputs.append(new)
        common_passes.RemoveUnusedNodesPass()(model)
        mask = next(v for v in g.inputs if v.name == self.mask_input)
        removed = []
        if not mask.uses():
            g.inputs.remove(mask)
            removed.append(self.mask_input)
        model.metadata_props[_keys.EXPLICIT_ATTENTION] = json.dumps(
            {"input": self.input_name, "replaced": replaced, "removed_inputs": removed}, sort_keys=True
        )
        logger.info("explicit-attention: %r now comes from input %r (removed inputs %s)", replaced, self.input_name,
                    removed)
        return ir.passes.PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        """Check what the pass promises on its output."""
        if _keys.EXPLICIT_ATTENTION in model.metadata_props and self.input_name not in {v.name for v in model.graph.inputs}:
            raise ir.passes.PostconditionError(f"explicit-attention: no {self.input_name!r} input after the pass")


@register_pass(
    "explicit-attention",
    help="decoder: replace the in-graph causal mask by a 4-D additive mask input attention_bias (with position_ids): "
    "what draft trees (speculative{tree=true}) need",
    after=("split-drafter",),
    before=("speculative",),
)
def _make_explicit_attention(context: CompileContext, input_name: str = "attention_bias") -> ExposeAttentionMaskPass:
    del context
    return ExposeAttentionMaskPass(input_name=input_name)
