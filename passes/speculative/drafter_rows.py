"""An int8 twin of an int4 drafter for its calls of many rows (the prompt, catch-up after a long accepted run).

An external int4 drafter (``MatMulNBits``, int8 compute) drafts one token per call fast, but its calls of many rows
run ``MatMulNBits``' blocked int8 kernels, which do not use the matrix units of CPUs that have them (AMX): on a
2-core Xeon with AMX, Qwen2.5-Coder-0.5B int4 takes 1.77 s for a 570-token prompt and the same graph with int8
``MatMul`` weights (whose integer GEMM uses AMX there) 0.51 s, while one-token calls are faster in int4 (15 vs 26 ms
of weight products). A speculative plan runs the drafter's prompt inside the first decode round,
so that second copy of the prompt is part of every answer's time per output token.

:func:`int8_rows_twin` builds the twin from the drafter itself: each ``MatMulNBits`` weight is dequantized (its
4-bit or 8-bit codes, zero points and block scales) to float32 and re-quantized to int8 per output column, with
one activation scale per row (``MatMulIntegerToFloat``); everything else (the attention, the embedding
table, the trimmed LM head's vocabulary) is the drafter's own graph, so the two share inputs, outputs and KV layout
and the runtime can hand the cache from one to the other. Its numbers are the int4 drafter's up to the int8
rounding: drafts may differ, never the output (every draft is verified by the target).
:func:`rows_from` picks the fewest rows from which the twin is faster, timed on this machine.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir

logger = logging.getLogger("dyncompile.passes.speculative")

__all__ = ["ROW_SIZES", "dequantize_matmulnbits", "int8_rows_twin", "rows_from"]

#: the call sizes (new rows on a 128-token cache) at which drafter and twin are timed (one row included)
ROW_SIZES = (1, 4, 16, 64)


def _unpack(codes: np.ndarray, bits: int, count: int) -> np.ndarray:
    """``count`` unsigned ``bits``-bit values per row of ``codes`` (uint8, low bits first)."""
    if bits == 8:
        return codes[..., :count].astype(np.int32)
    lo, hi = codes & 0x0F, codes >> 4
    out = np.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], -1)
    return out[..., :count].astype(np.int32)


def dequantize_matmulnbits(node: ir.Node) -> np.ndarray | None:
    """The float32 weight ``[K, N]`` a ``MatMulNBits`` node multiplies by (``None``: not a constant 4/8-bit one).

    ``B`` ``[N, blocks, blob]`` holds the codes, ``scales`` one float per (column, block), ``zero_points`` packed
    codes (or floats) per (column, block), by default the middle code ``2**(bits-1)``; ``g_idx`` (act-order) is not
    handled.
    """
    a = node.attributes
    k, n, bits, bs = (a.get_int(x) for x in ("K", "N", "bits", "block_size"))
    ins = list(node.inputs) + [None] * (6 - len(node.inputs))
    if bits not in (4, 8) or ins[4] is not None:
        return None
    vals = [v.const_value if v is not None else None for v in ins[1:4]]
    if vals[0] is None or vals[1] is None or (ins[3] is not None and vals[2] is None):
        return None
    blocks = (k + bs - 1) // bs
    codes = _unpack(vals[0].numpy().reshape(n, blocks, -1), bits, bs).astype(np.float32)
    scales = vals[1].numpy().astype(np.float32).reshape(n, blocks)
    if vals[2] is None:
        zp = np.full((n, blocks), 2 ** (bits - 1), np.float32)
    elif vals[2].dtype == ir.DataType.UINT8:
        zp = _unpack(vals[2].numpy().reshape(n, -1), bits, blocks).astype(np.float32)
    else:  # float zero points: w = (q - zp) * s with zp in code units, as ORT's kernel reads them
        zp = vals[2].numpy().astype(np.float32).reshape(n, blocks)
    w = (codes - zp[:, :, None]) * scales[:, :, None]
    return np.ascontiguousarray(w.reshape(n, blocks * bs)[:, :k].T)


def int8_rows_twin(drafter: ir.Model, *, reduce_range: bool | None = None) -> ir.Model | None:
    """A copy of ``drafter`` whose ``MatMulNBits`` are per-token int8 products (``None``: it has none it can take).

    Each weight: dequantized (:func:`dequantize_matmulnbits`), then int8 per output column, and each activation
    quantized per row (:func:`~dyncompile.passes.quantize_weights.quantize_per_token`, one
    ``MatMulIntegerToFloat`` per product). Per row, not per tensor: one scale for a whole prompt (ONNX Runtime's
    ``DynamicQuantizeMatMul``) lets the outlier rows of Qwen2.5 set the grid of every other row, and the drafts of
    the int4 drafter continuing that cache fell from 3.28 to 2.98 tokens per target call on a code prompt.
    ``reduce_range`` (default: on CPUs whose int8 kernels saturate pairs of products,
    :func:`~dyncompile.runtime.providers.int8_pairs_saturate`) keeps the weight codes in [-64, 64]. The drafter is
    not modified; the copy shares its other tensors (embedding table, norms) by object.
    """
    from dyncompile.passes.quantize_weights import quantize_per_token

    nbits = [n for n in drafter.graph.all_nodes() if n.op_type == "MatMulNBits"]
    if not nbits:
        return None
    if reduce_range is None:
        from dyncompile.runtime.providers import int8_pairs_saturate

        reduce_range = int8_pairs_saturate()
    weights = []
    for node in nbits:
        w = dequantize_matmulnbits(node)
        if w is None:
            logger.info("speculative: no int8 twin for the drafter: %s is not a constant 4/8-bit MatMulNBits without "
                        "act-order", node.name)
            return None
        weights.append(w)
    twin = drafter.clone()  # new graph, nodes and values (in the same order); the tensors are the drafter's own
    targets = []
    for i, node in enumerate([n for n in twin.graph.all_nodes() if n.op_type == "MatMulNBits"]):
        name = f"dyncompile_twin_{i}.weight"
        w = ir.Value(name=name, const_value=ir.tensor(weights[i], name=name))
        w.shape, w.type = w.const_value.shape, ir.TensorType(ir.DataType.FLOAT)
        twin.graph.register_initializer(w)
        ins = list(node.inputs) + [None] * (6 - len(node.inputs))
        mm = ir.node("MatMul", [ins[0], w], name=f"dyncompile_twin_{i}")
        new = [mm]
        if ins[5] is not None:  # bias
            new.append(ir.node("Add", [mm.outputs[0], ins[5]], name=f"dyncompile_twin_{i}.bias"))
        twin.graph.insert_before(node, new)
        old, out = node.outputs[0], new[-1].outputs[0]
        out.shape, out.type = old.shape, old.type
        name, output = old.name, old.is_graph_output()
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        if output:  # keep the graph output's name (the logits)
            old.name, out.name = f"{name}.nbits", name
        twin.graph.remove(node, safe=True)
        targets.append((mm, w))
    quantize_per_token(twin, targets, integer_to_float=True, reduce_range=reduce_range)
    for name in [n for n, v in twin.graph.initializers.items() if not v.uses() and not v.is_graph_output()]:
        twin.graph.initializers.pop(name)
    return twin


def rows_from(drafter_times: dict[int, float], twin_times: dict[int, float]) -> int | None:
    """The fewest rows from which the twin is faster at every measured size (``None``: at none, or not at 1+).

    One-row calls always stay with the drafter (the twin is for calls of many rows).
    """
    sizes = sorted(s for s in drafter_times if s > 1 and s in twin_times)
    start = None
    for s in sizes:
        if twin_times[s] < drafter_times[s]:
            start = s if start is None else start
        else:
            start = None
    return start


def describe(drafter_times: dict[int, float], twin_times: dict[int, float]) -> str:
    """``rows: drafter ms / twin ms`` for each measured size."""
    return ", ".join(f"{s}: {drafter_times[s] * 1e3:.1f} / {twin_times[s] * 1e3:.1f} ms" for s in sorted(drafter_times))


def twin_summary(twin: ir.Model) -> dict[str, Any]:
    """What the twin holds, for the plan's policy."""
    ops: dict[str, int] = {}
    for n in twin.graph.all_nodes():
        if n.op_type in ("MatMulIntegerToFloat", "MatMulInteger", "MatMulNBits", "MatMul"):
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {"format": "int8 weights per output column, activations per row", "ops": ops}
