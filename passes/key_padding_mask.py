"""``key-padding-mask``: an encoder's padding bias -> ``MultiHeadAttention``'s ``key_padding_mask``.

torch's ONNX exporter (dynamo) builds a BERT-style encoder's attention mask from ``attention_mask`` with about
twenty small kernels (``Shape``, ``Range``, ``Unsqueeze``, ``Expand``, ``Concat``, ``GatherND``, two ``And``, a
``Where``...) into a ``[B, 1, S, T]`` additive bias: 0 where the key is a token, a huge negative number where it is
padding. After ``fuse-encoder-attention`` that bias is each ``MultiHeadAttention``'s ``attention_bias``; the
operator takes the same information as ``key_padding_mask`` (``[B, T]`` int32, 1 = attend) and masks the padded
keys itself. At batch 1 on a CPU the chain costs more than a layer's attention kernel.

* Scope: main-graph ``com.microsoft.MultiHeadAttention`` nodes without a ``key_padding_mask`` whose
  ``attention_bias`` is a *padding bias* ``P`` or ``Add(X, P)`` (MPNet: its relative position bias ``X`` plus
  ``P``; ``X`` stays the bias). ``P`` is recognised by what it computes, not by the exporter's node pattern:
  (1) the graph inputs it depends on are ``attention_mask`` and, only through ``Shape``, other inputs; (2) on
  probe masks (two batch shapes, rows with and without padding, evaluated in ONNX Runtime) it is 0 wherever
  ``attention_mask`` is 1 and at most -1e4 wherever it is 0, the same for every query position and head (a
  bias the probe cannot evaluate, e.g. one that reads the shape of an input that is not ``[batch, sequence]``,
  is left alone).
* Rewrite: ``key_padding_mask = Cast(attention_mask, int32)`` (one, shared) and ``attention_bias`` = ``X`` or
  none; nodes nothing reads any more go.
* Invariants: graph inputs/outputs unchanged; outputs equal the input graph's (within 1e-6 on real MiniLM-L6
  and MPNet-base rows, padded batches included, in ORT with ``ORT_DISABLE_ALL``; bit-equal on the tested rows)
  for every input in which each row attends to at least one key: a masked key's probability is
  ``exp(-1e4 - ...)`` = 0 in float32 either way. Nodes whose ``mask_filter_value`` is above -1e4 are left alone.
  Idempotent: a rewritten node has its ``key_padding_mask``, so a second run reports ``modified=False``.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from dyncompile.passes._graph import extract_model
from dyncompile.passes._infra import not_fired, register_pass

logger = logging.getLogger(__name__)

__all__ = ["KeyPaddingMaskPass"]

_MS = "com.microsoft"
MASK_INPUT = "attention_mask"
#: a padded key's bias must be at most this (MultiHeadAttention's own mask value is -10000)
MASKED_AT_MOST = -1e4
#: probe masks: (batch rows, each row's number of tokens) at two sequence lengths
PROBES = ((7, (7, 4, 1)), (3, (3,)))


def _inputs_reached(v: ir.Value, graph_inputs: set[ir.Value]) -> set[str]:
    """Names of the graph inputs ``v`` depends on through their values (not only through a ``Shape``)."""
    reached: set[str] = set()
    seen: set[tuple[int, bool]] = set()
    stack = [(v, False)]
    while stack:
        x, shape_only = stack.pop()
        if x is None or (id(x), shape_only) in seen:
            continue
        seen.add((id(x), shape_only))
        if x in graph_inputs:
            if not shape_only:
                reached.add(x.name)
            continue
        p = x.producer()
        if p is not None:
            stack.extend((i, shape_only or p.op_type == "Shape") for i in p.inputs)
    return reached


def _probe(model: ir.Model, candidates: list[ir.Value]) -> set[str]:
    """Names of the ``candidates`` that compute a padding bias on every probe mask (module docstring, (2))."""
    import onnxruntime as ort

    names = [v.name for v in candidates]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    try:
        ok = set(names)
        part = extract_model(model, [v.name for v in model.graph.inputs], names, "padding_bias_probe")
        sess = ort.InferenceSession(ir.to_proto(part).SerializeToString(), so, providers=["CPUExecutionProvider"])
        for seq, lengths in PROBES:
            ok &= _padding_biases(sess, names, seq, lengths)
    except Exception as e:  # e.g. an input reached through Shape whose rank is not [batch, sequence]
        logger.info("key-padding-mask: the bias could not be evaluated on probe masks (%s)", e)
        return set()
    return ok


def _padding_biases(sess, names: list[str], seq: int, lengths: tuple[int, ...]) -> set[str]:
    """Which of ``names`` are a padding bias on one probe mask (rows of ``lengths`` tokens out of ``seq``)."""
    mask = np.array([[1] * n + [0] * (seq - n) for n in lengths], np.int64)
    feeds = {}
    for i in sess.get_inputs():
        if i.name == MASK_INPUT:
            feeds[i.name] = mask.astype(np.int32 if i.type == "tensor(int32)" else np.int64)
        else:  # reached only through Shape: its values do not matter, its [batch, sequence] shape does
            dtype = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}.get(i.type, np.float32)
            feeds[i.name] = np.zeros(mask.shape, dtype)
    keep = mask[:, None, None, :].astype(bool)  # [B, 1, 1, T]: the key is a token
    ok = set()
    for name, out in zip(names, sess.run(names, feeds), strict=True):
        out = np.asarray(out)
        if out.ndim != 4 or out.shape[1] != 1:
            continue
        try:
            b = np.broadcast_to(out, (len(lengths), 1, seq, seq))  # the same for every head
        except ValueError:
            continue
        k = np.broadcast_to(keep, b.shape)
        if np.all(b[k] == 0) and np.all(b[~k] <= MASKED_AT_MOST):
            ok.add(name)
    return ok


class KeyPaddingMaskPass(ir.passes.InPlacePass):
    """A padding bias -> ``MultiHeadAttention``'s ``key_padding_mask`` (see the module docstring)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the module docstring)."""
        graph = model.graph
        mhas = [n for n in graph if n.op_type == "MultiHeadAttention" and n.domain == _MS]
        pending = [n for n in mhas if not (len(n.inputs) > 4 and n.inputs[4] is not None)]
        if mhas and not pending:
            return ir.passes.PassResult(model, modified=False)  # rewritten by an earlier run
        todo = [n for n in pending if n.attributes.get_float("mask_filter_value", MASKED_AT_MOST) <= MASKED_AT_MOST]
        mask = next((v for v in graph.inputs if v.name == MASK_INPUT), None)
        why = None
        if not mhas:
            why = "no com.microsoft.MultiHeadAttention (run fuse-encoder-attention first)"
        elif not todo:
            why = f"every MultiHeadAttention masks with a mask_filter_value above {MASKED_AT_MOST:g}"
        elif mask is None:
            why = f"the graph has no {MASK_INPUT!r} input"
        if why:
            return not_fired(model, "key-padding-mask", why, "leave key-padding-mask out for this model")
        inputs = set(graph.inputs)
        # per node: (its bias, the operand that would stay the bias or None) for each way the bias may hold P
        options: dict[ir.Node, list[tuple[ir.Value, ir.Value | None]]] = {}
        for n in todo:
            b = n.inputs[5] if len(n.inputs) > 5 else None
            if b is None:
                continue
            opts = [(b, None)]
            p = b.producer()
            if p is not None and p.op_type == "Add" and p.domain in ("", "ai.onnx"):
                opts += [(p.inputs[1 - i], p.inputs[i]) for i in (0, 1)]  # (P, X) with X kept
            options[n] = [(cand, keep) for cand, keep in opts if _inputs_reached(cand, inputs) == {MASK_INPUT}]
        candidates = list({id(c): c for opts in options.values() for c, _ in opts}.values())
        padding = _probe(model, candidates) if candidates else set()
        chosen = {n: next(((c, k) for c, k in opts if c.name in padding), None) for n, opts in options.items()}
        chosen = {n: ck for n, ck in chosen.items() if ck is not None}
        if not chosen:
            return not_fired(model, "key-padding-mask",
                             f"no MultiHeadAttention bias is a padding mask computed from {MASK_INPUT!r} alone (0 for "
                             "a token, <= -1e4 for padding, the same for every query)",
                             "leave key-padding-mask out for this model")
        cast = ir.node("Cast", [mask], attributes={"to": ir.AttrInt64("to", ir.DataType.INT32)},
                       name="key_padding_mask.cast")
        cast.outputs[0].name = "key_padding_mask"
        graph.insert_before(next(iter(chosen)), cast)
        for n, (_, keep) in chosen.items():
            ins = list(n.inputs) + [None] * (6 - len(n.inputs))
            ins[4], ins[5] = cast.outputs[0], keep
            while ins and ins[-1] is None:
                ins.pop()
            n.resize_inputs(len(ins))
            for i, v in enumerate(ins):
                n.replace_input_with(i, v)
        import onnx_ir.passes.common as common_passes

        common_passes.RemoveUnusedNodesPass()(model)
        logger.info("key-padding-mask: %d of %d MultiHeadAttention nodes read attention_mask as their key padding mask",
                    len(chosen), len(mhas))
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "key-padding-mask",
    help="an encoder's exported padding-mask bias -> MultiHeadAttention's key_padding_mask (after "
    "fuse-encoder-attention); exact",
    after=("fuse-encoder-attention",),
    before=("early-exit", "quantize-int8", "quantize-int4", "pack-matmuls"),
)
def _make_key_padding_mask(context) -> KeyPaddingMaskPass:
    return KeyPaddingMaskPass()
