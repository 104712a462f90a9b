"""``trim-logits``: let the caller ask a decoder for the logits of its last ``k`` new tokens only.

A decoder's LM head multiplies every new token's hidden state by a ``[hidden, vocab]`` weight. During prefill
only the last token's logits are used, and with a large vocabulary the head is a big share of the work (Qwen2.5
0.5B: 896 x 151936, about a quarter of a prompt's FLOPs, plus a ``[prompt, vocab]`` float output), which is why
Hugging Face models take ``logits_to_keep`` and OpenVINO GenAI slices to the last token. This pass does the same
to an exported graph:

* Scope: the main graph of a KV decoder whose ``logits`` output comes (through ``Cast`` / ``Identity`` at most)
  from a ``MatMul``, ``Gemm`` or ``com.microsoft.MatMulNBits`` reading a 3-D ``[batch, seq, hidden]`` activation.
  Anything else is left alone (``modified=False``), as is a graph that has the input already (idempotent).
* Rewrite: ``head(x)`` -> ``head(Slice(x, starts=-logits_to_keep, ends=INT64_MAX, axes=[1]))`` with a new graph
  input ``logits_to_keep`` (int64 ``[1]``): ``0`` keeps every row (``-0`` = start at row 0), exactly the original
  outputs; ``k >= 1`` gives the last ``k`` rows. The runtime (and the speculative pass's probe) feed it from the
  plan's decoder spec: ``1`` for prompts, the number of new tokens for verification calls. (A required input,
  not an initializer with a default: ORT's IOBinding cannot bind an overridable initializer, and the shared KV
  buffer runs through IOBinding.) onnxruntime-genai does not feed it, so ``export-genai`` refuses such graphs.
* Invariants: every other input, output and name unchanged; fed ``0``, outputs equal the original's (the same
  MatMul on the same rows); fed ``k``, the rows equal the original's last ``k`` rows.
* Order: after the passes that rewrite or cut the graph (``fuse-decoder``, ``pack-matmuls``, ``eagle-drafter``,
  ``explicit-attention``), before ``speculative`` (whose decoder specs then name the input).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from dyncompile.passes._infra import not_fired, register_pass

logger = logging.getLogger(__name__)

__all__ = ["LOGITS_TO_KEEP", "TrimLogitsPass"]

#: the graph input (int64 [1]; 0 = all rows) the runtime feeds
LOGITS_TO_KEEP = "logits_to_keep"

_HEADS = {("", "MatMul"), ("", "Gemm"), ("com.microsoft", "MatMulNBits")}
_PASS_THROUGH = {"Cast", "Identity"}


def lm_head(graph: ir.Graph, logits: str = "logits") -> ir.Node | None:
    """The node computing ``logits`` from the last hidden states (see the module docstring), or ``None``."""
    out = next((v for v in graph.outputs if v.name == logits), None)
    node = out.producer() if out is not None else None
    while node is not None and node.op_type in _PASS_THROUGH:
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None or (node.domain or "", node.op_type) not in _HEADS:
        return None
    if node.op_type == "Gemm":  # 2-D only in ONNX; never a [batch, seq, hidden] head
        return None
    x, w = node.inputs[0], node.inputs[1]
    if x is None or out.shape is None or len(out.shape) != 3:
        return None
    if (x.shape is not None and len(x.shape) != 3) or (w is not None and w.shape is not None and len(w.shape) > 2):
        return None  # rows are not axis 1 of the activation
    return node


class TrimLogitsPass(ir.passes.InPlacePass):
    """Add a ``logits_to_keep`` input (0 = all rows) that limits the LM head to the last ``k`` new tokens."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        graph = model.graph
        if any(v.name == LOGITS_TO_KEEP for v in graph.inputs):
            return ir.passes.PassResult(model, modified=False)
        head = lm_head(graph)
        if head is None:
            return not_fired(model, "trim-logits", "no LM head found: a MatMul (or MatMulNBits) of a [batch, seq, "
                             "hidden] activation producing the rank-3 graph output 'logits'", "leave trim-logits out for this model")
        keep = ir.Value(name=LOGITS_TO_KEEP, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
        graph.inputs.append(keep)
        consts = {}
        for name, arr in (("ends", np.array([np.iinfo(np.int64).max], np.int64)), ("axes", np.array([1], np.int64))):
            v = ir.Value(name=f"trim_logits.{name}", const_value=ir.tensor(arr, name=f"trim_logits.{name}"))
            graph.register_initializer(v)
            consts[name] = v
        x = head.inputs[0]
        neg = ir.node("Neg", [keep], name="trim_logits/Neg")
        neg.outputs[0].name = "trim_logits.starts"
        sl = ir.node("Slice", [x, neg.outputs[0], consts["ends"], consts["axes"]], name="trim_logits/Slice")
        out = sl.outputs[0]
        out.name = "trim_logits.hidden"
        out.type = x.type
        if x.shape is not None:
            out.shape = ir.Shape([x.shape[0], "logits_to_keep", x.shape[2]])
        graph.insert_before(head, [neg, sl])
        head.replace_input_with(0, out)
        v = next(v for v in graph.outputs if v.name == "logits")
        while v is not None:  # the head's output and the Casts after it now have logits_to_keep rows
            if v.shape is not None and len(v.shape) == 3:
                v.shape = ir.Shape([v.shape[0], "logits_to_keep", v.shape[2]])
            node = v.producer()
            v = node.inputs[0] if node is not None and node is not head else None
        logger.info("trim-logits: %s %s now reads the last logits_to_keep rows", head.op_type, head.name)
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "trim-logits",
    help="add a logits_to_keep input (0 = all rows) so prompts run the LM head on their last token only",
    after=("fuse-decoder", "pack-matmuls", "eagle-drafter", "explicit-attention", "split-drafter"),
    before=("speculative",),
)
def _make_trim_logits(context) -> TrimLogitsPass:
    return TrimLogitsPass()
